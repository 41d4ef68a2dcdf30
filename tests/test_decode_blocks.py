"""qsfa.reference._decode_blocks: the bit-level bf16 rounding and the blocked dequantisation of the faithful QSFA
oracle (issue 15) against the casts and the whole-array code they replace."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qsfa.reference import _decode_blocks as D
from qsfa.reference import attention as A
from qsfa.reference import formats

BF16 = np.dtype(ml_dtypes.bfloat16)


def _hard_f32():
    """fp32 values around every kind of bf16 rounding decision: ties (both parities), just above / below a tie,
    subnormals, the overflow boundary, zeros and infinities, both signs."""
    rng = np.random.default_rng(7)
    hi = rng.integers(0, 0x7F80, 4000, dtype=np.uint32) << np.uint32(16)  # finite bf16 patterns
    lows = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    bits = (hi[:, None] | lows[None, :]).reshape(-1)
    bits = np.concatenate([bits, rng.integers(0, 0x7F800000, 20000, dtype=np.uint32),
                           np.array([0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0x00000001, 0x00008000,
                                     0x00018000, 0x007FFFFF], np.uint32)])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    return bits.view(np.float32)


@pytest.mark.parametrize("mode", ["rint", "round"])
def test_bf16_bits_equal_the_casts(mode):
    x = _hard_f32()
    want = formats.round_to(x, "bfloat16", rounding=mode) if mode == "round" else x.astype(BF16)
    want = np.asarray(want).astype(np.float32)
    got = x.copy()
    with np.errstate(over="ignore"):
        D.bf16_bits_inplace(got.view(np.uint32), mode)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.array_equal(got.view(np.uint32), A.round_to_query_dtype(x, "bfloat16", mode).view(np.uint32))


def _packed(rng, n, fmt, qdt, rope=64, scale_fill=None):
    kvd = 512 + 2 * rope + 16
    rows = np.zeros((n, kvd), np.uint8)
    if fmt == "int8":
        rows[:, :512] = rng.integers(-128, 128, (n, 512)).astype(np.int8).view(np.uint8)
    else:
        rows[:, :512] = rng.integers(0, 256, (n, 512)).astype(np.uint8)
    if rope:
        with np.errstate(over="ignore"):  # fp16 RoPE values beyond its range become inf, as stored
            rows[:, 512:512 + 2 * rope] = (rng.standard_normal((n, rope)) * np.exp(rng.uniform(-30, 30, (n, rope)))
                                           ).astype(A._QDT[qdt]).view(np.uint8)
    sc = (rng.uniform(0.5, 2, (n, 4)) * 2.0 ** rng.integers(-140, 120, (n, 4))).astype(np.float32)
    if scale_fill is not None:  # a non-finite scale and a zero code in its tile: a NaN product
        sc[3, 1] = scale_fill
        rows[3, 128] = 0
    rows[:, kvd - 16:] = sc.view(np.uint8)
    return rows


def _whole_array(packed, fmt, qdt, k_mode, rope):
    """The reference: decode * scale in fp32 over the whole array, rounded with round_q16, widened."""
    n = packed.shape[0]
    off = 512 + 2 * rope
    sc = np.ascontiguousarray(packed[:, off:off + 16]).view("<f4")
    with np.errstate(over="ignore", invalid="ignore"):
        prod = A.decode_nope(packed[:, :512], fmt).reshape(n, 4, 128) * sc[:, :, None]
    k = np.zeros((n, 576))
    k[:, :512] = A.round_q16(prod.reshape(n, 512), qdt, k_mode).astype(np.float64)
    if rope:
        k[:, 512:] = packed[:, 512:off].view(A._QDT[qdt]).astype(np.float64)
    return k


@pytest.mark.parametrize("fmt,qdt,k_mode,rope,scale_fill", [
    ("int8", "bfloat16", "rint", 64, None), ("int8", "bfloat16", "round", 64, None),
    ("int8", "bfloat16", "rint", 0, None), ("int8", "bfloat16", "rint", 64, np.inf),  # inf scale: NaN products
    ("int8", "float16", "round", 64, None), ("float8_e4m3fn", "bfloat16", "rint", 64, None),
    ("hifloat8", "float16", "rint", 64, None)])
def test_blocked_dequantisation_equals_the_whole_array(fmt, qdt, k_mode, rope, scale_fill):
    rng = np.random.default_rng(11)
    n = D.DEQUANT_ROWS * 2 + 37  # several blocks and a partial one
    packed = _packed(rng, n, fmt, qdt, rope, scale_fill)
    want = _whole_array(packed, fmt, qdt, k_mode, rope)
    k, facts = D.qsfa_keys(packed, fmt=fmt, qdt=qdt, k_mode=k_mode, rope=rope, exact=False)
    if fmt == "int8":  # (random FP8 / HiFloat8 codes include NaN codes)
        assert np.isnan(k).any() == (scale_fill is not None)
    assert np.array_equal(k.view(np.uint64), want.view(np.uint64)) or (
        np.array_equal(np.isnan(k), np.isnan(want)) and np.array_equal(k[~np.isnan(k)], want[~np.isnan(want)]))
    off = 512 + 2 * rope
    sc = np.ascontiguousarray(packed[:, off:off + 16]).view("<f4")
    ref = A.qsfa_row_facts(packed[:, :512], sc, fmt, qdt, packed[:, 512:off].view(np.uint16) if rope else None,
                           want[:, 512:] if rope else None)
    for got, exp in zip(facts, ref):
        assert np.array_equal(got, exp)
    k_exact, none = D.qsfa_keys(packed, fmt=fmt, qdt=qdt, k_mode=k_mode, rope=rope, exact=True)
    assert none is None
    with np.errstate(invalid="ignore"):
        exact = A.decode_nope(packed[:, :512], fmt, np.float64).reshape(n, 4, 128) * sc.astype(np.float64)[:, :, None]
    np.testing.assert_array_equal(k_exact[:, :512], exact.reshape(n, 512))


@pytest.mark.parametrize("qdt,rounding,p_mode", [("bfloat16", "unnormalised", "round"),
                                                  ("bfloat16", "normalised", "rint"),
                                                  ("float16", "unnormalised", "round")])
def test_softmax_blocks_do_not_change_the_bytes(qdt, rounding, p_mode, monkeypatch):
    """Blocks of rows (several, the last partial) give the bytes of one block over the whole chunk, with masked
    tokens, a row whose scores are all masked, exp values that underflow to 0 and a NaN score."""
    rng = np.random.default_rng(3)
    c, nh, w = 3, 5, 40
    s = (rng.standard_normal((c, nh, w)) * np.exp(rng.uniform(-2, 5, (c, nh, w)))).astype(np.float32)
    s[1, 2, :5] = np.nan
    valid = rng.random((c, w)) < 0.8
    valid[2] = False
    outs = []
    for elems in (3 * w + 7, 1 << 30):  # 3 rows and a bit per block / one block
        monkeypatch.setattr(D, "SOFTMAX_ELEMS", elems)
        p = np.empty((c, nh, w))
        with np.errstate(invalid="ignore"):
            m, l, e_min = D.softmax_rows(s.copy(), valid, np.float32(0.7), qdtype=qdt, probability_rounding=rounding,
                                         p_mode=p_mode, p_out=p)
        outs.append((p, m, l, e_min))
    for a, b in zip(*outs):
        assert a.tobytes() == b.tobytes()
    p, m, l, e_min = outs[0]
    assert np.isnan(p[1, 2]).all() and not np.isnan(p[0]).any()
    if rounding == "unnormalised":  # the all-masked row: every e = exp(0) = 1
        assert np.all(p[2] == 1.0) and np.all(l[2] == w)
    assert np.isinf(e_min[1, 2]) and np.isfinite(np.delete(e_min.reshape(-1), nh + 2)).all()
    assert (e_min[0] < 1e-30).any()  # underflowing exp: the smallest non-zero e is tiny
    assert (p[0][:, ~valid[0]] == 0).all()
