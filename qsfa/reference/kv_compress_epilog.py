"""KvCompressEpilog (docs/numerics/cache-writers.md#kv_compress_epilog, seed 002; cannmirror/ops-transformer attention/kv_compress_epilog/): quantise bf16 rows, scatter by slot.

``x [..., d]`` bfloat16 with ``n = d - 64`` NoPE columns first and the last 64 columns the RoPE. Each token
becomes one row of ``kv_cache_col`` bytes written at ``cache[s // blockSize, s % blockSize, 0, :kvCacheCol]``
(bytes from kvCacheCol to headDim keep their value; slot -1 writes nothing):

======  ==============================================================================  ========================
mode    row layout                                                                      kvCacheCol
======  ==============================================================================  ========================
0       [0,128) RoPE bf16 raw bits | n FP8 E4M3FN | G = n/64 bf16 scales | zero pad    roundup(128+n+2G, pad_to)
1       [0,128) RoPE bf16 raw bits | n FP8 E4M3FN | G E8M0 scale bytes                  128 + n + G
2       [0,64) RoPE HiFloat8 | n/2 packed FP4 E2M1 | n/gs bf16 scales | zero pad        roundup(64+n/2+2n/gs, pad_to)
======  ==============================================================================  ========================

Modes 0/1 (groups of 64 NoPE columns; quant_group_size is ignored), per group (docs/numerics/quantisers.md#fp8-group, "fp8 group"):
``s = max(amax, 1e-4) * fp32(1/448)`` (multiply by the rounded reciprocal 0x3B124925); with ``round_scale``
s is ceiled to a power of two by bit manipulation; ``q = E4M3FN_RINT(clamp(x / s, -448, 448))`` (fp32
divide, as the kernel's ``Div``). Mode 0 stores ``BF16_RINT(s)``; mode 1 stores ``(bits(s) >> 23) & 0xFF``
- with ``round_scale=False`` that is the floor exponent while the codes used the unrounded s (the
kernel's quirk, reproduced). An all-zero group: s = 2.2321e-7 (2^-22 rounded), bytes 0x3480 / 0x69 with
round_scale, 0x3470 / 0x68 without.

Mode 2: RoPE ``HiF8(x * x_scale)`` (fp32 multiply, TA, saturating); NoPE per group of ``gs``
(docs/numerics/quantisers.md#fp4-group, "fp4 group"): stored scale ``BF16_RINT(amax * fp32(1/6))``, multiplier
``inv = BF16_RINT(6 / amax)`` (0 for an all-zero group, which stores 0x0000 and codes 0); codes
``E2M1_RINT(clamp(BF16_RINT(x * inv), -6, 6))`` - the product is a bf16 multiply (exact fp32 product of
two bf16 values, rounded once to bf16). Two codes per byte, ``fp4_nibble_order`` (**OPEN**, docs/numerics/open-facts.md#nibble_order).

``pad_to`` (**OPEN**, docs/numerics/open-facts.md#pad_to): the row padding granularity of modes 0 and 2, default 32.
"""

from __future__ import annotations

import numpy as np

from .formats import encode, pack_fp4
from .scales import e8m0_byte, fp4_group_scale, fp8_group_scale, group_amax, round_scale_pow2
from .scatter import scatter_by_slot

__all__ = ["ROPE_DIM", "FP8_GROUP", "kv_cache_col", "epilog_rows", "kv_compress_epilog"]

ROPE_DIM = 64
FP8_GROUP = 64


