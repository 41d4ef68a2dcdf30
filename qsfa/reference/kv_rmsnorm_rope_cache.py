"""KvRmsNormRopeCache V1 / V2 (docs/numerics/cache-writers.md#kv_rmsnorm_rope_cache, seed 004; torch_npu ``npu_kv_rmsnorm_rope_cache[_v2]``).

``kv [Bkv, N, Skv, D]`` (fp16/bf16) is normalised / rotated in float32 and scattered into two caches:

* V1 (``v is None``; N = 1; D = Dv + Dk with Dv = len(gamma), Dk = cos width):
  ``c_kv = RMSNorm(kv[..., :Dv])`` -> ckv_cache; ``k_rope = RoPE(kv[..., Dv:])`` (raw, un-normalised
  input) -> k_cache.
* V2 (``v`` given; N in {1, 2, 4, 8}; len(gamma) = D; rope = cos width):
  ``r = RMSNorm(kv)``; ``k = cat(RoPE(r[..., :rope]), r[..., rope:])`` -> k_cache; ``v`` -> ckv_cache.

Rounding points (settled from the cannmirror/ops-transformer kernels ``kv_rms_norm_rope_cache_b16_pa_bnsd_quant.h``
(``RmsNormWithQuant`` / ``RopeWithQuant``) and ``arch35/kv_rms_norm_rope_cache_regbase_*.h``, and the V2
golden of the CANN ATK test ``FunctionKvRmsNormRopeCache``):

1. RMSNorm and RoPE run in fp32 from the exactly widened inputs (:mod:`qsfa.reference.rmsnorm_rope`);
   in V2 the RoPE reads the **fp32** RMSNorm result (no rounding in between).
2. A 16-bit cache receives the fp32 result rounded once to the cache dtype (= kv's dtype; RINT).
3. An 8-bit cache is quantised from the **fp32** result, not from the rounded 16-bit value:
   ``y = x * scale (+ offset)`` in fp32, then INT8 ``clamp(RINT(y), -128, 127)``, FP8 E4M3FN/E5M2
   ``RINT`` + saturation, HiFloat8 ``TA`` (ties away) with ``hifloat8_overflow``: "saturate" (+-max finite;
   the default) or "inf" (the 950 kernel's ``SatMode::NO_SAT`` cast: beyond the range +-Inf; the front door
   passes the chip's rule, docs/numerics/chips.md#kvrmsnormropecache). ``v`` (V2) is widened exactly and
   quantised the same way.
4. The optional outputs ``k_rope`` / ``c_kv`` (``is_output_kv``) are the fp32 results rounded to kv's
   dtype (V2: ``c_kv`` is ``v`` itself).

Cache modes (index semantics; ``-1`` skips a token and leaves the destination bytes untouched):

* Norm: caches ``[Bkv, N, Scache, D*]``; ``index [Bkv, Skv]`` = position inside the batch row.
* PA / PA_BNSD: ``[block_num, block_size, N, D*]``; ``index [Bkv*Skv]`` = global slot.
* PA_NZ: NZ storage (:func:`qsfa.reference.packing.nz_view`); index as PA.
* PA_BLK_BNSD / PA_BLK_NZ: ``index [Bkv*ceil(Skv/block_size)]``; chunk j of batch b (tokens
  ``j*bs .. min(Skv, (j+1)*bs)``) goes to rows ``0..len`` of block ``index // block_size``.

All validation (shapes, index range and uniqueness, dtypes) is done by the operator contract.
"""

from __future__ import annotations

import numpy as np

from .packing import nz_columns, nz_view
from .rmsnorm_rope import interleave_rope_f32, rms_norm_f32, round_to_dtype
from .scatter import scatter_by_slot

__all__ = ["CACHE_MODES", "QUANT_FORMATS", "FLOAT_FORMATS", "static_quant", "token_slots",
           "cache_target", "kv_rmsnorm_rope_cache"]

