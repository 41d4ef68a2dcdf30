"""DeepSeek-V4 indexer cache writers (Ascend 950): ``indexer_quant_cache`` and ``indexer_compress_epilog_v2``.

Documented in ``docs/numerics/cache-writers.md#indexer_quant_cache`` and
``docs/numerics/cache-writers.md#indexer_compress_epilog_v2``. Both are quantisers followed by a scatter, so the
reference is exact: every step below is an fp32 operation (NumPy float32 arithmetic is IEEE round-to-nearest-even
like the vector unit) or a bit manipulation, and the result is the kernel's bytes.

indexer_quant_cache - cannmirror/ops-transformer@7904813 ``attention/indexer_quant_cache/``
(``op_kernel/arch35/indexer_quant_cache_base.h``, ``..._multi_row_mx_fp8.h``, ``..._mx_fp4_base.h``,
``op_host/indexer_quant_cache_tiling_arch35.cpp``). ``x [..., d]`` float16 / bfloat16, d a multiple of 32:

=========  =================================================================================================
quant_mode  one row (token) of x, fp32 throughout
=========  =================================================================================================
"mxfp8"    groups of 32: ``amax' = max(amax, 1e-4)``, ``s = amax' * fp32(1/FMAX)``, ceiled to a power of two
           (``e = exp(s) + (mantissa(s) != 0)``; round_scale is not read - the kernel has only this path);
           E8M0 byte ``e``; codes ``FP8_RINT(x * 2^(127 - e))`` (an exact multiply)
"fp8"      one group per row: ``s = amax * fp32(1/FMAX)`` (0 for an all-zero row); stored fp32 ``s``.
           round_scale: ``s`` ceiled to a power of two, ``inv = 2^(127 - exp(s))`` (bits ``(254 - e) << 23``);
           otherwise ``inv = fp32(1 / s)``. codes ``FP8_RINT(fp32(x * inv))``, where the product is NaN
           (``0 * Inf`` of an all-zero row) x itself is cast (so +-0 stay +-0)
"hifloat8" ``HIF8_ROUND_SAT(fp32(x * x_scale))`` (ties away, saturating); cache_scale is not written by
           qsfa (docs/numerics/open-facts.md#indexer_quant_cache_hifloat8_scale)
"mxfp4"    groups of 32, E2M1 codes packed two per byte (element 2i in the low nibble): M = the largest
           bf16 exponent field of the group (a float16 x is first truncated to bf16); E8M0 byte
           ``max(M - 2, 0)`` (0 also for an all-zero group); multiplier ``2^(127 - byte)`` (0 for an all-zero
           group); codes ``E2M1_RINT_SAT(bf16(x) * multiplier)``. For float16 x the kernel sets mantissa bit 3
           when the low byte is in (0, 8) before truncating (a sticky bit), and the reference does the same
=========  =================================================================================================

FMAX = 448 (float8_e4m3fn cache) or 57344 (float8_e5m2); fp32(1/448) = 0x3B124925, fp32(1/57344) = 0x37924925.
Every cache is 4-D ``[num_blocks, block_size, 1, head_dim]``; slot s goes to ``[s // block_size, s % block_size,
0, :width]``; -1 skips the token.

indexer_compress_epilog_v2 - vllm-project/vllm-ascend@182b75e ``csrc/attention/indexer_compress_epilog_v2/``
(``op_kernel/indexer_compress_epilog_v2_base.h``, ``..._multi_row.h``, ``op_host/..._tiling.cpp``) and
``csrc/torch_binding.cpp``: FP8 E4M3FN with one fp32 scale per 128 values (the last group partial),
``s = amax * fp32(1/448)`` (0 for an all-zero group), codes ``FP8_RINT(fp32(x / s))`` (an fp32 divide; 0/0 keeps
x). Cache ``uint8 [num_blocks, block_size, 1, D]``: block b's bytes hold every token's d codes
(``pos * d``), then every token's ``ceil(d / 128)`` little-endian fp32 scales (``block_size * d + pos * 4 *
ceil(d / 128)``); other bytes keep their value.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import encode, pack_fp4
from .scales import FP8_AMAX_FLOOR, RECIP_448, round_scale_pow2

__all__ = [
    "QUANT_MODES",
    "MX_BLOCK",
    "EPILOG_V2_GROUP",
    "FP8_RECIP",
    "scale_cols",
    "cache_width",
    "fp8_row_quant",
    "mxfp8_quant",
    "hifloat8_quant",
    "mxfp4_quant",
    "epilog_v2_quant",
    "indexer_quant_cache",
    "indexer_compress_epilog_v2",
]

#: quant_mode strings of cann_ops_transformer.indexer_quant_cache, in the order of the kernel's integers 0..3.
QUANT_MODES = ("mxfp8", "fp8", "hifloat8", "mxfp4")
#: elements per E8M0 scale of the MX modes
MX_BLOCK = 32
#: elements per fp32 scale of indexer_compress_epilog_v2
EPILOG_V2_GROUP = 128

_F32, _U32, _U16 = np.float32, np.uint32, np.uint16
#: fp32(1 / FMAX) per FP8 cache format (the kernel's INV_FP8_*_MAX_VALUE bit patterns)
FP8_RECIP = {"float8_e4m3fn": RECIP_448, "float8_e5m2": np.array(0x37924925, _U32).view(_F32)[()]}


def scale_cols(d: int, quant_mode: str) -> int:
    """Scales per token: ``ceil(d / 32)`` for the MX modes, 1 for "fp8" / "hifloat8"."""
    return -(-d // MX_BLOCK) if quant_mode in ("mxfp8", "mxfp4") else 1


def cache_width(d: int, quant_mode: str) -> int:
    """Cache bytes per token: d, or ``ceil(d / 2)`` packed FP4 bytes for "mxfp4"."""
    return (d + 1) // 2 if quant_mode == "mxfp4" else d


def _pow2_inverse(e: np.ndarray) -> np.ndarray:
    """``2^(127 - e)`` for biased exponents ``e`` in [0, 254]: fp32 bits ``(254 - e) << 23``."""
    return ((_U32(254) - e.astype(_U32)) << _U32(23)).view(_F32)


def fp8_row_quant(x: np.ndarray, fmt: str, round_scale: bool):
    """"fp8" mode: ``(codes uint8 [T, d], scale float32 [T, 1])`` of ``x [T, d]`` (one scale per row)."""
    xf = np.asarray(x).astype(_F32)
    amax = np.abs(xf).max(axis=1, keepdims=True)
    s = np.where(amax != 0, amax * FP8_RECIP[fmt], _F32(0)).astype(_F32)
    if round_scale:
        s = round_scale_pow2(s)
        inv = _pow2_inverse(s.view(_U32) >> _U32(23))
    else:
        with np.errstate(divide="ignore"):
            inv = (_F32(1) / s).astype(_F32)
    with np.errstate(invalid="ignore"):
        y = xf * inv
    y = np.where(np.isnan(y), xf, y)
    return encode(y, fmt, rounding="rint"), s


def mxfp8_quant(x: np.ndarray, fmt: str):
    """"mxfp8" mode: ``(codes uint8 [T, d], e8m0 bytes uint8 [T, d / 32])``."""
    xf = np.asarray(x).astype(_F32)
    t, d = xf.shape
    g = xf.reshape(t, d // MX_BLOCK, MX_BLOCK)
    amax = np.maximum(np.abs(g).max(axis=2), FP8_AMAX_FLOOR)
    e = round_scale_pow2(amax * FP8_RECIP[fmt]).view(_U32) >> _U32(23)
    y = g * _pow2_inverse(e)[:, :, None]
    return encode(y.reshape(t, d), fmt, rounding="rint"), e.astype(np.uint8)


def hifloat8_quant(x: np.ndarray, x_scale: float):
    """"hifloat8" mode: HiFloat8 codes uint8 ``[T, d]`` of ``fp32(x * x_scale)`` (ties away, saturating)."""
    y = np.asarray(x).astype(_F32) * _F32(x_scale)
    return encode(y, "hifloat8", saturate=True, rounding="round")


def mxfp4_quant(x: np.ndarray):
    """"mxfp4" mode: ``(packed E2M1 bytes uint8 [T, d / 2], e8m0 bytes uint8 [T, d / 32])`` of float16 / bf16 x."""
    x = np.asarray(x)
    t, d = x.shape
    if x.dtype == np.float16:
        b = x.view(_U16)
        low = b & _U16(0xFF)
        b = np.where((low > 0) & (low < 8), b | _U16(8), b)
        x32 = b.view(np.float16).astype(_F32)
    else:
        x32 = x.astype(_F32)
    # truncation to bf16 (exact for bf16 x): the high half of the fp32 bits
    xb = (x32.view(_U32) & _U32(0xFFFF0000)).view(_F32).reshape(t, d // MX_BLOCK, MX_BLOCK)
    m = ((xb.view(_U32) >> _U32(23)) & _U32(0xFF)).max(axis=2)
    byte = np.where(m <= 2, _U32(0), m - _U32(2))
    mult = np.where(m == 0, _F32(0), _pow2_inverse(byte))
    codes = encode((xb * mult[:, :, None]).reshape(t, d), "float4_e2m1", saturate=True, rounding="rint")
    return pack_fp4(codes), byte.astype(np.uint8)


def epilog_v2_quant(x: np.ndarray):
    """indexer_compress_epilog_v2: ``(codes uint8 [T, d] E4M3FN, scales float32 [T, ceil(d / 128)])``."""
    xf = np.asarray(x).astype(_F32)
    t, d = xf.shape
    g = -(-d // EPILOG_V2_GROUP)
    pad = np.zeros((t, g * EPILOG_V2_GROUP), _F32)
    pad[:, :d] = np.abs(xf)
    amax = pad.reshape(t, g, EPILOG_V2_GROUP).max(axis=2)
    s = np.where(amax != 0, amax * RECIP_448, _F32(0)).astype(_F32)
    div = np.repeat(s, EPILOG_V2_GROUP, axis=1)[:, :d]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = xf / div
    y = np.where(np.isnan(y), xf, y)
    return encode(y, "float8_e4m3fn", rounding="rint"), s


def _rows(x, slot_mapping):
    x = np.asarray(x)
    x2 = x.reshape(-1, x.shape[-1])
    s = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
    keep = s != -1
    return x2[keep], s[keep]


def indexer_quant_cache(cache: np.ndarray, cache_scale: np.ndarray, x: np.ndarray, slot_mapping, *,
                        quant_mode: str = "fp8", round_scale: bool = True, x_scale: float = 1.0):
    """Quantise ``x [..., d]`` per ``quant_mode`` and write every token by slot (-1 skips) into
    ``cache [nb, bs, 1, W]`` and ``cache_scale [nb, bs, 1, Ws]``, in place; returns ``(cache, cache_scale)``.

    cache: float8_e4m3fn / float8_e5m2 ("mxfp8", "fp8"), uint8 HiFloat8 codes ("hifloat8"), uint8 packed E2M1
    ("mxfp4"); cache_scale: float32 ("fp8", "hifloat8") or uint8 E8M0 bytes ("mxfp8", "mxfp4")."""
    mode = quant_mode.lower()
    xk, s = _rows(x, slot_mapping)
    fmt = "float8_e5m2" if cache.dtype == np.dtype(ml_dtypes.float8_e5m2) else "float8_e4m3fn"
    scales = None
    if mode == "fp8":
        codes, scales = fp8_row_quant(xk, fmt, bool(round_scale))
    elif mode == "mxfp8":
        codes, scales = mxfp8_quant(xk, fmt)
    elif mode == "hifloat8":
        codes = hifloat8_quant(xk, float(x_scale))
    else:
        codes, scales = mxfp4_quant(xk)
    bs = cache.shape[1]
    blk, pos = s // bs, s % bs
    cache.view(np.uint8)[blk, pos, 0, :codes.shape[1]] = codes
    if scales is not None:
        cache_scale[blk, pos, 0, :scales.shape[1]] = scales.view(cache_scale.dtype)
    return cache, cache_scale


def indexer_compress_epilog_v2(indexer_compress_cache: np.ndarray, x: np.ndarray, slot_mapping, *,
                               layout: int = 2) -> np.ndarray:
    """Quantise ``x [..., d]`` to E4M3FN with fp32 scales per 128 values and write every token by slot (-1
    skips) into the uint8 cache ``[nb, bs, 1, D]`` (block layout of the module docstring), in place."""
    assert layout == 2, "only layout 2 exists"
    cache = indexer_compress_cache
    xk, s = _rows(x, slot_mapping)
    codes, scales = epilog_v2_quant(xk)
    t, d = codes.shape
    nb, bs = cache.shape[0], cache.shape[1]
    blocks = cache.reshape(nb, -1)  # dims 1..3 are dense (contract): a view
    assert np.may_share_memory(blocks, cache) or not cache.size, "cache blocks must be dense"
    sb = scales.astype("<f4").view(np.uint8).reshape(t, 4 * scales.shape[1])
    blk, pos = s // bs, s % bs
    blocks[blk[:, None], pos[:, None] * d + np.arange(d)] = codes
    blocks[blk[:, None], bs * d + pos[:, None] * sb.shape[1] + np.arange(sb.shape[1])] = sb
    return cache
