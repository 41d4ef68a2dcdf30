"""The "triton" backend through the public API, against the reference backend (docs/numerics/comparison.md#float-criterion).

* ``c8_cache_write``: byte for byte (``assert_bytes_equal``), NumPy and torch callers, int8 and FP8 caches,
  both OPEN scale orders, sentinel-filled caches with -1 slots.
* ``kv_quant_sparse_flash_attention``: ``compare_float`` (docs/numerics/comparison.md#float-criterion tolerances) on the attention output
  and, when requested, softmax_max / softmax_sum; every layout, sparse_block_size, rope 0/64, fp16/bf16,
  int8/FP8 NoPE, empty rows, both OPEN probability_rounding choices; a deliberately broken kernel
  variant must fail the same check.
* the kernel limits of qsfa.triton_backend: each one fires (UnsupportedByBackend) on a call the operator
  contract accepts.

``check_c8_cache_write(args, backend)`` and ``check_attention(args, backend)`` are the reusable
comparisons (argument dicts use the public parameter names).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from _triton_env import prepare

_, DEV_IS_CPU = prepare(__name__)  # before triton is imported: tests/_triton_env.py
import torch  # noqa: E402

import ml_dtypes  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

import qsfa  # noqa: E402
from qsfa import UnsupportedByBackend  # noqa: E402
from qsfa._arrays import to_numpy, to_torch  # noqa: E402
from qsfa._contract import copy_args  # noqa: E402
from qsfa._dispatch import operator  # noqa: E402
from qsfa.compare import assert_bytes_equal, compare_float  # noqa: E402
from qsfa.ops.attention import qsfa_case  # noqa: E402

from test_triton_kernels import LAYOUTS, c8_cases, make_attention_case, naive_qsfa  # noqa: E402

pytestmark = pytest.mark.triton
BF16 = np.dtype(ml_dtypes.bfloat16)
C8 = "c8_cache_write"
QSFA = "kv_quant_sparse_flash_attention"


# ------------------------------------------------------------------------------------------------
# reusable checks

def _copy(args):
    """Independent copies of every array (NumPy or torch) of an argument dict."""
    out = copy_args({k: v for k, v in args.items() if not isinstance(v, torch.Tensor)})
    out.update({k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)})
    return out


def check_c8_cache_write(args, backend="triton"):
    """``qsfa.c8_cache_write(**args, backend=backend)`` writes the same cache bytes as the reference.

    ``args`` are public parameters (NumPy arrays or CPU torch tensors); neither input is modified.
    Returns the backend's cache (NumPy)."""
    want_args, got_args = _copy(args), _copy(args)
    qsfa.c8_cache_write(**want_args, backend="reference")
    ret = qsfa.c8_cache_write(**got_args, backend=backend)
    assert ret is got_args["kv_cache"], "the operator returns the caller's buffer, updated in place"
    got = to_numpy(got_args["kv_cache"]) if isinstance(ret, torch.Tensor) else got_args["kv_cache"]
    want = to_numpy(want_args["kv_cache"]) if isinstance(ret, torch.Tensor) else want_args["kv_cache"]
    assert_bytes_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8), name="kv_cache")
    return got


def check_attention(args, backend="triton"):
    """``qsfa.kv_quant_sparse_flash_attention(**args, backend=backend)`` against the reference backend:
    docs/numerics/comparison.md#float-criterion criterion (``compare_float``) on attention_out and, when requested, on softmax_max /
    softmax_sum (fp32 tolerances); empty LSE outputs when not. Raises AssertionError with the report."""
    got = qsfa.kv_quant_sparse_flash_attention(**args, backend=backend)
    want = qsfa.kv_quant_sparse_flash_attention(**args, backend="reference")
    out, want_out = np.asarray(got[0]), np.asarray(want[0])
    dtype = "bfloat16" if want_out.dtype == BF16 else "float16"
    assert out.dtype == want_out.dtype and out.shape == want_out.shape
    res = compare_float(out, want_out, dtype=dtype, name="attention_out")
    assert res.passed, str(res)
    if args.get("return_softmax_lse"):
        for name, g, w in (("softmax_max", got[1], want[1]), ("softmax_sum", got[2], want[2])):
            r = compare_float(np.asarray(g), np.asarray(w), dtype="float32", name=name)
            assert r.passed, str(r)
    else:
        assert np.asarray(got[1]).shape == (0,) and np.asarray(got[2]).shape == (0,)
    return res


# ------------------------------------------------------------------------------------------------
# registration and limits

def test_triton_backend_is_usable_and_implements_both_operators():
    status = qsfa.backends()["triton"]
    assert status.usable, status.reason
    assert {C8, QSFA} <= set(status.operators)


