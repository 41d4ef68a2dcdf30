"""QSFA layout invariances: rope 0 == zero-padded rope 64, BSND == TND == PA_BSND (bit for bit), page
permutations, uniform attention, value not read, no stray reads of unselected cache rows."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import qsfa
from test_attention_support import (BF16, Case, golden_faithful, layout_args, lse_to_logical, random_case,
                                    to_logical)

LAYOUTS = [("BSND", "BSND"), ("TND", "TND"), ("BSND", "PA_BSND"), ("TND", "PA_BSND")]


def run_logical(case, layouts, **kw):
    args = layout_args(case, *layouts, **{k: kw.pop(k) for k in ("block_size", "page_order") if k in kw})
    args.update(return_softmax_lse=True, **kw)
    out, mx, sm = qsfa.kv_quant_sparse_flash_attention(**args)
    lq = layouts[0]
    return to_logical(out, case, lq), lse_to_logical(mx, case, lq), lse_to_logical(sm, case, lq)


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def zero_padded_rope64(case: Case) -> Case:
    q = np.concatenate([case.q, np.zeros(case.q.shape[:-1] + (64,), case.q.dtype)], axis=-1)
    rope = np.zeros(case.codes.shape[:2] + (64,), case.q.dtype)
    return Case(q, case.codes, rope, case.scales, case.idx, case.act_q, case.act_kv, case.key_fmt)


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x))
@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("precision", ["faithful", "exact"])
def test_rope0_bit_identical_to_zero_padded_rope64(layouts, qdtype, precision):
    rng = np.random.default_rng(11)
    case = random_case(rng, rope=0, qdtype=qdtype, act_q=[3, 2], act_kv=[40, 29], kv=40, sparse=24)
    padded = zero_padded_rope64(case)
    assert layout_args(case, *layouts)["key"].shape[-1] == 528
    assert layout_args(padded, *layouts)["key"].shape[-1] == 656
    a = run_logical(case, layouts, precision=precision)
    b = run_logical(padded, layouts, precision=precision)
    for x, y in zip(a, b):
        assert same_bits(x, y)
    assert np.abs(a[0].astype(np.float32)).max() > 0


@pytest.mark.parametrize("rope", [0, 64])
@pytest.mark.parametrize("sbs", [1, 4, 16])
def test_layouts_give_identical_results(rope, sbs):
    rng = np.random.default_rng(12)
    case = random_case(rng, rope=rope, act_q=[3, 1], act_kv=[47, 33], kv=48, sparse=8, sbs=sbs)
    ref = run_logical(case, LAYOUTS[0], sparse_block_size=sbs)
    for layouts in LAYOUTS[1:]:
        got = run_logical(case, layouts, sparse_block_size=sbs)
        for x, y in zip(ref, got):
            assert same_bits(x, y), layouts
    # and a correct answer, not just a consistent one
    g_out, g_max, g_sum = golden_faithful(case, sbs=sbs)
    qsfa.compare.assert_close(ref[0].astype(np.float32), g_out.astype(BF16).astype(np.float32), dtype="bfloat16")


def test_page_permutation_changes_nothing():
    rng = np.random.default_rng(13)
    case = random_case(rng, kv=70, act_kv=[70, 55], sparse=32)
    pages = 2 * 5  # ceil(70 / 16) pages per batch
    base = run_logical(case, ("TND", "PA_BSND"), block_size=16, page_order=np.arange(pages))
    for seed in range(3):
        order = np.random.default_rng(seed).permutation(pages + 1)[:pages]  # also uses the spare page
        got = run_logical(case, ("TND", "PA_BSND"), block_size=16, page_order=order)
        for x, y in zip(base, got):
            assert same_bits(x, y)
    bs32 = run_logical(case, ("TND", "PA_BSND"), block_size=32)
    for x, y in zip(base, bs32):
        assert same_bits(x, y)


@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x))
def test_uniform_attention_is_the_mean_of_selected_values(qdtype, layouts):
    """All scores 0 (q only in column 0, K column 0 zero): out = mean of the selected V, max 0, sum = count.

    The V values are multiples of 1/8 below 2^8 (codes 8..38 times 2^-3..2^0), so every sum of selected V
    is exact in fp32 and the kernel-order result is fp32(sum) / fp32(n) rounded once to the query dtype."""
    rng = np.random.default_rng(14)
    case = random_case(rng, qdtype=qdtype, act_q=[3, 2], act_kv=[61, 40], kv=64, sparse=48)
    b, kv = case.codes.shape[:2]
    case.codes[:] = (np.arange(b * kv * 512).reshape(b, kv, 512) % 31 + 8).astype(np.int8)
    case.codes[..., 0] = 0
    case.scales[:] = 2.0 ** ((np.arange(b * kv)[:, None] + np.arange(4)[None]) % 4 - 3).reshape(b, kv, 4)
    case.q[:] = 0
    case.q[..., 0] = (np.arange(case.q[..., 0].size).reshape(case.q.shape[:-1]) % 7 + 1)
    case.rope[:] = rng.uniform(-1, 1, case.rope.shape).astype(case.q.dtype) * 0  # zero RoPE keeps scores 0
    out, mx, sm = run_logical(case, layouts)
    v = case.codes.astype(np.float64) * np.repeat(case.scales.astype(np.float64), 128, axis=-1)
    from test_attention_support import round_q, selected_tokens

    for bi in range(b):
        for i in range(case.act_q[bi]):
            toks = selected_tokens(case.idx[bi, i], 1, 3, i, case.act_q[bi], case.act_kv[bi])
            total = v[bi, toks].sum(axis=0)
            assert np.array_equal(total, total.astype(np.float32))  # exact in fp32 by construction
            want = round_q(total.astype(np.float32) / np.float32(len(toks)), qdtype)
            assert np.array_equal(out[bi, i].astype(np.float32), np.broadcast_to(want, out[bi, i].shape))
            assert np.all(mx[bi, i] == 0) and np.all(sm[bi, i] == len(toks))
            # and within one unit in the last place of the float64 mean
            mean = total / len(toks)
            ulp = np.spacing(np.abs(mean).astype(case.q.dtype)).astype(np.float64)
            assert np.all(np.abs(out[bi, i].astype(np.float64) - mean) <= ulp)


def test_value_is_not_read():
    rng = np.random.default_rng(15)
    case = random_case(rng, kv=30, sparse=12)
    args = layout_args(case)
    ref = qsfa.kv_quant_sparse_flash_attention(**args)[0]
    garbage = np.full(args["key"].shape[:-1] + (512,), -1, np.int8)  # a 512-wide NoPE value of the key's dtype
    got = qsfa.kv_quant_sparse_flash_attention(**{**args, "value": garbage})[0]
    assert same_bits(ref, got)


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x))
def test_unselected_rows_are_never_read(layouts):
    """Poison every cache row no query selects (0xFF bytes: NaN scales and RoPE): nothing changes."""
    rng = np.random.default_rng(16)
    case = random_case(rng, kv=40, act_kv=[40, 25], sparse=10)
    base = run_logical(case, layouts)
    from test_attention_support import selected_tokens

    used = np.zeros(case.codes.shape[:2], bool)
    for b in range(2):
        for i in range(case.act_q[b]):
            used[b, selected_tokens(case.idx[b, i], 1, 3, i, case.act_q[b], case.act_kv[b])] = True
    rows = case.rows()
    rows[~used] = 0xFF
    args = layout_args(case, *layouts, rows=rows)
    args.update(return_softmax_lse=True)
    out, mx, sm = qsfa.kv_quant_sparse_flash_attention(**args)
    got = to_logical(out, case, layouts[0]), lse_to_logical(mx, case, layouts[0]), lse_to_logical(sm, case, layouts[0])
    for x, y in zip(base, got):
        assert same_bits(x, y)
    assert np.isfinite(got[0].astype(np.float32)).all()


def test_torch_in_torch_out_same_bits():
    torch = pytest.importorskip("torch")
    from qsfa._arrays import to_numpy, to_torch

    rng = np.random.default_rng(17)
    case = random_case(rng, kv=20, sparse=8)
    args = layout_args(case, "TND", "PA_BSND")
    args["return_softmax_lse"] = True
    ref = qsfa.kv_quant_sparse_flash_attention(**args)
    targs = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    got = qsfa.kv_quant_sparse_flash_attention(**targs)
    assert all(isinstance(g, torch.Tensor) for g in got)
    assert got[0].dtype == torch.bfloat16
    for x, y in zip(ref, got):
        assert same_bits(x, to_numpy(y))


@given(data=st.data())
def test_random_layout_equivalence_and_golden(data):
    """Hypothesis: random lengths / sbs / modes / block sizes; every layout agrees bit for bit and matches
    the per-row golden within the docs/numerics/comparison.md#float-criterion tolerances."""
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    batch = data.draw(st.integers(1, 2))
    q_s = data.draw(st.integers(1, 3))
    sbs = data.draw(st.sampled_from([1, 2, 4, 8, 16]))
    kv = data.draw(st.integers(1, 48))
    act_kv = [data.draw(st.integers(0, kv)) for _ in range(batch)]
    act_q = [data.draw(st.integers(0, q_s)) for _ in range(batch)]
    sparse = data.draw(st.integers(1, max(1, -(-kv // sbs))))
    mode = data.draw(st.sampled_from([0, 3]))
    rope = data.draw(st.sampled_from([0, 64]))
    qdtype = data.draw(st.sampled_from(["bfloat16", "float16"]))
    case = random_case(rng, batch=batch, q_s=q_s, heads=2, kv=kv, sparse=sparse, rope=rope, qdtype=qdtype,
                       act_q=act_q, act_kv=act_kv, sbs=sbs)
    if data.draw(st.booleans()):  # a -1 somewhere in the middle of some rows
        case.idx[..., sparse // 2] = -1
    block = data.draw(st.sampled_from([16, 32]))
    ref = None
    for layouts in LAYOUTS:
        if (layouts[0] == "TND" and sum(act_q) == 0) or (layouts[1] == "TND" and sum(act_kv) == 0):
            continue  # an empty TND tensor is rejected by the contract (torch_npu: "should not be empty")
        got = run_logical(case, layouts, sparse_block_size=sbs, sparse_mode=mode, block_size=block)
        if ref is None:
            ref = got
        else:
            for x, y in zip(ref, got):
                assert same_bits(x, y), layouts
    g_out, g_max, g_sum = golden_faithful(case, sbs=sbs, sparse_mode=mode)
    dt = ml_dtypes.bfloat16 if qdtype == "bfloat16" else np.float16
    qsfa.compare.assert_close(ref[0].astype(np.float32), g_out.astype(dt).astype(np.float32), dtype=qdtype)
    qsfa.compare.assert_close(ref[1], g_max, dtype="float32")
    qsfa.compare.assert_close(ref[2], g_sum, dtype="float32")


@pytest.mark.parametrize("shared", [True, False], ids=["prefill-like shared rows", "decode-like distinct rows"])
def test_shared_and_distinct_rows_paths_agree_with_golden(shared):
    """Chunks whose rows share most tokens (prefill) dequantise each cache row once and gather; chunks of
    distinct rows (decode) dequantise every gathered row. Both must give the golden, and never read a row
    nobody selected (tokens 30.. are poisoned with 0xFF bytes in the shared case)."""
    rng = np.random.default_rng(18)
    q_s = 16 if shared else 2
    case = random_case(rng, batch=1, q_s=q_s, heads=4, kv=40 if shared else 400, sparse=24, act_kv=None)
    if shared:
        case.idx[:] = np.stack([rng.permutation(30)[:24] for _ in range(q_s)])[None].astype(np.int32)
        case.act_q = [q_s]
        case.act_kv = [40]
    rows = case.rows()
    if shared:
        rows[:, 30:] = 0xFF
    args = layout_args(case, rows=rows)
    args.update(return_softmax_lse=True)
    out, mx, sm = qsfa.kv_quant_sparse_flash_attention(**args)
    assert np.isfinite(out.astype(np.float32)).all()
    g_out, g_max, g_sum = golden_faithful(case)
    qsfa.compare.assert_close(out.astype(np.float32), g_out.astype(BF16).astype(np.float32), dtype="bfloat16")
    qsfa.compare.assert_close(mx[:, 0], g_max, dtype="float32")
