"""Front doors of the cache-layout operators: FlashMLA's MODEL1 FP8 sparse cache.

* ``layouts.flashmla_model1_quantize`` - bf16 K rows ``[num_blocks, block_size, 1, 512]`` into FlashMLA's
  MODEL1 cache ``[num_blocks, padded block bytes]`` (448 FP8 E4M3FN NoPE + 64 bf16 RoPE per token, then
  7 E8M0 tile scales + 1 pad byte per token, each block padded to a multiple of 576 bytes);
* ``layouts.flashmla_model1_dequantize`` - back to bf16.

Public names: :func:`qsfa.layouts.flashmla_model1_quantize`, :func:`qsfa.layouts.flashmla_model1_dequantize`.
Numerics and byte layout: :mod:`qsfa.reference.flashmla_model1` and
``docs/numerics/flashmla-model1.md`` (source: deepseek-ai/FlashMLA@9241ae3 ``tests/quant.py``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._checks import all_finite, dtype_in, edit_params, is_array, is_int, ndim_in, rule, set_param
from .._contract import Contract, params
from .._dispatch import define_operator, run
from .._errors import Raw
from ..reference import flashmla_model1 as _m1

__all__ = ["flashmla_model1_quantize", "flashmla_model1_dequantize", "QUANTIZE", "DEQUANTIZE",
           "QUANTIZE_CONTRACT", "DEQUANTIZE_CONTRACT"]

QUANTIZE = "layouts.flashmla_model1_quantize"
DEQUANTIZE = "layouts.flashmla_model1_dequantize"
SOURCE = "deepseek-ai/FlashMLA@9241ae3 tests/quant.py (MODEL1_FP8Sparse); docs/numerics/flashmla-model1.md"

_BF16 = ml_dtypes.bfloat16


# ------------------------------------------------------------------------------------------ quantize


def _q_example(rng):
    k = (rng.standard_normal((2, 3, 1, _m1.D)) * 2).astype(_BF16)
    return dict(k=k)


QUANTIZE_CONTRACT = Contract(
    op=QUANTIZE,
    constraints=[
        is_array(QUANTIZE, "k", source=SOURCE),
        dtype_in(QUANTIZE, "k", ("bfloat16",), source=SOURCE),
        ndim_in(QUANTIZE, "k", (4,), source=SOURCE),
        rule(QUANTIZE, "k_shape", "k", "shape",
             f"must be [num_blocks, block_size, 1, {_m1.D}] ({_m1.D_NOPE} NoPE + {_m1.D_ROPE} RoPE, one KV head)",
             lambda a: None if a.k.shape[2] == 1 and a.k.shape[3] == _m1.D else tuple(a.k.shape),
             edit_params(lambda o: o.update(k=np.ascontiguousarray(o["k"][..., :448]))),
             source=SOURCE),
        rule(QUANTIZE, "k_block_size", "k", "shape", "block_size (k.shape[1]) must be at least 1",
             lambda a: None if a.k.shape[1] >= 1 else tuple(a.k.shape),
             edit_params(lambda o: o.update(k=o["k"][:, :0].copy())), source=SOURCE),
        all_finite(QUANTIZE, "k", source=SOURCE),
    ],
    example=_q_example,
    params=params("k:array"),
)

define_operator(QUANTIZE, QUANTIZE_CONTRACT, outputs=("cache",), reference=lambda k: _m1.quantize(k),
                doc="bf16 K rows into FlashMLA's MODEL1 FP8 sparse cache (E4M3FN NoPE, bf16 RoPE, E8M0 scales).")


def flashmla_model1_quantize(k, *, chip=None, backend="reference"):
    """Quantise bf16 K rows into FlashMLA's MODEL1 FP8 sparse KV cache (DeepSeek V4 geometry).

    k:       bfloat16 ``[num_blocks, block_size, 1, 512]`` (448 NoPE + 64 RoPE), finite.
    backend: "reference" (the only implementation).
    Returns uint8 ``[num_blocks, P]`` with ``P = ceil(block_size * 584 / 576) * 576``
    (:func:`qsfa.layouts.flashmla_model1_block_bytes`). Block layout: tokens' [448 E4M3FN codes | 64 bf16
    RoPE] rows (576 bytes each), then per token 7 E8M0 tile scales + 1 pad byte, then padding (pad bytes 0).
    Tile scale (64 NoPE values) ``s = 2^ceil(log2(max(amax / 448, 1e-4)))``, codes ``E4M3FN_RINT(x / s)``.
    """
    return run(QUANTIZE, dict(k=k), backend, chip=chip)


# ---------------------------------------------------------------------------------------- dequantize


def _dq_example(rng):
    k = (rng.standard_normal((2, 3, 1, _m1.D)) * 2).astype(_BF16)
    return dict(cache=_m1.quantize(k), block_size=3)


def _block_size_value(a):
    v = a.block_size
    return None if is_int(v) and v >= 1 else ("None" if v is None else v)


def _cache_width(a):
    want = _m1.block_bytes(a.block_size)
    got = a.cache.shape[1]
    return None if got == want else Raw(f"{got} bytes per block (block_size {a.block_size} needs {want})")


DEQUANTIZE_CONTRACT = Contract(
    op=DEQUANTIZE,
    constraints=[
        is_array(DEQUANTIZE, "cache", source=SOURCE),
        dtype_in(DEQUANTIZE, "cache", ("uint8", "float8_e4m3fn"), source=SOURCE),
        ndim_in(DEQUANTIZE, "cache", (2,), source=SOURCE),
        rule(DEQUANTIZE, "block_size_value", "block_size", "value", "must be an integer >= 1",
             _block_size_value, set_param("block_size", 0), source=SOURCE),
        rule(DEQUANTIZE, "cache_block_bytes", "cache", "shape",
             "cache.shape[1] must be the padded block size ceil(block_size * 584 / 576) * 576",
             _cache_width, set_param("block_size", 4), source=SOURCE),
    ],
    example=_dq_example,
    params=params("cache:array block_size:int"),
)

define_operator(DEQUANTIZE, DEQUANTIZE_CONTRACT, outputs=("k",),
                reference=lambda cache, block_size: _m1.dequantize(cache, int(block_size)),
                doc="FlashMLA MODEL1 FP8 sparse cache back to bf16 K rows (code * scale in bf16).")


def flashmla_model1_dequantize(cache, *, block_size, chip=None, backend="reference"):
    """bf16 K rows ``[num_blocks, block_size, 1, 512]`` of a FlashMLA MODEL1 cache.

    cache:      uint8 (or float8_e4m3fn, FlashMLA's own dtype) ``[num_blocks, P]``, P the padded block bytes
                of ``block_size`` (:func:`qsfa.layouts.flashmla_model1_block_bytes`).
    block_size: tokens per block (the layout cannot be read without it).
    NoPE: ``bf16(code) * bf16(2^(byte - 127))`` in bf16 (one rounding; NaN codes / byte 0xFF give NaN
    0x7FC0); RoPE: raw bits. Pad bytes are ignored.
    """
    return run(DEQUANTIZE, dict(cache=cache, block_size=block_size), backend, chip=chip)