@pytest.mark.parametrize("op_name", [C8, QSFA])
def test_kernel_limits_fire_on_contract_valid_calls(op_name):
    from qsfa import triton_backend

    op = operator(op_name)
    limits = triton_backend.limits(op_name)
    assert limits  # C8: HiFloat8 NoPE has no kernel; QSFA: precision
    for c in limits:
        bad = c.violate(op.contract.example(np.random.default_rng(0)))
        assert op.contract.first_violation(bad) is None, f"{c.id}: the violating call must pass the contract"
        before = {n: np.asarray(bad[n]).tobytes() for n in op.contract.inplace}
        with pytest.raises(UnsupportedByBackend) as ei:
            qsfa._dispatch.run(op_name, bad, backend="triton")
        assert ei.value.constraint_id == c.id
        assert str(ei.value).startswith("backend 'triton' does not support this call: Invalid ")
        assert {n: np.asarray(bad[n]).tobytes() for n in op.contract.inplace} == before
        assert c.check(op.contract.example(np.random.default_rng(0))) is None  # the example itself runs


# ------------------------------------------------------------------------------------------------
# C8 cache writer

def test_c8_contract_example():
    args = operator(C8).contract.example(np.random.default_rng(0))
    got = check_c8_cache_write(args)
    assert (got[0, 2] == 17).all()  # slot 2 is not in slot_mapping: sentinel bytes kept


@given(case=c8_cases(), key_dtype=st.sampled_from(["int8", "float8_e4m3fn"]),
       scale_order=st.sampled_from(["divide", "multiply", "reciprocal", "reciprocal_multiply", None]))
def test_c8_matches_reference(case, key_dtype, scale_order):
    check_c8_cache_write(dict(case, key_dtype=key_dtype, scale_order=scale_order))


def test_c8_scale_order_tie_per_chip():
    """docs/numerics/chips.md#c8-cache-writers through the kernel: the hand-built ties of tests/test_chips.py (A2/A3
    reciprocal vs 950 divide, int8 and FP8) give the bytes written out there."""
    from test_chips import C8_FP8_950, C8_FP8_RECIPROCAL, C8_INT8_950, C8_INT8_A2

    def write(key_dtype, first_two, **kw):
        k_nope = np.zeros((1, 512), BF16)
        k_nope[0, :2] = first_two
        cache = np.full((1, 1, 1, 528), 0x11, np.uint8)
        out = qsfa.c8_cache_write(k_nope, None, np.array([0]), cache, key_dtype=key_dtype, backend="triton", **kw)
        return np.asarray(out)[0, 0, 0].tolist()

    for chip, want in ((None, C8_INT8_A2), ("A3", C8_INT8_A2), ("950", C8_INT8_950)):
        assert write("int8", [7.46875, 3.734375], chip=chip) == want.tolist(), chip
    assert write("int8", [7.46875, 3.734375], chip="A2", scale_order="divide") == C8_INT8_950.tolist()
    assert write("float8_e4m3fn", [1.5, 1.125]) == C8_FP8_950.tolist()
    assert write("float8_e4m3fn", [1.5, 1.125], scale_order="reciprocal") == C8_FP8_RECIPROCAL.tolist()


def test_c8_torch_caller_in_place_fp8_cache():
    """torch tensors in, the caller's float8_e4m3fn cache updated in place (zero copies on the CPU)."""
    args = operator(C8).contract.example(np.random.default_rng(1))
    t = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    t["kv_cache"] = t["kv_cache"].view(torch.float8_e4m3fn)
    t["key_dtype"] = "float8_e4m3fn"
    check_c8_cache_write(t)


def test_c8_pipeline_slots_and_sentinel_then_attention():
    """docs/numerics/attention.md#scenarios pipeline case: cache prefilled with 17, slots [0..4, -1]; then attention over that cache."""
    rng = np.random.default_rng(3)
    T = 6
    k_nope = (rng.standard_normal((T, 512)) * 2).astype(BF16)
    cache = np.full((2, 16, 1, 528), 17, np.uint8)
    slots = np.array([0, 1, 2, 3, 4, -1], np.int64)
    args = dict(k_nope=k_nope, k_rope=None, slot_mapping=slots, kv_cache=cache)
    got = check_c8_cache_write(args)
    assert (got[0, 5:] == 17).all() and (got[1] == 17).all()
    q = rng.standard_normal((1, 1, 4, 512)).astype(BF16)
    idx = np.array([[[[0, 1, 2, 3, 4, -1, -1, -1]]]], np.int32)
    check_attention(dict(query=q, key=got.view(np.int8), value=got.view(np.int8), sparse_indices=idx,
                         scale_value=512 ** -0.5, block_table=np.array([[0]], np.int32),
                         actual_seq_lengths_kv=np.array([5], np.int32), layout_kv="PA_BSND", rope_head_dim=0,
                         return_softmax_lse=True))