CACHE_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")
QUANT_FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8")
FLOAT_FORMATS = ("float16", "bfloat16")


def _bcast_param(p: np.ndarray | None, n: int, d: int):
    """A quant parameter of shape [N, D], [D], [1, D] or [1] as a float32 array broadcastable to
    ``[B, N, S, D]``."""
    if p is None:
        return None
    p = np.asarray(p, dtype=np.float32)
    if p.ndim == 2:
        return p.reshape(1, p.shape[0], 1, p.shape[1])
    return p  # [D] or [1]: broadcasts along the last axis


HIFLOAT8_OVERFLOWS = ("saturate", "inf")


def static_quant(x: np.ndarray, fmt: str, scale, offset=None, hifloat8_overflow: str = "saturate") -> np.ndarray:
    """Static quantisation of fp32 ``x [B, N, S, D]``: ``y = x * scale (+ offset)`` in fp32, then the
    cast of ``fmt`` (int8 RINT + clamp [-128, 127]; FP8 RINT + SAT; HiFloat8 TA, saturating unless
    ``hifloat8_overflow="inf"``). Returns uint8 codes."""
    n, d = x.shape[1], x.shape[-1]
    y = (x * _bcast_param(scale, n, d)).astype(np.float32)
    if offset is not None:
        y = (y + _bcast_param(offset, n, d)).astype(np.float32)
    if fmt == "int8":
        return np.clip(np.rint(y), -128, 127).astype(np.int8).view(np.uint8)
    from . import formats

    assert hifloat8_overflow in HIFLOAT8_OVERFLOWS, hifloat8_overflow
    sat = fmt != "hifloat8" or hifloat8_overflow == "saturate"
    return np.asarray(formats.encode(y, fmt, saturate=sat, rounding="round" if fmt == "hifloat8" else "rint"),
                      dtype=np.uint8)


