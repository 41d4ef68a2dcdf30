"""The faithful attention oracle's dequantisation and softmax in cache-sized blocks (issue 15: the decode close to
the GEMM floor). Rules: docs/numerics/attention.md#kv_quant_sparse_flash_attention.

* :func:`qsfa_keys` - the QSFA dequantisation of :mod:`qsfa.reference.attention`: NoPE ``decode(code) *
  tile_scale`` (one fp32 multiply) rounded to the query dtype, RoPE as stored, widened exactly into the float64 K
  the GEMMs read; plus the per-row facts the certification uses (``attention.qsfa_row_facts``). Blocks of rows, one
  NumPy pass per step: decode (a cast, exact in fp32), the fp32 multiply in place, the rounding, the widening into
  K, the RoPE copy while the rows are in cache. For int8 codes with finite tile scales and a bf16 query (the decode
  case; no NaN can arise) the bf16 rounding is done on the fp32 bits in place (:func:`bf16_bits_inplace`) instead
  of a cast to bf16 and back.
* :func:`softmax_rows` - the fp32 softmax between the two GEMMs, a block of whole rows at a time (scale, mask, max,
  certified exp and sum, the rounded probabilities), so each block's scores, float64 exp values and probabilities
  stay in cache between the steps.

Both compute the same values as the whole-array code they replace (tests/test_decode_blocks.py,
benchmarks/bytecheck.py); block sizes only change the speed.
"""

from __future__ import annotations

import numpy as np

from ._workspace import scratch

__all__ = ["qsfa_keys", "softmax_rows", "bf16_bits_inplace", "DEQUANT_ROWS", "SOFTMAX_ELEMS"]

#: packed rows per block (the fp32 block and its bit scratch: 2 x 1 MiB; fewer, larger blocks measured faster)
DEQUANT_ROWS = 512


def bf16_bits_inplace(u: np.ndarray, mode: str, tmp: np.ndarray | None = None) -> None:
    """Round the fp32 values whose bits are ``u`` (uint32, C-contiguous; no NaN) to bfloat16, in place, as fp32.

    bf16 is the top half of the fp32 bits. RINT (half to even): add ``0x7FFF`` plus the lowest kept bit, truncate;
    ROUND (half away from zero): add ``0x8000``, truncate. Both act on the sign-magnitude bits, so either sign,
    subnormals and the overflow to inf come out as ml_dtypes' cast and ``attention._bf16_round_away`` give them
    (tests/test_decode_blocks.py). ``tmp``: uint32 scratch of u's shape (RINT only)."""
    if mode == "rint":
        if tmp is None:
            tmp = np.empty_like(u)
        np.right_shift(u, np.uint32(16), out=tmp)
        np.bitwise_and(tmp, np.uint32(1), out=tmp)
        np.add(tmp, np.uint32(0x7FFF), out=tmp)
        np.add(u, tmp, out=u)
    else:
        np.add(u, np.uint32(0x8000), out=u)
    np.bitwise_and(u, np.uint32(0xFFFF0000), out=u)


def qsfa_keys(packed: np.ndarray, *, fmt: str, qdt: str, k_mode: str, rope: int, exact: bool):
    """Packed QSFA rows ``[n, kvd]`` (uint8) -> ``(K [n, 576] float64, facts)``.

    K: NoPE decoded and scaled (faithful: one fp32 multiply rounded to the query dtype with ``k_mode``; exact: the
    exact float64 product), RoPE as stored (zero when ``rope == 0``); a view of a per-thread scratch buffer, valid
    until the next call in the thread. facts (faithful; None in exact mode), from the tile scales and the RoPE bits
    (see ``attention._dot_f32``): per row a 2-norm bound and lq, per row and NoPE tile the largest |entry| and lq.
    """
    from .attention import _QDT, NOPE_DIM, ROPE_DIM, TILE, decode_nope_into, min_lq, qsfa_row_facts, round_q16

    n = packed.shape[0]
    scale_off = NOPE_DIM + 2 * rope
    tiles = NOPE_DIM // TILE
    scales = np.ascontiguousarray(packed[:, scale_off:scale_off + 16]).view("<f4")
    k = scratch("qsfa_k", (n, NOPE_DIM + ROPE_DIM), np.float64)
    kn = k[:, :NOPE_DIM]
    rope16 = packed[:, NOPE_DIM:scale_off].view(_QDT[qdt]) if rope else None
    if exact or not rope:
        if rope:
            np.copyto(k[:, NOPE_DIM:], rope16)  # exact widening
        else:
            k[:, NOPE_DIM:] = 0
    if exact:  # the exact float64 products, in place
        kn3 = kn.reshape(n, tiles, TILE)  # splits the unit-stride axis: a view
        decode_nope_into(kn, packed[:, :NOPE_DIM], fmt)
        with np.errstate(invalid="ignore"):  # 0 x inf: NaN, as in the faithful path
            np.multiply(kn3, scales.astype(np.float64)[:, :, None], out=kn3)
        return k, None
    bits = fmt == "int8" and qdt == "bfloat16" and bool(np.isfinite(scales).all())  # int8 x finite: no NaN
    rows = max(min(n, DEQUANT_ROWS), 1)
    tmp = scratch("qsfa_k_block", (rows, NOPE_DIM), np.float32)
    aux = scratch("qsfa_k_bits", (rows, NOPE_DIM), np.uint32) if bits and k_mode == "rint" else None
    if rope:  # the RoPE values (float64, contiguous: copied into K block by block) and their facts
        r64 = scratch("qsfa_k_rope", (n, ROPE_DIM), np.float64)
        np.copyto(r64, rope16)
        rope_facts = np.einsum("nd,nd->n", r64, r64), min_lq(rope16.view(np.uint16), qdt)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        t = tmp[:b - a]
        t3 = t.reshape(b - a, tiles, TILE)
        decode_nope_into(t, packed[a:b, :NOPE_DIM], fmt)  # exact in fp32
        with np.errstate(over="ignore", invalid="ignore"):
            np.multiply(t3, scales[a:b, :, None], out=t3)  # the one fp32 multiply
            if bits:
                bf16_bits_inplace(t.view(np.uint32), k_mode, None if aux is None else aux[:b - a])
                np.copyto(kn[a:b], t)  # exact widening
            else:
                np.copyto(kn[a:b], round_q16(t, qdt, k_mode))
        if rope:  # while the block's rows of K are in cache
            np.copyto(k[a:b, NOPE_DIM:], r64[a:b])
    facts = qsfa_row_facts(packed[:, :NOPE_DIM], scales, fmt, qdt, rope_facts=rope_facts if rope else None)
    return k, facts