# ------------------------------------------------------------------------------------------------
# attention

def test_attention_contract_example():
    args = operator(QSFA).contract.example(np.random.default_rng(0))
    check_attention(args)


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x) if isinstance(x, tuple) else x)
@pytest.mark.parametrize("key_fmt", ["int8", "float8_e4m3fn"])
def test_attention_qsfa_case_layouts(layouts, key_fmt):
    lq, lkv = layouts
    args = qsfa_case(layout_query=lq, layout_kv=lkv, key_fmt=key_fmt, n_heads=4, sparse=6, kv_s=24, q_s=3,
                     sparse_block_size=2, explicit_lengths=True, seed=7)
    args["return_softmax_lse"] = True
    check_attention(args)


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda x: "+".join(x))
@settings(max_examples=max(1, settings.default.max_examples // len(LAYOUTS)))  # the profile's count, split 4 ways
@given(data=st.data())
def test_attention_matches_reference(lay, data):
    args = data.draw(st.builds(lambda seed, rope, dt, sbs, lse, pr: make_attention_case(
        np.random.default_rng(seed), layouts=lay, rope=rope, dtype=dt, sbs=sbs, lse=lse, q_n=2, K=12,
        stray_stop=True) | {"probability_rounding": pr},
        st.integers(0, 2**31 - 1), st.sampled_from([64, 0]),
        st.sampled_from(["bfloat16", "float16"]), st.sampled_from([1, 2, 4, 8, 16]), st.booleans(),
        st.sampled_from(["unnormalised", "normalised"])))
    check_attention(args)


def _hif8_case(layouts, qdtype, seed):
    """A contract-valid HiFloat8 call (rope 64, sparse_size 2048, -1 padded): NoPE codes drawn from every
    finite code (denormals 2^-22 .. 32768) with small tile scales, and every packed row that no query row
    selects poisoned (NaN NoPE codes 0x80, NaN scales, NaN RoPE) - the kernel must never read one."""
    from qsfa.conformance._support import selection

    lq, lkv = layouts
    args = qsfa_case(layout_query=lq, layout_kv=lkv, key_fmt="hifloat8", n_heads=4, sparse=2048, kv_s=24, q_s=3,
                     sparse_block_size=2, explicit_lengths=True, qdtype=qdtype, seed=seed)
    rng = np.random.default_rng(seed)
    idx = args["sparse_indices"]
    r = idx.reshape(-1, 2048)
    r[:] = -1
    for i in range(r.shape[0]):  # 5 of blocks 0..9 per row, in a random order (tokens 20..23 never selected)
        r[i, :5] = rng.permutation(10)[:5]
    key = args["key"].view(np.uint8)
    flat = key.reshape(-1, key.shape[-1])
    finite = np.setdiff1d(np.arange(256), [0x80, 0x6F, 0xEF]).astype(np.uint8)
    flat[:, :512] = rng.choice(finite, (flat.shape[0], 512))
    flat[:, 640:656] = rng.uniform(2.0**-12, 2.0**-8, (flat.shape[0], 4)).astype("<f4").view(np.uint8)
    w, batch, _, storage, _ = selection(args)
    used = np.zeros(flat.shape[0], bool)
    for row, j in zip(*np.nonzero(w)):
        used[storage(batch[row], j)] = True
    assert used.any() and not used.all()
    flat[~used, :512] = 0x80
    flat[~used, 512:] = np.full((int((~used).sum()), 36), np.nan, "<f4").view(np.uint8)
    args["return_softmax_lse"] = True
    return args


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x) if isinstance(x, tuple) else x)
@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
def test_attention_hifloat8_matches_reference(layouts, qdtype):
    """HiFloat8 NoPE (no longer a kernel limit) against the reference, with poisoned unselected rows."""
    args = _hif8_case(layouts, qdtype, seed=LAYOUTS.index(layouts) + 10 * (qdtype == "float16"))
    res = check_attention(args)
    assert np.isfinite(np.asarray(qsfa.kv_quant_sparse_flash_attention(**args, backend="triton")[0],
                                  np.float32)).all()
    assert res.passed


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x) if isinstance(x, tuple) else x)
def test_attention_split_kv_matches_reference(layouts, monkeypatch):
    """The split-KV path, forced through its environment variable with 16-position chunks, against the
    reference: both probability_rounding choices (normalised divides P by the row sum merged over the splits),
    LSE on, fp16 (tight atol) and bf16."""
    from qsfa.kernels.qsfa_split import SPLIT_ENV

    monkeypatch.setenv(SPLIT_ENV, "16")
    i = LAYOUTS.index(layouts)
    args = make_attention_case(np.random.default_rng(70 + i), layouts=layouts, dtype=("float16", "bfloat16")[i % 2],
                               sbs=(1, 4)[i // 2], q_n=2, K=20, stray_stop=True)
    for pr in ("unnormalised", "normalised"):
        check_attention(dict(args, probability_rounding=pr))


def test_attention_torch_caller():
    args = make_attention_case(np.random.default_rng(9), layouts=("TND", "PA_BSND"), q_n=4)
    t = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    out = qsfa.kv_quant_sparse_flash_attention(**t, backend="triton")
    assert all(isinstance(o, torch.Tensor) for o in out)
    check_attention(args)


def test_attention_independent_naive_agrees_with_reference():
    """The test-local per-row implementation and the library's reference agree (so both oracles are sound)."""
    for seed, lay in enumerate(LAYOUTS):
        args = make_attention_case(np.random.default_rng(50 + seed), layouts=lay, q_n=2, stray_stop=True)
        want = qsfa.kv_quant_sparse_flash_attention(**args, backend="reference")
        mine = naive_qsfa(**args)
        for a, b, dt in ((mine[0], want[0], None), (mine[1], want[1], "float32"), (mine[2], want[2], "float32")):
            r = compare_float(np.asarray(a, np.float32) if dt else a, b, dtype=dt)
            assert r.passed, str(r)


@pytest.mark.parametrize("fault", [None, "threshold_off_by_one", "ignore_stop"])
def test_broken_kernel_fails_check_attention(fault, monkeypatch):
    """check_attention catches a kernel whose causal threshold is off by one / that reads past a -1; the real
    kernel (fault None) passes it on the same case."""
    from qsfa.kernels import qsfa_attention

    args = qsfa_case(layout_query="BSND", layout_kv="PA_BSND", n_heads=2, sparse=24, kv_s=24, q_s=4,
                     explicit_lengths=True, seed=3)
    args["sparse_indices"][0, 1, 0, 5] = -1  # one row stops mid-row, with valid entries after the -1
    if fault is None:
        check_attention(args)  # the real kernel passes
        return
    real = qsfa_attention.launch_qsfa_attention
    monkeypatch.setattr(qsfa_attention, "launch_qsfa_attention",
                        lambda *a, **k: real(*a, **k, _fault=fault))
    with pytest.raises(AssertionError):
        check_attention(args)


# ------------------------------------------------------------------------------------------------
# the GPU benchmark's own helpers, on the CPU (so the script cannot rot where no GPU is lent)

@pytest.mark.parametrize("layout_query", ["BSND", "TND"])
def test_benchmark_helpers_on_cpu(layout_query):
    import importlib.util as iu

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "triton_qsfa.py")
    spec = iu.spec_from_file_location("_triton_qsfa_bench", path)
    bench = iu.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if DEV_IS_CPU:
        assert bench.run(quick=True)[0]["skipped"].startswith("TRITON_INTERPRET=1")
    args = bench.make_case(batch=2, q_per_batch=2, q_n=16, sparse=24, kv_len=64, block_size=16,
                           layout_query=layout_query, device="cpu" if DEV_IS_CPU else "cuda")
    flops, nbytes, n_sel = bench._work(args)
    assert n_sel == 4 * 24  # every index entry selects a valid token by construction
    assert flops == 2.0 * 16 * (576 + 512) * n_sel
    from qsfa.kernels.qsfa_attention import launch_qsfa_attention

    kw = {k: v for k, v in args.items() if k not in ("query", "key", "value", "sparse_indices", "scale_value")}
    out = launch_qsfa_attention(args["query"], args["key"], args["sparse_indices"], args["scale_value"], **kw)[0]
    assert bench._check_subset(args, out).startswith("PASS")
    if layout_query == "BSND":  # the split rows' call, with a chunk small enough to split here
        out = launch_qsfa_attention(args["query"], args["key"], args["sparse_indices"], args["scale_value"],
                                    split_kv=16, **kw)[0]
        assert bench._check_subset(args, out).startswith("PASS")
        assert "auto" in bench.SPLITS


# ------------------------------------------------------------------------------------------------
# the requested chip's rounding points (the tie cases of tests/test_chips.py, docs/numerics/chips.md)

@pytest.mark.parametrize("chip", [None, "A2", "950"])
@pytest.mark.parametrize("qdtype", ["bfloat16", "float16"])
def test_triton_follows_the_chips_rounding(chip, qdtype):
    import test_chips as TC

    assert TC._qsfa_lane(TC._ties_p(qdtype), 1, chip=chip, backend="triton") == TC.P_EXPECT[qdtype][0]
    assert TC._qsfa_lane(TC._ties_k(qdtype), 5, chip=chip, backend="triton") == TC.K_EXPECT[qdtype][1][chip]
    assert TC._qsfa_lane(TC._ties_out(qdtype), 7, chip=chip, backend="triton") == TC.OUT_EXPECT[qdtype][1][chip]
