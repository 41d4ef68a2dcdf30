"""FlashMLA's MODEL1 FP8 sparse KV cache (DeepSeek V4 geometry): quantise bf16 K rows into it and back.

Source: deepseek-ai/FlashMLA@9241ae3ef9bac614dd25e45e507e089f888280e0 ``tests/quant.py``
(``FP8KVCacheLayout.MODEL1_FP8Sparse``: d 512 = 448 NoPE + 64 RoPE, tiles of 64, 7 tiles). Documented in
``docs/numerics/flashmla-model1.md``.

Byte layout of one block of ``bs`` tokens (``B = bs * 584`` bytes of data, the block padded to
``P = ceil(B / 576) * 576`` bytes; :func:`block_bytes`):

=====================================  ======================================================================
bytes of the block                     contents
=====================================  ======================================================================
``[576 t, 576 t + 448)``               token t's 448 NoPE codes, FP8 E4M3FN
``[576 t + 448, 576 t + 576)``         token t's 64 RoPE values, bf16, little-endian raw bits (not quantised)
``[576 bs + 8 t, 576 bs + 8 t + 7)``   token t's 7 tile scales, E8M0 bytes (tile j = NoPE [64 j, 64 j + 64))
``576 bs + 8 t + 7``                   pad byte (written 0 here)
``[584 bs, P)``                        block padding (written 0 here)
=====================================  ======================================================================

So every token's 576 NoPE+RoPE bytes come first, then every token's 8 scale bytes. (The per-token summary
"448 | 128 | 8 = 584 bytes" of the vLLM notes counts the same bytes but not where they sit.) FlashMLA
allocates the cache with ``torch.empty``: its pad bytes are unspecified and no reader uses them; this
reference writes them as 0 so its output is deterministic.

Quantisation of tile j of token t (``x`` = the 64 bf16 NoPE values, widened exactly to fp32):

* ``amax = max |x|``; ``v = max(amax / 448, fp32(1e-4))`` (fp32 divide);
* ``s = 2^ceil(log2(v))`` - the exact power-of-two ceiling of v (``round_scale_pow2``); since
  v >= 1e-4, ``s >= 2^-13`` (an all-zero tile: s = 2^-13, byte 0x72). FlashMLA evaluates
  ``ceil(log2(v))`` in float32, which returns k for v a few ulps above 2^k; for bf16 input that never
  happens (amax / 448 is at least 1/1792 relatively away from any power of two unless it is one), so
  the two agree on every bf16 input - ``tests/test_flashmla_model1.py`` checks every bf16 amax;
* codes ``E4M3FN_RINT(x / s)`` (exact fp32 divide by a power of two; |x / s| <= 448, never saturates);
* scale byte ``log2(s) + 127`` (E8M0).

Dequantisation (FlashMLA's ``dequantize_k_cache``): the code and the scale are each converted to bf16
(exact: an E4M3 value and a power of two 2^-127..2^127 are bf16 values) and multiplied in bf16 - one fp32
product rounded to bf16 (RINT). On bytes written by :func:`quantize` the product is exact for NoPE
magnitudes below 1.9375 * 2^127 (bf16 0x7F78; beyond, code 256 times scale 2^120 overflows to inf:
docs/numerics/flashmla-model1.md#fixed-points); on arbitrary bytes an E4M3 NaN code (0x7F / 0xFF) or the E8M0
NaN byte 0xFF gives NaN - qsfa always writes the bf16 bits 0x7FC0 (torch: 0x7FC0 from its scalar CPU loop,
0xFFFF from its vectorised one) - and ``448 * 2^127`` overflows to inf. RoPE bits are copied unchanged (NaN
payloads included).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import decode, encode
from .scales import flashmla_v32_scale

__all__ = [
    "D", "D_NOPE", "D_ROPE", "TILE", "NUM_TILES", "TOKEN_BYTES", "DATA_BYTES", "SCALE_STRIDE", "BLOCK_ALIGN",
    "block_bytes", "quantize", "dequantize", "unpack", "pad_mask",
]

D, D_NOPE, D_ROPE, TILE, NUM_TILES = 512, 448, 64, 64, 7
#: NoPE codes + RoPE bf16 of one token, stored together
DATA_BYTES = D_NOPE + 2 * D_ROPE  # 576
#: scale bytes per token (7 E8M0 + 1 pad)
SCALE_STRIDE = NUM_TILES + 1  # 8
#: bytes per token in all
TOKEN_BYTES = DATA_BYTES + SCALE_STRIDE  # 584
#: every block is padded to a multiple of this many bytes
BLOCK_ALIGN = 576

_BF16 = np.dtype(ml_dtypes.bfloat16)


def block_bytes(block_size: int) -> int:
    """Bytes of one padded block: ``ceil(block_size * 584 / 576) * 576`` (block_size 64 -> 37440)."""
    return -(-int(block_size) * TOKEN_BYTES // BLOCK_ALIGN) * BLOCK_ALIGN


def pad_mask(num_blocks: int, block_size: int) -> np.ndarray:
    """bool ``[num_blocks, block_bytes(block_size)]`` (read-only): True at the bytes this layout leaves unspecified -
    every token's pad byte ``576 bs + 8 t + 7`` and the block padding ``[584 bs, P)``. FlashMLA allocates the cache
    with ``torch.empty`` and never writes them; :func:`quantize` writes 0 there."""
    bs = int(block_size)
    m = np.zeros(block_bytes(bs), bool)
    m[DATA_BYTES * bs + SCALE_STRIDE * np.arange(bs) + NUM_TILES] = True
    m[TOKEN_BYTES * bs:] = True
    return np.broadcast_to(m, (int(num_blocks), m.size))


def quantize(k: np.ndarray) -> np.ndarray:
    """bf16 ``k [num_blocks, block_size, 1, 512]`` -> uint8 cache ``[num_blocks, block_bytes(block_size)]``."""
    k = np.asarray(k)
    nb, bs = k.shape[0], k.shape[1]
    x = k.reshape(nb, bs, D)
    nope = x[..., :D_NOPE].astype(np.float32)
    amax = np.abs(nope).reshape(nb, bs, NUM_TILES, TILE).max(axis=-1)  # [nb, bs, 7]
    s = flashmla_v32_scale(amax, ceil_mode="bits")  # 2^ceil(log2(max(amax / 448, 1e-4)))
    y = nope.reshape(nb, bs, NUM_TILES, TILE) / s[..., None]
    codes = encode(y.reshape(nb, bs, D_NOPE), "float8_e4m3fn", rounding="rint")
    scale_bytes = ((s.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(np.uint8)

    out = np.zeros((nb, block_bytes(bs)), np.uint8)
    data = out[:, :bs * DATA_BYTES].reshape(nb, bs, DATA_BYTES)
    data[..., :D_NOPE] = codes
    rope = np.ascontiguousarray(x[..., D_NOPE:]).view(np.uint16).astype("<u2")
    data[..., D_NOPE:] = rope.view(np.uint8).reshape(nb, bs, 2 * D_ROPE)
    scales = out[:, bs * DATA_BYTES:bs * TOKEN_BYTES].reshape(nb, bs, SCALE_STRIDE)
    scales[..., :NUM_TILES] = scale_bytes
    return out


def unpack(cache: np.ndarray, block_size: int):
    """Split a MODEL1 cache ``[num_blocks, block_bytes]`` (one-byte elements) into ``(codes uint8
    [nb, bs, 448], rope bf16 [nb, bs, 64], scale bytes uint8 [nb, bs, 7])`` - byte moves only."""
    b = np.ascontiguousarray(cache).view(np.uint8)
    nb, bs = b.shape[0], int(block_size)
    data = b[:, :bs * DATA_BYTES].reshape(nb, bs, DATA_BYTES)
    codes = data[..., :D_NOPE].copy()
    rope = np.ascontiguousarray(data[..., D_NOPE:]).view("<u2").astype(np.uint16).view(_BF16)
    scales = b[:, bs * DATA_BYTES:bs * TOKEN_BYTES].reshape(nb, bs, SCALE_STRIDE)[..., :NUM_TILES].copy()
    return codes, rope, scales


def dequantize(cache: np.ndarray, block_size: int) -> np.ndarray:
    """uint8 cache ``[num_blocks, block_bytes(block_size)]`` -> bf16 ``[num_blocks, block_size, 1, 512]``."""
    codes, rope, scale_bytes = unpack(cache, block_size)
    nb, bs = codes.shape[0], codes.shape[1]
    vals = decode(codes, "float8_e4m3fn").reshape(nb, bs, NUM_TILES, TILE)
    s = decode(scale_bytes, "float8_e8m0")[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        prod = (vals * s).reshape(nb, bs, D_NOPE)  # exact fp32 product (or inf), rounded once to bf16
    out = np.empty((nb, bs, D), np.uint16)
    out[..., :D_NOPE] = np.where(np.isnan(prod), np.uint16(0x7FC0), encode(prod, "bfloat16", rounding="rint"))
    out[..., D_NOPE:] = rope.view(np.uint16)
    return out.view(_BF16).reshape(nb, bs, 1, D)