def _roundup(v: int, m: int) -> int:
    return -(-v // m) * m


def kv_cache_col(d: int, quant_mode: int, quant_group_size: int = 64, pad_to: int = 32) -> int:
    """Bytes written per row (kvCacheCol, padding included) for ``x [..., d]``."""
    n = d - ROPE_DIM
    if quant_mode in (0, 1):
        g = -(-n // FP8_GROUP)
        return _roundup(128 + n + 2 * g, pad_to) if quant_mode == 0 else 128 + n + g
    return _roundup(ROPE_DIM + n // 2 + 2 * (n // quant_group_size), pad_to)


def _le_bytes(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.astype(a.dtype.newbyteorder("<")).view(np.uint8).reshape(*a.shape[:-1], -1)


def epilog_rows(x: np.ndarray, *, quant_group_size: int = 64, quant_mode: int = 1, round_scale: bool = True,
                x_scale: float = 1.0, pad_to: int = 32, fp4_nibble_order: str = "low_first") -> np.ndarray:
    """The rows KvCompressEpilog writes for bf16 ``x [T, d]``: uint8 ``[T, kvCacheCol]``."""
    x = np.asarray(x)
    t, d = x.shape
    n = d - ROPE_DIM
    col = kv_cache_col(d, quant_mode, quant_group_size, pad_to)
    xf = x.astype(np.float32)
    nope = xf[:, :n]
    out = np.zeros((t, col), np.uint8)
    if quant_mode in (0, 1):
        s = fp8_group_scale(group_amax(nope, FP8_GROUP))  # [T, G]
        if round_scale:
            s = round_scale_pow2(s)
        y = nope / np.repeat(s, FP8_GROUP, axis=1)[:, :n]
        y = np.clip(y, np.float32(-448.0), np.float32(448.0))
        codes = encode(y, "float8_e4m3fn", saturate=True, rounding="rint")
        out[:, :128] = _le_bytes(np.ascontiguousarray(x[:, n:]).view(np.uint16))
        out[:, 128:128 + n] = codes
        if quant_mode == 0:
            sb = _le_bytes(encode(s, "bfloat16", rounding="rint"))
        else:
            sb = e8m0_byte(s)
        out[:, 128 + n:128 + n + sb.shape[1]] = sb
        return out
    gs = quant_group_size
    rope = xf[:, n:] * np.float32(x_scale)
    out[:, :ROPE_DIM] = encode(rope, "hifloat8", saturate=True, rounding="round")
    fs = fp4_group_scale(group_amax(nope, gs))  # [T, n/gs]
    inv = np.repeat(fs.inv.astype(np.float32), gs, axis=1)
    xq = _bf16_bits_to_f32(encode(nope * inv, "bfloat16", rounding="rint"))  # exact product, one bf16 rounding
    xq = np.clip(xq, np.float32(-6.0), np.float32(6.0))
    codes = encode(xq, "float4_e2m1", saturate=True, rounding="rint")
    packed = pack_fp4(codes, nibble_order=fp4_nibble_order)
    out[:, ROPE_DIM:ROPE_DIM + n // 2] = packed
    sb = _le_bytes(np.asarray(fs.scale_bits, dtype=np.uint16))
    out[:, ROPE_DIM + n // 2:ROPE_DIM + n // 2 + sb.shape[1]] = sb
    return out


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << np.uint32(16)).view(np.float32)


def kv_compress_epilog(cache: np.ndarray, x: np.ndarray, slot_mapping, *, quant_group_size: int = 64,
                       quant_mode: int = 1, round_scale: bool = True, x_scale: float = 1.0, pad_to: int = 32,
                       fp4_nibble_order: str = "low_first") -> np.ndarray:
    """Quantise ``x [..., d]`` (bf16) row by row and scatter into ``cache [blockNum, blockSize, 1, headDim]``
    (uint8, in place, any stride along blockNum) by ``slot_mapping`` (shape ``x.shape[:-1]``; -1 skipped).
    Returns ``cache``; zero tokens write nothing."""
    x = np.asarray(x)
    if x.size == 0:  # no token: nothing to quantise or write (the row helpers reshape by the token count)
        return cache
    rows = epilog_rows(x.reshape(-1, x.shape[-1]), quant_group_size=quant_group_size, quant_mode=quant_mode,
                       round_scale=round_scale, x_scale=x_scale, pad_to=pad_to, fp4_nibble_order=fp4_nibble_order)
    scatter_by_slot(cache, rows[:, None, :], np.asarray(slot_mapping).reshape(-1))
    return cache
