"""quant_lightning_indexer_v2 (ops-transformer QLI v2) against a plain per-row model written here, and against
vllm_quant_lightning_indexer, which computes the same thing under other names (one reference, two front doors)."""

import math

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa._errors import InvalidArgument, InvalidDtype
from qsfa.ops.indexer_v4 import vqli_case
from qsfa.ops.quant_lightning_indexer_v2 import qli2_case
from qsfa.reference.formats import decode
from qsfa.reference.indexer_v4 import _dots


def _f16(x):
    return float(np.float16(x))


def _f32(x):
    return float(np.float32(x))


def _bf16_away(x):
    x = _f32(x)
    if x == 0:
        return x
    ulp = 2.0 ** (math.floor(math.log2(abs(x))) - 7)
    lo = math.floor(abs(x) / ulp) * ulp
    return math.copysign(lo + ulp if abs(x) - lo >= ulp / 2 else lo, x)


def _values(codes, mode):
    if mode == 4:
        return np.asarray(decode(codes.view(np.uint8), "hifloat8"), np.float64)
    return codes.astype(np.float64)


def _plain(a, exact=False):
    """Indices by the definition, row by row: the compressed length S2 from seqused_k / cu_seqlens_k, the original
    length S2 * cmp + residual, the causal count, and the score with the kernel's rounding points per quant_mode
    (2: fp16 DEQF16 of ReLU(dot)/1024 and fp16 w*sq; 1 / 4: fp32 and a bf16 sort key, ties away) or none (exact)."""
    q, key, w, sq, sk = (a[k] for k in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale"))
    mode, cmp, k_out = a["quant_mode"], a["cmp_ratio"], a["topk"]
    if a["layout_q"] == "BSND":
        b_n, s1 = q.shape[:2]
        lq = [s1] * b_n if a["seqused_q"] is None else [int(v) for v in a["seqused_q"]]
        rows = [(b, p, (b, p), p < lq[b]) for b in range(b_n) for p in range(s1)]
    else:
        cu = [int(v) for v in a["cu_seqlens_q"]]
        b_n = len(cu) - 1
        lq = [cu[i + 1] - cu[i] for i in range(b_n)]
        rows = [(b, t - cu[b], (t,), True) for b in range(b_n) for t in range(cu[b], cu[b + 1])]
    if a["layout_k"] == "TND":
        ck = [int(v) for v in a["cu_seqlens_k"]]
        s2 = [ck[i + 1] - ck[i] for i in range(b_n)]
        where = lambda b, j: (ck[b] + j,)  # noqa: E731
    elif a["layout_k"] == "BSND":
        s2 = [key.shape[1]] * b_n if a["seqused_k"] is None else [int(v) for v in a["seqused_k"]]
        where = lambda b, j: (b, j)  # noqa: E731
    else:
        s2 = [int(v) for v in a["seqused_k"]]
        bs = key.shape[1]
        where = lambda b, j: (a["block_table"][b, j // bs], j % bs)  # noqa: E731
    res = [0] * b_n if a["cmp_residual_k"] is None else [int(v) for v in a["cmp_residual_k"]]
    out = np.full(q.shape[:-2] + (1, k_out), -1, np.int32)
    for b, p, at, valid in rows:
        if not valid:
            continue
        num = s2[b] * cmp + res[b] - lq[b] + p + 1
        n = min(num // cmp if num > 0 else 0, s2[b]) if a["mask_mode"] == 3 else s2[b]
        scores = []
        for j in range(n):
            kj = _values(key[where(b, j)][0], mode)
            skj = float(sk[0] if mode == 4 else sk[where(b, j)][0])
            terms = []
            for h in range(q.shape[-2]):
                dot = math.fsum(_values(q[at][h], mode) * kj)
                sqh = float(sq[0] if mode == 4 else sq[at][h])
                if exact:
                    terms.append(float(w[at][h]) * sqh * max(dot, 0.0))
                elif mode == 2:
                    terms.append(_f16(np.float16(w[at][h]) * np.float16(sqh)) * _f16(max(dot, 0.0) / 1024))
                else:
                    terms.append(_f32(_f32(np.float32(w[at][h]) * np.float32(sqh)) * max(_f32(dot), 0.0)))
            s = math.fsum(terms) * skj if exact else _f32(_f32(math.fsum(terms)) * _f32(skj))
            scores.append(s if exact or mode == 2 else _bf16_away(s))
        order = sorted(range(n), key=lambda j: (-scores[j], j))[:k_out]
        out[at][0, :len(order)] = order
    return out


def _run(a, **kw):
    a = {**a, **kw}
    pos = [a.pop(x) for x in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale", "topk",
                              "quant_mode")]
    return qsfa.quant_lightning_indexer_v2(*pos, **a)


CASES = [
    dict(),
    dict(layout_q="TND", q_s=3),
    dict(fmt="float8_e4m3fn", cmp_ratio=128, kv_s=3, residual=100),
    dict(fmt="float8_e4m3fn", layout_q="BSND", layout_k="BSND", kv_s=5, residual=3),
    dict(fmt="float8_e4m3fn", layout_q="TND", layout_k="TND", q_s=3, kv_s=4, residual=0),
    dict(fmt="hifloat8", cmp_ratio=4, kv_s=5, residual=2, topk=6),
    dict(fmt="hifloat8", layout_q="TND", layout_k="TND", q_s=2, kv_s=3, cmp_ratio=1, topk=3),
    dict(cmp_ratio=1, kv_s=9, q_s=4, topk=5),
    dict(mask_mode=0, kv_s=5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_matches_plain_model(case):
    a = qli2_case(**case)
    idx, val = _run(a)
    assert idx.dtype == np.int32 and val.shape == (0,) and val.dtype == ml_dtypes.bfloat16
    want = _plain(a)
    assert idx.shape == want.shape
    np.testing.assert_array_equal(idx, want)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn", "hifloat8"])
def test_exact_precision_ranks_the_float64_scores(fmt):
    a = qli2_case(fmt=fmt, kv_s=7, q_s=3, topk=7, residual=3)
    idx, _ = _run(a, precision="exact")
    np.testing.assert_array_equal(idx, _plain(a, exact=True))


def test_causal_count_uses_the_residual():
    # S2 = 4 compressed tokens, 3 rows, cmp 4: original length 16 + r; rows see min((16 + r - 3 + p + 1) // 4, 4)
    a = qli2_case(kv_s=4, q_s=3, topk=8, residual=0)
    for r, want in ((0, [3, 3, 4]), (1, [3, 4, 4]), (3, [4, 4, 4])):
        a["cmp_residual_k"] = np.full(2, r, np.int32)
        idx, _ = _run(a)
        assert [int((idx[0, p, 0] >= 0).sum()) for p in range(3)] == want, r


@pytest.mark.parametrize("fmt,cmp", [("int8", 4), ("int8", 16), ("float8_e4m3fn", 128), ("int8", 1)])
@pytest.mark.parametrize("mode", [3, 0])
def test_same_indices_as_vllm_quant_lightning_indexer(fmt, cmp, mode):
    """One computation, two front doors: seqused_k compressed tokens plus cmp_residual_k original ones equal
    vLLM-Ascend's actual_seq_lengths_key = seqused_k * cmp_ratio + cmp_residual_k original tokens."""
    v = vqli_case(fmt=fmt, cmp_ratio=cmp, kv_s=7, q_s=3, act_kv_orig=[7 * cmp + cmp // 2, 5 * cmp], sparse_count=6,
                  seed=3)
    v["sparse_mode"] = mode
    pos = [v.pop(k) for k in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale")]
    want, _ = qsfa.vllm_quant_lightning_indexer(*pos, **v)
    v = vqli_case(fmt=fmt, cmp_ratio=cmp, kv_s=7, q_s=3, sparse_count=6, seed=3)
    lens = np.array([7 * cmp + cmp // 2, 5 * cmp])
    res = lens % cmp if (cmp != 1 and mode == 3) else None
    got, _ = qsfa.quant_lightning_indexer_v2(
        v["query"], v["key"], v["weights"], v["query_dequant_scale"], v["key_dequant_scale"], 6,
        2 if fmt == "int8" else 1, seqused_k=(lens // cmp).astype(np.int32),
        cmp_residual_k=None if res is None else res.astype(np.int32), block_table=v["block_table"],
        layout_q="BSND", layout_k="PA_BBND", mask_mode=mode, cmp_ratio=cmp)
    assert (want >= 0).sum() > 0
    np.testing.assert_array_equal(got, want)


def test_key_layouts_agree():
    """The same compressed tokens stored paged, batch-continuous (BSND) and packed (TND) give the same indices."""
    pa = qli2_case(fmt="float8_e4m3fn", layout_q="TND", layout_k="PA_BBND", kv_s=6, q_s=2, residual=1, seed=5)
    tnd = qli2_case(fmt="float8_e4m3fn", layout_q="TND", layout_k="TND", kv_s=6, q_s=2, residual=1, seed=5)
    bs = pa["key"].shape[1]
    flat_rows = [pa["block_table"][b, j // bs] * bs + j % bs for b in range(2) for j in range(6)]
    tnd["key"] = pa["key"].reshape(-1, 1, 128)[flat_rows]
    tnd["key_dequant_scale"] = pa["key_dequant_scale"].reshape(-1, 1)[flat_rows]
    i_pa, _ = _run(pa)
    i_tnd, _ = _run(tnd)
    np.testing.assert_array_equal(i_pa, i_tnd)
    assert (i_pa >= 0).sum() > 0


def test_hifloat8_dot_is_rounded_once_to_fp32_even_where_float64_cannot_sum_it():
    """HiFloat8 products span 2^75: 2^15 * 2^15 plus a few 2^-22 * 2^-22 terms is not exact in float64; the dot
    must be RN32 of the exact sum (here 2^30 exactly, the tiny terms far below half an fp32 ulp)."""
    from qsfa.reference.formats import encode

    vals = np.zeros(128, np.float32)
    vals[0] = 2.0 ** 15
    vals[1:5] = 2.0 ** -22
    codes = np.asarray(encode(vals, "hifloat8"), np.uint8)
    assert np.array_equal(np.asarray(decode(codes, "hifloat8"), np.float32), vals)
    d = _dots(codes.reshape(1, 1, 128), codes.reshape(1, 128), "hifloat8")
    assert d.shape == (1, 1, 1) and d[0, 0, 0] == _f32(math.fsum(vals.astype(np.float64) ** 2)) == 2.0 ** 30
    # and a case where the tiny terms decide a tie: 2^30 + 2^-44 * k rounds up only through the sticky bits
    vals2 = np.zeros(128, np.float32)
    vals2[0] = 2.0 ** 15
    vals2[1] = 2.0 ** 3  # 2^6: exactly half an fp32 ulp of 2^30 is 2^6 -> a tie, to even (down)
    vals2[2:6] = 2.0 ** -22  # + tiny: now above the tie -> rounds up
    c2 = np.asarray(encode(vals2, "hifloat8"), np.uint8)
    sq64 = np.asarray(decode(c2, "hifloat8"), np.float64) ** 2
    assert _f32(math.fsum(sq64)) == 2.0 ** 30  # float64 loses the tiny terms: a tie, rounded to even (down)
    d2 = _dots(c2.reshape(1, 1, 128), c2.reshape(1, 128), "hifloat8")[0, 0, 0]
    assert d2 == 2.0 ** 30 + 2.0 ** 7


def test_bad_input_is_named():
    a = qli2_case()
    a["cmp_residual_k"] = None
    with pytest.raises(InvalidArgument) as ei:
        _run(a)
    assert ei.value.constraint_id == "quant_lightning_indexer_v2.cmp_residual_k_presence"
    assert str(ei.value).startswith("Invalid value for cmp_residual_k, actual: None, reason: is required when")
    with pytest.raises(InvalidArgument) as ei:
        _run(qli2_case(fmt="float8_e4m3fn", cmp_ratio=8), chip="950")
    assert ei.value.constraint_id == "quant_lightning_indexer_v2.950_cmp_ratio"
    with pytest.raises(InvalidDtype) as ei:
        _run(qli2_case(), quant_mode=1)
    assert ei.value.constraint_id == "quant_lightning_indexer_v2.query_dtype_for_quant_mode"
    with pytest.raises(InvalidArgument) as ei:
        _run(qli2_case(), chip="A3", layout_k="BSND", block_table=None, seqused_k=None,
             key=np.zeros((2, 6, 1, 128), np.int8), key_dequant_scale=np.ones((2, 6, 1), np.float16))
    assert ei.value.constraint_id == "quant_lightning_indexer_v2.a2a3_layout_k"


def test_golden_set_files_match_the_plain_model(tmp_path):
    """The catalogue's quant-lightning-indexer-v2 set, read back with NumPy and the manifest only."""
    import os

    from qsfa.cli import main
    from qsfa.golden import load_manifest

    out = tmp_path / "qli2"
    assert main(["golden", "generate", "--set", "quant-lightning-indexer-v2", "--out", str(out), "-q"]) == 0
    man = load_manifest(out)
    assert not man["skipped"] and len(man["cases"]) == 5
    modes = set()
    for case in man["cases"]:
        arr = {}
        for e in case["arrays"]:
            a = np.fromfile(os.path.join(out, e["file"]), dtype=e["storage"]).reshape(e["shape"])
            if e["dtype"] == "float8_e4m3fn":
                a = a.view(ml_dtypes.float8_e4m3fn)
            arr[(e["role"], e["name"])] = a
        p = case["params"]
        args = dict(cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, cmp_residual_k=None,
                    block_table=None)
        args.update({n: v for (role, n), v in arr.items() if role == "input"})
        args.update({k: p[k] for k in ("topk", "quant_mode", "layout_q", "layout_k", "mask_mode", "cmp_ratio")})
        got = arr[("output", "sparse_indices")]
        np.testing.assert_array_equal(got, _plain(args), err_msg=case["name"])
        assert (got >= 0).any(), case["name"]
        modes.add(p["quant_mode"])
    assert modes == {1, 2, 4}


def test_compare_topk_is_fair_to_ties_with_the_reference_scores():
    """A device that breaks ties of the 950's bfloat16 sort key another way passes the top-k criterion (reported as
    tie-tolerant, not exact); one that swaps in a clearly lower-scoring token fails it."""
    from qsfa.compare import compare_topk
    from qsfa.reference.indexer_v4 import quant_lightning_indexer_v2_scores

    a = qli2_case(fmt="float8_e4m3fn", kv_s=12, q_s=1, topk=4, cmp_ratio=1, mask_mode=0)
    a["key"][:] = np.float32(0.5)  # every token alike, scale included: all scores of a row tie, none zero
    a["key_dequant_scale"][:] = np.float32(0.05)
    gold, _ = _run(a)
    scores = quant_lightning_indexer_v2_scores(**a)
    assert scores.shape == gold.shape[:-1] + (12,) and (scores != 0).all() and (scores == scores[..., :1]).all()
    device = gold.copy()
    device[..., -1] = 11  # another of the tied tokens
    r = compare_topk(device, gold, scores)
    assert r.passed and r.topk["tie_rows"] > 0 and device.tobytes() != gold.tobytes()
    b = qli2_case(fmt="float8_e4m3fn", kv_s=12, q_s=1, topk=4, cmp_ratio=1, mask_mode=0)
    gold_b, _ = _run(b)
    sc_b = quant_lightning_indexer_v2_scores(**b)
    worst = int(np.argmin(sc_b[0, 0, 0]))
    assert worst not in gold_b[0, 0, 0]
    bad = gold_b.copy()
    bad[0, 0, 0, -1] = worst
    assert not compare_topk(bad, gold_b, sc_b).passed
