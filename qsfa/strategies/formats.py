"""Hypothesis strategies of the number-format operators (docs/numerics/formats.md): ``formats.encode``,
``formats.decode``, ``formats.pack_fp4`` and ``formats.unpack_fp4``."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .. import _edges as _E
from .._values import _format_values, as_dtype
from ._common import _b, _BF16, _choose, _F16, _rng, Bounds, bounds

__all__ = [
    "encode_args",
    "decode_args",
    "pack_fp4_args",
    "unpack_fp4_args",
]


# ---------------------------------------------------------------------------------------------------
# formats


_ENCODE_INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16")
_NP_IN = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64), "float16": _F16, "bfloat16": _BF16}


@st.composite
def encode_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``formats.encode``: ``x`` (float32 / float64 / float16 / bfloat16, 1-2 dims) of values chosen to hit
    ties, neighbours of ties and range edges; every ``fmt``, ``saturate`` and supported ``rounding``."""
    from ..reference import formats as F

    b = _b(bounds)
    pins, edge = _E.take(draw, "formats.encode", pins)
    fmt = _choose(draw, pins, "fmt", F.FORMAT_NAMES)
    saturate = _choose(draw, pins, "saturate", (False, True))
    rounding = _choose(draw, pins, "rounding", (None,) + F.rounding_modes(fmt))
    in_dt = _choose(draw, pins, "x_dtype", _ENCODE_INPUT_DTYPES)
    n = draw(st.integers(1, b.max_elements))
    shape = draw(st.sampled_from([(n,), (1, n)] + ([(2, n // 2)] if n >= 4 and n % 2 == 0 else [])))
    rng = _rng(draw)
    no_specials = fmt in ("int8", "float4_e2m1")
    with np.errstate(over="ignore"):
        x = as_dtype(_format_values(rng, fmt, n, specials=not no_specials or saturate), _NP_IN[in_dt])
        if edge is not None:  # every boundary value in the edge phase; a shrinkable prefix otherwise
            x = as_dtype(_E.encode_values(rng, fmt, saturate), _NP_IN[in_dt])
            x = x if pins.get("edge_full") else x[:draw(st.integers(1, x.size))]
            shape = x.shape
    if no_specials:
        x[np.isnan(x.astype(np.float64))] = 0
        if not saturate:
            bad = F.out_of_range(x, fmt, rounding) | ~np.isfinite(x.astype(np.float64))
            x[bad] = 0
    return dict(x=x.reshape(shape), fmt=fmt, saturate=saturate, rounding=rounding)


@st.composite
def decode_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``formats.decode``: codes of every format in each accepted code dtype (every code value possible)."""
    from ..reference import formats as F

    b = _b(bounds)
    pins, edge = _E.take(draw, "formats.decode", pins)
    fmt = _choose(draw, pins, "fmt", F.FORMAT_NAMES)
    dts = F.code_input_dtypes(fmt)
    dt = dts[draw(st.integers(0, len(dts) - 1))]
    n = draw(st.integers(1, b.max_elements))
    rng = _rng(draw)
    hi = 16 if fmt == "float4_e2m1" else 1 << (8 * dt.itemsize)
    codes = rng.integers(0, hi, n).astype(np.uint16 if dt.itemsize == 2 else np.uint8)
    if edge is not None:
        codes = _E.decode_codes(fmt, dt.itemsize)
        n = codes.size
    if draw(st.booleans()):
        codes = codes.reshape(1, n)
    return dict(codes=codes.view(dt), fmt=fmt)


@st.composite
def pack_fp4_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``formats.pack_fp4``: uint8 codes 0..15 with an even last axis; both nibble orders."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "formats.pack_fp4", pins)
    k = draw(st.integers(1, max(1, b.max_elements // 2)))
    lead = draw(st.sampled_from([(), (1,), (3,)]))
    rng = _rng(draw)
    codes = rng.integers(0, 16, lead + (2 * k,)).astype(np.uint8) if edge is None else _E.nibble_pairs()
    return dict(codes=codes, nibble_order=_choose(draw, pins, "nibble_order", ("low_first", "high_first")))


@st.composite
def unpack_fp4_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``formats.unpack_fp4``: any uint8 bytes; both nibble orders."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "formats.unpack_fp4", pins)
    k = draw(st.integers(1, max(1, b.max_elements // 2)))
    lead = draw(st.sampled_from([(), (2,)]))
    rng = _rng(draw)
    packed = rng.integers(0, 256, lead + (k,)).astype(np.uint8) if edge is None else np.arange(256, dtype=np.uint8)
    return dict(packed=packed,
                nibble_order=_choose(draw, pins, "nibble_order", ("low_first", "high_first")))
