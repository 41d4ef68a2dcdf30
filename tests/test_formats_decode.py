"""Every code of every format decodes to the right value (docs/numerics/formats.md#summary).

Expected values are derived here independently of qsfa: the IEEE-like bit-field formula written out
plainly, HiFloat8 by reading the prefix table of docs/numerics/formats.md#hifloat8 literally from the bit string, int8 from NumPy's
two's complement view; and cross-checked against ml_dtypes / en_dtypes where their semantics agree
(decoding agrees everywhere: the differences docs/numerics/formats.md#summary lists are all on the encode side).
"""

import math

import en_dtypes
import ml_dtypes
import numpy as np
import pytest

from qsfa.reference import formats as F


def _same(a, b):
    """Equal as float32 values, NaN == NaN, and the sign of zero must match too."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    assert a.shape == b.shape
    both_nan = np.isnan(a) & np.isnan(b)
    eq = (a == b) & (np.signbit(a) == np.signbit(b))
    bad = ~(both_nan | eq)
    assert not bad.any(), f"first mismatches at {np.flatnonzero(bad)[:8]}: {a[bad][:8]} vs {b[bad][:8]}"


def ieee_like_values(n_codes, ebits, mbits, bias, *, inf, nan, signed=True, subnormals=True):
    """Decoded value of every code 0..n_codes-1 of an IEEE-like format, by the field formula."""
    c = np.arange(n_codes, dtype=np.int64)
    sign = ((c >> (ebits + mbits)) & 1) if signed else np.zeros_like(c)
    e = (c >> mbits) & ((1 << ebits) - 1)
    m = c & ((1 << mbits) - 1)
    if subnormals:
        mag = np.where(e == 0, m * 2.0 ** (1 - bias - mbits), (1.0 + m / 2.0**mbits) * np.exp2(e - bias))
    else:
        mag = (1.0 + m / 2.0**mbits) * np.exp2(e - bias)
    e_all = e == (1 << ebits) - 1
    if inf:  # IEEE: exponent all ones -> Inf (mantissa 0) / NaN
        mag = np.where(e_all & (m == 0), np.inf, mag)
        mag = np.where(e_all & (m != 0), np.nan, mag)
    if nan == "ones":  # only the all-ones magnitude is NaN
        mag = np.where(e_all & (m == (1 << mbits) - 1), np.nan, mag)
    return np.where(sign == 1, -mag, mag)


def hifloat8_values_from_spec():
    """HiFloat8 by reading the table of docs/numerics/formats.md#hifloat8 literally: the prefix ("dot") says how many exponent bits
    follow; the exponent field is sign-magnitude with an implicit leading 1; 0000mmm are denormals."""
    out = []
    for code in range(256):
        neg = code >= 128
        bits = format(code & 0x7F, "07b")
        if bits.startswith("11"):
            d, rest = 4, bits[2:]
        elif bits.startswith("10"):
            d, rest = 3, bits[2:]
        elif bits.startswith("01"):
            d, rest = 2, bits[2:]
        elif bits.startswith("001"):
            d, rest = 1, bits[3:]
        elif bits.startswith("0001"):
            d, rest = 0, bits[4:]
        else:
            d, rest = None, bits[4:]
        if d is None:
            m = int(rest, 2)
            v = 0.0 if m == 0 else math.ldexp(1.0, m - 23)
        else:
            efield, mfield = rest[:d], rest[d:]
            if d == 0:
                e = 0
            else:
                mag = int("1" + efield[1:], 2)
                e = -mag if efield[0] == "1" else mag
            v = math.ldexp(1.0 + int(mfield, 2) / 2 ** len(mfield), e)
        out.append(-v if neg else v)
    out = np.array(out)
    out[0x80] = np.nan  # docs/numerics/formats.md#hifloat8 specials
    out[0x6F] = np.inf
    out[0xEF] = -np.inf
    return out


EXPECTED = {
    "float8_e4m3fn": lambda: ieee_like_values(256, 4, 3, 7, inf=False, nan="ones"),
    "float8_e5m2": lambda: ieee_like_values(256, 5, 2, 15, inf=True, nan="ieee"),
    "float4_e2m1": lambda: ieee_like_values(16, 2, 1, 1, inf=False, nan=None),
    "float8_e8m0": lambda: ieee_like_values(256, 8, 0, 127, inf=False, nan="ones", signed=False, subnormals=False),
    "bfloat16": lambda: ieee_like_values(1 << 16, 8, 7, 127, inf=True, nan="ieee"),
    "float16": lambda: ieee_like_values(1 << 16, 5, 10, 15, inf=True, nan="ieee"),
    "hifloat8": hifloat8_values_from_spec,
    "int8": lambda: np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float64),
}


@pytest.mark.parametrize("fmt", F.FORMAT_NAMES)
def test_every_code_decodes_to_the_field_formula(fmt):
    codes = F.all_codes(fmt)
    assert len(codes) == {4: 16, 8: 256, 16: 65536}[F.code_bits(fmt)]
    got = F.decode(codes, fmt)
    assert got.dtype == np.float32
    _same(got, EXPECTED[fmt]())


ML = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e8m0": ml_dtypes.float8_e8m0fnu,
    "bfloat16": ml_dtypes.bfloat16,
    "float16": np.float16,
}


@pytest.mark.parametrize("fmt", sorted(ML))
def test_decode_matches_ml_dtypes(fmt):
    codes = F.all_codes(fmt)
    with np.errstate(invalid="ignore"):
        ref = codes.view(ML[fmt]).astype(np.float32)
    _same(F.decode(codes, fmt), ref)


def test_decode_float4_matches_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    _same(F.decode(codes, "float4_e2m1"), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_decode_hifloat8_matches_en_dtypes():
    codes = np.arange(256, dtype=np.uint8)
    ref = codes.view(en_dtypes.hifloat8).astype(np.float32)
    got = F.decode(codes, "hifloat8")
    # en_dtypes decodes 0x80 to NaN as docs/numerics/formats.md#hifloat8 says; compare everything, NaN included
    _same(got, ref)


def test_spec_named_codes():
    """The values docs/numerics/formats.md spells out, one by one."""
    d = lambda c, f: float(F.decode(np.array([c], np.uint8), f)[0])  # noqa: E731
    # HiFloat8 (docs/numerics/formats.md#hifloat8 examples and specials)
    assert d(0x18, "hifloat8") == 0.5
    assert d(0x20, "hifloat8") == 4.0
    assert d(0x7F, "hifloat8") == 1.5 * 2.0**-15
    assert d(0x6E, "hifloat8") == 32768.0
    assert d(0x00, "hifloat8") == 0.0 and not np.signbit(d(0x00, "hifloat8"))
    assert np.isnan(d(0x80, "hifloat8"))
    assert d(0x6F, "hifloat8") == np.inf and d(0xEF, "hifloat8") == -np.inf
    assert [d(c, "hifloat8") for c in range(1, 8)] == [2.0 ** (m - 23) for m in range(1, 8)]
    # E4M3FN: max 448 = 0x7E, 0x7F/0xFF NaN, no Inf, min subnormal 2^-9
    assert d(0x7E, "float8_e4m3fn") == 448.0 and d(0xFE, "float8_e4m3fn") == -448.0
    assert np.isnan(d(0x7F, "float8_e4m3fn")) and np.isnan(d(0xFF, "float8_e4m3fn"))
    assert d(0x01, "float8_e4m3fn") == 2.0**-9
    assert np.signbit(d(0x80, "float8_e4m3fn")) and d(0x80, "float8_e4m3fn") == 0
    # E5M2: max 57344 = 0x7B, Inf 0x7C, NaN 0x7D-0x7F
    assert d(0x7B, "float8_e5m2") == 57344.0 and d(0x7C, "float8_e5m2") == np.inf
    assert d(0xFC, "float8_e5m2") == -np.inf and all(np.isnan(d(c, "float8_e5m2")) for c in (0x7D, 0x7E, 0x7F))
    assert d(0x01, "float8_e5m2") == 2.0**-16
    # E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and the negatives
    assert [d(c, "float4_e2m1") for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert [d(c, "float4_e2m1") for c in range(9, 16)] == [-0.5, -1, -1.5, -2, -3, -4, -6]
    # E8M0: value 2^(b-127), 0xFF NaN, 0x00 = 2^-127 (no zero)
    assert d(0x7F, "float8_e8m0") == 1.0 and d(0x00, "float8_e8m0") == 2.0**-127
    assert d(0xFE, "float8_e8m0") == 2.0**127 and np.isnan(d(0xFF, "float8_e8m0"))
    assert d(0x69, "float8_e8m0") == 2.0**-22 and d(0x68, "float8_e8m0") == 2.0**-23
    # int8 two's complement
    assert [d(c, "int8") for c in (0x7F, 0x80, 0xFF)] == [127, -128, -1]


def test_max_finite():
    assert F.max_finite("int8") == 127
    assert F.max_finite("float8_e4m3fn") == 448
    assert F.max_finite("float8_e5m2") == 57344
    assert F.max_finite("hifloat8") == 32768
    assert F.max_finite("float4_e2m1") == 6
    assert F.max_finite("float8_e8m0") == 2.0**127
    assert F.max_finite("float16") == 65504
    assert F.max_finite("bfloat16") == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


def test_decode_accepts_int8_and_ml_dtypes_views():
    c = np.arange(256, dtype=np.uint8)
    _same(F.decode(c.view(np.int8), "int8"), F.decode(c, "int8"))
    _same(F.decode(c.view(ml_dtypes.float8_e4m3fn), "float8_e4m3fn"), F.decode(c, "float8_e4m3fn"))
    h = np.arange(1 << 16, dtype=np.uint16)
    _same(F.decode(h.view(ml_dtypes.bfloat16), "bfloat16"), F.decode(h, "bfloat16"))
    # shape preserved
    assert F.decode(c.reshape(4, 8, 8), "hifloat8").shape == (4, 8, 8)


def test_midpoints_and_value_sets():
    v = F.representable_values("float4_e2m1")
    np.testing.assert_array_equal(v, [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6])
    np.testing.assert_array_equal(F.midpoints("float4_e2m1"),
                                  [-5, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])
    m = F.midpoints("int8")
    np.testing.assert_array_equal(m, np.arange(-128, 127) + 0.5)
    # midpoints are exact in float32 for every 8/4/16-bit format
    for fmt in F.FORMAT_NAMES:
        mp = F.midpoints(fmt)
        assert np.array_equal(mp.astype(np.float32).astype(np.float64), mp), fmt
