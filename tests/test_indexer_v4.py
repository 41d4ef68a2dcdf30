"""vllm_quant_lightning_indexer (V4, compressed keys) against a plain per-row model written here."""

import math

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa._errors import InvalidArgument, InvalidDtype
from qsfa.compare import compare_topk
from qsfa.ops.indexer_v4 import vqli_case
from qsfa.reference.indexer_v4 import bf16_round_away


def _f16(x):
    return float(np.float16(x))


def _f32(x):
    return float(np.float32(x))


def _bf16_away(x):
    """bfloat16 rounding of a float32 value, ties away from zero, by hand (nearest of the two candidates)."""
    x = _f32(x)
    if x == 0:
        return x
    e = math.floor(math.log2(abs(x)))
    ulp = 2.0 ** (e - 7)
    lo = math.floor(abs(x) / ulp) * ulp
    r = lo + ulp if abs(x) - lo >= ulp / 2 else lo
    return math.copysign(r, x)


def _plain(args):
    """Indices by the definition: per row, per visible compressed token, a score with the kernel's rounding
    points (int8: fp16 DEQF16 of ReLU(dot)/1024 and fp16 w*sq; FP8: fp32 and a bf16 sort key)."""
    q, key, w, sq, sk = (args[k] for k in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale"))
    int8 = q.dtype == np.int8
    cmp, k_out, bt = args["cmp_ratio"], args["sparse_count"], args["block_table"]
    bs = key.shape[1]
    lk = [int(v) for v in args["actual_seq_lengths_key"]]
    if args["layout_query"] == "BSND":
        b_n, s1 = q.shape[:2]
        given = args.get("actual_seq_lengths_query")
        lq = [s1] * b_n if given is None else [int(v) for v in given]
        rows = [(b, p, (b, p), p < lq[b]) for b in range(b_n) for p in range(s1)]
    else:
        ends = [int(v) for v in args["actual_seq_lengths_query"]]
        lq = [e - s for s, e in zip([0] + ends[:-1], ends)]
        rows, start = [], 0
        for b, e in enumerate(ends):
            rows += [(b, t - start, (t,), True) for t in range(start, e)]
            start = e
        rows += [(0, 0, (t,), False) for t in range(start, q.shape[0])]
    out = np.full(q.shape[:-2] + (1, k_out), -1, np.int32)
    for b, p, at, valid in rows:
        if not valid:
            continue
        num = lk[b] - lq[b] + p + 1 if args["sparse_mode"] == 3 else lk[b]
        n = min(num // cmp if num > 0 else 0, lk[b] // cmp)
        scores = []
        for j in range(n):
            blk, off = bt[b, j // bs], j % bs
            kj = key[blk, off, 0].astype(np.float64)
            terms = []
            for h in range(q.shape[-2]):
                dot = float(np.dot(q[at][h].astype(np.float64), kj))
                if int8:
                    t = _f16(max(dot, 0.0) / 1024)
                    u = _f16(np.float16(w[at][h]) * np.float16(sq[at][h]))
                    terms.append(u * t)
                else:
                    u = _f32(np.float32(w[at][h]) * np.float32(sq[at][h]))
                    terms.append(_f32(u * max(_f32(dot), 0.0)))
            s = _f32(_f32(math.fsum(terms)) * _f32(sk[blk, off, 0]))
            scores.append(s if int8 else _bf16_away(s))
        order = sorted(range(n), key=lambda j: (-scores[j], j))[:k_out]
        out[at][0, :len(order)] = order
    return out


def _run(args, **kw):
    a = dict(args)
    q, k, w, sq, sk = (a.pop(x) for x in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale"))
    a.update(kw)
    return qsfa.vllm_quant_lightning_indexer(q, k, w, sq, sk, **a)


CASES = [
    dict(cmp_ratio=4, kv_s=6, q_s=3),
    dict(cmp_ratio=4, kv_s=6, q_s=3, layout_query="TND"),
    dict(cmp_ratio=128, kv_s=3, q_s=2, fmt="float8_e4m3fn"),
    dict(cmp_ratio=1, kv_s=9, q_s=4, sparse_count=5),
    dict(cmp_ratio=4, kv_s=5, q_s=2, act_kv_orig=[13, 20], block_size=32),  # 13 // 4 = 3 compressed tokens
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("sparse_mode", [3, 0])
def test_matches_plain_model(case, sparse_mode):
    args = vqli_case(**case)
    args["sparse_mode"] = sparse_mode
    idx, val = _run(args)
    assert idx.dtype == np.int32 and val.shape == (0,) and val.dtype == np.float32
    want = _plain(args)
    assert idx.shape == want.shape
    np.testing.assert_array_equal(idx, want)


def test_causal_visibility_counts_original_tokens():
    # actKV 10 original tokens, 3 query rows, cmp 4: rows see (10 - 3 + p + 1) // 4 = 2, 2, 2 -> then capped by 10//4
    args = vqli_case(cmp_ratio=4, kv_s=4, q_s=3, act_kv_orig=[10, 16], sparse_count=8)
    idx, _ = _run(args)
    assert [(idx[0, p, 0] >= 0).sum() for p in range(3)] == [2, 2, 2]
    # batch 1: (16 - 3 + p + 1) // 4 = 3, 3, 4
    assert [(idx[1, p, 0] >= 0).sum() for p in range(3)] == [3, 3, 4]


def test_a_query_that_sees_no_compressed_token_is_all_minus_one():
    args = vqli_case(cmp_ratio=128, kv_s=2, q_s=2, act_kv_orig=[127, 256], fmt="float8_e4m3fn")
    idx, _ = _run(args)
    assert (idx[0] == -1).all()  # 127 // 128 = 0 compressed tokens
    assert (idx[1, 0, 0] >= 0).sum() == 1 and (idx[1, 1, 0] >= 0).sum() == 2  # (256 - 2 + p + 1) // 128


def test_ties_at_the_kth_score_keep_increasing_token_order():
    args = vqli_case(cmp_ratio=4, kv_s=6, q_s=1, sparse_count=3)
    key = args["key"].copy()
    bt = args["block_table"]
    for b in range(2):  # every compressed token of a batch gets the same codes and scale: all scores tie
        first = key[bt[b, 0], 0].copy()
        for j in range(6):
            key[bt[b, j // 16], j % 16] = first
        args["key_dequant_scale"][bt[b, 0], :6] = args["key_dequant_scale"][bt[b, 0], 0]
    args["key"] = key
    idx, _ = _run(args)
    np.testing.assert_array_equal(idx[:, 0, 0], [[0, 1, 2], [0, 1, 2]])
    # a different tie order is still fair by the score criterion
    shuffled = idx.copy()
    shuffled[:, 0, 0] = [[5, 3, 4], [4, 5, 0]]
    scores = np.zeros((2, 6), np.float32)
    res = compare_topk(idx.reshape(2, 3), shuffled.reshape(2, 3), scores)
    assert res.passed and res.topk["exact_rows"] == 0 and res.topk["tie_rows"] == 2


def test_shape_invariance_slices_of_the_query_rows():
    """vLLM-Ascend #15053: the indexer over all query rows equals the indexer over slices of them (a slice of
    rows [a, b) of a batch is the same request with actQ' = b - a and actKV' = actKV - actQ + b)."""
    args = vqli_case(cmp_ratio=4, kv_s=8, q_s=5, act_kv_orig=[29, 32], sparse_count=4, block_size=16)
    full, _ = _run(args)
    for a, b in ((0, 2), (2, 5), (4, 5)):
        part = dict(args)
        for name in ("query", "weights", "query_dequant_scale"):
            part[name] = np.ascontiguousarray(args[name][:, a:b])
        part["actual_seq_lengths_query"] = np.full(2, b - a, np.int32)
        part["actual_seq_lengths_key"] = (args["actual_seq_lengths_key"] - 5 + b).astype(np.int32)
        got, _ = _run(part)
        np.testing.assert_array_equal(got, full[:, a:b])


def test_batch_invariance_a_request_alone_equals_inside_an_uneven_batch():
    args = vqli_case(cmp_ratio=4, kv_s=6, q_s=3, layout_query="TND", act_kv_orig=[24, 17], sparse_count=4)
    args["actual_seq_lengths_query"] = np.array([1, 3], np.int32)  # uneven: 1 row and 2 rows (of 6)
    full, _ = _run(args)
    alone = dict(args)
    for name in ("query", "weights", "query_dequant_scale"):
        alone[name] = np.ascontiguousarray(args[name][1:3])
    alone["actual_seq_lengths_query"] = np.array([2], np.int32)
    alone["actual_seq_lengths_key"] = args["actual_seq_lengths_key"][1:]
    alone["block_table"] = np.ascontiguousarray(args["block_table"][1:])
    got, _ = _run(alone)
    np.testing.assert_array_equal(got, full[1:3])
    assert (full[3:] == -1).all()  # TND rows past the last prefix sum


def test_metadata_is_ignored_by_the_reference():
    args = vqli_case()
    base, _ = _run(args)
    got, _ = _run(args, metadata=np.arange(1024, dtype=np.int32))
    np.testing.assert_array_equal(got, base)


def test_bf16_round_away_ties_away_from_zero():
    x = np.array([1 + 2 ** -8, -(1 + 2 ** -8), 1 + 3 * 2 ** -8, 1 + 2 ** -9, 3.0], np.float32)
    got = bf16_round_away(x)
    np.testing.assert_array_equal(got, np.array([1 + 2 ** -7, -(1 + 2 ** -7), 1 + 2 ** -6, 1.0, 3.0], np.float32))
    # RNE would round the first tie down: the two rules differ here
    assert float(x[0].astype(ml_dtypes.bfloat16)) == 1.0


@pytest.mark.parametrize("chip,change,cid", [
    ("950", dict(cmp_ratio=8), "950_cmp_ratio"),
    ("A3", dict(fmt="float8_e4m3fn"), "a2a3_dtypes"),
])
def test_chip_rules(chip, change, cid):
    fmt = change.pop("fmt", "float8_e4m3fn" if chip == "950" else "int8")
    args = vqli_case(fmt=fmt)
    args.update(change)
    with pytest.raises((InvalidArgument, InvalidDtype)) as ei:
        _run(args, chip=chip)
    assert ei.value.constraint_id == f"vllm_quant_lightning_indexer.{cid}"


@pytest.fixture(scope="module")
def vqli_set(tmp_path_factory):
    from qsfa.cli import main

    out = tmp_path_factory.mktemp("vqli") / "set"
    assert main(["golden", "generate", "--set", "vllm-quant-lightning-indexer", "--out", str(out), "-q"]) == 0
    return out


def test_golden_set_files_match_the_plain_model(vqli_set):
    """The catalogue's vllm-quant-lightning-indexer set, read back with NumPy and the manifest only."""
    import os

    from qsfa.golden import load_manifest

    out = vqli_set
    man = load_manifest(out)
    assert not man["skipped"] and len(man["cases"]) == 5
    starved = 0
    for case in man["cases"]:
        arr = {}
        for e in case["arrays"]:
            a = np.fromfile(os.path.join(out, e["file"]), dtype=e["storage"]).reshape(e["shape"])
            if e["dtype"] == "float8_e4m3fn":
                a = a.view(ml_dtypes.float8_e4m3fn)
            arr[(e["role"], e["name"])] = a
        p = case["params"]
        args = {n: v for (role, n), v in arr.items() if role == "input"}
        args.update(cmp_ratio=p["cmp_ratio"], sparse_count=p["sparse_count"], sparse_mode=3,
                    layout_query=p.get("layout_query", "BSND"))
        got = arr[("output", "sparse_indices")]
        np.testing.assert_array_equal(got, _plain(args), err_msg=case["name"])
        assert (got >= 0).any(), case["name"]
        starved += int((got == -1).all(axis=-1).sum())
    assert starved >= 2  # the c4 decode and c128 cases hold requests that see no compressed token


def test_a_dump_without_the_outputs_a_call_does_not_produce_is_complete(vqli_set, tmp_path, capsys):
    """return_value=False: the golden stores sparse_values with no elements; a device dump holds only the indices.
    Leaving the indices out is still an error, and so is a non-empty file where the golden has no elements."""
    import os

    from qsfa.cli import main
    from qsfa.golden import load_manifest

    man = load_manifest(vqli_set)
    dump = tmp_path / "dump"
    for case in man["cases"]:
        (dump / case["name"]).mkdir(parents=True)
        for e in case["arrays"]:
            if e["role"] == "output" and e["name"] == "sparse_indices":
                a = np.fromfile(os.path.join(vqli_set, e["file"]), dtype=e["storage"]).reshape(e["shape"])
                np.save(dump / case["name"] / "out.sparse_indices.npy", a)
    assert main(["golden", "compare", str(vqli_set), "--actual", str(dump)]) == 0
    assert "not produced" in capsys.readouterr().out
    first = man["cases"][0]["name"]
    np.save(dump / first / "out.sparse_values.npy", np.zeros(3, np.float32))
    assert main(["golden", "compare", str(vqli_set), "--actual", str(dump)]) == 2
    os.remove(dump / first / "out.sparse_values.npy")
    os.remove(dump / first / "out.sparse_indices.npy")
    assert main(["golden", "compare", str(vqli_set), "--actual", str(dump)]) == 2
    assert "out.sparse_indices" in capsys.readouterr().err
