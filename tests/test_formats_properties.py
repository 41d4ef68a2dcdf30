"""Hypothesis properties of the number formats (docs/numerics/formats.md#summary).

* decode(encode(x)) is the representable value nearest to x, ties broken by the rounding mode - checked
  against a brute-force search over the whole decoded code table written here;
* encode is monotone (non-decreasing values for sorted inputs);
* encode(decode(c)) == c for every non-NaN code, in any array shape.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qsfa.reference import formats as F

ROUNDING = {
    "int8": ("rint", "round"),
    "float8_e4m3fn": ("rint", "round"),
    "float8_e5m2": ("rint", "round"),
    "hifloat8": ("round",),
    "float4_e2m1": ("rint", "round"),
    "float8_e8m0": ("floor", "ceil", "rint", "round"),
    "bfloat16": ("rint", "round"),
    "float16": ("rint", "round"),
}
LIMITS = {  # input range where no overflow can happen (the overflow rules are tested in test_formats_encode)
    "int8": (-128.0, 127.0),
    "float8_e4m3fn": (-448.0, 448.0),
    "float8_e5m2": (-57344.0, 57344.0),
    "hifloat8": (-32768.0, 32768.0),
    "float4_e2m1": (-6.0, 6.0),
    "float8_e8m0": (2.0**-126, 2.0**127),  # unsigned; below 2^-126 the byte rules are tested by hand
    "bfloat16": (-3.3895313892515355e38, 3.3895313892515355e38),
    "float16": (-65504.0, 65504.0),
}


def code_table(fmt):
    """(finite values, their codes) over every code; -0 dropped (it is the same value as +0)."""
    codes = F.all_codes(fmt)
    with np.errstate(invalid="ignore"):
        vals = F.decode(codes, fmt).astype(np.float64)
    keep = np.isfinite(vals) & ~((vals == 0) & np.signbit(vals))
    return vals[keep], codes[keep].astype(np.int64)


def brute_force_nearest(x, fmt, rounding):
    """Nearest table value to each x by exhaustive distance, tie rule applied; directed modes for E8M0."""
    vals, codes = code_table(fmt)
    x = np.asarray(x, np.float64)
    if rounding in ("floor", "ceil"):
        ok = vals[None, :] <= x[:, None] if rounding == "floor" else vals[None, :] >= x[:, None]
        d = np.where(ok, np.abs(vals[None, :] - x[:, None]), np.inf)
        return vals[np.argmin(d, axis=1)]
    d = np.abs(vals[None, :] - x[:, None])
    dmin = d.min(axis=1, keepdims=True)
    cand = d == dmin
    if rounding == "rint":
        # a tie has two candidates; keep the one whose code is even (int8: the even integer)
        key = (vals % 2 == 0) if fmt == "int8" else (codes % 2 == 0)
        pick = cand & key[None, :]
        pick = np.where(pick.any(axis=1, keepdims=True), pick, cand)
    else:  # "round": ties away from zero
        mag = np.where(cand, np.abs(vals)[None, :], -1.0)
        pick = cand & (mag == mag.max(axis=1, keepdims=True))
    assert (pick.sum(axis=1) == 1).all()
    return vals[np.argmax(pick, axis=1)]


def near_midpoints(fmt):
    """Midpoints and their float32 neighbours: where rounding bugs live."""
    mp = F.midpoints(fmt).astype(np.float32)
    lo, hi = LIMITS[fmt]
    pts = np.concatenate([mp, np.nextafter(mp, np.float32(np.inf)), np.nextafter(mp, np.float32(-np.inf))])
    return np.unique(pts[(pts >= lo) & (pts <= hi)]).astype(np.float64).tolist()


_NEAR = {fmt: near_midpoints(fmt) for fmt in F.FORMAT_NAMES}


@st.composite
def format_case(draw, width=32):
    fmt = draw(st.sampled_from(F.FORMAT_NAMES))
    rounding = draw(st.sampled_from(ROUNDING[fmt]))
    lo, hi = LIMITS[fmt]
    element = st.one_of(
        st.floats(min_value=lo, max_value=hi, width=width, allow_nan=False, allow_infinity=False),
        st.sampled_from(_NEAR[fmt]),
    )
    xs = draw(st.lists(element, min_size=1, max_size=48))
    return fmt, rounding, np.array(xs, np.float32 if width == 32 else np.float64)


@given(format_case(width=32))
def test_encode_is_nearest_float32(case):
    fmt, rounding, x = case
    got = F.decode(F.encode(x, fmt, rounding=rounding), fmt).astype(np.float64)
    expect = brute_force_nearest(x, fmt, rounding)
    np.testing.assert_array_equal(got, expect, err_msg=f"{fmt} {rounding} x={x.tolist()}")


@given(format_case(width=64))
def test_encode_is_nearest_float64(case):
    """float64 input rounds once, directly (the round-to-odd narrowing must not double-round)."""
    fmt, rounding, x = case
    got = F.decode(F.encode(x, fmt, rounding=rounding), fmt).astype(np.float64)
    np.testing.assert_array_equal(got, brute_force_nearest(x, fmt, rounding), err_msg=f"{fmt} {rounding}")


@given(st.sampled_from(F.FORMAT_NAMES), st.data())
def test_encode_is_monotone(fmt, data):
    rounding = data.draw(st.sampled_from(ROUNDING[fmt]))
    lo, hi = LIMITS[fmt]
    if fmt not in ("int8", "float4_e2m1"):  # formats with Inf/NaN: the whole float32 line, saturated or not
        lo, hi = (0.0, np.inf) if fmt == "float8_e8m0" else (-np.inf, np.inf)
    xs = data.draw(st.lists(st.floats(min_value=lo, max_value=hi, width=32, allow_nan=False), min_size=2,
                            max_size=64))
    x = np.sort(np.array(xs, np.float32))
    saturate = data.draw(st.booleans())
    v = F.decode(F.encode(x, fmt, rounding=rounding, saturate=saturate), fmt)
    if fmt == "float8_e4m3fn" and not saturate:
        v = np.where(np.isnan(v), np.where(x > 0, np.inf, -np.inf), v)  # overflow NaN sits beyond max
    if fmt == "float8_e8m0" and not saturate:
        v = np.where(np.isnan(v), np.inf, v)
    assert not np.isnan(v).any() and (v[1:] >= v[:-1]).all(), (fmt, rounding, x, v)


@given(st.sampled_from(F.FORMAT_NAMES), st.data())
def test_code_round_trip_any_shape(fmt, data):
    codes = F.all_codes(fmt)
    vals = F.decode(codes, fmt)
    ok = codes[~np.isnan(vals)]
    shape = data.draw(hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))
    pick = data.draw(hnp.arrays(np.int64, shape, elements=st.integers(0, len(ok) - 1)))
    c = ok[pick]
    again = F.encode(F.decode(c, fmt), fmt)
    assert again.shape == c.shape and again.dtype == c.dtype
    np.testing.assert_array_equal(again, c)