#: scores per block of :func:`softmax_rows` (fp32 256 KiB; their float64 exp 512 KiB). Each block costs ~30 NumPy
#: calls (~25 us): 2^15 - 2^17 measured best, 2^13 or one block for the whole chunk ~1 ms slower per decode
SOFTMAX_ELEMS = 1 << 16


def softmax_rows(s: np.ndarray, valid: np.ndarray, scale, *, qdtype: str, probability_rounding: str, p_mode: str,
                 p_out: np.ndarray):
    """The faithful softmax of ``attention._faithful_chunk``, a block of whole rows at a time (its fp32 scores, their
    float64 exp and the probabilities stay in cache between the steps).

    s: ``RN32(q . k)`` fp32 ``[c, N, W]`` (overwritten); valid ``[c, W]``; scale fp32. Per row: ``s * scale`` (fp32),
    ``MASK_VALUE`` where not valid, ``m = max``, ``e = RN32(exp(s - m))``, ``l = RN32(sum e)``, the smallest non-zero
    e; P = e (``"normalised"``: ``e / l``, fp32) rounded to ``qdtype`` with ``p_mode``, written into ``p_out``
    (float64 ``[c, N, W]``). Returns ``(m, l)`` fp32 and ``e_min`` float64 (``inf`` where every e is 0), ``[c, N]``.
    """
    from .attention import MASK_VALUE, certified_f32, exact_sum_f32, exp_f32, round_q16, sum_error_bound

    c, nh, w = s.shape
    s2, p2 = s.reshape(-1, w), p_out.reshape(-1, w)
    n = s2.shape[0]
    masked = None if valid.all() else ~valid
    m, l, e_min = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float64)
    step = max(1, SOFTMAX_ELEMS // max(w, 1))
    e64 = scratch("softmax_e64", (min(step, n), w), np.float64)
    bits = scratch("softmax_bits", (min(step, n), w), np.uint32) if qdtype == "bfloat16" else None
    for a in range(0, n, step):
        b = min(n, a + step)
        x = s2[a:b]
        x *= scale  # fp32 multiply
        if masked is not None:
            np.copyto(x, MASK_VALUE, where=masked[np.arange(a, b) // nh])  # -2e38, not -inf (the kernel's value)
        mb = x.max(axis=-1)
        x -= mb[:, None]  # fp32 subtract (exact IEEE operation)
        e = exp_f32(x, out64=e64[:b - a])  # RN32(exp(s - m))
        l64 = np.add.reduce(e, axis=-1, dtype=np.float64)
        lb = certified_f32(l64, sum_error_bound(w, l64),  # all terms >= 0: sum |e| = l
                           lambda idx, e=e: exact_sum_f32(e[idx].astype(np.float64)))
        em = e.min(axis=-1)
        if not em.all():  # unselected tokens (or underflow) give P = 0: the smallest non-zero one matters
            em = np.min(e, axis=-1, where=e > 0, initial=np.inf)
        if probability_rounding == "normalised":
            e /= lb[:, None]  # fp32 divide
        if bits is not None and np.isfinite(l64).all():  # no NaN in e: round its fp32 bits in place
            bf16_bits_inplace(e.view(np.uint32), p_mode, bits[:b - a])
            np.copyto(p2[a:b], e)
        else:
            np.copyto(p2[a:b], round_q16(e, qdtype, p_mode))
        m[a:b], l[a:b], e_min[a:b] = mb, lb, em
    return m.reshape(c, nh), l.reshape(c, nh), e_min.reshape(c, nh)
