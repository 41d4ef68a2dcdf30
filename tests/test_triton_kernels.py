"""Kernel-level tests of qsfa.kernels (Triton; the CPU interpreter when no CUDA device is present).

Every expectation here is computed independently of the kernels: the rounding helpers against
ml_dtypes / numpy (and a nextafter-based half-away rounding written below), the C8 writer against a
vectorised NumPy implementation of docs/numerics/quantisers.md#int8-dynamic and
docs/numerics/cache-writers.md#c8_cache_write written in this file, and attention against a
plain per-row NumPy implementation of docs/numerics/attention.md#kv_quant_sparse_flash_attention (normalised probabilities, float64 scores: a different
but equally faithful reading, so agreement within docs/numerics/comparison.md#float-criterion is meaningful).
The operator-level checks against the library's reference are in tests/test_triton_backend.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from _triton_env import prepare

# triton.jit reads TRITON_INTERPRET when a kernel is defined, including triton's own tl.max & co.,
# so it is set (without a CUDA device) before triton is first imported: tests/_triton_env.py
DEV, _ = prepare(__name__)
import torch  # noqa: E402

import ml_dtypes  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from qsfa.compare import assert_bytes_equal, compare_float  # noqa: E402
from qsfa.kernels import _common as C  # noqa: E402
from qsfa.kernels.c8_cache_writer import launch_c8_cache_write  # noqa: E402
from qsfa.kernels.qsfa_attention import KernelConfig, _decode_hif8, hif8_table, launch_qsfa_attention  # noqa: E402

pytestmark = pytest.mark.triton
BF16 = np.dtype(ml_dtypes.bfloat16)
NP_DT = {"bfloat16": BF16, "float16": np.dtype(np.float16)}
TORCH_DT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _t(a: np.ndarray):
    """NumPy (incl. ml_dtypes bf16) -> torch on DEV, bits preserved."""
    a = np.ascontiguousarray(a)
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(DEV)
    return torch.from_numpy(a).to(DEV)


def _np(t) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


# ------------------------------------------------------------------------------------------------
# rounding helpers

@triton.jit
def _round_kernel(x_ptr, o_ptr, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if WHICH == 0:
        y = C.bf16_to_f32(C.f32_to_bf16_rne(x))
    elif WHICH == 1:
        y = C.f32_to_f16_round(x).to(tl.float32)
    elif WHICH == 2:
        y = C.f32_to_f16_rne(x).to(tl.float32)
    elif WHICH == 3:
        y = C.rint_small(x)
    elif WHICH == 5:
        y = C.bf16_to_f32(C.f32_to_bf16_round(x))
    else:
        y = C.bf16_to_f32(x.to(tl.bfloat16))  # native cast (truncates in the interpreter)
    tl.store(o_ptr + offs, y, mask=m)


def _apply(x: np.ndarray, which: int) -> np.ndarray:
    xt = _t(x.astype(np.float32))
    out = torch.empty_like(xt)
    n = xt.numel()
    _round_kernel[(triton.cdiv(n, 1024),)](xt, out, n, WHICH=which, BLOCK=1024)
    return _np(out)


def _f16_round_half_away(x: np.ndarray) -> np.ndarray:
    """Independent fp32 -> fp16 round-half-away: the RNE result, moved to the other neighbour on ties
    that RNE resolved towards zero (neighbour found with nextafter, tie decided in float64)."""
    x = x.astype(np.float32)
    r = x.astype(np.float16)
    x64, r64 = x.astype(np.float64), r.astype(np.float64)
    direction = np.where(x64 > r64, np.float16(np.inf), np.float16(-np.inf))
    nb = np.nextafter(r, direction.astype(np.float16))
    gap = np.abs(nb.astype(np.float64) - r64)
    tie = (x64 != r64) & np.isfinite(r64) & (2 * np.abs(x64 - r64) == gap)
    away = tie & (np.abs(nb.astype(np.float64)) > np.abs(r64))
    return np.where(away, nb, r).astype(np.float32)


def _fp32_samples(rng, n=4096):
    """Finite fp32 values: random bit patterns plus exact bf16 / fp16 ties and neighbours."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    base = rng.standard_normal(n).astype(np.float32) * np.float32(3.0)
    b16 = (base.view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # bf16 ties
    h = rng.standard_normal(n).astype(np.float16).astype(np.float32)
    h_next = np.nextafter(h.astype(np.float16), np.float16(np.inf)).astype(np.float32)
    f16_ties = ((h.astype(np.float64) + h_next.astype(np.float64)) / 2).astype(np.float32)
    sub = (rng.integers(-1023, 1024, n) + 0.5).astype(np.float32) * np.float32(2.0**-24)  # fp16 subnormal ties
    return np.concatenate([x, b16.view(np.float32), f16_ties, sub, np.float32([0.0, -0.0, 65519.0, 65520.0, -65520.0])])


def test_rounding_helpers_bf16_rne_matches_ml_dtypes():
    x = _fp32_samples(np.random.default_rng(1))
    x = x[np.abs(x) < np.float32(3.3e38)]
    got = _apply(x, 0)
    want = x.astype(BF16).astype(np.float32)
    assert_bytes_equal(got, want, name="f32_to_bf16_rne")


def test_rounding_helpers_bf16_round_half_away():
    """f32_to_bf16_round against qsfa.formats' ties-away rounding (a table-free encoder, not bit arithmetic)."""
    from qsfa.reference import formats as F

    x = _fp32_samples(np.random.default_rng(3))
    x = x[np.abs(x) < np.float32(3.3e38)]
    got = _apply(x, 5)
    want = np.asarray(F.round_to(x, "bfloat16", rounding="round"), np.float32)
    assert_bytes_equal(got, want, name="f32_to_bf16_round")
    assert (want != x.astype(BF16).astype(np.float32)).sum() > 500  # the ties are exercised


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_rounding_helpers_f16_round_half_away():
    x = _fp32_samples(np.random.default_rng(2))
    x = x[np.abs(x) < np.float32(1e6)]
    got = _apply(x, 1)
    want = _f16_round_half_away(x)
    assert_bytes_equal(got, want, name="f32_to_f16_round")
    # the ties really are exercised: half-away and RNE disagree on a good share of them
    assert (want != x.astype(np.float16).astype(np.float32)).sum() > 500
    assert_bytes_equal(_apply(x, 2), x.astype(np.float16).astype(np.float32), name="f32_to_f16_rne")


def test_rounding_helpers_rint_small_ties_to_even():
    rng = np.random.default_rng(3)
    x = np.concatenate([np.arange(-300, 300) + np.float32(0.5), rng.uniform(-1000, 1000, 4000),
                        np.float32([0.49999997, -0.49999997, 1.5, 2.5, -2.5, 127.5, -127.5])]).astype(np.float32)
    # rint_small returns +0 where np.rint gives -0 (documented; the int8 codes are the same)
    assert_bytes_equal(_apply(x, 3), np.rint(x).astype(np.float32) + np.float32(0.0), name="rint_small")


def test_interpreter_bf16_cast_truncates():
    """Documents why f32_to_bf16_rne exists: the interpreter's native fp32->bf16 cast truncates."""
    if DEV != "cpu":
        pytest.skip("interpreter-only behaviour")
    x = _fp32_samples(np.random.default_rng(4))
    x = x[np.isfinite(x) & (np.abs(x) > np.float32(1e-30)) & (np.abs(x) < np.float32(1e30))]
    rne = x.astype(BF16).astype(np.float32)
    trunc = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert not np.array_equal(rne, trunc)
    assert np.array_equal(_apply(x, 4), trunc)  # if Triton fixes this, the helper is still right


@triton.jit
def _fp8_cast_kernel(x_ptr, o_ptr):
    i = tl.arange(0, 4)
    tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv).to(tl.uint8, bitcast=True))


