"""Hypothesis strategies of the cache-family operators added beside the first catalogue.

Same conventions as :mod:`qsfa.strategies` (importing either module registers everything
here in :data:`qsfa.strategies.STRATEGIES`): each strategy draws a ``dict`` of valid arguments; structure is drawn by
hypothesis, bulk contents come from a NumPy generator seeded by a drawn integer.

* ``layouts.flashmla_model1_quantize`` / ``layouts.flashmla_model1_dequantize`` (FlashMLA MODEL1 cache);
* ``kv_compress_epilog_vllm`` (vLLM-Ascend's kv_compress_epilog, MXFP8);
* ``c8_cache_write`` / ``c8_rmsnorm_rope_cache`` with ``key_dtype="hifloat8"`` and its OPEN ``dst_type_max``: the
  registry entries wrap :func:`qsfa.strategies.c8_cache_write_args` / ``c8_rmsnorm_rope_cache_args``, drawing the key
  format themselves (HiFloat8 included) and passing it on as a pin.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from . import _edges as _E
from .strategies import (_BF16, STRATEGIES, Bounds, _b, _choose, _group_values, _rng, poison_bytes, slot_mapping,
                         strided_like)

__all__ = ["flashmla_model1_quantize_args", "flashmla_model1_dequantize_args", "kv_compress_epilog_vllm_args",
           "MORE_STRATEGIES"]


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
    from .reference.flashmla_model1 import block_bytes, quantize

    b = _b(bounds)
    rng = _rng(draw)
    if _choose(draw, pins, "source", ("quantized", "random")) == "random":
        nb = draw(st.integers(1, 3))
        bs = _choose(draw, pins, "block_size", (1, 2, 3, 5, 8))
        return dict(cache=poison_bytes(rng, (nb, block_bytes(bs)), np.uint8), block_size=bs)
    k = _model1_k(draw, rng, b, pins)
    return dict(cache=quantize(k), block_size=k.shape[1])


@st.composite
def kv_compress_epilog_vllm_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``kv_compress_epilog_vllm``: bf16 ``x [T, d]`` (d 128..576, partial last groups included; now and then a
    group whose amax is 448 * 2^k, the doubled power-of-two scale), both layouts, group sizes 64 / 128, E4M3FN
    and E5M2 caches of random bytes (layout 1 ``[N, 1, head_dim >= row]``, layout 2 ``[nb, bs, 1, X]``), strided
    along dimension 0 half the time, slots with -1."""
    import ml_dtypes

    from .reference import kv_compress_epilog_vllm as kv

    b = _b(bounds)
    layout = _choose(draw, pins, "layout", (1, 2))
    gs = _choose(draw, pins, "quant_group_size", (64, 128))
    d = _choose(draw, pins, "d", (128, 192, 208, 512, 576))
    fmt = _choose(draw, pins, "cache_dtype", ("float8_e4m3fn", "float8_e5m2"))
    t = draw(st.integers(1, b.max_tokens))
    rng = _rng(draw)
    x = _group_values(rng, (t, d))
    if draw(st.booleans()):  # a group with amax 448 * 2^k: scale exactly a power of two before rounding
        x[0, 0] = np.float32(448.0 * 2.0 ** int(rng.integers(-6, 3)))
    x = x.astype(_BF16)
    if layout == 1:
        n_slots = t + draw(st.integers(0, 4))
        shape = (n_slots, 1, kv.kv_cache_col(d, gs) + draw(st.sampled_from([0, 0, 7, 128])))
        num = n_slots
    else:
        bs = draw(st.integers(1, min(b.max_block_size, 8)))
        nb = draw(st.integers(1, 3))
        shape = (nb, bs, 1, kv.value_per_token(d) + kv.scale_per_token(d, gs) + draw(st.sampled_from([0, 0, 8])))
        num = nb * bs
    cache = poison_bytes(rng, shape, np.uint8)
    if draw(st.booleans()):  # dimension 0 strided: rows / blocks further apart than their size
        item = cache.strides
        cache = strided_like(cache, (item[0] + 64 * draw(st.integers(1, 3)),) + item[1:])
    cache = cache.view(getattr(ml_dtypes, fmt))
    slots = slot_mapping(rng, t, num, skip_fraction=draw(st.sampled_from([0.0, 0.3])),
                         dtype=_choose(draw, pins, "slot_dtype", ("int64", "int32")))
    return dict(kv_compress_cache=cache, x=x, slot_mapping=slots, quant_group_size=gs, quant_mode=2,
                round_scale_flag=_choose(draw, pins, "round_scale_flag", (True, False)), layout=layout)


def _with_hifloat8_keys(base, op):
    """``base`` (a C8 writer strategy) with ``key_dtype`` drawn from int8 / float8_e4m3fn / hifloat8 and, for
    HiFloat8, the OPEN ``dst_type_max`` from 0 (= 32768) and the values torch_npu documents."""

    @st.composite
    def strat(draw, bounds: Bounds | None = None, **pins) -> dict:
        key = _choose(draw, {**_E.edge_pins(op, pins.get("edge")), **pins}, "key_dtype",  # a pinned edge's key first
                      ("int8", "float8_e4m3fn", "hifloat8"))
        args = draw(base(bounds, **{k: v for k, v in pins.items() if k != "dst_type_max"}, key_dtype=key))
        args["dst_type_max"] = (_choose(draw, pins, "dst_type_max", (0.0, 15.0, 56.0, 224.0, 32768.0))
                                if key == "hifloat8" else 0.0)
        return args

    strat.__doc__ = f"{base.__doc__ or ''} (HiFloat8 keys and dst_type_max added by qsfa.strategies_more)"
    return strat


MORE_STRATEGIES = {
    "layouts.flashmla_model1_quantize": flashmla_model1_quantize_args,
    "layouts.flashmla_model1_dequantize": flashmla_model1_dequantize_args,
    "kv_compress_epilog_vllm": kv_compress_epilog_vllm_args,
}

for _op in ("c8_cache_write", "c8_rmsnorm_rope_cache"):
    if _op in STRATEGIES and not getattr(STRATEGIES[_op], "_hifloat8_keys", False):
        MORE_STRATEGIES[_op] = _with_hifloat8_keys(STRATEGIES[_op], _op)
        MORE_STRATEGIES[_op]._hifloat8_keys = True
STRATEGIES.update(MORE_STRATEGIES)
