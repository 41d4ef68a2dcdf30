"""DeepSeek-V4 KV compressor (C4A / C4Li / C128A): docs/numerics/compressor.md.

For each batch ``b`` the call brings ``used_b`` new tokens at positions ``p = start_b .. start_b + used_b - 1``
(``start_b = start_pos[b]``, 0 when None). Per new token (``H`` = hidden size, ``D`` = head_dim, ``r`` = cmp_ratio):

* ``kv = x @ wkv.T`` and ``score = x @ wgate.T + ape[p % r]`` (``[coff * D]`` each);
* the state row of position ``p`` (``state_cache[blk, p % block_size]``, ``[kv | score]``, fp32) is written:
  cache_mode 1 at ``blk = state_block_table[b, p // block_size]`` unless that entry is 0, cache_mode 2 (a ring
  buffer per batch) at ``blk = state_block_table[b]`` for the tokens of the last ``coff`` groups only;
* every group ``g`` that this call completes (``start_b // r <= g < (start_b + used_b) // r``) gives one compressed
  row: its ``coff * r`` slots are, for coff 2, the previous group's tokens (columns ``[0, D)``; none before
  position 0) then the group's own (columns ``[D, 2D)``), for coff 1 the group's own (columns ``[0, D)``); a slot
  before ``start_b`` is read from the state as it was before the call. Per column, ``w = softmax(score)`` over the
  slots (a missing slot weighs 0) and the row is ``sum(w * kv)``.

Rows go out in group order: BSH ``cmp_kv[b, k]`` for the k-th group of batch b (``[B, ceil(S / r), D]``), TH packed
batch after batch (``[min(T, T // r + B), D]``); the rows no group fills are padding (written as zeros here; the
kernel leaves them unspecified).

``precision="faithful"`` (the kernel's rounding points, ops-transformer attention/compressor/op_kernel):
``kv`` and the matmul part of ``score`` are RN32 of the exact dot products (the cube's fp32 output), ``+ ape`` an
fp32 add; the softmax is fp32: ``m = max``, ``e = RN32(exp(RN32(s - m)))``, ``l`` = the fp32 sum of ``e``, ``w = e / l``
(fp32 divide), products ``RN32(w * kv)``, their fp32 sum; the row is cast to x's dtype with CAST_ROUND (half away
from 0). The two fp32 sums follow the chip's order (``reduce_order``): "tree" (Atlas A3, arch22 ``ColumnSum``:
the second half of the slots added onto the first, halving until one is left) or "sequential" (Ascend 950,
arch35 ``vf_softmax.h`` / ``vf_mul.h``: slot 0 first, from +0).
``precision="exact"``: float64 matmuls, softmax and sums, float64 rows; the state is fp32 storage either way (the
rounded value is written, the float64 one used for this call's own tokens).

``quant_compressor`` (the HiFloat8 path, ``quant=(x_descale, wkv_descale, wgate_descale)``): x, wkv and wgate
are HiFloat8 codes (uint8); faithful ``kv = RN32(x . wkv) * d`` with ``d = fp32(wkv_descale * x_descale)`` per
column (the kernel multiplies the two descales first, then one fp32 multiply per value), the same for the score
before ``+ ape``; the rest as above, and ``cmp_kv`` is bf16. Exact: float64 ``dot * x_descale * w_descale``.

Returns ``(cmp_kv, state_cache)``; ``state_cache`` is updated in place.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .attention import _dot_f32, _qdt_name, decode_nope, exp_f32, min_lq, round_q16, row_facts

__all__ = ["compressor", "plan", "SCENARIOS", "REDUCE_ORDERS", "PRECISIONS", "cmp_rows"]

BF16 = ml_dtypes.bfloat16
#: (cmp_ratio, coff, head_dim) the kernels accept: C4A, C4Li, C128A
SCENARIOS = ((4, 2, 512), (4, 2, 128), (128, 1, 512))
REDUCE_ORDERS = ("tree", "sequential")
PRECISIONS = ("faithful", "exact")
#: float32 bytes of gathered slots a chunk of groups may hold
_CHUNK_BYTES = 32 << 20


def _ints(a):
    return None if a is None else np.asarray(a, np.int64).reshape(-1)


def cmp_rows(x_shape, cmp_ratio: int, n_batch: int) -> tuple:
    """Shape of ``cmp_kv`` without its last axis: ``(B, ceil(S / r))`` for BSH x, ``(min(T, T // r + B),)`` for TH."""
    if len(x_shape) == 3:
        return (x_shape[0], -(-x_shape[1] // cmp_ratio))
    t = x_shape[0]
    return (min(t, t // cmp_ratio + n_batch),)


def plan(x_shape, cu_seqlens, seqused, start_pos, cmp_ratio):
    """Per batch ``(row offset in x, used tokens, start position)`` as int64 arrays, and B."""
    if len(x_shape) == 3:
        nb, s = x_shape[0], x_shape[1]
        base = np.arange(nb, dtype=np.int64) * s
        length = np.full(nb, s, np.int64)
    else:
        cu = _ints(cu_seqlens)
        nb = cu.size - 1
        base, length = cu[:-1], cu[1:] - cu[:-1]
    used = length if seqused is None else _ints(seqused)
    start = np.zeros(nb, np.int64) if start_pos is None else _ints(start_pos)
    return base, used, start, nb


def _facts(v64, codes, quant):
    if quant is None:
        return row_facts(v64, codes.view(np.uint16), _qdt_name(codes))
    norm = np.sqrt(np.einsum("...d,...d->...", v64, v64)) * (1 + 2.0 ** -40)
    return norm, min_lq(np.ascontiguousarray(codes).view(np.uint8), "hifloat8")


def _projections(xt, wkv, wgate, precision, quant=None):
    """(kv, score) of the token rows ``xt [n, H]``: RN32 of the exact dots (faithful) or float64 (exact); with
    ``quant`` the HiFloat8 codes are decoded and the dots dequantised (module docstring)."""
    val = (lambda c: decode_nope(np.ascontiguousarray(c).view(np.uint8), "hifloat8", np.float64)) if quant else \
        (lambda c: c.astype(np.float64))
    x64 = val(xt)
    xf = None if precision == "exact" else _facts(x64, xt, quant)
    outs = []
    for i, w in enumerate((wkv, wgate)):
        w64 = val(w)
        if precision == "exact":
            d = x64 @ w64.T
            if quant:
                d = d * float(np.float32(quant[0]).reshape(-1)[0]) * np.asarray(quant[1 + i], np.float64)
            outs.append(d)
            continue
        wf = _facts(w64, w, quant)
        d = _dot_f32(x64[None], w64.T[None], (xf[0][None], xf[1][None]), (wf[0][None], wf[1][None]))[0]
        if quant:
            desc = (np.asarray(quant[1 + i], np.float32) * np.asarray(quant[0], np.float32).reshape(-1)[0])
            d = (d * desc.astype(np.float32)).astype(np.float32)
        outs.append(d)
    return outs


def _fold_sum(a, order):
    """fp32 sum over axis 1 of ``a [G, n, D]`` (n a power of two for "tree") in the chip's order."""
    if order == "tree":
        while a.shape[1] > 1:
            h = a.shape[1] // 2
            a = a[:, :h] + a[:, h:]
        return a[:, 0]
    acc = np.zeros((a.shape[0], a.shape[2]), np.float32)
    for j in range(a.shape[1]):
        acc = acc + a[:, j]
    return acc


def _reduce(kv, sc, precision, order):
    """Compressed rows of slots ``kv, sc [G, n, D]`` (missing slots: sc -inf, kv 0)."""
    m = sc.max(axis=1, keepdims=True)
    if precision == "exact":
        e = np.exp(sc - m)
        w = e / e.sum(axis=1, keepdims=True)
        return (w * kv).sum(axis=1)
    with np.errstate(invalid="ignore"):
        diff = (sc - m).astype(np.float32)
    e = exp_f32(diff)
    e[np.isneginf(sc)] = 0.0  # a missing slot: exp(-inf) = +0
    l = _fold_sum(e, order)
    w = e / l[:, None, :]
    return _fold_sum((w * kv).astype(np.float32), order)


def compressor(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens=None, seqused=None, start_pos=None,
               *, cmp_ratio, coff=1, cache_mode=1, precision="faithful", reduce_order="tree", quant=None,
               raw_rows=False):
    """The compressor (module docstring). ``state_cache`` ``[block_num, block_size, 2 * coff * D]`` fp32 is written
    in place; returns ``(cmp_kv, state_cache)``. ``raw_rows``: ``cmp_kv`` keeps the reduce's fp32 rows (faithful;
    float64 with exact) instead of casting them to x's dtype - the input of ``vllm_compressor``'s RMSNorm."""
    assert precision in PRECISIONS and reduce_order in REDUCE_ORDERS
    r, cf = int(cmp_ratio), int(coff)
    x = np.asarray(x)
    h = x.shape[-1]
    cd = wkv.shape[0]  # coff * D
    d = cd // cf
    base, used, start, nb = plan(x.shape, cu_seqlens, seqused, start_pos, r)
    out_name = "bfloat16" if quant is not None else _qdt_name(x)
    out_dt = np.float64 if precision == "exact" else (np.float32 if raw_rows else
                                                       np.dtype(BF16) if quant is not None else x.dtype)
    cmp_kv = np.zeros(cmp_rows(x.shape, r, nb) + (d,), out_dt)
    if nb == 0 or int(used.sum()) == 0:
        return cmp_kv, state_cache
    bsz = state_cache.shape[1]
    table = np.asarray(state_block_table, np.int64)

    # the call's tokens, batch after batch
    tok_b = np.repeat(np.arange(nb, dtype=np.int64), used)
    first = np.concatenate(([0], np.cumsum(used)[:-1]))
    tok_i = np.arange(tok_b.size, dtype=np.int64) - first[tok_b]
    tok_p = start[tok_b] + tok_i
    xt = x.reshape(-1, h)[base[tok_b] + tok_i]
    kv_new, sc_new = _projections(xt, wkv, wgate, precision, quant)
    ape_t = np.asarray(ape)[tok_p % r]
    if precision == "exact":
        sc_new = sc_new + ape_t.astype(np.float64)
    else:
        sc_new = (sc_new + ape_t).astype(np.float32)

    # the groups this call completes
    g_lo, g_hi = start // r, (start + used) // r
    n_g = np.maximum(g_hi - g_lo, 0)
    grp_b = np.repeat(np.arange(nb, dtype=np.int64), n_g)
    g_first = np.concatenate(([0], np.cumsum(n_g)[:-1]))
    grp_k = np.arange(grp_b.size, dtype=np.int64) - g_first[grp_b]
    grp_g = g_lo[grp_b] + grp_k
    # slot positions [G, coff * r] and their column block
    j = np.arange(r, dtype=np.int64)
    halves = [(grp_g[:, None] - (cf - 1 - c)) * r + j for c in range(cf)]  # c = 0: previous group when coff 2
    pos = np.concatenate(halves, axis=1)
    col = np.repeat(np.arange(cf, dtype=np.int64), r)
    # the state rows those slots read (positions before start_b), gathered before this call writes any
    from_state_all = (pos >= 0) & (pos < start[grp_b, None])
    fs_b = np.broadcast_to(grp_b[:, None], pos.shape)[from_state_all]
    fs_p = pos[from_state_all]
    if cache_mode == 1:
        fs_blk = table[fs_b, np.minimum(fs_p // bsz, table.shape[1] - 1)] if fs_p.size else fs_p
    else:
        fs_blk = table.reshape(-1)[fs_b]
    st_vals = np.concatenate([np.zeros((1, 2 * cd), np.float32), state_cache[fs_blk, fs_p % bsz]])
    st_map = np.zeros(pos.shape, np.int64)
    st_map[from_state_all] = 1 + np.arange(fs_p.size, dtype=np.int64)

    # state writes
    if cache_mode == 1:
        blk = table[tok_b, tok_p // bsz]
        keep = blk != 0
    else:
        blk = table.reshape(-1)[tok_b]
        last = (start + used) // r - (cf - 1)  # the first group a ring buffer keeps
        keep = tok_p // r >= last[tok_b]
    row = tok_p % bsz
    state_cache[blk[keep], row[keep], :cd] = kv_new[keep].astype(np.float32)
    state_cache[blk[keep], row[keep], cd:] = sc_new[keep].astype(np.float32)

    out_flat = cmp_kv.reshape(-1, d)
    out_row = grp_b * cmp_kv.shape[1] + grp_k if x.ndim == 3 else np.arange(grp_b.size, dtype=np.int64)
    step = max(1, _CHUNK_BYTES // (cf * r * d * 16))
    work_dt = np.float64 if precision == "exact" else np.float32
    for c0 in range(0, grp_b.size, step):
        sl = slice(c0, c0 + step)
        gb, ps = grp_b[sl, None], pos[sl]
        missing = ps < 0
        from_state = ~missing & (ps < start[gb])
        new_idx = np.where(from_state | missing, 0, first[gb] + ps - start[gb])
        srow = st_vals[st_map[sl]]  # [g, n, 2 * coff * D]
        cols = col[None, :, None] * d + np.arange(d)[None, None, :]
        st_kv = np.take_along_axis(srow[..., :cd], cols, axis=2)
        st_sc = np.take_along_axis(srow[..., cd:], cols, axis=2)
        nw_kv = np.take_along_axis(kv_new[new_idx], cols, axis=2)
        nw_sc = np.take_along_axis(sc_new[new_idx], cols, axis=2)
        fs = from_state[..., None]
        kv = np.where(fs, st_kv, nw_kv).astype(work_dt)
        sc = np.where(fs, st_sc, nw_sc).astype(work_dt)
        kv[missing] = 0.0
        sc[missing] = -np.inf
        rows = _reduce(kv, sc, precision, reduce_order)
        if precision == "exact" or raw_rows:
            out_flat[out_row[sl]] = rows
        else:
            out_flat[out_row[sl]] = round_q16(rows, out_name, "round")
    return cmp_kv, state_cache