def test_interpreter_fp8_cast_is_not_rne():
    """Documents why the C8 writer encodes FP8 by bit arithmetic: the interpreter's fp32 -> e4m3 cast
    rounds ties up (1.0625 -> 1.125) and loses the mantissa carry (1.9375 -> 1.0 instead of 2.0)."""
    if DEV != "cpu":
        pytest.skip("interpreter-only behaviour")
    x = np.float32([1.0625, 1.9375, 3.875, 1.1875])
    out = torch.empty(4, dtype=torch.uint8)
    _fp8_cast_kernel[(1,)](_t(x), out)
    rne = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert rne.tolist() == [0x38, 0x40, 0x48, 0x3A]
    assert _np(out).tolist() == [0x39, 0x38, 0x48, 0x3A]


@triton.jit
def _hif8_decode_kernel(c_ptr, o_ptr):
    i = tl.arange(0, 256)
    tl.store(o_ptr + i, _decode_hif8(tl.load(c_ptr + i)))


def test_hif8_decode_every_code():
    """The attention kernel's HiFloat8 decoder (bit arithmetic) against the independent en-dtypes type and
    qsfa.formats.decode, all 256 codes, bit for bit (NaN only at 0x80, +-Inf at 0x6F / 0xEF)."""
    en = pytest.importorskip("en_dtypes")
    from qsfa import formats

    codes = np.arange(256, dtype=np.uint8)
    out = torch.empty(256, dtype=torch.float32, device=DEV)
    _hif8_decode_kernel[(1,)](_t(codes), out)
    got = _np(out)
    want = codes.view(en.hifloat8).astype(np.float32)
    assert np.flatnonzero(np.isnan(got)).tolist() == [0x80] == np.flatnonzero(np.isnan(want)).tolist()
    assert got[0x6F] == np.inf and got[0xEF] == -np.inf
    keep = codes != 0x80
    assert_bytes_equal(got[keep], want[keep], name="hifloat8 decode vs en_dtypes")
    assert_bytes_equal(got[keep], np.asarray(formats.decode(codes, "hifloat8"))[keep], name="vs qsfa.formats")
    tab = _np(hif8_table(DEV))  # the table the attention kernel gathers from
    assert np.isnan(tab[0x80])
    assert_bytes_equal(tab[keep], want[keep], name="hif8_table")


