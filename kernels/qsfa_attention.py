"""Triton kernel: QSFA (kv_quant_sparse_flash_attention) decode and prefill, docs/numerics/attention.md#kv_quant_sparse_flash_attention.

Work split: one program per (query row, block of BLOCK_H heads, block of BLOCK_DV output columns). All
Q_N heads share the single KV head, so one gathered K/V tile serves BLOCK_H heads (the decode speed-up).
Per program:

1. walk the row's selected token positions in chunks of BLOCK_N: position p -> index entry e = p // sbs,
   token ``sparse_indices[row, e] * sbs + p % sbs``; a token is valid when it lies in ``[0, limit)``
   (``limit = min(actKV, threshold)``); positions stop after ``n_read`` entries (the host computes
   ``n_read = min(sparse_size, ceil(threshold / sbs), first -1)``; 0 for rows that see nothing);
2. gather the packed rows (PA_BSND through block_table, or BSND / TND), dequantise the NoPE codes (int8,
   FP8 E4M3FN or HiFloat8, each decoded exactly by bit arithmetic) with their tile scale in fp32 and round to the query dtype; RoPE as stored;
3. scores = fp32(q . k) * scale_value with fp32 accumulation; invalid tokens get probability exactly 0
   (the effect of the reference's -2e38 score);
4. softmax in fp32 and probabilities rounded to the query dtype before P @ V (fp32 accumulation):
   one-pass online softmax (running max, rescaled accumulator), or two-pass (pass 1: row max and sum;
   pass 2: P = exp(s - final max), optionally / sum) which rounds P exactly where the reference does;
5. out = acc / sum (correctly rounded division) rounded to the query dtype; softmax_max = max,
   softmax_sum = sum; a row without a valid token writes out = 0, max = sum = 0.

Rounding to the query dtype at K, P and out follows the requested chip's modes (constexpr Q_ROUND, P_ROUND,
O_ROUND: RINT or ROUND = half away from zero; docs/numerics/chips.md), as qsfa.reference.attention; all are done
explicitly on bit patterns (kernels/_common.py), so the interpreter and a GPU agree. The interpreter's ``tl.dot`` is wrong for bf16 operands (raw uint16 bits),
so under ``TRITON_INTERPRET=1`` dot operands are widened exactly to fp32; on a GPU the dots take the
16-bit operands directly. ``tl.exp`` is numpy's float32 exp in the interpreter and an approximate
``ex2`` on GPUs (a last-bit difference in P that the docs/numerics/comparison.md#float-criterion tolerance absorbs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import ROUND_AWAY, ROUND_RINT, interpreting, round_to_dtype, to_f32

__all__ = ["qsfa_attention_kernel", "launch_qsfa_attention", "KernelConfig", "default_config"]

NOPE = 512
NOPE_C = tl.constexpr(NOPE)  # the same, readable inside @triton.jit functions


@triton.jit
def _decode_e4m3fn(c):
    """FP8 E4M3FN codes (uint8) -> fp32, exact (0x7F / 0xFF -> NaN)."""
    c32 = c.to(tl.uint32)
    e = (c32 >> 3) & 0xF
    m = c32 & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    val = tl.where((c32 & 0x7F) == 0x7F, float("nan"), val)
    return tl.where((c32 & 0x80) != 0, -val, val)


@triton.jit
def _decode_hif8(c):
    """HiFloat8 codes (uint8) -> fp32, exact (docs/numerics/formats.md#hifloat8): bits 6..0 start with the dot
    field (``11`` D = 4, ``10`` D = 3, ``01`` D = 2, ``001`` D = 1, ``0001`` D = 0, ``0000`` denormal), then D
    sign-magnitude exponent bits (implicit leading 1 on the magnitude), then M = 1, 2, 3, 3, 3 mantissa bits;
    denormal ``0000 mmm`` = 2^(mmm - 23). 0x00 = 0, 0x80 = NaN, 0x6F / 0xEF = +-Inf. Every value is a normal
    fp32 number (2^-22 .. 2^15), so the result is assembled from its fp32 fields."""
    c32 = c.to(tl.int32) & 0xFF
    a = c32 & 0x7F
    d4 = a >= 0x60
    d3 = a >= 0x40
    d2 = a >= 0x20
    d1 = a >= 0x10
    mbits = tl.where(d4, 1, tl.where(d3, 2, 3))
    mant = a & ((1 << mbits) - 1)
    # exponent magnitude: 8 + eee, 4 + ee, 2 + e, 1, 0; its sign bit is bit 4 (D >= 2) or bit 3 (D = 1)
    mag = tl.where(d4, 8 + ((a >> 1) & 7), tl.where(d3, 4 + ((a >> 2) & 3), tl.where(d2, 2 + ((a >> 3) & 1),
                                                                               tl.where(d1, 1, 0))))
    neg_e = tl.where(d2, (a >> 4) & 1, tl.where(d1, (a >> 3) & 1, 0))
    e = tl.where(neg_e != 0, -mag, mag)
    normal = ((e + 127) << 23) | (mant << (23 - mbits))
    bits = tl.where(a >= 0x08, normal, tl.where(a == 0, 0, (a + 104) << 23))
    val = bits.to(tl.float32, bitcast=True)
    val = tl.where(a == 0x6F, float("inf"), val)
    val = tl.where(c32 == 0x80, float("nan"), val)
    return tl.where((c32 & 0x80) != 0, -val, val)


@triton.jit
def _hif8_table_kernel(o_ptr):
    c = tl.arange(0, 256)
    tl.store(o_ptr + c, _decode_hif8(c.to(tl.uint8)))


_HIF8_TABLES: dict = {}


def hif8_table(device):
    """The 256 HiFloat8 values as fp32 on ``device`` (decoded once per device by :func:`_decode_hif8`)."""
    import torch

    key = str(device)
    if key not in _HIF8_TABLES:
        tab = torch.empty(256, dtype=torch.float32, device=device)
        _hif8_table_kernel[(1,)](tab)
        _HIF8_TABLES[key] = tab
    return _HIF8_TABLES[key]


#: NoPE code formats of the KEY_FMT constexpr
KEY_INT8, KEY_E4M3FN, KEY_HIF8 = 0, 1, 2
KEY_FORMATS = {"int8": KEY_INT8, "float8_e4m3fn": KEY_E4M3FN, "hifloat8": KEY_HIF8}


@triton.jit
def _dequant(q8, sc, tab_ptr, IS_BF16: tl.constexpr, Q_ROUND: tl.constexpr, KEY_FMT: tl.constexpr):
    """``decode(code) * scale`` (one fp32 multiply; every code decodes exactly) rounded to the query dtype.
    HiFloat8 codes are looked up in ``tab_ptr`` (256 fp32 values written by :func:`_decode_hif8`; a gather from
    a 1 KiB table costs fewer registers than decoding in place, which spills at the default tiling)."""
    if KEY_FMT == 1:
        val = _decode_e4m3fn(q8.to(tl.uint8, bitcast=True))
    elif KEY_FMT == 2:
        val = tl.load(tab_ptr + q8.to(tl.uint8, bitcast=True).to(tl.int32))
    else:
        val = q8.to(tl.float32)
    return round_to_dtype(val * sc, IS_BF16, Q_ROUND)


@triton.jit
def _nope_tile(kv_i8_ptr, kv_f32_ptr, tab_ptr, row_off, valid, J: tl.constexpr, SCALE_IDX: tl.constexpr,
               IS_BF16: tl.constexpr, Q_ROUND: tl.constexpr, KEY_FMT: tl.constexpr):
    """NoPE tile J (columns [128 J, 128 J + 128)) of the rows at byte offsets ``row_off``, dequantised:
    [BLOCK_N, 128] in the query dtype (one scale load per row)."""
    cols = tl.arange(0, 128)
    q8 = tl.load(kv_i8_ptr + row_off[:, None] + (J * 128 + cols)[None, :], mask=valid[:, None], other=0)
    sc = tl.load(kv_f32_ptr + row_off // 4 + (SCALE_IDX + J), mask=valid, other=0.0)
    return _dequant(q8, sc[:, None], tab_ptr, IS_BF16, Q_ROUND, KEY_FMT)


@triton.jit
def _dot_t(a, b, IS_BF16: tl.constexpr, DOT_F32: tl.constexpr):
    """a @ b^T with fp32 accumulation (operands widened to fp32 under the interpreter)."""
    if DOT_F32:
        return tl.dot(to_f32(a, IS_BF16), tl.trans(to_f32(b, IS_BF16)))
    else:
        return tl.dot(a, tl.trans(b))


@triton.jit
def _chunk_scores(p0, n_pos, limit, kv_b, kv_off, row, q0, q1, q2, q3, q_rope,
                  kv_i8_ptr, kv_16_ptr, kv_f32_ptr, tab_ptr, stride_kb, stride_kt, bt_ptr, stride_bt,
                  idx_ptr, stride_ir, scale_value, block_size,
                  SBS: tl.constexpr, SCALE_IDX: tl.constexpr, IS_PA: tl.constexpr, HAS_ROPE: tl.constexpr,
                  IS_BF16: tl.constexpr, Q_ROUND: tl.constexpr, KEY_FMT: tl.constexpr, DOT_F32: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Scores [BLOCK_H, BLOCK_N] (invalid tokens -inf) of the selected positions [p0, p0 + BLOCK_N), plus
    the gathered rows' byte offsets and their validity. The NoPE is streamed in four 128-column tiles
    (q0..q3 are the matching query tiles) so only one dequantised tile is live at a time."""
    pos = p0 + tl.arange(0, BLOCK_N)
    in_range = pos < n_pos
    entry = pos // SBS
    idx = tl.load(idx_ptr + row * stride_ir + entry, mask=in_range, other=-1).to(tl.int64)
    tok = idx * SBS + (pos % SBS)
    valid = in_range & (idx >= 0) & (tok < limit)
    tok = tl.where(valid, tok, 0)
    if IS_PA:
        blk = tl.load(bt_ptr + kv_b * stride_bt + tok // block_size, mask=valid, other=0).to(tl.int64)
        row_off = blk * stride_kb + (tok % block_size) * stride_kt
    else:
        row_off = kv_b * stride_kb + (kv_off + tok) * stride_kt
    row_off = tl.multiple_of(row_off, 16)  # the launcher guarantees 16-byte aligned rows (vector loads)

    s = _dot_t(q0, _nope_tile(kv_i8_ptr, kv_f32_ptr, tab_ptr, row_off, valid, 0, SCALE_IDX, IS_BF16, Q_ROUND, KEY_FMT),
               IS_BF16, DOT_F32)
    s += _dot_t(q1, _nope_tile(kv_i8_ptr, kv_f32_ptr, tab_ptr, row_off, valid, 1, SCALE_IDX, IS_BF16, Q_ROUND, KEY_FMT),
                IS_BF16, DOT_F32)
    s += _dot_t(q2, _nope_tile(kv_i8_ptr, kv_f32_ptr, tab_ptr, row_off, valid, 2, SCALE_IDX, IS_BF16, Q_ROUND, KEY_FMT),
                IS_BF16, DOT_F32)
    s += _dot_t(q3, _nope_tile(kv_i8_ptr, kv_f32_ptr, tab_ptr, row_off, valid, 3, SCALE_IDX, IS_BF16, Q_ROUND, KEY_FMT),
                IS_BF16, DOT_F32)
    if HAS_ROPE:
        rcols = tl.arange(0, 64)
        k_rope = tl.load(kv_16_ptr + (row_off // 2)[:, None] + 256 + rcols[None, :],
                         mask=valid[:, None], other=0.0)
        s += _dot_t(q_rope, k_rope, IS_BF16, DOT_F32)
    s = s * scale_value
    s = tl.where(valid[None, :], s, float("-inf"))
    return s, row_off, valid


@triton.jit
def _v_sub(kv_i8_ptr, kv_f32_ptr, tab_ptr, row_off, valid, c0, SCALE_IDX: tl.constexpr, IS_BF16: tl.constexpr,
           Q_ROUND: tl.constexpr, KEY_FMT: tl.constexpr, W: tl.constexpr):
    """V columns [c0, c0 + W) (inside one 128-column scale tile) dequantised: [BLOCK_N, W]."""
    cols = tl.arange(0, W)
    q8 = tl.load(kv_i8_ptr + row_off[:, None] + (c0 + cols)[None, :], mask=valid[:, None], other=0)
    sc = tl.load(kv_f32_ptr + row_off // 4 + SCALE_IDX + c0 // 128, mask=valid, other=0.0)
    return _dequant(q8, sc[:, None], tab_ptr, IS_BF16, Q_ROUND, KEY_FMT)


@triton.jit
def _pv(acc, p16, row_off, valid, c0, kv_i8_ptr, kv_f32_ptr, tab_ptr, SCALE_IDX: tl.constexpr, IS_BF16: tl.constexpr,
        Q_ROUND: tl.constexpr, KEY_FMT: tl.constexpr, DOT_F32: tl.constexpr, W: tl.constexpr):
    """acc + P @ V[:, c0:c0 + W] with fp32 accumulation (V re-gathered and dequantised, one sub-tile)."""
    v = _v_sub(kv_i8_ptr, kv_f32_ptr, tab_ptr, row_off, valid, c0, SCALE_IDX, IS_BF16, Q_ROUND, KEY_FMT, W)
    if DOT_F32:
        return acc + tl.dot(to_f32(p16, IS_BF16), to_f32(v, IS_BF16))
    else:
        return acc + tl.dot(p16, v)


@triton.jit
def _store_out(out_ptr, row, stride_or, stride_oh, heads, hmask, c0, acc, has, l_out, IS_BF16: tl.constexpr,
               Q_ROUND: tl.constexpr, W: tl.constexpr):
    """out[row, heads, c0:c0 + W] = round(acc / l) (0 for rows without a selected token)."""
    o = tl.math.div_rn(acc, tl.broadcast_to(tl.where(has, l_out, 1.0)[:, None], acc.shape))
    o16 = round_to_dtype(tl.where(has[:, None], o, 0.0), IS_BF16, Q_ROUND)
    cols = c0 + tl.arange(0, W)
    tl.store(out_ptr + row * stride_or + heads.to(tl.int64)[:, None] * stride_oh + cols[None, :], o16,
             mask=hmask[:, None])


@triton.jit
def _store_acc(ws_acc_ptr, ws_row, Q_N, heads, hmask, c0, acc, W: tl.constexpr):
    """ws_acc[ws_row, heads, c0:c0 + W] = acc (fp32, unnormalised P @ V of one split)."""
    cols = c0 + tl.arange(0, W)
    tl.store(ws_acc_ptr + (ws_row * Q_N + heads.to(tl.int64))[:, None] * NOPE_C + cols[None, :], acc,
             mask=hmask[:, None])


@triton.jit
def split_stats(ws_ml_ptr, row, heads, hmask, Q_N, NS: tl.constexpr):
    """The row's softmax max and sum [BLOCK_H] from its NS splits' (max, sum): m = max_s m_s (-inf when no split
    saw a token), l = sum_s l_s * exp(m_s - m), summed in split order (an empty split has m_s = -inf, l_s = 0)."""
    m = tl.load(ws_ml_ptr + (row * NS * 2) * Q_N + heads, mask=hmask, other=float("-inf"))
    for sp in range(1, NS):
        m = tl.maximum(m, tl.load(ws_ml_ptr + ((row * NS + sp) * 2) * Q_N + heads, mask=hmask, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros_like(m)
    for sp in range(0, NS):
        ms = tl.load(ws_ml_ptr + ((row * NS + sp) * 2) * Q_N + heads, mask=hmask, other=float("-inf"))
        ls = tl.load(ws_ml_ptr + ((row * NS + sp) * 2 + 1) * Q_N + heads, mask=hmask, other=0.0)
        l += ls * tl.exp(ms - m_safe)
    return m, l


@triton.jit
def qsfa_attention_kernel(
    q_ptr, stride_qr, stride_qh,               # query rows [R, Q_N, Q_D] (element strides, last dim dense)
    kv_i8_ptr, kv_16_ptr, kv_f32_ptr,          # the key buffer viewed as int8 / 16-bit / fp32
    tab_ptr,                                   # fp32 [256] HiFloat8 decode table (KEY_FMT 2; else unread)
    stride_kb, stride_kt,                      # byte strides: batch-or-block, token-row
    bt_ptr, stride_bt,                         # block_table [B, max_blocks] (PA only)
    idx_ptr, stride_ir,                        # sparse_indices rows [R, sparse_size] int32
    meta_ptr,                                  # int64 [R, 4]: kv_b, kv_off, limit, n_pos
    out_ptr, stride_or, stride_oh,             # out [R, Q_N, 512]
    max_ptr, sum_ptr,                          # fp32 [R, Q_N] (only when WRITE_LSE)
    scale_value,
    Q_N, block_size,
    SBS: tl.constexpr,
    SCALE_IDX: tl.constexpr,                   # fp32 index of the first scale in a row: 160 (rope 64), 128
    IS_PA: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    IS_BF16: tl.constexpr,
    Q_ROUND: tl.constexpr,                     # rounding of the dequantised K (and V): ROUND_AWAY / ROUND_RINT
    P_ROUND: tl.constexpr,                     # rounding of P before P @ V
    O_ROUND: tl.constexpr,                     # rounding of the output
    KEY_FMT: tl.constexpr,                     # NoPE codes: 0 int8, 1 FP8 E4M3FN, 2 HiFloat8
    TWO_PASS: tl.constexpr,                    # pass 1: row max and sum; pass 2: P against the final max
    P_NORMALISED: tl.constexpr,                # (two-pass only) round p / sum instead of p
    WRITE_LSE: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    ws_ml_ptr=None, ws_acc_ptr=None,           # split-KV workspace: fp32 [R, NS, 2, Q_N] (max, sum), [R, NS, Q_N, 512]
    SPLIT: tl.constexpr = 0,                   # 0 unsplit; 1 stats / 2 P @ V (two-pass); 3 one-pass (module doc)
    NS: tl.constexpr = 1,                      # splits per row
    CHUNK: tl.constexpr = 0,                   # selected positions per split (a multiple of BLOCK_N)
):
    if SPLIT == 0:
        row = tl.program_id(0).to(tl.int64)
    else:
        row = (tl.program_id(0) // NS).to(tl.int64)
        split = tl.program_id(0) % NS
    pid_h = tl.program_id(1)
    pid_v = tl.program_id(2)

    kv_b = tl.load(meta_ptr + row * 4 + 0)
    kv_off = tl.load(meta_ptr + row * 4 + 1)
    limit = tl.load(meta_ptr + row * 4 + 2)
    n_pos = tl.load(meta_ptr + row * 4 + 3).to(tl.int32)
    p_lo = 0
    if SPLIT != 0:  # this program's share of the row's positions: [p_lo, n_pos) after the clamp
        p_lo = split * CHUNK
        n_pos = tl.minimum(n_pos, p_lo + CHUNK)

    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < Q_N
    c128 = tl.arange(0, 128)
    q_row = q_ptr + row * stride_qr + heads.to(tl.int64)[:, None] * stride_qh
    q0 = tl.load(q_row + c128[None, :], mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + 128 + c128[None, :], mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_row + 256 + c128[None, :], mask=hmask[:, None], other=0.0)
    q3 = tl.load(q_row + 384 + c128[None, :], mask=hmask[:, None], other=0.0)
    q_rope = q0  # placeholder when there is no RoPE (never read)
    if HAS_ROPE:
        rcols = tl.arange(0, 64)
        q_rope = tl.load(q_row + 512 + rcols[None, :], mask=hmask[:, None], other=0.0)
    # the program's BLOCK_DV output columns as four sub-tiles of W columns (each inside one scale tile), so
    # only one dequantised V sub-tile is live at a time
    W: tl.constexpr = BLOCK_DV // 4
    dv0 = pid_v * BLOCK_DV

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, W], tl.float32)
    acc1 = tl.zeros([BLOCK_H, W], tl.float32)
    acc2 = tl.zeros([BLOCK_H, W], tl.float32)
    acc3 = tl.zeros([BLOCK_H, W], tl.float32)

    if TWO_PASS:
        if SPLIT == 2:  # the row's max and sum (split_stats over its splits' pass 1; here ws_ml is [R, 2, Q_N])
            m_i = tl.load(ws_ml_ptr + row * 2 * Q_N + heads, mask=hmask, other=float("-inf"))
            l_i = tl.load(ws_ml_ptr + (row * 2 + 1) * Q_N + heads, mask=hmask, other=0.0)
        else:
            for p0 in range(p_lo, n_pos, BLOCK_N):
                s, row_off, valid = _chunk_scores(
                    p0, n_pos, limit, kv_b, kv_off, row, q0, q1, q2, q3, q_rope, kv_i8_ptr, kv_16_ptr, kv_f32_ptr, tab_ptr,
                    stride_kb, stride_kt, bt_ptr, stride_bt, idx_ptr, stride_ir, scale_value, block_size,
                    SBS, SCALE_IDX, IS_PA, HAS_ROPE, IS_BF16, Q_ROUND, KEY_FMT, DOT_F32, BLOCK_N)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
                m_i = m_new
        if SPLIT != 1:  # (phase 1 of a two-pass split stops after pass 1)
            m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
            l_div = tl.where(l_i > 0.0, l_i, 1.0)
            for p0 in range(p_lo, n_pos, BLOCK_N):
                s, row_off, valid = _chunk_scores(
                    p0, n_pos, limit, kv_b, kv_off, row, q0, q1, q2, q3, q_rope, kv_i8_ptr, kv_16_ptr, kv_f32_ptr, tab_ptr,
                    stride_kb, stride_kt, bt_ptr, stride_bt, idx_ptr, stride_ir, scale_value, block_size,
                    SBS, SCALE_IDX, IS_PA, HAS_ROPE, IS_BF16, Q_ROUND, KEY_FMT, DOT_F32, BLOCK_N)
                p = tl.exp(s - m_fin[:, None])
                if P_NORMALISED:
                    p = tl.math.div_rn(p, tl.broadcast_to(l_div[:, None], p.shape))
                p16 = round_to_dtype(p, IS_BF16, P_ROUND)
                acc0 = _pv(acc0, p16, row_off, valid, dv0, kv_i8_ptr, kv_f32_ptr, tab_ptr, SCALE_IDX, IS_BF16, Q_ROUND,
                           KEY_FMT, DOT_F32, W)
                acc1 = _pv(acc1, p16, row_off, valid, dv0 + W, kv_i8_ptr, kv_f32_ptr, tab_ptr, SCALE_IDX, IS_BF16, Q_ROUND,
                           KEY_FMT, DOT_F32, W)
                acc2 = _pv(acc2, p16, row_off, valid, dv0 + 2 * W, kv_i8_ptr, kv_f32_ptr, tab_ptr, SCALE_IDX, IS_BF16,
                           Q_ROUND, KEY_FMT, DOT_F32, W)
                acc3 = _pv(acc3, p16, row_off, valid, dv0 + 3 * W, kv_i8_ptr, kv_f32_ptr, tab_ptr, SCALE_IDX, IS_BF16,
                           Q_ROUND, KEY_FMT, DOT_F32, W)
            if P_NORMALISED:
                l_out = tl.where(l_i > 0.0, 1.0, 0.0)
            else:
                l_out = l_i
    else:
        for p0 in range(p_lo, n_pos, BLOCK_N):
            s, row_off, valid = _chunk_scores(
                p0, n_pos, limit, kv_b, kv_off, row, q0, q1, q2, q3, q_rope, kv_i8_ptr, kv_16_ptr, kv_f32_ptr, tab_ptr,
                stride_kb, stride_kt, bt_ptr, stride_bt, idx_ptr, stride_ir, scale_value, block_size,
                SBS, SCALE_IDX, IS_PA, HAS_ROPE, IS_BF16, Q_ROUND, KEY_FMT, DOT_F32, BLOCK_N)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            p16 = round_to_dtype(p, IS_BF16, P_ROUND)
            acc0 = _pv(acc0 * alpha[:, None], p16, row_off, valid, dv0, kv_i8_ptr, kv_f32_ptr, tab_ptr, SCALE_IDX,
                       IS_BF16, Q_ROUND, KEY_FMT, DOT_F32, W)
            acc1 = _pv(acc1 * alpha[:, None], p16, row_off, valid, dv0 + W, kv_i8_ptr, kv_f32_ptr, tab_ptr, SCALE_IDX,
                       IS_BF16, Q_ROUND, KEY_FMT, DOT_F32, W)
            acc2 = _pv(acc2 * alpha[:, None], p16, row_off, valid, dv0 + 2 * W, kv_i8_ptr, kv_f32_ptr,
                       tab_ptr, SCALE_IDX, IS_BF16, Q_ROUND, KEY_FMT, DOT_F32, W)
            acc3 = _pv(acc3 * alpha[:, None], p16, row_off, valid, dv0 + 3 * W, kv_i8_ptr, kv_f32_ptr,
                       tab_ptr, SCALE_IDX, IS_BF16, Q_ROUND, KEY_FMT, DOT_F32, W)
        l_out = l_i

    if SPLIT == 0:
        has = l_out > 0.0
        _store_out(out_ptr, row, stride_or, stride_oh, heads, hmask, dv0, acc0, has, l_out, IS_BF16, O_ROUND, W)
        _store_out(out_ptr, row, stride_or, stride_oh, heads, hmask, dv0 + W, acc1, has, l_out, IS_BF16, O_ROUND, W)
        _store_out(out_ptr, row, stride_or, stride_oh, heads, hmask, dv0 + 2 * W, acc2, has, l_out, IS_BF16,
                   O_ROUND, W)
        _store_out(out_ptr, row, stride_or, stride_oh, heads, hmask, dv0 + 3 * W, acc3, has, l_out, IS_BF16,
                   O_ROUND, W)
        if WRITE_LSE:
            if pid_v == 0:
                tl.store(max_ptr + row * Q_N + heads, tl.where(l_i > 0.0, m_i, 0.0), mask=hmask)
                tl.store(sum_ptr + row * Q_N + heads, l_i, mask=hmask)
    else:  # split-KV: this split's partial results into the workspace (combined by kernels/qsfa_split.py)
        ws_row = (row * NS + split).to(tl.int64)
        if SPLIT != 1:
            _store_acc(ws_acc_ptr, ws_row, Q_N, heads, hmask, dv0, acc0, W)
            _store_acc(ws_acc_ptr, ws_row, Q_N, heads, hmask, dv0 + W, acc1, W)
            _store_acc(ws_acc_ptr, ws_row, Q_N, heads, hmask, dv0 + 2 * W, acc2, W)
            _store_acc(ws_acc_ptr, ws_row, Q_N, heads, hmask, dv0 + 3 * W, acc3, W)
        if SPLIT != 2:
            if pid_v == 0:
                tl.store(ws_ml_ptr + ws_row * 2 * Q_N + heads, m_i, mask=hmask)
                tl.store(ws_ml_ptr + (ws_row * 2 + 1) * Q_N + heads, l_i, mask=hmask)


class KernelConfig:
    """Launch parameters of the attention kernel (tiling; no effect on results beyond fp32 summation order).

    block_h:  heads per program (>= 16 for tl.dot on GPUs; heads beyond Q_N are masked).
    block_n:  selected tokens per step (>= 16).
    block_dv: output columns per program (512, 256 or 128); smaller values cut registers but recompute
              the scores once per column block.
    two_pass: False = one-pass online softmax: P is rounded relative to the running max and rescaled
              (fastest; its rounding differs from a whole-row softmax by ~1 ulp of P per element).
              True = pass 1 finds the row max and sum, pass 2 rounds P against the final max - the
              reference's rounding points exactly, at the cost of computing Q.K twice.
    split_block_dv: block_dv of the split-KV path's programs (kernels/qsfa_split.py): 128 by default (the
              split programs already fill the device; 256 columns there spill on sm_90, the chunk bookkeeping
              costing the last registers the unsplit kernel had spare).
    """

    def __init__(self, block_h: int = 64, block_n: int = 32, block_dv: int = 512, num_warps: int = 8,
                 num_stages: int = 1, two_pass: bool = False, split_block_dv: int = 128):
        for name, v in (("block_dv", block_dv), ("split_block_dv", split_block_dv)):
            if v not in (128, 256, 512):
                raise ValueError(f"{name} must be 128, 256 or 512, got {v}")
        self.split_block_dv = split_block_dv
        for name, v in (("block_h", block_h), ("block_n", block_n)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        self.block_h, self.block_n, self.block_dv = block_h, block_n, block_dv
        self.num_warps, self.num_stages = num_warps, num_stages
        self.two_pass = bool(two_pass)

    def __repr__(self):
        return (f"KernelConfig(block_h={self.block_h}, block_n={self.block_n}, block_dv={self.block_dv}, "
                f"num_warps={self.num_warps}, num_stages={self.num_stages}, two_pass={self.two_pass}, "
                f"split_block_dv={self.split_block_dv})")


def default_config(q_n: int) -> KernelConfig:
    """Tiling used when none is given: small tiles under the interpreter, 64-head tiles on a GPU."""
    if interpreting():
        return KernelConfig(block_h=16, block_n=16, block_dv=512, num_warps=1, num_stages=1, two_pass=True,
                            split_block_dv=512)
    # sm_90 compile (AOT, no GPU): 64 heads x 256 columns, 8 warps, 2 stages uses 254 registers and no
    # spills; 64 x 512 spills (see benchmarks/triton_qsfa.py for the tilings to time on a device)
    return KernelConfig(block_h=64 if q_n >= 64 else 16 if q_n <= 16 else 32, block_n=32, block_dv=256,
                        num_warps=8, num_stages=2)


def _row_metadata(query, sparse_indices, *, layout_query, layout_kv, sparse_mode, sparse_block_size,
                  act_q, act_kv, fault=None):
    """Per query row (BSND b*Q_S+s, or TND token t): kv_b, kv_off, limit, n_pos, as int64 [R, 4]."""
    import torch

    dev = query.device
    if layout_query == "TND":
        R = int(query.shape[0])
        cu_q = act_q.to(torch.int64)
        B = int(cu_q.shape[0])
        t = torch.arange(R, device=dev, dtype=torch.int64)
        b = torch.searchsorted(cu_q, t, right=True).clamp_(max=max(B - 1, 0))
        start_q = torch.cat([cu_q.new_zeros(1), cu_q[:-1]])
        len_q = cu_q - start_q
        i = t - start_q[b]
        row_ok = t < cu_q[-1] if B else torch.zeros_like(t, dtype=torch.bool)
    else:
        B, Q_S = int(query.shape[0]), int(query.shape[1])
        R = B * Q_S
        r = torch.arange(R, device=dev, dtype=torch.int64)
        b, i = r // Q_S, r % Q_S
        len_q = act_q.to(torch.int64)
        row_ok = i < len_q[b]

    kvl = act_kv.to(torch.int64)
    if layout_kv == "TND":
        start_kv = torch.cat([kvl.new_zeros(1), kvl[:-1]])
        len_kv = kvl - start_kv
        kv_off = start_kv[b]
        kv_b = torch.zeros_like(b)
    else:
        len_kv = kvl
        kv_off = torch.zeros_like(b)
        kv_b = b

    akv = len_kv[b]
    if sparse_mode == 3:
        thr = akv - len_q[b] + i + 1
    else:
        thr = akv.clone()
    if fault == "threshold_off_by_one":  # deliberately broken variant (tests prove the checks catch it)
        thr = thr + 1
    thr = torch.where(row_ok, thr, torch.zeros_like(thr))
    limit = torch.minimum(akv, thr).clamp_(min=0)
    sbs = int(sparse_block_size)
    K = int(sparse_indices.shape[-1])
    n_lim = torch.clamp((thr + sbs - 1) // sbs, min=0, max=K)
    idx = sparse_indices.reshape(R, K)
    is_stop = idx == -1
    if fault == "ignore_stop":  # deliberately broken variant: -1 entries skipped instead of ending the row
        is_stop = torch.zeros_like(is_stop)
    first_stop = torch.where(is_stop.any(dim=1), is_stop.to(torch.int32).argmax(dim=1).to(torch.int64),
                             torch.full_like(n_lim, K))
    n_read = torch.minimum(n_lim, first_stop)
    meta = torch.stack([kv_b, kv_off, limit, n_read * sbs], dim=1).contiguous()
    return meta, idx


def launch_qsfa_attention(query, key, sparse_indices, scale_value, *, block_table=None,
                          actual_seq_lengths_query=None, actual_seq_lengths_kv=None, sparse_block_size=1,
                          layout_query="BSND", layout_kv="BSND", sparse_mode=3, rope_head_dim=64,
                          return_softmax_lse=False, key_dtype="int8", probability_rounding="unnormalised",
                          k_rounding=None, p_rounding=None, out_rounding=None, config: KernelConfig | None = None,
                          split_kv=None, _fault: str | None = None):
    """Run the QSFA kernel on validated arguments (torch tensors on one device).

    query:  BSND ``[B, Q_S, Q_N, 512 + rope]`` or TND ``[Q_T, Q_N, 512 + rope]``, float16 / bfloat16.
    key:    packed rows, BSND ``[B, KV_S, 1, W]``, TND ``[KV_T, 1, W]`` or PA_BSND
            ``[block_num, block_size, 1, W]``, W = 656 (rope 64) or 528 (rope 0); any one-byte dtype.
    sparse_indices: ``[B, Q_S, 1, K]`` / ``[Q_T, 1, K]`` int32 (entries >= -1; -1 ends a row).
    block_table: int32 ``[B, max_blocks]`` (PA_BSND).
    actual_seq_lengths_query / _kv: int ``[B]`` (TND: prefix sums); None = full lengths (BSND).
    key_dtype: NoPE code format, "int8", "float8_e4m3fn" or "hifloat8" (HiFloat8: rope 64 only, the contract's rule).
    probability_rounding: "unnormalised" (round ``exp(s - max)``; P @ V divided by the sum at the end) or
            "normalised" (round ``p / sum``; always runs two-pass) - the reference's OPEN parameter.
    k_rounding, p_rounding, out_rounding: "rint" or "round" (half away from zero) at the three rounding points
            (dequantised K, P, out); None = the A2/A3 kernels' mode (K and out: bf16 RINT, fp16 ROUND; P: ROUND).
            The triton backend passes the requested chip's modes (qsfa.chips).
    config: tiling (:class:`KernelConfig`); None = :func:`default_config`.
    split_kv: the split-KV (flash-decoding) path for long selections (kernels/qsfa_split.py): None = the
            ``QSFA_TRITON_SPLIT_KV`` environment variable, else "auto" (split long rows when the unsplit grid
            would leave a CUDA device idle); "auto", "on" / True, "off" / False, or an int = positions per
            split (forces it; tests). Same rounding points as unsplit; only fp32 summation order changes.
    _fault: tests only - ``"threshold_off_by_one"`` or ``"ignore_stop"`` run a deliberately broken variant.
    Returns ``(attention_out, softmax_max, softmax_sum)``; the LSE tensors are fp32 ``[B, 1, Q_S, Q_N]`` /
    ``[1, Q_T, Q_N]``, or empty ``[0]`` unless ``return_softmax_lse``.
    """
    import torch

    cfg = config or default_config(int(query.shape[-2]))
    dev = query.device
    is_bf16 = query.dtype == torch.bfloat16
    modes = {"rint": ROUND_RINT, "round": ROUND_AWAY}
    dflt = "rint" if is_bf16 else "round"
    k_rounding, out_rounding, p_rounding = k_rounding or dflt, out_rounding or dflt, p_rounding or "round"
    for name, m in (("k_rounding", k_rounding), ("p_rounding", p_rounding), ("out_rounding", out_rounding)):
        if m not in modes:
            raise ValueError(f"{name} must be 'rint' or 'round', got {m!r}")
    if probability_rounding not in ("unnormalised", "normalised"):
        raise ValueError(f"probability_rounding must be 'unnormalised' or 'normalised', got {probability_rounding!r}")
    if key_dtype not in KEY_FORMATS:
        raise ValueError(f"key_dtype must be 'int8', 'float8_e4m3fn' or 'hifloat8', got {key_dtype!r}")
    normalised = probability_rounding == "normalised"

    q_n = int(query.shape[-2])
    q_rows = query.reshape(-1, q_n, query.shape[-1])
    if q_rows.stride(-1) != 1:
        q_rows = q_rows.contiguous()
    R = int(q_rows.shape[0])
    kv_s = int(key.shape[1]) if layout_kv in ("BSND", "PA_BSND") else int(key.shape[0])

    if actual_seq_lengths_query is None:
        act_q = torch.full((int(query.shape[0]),), int(query.shape[1]), dtype=torch.int64, device=dev)
    else:
        act_q = torch.as_tensor(actual_seq_lengths_query, device=dev).reshape(-1)
    if actual_seq_lengths_kv is None:
        act_kv = torch.full((int(act_q.shape[0]),), kv_s, dtype=torch.int64, device=dev)
    else:
        act_kv = torch.as_tensor(actual_seq_lengths_kv, device=dev).reshape(-1)

    meta, idx = _row_metadata(query, sparse_indices, layout_query=layout_query, layout_kv=layout_kv,
                              sparse_mode=sparse_mode, sparse_block_size=sparse_block_size,
                              act_q=act_q, act_kv=act_kv, fault=_fault)
    idx = idx.to(torch.int32)
    if idx.stride(-1) != 1:
        idx = idx.contiguous()

    # key views sharing one base address: int8 (NoPE codes), 16-bit in the query dtype (RoPE), fp32
    # (scales); the kernel indexes them with byte offsets, // 2 and // 4.
    k8 = key if key.dtype == torch.int8 else key.view(torch.int8)
    if layout_kv == "TND":
        k8 = k8.reshape(k8.shape[0], k8.shape[-1])
    # rows must start on 16-byte boundaries (the kernel's vector loads rely on it; 656 and 528 are multiples
    # of 16, so a fresh contiguous copy always qualifies)
    strides_ok = k8.stride(-1) == 1 and all(st % 16 == 0 for st in k8.stride()[:-1]) and k8.data_ptr() % 16 == 0
    if not strides_ok:
        k8 = k8.contiguous()
    if layout_kv == "TND":
        stride_kb, stride_kt = 0, k8.stride(0)
    else:
        stride_kb, stride_kt = k8.stride(0), k8.stride(1)
    k16 = k8.view(query.dtype)
    k32 = k8.view(torch.float32)

    if layout_kv == "PA_BSND":
        bt = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
        if bt.stride(-1) != 1:
            bt = bt.contiguous()
        stride_bt, bsz = bt.stride(0), int(key.shape[1])
    else:
        bt, stride_bt, bsz = idx, 0, 1

    out = torch.empty((R, q_n, NOPE), dtype=query.dtype, device=dev)
    if return_softmax_lse:
        smax = torch.empty((R, q_n), dtype=torch.float32, device=dev)
        ssum = torch.empty((R, q_n), dtype=torch.float32, device=dev)
    else:
        smax = ssum = torch.empty((1,), dtype=torch.float32, device=dev)

    n_hb, n_vb = triton.cdiv(q_n, cfg.block_h), NOPE // cfg.block_dv
    two_pass = cfg.two_pass or normalised
    args = (q_rows, q_rows.stride(0), q_rows.stride(1),
            k8, k16, k32, hif8_table(dev) if key_dtype == "hifloat8" else k32, stride_kb, stride_kt,
            bt, stride_bt,
            idx, idx.stride(0),
            meta,
            out, out.stride(0), out.stride(1),
            smax, ssum,
            float(scale_value),
            q_n, bsz)
    consts = dict(
        SBS=int(sparse_block_size),
        SCALE_IDX=160 if int(rope_head_dim) == 64 else 128,
        IS_PA=layout_kv == "PA_BSND",
        HAS_ROPE=int(rope_head_dim) == 64,
        IS_BF16=is_bf16,
        Q_ROUND=modes[k_rounding],
        P_ROUND=modes[p_rounding],
        O_ROUND=modes[out_rounding],
        KEY_FMT=KEY_FORMATS[key_dtype],
        TWO_PASS=two_pass,
        P_NORMALISED=normalised,
        WRITE_LSE=bool(return_softmax_lse),
        DOT_F32=interpreting(),
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        BLOCK_DV=cfg.block_dv,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        enable_fp_fusion=False,  # keep every fp32 rounding point (no mul+add -> fma contraction)
    )
    from .qsfa_split import split_combine_kernel, split_plan, split_row_stats_kernel

    chunk = split_plan(split_kv, int(idx.shape[-1]) * int(sparse_block_size), R * n_hb * n_vb, cfg.block_n,
                       dev) if R > 0 else 0
    if R > 0 and chunk == 0:
        qsfa_attention_kernel[(R, n_hb, n_vb)](*args, **consts)
    elif R > 0:  # split-KV (kernels/qsfa_split.py): partials per chunk of positions, then one combine pass
        ns = triton.cdiv(int(idx.shape[-1]) * int(sparse_block_size), chunk)
        ws_ml = torch.empty((R, ns, 2, q_n), dtype=torch.float32, device=dev)
        ws_acc = torch.empty((R, ns, q_n, NOPE), dtype=torch.float32, device=dev)
        split = dict(consts, NS=ns, CHUNK=chunk, BLOCK_DV=cfg.split_block_dv)
        n_vb = NOPE // cfg.split_block_dv
        if two_pass:
            qsfa_attention_kernel[(R * ns, n_hb, 1)](*args, ws_ml_ptr=ws_ml, ws_acc_ptr=ws_acc, SPLIT=1, **split)
            row_ml = torch.empty((R, 2, q_n), dtype=torch.float32, device=dev)
            split_row_stats_kernel[(R, n_hb)](ws_ml, row_ml, q_n, NS=ns, BLOCK_H=cfg.block_h, num_warps=1)
            qsfa_attention_kernel[(R * ns, n_hb, n_vb)](*args, ws_ml_ptr=row_ml, ws_acc_ptr=ws_acc, SPLIT=2, **split)
        else:
            qsfa_attention_kernel[(R * ns, n_hb, n_vb)](*args, ws_ml_ptr=ws_ml, ws_acc_ptr=ws_acc, SPLIT=3, **split)
        split_combine_kernel[(R, n_hb, n_vb)](
            ws_ml, ws_acc, out, out.stride(0), out.stride(1), smax, ssum, q_n, NS=ns, RESCALE=not two_pass,
            P_NORMALISED=normalised, IS_BF16=is_bf16, O_ROUND=modes[out_rounding],
            WRITE_LSE=bool(return_softmax_lse), BLOCK_H=cfg.block_h, BLOCK_DV=cfg.split_block_dv,
            num_warps=cfg.num_warps, enable_fp_fusion=False)

    attention_out = out.reshape(tuple(query.shape[:-1]) + (NOPE,))
    if return_softmax_lse:
        if layout_query == "TND":
            lse_shape = (1, R, q_n)
        else:
            lse_shape = (int(query.shape[0]), 1, int(query.shape[1]), q_n)
        return attention_out, smax.reshape(lse_shape), ssum.reshape(lse_shape)
    empty = torch.empty((0,), dtype=torch.float32, device=dev)
    return attention_out, empty, empty.clone()
