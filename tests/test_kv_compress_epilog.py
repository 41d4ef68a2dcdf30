"""KvCompressEpilog (docs/numerics/cache-writers.md#kv_compress_epilog): row widths, hand-worked rows of all three modes (zero groups included),
the round_scale=False quirk, strided caches, and random rows against a slow per-token loop (ml_dtypes /
en_dtypes encoders)."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import qsfa
from qsfa.reference.kv_compress_epilog import kv_cache_col

BF16 = ml_dtypes.bfloat16
F32 = np.float32
RECIP_448 = np.array(0x3B124925, np.uint32).view(np.float32)[()]


def _cache(bn=2, bs=4, hd=704, fill=17):
    return np.full((bn, bs, 1, hd), fill, np.uint8)


def test_kv_cache_col():
    assert kv_cache_col(512, 1) == 583  # docs/numerics/cache-writers.md#kv_compress_epilog: 128 + 448 + 7
    assert kv_cache_col(512, 0) == 608  # roundup(128 + 448 + 14, 32)
    assert kv_cache_col(512, 0, pad_to=128) == 640
    assert kv_cache_col(512, 2, 64) == 320  # roundup(64 + 224 + 14, 32)
    assert kv_cache_col(512, 2, 16, pad_to=128) == 384  # 64 + 224 + 56 = 344
    assert kv_cache_col(576, 1) == 128 + 512 + 8


def _x128(nope_vals, rope_vals):
    x = np.zeros((1, 128), BF16)
    x[0, : len(nope_vals)] = nope_vals
    x[0, 64: 64 + len(rope_vals)] = rope_vals
    return x


def test_mode1_hand_worked_round_scale():
    x = _x128([1.0, -0.5, 0.25], [1.0, -2.0])
    cache = _cache(hd=224)
    qsfa.kv_compress_epilog(cache, x, np.array([5]), quant_mode=1)
    row = cache[1, 1, 0].tolist()
    # RoPE raw bf16 bits first: 1.0 = 0x3F80, -2.0 = 0xC000 (little-endian)
    assert row[0:4] == [0x80, 0x3F, 0x00, 0xC0] and not any(row[4:128])
    # amax 1 -> s = 1 * fp32(1/448) ~ 2^-8.8 -> ceiled to 2^-8; codes of 256, -128, 64
    assert row[128:131] == [0x78, 0xF0, 0x68] and not any(row[131:192])
    assert row[192] == 127 - 8  # E8M0 byte of 2^-8
    assert row[193:] == [17] * 31  # kvCacheCol = 193; the rest of headDim keeps its bytes
    assert np.all(np.delete(cache.reshape(8, 224), 5, axis=0) == 17)


def test_mode1_round_scale_false_quirk():
    x = _x128([1.0, -0.5], [])
    cache = _cache(hd=224)
    qsfa.kv_compress_epilog(cache, x, np.array([0]), quant_mode=1, round_scale=False)
    row = cache[0, 0, 0].tolist()
    # data scaled by the unrounded s = fp32(1/448): 1 / s = 447.99997 -> 448 (0x7E); -0.5 / s -> -224 (0xF6)
    assert F32(1.0) / RECIP_448 == F32(447.99997)
    assert row[128:130] == [0x7E, 0xF6]
    assert row[192] == 127 - 9  # but the byte is the floor exponent of s (2^-9), not its ceiling


def test_mode0_hand_worked_bf16_scale_and_padding():
    x = _x128([1.0, -0.5, 0.25], [1.0])
    cache = _cache(hd=256)
    qsfa.kv_compress_epilog(cache, x, np.array([2]), quant_mode=0)
    row = cache[0, 2, 0].tolist()
    assert row[128:131] == [0x78, 0xF0, 0x68]
    assert row[192:194] == [0x80, 0x3B]  # bf16 2^-8 = 0x3B80
    assert row[194:224] == [0] * 30  # zero padding up to kvCacheCol = 224
    assert row[224:] == [17] * 32


@pytest.mark.parametrize("mode,round_scale,scale_bytes", [
    (0, True, [0x80, 0x34]),   # 2^-22 -> bf16 0x3480
    (0, False, [0x70, 0x34]),  # 1e-4 * fp32(1/448) = 2.2321e-7 -> bf16 0x3470
    (1, True, [0x69]),         # E8M0 0x69 = 2^-22
    (1, False, [0x68]),        # floor exponent of 2.2321e-7 = 2^-23
])
def test_zero_group_bytes_modes_0_1(mode, round_scale, scale_bytes):
    x = np.zeros((1, 192), BF16)  # n = 128: two zero groups
    cache = _cache(hd=320)
    qsfa.kv_compress_epilog(cache, x, np.array([0]), quant_mode=mode, round_scale=round_scale)
    row = cache[0, 0, 0].tolist()
    assert not any(row[:256])  # RoPE zeros, FP8 codes 0
    k = len(scale_bytes)
    assert row[256:256 + 2 * k] == scale_bytes * 2


def test_mode2_hand_worked_rows_and_zero_group():
    x = _x128([6.0, -3.0, 1.5, 0.5], [1.0, -0.25, 0.0, 0.5])
    cache = _cache(hd=160)
    qsfa.kv_compress_epilog(cache, x, np.array([3]), quant_mode=2, quant_group_size=32, x_scale=2.0)
    row = cache[0, 3, 0].tolist()
    # RoPE: HiF8(x * 2): 2.0 = 0x10, -0.5 = 0x98, 0 = 0x00, 1.0 = 0x08
    assert row[0:4] == [0x10, 0x98, 0x00, 0x08] and not any(row[4:64])
    # group 0: amax 6 -> inv = bf16(6/6) = 1; E2M1 codes 6 -> 7, -3 -> 0xD, 1.5 -> 3, 0.5 -> 1; low nibble first
    assert row[64:66] == [0xD7, 0x13] and not any(row[66:96])
    # scales: bf16(6 * fp32(1/6)) = 1.0 = 0x3F80; group 1 is all zero: scale 0x0000
    assert row[96:100] == [0x80, 0x3F, 0x00, 0x00]
    assert row[100:128] == [0] * 28 and row[128:] == [17] * 32  # kvCacheCol = roundup(100, 32)
    high = _cache(hd=160)
    qsfa.kv_compress_epilog(high, x, np.array([3]), quant_mode=2, quant_group_size=32, x_scale=2.0,
                            fp4_nibble_order="high_first", pad_to=128)
    hrow = high[0, 3, 0].tolist()
    assert hrow[64:66] == [0x7D, 0x31] and hrow[100:128] == [0] * 28 and hrow[128:] == [17] * 32


def test_strided_cache_and_leading_dims():
    parent = np.full((6, 4, 1, 640), 17, np.uint8)
    view = parent[::2]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 512)).astype(BF16)
    slots = np.array([[0, -1, 5], [11, 2, -1]], np.int32)
    out = qsfa.kv_compress_epilog(view, x, slots)
    assert out is view
    flat = qsfa.kv_compress_epilog(_cache(3, 4, 640), x.reshape(6, 512), slots.reshape(6).astype(np.int64))
    assert np.array_equal(parent[::2], flat)
    assert np.all(parent[1::2] == 17)


# ----------------------------------------------------------------------------- slow loop


def _hif8(v):
    en = pytest.importorskip("en_dtypes")
    v = np.clip(np.float32(v), -32768, 32768)
    code = int(np.array([v], np.float32).astype(en.hifloat8).view(np.uint8)[0])
    return 0 if code == 0x80 else code  # -0 -> the single zero


def _slow_row(x, mode, gs, round_scale, x_scale, pad_to, order):
    """One KvCompressEpilog row, element by element with numpy float32 scalars."""
    d = x.shape[0]
    n = d - 64
    xf = x.astype(np.float32)
    out = []
    if mode in (0, 1):
        out += list(np.ascontiguousarray(x[n:]).view(np.uint8))
        scales = []
        for g in range(n // 64):
            grp = xf[g * 64:(g + 1) * 64]
            s = F32(max(F32(np.max(np.abs(grp))), F32(1e-4)) * RECIP_448)
            if round_scale:
                b = int(np.array([s], np.float32).view(np.uint32)[0])
                s = np.array([((b >> 23) + (1 if b & 0x7FFFFF else 0)) << 23], np.uint32).view(np.float32)[0]
            scales.append(s)
            for v in grp:
                y = np.clip(F32(v / s), F32(-448), F32(448))
                out.append(int(np.array([y], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0]))
        for s in scales:
            if mode == 0:
                out += list(np.array([s], np.float32).astype(BF16).view(np.uint8))
            else:
                out.append((int(np.array([s], np.float32).view(np.uint32)[0]) >> 23) & 0xFF)
    else:
        out += [_hif8(F32(v * F32(x_scale))) for v in xf[n:]]
        codes, scales = [], []
        for g in range(n // gs):
            grp = xf[g * gs:(g + 1) * gs]
            amax = F32(np.max(np.abs(grp)))
            scales.append(np.array([amax * F32(1.0 / 6.0)], np.float32).astype(BF16))
            inv = F32(np.array([F32(6.0) / amax if amax else 0], np.float32).astype(BF16)[0])
            for v in grp:
                p = F32(np.array([F32(v * inv)], np.float32).astype(BF16)[0])
                p = np.clip(p, F32(-6), F32(6))
                codes.append(int(np.array([p], np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)[0]))
        for i in range(0, n, 2):
            a, b = codes[i], codes[i + 1]
            out.append(a | (b << 4) if order == "low_first" else b | (a << 4))
        for s in scales:
            out += list(s.view(np.uint8))
    while len(out) % pad_to and mode != 1:
        out.append(0)
    return out


@st.composite
def _kce_case(draw):
    mode = draw(st.sampled_from([0, 1, 2]))
    d = draw(st.sampled_from([128, 192, 576]))
    gs = draw(st.sampled_from([16, 32, 64]))
    bn, bs = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4]))
    t = draw(st.integers(1, min(5, bn * bs)))
    slots = draw(st.permutations(list(range(bn * bs))))[:t]
    skips = draw(st.lists(st.booleans(), min_size=t, max_size=t))
    slots = np.array([-1 if k else s for s, k in zip(slots, skips)], np.int64)
    return (mode, d, gs, bn, bs, slots, draw(st.booleans()), draw(st.sampled_from([1.0, 0.25, 300.0])),
            draw(st.sampled_from([32, 128])), draw(st.sampled_from(["low_first", "high_first"])),
            draw(st.sampled_from([1e-6, 1.0, 1e4])), draw(st.integers(0, 2**32 - 1)))


@given(_kce_case())
def test_random_rows_against_slow_loop_and_permutation(case):
    mode, d, gs, bn, bs, slots, rs, xs, pad, order, mag, seed = case
    rng = np.random.default_rng(seed)
    t = slots.size
    x = (rng.standard_normal((t, d)) * mag).astype(BF16)
    x[0, :64] = 0  # an all-zero group
    col = kv_cache_col(d, mode, gs, pad)
    hd = col + 8
    kw = dict(quant_mode=mode, quant_group_size=gs, round_scale=rs, x_scale=xs, pad_to=pad, fp4_nibble_order=order)
    got = qsfa.kv_compress_epilog(_cache(bn, bs, hd), x, slots, **kw)
    expect = _cache(bn, bs, hd)
    for i, s in enumerate(slots):
        if s != -1:
            row = _slow_row(x[i], mode, gs, rs, xs, pad, order)
            assert len(row) == col
            expect[s // bs, s % bs, 0, :col] = row
    assert got.tobytes() == expect.tobytes()
    perm = rng.permutation(t)
    again = qsfa.kv_compress_epilog(_cache(bn, bs, hd), x[perm], slots[perm], **kw)
    assert again.tobytes() == got.tobytes()


@pytest.mark.parametrize("kw,cid", [
    (dict(cache=np.full((2, 4, 1, 582), 17, np.uint8)), "kv_compress_epilog.head_dim"),
    (dict(slot_mapping=np.array([1, 1])), "kv_compress_epilog.slot_mapping_unique"),
    (dict(slot_mapping=np.array([1, 8])), "kv_compress_epilog.slot_mapping_range"),
    (dict(quant_mode=2, quant_group_size=8), "kv_compress_epilog.quant_group_size_value"),
    (dict(x=np.ones((2, 544), BF16)), "kv_compress_epilog.x_last_dim"),
    (dict(x=np.ones((2, 512), np.float16)), "kv_compress_epilog.x_dtype"),
])
def test_rejections_write_nothing(kw, cid):
    args = dict(cache=np.full((2, 4, 1, 600), 17, np.uint8), x=np.ones((2, 512), BF16),
                slot_mapping=np.array([0, 1]))
    args.update(kw)
    with pytest.raises((qsfa.InvalidArgument, qsfa.InvalidDtype)) as ei:
        qsfa.kv_compress_epilog(**args)
    assert ei.value.constraint_id == cid
    assert np.all(args["cache"] == 17)