def token_slots(index: np.ndarray, cache_mode: str, batch: int, seq: int, rows_per_block: int) -> np.ndarray:
    """Slot of every token ``t = b * Skv + s`` in the logical ``[blocks, rows_per_block, ...]`` view of
    the cache (``-1`` = skip). Norm: the view's blocks are the batch rows; PA_BLK_*: per-chunk start
    slots are expanded to one slot per token."""
    index = np.asarray(index).astype(np.int64)
    if cache_mode == "Norm":
        idx = index.reshape(batch, seq)
        slots = np.arange(batch, dtype=np.int64)[:, None] * rows_per_block + idx
        return np.where(idx == -1, -1, slots).reshape(-1)
    if cache_mode in ("PA_BLK_BNSD", "PA_BLK_NZ"):
        chunks = -(-seq // rows_per_block)
        idx = index.reshape(batch, chunks)
        s = np.arange(seq, dtype=np.int64)
        start = idx[:, s // rows_per_block]  # [B, S]
        slots = (start // rows_per_block) * rows_per_block + (s % rows_per_block)[None, :]
        return np.where(start == -1, -1, slots).reshape(-1)
    return index.reshape(-1)


def cache_target(cache: np.ndarray, cache_mode: str):
    """``(view, rows_per_block, nz_c)``: a writable view ``[blocks, rows, N, D]`` (ND modes) or
    ``[blocks, rows, N, D // c, c]`` (NZ modes) of ``cache``, without copying."""
    if cache_mode == "Norm":
        return cache.transpose(0, 2, 1, 3), cache.shape[2], None
    if cache_mode in ("PA_NZ", "PA_BLK_NZ"):
        v = nz_view(cache)
        return v, v.shape[1], nz_columns(cache.dtype)
    return cache, cache.shape[1], None


def _write(cache, cache_mode, values_bnsd: np.ndarray, index, batch, seq):
    """Scatter per-token values ``[B, N, S, D]`` (already in the cache's element type) into ``cache``."""
    view, rows_per_block, c = cache_target(cache, cache_mode)
    n, d = values_bnsd.shape[1], values_bnsd.shape[3]
    rows = values_bnsd.transpose(0, 2, 1, 3).reshape(batch * seq, n, d)
    if c is not None:
        rows = rows.reshape(batch * seq, n, d // c, c)
    slots = token_slots(index, cache_mode, batch, seq, rows_per_block)
    scatter_by_slot(view, rows.view(cache.dtype) if rows.dtype.itemsize == cache.dtype.itemsize else rows, slots)


def _cache_values(x_f32: np.ndarray, fmt: str, kv_dtype, scale, offset, raw=None,
                  hifloat8_overflow="saturate") -> np.ndarray:
    """What a cache of format ``fmt`` stores for the fp32 values ``x_f32`` (``raw``: the exact 16-bit
    source when there is one, V2's ``v``)."""
    if fmt in QUANT_FORMATS:
        return static_quant(x_f32, fmt, scale, offset, hifloat8_overflow)
    if raw is not None:
        return raw
    return round_to_dtype(x_f32, kv_dtype)


def kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                          k_rope_offset=None, c_kv_offset=None, v=None, epsilon: float = 1e-5,
                          cache_mode: str = "Norm", is_output_kv: bool = False, k_cache_dtype: str | None = None,
                          ckv_cache_dtype: str | None = None, hifloat8_overflow: str = "saturate"):
    """RMSNorm + interleave RoPE + static quantisation + scatter into ``k_cache`` / ``ckv_cache`` (in place).

    ``k_cache_dtype`` / ``ckv_cache_dtype`` name each cache's format ("int8", "float8_e4m3fn",
    "float8_e5m2", "hifloat8", "float16", "bfloat16"); ``None`` infers it from the array dtype.
    ``hifloat8_overflow``: "saturate" or "inf" (see the module docstring).
    Returns ``(k_cache, ckv_cache, k_rope, c_kv)``; ``k_rope``/``c_kv`` are ``None`` unless
    ``is_output_kv`` is in effect (PA* modes, or Norm in V2 with a quantised cache).
    """
    from .._arrays import dtype_name

    kv = np.asarray(kv)
    b, n, s, d = kv.shape
    kfmt = k_cache_dtype or dtype_name(k_cache)
    cfmt = ckv_cache_dtype or dtype_name(ckv_cache)
    if v is None:
        dv = np.asarray(gamma).shape[-1]
        c_f32 = rms_norm_f32(kv[..., :dv], gamma, epsilon)
        k_f32 = interleave_rope_f32(kv[..., dv:], cos, sin)
        c_raw = None
    else:
        rope = np.asarray(cos).shape[-1]
        r = rms_norm_f32(kv, gamma, epsilon)
        k_f32 = np.concatenate([interleave_rope_f32(r[..., :rope], cos, sin), r[..., rope:]], axis=-1)
        c_raw = np.asarray(v)
        c_f32 = c_raw.astype(np.float32)

    k_vals = _cache_values(k_f32, kfmt, kv.dtype, k_rope_scale, k_rope_offset, hifloat8_overflow=hifloat8_overflow)
    c_vals = _cache_values(c_f32, cfmt, kv.dtype, c_kv_scale, c_kv_offset, raw=c_raw,
                           hifloat8_overflow=hifloat8_overflow)
    _write(k_cache, cache_mode, k_vals, index, b, s)
    _write(ckv_cache, cache_mode, c_vals, index, b, s)

    quantised = kfmt in QUANT_FORMATS or cfmt in QUANT_FORMATS
    effective = is_output_kv and (cache_mode != "Norm" or (v is not None and quantised))
    if not effective:
        return k_cache, ckv_cache, None, None
    k_rope = round_to_dtype(k_f32, kv.dtype)
    c_kv = c_raw.copy() if c_raw is not None else round_to_dtype(c_f32, kv.dtype)
    return k_cache, ckv_cache, k_rope, c_kv
