"""Hypothesis strategies of the cache-layout operators (docs/numerics/flashmla-model1.md):
``layouts.flashmla_model1_quantize`` / ``layouts.flashmla_model1_dequantize``."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from .._values import _group_values
from ._common import _b, _BF16, _choose, _rng, Bounds, bounds, poison_bytes

__all__ = [
    "flashmla_model1_quantize_args",
    "flashmla_model1_dequantize_args",
]


def _model1_k(draw, rng, b: Bounds, pins):
    nb = draw(st.integers(1, 3))
    bs = _choose(draw, pins, "block_size", (1, 2, 3, 5, 8, min(64, b.max_block_size)))
    k = _group_values(rng, (nb, bs, 1, 512))
    # spread the tiles' magnitudes over the bf16 range now and then (huge and tiny scales, the 1e-4 floor)
    if draw(st.booleans()):
        k = k * np.exp2(rng.integers(-40, 40, (nb, bs, 1, 8)).repeat(64, axis=-1)).astype(np.float32)
    return k.astype(_BF16)


@st.composite
def flashmla_model1_quantize_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``layouts.flashmla_model1_quantize``: bf16 ``k [nb, bs, 1, 512]`` with per-16 magnitudes over
    several decades, zero stretches (all-zero tiles) and, half the time, tile magnitudes 2^-40..2^40."""
    b = _b(bounds)
    return dict(k=_model1_k(draw, _rng(draw), b, pins))


@st.composite
def flashmla_model1_dequantize_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``layouts.flashmla_model1_dequantize``: a cache written by the reference quantiser, or (``source=
    "random"``) arbitrary bytes - NaN codes, the NaN scale byte, overflowing products included."""
    from ..reference.flashmla_model1 import block_bytes, quantize

    b = _b(bounds)
    rng = _rng(draw)
    if _choose(draw, pins, "source", ("quantized", "random")) == "random":
        nb = draw(st.integers(1, 3))
        bs = _choose(draw, pins, "block_size", (1, 2, 3, 5, 8))
        return dict(cache=poison_bytes(rng, (nb, block_bytes(bs)), np.uint8), block_size=bs)
    k = _model1_k(draw, rng, b, pins)
    return dict(cache=quantize(k), block_size=k.shape[1])
