"""HiFloat8 "hybrid" rounding (Ascend/op-plugin test helper cvt_float32_to_hifuint8(round_mode="hybrid")):
TA for binades |e| <= 3, the deterministic SSR elsewhere. Expected codes are worked out by hand below."""

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa import formats


def _f32_from(exp: int, frac: int) -> np.float32:
    """The float32 2^exp * (1 + frac * 2^-23)."""
    return np.array([((exp + 127) << 23) | frac], np.uint32).view(np.float32)[0]


def _code(x, **kw):
    return int(formats.encode(np.array([x], np.float32), "hifloat8", rounding="hybrid", **kw)[0])


# (value, code, arithmetic). SSR: M mantissa bits kept, f the 23-bit fp32 fraction, R the 23 - M bits below the
# kept ones, F = top 14 bits of R, T = f & 0x3FFF; round up iff F >= T.
HAND = [
    # |e| <= 3: TA, as rounding="round"
    (1.0625, 0x09, "e 0, tie 1.0 / 1.125 -> away: 1.125"),
    (0.125, 0x38, "e -3 on the grid (TA keeps it): D2 prefix 01, S 1, e bit 1, mmm 000"),
    # e = 4, M = 2 (grid 16, 20, 24, 28)
    (16.0, 0x41, "f 0: R 0, F 0 >= T 0 -> up to 20 (a grid value moves up one step)"),
    (17.0, 0x41, "f 2^19: q 0, F = 2^19 >> 7 = 4096 >= T 0 -> 20"),
    (21.0, 0x42, "f 0x280000: q 1, R 2^19, F 4096 >= T 0 -> 24 (TA would give 20)"),
    (float(_f32_from(4, 0x3FFF)), 0x40, "f 0x3FFF: q 0, F = 0x3FFF >> 7 = 127 < T = 16383 -> 16"),
    # e = -4, M = 2: 2^-4 on the grid moves up to 1.25 * 2^-4 = D3 prefix 10, S 1, ee 00, mm 01
    (0.0625, 0x51, "f 0 -> up: 0.078125"),
    # e = 15, M = 1: 32768 rounds up to the 1.5 * 2^15 pattern, which is +Inf
    (32768.0, 0x6F, "f 0 -> up -> 0x6F"),
    (40960.0, 0x6F, "|x| >= 40960 overflows before rounding, as in TA"),
    # denormal powers of two (M = 0): 2^-22 -> 2^-21
    (2.0 ** -22, 0x02, "f 0 -> up one power of two"),
    # binade 2^-23: F = (f >> 10) + 8192 against T
    (1.5 * 2.0 ** -23, 0x01, "f 0x400000: F 4096 + 8192 >= T 0 -> 2^-22"),
    (float(_f32_from(-23, 0x3FFF)), 0x00, "f 0x3FFF: F 15 + 8192 = 8207 < T 16383 -> 0"),
    (2.0 ** -24, 0x00, "below 2^-23: 0"),
]


@pytest.mark.parametrize("x,code,why", HAND, ids=[h[2][:30] for h in HAND])
def test_hand_worked_codes(x, code, why):
    assert _code(x) == code, why
    neg = 0 if code == 0 else code | 0x80
    assert _code(-x) == neg, f"-{x}: {why}"


def test_saturate_maps_the_inf_pattern_to_the_largest_finite():
    assert _code(32768.0, saturate=True) == 0x6E  # qsfa's saturate: no Inf code for finite input
    assert _code(-40960.0, saturate=True) == 0xEE
    assert _code(float("inf")) == 0x6F and _code(float("nan")) == 0x80


def test_ta_binades_agree_with_round_and_others_round_to_a_neighbour():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-24, 16, 200_000))).astype(np.float32)
    x = x[np.abs(x) < 40960]
    hyb = formats.encode(x, "hifloat8", rounding="hybrid")
    ta = formats.encode(x, "hifloat8", rounding="round")
    e = np.floor(np.log2(np.abs(x.astype(np.float64))))
    small = np.abs(e) <= 3
    assert np.array_equal(hyb[small], ta[small])
    # elsewhere the result is the grid value at or below |x| or the next one above it
    v = np.abs(formats.decode(hyb, "hifloat8").astype(np.float64))
    grid = np.unique(np.abs(formats.representable_values("hifloat8").astype(np.float64)))
    below = grid[np.searchsorted(grid, np.abs(x), side="right") - 1]
    above = grid[np.minimum(np.searchsorted(grid, np.abs(x), side="right"), grid.size - 1)]
    big = ~small & (np.abs(x) < 32768) & (np.abs(x) >= 2.0 ** -23)
    assert np.all((v[big] == below[big]) | (v[big] == above[big]))
    assert (hyb[big] != ta[big]).any()  # SSR is not nearest rounding


def test_half_precision_inputs_widen_exactly_and_round_to_works():
    x = np.array([16.0, 21.0, 0.0625, 1.0625], np.float32)
    want = formats.encode(x, "hifloat8", rounding="hybrid")
    for dt in (np.float16, ml_dtypes.bfloat16):
        assert np.array_equal(formats.encode(x.astype(dt), "hifloat8", rounding="hybrid"), want)
    np.testing.assert_array_equal(formats.round_to(x, "hifloat8", rounding="hybrid"), [20.0, 24.0, 0.078125, 1.125])


def test_only_hifloat8_takes_hybrid():
    assert formats.rounding_modes("hifloat8") == ("round", "hybrid")
    with pytest.raises(qsfa.InvalidArgument, match="Invalid value for rounding, actual: 'hybrid with fmt float8_e4m3fn"):
        formats.encode(np.ones(2, np.float32), "float8_e4m3fn", rounding="hybrid")