@triton.jit
def _widen_kernel(x_ptr, o_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(o_ptr + offs, C.to_f32(tl.load(x_ptr + offs, mask=m, other=0.0), IS_BF16), mask=m)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_to_f32_exact_for_every_16_bit_pattern(dtype):
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(NP_DT[dtype])
    x = x[np.isfinite(x.astype(np.float32))]
    out = torch.empty(x.size, dtype=torch.float32, device=DEV)
    _widen_kernel[(triton.cdiv(x.size, 4096),)](_t(x), out, x.size, IS_BF16=dtype == "bfloat16", BLOCK=4096)
    assert_bytes_equal(_np(out), x.astype(np.float32), name=f"{dtype} -> fp32")


# ------------------------------------------------------------------------------------------------
# C8 cache writer: independent NumPy expectation

def c8_expected(k_nope, k_rope, slots, cache, scale_order="divide", key_dtype="int8"):
    """docs/numerics/cache-writers.md#c8_cache_write in NumPy: returns the cache bytes after the write (a copy).

    int8: ``s = amax / 127``, ``clamp(RINT(y), +-127)``; float8_e4m3fn: ``s = amax / 448``, y clamped to
    +-448 and cast with ml_dtypes (round half to even; no saturation needed inside +-448).
    ``y = x / s`` ("divide"), ``x * fp32(TYPE_MAX / amax)`` ("multiply") or ``x * fp32(fp32(1 / amax) * TYPE_MAX)``
    ("reciprocal", stored scale ``amax * fp32(1 / TYPE_MAX)``; "reciprocal_multiply", stored scale ``amax / TYPE_MAX``)."""
    T = k_nope.shape[0]
    tmax = np.float32(127 if key_dtype == "int8" else 448)
    x = k_nope.astype(np.float32).reshape(T, 4, 128)
    amax = np.abs(x).max(axis=-1)
    s = (amax / tmax).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if scale_order == "divide":
            y = x / s[..., None]
        elif scale_order == "multiply":
            y = x * (tmax / amax).astype(np.float32)[..., None]
        else:
            y = x * ((np.float32(1) / amax).astype(np.float32) * tmax).astype(np.float32)[..., None]
    if scale_order == "reciprocal":
        s = (amax * (np.float32(1) / tmax)).astype(np.float32)
    y = np.clip(np.where(s[..., None] == 0, np.float32(0), y), -tmax, tmax).astype(np.float32)
    if key_dtype == "int8":
        q = np.rint(y).astype(np.int8).view(np.uint8)
    else:
        q = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    parts = [q.reshape(T, 512)]
    if k_rope is not None:
        parts.append(np.ascontiguousarray(k_rope).view(np.uint8).reshape(T, 128))
    parts.append(s.astype("<f4").view(np.uint8).reshape(T, 16))
    rows = np.concatenate(parts, axis=1)
    out = np.array(cache, copy=True).view(np.uint8)
    bs = out.shape[1]
    sl = np.asarray(slots).astype(np.int64)
    keep = sl >= 0
    out[sl[keep] // bs, sl[keep] % bs, 0, :] = rows[keep]
    return out


@st.composite
def c8_cases(draw):
    dtype = draw(st.sampled_from(["bfloat16", "float16"]))
    rope = draw(st.booleans())
    T = draw(st.integers(0, 6))
    bs = draw(st.sampled_from([1, 4, 16]))
    nblk = draw(st.integers(max(1, -(-T // bs)), max(1, -(-T // bs)) + 2))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["normal", "ties", "zeros", "wide"]))
    x = rng.standard_normal((T, 512)).astype(np.float32)
    if kind == "ties":  # amax 127 -> s == 1 exactly; k + 0.5 values are exact RINT ties
        x = (rng.integers(-126, 126, (T, 512)) + 0.5).astype(np.float32)
        x[:, ::128] = 127.0
    elif kind == "zeros":
        x[:, 128:256] = 0.0
        if T:
            x[0] = 0.0
    elif kind == "wide":
        x *= np.float32(2.0) ** rng.integers(-20, 12, (T, 1)).astype(np.float32)
    k_nope = x.astype(NP_DT[dtype])
    k_rope = rng.standard_normal((T, 64)).astype(NP_DT[dtype]) if rope else None
    n_slots = nblk * bs
    slots = rng.permutation(n_slots)[:T].astype(np.int64)
    if T:
        slots[rng.random(T) < 0.3] = -1
    slot_dtype = draw(st.sampled_from([np.int32, np.int64]))
    width = 656 if rope else 528
    cache = rng.integers(0, 256, (nblk, bs, 1, width), dtype=np.uint8)  # sentinel bytes
    return dict(k_nope=k_nope, k_rope=k_rope, slot_mapping=slots.astype(slot_dtype), kv_cache=cache)


@given(case=c8_cases(), cache_dtype=st.sampled_from(["uint8", "int8"]),
       key_dtype=st.sampled_from(["int8", "float8_e4m3fn"]),
       order=st.sampled_from(["divide", "multiply", "reciprocal", "reciprocal_multiply"]))
def test_c8_kernel_bit_exact(case, cache_dtype, key_dtype, order):
    want = c8_expected(case["k_nope"], case["k_rope"], case["slot_mapping"], case["kv_cache"], order, key_dtype)
    cache = _t(case["kv_cache"])
    if cache_dtype == "int8":
        cache = cache.view(torch.int8)
    rope = None if case["k_rope"] is None else _t(case["k_rope"])
    ret = launch_c8_cache_write(_t(case["k_nope"]), rope, _t(case["slot_mapping"]), cache, key_dtype=key_dtype,
                                scale_order=order)
    assert ret is cache
    assert_bytes_equal(_np(cache).view(np.uint8), want, name="kv_cache")


def test_c8_kernel_fp8_codes_exhaustive():
    """Every E4M3FN code magnitude and every midpoint between neighbours, through the writer (amax 448 -> s = 1)."""
    mags = np.arange(0, 0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)  # 0 .. 448
    mids = (mags[:-1].astype(np.float64) + mags[1:]) / 2
    vals = np.concatenate([mags, mids.astype(np.float32), -mags, -mids.astype(np.float32)])
    vals = np.concatenate([vals, np.zeros((-vals.size) % 511, np.float32)])
    rows = vals.reshape(-1, 511)
    x = np.concatenate([np.full((rows.shape[0], 1), 448, np.float32), rows], axis=1)
    x[:, 128] = x[:, 256] = x[:, 384] = 448  # every tile has amax 448, so s = 1 exactly
    assert np.array_equal(x.astype(np.float16).astype(np.float32), x)  # exact in fp16
    k_nope = x.astype(np.float16)
    T = k_nope.shape[0]
    cache = _t(np.zeros((T, 1, 1, 528), np.uint8))
    launch_c8_cache_write(_t(k_nope), None, _t(np.arange(T)), cache, key_dtype="float8_e4m3fn")
    want = c8_expected(k_nope, None, np.arange(T), np.zeros((T, 1, 1, 528), np.uint8), key_dtype="float8_e4m3fn")
    assert_bytes_equal(_np(cache), want, name="fp8 codes")


def test_c8_kernel_multiply_order_and_strided_cache():
    rng = np.random.default_rng(7)
    T = 6
    # values where x/s and x*127/amax round differently do exist; search a few rows for one
    x = (rng.standard_normal((T, 512)) * 3).astype(BF16)
    rope = rng.standard_normal((T, 64)).astype(BF16)
    big = rng.integers(0, 256, (8, 4, 1, 656), dtype=np.uint8)
    slots = np.array([0, 5, -1, 9, 12, 2], np.int64)
    for order in ("divide", "multiply"):
        full = _t(big)
        view = full[::2]  # non-contiguous along block_num: writes must land in the caller's buffer
        launch_c8_cache_write(_t(x), _t(rope), _t(slots), view, scale_order=order)
        want_view = c8_expected(x, rope, slots, big[::2], scale_order=order)
        got = _np(full)
        assert_bytes_equal(got[::2], want_view, name=f"strided cache ({order})")
        assert_bytes_equal(got[1::2], big[1::2], name="blocks outside the view untouched")


def test_c8_kernel_orders_differ_somewhere():
    """The two OPEN quantisation orders are distinguishable, so the parameter is not a no-op."""
    rng = np.random.default_rng(11)
    T = 32
    x = (rng.standard_normal((T, 512)) * 5).astype(BF16)
    a = c8_expected(x, None, np.arange(T), np.zeros((T, 1, 1, 528), np.uint8), "divide")
    b = c8_expected(x, None, np.arange(T), np.zeros((T, 1, 1, 528), np.uint8), "multiply")
    assert not np.array_equal(a, b)
    cache = _t(np.zeros((T, 1, 1, 528), np.uint8))
    launch_c8_cache_write(_t(x), None, _t(np.arange(T)), cache, scale_order="multiply")
    assert_bytes_equal(_np(cache), b, name="multiply order")


# ------------------------------------------------------------------------------------------------
# attention: independent per-row NumPy implementation of docs/numerics/attention.md#kv_quant_sparse_flash_attention

def _round_q(x32: np.ndarray, dtype: str, mode: str | None = None) -> np.ndarray:
    """fp32 -> the query dtype with ``mode`` ("rint" / "round"; None: bf16 RINT, fp16 ROUND), as float32."""
    x32 = np.asarray(x32, np.float32)
    mode = mode or ("rint" if dtype == "bfloat16" else "round")
    if mode == "rint":
        return x32.astype(NP_DT[dtype]).astype(np.float32)
    if dtype == "bfloat16":
        from qsfa.reference import formats as F

        return np.asarray(F.round_to(x32, "bfloat16", rounding="round"), np.float32)
    return _f16_round_half_away(x32)


def naive_qsfa(query, key, sparse_indices, scale_value, *, block_table=None, actual_seq_lengths_query=None,
               actual_seq_lengths_kv=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
               sparse_mode=3, rope_head_dim=64, normalise_before_rounding=False, k_rounding=None, p_rounding="round",
               out_rounding=None, **_):
    """(out [.., 512] query dtype, softmax_max, softmax_sum) per docs/numerics/attention.md#kv_quant_sparse_flash_attention, one query row at a time.

    Probabilities: ``exp(s - max)`` rounded to the query dtype, P @ V in float64, divided by the fp32 sum
    (the FlashAttention order of the Ascend kernels); ``normalise_before_rounding`` rounds ``p / sum``
    instead. With fp16 outputs the two orders differ by more than docs/numerics/comparison.md#float-criterion's atol on outputs near 0.
    """
    dtype = "bfloat16" if query.dtype == BF16 else "float16"
    q_n = query.shape[-2]
    sbs = sparse_block_size
    K = sparse_indices.shape[-1]
    if layout_query == "TND":
        cu = np.asarray(actual_seq_lengths_query, np.int64)
        B = len(cu)
        starts = np.concatenate([[0], cu[:-1]])
        rows = [(b, i, starts[b] + i, cu[b] - starts[b]) for b in range(B) for i in range(cu[b] - starts[b])]
        q_rows = query.reshape(-1, q_n, query.shape[-1])
        idx_rows = sparse_indices.reshape(-1, K)
    else:
        B, Q_S = query.shape[:2]
        aq = np.full(B, Q_S) if actual_seq_lengths_query is None else np.asarray(actual_seq_lengths_query)
        rows = [(b, i, b * Q_S + i, aq[b]) for b in range(B) for i in range(int(aq[b]))]
        q_rows = query.reshape(-1, q_n, query.shape[-1])
        idx_rows = sparse_indices.reshape(-1, K)
    kvl = np.asarray(actual_seq_lengths_kv, np.int64) if actual_seq_lengths_kv is not None else None
    if layout_kv == "TND":
        kv_start = np.concatenate([[0], kvl[:-1]])
        kv_len = kvl - kv_start
    elif kvl is None:
        kv_len = np.full(B, key.shape[1])
    else:
        kv_len = kvl
    key_u8 = np.asarray(key).view(np.uint8)
    R = q_rows.shape[0]
    out = np.zeros((R, q_n, 512))
    smax = np.zeros((R, q_n))
    ssum = np.zeros((R, q_n))
    scale_off = 640 if rope_head_dim == 64 else 512
    for b, i, r, aq_b in rows:
        akv = int(kv_len[b])
        thr = akv - int(aq_b) + i + 1 if sparse_mode == 3 else akv
        if thr <= 0:
            continue
        lim = min(akv, thr)
        toks = []
        for e in range(min(K, -(-thr // sbs))):
            t = int(idx_rows[r, e])
            if t == -1:
                break
            toks += [t * sbs + w for w in range(sbs) if 0 <= t * sbs + w < lim]
        if not toks:
            continue
        toks = np.array(toks)
        if layout_kv == "PA_BSND":
            bsz = key.shape[1]
            blk = np.asarray(block_table)[b, toks // bsz]
            krow = key_u8[blk, toks % bsz, 0]
        elif layout_kv == "TND":
            krow = key_u8[kv_start[b] + toks, 0]
        else:
            krow = key_u8[b, toks, 0]
        codes = krow[:, :512].view(np.int8).astype(np.float32)
        scales = np.ascontiguousarray(krow[:, scale_off:scale_off + 16]).view("<f4")
        kd = _round_q(codes * np.repeat(scales, 128, axis=1), dtype, k_rounding)
        qf = q_rows[r].astype(np.float64)
        s = qf[:, :512] @ kd.T.astype(np.float64)
        if rope_head_dim == 64:
            kr = np.ascontiguousarray(krow[:, 512:640]).view(NP_DT[dtype]).astype(np.float64)
            s = s + qf[:, 512:] @ kr.T
        s = (s.astype(np.float32) * np.float32(scale_value)).astype(np.float64)
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        l_ = p.sum(axis=1, keepdims=True)
        if normalise_before_rounding:
            out[r] = _round_q(p / l_, dtype, p_rounding).astype(np.float64) @ kd.astype(np.float64)
        else:
            out[r] = (_round_q(p, dtype, p_rounding).astype(np.float64) @ kd.astype(np.float64)) / l_
        smax[r], ssum[r] = m[:, 0], l_[:, 0]
    out = _round_q(out.astype(np.float32), dtype, out_rounding).astype(NP_DT[dtype]).reshape(tuple(query.shape[:-1]) + (512,))
    if layout_query == "TND":
        lse_shape = (1, R, q_n)
    else:
        lse_shape = (query.shape[0], 1, query.shape[1], q_n)
    return out, smax.reshape(lse_shape), ssum.reshape(lse_shape)


def pack_key(codes: np.ndarray, scales: np.ndarray, rope: np.ndarray | None) -> np.ndarray:
    """Packed rows [..., 656|528] uint8 from int8 codes [..., 512], fp32 scales [..., 4], rope [..., 64]."""
    parts = [codes.astype(np.int8).view(np.uint8)]
    if rope is not None:
        parts.append(np.ascontiguousarray(rope).view(np.uint8))
    parts.append(np.ascontiguousarray(scales.astype("<f4")).view(np.uint8))
    return np.concatenate(parts, axis=-1)


LAYOUTS = [("BSND", "BSND"), ("BSND", "PA_BSND"), ("TND", "TND"), ("TND", "PA_BSND")]


def make_attention_case(rng, *, dtype="bfloat16", rope=64, layouts=("BSND", "PA_BSND"), sbs=1, q_n=2, B=2,
                        sparse_mode=3, K=16, lse=True, pass_q_lens=True, pass_kv_lens=True, block_size=16,
                        stray_stop=False, max_kv=40, max_q=3):
    """A small valid QSFA argument set (NumPy) drawn from ``rng``.

    Lengths: actKV in [0, max_kv] (rarely 0), actQ in [0, max_q] (rarely 0): empty batches, rows past actQ
    and rows whose causal threshold is <= 0 all occur. Indices: distinct token blocks (some beyond the
    causal limit or actKV) followed by -1 (or a full row), optionally one stray -1 mid-row. PA caches hold
    one extra block of 0xFF bytes that no block_table entry maps (NaN scales if it were ever read).
    """
    lq, lkv = layouts
    kv_len = np.where(rng.random(B) < 0.1, 0, rng.integers(1, max_kv + 1, B))
    q_len = np.where(rng.random(B) < 0.1, 0, rng.integers(1, max_q + 1, B))
    Q_S = max_q
    w = 656 if rope else 528
    if lq == "BSND":
        query = rng.standard_normal((B, Q_S, q_n, 512 + rope))
        R = B * Q_S
        aq = q_len
    else:
        aq = np.cumsum(q_len)
        R = int(aq[-1])
        query = rng.standard_normal((R, q_n, 512 + rope))
    query = query.astype(NP_DT[dtype])
    n_blocks = -(-max_kv // sbs) + 1
    idx = np.stack([rng.permutation(n_blocks)[:K] if K <= n_blocks else rng.integers(0, n_blocks, K)
                    for _ in range(R)]) if R else np.zeros((0, K))
    idx = idx.astype(np.int32)
    if R:
        tails = np.where(rng.random(R) < 0.5, K, rng.integers(0, K + 1, R))
        idx[np.arange(K)[None, :] >= tails[:, None]] = -1
        if stray_stop:
            idx[rng.integers(0, R), rng.integers(0, K)] = -1
    sparse = idx.reshape((B, Q_S, 1, K) if lq == "BSND" else (R, 1, K))

    def rows(n):
        codes = rng.integers(-127, 128, (n, 512))  # int8 codes
        scales = rng.uniform(0.002, 0.03, (n, 4)).astype(np.float32)
        r = rng.standard_normal((n, 64)).astype(NP_DT[dtype]) if rope else None
        return pack_key(codes, scales, r)

    args = dict(query=query, sparse_indices=sparse, scale_value=float(rng.uniform(0.02, 0.08)),
                sparse_block_size=sbs, layout_query=lq, layout_kv=lkv, sparse_mode=sparse_mode,
                rope_head_dim=rope, return_softmax_lse=lse,
                actual_seq_lengths_query=aq.astype(np.int32) if lq == "TND" or pass_q_lens else None)
    if lkv == "PA_BSND":
        nb_per = -(-max_kv // block_size)
        nblk = B * nb_per + 1
        key = rows(nblk * block_size).reshape(nblk, block_size, 1, w)
        key[-1] = 0xFF
        args["block_table"] = rng.permutation(nblk - 1)[:B * nb_per].reshape(B, nb_per).astype(np.int32)
        args["actual_seq_lengths_kv"] = kv_len.astype(np.int32)
    elif lkv == "TND":
        cu = np.cumsum(kv_len)
        key = rows(max(int(cu[-1]), 1)).reshape(-1, 1, w)
        args["actual_seq_lengths_kv"] = cu.astype(np.int32)
    else:
        key = rows(B * max_kv).reshape(B, max_kv, 1, w)
        args["actual_seq_lengths_kv"] = kv_len.astype(np.int32) if pass_kv_lens else None
    args["key"] = key.view(np.int8)
    args["value"] = args["key"]
    return args


@st.composite
def attention_cases(draw, layouts=None):
    """Hypothesis strategy over make_attention_case's knobs (``layouts``: one pair, or drawn from LAYOUTS)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    return make_attention_case(
        rng, dtype=draw(st.sampled_from(["bfloat16", "float16"])), rope=draw(st.sampled_from([64, 0])),
        layouts=layouts or draw(st.sampled_from(LAYOUTS)), sbs=draw(st.sampled_from([1, 2, 4])),
        q_n=draw(st.sampled_from([1, 2, 4])), B=draw(st.integers(1, 2)),
        sparse_mode=draw(st.sampled_from([3, 0])), K=draw(st.integers(1, 24)), lse=draw(st.booleans()),
        pass_q_lens=draw(st.booleans()), pass_kv_lens=draw(st.booleans()),
        block_size=draw(st.sampled_from([16, 32])), stray_stop=draw(st.booleans()))


def _launch(args, **kw):
    t = {k: (_t(v) if isinstance(v, np.ndarray) else v) for k, v in args.items() if k != "value"}
    return launch_qsfa_attention(t.pop("query"), t.pop("key"), t.pop("sparse_indices"), t.pop("scale_value"),
                                 **t, **kw)


def check_attention_naive(args, **launch_kw):
    """The kernel against naive_qsfa under the docs/numerics/comparison.md#float-criterion criterion; raises AssertionError.
    Returns the kernel's outputs (torch tensors), for a test that compares them further."""
    out, smax, ssum = _launch(args, **launch_kw)
    w_out, w_max, w_sum = naive_qsfa(**args)
    dtype = "bfloat16" if args["query"].dtype == BF16 else "float16"
    res = compare_float(_np(out), w_out, dtype=dtype, name="attention_out")
    assert res.passed, str(res)
    if args.get("return_softmax_lse"):
        for name, got, want in (("softmax_max", smax, w_max), ("softmax_sum", ssum, w_sum)):
            r = compare_float(_np(got), want.astype(np.float32), dtype="float32", name=name)
            assert r.passed, str(r)
    else:
        assert tuple(smax.shape) == (0,) and tuple(ssum.shape) == (0,)
    return out, smax, ssum


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda x: "+".join(x))
@settings(max_examples=max(1, settings.default.max_examples // len(LAYOUTS)))  # the profile's count, split 4 ways
@given(data=st.data())
def test_attention_kernel_matches_naive(lay, data):
    check_attention_naive(data.draw(attention_cases(lay)))


@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "+".join(x) if isinstance(x, tuple) else x)
@pytest.mark.parametrize("rope", [0, 64])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_attention_kernel_matrix(layouts, rope, dtype):
    """Every layout x rope x dtype once, with LSE, block-sparse rows and a stray -1 (seeded)."""
    combo = LAYOUTS.index(layouts) * 4 + (rope // 64) * 2 + (dtype == "float16")
    for seed in range(100 + 10 * combo, 110 + 10 * combo):  # the first seed whose case attends in >= 3 rows
        args = make_attention_case(np.random.default_rng(seed), dtype=dtype, rope=rope, layouts=layouts,
                                   sbs=(1, 2, 4)[combo % 3], q_n=4, K=20, stray_stop=True)
        if (np.abs(naive_qsfa(**args)[0].astype(np.float32)).sum(axis=-1) > 0).reshape(-1, 4).any(axis=1).sum() >= 3:
            break
    else:
        pytest.fail("no seed gave a case with 3 attending rows")
    check_attention_naive(args)
    if dtype == "bfloat16":  # the one-pass online softmax too (its P rounding is ~1 ulp off a whole-row softmax)
        check_attention_naive(args, config=KernelConfig(block_h=16, block_n=16, two_pass=False, num_warps=1))


def _prefill_case(dtype="bfloat16", rope=64, sbs=1):
    """Deterministic prefill case whose rows see tokens right at the causal limit and a -1 mid-row."""
    rng = np.random.default_rng(5)
    B, Q_S, q_n, kv = 1, 4, 2, 32
    query = rng.standard_normal((B, Q_S, q_n, 512 + rope)).astype(NP_DT[dtype])
    codes = rng.integers(-127, 128, (B, kv, 512))
    scales = rng.uniform(0.01, 0.05, (B, kv, 4)).astype(np.float32)
    r = rng.standard_normal((B, kv, 64)).astype(NP_DT[dtype]) if rope else None
    key = pack_key(codes, scales, r).reshape(B, kv, 1, -1).view(np.int8)
    K = kv // sbs
    idx = np.tile(np.arange(K)[::-1].astype(np.int32), (B, Q_S, 1, 1))  # every block, highest first
    idx[0, 1, 0, 3] = -1  # row 1 stops reading after 3 entries
    return dict(query=query, key=key, value=key, sparse_indices=idx, scale_value=0.06, sparse_block_size=sbs,
                layout_query="BSND", layout_kv="BSND", sparse_mode=3, rope_head_dim=rope,
                return_softmax_lse=True, actual_seq_lengths_query=np.array([Q_S], np.int32),
                actual_seq_lengths_kv=np.array([kv - 3], np.int32))


@pytest.mark.parametrize("fault", [None, "threshold_off_by_one", "ignore_stop"])
def test_attention_check_catches_broken_kernel(fault):
    """The real kernel (fault None) passes check_attention_naive on this case; each planted fault fails it."""
    args = _prefill_case()
    args["sparse_indices"] = np.tile(np.arange(32, dtype=np.int32), (1, 4, 1, 1))  # lowest first
    args["sparse_indices"][0, 1, 0, 3] = -1
    if fault is None:
        check_attention_naive(args)
    else:
        with pytest.raises(AssertionError):
            check_attention_naive(args, _fault=fault)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("rope", [0, 64])
def test_attention_kernel_deterministic_prefill(dtype, rope):
    check_attention_naive(_prefill_case(dtype, rope))


def test_attention_kernel_block_sparse_and_tilings():
    args = _prefill_case("float16", 64, sbs=4)
    check_attention_naive(args)
    # tiling changes only the fp32 summation order
    check_attention_naive(args, config=KernelConfig(block_h=16, block_n=32, block_dv=128, num_warps=1))


def test_shared_interpreter_patch_changes_no_bit():
    """tests/_triton_env.py's share_interpreter_patch (speed only) against Triton's own per-call patching: the same
    launch (two-pass with split KV: the attention and merge kernels) gives the same bytes, and triton.language is
    restored after it."""
    from triton.runtime import interpreter as itp

    pairs = getattr(getattr(itp, "_patch_lang", None), "_qsfa_pairs", None)
    if DEV != "cpu" or pairs is None:
        pytest.skip("the shared patch is installed only in Triton 3.9's interpreter")
    args = make_attention_case(np.random.default_rng(7), dtype="float16", rope=64, layouts=("TND", "PA_BSND"),
                               sbs=2, q_n=2, K=12, stray_stop=True, max_kv=24, max_q=2)
    cfgs = (dict(config=KernelConfig(block_h=16, block_n=16, two_pass=True, num_warps=1), split_kv=16),)
    tl_max, tl_add = tl.max, tl.tensor.__add__
    out = {}
    for mode in ("triton", "shared"):
        itp._patch_lang, itp.GridExecutor.__call__ = pairs[mode]
        try:
            out[mode] = [_np(x) for kw in cfgs for x in _launch(args, **kw)]
        finally:
            itp._patch_lang, itp.GridExecutor.__call__ = pairs["shared"]
        assert tl.max is tl_max and tl.tensor.__add__ is tl_add
    assert len(out["shared"]) == 3 and any(np.abs(o.astype(np.float32)).sum() > 0 for o in out["shared"][:1])
    for a, b in zip(out["shared"], out["triton"]):
        assert_bytes_equal(a, b, name="shared interpreter patch")


def test_attention_rope0_equals_zero_rope():
    """docs/numerics/attention.md#rope-0: rope 0 gives results bit-identical to the same data with zero RoPE (Q_D 576, KV_D 656)."""
    a0 = _prefill_case("bfloat16", 0)
    key0 = a0["key"].view(np.uint8)
    key64 = np.concatenate([key0[..., :512], np.zeros(key0.shape[:-1] + (128,), np.uint8), key0[..., 512:]], -1)
    q64 = np.concatenate([a0["query"], np.zeros(a0["query"].shape[:-1] + (64,), BF16)], -1)
    a64 = dict(a0, query=q64, key=key64.view(np.int8), value=key64.view(np.int8), rope_head_dim=64)
    for x, y in zip(_launch(a0), _launch(a64)):
        assert_bytes_equal(_np(x), _np(y))


def test_attention_uniform_scores():
    """All scores 0 (zero query): out = mean of the selected V, softmax_max = 0, softmax_sum = count.

    _prefill_case: actKV 29, actQ 4 -> causal limits 26..29; indices 31, 30, ... (highest first), so row i
    reads its first 26+i entries and keeps tokens [32-thr, thr): 20, 0 (row 1 stops after 3 entries,
    all >= its limit: an empty row), 24, 26 tokens.
    """
    args = _prefill_case("bfloat16", 64)
    args["query"] = np.zeros_like(args["query"])
    out, smax, ssum = _launch(args)
    counts = {0: (6, 26), 1: None, 2: (4, 28), 3: (3, 29)}
    key = args["key"].view(np.uint8)[0, :, 0]
    v = (key[:, :512].view(np.int8).astype(np.float32)
         * np.repeat(np.ascontiguousarray(key[:, 640:656]).view("<f4"), 128, axis=1)).astype(BF16).astype(np.float64)
    want = np.zeros((4, 512))
    want_sum = np.zeros(4)
    for i, rng_ in counts.items():
        if rng_ is not None:
            want[i] = v[rng_[0]:rng_[1]].mean(axis=0)
            want_sum[i] = rng_[1] - rng_[0]
    assert np.array_equal(_np(smax), np.zeros((1, 1, 4, 2), np.float32))
    assert np.array_equal(_np(ssum)[0, 0], np.repeat(want_sum[:, None], 2, 1).astype(np.float32))
    got = _np(out)[0]
    assert np.array_equal(got[1], np.zeros((2, 512), BF16))  # the empty row
    res = compare_float(got, np.repeat(want[:, None], 2, 1).astype(BF16), dtype="bfloat16")
    assert res.passed, str(res)


# ------------------------------------------------------------------------------------------------
# split-KV (flash-decoding) path: forced with tiny chunks

@pytest.mark.parametrize("two_pass", [True, False])
@pytest.mark.parametrize("chunk", [16, 32])
def test_attention_split_kv_matches_naive(two_pass, chunk):
    """Rows cut into chunks of 16 / 32 positions (several splits, empty trailing splits, rows with nothing) meet
    the same criterion as unsplit; the LSE is the row's, merged over the splits."""
    args = make_attention_case(np.random.default_rng(21 + chunk), dtype="bfloat16", rope=64,
                               layouts=("TND", "PA_BSND"), sbs=2, q_n=4, K=24, stray_stop=True)
    cfg = KernelConfig(block_h=16, block_n=16, two_pass=two_pass, num_warps=1)
    from qsfa.kernels import qsfa_split

    plans = []
    real = qsfa_split.split_plan
    qsfa_split.split_plan = lambda *a: plans.append(real(*a)) or plans[-1]
    try:
        split = [_np(x) for x in check_attention_naive(args, config=cfg, split_kv=chunk)]
    finally:
        qsfa_split.split_plan = real
    assert plans == [chunk] and -(-48 // chunk) >= 2  # K 24 x sbs 2 = 48 positions: the path really split
    whole = [_np(x) for x in _launch(args, config=cfg, split_kv="off")]
    for a, b, dt in zip(split, whole, ("bfloat16", "float32", "float32")):
        r = compare_float(a, b, dtype=dt)
        assert r.passed, str(r)


def test_attention_split_kv_fp16_rope0_and_plan():
    from qsfa.kernels.qsfa_split import split_plan

    args = _prefill_case("float16", 0, sbs=1)
    cfg = KernelConfig(block_h=16, block_n=16, two_pass=True, num_warps=1)
    check_attention_naive(args, config=cfg, split_kv=16)
    assert split_plan(16, 32, 1, 16, "cpu") == 16
    assert split_plan(20, 64, 1, 16, "cpu") == 32          # rounded up to a multiple of block_n
    assert split_plan(64, 64, 1, 16, "cpu") == 0           # one chunk covers the row: no split
    assert split_plan("off", 4096, 1, 16, "cpu") == 0
    assert split_plan("auto", 4096, 1, 16, "cpu") == 0     # auto never splits off a CUDA device
    assert split_plan("on", 4096, 1, 16, "cpu") == 256
    with pytest.raises(ValueError, match="split_kv"):
        split_plan("sometimes", 4096, 1, 16, "cpu")
