"""Hypothesis strategies of the quantisers (docs/numerics/quantisers.md): ``dynamic_block_quant``."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .. import _edges as _E
from .._values import _group_values, as_dtype
from ._common import _b, _choose, _rng, Bounds, bounds
from .formats import _NP_IN

__all__ = [
    "dynamic_block_quant_args",
]


# ---------------------------------------------------------------------------------------------------
# dynamic_block_quant


_DBQ_CODES = {"int8": (1,), "float8_e5m2": (23, 291), "float8_e4m3fn": (24, 292), "hifloat8": (290,)}


@st.composite
def dynamic_block_quant_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``dynamic_block_quant``: 2-D / 3-D float16 / bfloat16 / float32 ``x`` (edge blocks partial, zero
    blocks, optionally +-inf / nan), every destination (as a name or a torch_npu code), block shapes of the
    chip limits, ``min_scale``, ``dst_type_max`` (HiFloat8) and both ``scale_order`` values (OPEN)."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "dynamic_block_quant", pins)
    dst = _choose(draw, pins, "dst_type", tuple(_DBQ_CODES))
    as_code = draw(st.booleans())
    dst_arg = draw(st.sampled_from(_DBQ_CODES[dst])) if as_code else dst
    xdt = _choose(draw, pins, "x_dtype", ("float16", "bfloat16", "float32"))
    rank = _choose(draw, pins, "x_ndim", (2, 3))
    m = _E.pinned_int(draw, pins, "rows", 1, 6)
    n = draw(st.integers(1, max(1, min(b.max_elements, 320)))) if edge is None else 2 * 128 + 3
    shape = (m, n) if rank == 2 else (draw(st.integers(1, 2)), m, n)
    rb = _choose(draw, pins, "row_block_size", (1, 2, 64, 128))
    cb = _choose(draw, pins, "col_block_size", (1, 64, 128, 192, 256))
    min_scale = _choose(draw, pins, "min_scale", (0.0, 0.0, 1e-3, 0.5, 8.0))
    scale_order = _choose(draw, pins, "scale_order", ("divide", "multiply") if min_scale == 0 else ("divide",))
    dmax = _choose(draw, pins, "dst_type_max", (0.0, 15.0, 56.0, 224.0, 32768.0) if dst == "hifloat8" else (0.0,))
    specials = _choose(draw, pins, "specials", (False, True))
    rng = _rng(draw)
    x = _group_values(rng, shape)
    if edge is not None:
        x = _E.dbq_x(rng, edge, x, dst, dmax, cb)
    if specials:
        sp = rng.random(shape) < 0.03
        x[sp] = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), int(sp.sum()))
    x = as_dtype(x, np.float32 if xdt == "float32" else _NP_IN[xdt])
    return dict(x=x, min_scale=min_scale, round_mode="round" if dst == "hifloat8" else "rint", dst_type=dst_arg,
                row_block_size=rb, col_block_size=cb, dst_type_max=dmax, scale_order=scale_order)
