"""vLLM-Ascend's own KvCompressEpilog (``torch.ops._C_ascend.kv_compress_epilog``, Ascend 950), MXFP8 mode.

Source: vllm-project/vllm-ascend@182b75ea84ff13ece27b57391331ef8935410aea
``csrc/attention/kv_compress_epilog/`` (``op_host/kv_compress_epilog_tiling_arch35.cpp``,
``op_kernel/kv_compress_epilog.h``, ``op_kernel/kv_compress_epilog_common.h``: ``VFProcessDynamicMxFP8Quant``
and ``VFProcessDynamicMxFP8QuantLayout2``) and ``csrc/torch_binding.cpp`` (``kv_compress_epilog``). Documented
in ``docs/numerics/cache-writers.md#kv_compress_epilog_vllm``. It is a different operator from the CANN
KvCompressEpilog of :mod:`qsfa.reference.kv_compress_epilog` (other row layout, FP8-typed cache, no x_scale).

``x [T, d]`` bf16, ``n = d - 64`` NoPE columns then 64 RoPE columns; groups of ``G`` = ``quant_group_size``
(64 or 128) NoPE values, the last one partial when ``G`` does not divide n; ``g = ceil(n / G)`` scales.

Scale of a group (quant_mode 2, MXFP8), fp32 throughout:

* ``s = max(amax, 1e-4) * fp32(1 / FMAX)`` - FMAX 448 (E4M3FN cache) or 57344 (E5M2 cache); the reciprocal is
  rounded to fp32 first (0x3B124925 / 0x37924925), then multiplied;
* with ``round_scale_flag``: ``s = 2^(E + 1)`` where ``E = floor(log2 s)`` (the exponent field plus one, mantissa
  cleared). The kernel adds the one when the *exponent field* is non-zero (where a ceiling would test the
  mantissa), so a scale that is already a power of two is doubled: amax = 448 gives s = 1 -> 2, codes 224. For
  any other s this is the ceiling to a power of two;
* codes ``FP8_RINT(clamp(x / s, -FMAX, FMAX))`` (an fp32 divide; saturating);
* stored scale byte ``(bits(s) >> 23) & 0xFF`` - the E8M0 byte of s with round_scale_flag; without it the
  floor exponent of the unrounded s that the codes were divided by (the kernel's behaviour, kept).

Row layouts (``col = kv_cache_col(d, G)``, a multiple of 128):

======  ==============================================================================================
layout  where token t with slot s goes
======  ==============================================================================================
1       one row of ``col`` bytes at ``cache[s, 0, :col]`` (cache ``[num_slots, 1, head_dim]``):
        ``[0, 128)`` RoPE bf16 raw bits | ``[128, 128 + n)`` FP8 codes | ``g`` E8M0 scale bytes |
        zero padding to ``col``; bytes from col to head_dim keep their value
2       FlashMLA-MODEL1-like blocks (cache ``[num_blocks, block_size, 1, X]``, ``X >= vpt + spt``), slot s in
        block ``b = s // block_size`` at position ``p = s % block_size``; with the block's bytes ``B``
        (dims 1..3 flattened): ``B[p * vpt, (p + 1) * vpt)`` = n FP8 codes | 128 RoPE bytes
        (``vpt = n + 128``), ``B[bs * vpt + p * spt, ...)`` = g scale bytes then ``spt - g`` pad bytes
        (``spt = roundup(g, 8)``). The kernel copies those pad bytes from a scratch buffer it never
        writes (unspecified); qsfa writes 0. Every other byte keeps its value.
======  ==============================================================================================

With d = 512 and G = 64, layout 2 is FlashMLA's MODEL1 layout (:mod:`qsfa.reference.flashmla_model1`); only the
scale rule differs (the 1e-4 floor applies to amax here, to amax / 448 there; and the doubled powers of two).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import encode
from .scales import group_amax

__all__ = ["ROPE_DIM", "ROW_ALIGN", "FP8_MAX", "kv_cache_col", "value_per_token", "scale_per_token",
           "mxfp8_scales", "epilog_rows", "kv_compress_epilog_vllm", "scale_pad_mask"]

ROPE_DIM = 64
ROW_ALIGN = 128
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
_U32 = np.uint32


def _roundup(v: int, m: int) -> int:
    return -(-v // m) * m


def kv_cache_col(d: int, quant_group_size: int = 64) -> int:
    """Bytes of a layout-1 row: ``roundup(n + 128 + ceil(n / G), 128)`` (d 512, G 64 -> 640)."""
    n = d - ROPE_DIM
    return _roundup(n + 2 * ROPE_DIM + -(-n // quant_group_size), ROW_ALIGN)


def value_per_token(d: int) -> int:
    """Layout 2: FP8 codes + bf16 RoPE bytes per token, ``n + 128``."""
    return d - ROPE_DIM + 2 * ROPE_DIM


def scale_per_token(d: int, quant_group_size: int = 64) -> int:
    """Layout 2: scale bytes per token, ``roundup(ceil(n / G), 8)``."""
    return _roundup(-(-(d - ROPE_DIM) // quant_group_size), 8)


def mxfp8_scales(nope: np.ndarray, quant_group_size: int, fmt: str, round_scale: bool):
    """``(s, scale_bytes)`` of fp32 NoPE values ``[T, n]``: the fp32 divisor of every group ``[T, g]`` and
    the stored byte ``(bits(s) >> 23) & 0xFF`` ``[T, g]`` uint8 (see the module docstring)."""
    coeff = np.float32(1.0) / np.float32(FP8_MAX[fmt])  # fp32(1 / FMAX), as the kernel's SetMaxValue
    amax = group_amax(nope, quant_group_size)
    s = np.maximum(amax, np.float32(1e-4)) * coeff
    if round_scale:
        e = (s.view(_U32) >> _U32(23)) & _U32(0xFF)
        e = e + (e != 0).astype(_U32)
        s = (e << _U32(23)).view(np.float32)
    sb = ((s.view(_U32) >> _U32(23)) & _U32(0xFF)).astype(np.uint8)
    return s, sb


def epilog_rows(x: np.ndarray, *, quant_group_size: int = 64, fmt: str = "float8_e4m3fn",
                round_scale: bool = True):
    """``(codes uint8 [T, n], rope bytes uint8 [T, 128], scale bytes uint8 [T, g])`` of bf16 ``x [T, d]``."""
    x = np.asarray(x)
    t, d = x.shape
    n = d - ROPE_DIM
    nope = x[:, :n].astype(np.float32)
    s, sb = mxfp8_scales(nope, quant_group_size, fmt, round_scale)
    div = np.repeat(s, quant_group_size, axis=1)[:, :n]
    fmax = np.float32(FP8_MAX[fmt])
    y = np.clip(nope / div, -fmax, fmax)
    codes = encode(y, fmt, rounding="rint")
    rope = np.ascontiguousarray(x[:, n:]).view(np.uint16).astype("<u2").view(np.uint8).reshape(t, 2 * ROPE_DIM)
    return codes, rope, sb


def kv_compress_epilog_vllm(kv_compress_cache: np.ndarray, x: np.ndarray, slot_mapping, *,
                            quant_group_size: int = 64, quant_mode: int = 2, round_scale_flag: bool = True,
                            layout: int = 1) -> np.ndarray:
    """Quantise ``x [T, d]`` (bf16) and write it into the FP8-typed cache by slot (-1 skips); returns the cache.

    kv_compress_cache: layout 1 ``[num_slots, 1, head_dim]``, layout 2 ``[num_blocks, block_size, 1, X]``;
    float8_e4m3fn or float8_e5m2 (the code format), written in place (any stride along dimension 0)."""
    assert quant_mode == 2, "only quant_mode 2 (MXFP8) is modelled"
    cache = kv_compress_cache
    fmt = "float8_e5m2" if cache.dtype == np.dtype(ml_dtypes.float8_e5m2) else "float8_e4m3fn"
    x = np.asarray(x)
    d = x.shape[1]
    n = d - ROPE_DIM
    codes, rope, sb = epilog_rows(x, quant_group_size=quant_group_size, fmt=fmt, round_scale=bool(round_scale_flag))
    s = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
    keep = s != -1
    s, codes, rope, sb = s[keep], codes[keep], rope[keep], sb[keep]
    t, g = sb.shape
    byte_view = cache.view(np.uint8)
    if layout == 1:
        col = kv_cache_col(d, quant_group_size)
        rows = np.zeros((t, col), np.uint8)
        rows[:, :2 * ROPE_DIM] = rope
        rows[:, 2 * ROPE_DIM:2 * ROPE_DIM + n] = codes
        rows[:, 2 * ROPE_DIM + n:2 * ROPE_DIM + n + g] = sb
        byte_view[s, 0, :col] = rows
        return cache
    nb, bs = cache.shape[0], cache.shape[1]
    blocks = byte_view.reshape(nb, -1)  # a view: the contract requires dimensions 1..3 to be dense
    assert np.may_share_memory(blocks, byte_view), "layout-2 cache blocks must be dense"
    vpt, spt = value_per_token(d), scale_per_token(d, quant_group_size)
    blk, pos = s // bs, s % bs
    values = np.concatenate([codes, rope], axis=1)  # [t, vpt]
    scales = np.zeros((t, spt), np.uint8)
    scales[:, :g] = sb
    v_off = pos[:, None] * vpt + np.arange(vpt)
    s_off = bs * vpt + pos[:, None] * spt + np.arange(spt)
    blocks[blk[:, None], v_off] = values
    blocks[blk[:, None], s_off] = scales
    return cache


def scale_pad_mask(cache_shape, d: int, slot_mapping, *, quant_group_size: int = 64, layout: int = 1) -> np.ndarray:
    """bool of ``cache_shape`` (a one-byte cache): True at the bytes a call leaves unspecified - layout 2's scale
    padding of every written token, ``B[bs * vpt + p * spt + g, bs * vpt + (p + 1) * spt)`` (the kernel copies it
    from a scratch buffer it never writes; :func:`kv_compress_epilog_vllm` writes 0). Layout 1 has none (its row
    padding is written as zeros); bytes no token targets keep their value, so they are specified."""
    shape = tuple(int(x) for x in cache_shape)
    mask = np.zeros(shape, bool)
    if layout != 2:
        return mask
    s = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
    s = s[s >= 0]
    nb, bs = shape[0], shape[1]
    flat = mask.reshape(nb, -1)
    n = d - ROPE_DIM
    g = -(-n // quant_group_size)
    vpt, spt = value_per_token(d), scale_per_token(d, quant_group_size)
    if spt > g and s.size:
        off = bs * vpt + (s % bs)[:, None] * spt + np.arange(g, spt)
        flat[(s // bs)[:, None], off] = True
    return mask
