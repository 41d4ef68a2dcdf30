"""The C8 cache writer of the QSFA pipeline (docs/numerics/cache-writers.md#c8_cache_write, last paragraph) as two stages.

Stage 2, :func:`c8_cache_write` - quantise + pack + scatter, bit-exact and what a kernel is checked
against: the NoPE ``[T, 512]`` is quantised per 1x128 tile with one fp32 scale per tile, the RoPE bytes
are copied as stored, and the packed 656-byte (rope 64) or 528-byte (rope 0) rows
(:mod:`qsfa.reference.packing`) are scattered into ``[block_num, block_size, 1, W]`` by slot (-1 skipped).

* key_dtype "int8" (Atlas A2/A3): the int8 dynamic rule of docs/numerics/quantisers.md#int8-dynamic, ``s = amax / 127`` (fp32),
  ``q = clamp(RINT(x / s), -127, 127)``, an all-zero tile gives ``s = 0, q = 0``.
* key_dtype "float8_e4m3fn" (Ascend 950): vllm-ascend's writer calls ``npu_dynamic_block_quant`` with
  ``dst_type=float8_e4m3fn`` (vllm_ascend/attention/sfa_v1.py ``custom_kv_rmsnorm_rope``, the A5 branch
  of ``c8_k_cache_dtype``), so ``s = amax / 448``, ``q = E4M3FN(RINT, SAT)(x / s)``.
* key_dtype "hifloat8" (Ascend 950; **OPEN**, docs/numerics/open-facts.md#hifloat8-c8-nope): no public writer
  fixes the scale, so qsfa applies the same ``npu_dynamic_block_quant`` call with ``dst_type=hifloat8``:
  ``s = amax / TYPE_MAX``, ``q = HiF8(ROUND, SAT)(x / s)``, with TYPE_MAX = ``dst_type_max`` (0 = the format's
  32768, the torch_npu default; 15 / 56 / 224 are the other values torch_npu documents). Attention dequantises
  such rows as ``decode(q) * s`` like the others.

``scale_order`` is the order of that arithmetic, passed to :func:`qsfa.reference.quant.dynamic_block_quant`
("divide" here by default; the public operators' None takes the chip's order, A2/A3 "reciprocal" and 950 "divide":
docs/numerics/chips.md#c8-cache-writers).

Stage 1+2, :func:`c8_rmsnorm_rope_cache`, mirrors vllm-ascend's ``custom_kv_rmsnorm_rope`` +
``_store_parallel_kv``: ``npu_rms_norm`` of the NoPE part and ``npu_interleave_rope`` of the RoPE part,
each returning the model dtype, then the quantiser on those rounded values. Rounding points:

1. RMSNorm computed in fp32 (:func:`qsfa.reference.rmsnorm_rope.rms_norm_f32`), rounded RINT to the model
   dtype (bf16/fp16) - ``npu_rms_norm`` returns x's dtype;
2. interleave RoPE computed in fp32, rounded RINT to the model dtype - ``npu_interleave_rope`` returns
   x's dtype; these 16-bit values are the RoPE bytes stored in the row;
3. the quantiser upcasts the rounded NoPE exactly to fp32 (amax, scale and ``x / s`` in fp32).

Only steps 2-3 and the packing are bit-reproducible across implementations; the fp32 sum of squares of
step 1 depends on the reduction order (see :mod:`qsfa.reference.rmsnorm_rope`).
"""

from __future__ import annotations

import numpy as np

from .packing import pack_rows
from .quant import dynamic_block_quant
from .rmsnorm_rope import interleave_rope_f32, rms_norm_f32, round_to_dtype
from .scatter import scatter_by_slot

__all__ = ["KEY_DTYPES", "NOPE_DIM", "TILE", "quantize_nope", "c8_rows", "c8_cache_write", "c8_rmsnorm_rope_cache"]

KEY_DTYPES = ("int8", "float8_e4m3fn", "hifloat8")
NOPE_DIM = 512
TILE = 128


def quantize_nope(k_nope: np.ndarray, key_dtype: str = "int8", scale_order: str = "divide",
                  dst_type_max: float = 0.0):
    """Per-1x128-tile dynamic quantisation of ``k_nope [..., 512]``: ``(codes uint8 [..., 512],
    scales float32 [..., 4])`` (see the module docstring for the three key dtypes)."""
    k_nope = np.asarray(k_nope)
    lead, d = k_nope.shape[:-1], k_nope.shape[-1]
    hif8 = key_dtype == "hifloat8"
    q, s = dynamic_block_quant(k_nope.reshape(-1, 1, d), dst_type=key_dtype, row_block_size=1,
                               col_block_size=TILE, scale_order=scale_order, round_mode="round" if hif8 else "rint",
                               dst_type_max=float(dst_type_max) if hif8 else 0.0)
    return q.view(np.uint8).reshape(*lead, d), s.reshape(*lead, d // TILE)


def c8_rows(k_nope: np.ndarray, k_rope: np.ndarray | None, key_dtype: str = "int8",
            scale_order: str = "divide", dst_type_max: float = 0.0) -> np.ndarray:
    """Packed QSFA rows uint8 ``[T, 656 | 528]`` of ``k_nope [T, 512]`` and ``k_rope [T, 64]`` / None."""
    q, s = quantize_nope(k_nope, key_dtype, scale_order, dst_type_max)
    return pack_rows(q, k_rope, s)


def c8_cache_write(k_nope, k_rope, slot_mapping, kv_cache, *, key_dtype: str = "int8",
                   scale_order: str = "divide", dst_type_max: float = 0.0) -> np.ndarray:
    """Quantise, pack and scatter one row per token into ``kv_cache [block_num, block_size, 1, W]``
    (one-byte dtype, written in place; slot -1 skipped). Returns ``kv_cache``."""
    rows = c8_rows(k_nope, k_rope, key_dtype, scale_order, dst_type_max)
    scatter_by_slot(kv_cache, rows[:, None, :], slot_mapping)
    return kv_cache


def c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slot_mapping, kv_cache, *, epsilon: float = 1e-6,
                          rope_head_dim: int = 64, key_dtype: str = "int8",
                          scale_order: str = "divide", dst_type_max: float = 0.0) -> np.ndarray:
    """RMSNorm the NoPE part of ``kv [T, 512 + rope]``, interleave-RoPE the rest (skipped at rope 0),
    round both to kv's dtype, then :func:`c8_cache_write`. ``cos``/``sin``: ``[T, rope]``."""
    kv = np.asarray(kv)
    nope = round_to_dtype(rms_norm_f32(kv[..., :NOPE_DIM], gamma, epsilon), kv.dtype)
    rope = None
    if rope_head_dim:
        rope = round_to_dtype(interleave_rope_f32(kv[..., NOPE_DIM:NOPE_DIM + rope_head_dim], cos, sin), kv.dtype)
    return c8_cache_write(nope, rope, slot_mapping, kv_cache, key_dtype=key_dtype, scale_order=scale_order,
                          dst_type_max=dst_type_max)
