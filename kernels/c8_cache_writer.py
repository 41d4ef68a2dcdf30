"""Triton kernel: the QSFA C8 cache writer (quantise + pack + scatter by slot), docs/numerics/cache-writers.md#c8_cache_write,
#scatter_by_slot and docs/numerics/quantisers.md#int8-dynamic.

One program per token, one launch per batch. For token t with slot s = slot_mapping[t] (s = -1: nothing
is written), the packed row ``kv_cache[s // block_size, s % block_size, 0, :]`` receives

* bytes [0, 512): int8 NoPE, per 1x128 tile j: ``amax = max|x|`` (fp32), ``s_j = amax / 127`` (fp32,
  correctly rounded division), ``q = clamp(RINT(x / s_j), -127, 127)``; an all-zero tile gives s_j = 0 and
  q = 0 (docs/numerics/open-facts.md#zero-tile: OPEN on hardware, qsfa's definition);
* bytes [512, 640): the raw 16-bit RoPE bytes (rope 64 only);
* bytes [640, 656) (or [512, 528) at rope 0): s_0..s_3 as little-endian fp32.

Bytes outside written rows are never touched. Exactness on every target: divisions are
``tl.math.div_rn``; RINT is the magic-number add (|x / s| <= 127.00001 < 2**22); amax is an exact fp32
max; the scale bytes are the fp32 bit pattern split by shifts. See kernels/_common.py for the
interpreter-vs-GPU notes.

``key_dtype="float8_e4m3fn"`` (Ascend 950): ``s = amax / 448``, ``q = E4M3FN_RNE(clamp(x / s, +-448))``,
encoded by bit arithmetic (the interpreter's fp8 conversion does not round to nearest even).

``scale_order`` (qsfa.reference.quant; per chip, docs/numerics/chips.md#c8-cache-writers): ``"divide"`` (950;
the default here) quantises ``x / s``; ``"reciprocal"`` (A2/A3) quantises ``x * fp32(fp32(1 / amax) * TYPE_MAX)`` and
stores ``s = amax * fp32(1 / TYPE_MAX)``; ``"reciprocal_multiply"`` that multiplier with ``s = amax / TYPE_MAX``;
``"multiply"`` quantises ``x * fp32(TYPE_MAX / amax)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import rint_small, to_f32

__all__ = ["c8_cache_write_kernel", "launch_c8_cache_write", "SCALE_ORDERS", "KEY_DTYPES"]

SCALE_ORDERS = ("divide", "multiply", "reciprocal", "reciprocal_multiply")  # index = the ORDER constexpr
KEY_DTYPES = ("int8", "float8_e4m3fn")

NOPE = 512
TILE = 128
N_TILES = NOPE // TILE
ROPE_BYTES = 128  # 64 x 16-bit


@triton.jit
def _encode_e4m3fn(y):
    """fp32 ``y`` with |y| <= 448 -> FP8 E4M3FN code (uint8), round half to even, by bit arithmetic.

    Normal range (|y| >= 2**-6): the fp32 pattern rounded at bit 20 (RNE) then rebiased (127 -> 7);
    subnormal range: RINT(|y| * 2**9) (which lands on 8 = the smallest normal where it should).
    The sign is the sign bit of ``y`` (so -0.0 and negative values that round to 0 give 0x80, as a cast does).
    """
    a = tl.abs(y)
    b = a.to(tl.uint32, bitcast=True)
    rb = b + (0x7FFFF + ((b >> 20) & 1))
    normal = ((rb >> 20).to(tl.int32) - 960)  # 960 = (127 - 7) << 3
    sub = rint_small(a * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    sign = ((y.to(tl.uint32, bitcast=True) >> 31) << 7).to(tl.int32)
    return (code | sign).to(tl.uint8)


@triton.jit
def c8_cache_write_kernel(
    nope_ptr, stride_nt, stride_nd,          # k_nope [T, 512] fp16/bf16 (element strides)
    rope_ptr, stride_rt,                     # k_rope viewed as uint8 [T, 128] (row stride in bytes)
    slot_ptr,                                # slot_mapping [T] int32/int64
    cache_ptr, stride_cb, stride_cr,         # kv_cache as uint8 [block_num, block_size, 1, W]; byte strides
    stride_cc,                               # byte stride of the last (column) dim
    block_size,
    HAS_ROPE: tl.constexpr,
    ORDER: tl.constexpr,                     # index into SCALE_ORDERS
    IS_BF16: tl.constexpr,
    FP8: tl.constexpr,                       # key_dtype float8_e4m3fn (else int8)
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        row = slot % block_size
        row_ptr = cache_ptr + blk * stride_cb + row * stride_cr

        tiles = tl.arange(0, 4)  # N_TILES
        cols = tl.arange(0, 128)  # TILE
        d = tiles[:, None] * 128 + cols[None, :]
        x = to_f32(tl.load(nope_ptr + t.to(tl.int64) * stride_nt + d * stride_nd), IS_BF16)  # exact
        amax = tl.max(tl.abs(x), axis=1)  # [4], exact
        zero = amax == 0.0
        if FP8:
            type_max = 448.0
        else:
            type_max = 127.0
        s = tl.math.div_rn(amax, tl.full(amax.shape, type_max, tl.float32))
        if ORDER == 0:  # divide
            y = tl.math.div_rn(x, tl.broadcast_to(tl.where(zero, 1.0, s)[:, None], x.shape))
        else:
            if ORDER == 1:  # multiply: one correctly rounded quotient
                inv = tl.math.div_rn(tl.full(amax.shape, type_max, tl.float32), tl.where(zero, 1.0, amax))
            else:  # reciprocal, reciprocal_multiply: fp32(1 / amax), then times TYPE_MAX (two roundings)
                inv = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(zero, 1.0, amax)) * type_max
            y = x * tl.broadcast_to(inv[:, None], x.shape)
            if ORDER == 2:  # reciprocal: the stored scale is amax * fp32(1 / TYPE_MAX)
                s = amax * tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32),
                                          tl.full(amax.shape, type_max, tl.float32))
        y = tl.minimum(tl.maximum(y, -type_max), type_max)
        y = tl.where(zero[:, None], 0.0, y)
        if FP8:
            qb = _encode_e4m3fn(y)
        else:
            qb = rint_small(y).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
        tl.store(row_ptr + d * stride_cc, qb)

        if HAS_ROPE:
            rb = tl.arange(0, 128)
            rbytes = tl.load(rope_ptr + t.to(tl.int64) * stride_rt + rb)
            tl.store(row_ptr + (512 + rb) * stride_cc, rbytes)
            scale_off = 640
        else:
            scale_off = 512

        # 4 fp32 scales, little-endian bytes: byte k of scale j at scale_off + 4*j + k
        sbits = tl.where(zero, 0.0, s).to(tl.uint32, bitcast=True)  # [4]
        k = tl.arange(0, 4)
        sb = ((sbits[:, None] >> (8 * k[None, :]).to(tl.uint32)) & 0xFF).to(tl.uint8)  # [4 tiles, 4 bytes]
        tl.store(row_ptr + (scale_off + tiles[:, None] * 4 + k[None, :]) * stride_cc, sb)


def launch_c8_cache_write(k_nope, k_rope, slot_mapping, kv_cache, *, key_dtype: str = "int8",
                          scale_order: str = "divide"):
    """Quantise, pack and scatter ``k_nope`` / ``k_rope`` rows into ``kv_cache`` in place (one launch).

    Parameters (torch tensors on one device; validated by the operator contract beforehand):
      k_nope:       ``[T, 512]`` float16 / bfloat16 (any strides).
      k_rope:       ``[T, 64]`` of the same 16-bit dtype, or None (rope 0, 528-byte rows).
      slot_mapping: ``[T]`` int32 / int64; -1 = skip; otherwise unique and < block_num * block_size.
      kv_cache:     ``[block_num, block_size, 1, 656 | 528]`` uint8 / int8 / float8_e4m3fn (any strides);
                    written in place.
      key_dtype:    "int8" (``s = amax / 127``, RINT, clamp +-127) or "float8_e4m3fn" (``s = amax / 448``,
                    clamp +-448, E4M3FN RNE).
      scale_order:  one of :data:`SCALE_ORDERS` (module docstring; default ``"divide"``).
    Returns ``kv_cache``.
    """
    import torch

    if scale_order not in SCALE_ORDERS:
        raise ValueError(f"scale_order must be one of {SCALE_ORDERS}, got {scale_order!r}")
    if key_dtype not in KEY_DTYPES:
        raise ValueError(f"key_dtype must be one of {KEY_DTYPES}, got {key_dtype!r}")
    T = int(k_nope.shape[0])
    if T == 0:
        return kv_cache
    cache_u8 = kv_cache if kv_cache.dtype == torch.uint8 else kv_cache.view(torch.uint8)
    slots = slot_mapping.reshape(-1)
    if not slots.is_contiguous():
        slots = slots.contiguous()
    if k_rope is not None:
        r = k_rope if k_rope.stride(-1) == 1 else k_rope.contiguous()
        rope_u8 = r.view(torch.uint8)  # [T, 128] raw bytes, little-endian 16-bit values
        stride_rt = rope_u8.stride(0)
    else:
        rope_u8 = cache_u8  # unused
        stride_rt = 0
    block_size = int(kv_cache.shape[1])
    c8_cache_write_kernel[(T,)](
        k_nope, k_nope.stride(0), k_nope.stride(1),
        rope_u8, stride_rt,
        slots,
        cache_u8, cache_u8.stride(0), cache_u8.stride(1), cache_u8.stride(3),
        block_size,
        HAS_ROPE=k_rope is not None,
        ORDER=SCALE_ORDERS.index(scale_order),
        IS_BF16=k_nope.dtype == torch.bfloat16,
        FP8=key_dtype == "float8_e4m3fn",
        enable_fp_fusion=False,  # no fma contraction: every fp32 operation rounds as in the reference
    )
    return kv_cache
