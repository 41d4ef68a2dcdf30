"""indexer_quant_cache and indexer_compress_epilog_v2 (docs/numerics/cache-writers.md#indexer_quant_cache,
#indexer_compress_epilog_v2): the public kernel golden, hand-worked bytes, and an independent computation.

Expected bytes are either worked out by hand in the comments, copied from the public kernel unit test, or computed
by ``_independent_*`` below - a per-group Python loop over math.frexp and ml_dtypes casts that shares no code with
qsfa.reference.indexer_cache.
"""

import math

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa.formats import encode

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
F32 = np.float32
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
ML = {"e4m3": E4M3, "e5m2": E5M2}


def _u8(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _caches(nb, bs, w, ws, cdt, sdt, fill=0xA5):
    return (np.full((nb, bs, 1, w), fill, np.uint8).view(cdt) if cdt != F32 else None,
            np.full((nb, bs, 1, ws * np.dtype(sdt).itemsize), fill, np.uint8).view(sdt))


# ------------------------------------------------------------------------------------------- public golden


@pytest.mark.parametrize("round_scale,codes,scale", [(True, (0x78, 0xF0), 0x3B800000), (False, (0x7E, 0xF6), 0x3B124925)])
def test_the_kernel_unit_test_golden(round_scale, codes, scale):
    # cannmirror/ops-transformer@7904813 attention/indexer_quant_cache/tests/ut/op_kernel/arch35/
    # test_indexer_quant_cache_golden.cpp: float16 x alternating 1.0 / -0.5, d 64, slots {0, -1, 2, 3}, E4M3FN cache
    x = np.tile(np.array([1.0, -0.5], np.float16), (4, 32))
    cache = np.zeros((4, 1, 1, 64), np.uint8).view(E4M3)
    cs = np.zeros((4, 1, 1, 1), F32)
    qsfa.indexer_quant_cache(cache, cs, x, np.array([0, -1, 2, 3], np.int32), quant_mode="fp8",
                             round_scale=round_scale)
    for row in (0, 2, 3):
        assert (_u8(cache)[row, 0, 0] == np.tile(np.array(codes, np.uint8), 32)).all()
        assert cs.view(np.uint32)[row, 0, 0, 0] == scale
    assert not _u8(cache)[1].any() and cs[1].view(np.uint32)[0, 0, 0] == 0


# ------------------------------------------------------------------------------------------- hand-worked bytes


def test_mxfp8_hand_worked():
    # group 0: amax 3 -> s = 3 * fp32(1/448) = 0.0067 in [2^-8, 2^-7) -> 2^-7, E8M0 byte 120 (0x78);
    #   x * 128: 3 -> 384 = 1.5 * 2^8 -> 0x7C; 1 -> 128 -> 0x70; -2 -> -256 -> 0xF8
    # group 1: all zero -> amax floored to 1e-4 -> s = 2.23e-7 in [2^-23, 2^-22) -> 2^-22, byte 105 (0x69), codes 0
    # round_scale=False changes nothing (the kernel's MX-FP8 path always rounds)
    x = np.zeros((1, 64), F32)
    x[0, :3] = [3.0, 1.0, -2.0]
    for rs in (True, False):
        cache, cs = np.zeros((1, 2, 1, 70), np.uint8).view(E4M3), np.zeros((1, 2, 1, 3), np.uint8)
        qsfa.indexer_quant_cache(cache, cs, x.astype(BF16), np.array([1], np.int32), quant_mode="MXFP8",
                                 round_scale=rs)
        assert list(_u8(cache)[0, 1, 0, :4]) == [0x7C, 0x70, 0xF8, 0x00]
        assert not _u8(cache)[0, 1, 0, 4:64].any() and not _u8(cache)[0, 1, 0, 64:].any()
        assert list(cs[0, 1, 0]) == [0x78, 0x69, 0x00]  # the third scale byte is past ceil(d / 32): untouched
        assert not _u8(cache)[0, 0].any()


def test_mxfp4_hand_worked_bf16():
    # group 0: [4, 1.25, -0.75, 0.2, 5.5, 7.5, 0...]: largest exponent field 129 (values in [4, 8)) -> byte 127,
    #   multiplier 2^0; E2M1 (0, .5, 1, 1.5, 2, 3, 4, 6 = codes 0..7): 4 -> 6; 1.25 tie -> 1 (even) -> 2;
    #   -0.75 tie -> -1 -> 0xA; 0.2 -> 0; 5.5 -> 6 -> 7; 7.5 saturates -> 6 -> 7
    #   packed low nibble first: 0x26, 0x0A, 0x77, zeros
    # group 1: [0.5, -0.25, 0...]: field 126 -> byte 124, multiplier 2^3: 4 -> code 6; -2 -> 0xC -> byte 0xC6
    x = np.zeros((1, 64), F32)
    x[0, :6] = [4.0, 1.25, -0.75, 0.2, 5.5, 7.5]
    x[0, 32:34] = [0.5, -0.25]
    cache, cs = np.zeros((2, 1, 1, 32), np.uint8), np.zeros((2, 1, 1, 2), np.uint8)
    qsfa.indexer_quant_cache(cache, cs, x.astype(BF16), np.array([1], np.int32), quant_mode="mxfp4")
    assert list(cache[1, 0, 0, :4]) == [0x26, 0x0A, 0x77, 0x00]
    assert list(cache[1, 0, 0, 16:18]) == [0xC6, 0x00]
    assert list(cs[1, 0, 0]) == [127, 124]
    assert not cache[0].any() and not cs[0].any()


def test_mxfp4_float16_sticky_bit():
    # 1.25 + 2^-10 in float16 has low byte 0x01 -> the kernel sets mantissa bit 3 before truncating to bf16, so
    # the value stays above the 1.0 / 1.5 midpoint: code 3. Truncating without it gives 1.25, a tie -> code 2.
    x = np.zeros((1, 32), np.float16)
    x[0, 0], x[0, 1] = 4.0, np.float16(1.25) + np.float16(2 ** -10)
    assert x.view(np.uint16)[0, 1] & 0xFF == 0x01
    cache, cs = np.zeros((1, 1, 1, 16), np.uint8), np.zeros((1, 1, 1, 1), np.uint8)
    qsfa.indexer_quant_cache(cache, cs, x, np.array([0], np.int32), quant_mode="mxfp4")
    assert cache[0, 0, 0, 0] == 0x36 and cs[0, 0, 0, 0] == 127


def test_fp8_zero_row_keeps_signed_zeros_and_e5m2():
    # an all-zero row: s = 0, inv = 1/0 = Inf (no round) or 2^127 (round); 0 * Inf = NaN -> x itself: -0 -> 0x80
    x = np.zeros((1, 32), F32)
    x[0, 3] = -0.0
    for rs in (True, False):
        cache, cs = np.full((1, 1, 1, 32), 0x11, np.uint8).view(E5M2), np.ones((1, 1, 1, 1), F32)
        qsfa.indexer_quant_cache(cache, cs, x.astype(BF16), np.array([0], np.int32), quant_mode="fp8", round_scale=rs)
        want = np.zeros(32, np.uint8)
        want[3] = 0x80
        assert (_u8(cache)[0, 0, 0] == want).all() and cs[0, 0, 0, 0] == 0
    # E5M2, x = 57344 * 3 = 1.3125 * 2^17: s = x * fp32(1/57344) rounds to exactly 3.0 -> ceiled to 4 (0x40800000);
    # x / 4 = 1.3125 * 2^15 -> E5M2 (two mantissa bits) nearest 1.25 * 2^15: exponent field 30, mantissa 01 = 0x79
    x = np.zeros((1, 32), F32)
    x[0, 0] = 57344.0 * 3
    cache, cs = np.zeros((1, 1, 1, 32), np.uint8).view(E5M2), np.zeros((1, 1, 1, 1), F32)
    qsfa.indexer_quant_cache(cache, cs, x.astype(BF16), np.array([0], np.int32), quant_mode="fp8")
    assert cs.view(np.uint32)[0, 0, 0, 0] == 0x40800000 and _u8(cache)[0, 0, 0, 0] == 0x79


def test_hifloat8_scales_and_leaves_cache_scale():
    # codes of fp32(x * x_scale) by the format layer's HiFloat8 encoder (ties away, saturating: 1e6 * 0.5 -> 32768)
    x = np.zeros((2, 32), F32)
    x[0, :4] = [3.0, -1.0, 100.0, 1e6]
    x[1, 0] = 2.0
    cache, cs = np.zeros((1, 2, 1, 32), np.uint8), np.full((1, 2, 1, 1), 7.0, F32)
    qsfa.indexer_quant_cache(cache, cs, x.astype(BF16), np.array([1, 0], np.int32), quant_mode="hifloat8",
                             x_scale=0.5)
    want = encode(x.astype(BF16).astype(F32) * F32(0.5), "hifloat8", saturate=True, rounding="round")
    assert (cache[0, 1, 0] == want[0]).all() and (cache[0, 0, 0] == want[1]).all()
    assert (cs == 7.0).all()  # not written (docs/numerics/open-facts.md#indexer_quant_cache_hifloat8_scale)


def test_epilog_v2_hand_worked_layout():
    # d 160: group 0 (128 values) amax 448 -> s = 448 * fp32(1/448) rounds to exactly 1.0 (bytes 00 00 80 3F);
    #   x / 1: 448 -> 0x7E, 1 -> 0x38, -2 -> 0xC0. group 1 (32 values) all zero -> s = 0, 0/0 keeps x: -0 -> 0x80
    # cache [2, 2, 1, 168]: slot 3 = block 1, position 1 -> codes at 1 * 160, scales at 2 * 160 + 1 * 8
    x = np.zeros((2, 160), F32)
    x[0, :3] = [448.0, 1.0, -2.0]
    x[0, 130] = -0.0
    cache = np.full((2, 2, 1, 168), 0x5A, np.uint8)
    before = cache.copy()
    out = qsfa.indexer_compress_epilog_v2(cache, x.astype(BF16), np.array([3, -1], np.int32))
    assert out is cache
    blk = cache[1].reshape(-1)
    assert list(blk[160:163]) == [0x7E, 0x38, 0xC0] and not blk[163:290].any() and blk[290] == 0x80
    assert not blk[291:320].any()
    assert list(blk[328:336]) == [0x00, 0x00, 0x80, 0x3F, 0, 0, 0, 0]
    changed = np.flatnonzero((cache != before).reshape(-1))
    assert changed.min() >= 336 + 160 and changed.max() < 336 + 336  # only block 1's slot-1 bytes


# ------------------------------------------------------------------------------------------- independent model


def _ceil_exp(s):
    """Unbiased exponent of the power-of-two ceiling of a positive float."""
    m, ex = math.frexp(float(s))
    return ex - 1 if m == 0.5 else ex


def _fp8(v, fmt):
    return np.array(v, F32).astype(ML[fmt]).view(np.uint8)


def _independent_row(xrow, mode, fmt, round_scale, x_scale):
    """(code bytes, scale bytes) of one token, group by group."""
    xr = xrow.astype(F32)
    d = xr.size
    if mode == "fp8":
        amax = F32(np.abs(xr).max())
        c = F32(1) / F32(FMAX[fmt])
        s = F32(amax * c)
        if amax == 0:
            return _fp8(xr, fmt), np.zeros(1, F32).view(np.uint8)
        if round_scale:
            e = _ceil_exp(s)
            return _fp8(xr * F32(2.0 ** -e), fmt), np.array([2.0 ** e], F32).view(np.uint8)
        return _fp8(xr * (F32(1) / s), fmt), np.array([s], F32).view(np.uint8)
    if mode == "mxfp8":
        codes, sc = [], []
        for g in range(d // 32):
            v = xr[32 * g:32 * g + 32]
            s = F32(max(F32(np.abs(v).max()), F32(1e-4)) * (F32(1) / F32(FMAX[fmt])))
            e = _ceil_exp(s)
            codes.append(_fp8(v * F32(2.0 ** -e), fmt))
            sc.append(e + 127)
        return np.concatenate(codes), np.array(sc, np.uint8)
    if mode == "hifloat8":
        return encode(xr * F32(x_scale), "hifloat8", saturate=True, rounding="round"), None
    # mxfp4 (bf16 x only here): exponent field of each element
    codes, sc = [], []
    for g in range(d // 32):
        v = xr[32 * g:32 * g + 32].astype(np.float64)
        fields = [0 if (a == 0 or a < 2.0 ** -126) else math.frexp(a)[1] - 1 + 127 for a in np.abs(v)]
        fm = max(fields)
        byte = max(fm - 2, 0)
        mult = 0.0 if fm == 0 else 2.0 ** (127 - byte)
        q = np.clip(v * mult, -6, 6).astype(F32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
        codes.append(q)
        sc.append(byte)
    q = np.concatenate(codes)
    return (q[0::2] | (q[1::2] << 4)).astype(np.uint8), np.array(sc, np.uint8)


CASES = [("fp8", "e4m3", True), ("fp8", "e4m3", False), ("fp8", "e5m2", True), ("fp8", "e5m2", False),
         ("mxfp8", "e4m3", True), ("mxfp8", "e5m2", True), ("hifloat8", None, True), ("mxfp4", None, True)]


def _x(rng, t, d, dtype=BF16):
    x = rng.standard_normal((t, d)) * np.exp2(rng.integers(-12, 12, (t, 1)))
    x[0, :] = 0  # an all-zero token
    x[1, 32:64] = 0  # an all-zero group
    x[2, 5] = 1e-30 if dtype == BF16 else 1e-6  # tiny values (bf16 keeps 1e-30 normal)
    return x.astype(dtype)


@pytest.mark.parametrize("mode,fmt,rs", CASES)
def test_against_the_independent_model(mode, fmt, rs):
    rng = np.random.default_rng(hash((mode, fmt, rs)) % 2 ** 32)
    t, d, nb, bs = 9, 96, 4, 3
    x = _x(rng, t, d)
    slots = np.array([5, 0, 11, -1, 3, 7, 1, 9, 2], np.int32)
    cdt = {"e4m3": E4M3, "e5m2": E5M2, None: np.uint8}[fmt]
    w = d // 2 if mode == "mxfp4" else d
    sdt, ws = (np.uint8, 3) if mode in ("mxfp8", "mxfp4") else (F32, 1)
    cache = np.full((nb, bs, 1, w + 5), 0xC3, np.uint8).view(cdt)
    cs = np.full((nb, bs, 1, ws + 2), 0x3C, np.uint8) if sdt == np.uint8 else np.full((nb, bs, 1, ws + 2), -9.5, F32)
    c0, s0 = _u8(cache).copy(), _u8(cs).copy()
    qsfa.indexer_quant_cache(cache, cs, x, slots, quant_mode=mode, round_scale=rs, x_scale=0.375)
    wc, wsb = c0.copy(), s0.copy()
    for i, s in enumerate(slots):
        if s < 0:
            continue
        codes, sc = _independent_row(x[i], mode, fmt, rs, 0.375)
        wc[s // bs, s % bs, 0, :codes.size] = codes
        if sc is not None:
            wsb[s // bs, s % bs, 0, :sc.size] = sc
    assert _u8(cache).tobytes() == wc.tobytes()
    assert _u8(cs).tobytes() == wsb.tobytes()


def test_float16_x_matches_the_independent_model_away_from_the_sticky_bit():
    # float16 values with a zero low byte need no sticky bit: the MX-FP4 bytes equal the bf16 model's
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 64)) * 8).astype(np.float16)
    x = (x.view(np.uint16) & np.uint16(0xFF00)).view(np.float16)
    cache, cs = np.zeros((1, 4, 1, 32), np.uint8), np.zeros((1, 4, 1, 2), np.uint8)
    qsfa.indexer_quant_cache(cache, cs, x, np.arange(4, dtype=np.int32), quant_mode="mxfp4")
    for i in range(4):
        codes, sc = _independent_row(x[i], "mxfp4", None, True, 1.0)
        assert cache[0, i, 0].tobytes() == codes.tobytes() and cs[0, i, 0].tobytes() == sc.tobytes()


def _independent_epilog(x, slots, nb, bs, width, fill):
    t, d = x.shape
    g = -(-d // 128)
    out = np.full((nb, bs * width), fill, np.uint8)
    for i, s in enumerate(slots):
        if s < 0:
            continue
        b, p = divmod(int(s), bs)
        xr = x[i].astype(F32)
        for j in range(g):
            v = xr[128 * j:128 * j + 128]
            sc = F32(F32(np.abs(v).max()) * (F32(1) / F32(448)))
            q = v if sc == 0 else (v / sc).astype(F32)
            out[b, p * d + 128 * j:p * d + 128 * j + v.size] = _fp8(q, "e4m3")
            out[b, bs * d + p * 4 * g + 4 * j:bs * d + p * 4 * g + 4 * j + 4] = np.array([sc], "<f4").view(np.uint8)
    return out


@pytest.mark.parametrize("d", [128, 200, 64])
def test_epilog_v2_against_the_independent_model(d):
    rng = np.random.default_rng(d)
    nb, bs = 3, 4
    width = d + 4 * -(-d // 128) + 3
    x = _x(rng, 7, d)
    slots = np.array([4, 11, -1, 0, 7, 2, 9], np.int32)
    cache = np.full((nb, bs, 1, width), 0x77, np.uint8)
    qsfa.indexer_compress_epilog_v2(cache, x, slots)
    assert cache.reshape(nb, -1).tobytes() == _independent_epilog(x, slots, nb, bs, width, 0x77).tobytes()


def test_strided_block_dimension_is_written_in_place():
    # vLLM-Ascend passes stride(0) as block_stride: a cache whose blocks sit apart in a bigger buffer
    rng = np.random.default_rng(3)
    x = _x(rng, 4, 128, np.float16)
    buf = np.full((6, 2, 1, 132), 0x44, np.uint8)
    cache = buf[::2]
    slots = np.array([1, 4, -1, 2], np.int32)
    qsfa.indexer_compress_epilog_v2(cache, x, slots)
    dense = np.full((3, 2, 1, 132), 0x44, np.uint8)
    qsfa.indexer_compress_epilog_v2(dense, x, slots)
    assert buf[::2].tobytes() == dense.tobytes() and (buf[1::2] == 0x44).all()
    qc, qs = buf[::2].view(E4M3)[..., :128], np.zeros((6, 2, 1, 1), F32)[::2]
    with pytest.raises(qsfa.InvalidArgument, match="only the block dimension may be strided"):
        qsfa.indexer_quant_cache(qc, qs, x, slots)


# ------------------------------------------------------------------------------------------- errors, chips


@pytest.mark.parametrize("kw,match", [
    (dict(quant_mode="int4"), "Invalid value for quant_mode"),
    (dict(quant_mode="fp8"), "Invalid dtype for cache, actual: uint8 with quant_mode 'fp8'"),
    (dict(x_scale=float("nan")), "Invalid value for x_scale"),
])
def test_quant_cache_errors_before_any_write(kw, match):
    x = np.ones((2, 64), BF16)
    cache, cs = np.zeros((1, 2, 1, 32), np.uint8), np.zeros((1, 2, 1, 2), np.uint8)
    args = dict(quant_mode="mxfp4")
    args.update(kw)
    with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype), match=match):
        qsfa.indexer_quant_cache(cache, cs, x, np.array([0, 1], np.int32), **args)
    assert not cache.any() and not cs.any()


def test_epilog_v2_width_error_and_a2a3_rule():
    x = np.ones((1, 256), BF16)
    cache = np.zeros((1, 1, 1, 263), np.uint8)
    with pytest.raises(qsfa.InvalidArgument, match=r"head_dim 263 < 264"):
        qsfa.indexer_compress_epilog_v2(cache, x, np.array([0], np.int32))
    cache = np.zeros((1, 1, 1, 264), np.uint8)
    with pytest.raises(qsfa.InvalidArgument, match="runs on Ascend 950 only"):
        qsfa.indexer_compress_epilog_v2(cache, x, np.array([0], np.int32), chip="A3")
    assert not cache.any()
    qsfa.indexer_compress_epilog_v2(cache, x, np.array([0], np.int32), chip="950")
    assert cache.any()


@pytest.mark.parametrize("mode", ["mxfp8", "fp8", "hifloat8", "mxfp4", "epilog_v2"])
def test_a_request_alone_equals_the_same_request_inside_an_uneven_batch(mode):
    # two requests of 12 and 11 tokens (cu_seqlens [0, 12, 23], the uneven prefill of vLLM-Ascend #9496): the second
    # written alone leaves exactly the bytes it leaves when written together with the first
    rng = np.random.default_rng(9)
    x = _x(rng, 23, 128)
    slots = rng.permutation(32)[:23].astype(np.int32)
    if mode == "epilog_v2":
        def write(xs, ss):
            c = np.full((8, 4, 1, 132), 0x3C, np.uint8)
            qsfa.indexer_compress_epilog_v2(c, xs, ss)
            return c.tobytes()
    else:
        def write(xs, ss):
            w = 64 if mode == "mxfp4" else 128
            cdt = E4M3 if mode in ("fp8", "mxfp8") else np.uint8
            c = np.full((8, 4, 1, w), 0x3C, np.uint8).view(cdt)
            s = np.full((8, 4, 1, 4), 0x3C, np.uint8) if mode in ("mxfp8", "mxfp4") else np.full((8, 4, 1, 1), 2.0, F32)
            qsfa.indexer_quant_cache(c, s, xs, ss, quant_mode=mode, x_scale=0.5)
            return _u8(c).tobytes() + _u8(s).tobytes()
    both = write(x, slots)
    first_skipped = slots.copy()
    first_skipped[:12] = -1
    assert write(x[12:], slots[12:]) == write(x, first_skipped)
    assert both != write(x[12:], slots[12:])  # the first request's slots were written too


@pytest.mark.parametrize("bad", [1e300, -1e39, float("inf"), float("nan"), 2 ** 1100])
def test_x_scale_is_a_float32_attribute(bad):
    """x_scale is a float32 kernel attribute like the other kernels' float ones: a magnitude float32 cannot hold
    is refused by name before anything is written."""
    x = np.ones((1, 32), BF16)
    cache, cs = np.zeros((1, 1, 1, 32), np.uint8), np.zeros((1, 1, 1, 1), F32)
    with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype), match="for x_scale, actual: "):
        qsfa.indexer_quant_cache(cache, cs, x, np.array([0], np.int32), quant_mode="hifloat8", x_scale=bad)
    assert not cache.any()


def test_a_large_integer_x_scale_is_its_float32_value():
    """2**64 is a float32 value (it raised a bare TypeError from np.isfinite): it scales like 2.0**64."""
    x = np.full((1, 32), 2.0 ** -70, BF16)
    outs = []
    for s in (2 ** 64, 2.0 ** 64):
        cache, cs = np.zeros((1, 1, 1, 32), np.uint8), np.zeros((1, 1, 1, 1), F32)
        qsfa.indexer_quant_cache(cache, cs, x, np.array([0], np.int32), quant_mode="hifloat8", x_scale=s)
        outs.append(cache.copy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0][0, 0, 0], encode(np.full(32, 2.0 ** -6, F32), "hifloat8", saturate=True,
                                                           rounding="round"))
