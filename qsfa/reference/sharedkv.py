"""DeepSeek-V4 shared-KV sparse attention (SWA / CSA / HCA): one core for every V4 entry point.
docs/numerics/attention-v4.md.

For every valid query row ``i`` of batch ``b`` and query head ``h`` (one KV head: K = V)::

    out = sum_j exp(s_j) K_j / (sum_j exp(s_j) + exp(sink_h)),   s_j = softmax_scale * q . K_j

over the tokens ``K_j`` the row selects (``S1`` = the batch's query length, ``S2`` its ``ori_kv`` length):

* the window over ``ori_kv`` (``thr = S2 - S1 + i + 1``, the right-down causal diagonal): ``ori_mask_mode`` 4 (band)
  ``[max(thr - ori_win_left - 1, 0), thr + ori_win_right)``, 3 (causal) ``[0, thr + ori_win_right)``, 0 (no mask)
  ``[0, S2)``; a window bound of -1 is unlimited; clipped to ``[0, S2)``;
* the compressed part over ``cmp_kv`` (length ``S3``), when given: the pre-compression length is
  ``L = S3 * cmp_ratio + cmp_residual_kv[b]`` (``S2`` when ``cmp_residual_kv`` is None), the bound
  ``thr_c = floor((L - S1 + i + 1) / cmp_ratio)`` (``cmp_mask_mode`` 3) or ``floor(L / cmp_ratio)`` (0), clipped to
  ``[0, S3]``. HCA (no indices): the tokens ``[0, thr_c)``. CSA: of the row's ``cmp_sparse_indices`` only the first
  ``min(K, thr_c)`` positions are read, reading stops at the first -1, and an entry ``>= thr_c`` is skipped
  (ops-transformer attention/sparse_flash_mla/tests/pytest/sparse_flash_mla_golden.py ``gather_kv``);
* with ``ori_mask_mode`` 3 or 4 the rows ``i < S1 - S2`` (``thr <= 0``) are zero, and so is their LSE.

The sink is one more logit per head in the denominator only (None or -inf: no sink). The LSE is
``log(sum_j exp(s_j) + exp(sink))`` - it includes the sink, as the public golden's ``row_max + log(row_sum)`` whose
``row_sum`` starts at 1 against ``row_max = sink``. A row with no token and no sink gives ``out = 0``, ``lse = -inf``.

``precision="exact"``: float64, no rounding (the definition above; float64 outputs).

``precision="faithful"``: the kernel's online softmax (docs ``aclnnSparseFlashMla.md`` formulas and the golden's
``RUN_MODE = 1``; the kernels' vector stages). The row's selected tokens are cut into S2 tiles of ``s2_tile`` tokens
(A2/A3 512, 950 128; qsfa.chips.SHAREDKV_NUMERICS): the window's tokens
from the window start, then - starting a new tile - the compressed tokens in index order. State (fp32) starts at
``m = sink``, ``l = 1``, ``O = 0``; per tile ``S = RN32(q . k) * fp32(softmax_scale)``, ``m' = max(m, max S)``,
``a = RN32(exp(m - m'))``, ``E = RN32(exp(S - m'))``, ``l = a * l + RN32(sum E)``, ``P = round(E)`` to the query dtype
(against the running max ``m'``, ``p_rounding``: ROUND on every chip), ``O = a * O + RN32(P @ K)``; finally
``out = round(O / l)`` (``out_rounding``: A2/A3 bf16 RINT, fp16 ROUND; 950 ROUND) and ``lse = m + RN32(log l)``.
The public golden rounds P half to even (``torch .to``); the kernels cast with ``CAST_ROUND`` - qsfa follows the
kernels (docs/numerics/chips.md#deepseek-v4-shared-kv-attention). A kernel that splits one row's S2 range over
cores (flash decode, chosen by the metadata) merges partial results in another order; that path is not modelled. Every RN32 is the correctly rounded fp32 value of the exact result,
as in :mod:`qsfa.reference.attention` (same helpers), so the bytes do not depend on the BLAS; the kernel's
accumulation order lands within a few fp32 ulps (docs/numerics/comparison.md#float-criterion).

Vectorised over rows, heads and tokens; Python loops only over chunks of rows, over S2 tiles, and over a chunk's
rows to copy their selected K rows (one ``np.take`` per row and cache). The faithful path packs each S2 tile to the
tokens its rows select (a masked slot changes no fp32 result: every one is the correctly rounded value of an exact
sum, to which it adds zero) and computes the scores' softmax steps for all tiles of a chunk at once; per tile
remain the two certified products and the state update. Bytes: pinned by benchmarks/bytecheck.py (``sharedkv-*``);
speed: benchmarks/sharedkv_decode.py.
"""

from __future__ import annotations

import numpy as np

from .attention import (
    _dot_f32, _FIELD16, _NO_LQ, _QDT, _qdt_name, certified_f32, exact_room, exact_sum_f32, exp_f32, log_f32,
    round_q16, row_facts, rows_in_range, sum_error_bound, zero_idle_rows,
)
from ._decode_blocks import bf16_bits_inplace
from ._workspace import scratch

__all__ = ["sharedkv_attention", "select_tokens", "S2_TILE", "PRECISIONS", "KV_LAYOUTS"]

#: the kernel's S2 tile (aclnnSparseFlashMla.md: "S2方向按512分块循环"; golden ``s2_base_size = 512``)
S2_TILE = 512
PRECISIONS = ("faithful", "exact")
KV_LAYOUTS = ("BSND", "TND", "PA_BBND")
#: float64 bytes of gathered K a chunk of rows may hold
_CHUNK_BYTES = 48 << 20


def _ints(a):
    return None if a is None else np.asarray(a, np.int64).reshape(-1)


def _query_rows(q, layout_q, cu_seqlens_q, seqused_q):
    """(q rows [R, N, D], batch [R], position i [R], S1 [R], valid [R], B)."""
    if layout_q == "BSND":
        b_, s1 = q.shape[0], q.shape[1]
        rows = q.reshape(b_ * s1, q.shape[2], q.shape[3])
        bat = np.repeat(np.arange(b_, dtype=np.int64), s1)
        pos = np.tile(np.arange(s1, dtype=np.int64), b_)
        s1_act = np.full(b_ * s1, s1, np.int64)
        used = _ints(seqused_q)
        valid = np.ones(b_ * s1, bool) if used is None else pos < used[bat]
        return rows, bat, pos, s1_act, valid, b_
    cu = _ints(cu_seqlens_q)
    b_ = cu.size - 1
    t = q.shape[0]
    r = np.arange(t, dtype=np.int64)
    bat = np.clip(np.searchsorted(cu, r, side="right") - 1, 0, b_ - 1)
    pos = r - cu[bat]
    s1_act = (cu[1:] - cu[:-1])[bat]
    valid = r < cu[-1]
    return q, bat, pos, s1_act, valid, b_


class LazyRows:
    """Quantised cache rows ``[..., row_bytes]`` seen as dequantised rows ``[..., d]``, decoded only where the core
    gathers them (integer indexing of the flat view). A 950 cache holds every token of every request while a call
    reads a window and a top-k of it; ``decode`` works row by row, so the gathered rows are the bytes a whole-cache
    dequantisation would give."""

    def __init__(self, raw: np.ndarray, decode, d: int):
        self._raw, self._decode = raw, decode
        self.shape = tuple(raw.shape[:-1]) + (int(d),)

    def reshape(self, *shape):
        assert shape == (-1, self.shape[-1]), shape  # the only view the core takes (_kv_source)
        return LazyRows(self._raw.reshape(-1, self._raw.shape[-1]), self._decode, self.shape[-1])

    def __getitem__(self, idx):
        return self._decode(self._raw[idx])


def _kv_source(kv, layout_kv, block_table, cu, seqused, b_):
    """(flat rows [n, D], lengths [B] or None, row_of(batch, token) -> flat row index)."""
    d = kv.shape[-1]
    if layout_kv == "BSND":
        s = kv.shape[1]
        lens = _ints(seqused)
        return kv.reshape(-1, d), (np.full(b_, s, np.int64) if lens is None else lens), lambda b, j: b * s + j
    if layout_kv == "TND":
        c = _ints(cu)
        lens = c[1:] - c[:-1] if seqused is None else _ints(seqused)
        return kv.reshape(-1, d), lens, lambda b, j: c[b] + j
    bs = kv.shape[1]
    bt = np.asarray(block_table, np.int64)
    lens = _ints(seqused)
    return kv.reshape(-1, d), lens, lambda b, j: bt[b, j // bs] * bs + j % bs


def select_tokens(bat, pos, s1_act, valid, ori_len, cmp_len, cmp_residual_kv, cmp_sparse_indices, *, has_cmp,
                  cmp_ratio, ori_mask_mode, cmp_mask_mode, ori_win_left, ori_win_right):
    """Per query row: (zero_row [R], ori start [R], ori count [R], cmp tokens [R, Kc] (-1 padded, in order),
    cmp count [R]). ``cmp_sparse_indices``: [R, K] or None (HCA)."""
    s2 = ori_len[bat]
    thr = s2 - s1_act + pos + 1
    zero = ~valid
    if ori_mask_mode in (3, 4):
        zero = zero | (thr <= 0)
    if ori_mask_mode == 0:
        start, end = np.zeros_like(thr), s2
    else:
        start = np.zeros_like(thr) if (ori_mask_mode == 3 or ori_win_left == -1) else thr - ori_win_left - 1
        end = s2 if ori_win_right == -1 else thr + ori_win_right
    start = np.clip(start, 0, s2)
    end = np.clip(end, start, s2)
    n_ori = np.where(zero, 0, end - start)
    if not has_cmp:
        return zero, start, n_ori, np.full((bat.size, 0), -1, np.int64), np.zeros_like(n_ori)
    s3 = cmp_len[bat]
    big = s3 * cmp_ratio + _ints(cmp_residual_kv)[bat] if cmp_residual_kv is not None else s2
    thr_c = np.floor_divide(big - s1_act + pos + 1, cmp_ratio) if cmp_mask_mode == 3 else big // cmp_ratio
    thr_c = np.where(zero, 0, np.clip(thr_c, 0, s3))
    if cmp_sparse_indices is None:
        width = int(thr_c.max(initial=0))
        j = np.arange(width, dtype=np.int64)[None, :]
        keep = j < thr_c[:, None]
        toks = np.where(keep, j, -1)
        return zero, start, n_ori, toks, thr_c
    idx = np.asarray(cmp_sparse_indices, np.int64)
    k = idx.shape[1]
    p = np.arange(k, dtype=np.int64)[None, :]
    before_end = np.cumprod(idx != -1, axis=1).astype(bool)  # reading stops at the first -1
    keep = before_end & (p < np.minimum(k, thr_c)[:, None]) & (idx >= 0) & (idx < thr_c[:, None])
    n_cmp = keep.sum(axis=1)
    if n_cmp.sum() == keep.size:  # every entry kept (a decode's top-k): already in order
        return zero, start, n_ori, idx, n_cmp
    order = np.argsort(~keep, axis=1, kind="stable")  # kept entries first, in index order
    toks = np.where(np.take_along_axis(keep, order, 1), np.take_along_axis(idx, order, 1), -1)
    return zero, start, n_ori, toks[:, : int(n_cmp.max(initial=0))], n_cmp


def _take(flat, rows, out):
    """``out[...] = flat[rows]`` (rows of a flat cache, or of :class:`LazyRows`); an array's rows in range are
    copied straight into ``out`` (``np.take`` buffers its output unless told how to treat indices out of range),
    consecutive rows (a window, an HCA's compressed tokens) as one slice."""
    if isinstance(flat, np.ndarray) and (rows.size == 0 or (rows.min() >= 0 and rows.max() < flat.shape[0])):
        if rows.size > 1 and int(rows[-1]) - int(rows[0]) == rows.size - 1 and (np.diff(rows) == 1).all():
            np.copyto(out, flat[int(rows[0]):int(rows[-1]) + 1])
        else:
            np.take(flat, rows, axis=0, out=out, mode="clip")
    else:
        out[...] = flat[rows]


def _rows_of(a, r):
    """``a[r]`` for sorted distinct row numbers ``r``: a view when they are consecutive (a decode's rows)."""
    if r.size and int(r[-1]) - int(r[0]) + 1 == r.size:
        return a[int(r[0]):int(r[-1]) + 1]
    return a[r]


def _tile_layout(n_ori, ori_slots, n_cmp, tile):
    """The S2 tiles of a chunk of rows packed to their selected slots. A row selects the slots ``[0, n_ori)`` (its
    window) and ``[ori_slots, ori_slots + n_cmp)`` (its compressed tokens, from a tile boundary); a packed tile is
    as wide as its most populated row (rows with fewer tokens are masked there), so every tile a row fills keeps
    the full width and a row's window lands at ``[0, n_ori)``, its compressed tokens at ``[at, at + n_cmp)``.
    Returns (tiles: [(lo, hi)] of the packed tiles that hold a selected slot, packed width, at [c])."""
    n_t = -(-int((ori_slots + n_cmp).max(initial=0)) // tile)
    t0 = np.arange(n_t, dtype=np.int64)[None, :] * tile  # first slot of each tile
    cnt = np.clip(n_ori[:, None] - t0, 0, tile) + np.clip(n_cmp[:, None] - (t0 - ori_slots[:, None]), 0, tile) * (
        t0 >= ori_slots[:, None])
    wt = cnt.max(axis=0, initial=0)  # [n_t]
    off = np.concatenate([[0], np.cumsum(wt)])
    tiles = [(int(off[t]), int(off[t] + wt[t])) for t in range(n_t) if wt[t] > 0]
    return tiles, int(off[-1]), off[np.minimum(ori_slots // tile, n_t)]


def _lq(mn, qdtype):
    """min_lq from the minimum of ``magnitude bits - 1`` (uint16, zero wrapped to 0xFFFF) of 16-bit values."""
    mn = mn.astype(np.int32)
    shift, low = _FIELD16[qdtype]
    return np.where(mn == 0xFFFF, _NO_LQ, ((mn + 1) >> shift) + low)


def _row_squares(k64, block=128):
    """The sum of squares of every row of ``k64`` (float64), ``block`` rows at a time."""
    d = k64.shape[-1]
    src = k64.reshape(-1, d)
    sq = np.empty(src.shape[0])
    for a in range(0, src.shape[0], block):
        np.einsum("nd,nd->n", src[a:a + block], src[a:a + block], out=sq[a:a + block])
    return sq.reshape(k64.shape[:-1])


#: 16-bit magnitude bits (sign cleared) at or above which a value is inf / NaN
_NONFINITE16 = {"bfloat16": 0x7F80, "float16": 0x7C00}


def _k_facts(k64, k16, tiles, qdtype, q_finite):
    """The facts of K (see attention._dot_f32) from its 16-bit values: per row (2-norm bound, lq); V's facts for
    tile t, ``vf(t)``; and whether Q (``q_finite``) and K are finite. One pass makes the magnitude bits (sign
    cleared), a second turns them into ``magnitude - 1`` in place (zero wraps to 0xFFFF: never the minimum of a
    row or column with a non-zero value). A row's 2-norm bound is ``sqrt(D) max |k|`` (its largest magnitude: one
    pass over the 2-byte bits, no float64 sums of squares); where Q or K holds an inf / NaN (the per-tile Q.K
    calls of :func:`_faithful`) it is the square root of the row's float64 sum of squares, the facts those calls
    always saw.

    ``vf(t, room)``: V's facts for P @ V over tile t, per column ``(max |entry|, lq)`` ``[c, D]``. When the tile's
    largest magnitude and smallest lq over all its rows (from the row facts: no pass over V) already fit ``room``
    (``[c]``, the smallest room of the tile's P rows: attention._dot_f32), every pair is exact with those
    tile-wide facts, broadcast over the columns; otherwise the columns are reduced along the token axis (the
    same facts as ``min_lq`` of the transposed bits). Either way the products are the same correctly rounded
    values: the facts only choose between the exactness proof and the certified sums."""
    mag = np.bitwise_and(k16.view(np.uint16), np.uint16(0x7FFF), out=scratch("sharedkv_kmag", k16.shape, np.uint16))
    rmax = mag.max(axis=-1)
    finite = q_finite and bool((rmax < _NONFINITE16[qdtype]).all())
    mag -= np.uint16(1)
    rmin = mag.min(axis=-1)
    c, d = k16.shape[0], k16.shape[-1]
    lo_t = np.array([lo for lo, _ in tiles], np.int64)
    t_max = np.maximum.reduceat(rmax, lo_t, axis=-1).view(_QDT[qdtype]).astype(np.float64)  # [c, T]
    t_lq = _lq(np.minimum.reduceat(rmin, lo_t, axis=-1), qdtype)
    with np.errstate(divide="ignore"):
        t_span = np.log2(t_max) - t_lq

    def vf(t, room=None):
        if finite and room is not None and (t_span[:, t] <= room).all():
            return (np.broadcast_to(t_max[:, t, None], (c, d)), np.broadcast_to(t_lq[:, t, None], (c, d)))
        lo, hi = tiles[t]
        m1 = mag[:, lo:hi]
        vmax = (m1 + np.uint16(1)).max(axis=1).view(_QDT[qdtype]).astype(np.float64)  # (0xFFFF + 1 wraps to 0)
        return vmax, _lq(m1.min(axis=1), qdtype)

    if finite:  # |k|_2 <= sqrt(D) max |k_j|; the margin covers the two roundings of the product
        norm = rmax.view(_QDT[qdtype]).astype(np.float64) * (np.sqrt(float(d)) * (1 + 2.0 ** -40))
    else:
        norm = np.sqrt(_row_squares(k64)) * (1 + 2.0 ** -40)
    return (norm, _lq(rmin, qdtype)), vf, finite


def output_rows(attention_out, n_rows: int, n_heads: int, d: int, odt) -> np.ndarray:
    """The ``[rows, heads, d]`` output the chunks write: zeros, or a view of the caller's ``attention_out`` (its
    contract checked dtype, size and C-contiguity before the call, so the reshape is a view, never a copy)."""
    if attention_out is None:
        return np.zeros((n_rows, n_heads, d), odt)
    assert attention_out.dtype == odt and attention_out.size == n_rows * n_heads * d, attention_out.dtype
    out = attention_out.reshape(n_rows, n_heads, d)
    assert np.shares_memory(out, attention_out)
    return out


def sharedkv_attention(q, ori_kv, cmp_kv=None, cmp_sparse_indices=None, *, ori_block_table=None,
                       cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None,
                       seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None, sinks=None,
                       softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1,
                       ori_win_right=-1, layout_q="BSND", layout_kv="BSND", return_softmax_lse=False,
                       precision="faithful", s2_tile=S2_TILE, p_rounding="round", out_rounding="rint",
                       attention_out=None):
    """The shared-KV attention core (module docstring). Arguments as ``aclnnSparseFlashMla`` (N2 = 1); the
    layout ``"PA_ND"`` is taken as ``"PA_BBND"``. A PA compressed cache without ``seqused_cmp_kv`` has
    ``S3 = floor(S2 / cmp_ratio)``. ``s2_tile``, ``p_rounding``, ``out_rounding`` ("rint" / "round"): the chip's
    (qsfa.chips.SHAREDKV_NUMERICS; the defaults are Atlas A2/A3's for a bfloat16 query). Returns ``(attention_out like q, softmax_lse)``; softmax_lse is float32
    (float64 exact) ``[B, 1, S1, N1]`` (BSND) / ``[1, T1, N1]`` (TND), or an empty ``[0]`` array when not
    requested.

    ``attention_out``: an optional C-contiguous array of the output's shape and dtype (e.g. an ``np.memmap``): the
    rows are written into it chunk by chunk and it is returned, so a long prefill's output never exists in memory
    as a whole. Within :func:`qsfa.reference.attention.only_rows` only the rows of the range are computed (the
    others are zero, LSE included; a row's bytes do not depend on the rows computed with it), so a call split
    into row ranges assembles to the same bytes (qsfa.distributed's row tasks)."""
    assert precision in PRECISIONS, precision
    exact = precision == "exact"
    layout_kv = "PA_BBND" if layout_kv == "PA_ND" else layout_kv
    qdtype = _qdt_name(q)
    rows, bat, pos, s1_act, valid, b_ = _query_rows(q, layout_q, cu_seqlens_q, seqused_q)
    n_heads, d = rows.shape[1], rows.shape[2]
    ori_flat, ori_len, ori_row = _kv_source(ori_kv, layout_kv, ori_block_table, cu_seqlens_ori_kv, seqused_ori_kv, b_)
    has_cmp = cmp_kv is not None
    cmp_flat = cmp_len = cmp_row = None
    if has_cmp:
        cmp_flat, cmp_len, cmp_row = _kv_source(cmp_kv, layout_kv, cmp_block_table, cu_seqlens_cmp_kv,
                                                 seqused_cmp_kv, b_)
        if cmp_len is None:  # PA without seqused_cmp_kv
            cmp_len = ori_len // cmp_ratio
    idx = None
    if cmp_sparse_indices is not None:
        idx = np.asarray(cmp_sparse_indices).reshape(rows.shape[0], -1)
    masks = dict(cmp_ratio=int(cmp_ratio), ori_mask_mode=int(ori_mask_mode), cmp_mask_mode=int(cmp_mask_mode),
                 ori_win_left=int(ori_win_left), ori_win_right=int(ori_win_right))
    # the window of every row here; the compressed tokens chunk by chunk (a long prefill's [rows, K] index arrays
    # would not fit the working set)
    zero, start, n_ori, _, _ = select_tokens(bat, pos, s1_act, valid, ori_len, cmp_len, cmp_residual_kv, None,
                                             has_cmp=False, **masks)
    tile = int(s2_tile)
    ori_slots = -(-n_ori // tile) * tile  # the compressed part starts a new tile
    cmp_bound = 0 if not has_cmp else int(idx.shape[1]) if idx is not None else int(cmp_len.max(initial=0))
    sink = np.full(n_heads, -np.inf, np.float32) if sinks is None else np.asarray(sinks, np.float32)
    fdt = np.float64 if exact else np.float32
    odt = np.float64 if exact else _QDT[qdtype]
    out = output_rows(attention_out, rows.shape[0], n_heads, d, odt)
    lse = np.zeros((rows.shape[0], n_heads), fdt)
    live = rows_in_range(np.nonzero(~zero)[0])
    # rows of the range no chunk writes are zero (the others' bytes stay)
    zero_idle_rows([] if attention_out is None else [out], rows.shape[0], live)
    # K bytes per row: faithful packs a row's window to [0, n_ori) (see _tile_layout), exact keeps the slot layout
    ori_w = ori_slots if exact else n_ori
    per_row = max(int(ori_w[live].max(initial=0)) + cmp_bound, 1) * d * 8 * 2
    step = max(1, _CHUNK_BYTES // per_row)
    span = np.arange(int(n_ori[live].max(initial=0)), dtype=np.int64)
    for c0 in range(0, live.size, step):
        r = live[c0:c0 + step]
        _, _, _, cmp_toks, n_cmp = select_tokens(bat[r], pos[r], s1_act[r], valid[r], ori_len, cmp_len,
                                                 cmp_residual_kv, None if idx is None else idx[r],
                                                 has_cmp=has_cmp, **masks)
        n_o, slots_o = n_ori[r], ori_slots[r]
        # faithful: every S2 tile compacted to its selected slots (a masked slot adds exactly nothing: e = 0, P = 0,
        # and every fp32 result is RN32 of an exact value); exact: the slot layout (its float64 sums see the zeros)
        if exact:
            wc = max(int((slots_o + n_cmp).max(initial=0)), 1)
            tiles, at = [(0, wc)], slots_o
        else:
            tiles, wc, at = _tile_layout(n_o, slots_o, n_cmp, tile)
        # row i: window at [0, n_o), compressed tokens at [at, at + n_cmp), zeros elsewhere
        k16 = scratch("sharedkv_k16", (r.size, max(wc, 1), d), rows.dtype)
        br, st = bat[r].tolist(), start[r].tolist()
        for i, (no, a, nc) in enumerate(zip(n_o.tolist(), at.tolist(), n_cmp.tolist())):
            if no:
                _take(ori_flat, ori_row(br[i], st[i] + span[:no]), k16[i, :no])
            if nc:
                _take(cmp_flat, cmp_row(br[i], cmp_toks[i, :nc]), k16[i, a:a + nc])
                k16[i, no:a] = 0
                k16[i, a + nc:] = 0
            else:
                k16[i, no:] = 0
        j = np.arange(k16.shape[1], dtype=np.int64)[None, :]
        selc = (j < n_o[:, None]) | ((j >= at[:, None]) & (j < (at + n_cmp)[:, None]))
        if exact:
            k64 = k16.astype(np.float64)
        else:  # (a kept buffer: a fresh one costs a page fault per 4 KiB)
            k64 = scratch("sharedkv_k64", k16.shape, np.float64)
            np.copyto(k64, k16)
        q16 = _rows_of(rows, r)
        q64 = q16.astype(np.float64) if exact else scratch("sharedkv_q64", q16.shape, np.float64)
        if not exact:
            np.copyto(q64, q16)
        if exact:
            o, l_ = _exact(q64, k64, selc, float(softmax_scale), sink.astype(np.float64))
        else:
            o, l_ = _faithful(q64, q16, k64, k16, selc, np.float32(softmax_scale), sink, qdtype, tiles,
                              p_rounding, out_rounding)
        out[r] = o
        lse[r] = l_
    out = out.reshape(q.shape) if attention_out is None else attention_out
    if not return_softmax_lse:
        return out, np.zeros((0,), fdt)
    if layout_q == "BSND":
        lse = lse.reshape(q.shape[0], 1, q.shape[1], n_heads)
    else:
        lse = lse.reshape(1, q.shape[0], n_heads)
    return out, lse


def _exact(q64, k64, sel, scale, sink):
    s = np.matmul(q64, k64.transpose(0, 2, 1)) * scale  # [c, N, w]
    s[~np.broadcast_to(sel[:, None, :], s.shape)] = -np.inf
    m = np.maximum(s.max(axis=-1), sink[None, :])
    with np.errstate(invalid="ignore", divide="ignore"):
        m0 = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m0[..., None])
        den = e.sum(axis=-1) + np.exp(sink[None, :] - m0)
        o = np.matmul(e, k64) / np.where(den > 0, den, 1.0)[..., None]
        lse = m0 + np.log(den)
    return o, np.where(den > 0, lse, -np.inf)


def _faithful(q64, q16, k64, k16, sel, scale, sink, qdtype, tiles, p_rounding, out_rounding):
    """The online softmax over the packed tiles ``[(lo, hi)]`` of ``k64`` (see :func:`_tile_layout`); ``sel``
    [c, W] marks the selected tokens. Vectorised over rows, heads and tiles: the scores of all tiles land in one
    block (one ``_dot_f32`` call; per tile where Q or K holds a non-finite value), and the
    running maxima (they depend on the scores only), the exponentials, the tile sums and P are computed for all
    tiles at once; per tile remain ``RN32(P @ V)`` and the state update."""
    c, n = q64.shape[:2]
    d = k64.shape[-1]
    if not tiles:  # no row of the chunk selects a token: the state stays m = sink, l = 1, O = 0
        m = np.broadcast_to(sink[None, :], (c, n)).astype(np.float32)
        return _finish(m, np.ones((c, n), np.float32), np.zeros((c, n, d), np.float32), qdtype, out_rounding)
    lo_t = np.array([t[0] for t in tiles], np.int64)
    wt = np.array([t[1] - t[0] for t in tiles], np.int64)
    qf = row_facts(q64, q16.view(np.uint16), qdtype)
    kf, vf, finite = _k_facts(k64, k16, tiles, qdtype, bool(np.isfinite(qf[0]).all()))
    s = scratch("sharedkv_s", (c, n, k64.shape[1]), np.float32)  # (kept buffers: no page faults per call)
    if finite:
        # RN32(q . k)  [c, N, W] in one call over the tiles (they are contiguous from 0): with every value finite
        # each score is the one RN32 of its exact dot product, whichever pairs are certified together
        _dot_f32(q64, k64.transpose(0, 2, 1), qf, kf, out=s)
    else:  # one call per tile: an inf / NaN term's NaN bits in the exact sums depend on the pairs summed with it
        for lo, hi in tiles:
            _dot_f32(q64, k64[:, lo:hi].transpose(0, 2, 1), qf, (kf[0][:, lo:hi], kf[1][:, lo:hi]),
                     out=s[..., lo:hi])
    s *= scale  # fp32 multiply
    if not sel.all():
        np.copyto(s, np.float32(-np.inf), where=~sel[:, None, :])
    any_t = np.logical_or.reduceat(sel, lo_t, axis=1)  # [c, T]
    tmax = np.maximum.reduceat(s, lo_t, axis=-1)  # [c, N, T]
    # the running state m before each tile and the max each tile uses (0 for a row the tile does not touch)
    m_prev = np.empty(tmax.shape, np.float32)
    m_use = np.empty(tmax.shape, np.float32)
    m = np.broadcast_to(sink[None, :], (c, n)).astype(np.float32)
    for t in range(len(tiles)):
        upd = any_t[:, t, None]
        m_new = np.maximum(m, tmax[..., t])
        m_prev[..., t] = m
        m_use[..., t] = np.where(upd, m_new, np.float32(0))
        m = np.where(upd, m_new, m).astype(np.float32)
    with np.errstate(invalid="ignore"):
        a_all = np.where(np.isneginf(m_prev), np.float32(0), exp_f32((m_prev - m_use).astype(np.float32)))
    clean = bool(np.isfinite(m_use).all())  # no +inf / NaN score: s - m is finite or -inf (masked), exp +0
    fin = None if clean else np.isfinite(s)
    with np.errstate(invalid="ignore"):
        for t, (lo, hi) in enumerate(tiles):
            np.subtract(s[..., lo:hi], m_use[..., t, None], out=s[..., lo:hi])
        e = exp_f32(s, out64=scratch("sharedkv_e64", s.shape, np.float64),
                    out=scratch("sharedkv_e", s.shape, np.float32))  # RN32(exp(s - m'))  [c, N, W]
    if clean:
        l64 = np.add.reduceat(e, lo_t, axis=-1, dtype=np.float64)  # terms in [0, 1]: sum |e| = l64
        tsum = certified_f32(l64, sum_error_bound(int(wt.max()), l64), lambda idx: np.array(
            [exact_sum_f32(e[i // (n * wt.size), (i // wt.size) % n, lo_t[i % wt.size]:tiles[i % wt.size][1]]
                           [None].astype(np.float64))[0] for i in idx], np.float32))
    else:
        e = np.where(fin, e, np.float32(0)).astype(np.float32)
        tsum = np.stack([exact_sum_f32(e[..., lo:hi].reshape(-1, hi - lo).astype(np.float64)).reshape(c, n)
                         for lo, hi in tiles], axis=-1)
    p64 = scratch("sharedkv_p64", e.shape, np.float64)
    mn = _round_p(e, lo_t, qdtype, p_rounding, clean, p64)  # P against the running max
    p_sum = np.add.reduceat(p64, lo_t, axis=-1) * (1 + 2.0 ** -40)
    p_lq = _lq(mn, qdtype)  # min_lq of each tile's P
    l = np.ones((c, n), np.float32)
    acc = scratch("sharedkv_acc", (c, n, d), np.float32)
    acc.fill(0)
    pv = scratch("sharedkv_pv", (c, n, d), np.float32)
    for t, (lo, hi) in enumerate(tiles):
        room = exact_room((p_sum[..., t], p_lq[..., t])).min(axis=1)  # (the P rows' room _dot_f32 reads)
        _dot_f32(p64[..., lo:hi], k64[:, lo:hi], (p_sum[..., t], p_lq[..., t]),
                 vf(t, room), out=pv)  # RN32(P @ V)  [c, N, D]
        a = a_all[..., t]
        if any_t[:, t].all():
            l = a * l + tsum[..., t]
            acc *= a[..., None]
            acc += pv
        else:
            upd = any_t[:, t, None]
            l = np.where(upd, a * l + tsum[..., t], l).astype(np.float32)
            acc = np.where(upd[..., None], a[..., None] * acc + pv, acc).astype(np.float32)
    return _finish(m, l, acc, qdtype, out_rounding)


def _round_p(e, lo_t, qdtype, p_rounding, clean, p64):
    """P = ``e`` (fp32 ``[c, N, W]``) rounded to ``qdtype`` with ``p_rounding``, written into ``p64`` (float64);
    returns per tile (first slots ``lo_t``) the minimum of P's ``magnitude bits - 1`` (16-bit; 0xFFFF for a tile
    of zeros: see :func:`_lq`). ``clean`` (e has no NaN) and bf16: rounded on e's fp32 bits in place (e then holds
    P), the magnitudes read from the fp32 bits' top halves - the values and minima of the bf16 array
    (tests/test_sharedkv.py)."""
    if clean and qdtype == "bfloat16":
        u = e.view(np.uint32)
        bits = scratch("sharedkv_pbits", e.shape, np.uint32)
        bf16_bits_inplace(u, p_rounding, bits)
        np.copyto(p64, e)
        mag1 = np.bitwise_and(u, np.uint32(0x7FFFFFFF), out=bits)
        mag1 -= np.uint32(1)  # zero wraps to 0xFFFFFFFF
        return (np.minimum.reduceat(mag1, lo_t, axis=-1).astype(np.int64) + 1 >> 16) - 1
    p16 = round_q16(e, qdtype, p_rounding)
    np.copyto(p64, p16)
    mag1 = np.bitwise_and(p16.view(np.uint16), np.uint16(0x7FFF), out=scratch("sharedkv_pmag", p16.shape, np.uint16))
    mag1 -= np.uint16(1)  # zero wraps to 0xFFFF
    return np.minimum.reduceat(mag1, lo_t, axis=-1)


def _finish(m, l, acc, qdtype, out_rounding):
    """``out = round(O / l)``, ``lse = m + RN32(ln l)`` (0 and -inf where ``l`` is not positive)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        if (l > 0).all():  # (the common case, in place)
            o = np.divide(acc, l[..., None], out=acc)
        else:
            o = np.where(l[..., None] > 0, acc / np.where(l > 0, l, np.float32(1))[..., None], np.float32(0))
        lse = np.where(l > 0, m + log_f32(np.where(l > 0, l, np.float32(1))), -np.inf).astype(np.float32)
    return round_q16(o.astype(np.float32, copy=False), qdtype, out_rounding), lse


# ----------------------------------------------------------------------------------------------------
# mixed_quant_sparse_flash_mla: the two quantised row layouts, dequantised in front of the same core
#
# quant_mode 1 (608 bytes per token; cannmirror/ops-transformer attention/mixed_quant_sparse_flash_mla/README.md):
#   [0, 128) RoPE, 64 values of the query dtype (bf16) | [128, 576) NoPE, 448 FP8 E4M3FN codes |
#   [576, 590) 7 bf16 scales, one per 64-value tile | [590, 608) pad (never read).
# quant_mode 2 (584 bytes per token, PA_BBND only): FlashMLA's MODEL1 block - every token's 448 NoPE codes + 64
#   bf16 RoPE values (576 bytes) first, then every token's 7 E8M0 tile scales + 1 pad byte
#   (qsfa.reference.flashmla_model1; a [block_num, block_size, 1, 584] tensor is one unpadded MODEL1 block per
#   block_num).
# The dequantised K row is [NoPE 448, RoPE 64] (the golden's concat([nope, rope])); q is ordered the same way.

MODE1_BYTES = 608
MODE2_BYTES = 584
QUANT_MODES = (1, 2)
_NOPE, _ROPE, _TILE = 448, 64, 64


def pack_mode1(k: np.ndarray) -> np.ndarray:
    """bf16 K rows ``[..., 512]`` ([NoPE 448, RoPE 64]) -> quant_mode 1 rows, uint8 ``[..., 608]``: per 64-value
    tile ``scale = bf16(amax / 448)`` (an all-zero tile: 1), codes ``E4M3FN_RINT(x / scale)`` (fp32 divide,
    saturating). A writer for test data; the operator only reads rows."""
    from .formats import encode

    k = np.asarray(k)
    lead = k.shape[:-1]
    x = k.reshape(-1, 512).astype(np.float32)
    nope = x[:, :_NOPE].reshape(-1, _NOPE // _TILE, _TILE)
    amax = np.abs(nope).max(axis=-1)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(_QDT["bfloat16"])
    codes = encode((nope / scale.astype(np.float32)[..., None]).reshape(-1, _NOPE), "float8_e4m3fn",
                   saturate=True, rounding="rint")
    out = np.zeros((x.shape[0], MODE1_BYTES), np.uint8)
    out[:, :128] = np.ascontiguousarray(k.reshape(-1, 512)[:, _NOPE:].astype(_QDT["bfloat16"])).view(np.uint8)
    out[:, 128:576] = codes
    out[:, 576:590] = np.ascontiguousarray(scale).view(np.uint8)
    return out.reshape(lead + (MODE1_BYTES,))


def dequant_mode1(rows: np.ndarray, k_rounding: str = "rint") -> np.ndarray:
    """quant_mode 1 rows ``[..., 608]`` (any one-byte dtype) -> bf16 ``[..., 512]``: ``decode(code) * scale``
    (exact in fp32: 4 x 8 significant bits) rounded once to bf16 with ``k_rounding``; RoPE copied."""
    from .formats import decode

    b = np.ascontiguousarray(rows).view(np.uint8)
    lead = b.shape[:-1]
    b = b.reshape(-1, MODE1_BYTES)
    vals = decode(b[:, 128:576], "float8_e4m3fn").reshape(-1, _NOPE // _TILE, _TILE)
    scale = np.ascontiguousarray(b[:, 576:590]).view(_QDT["bfloat16"]).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        prod = (vals * scale[..., None]).reshape(-1, _NOPE)
    out = np.empty((b.shape[0], 512), _QDT["bfloat16"])
    out[:, :_NOPE] = round_q16(prod, "bfloat16", k_rounding)
    out[:, _NOPE:] = np.ascontiguousarray(b[:, :128]).view(_QDT["bfloat16"])
    return out.reshape(lead + (512,))


def dequant_mode2(blocks: np.ndarray) -> np.ndarray:
    """quant_mode 2 blocks ``[block_num, block_size, 1, 584]`` -> bf16 ``[block_num, block_size, 1, 512]``
    ([NoPE 448, RoPE 64]; qsfa.reference.flashmla_model1.dequantize: exact power-of-two scaling)."""
    from .flashmla_model1 import dequantize

    b = np.ascontiguousarray(blocks).view(np.uint8)
    nb, bs = b.shape[0], b.shape[1]
    return dequantize(b.reshape(nb, bs * MODE2_BYTES), bs)


# ----------------------------------------------------------------------------------------------------
# kv_quant_sparse_attn_sharedkv (vLLM-Ascend, Ascend 950): 640-byte rows
#
# vllm-project/vllm-ascend@182b75e csrc/attention/kv_quant_sparse_attn_sharedkv/README.md: per token
#   [0, 128) RoPE, 64 bf16 values | [128, 576) NoPE, 448 FP8 E4M3FN codes | [576, 583) 7 E8M0 tile scales
#   (tile_size 64) | [583, 640) pad (never read). K NoPE = decode(code) * 2^(byte - 127): exact.

KVQ_BYTES = 640


def pack_640(k: np.ndarray) -> np.ndarray:
    """bf16 K rows ``[..., 512]`` ([NoPE 448, RoPE 64]) -> 640-byte rows (uint8): per tile the MODEL1 scale
    ``2^ceil(log2(max(amax / 448, 1e-4)))`` and E4M3FN RINT codes (qsfa.reference.flashmla_model1). Test data."""
    from .flashmla_model1 import quantize, unpack

    k = np.asarray(k)
    lead = k.shape[:-1]
    rows = k.reshape(-1, 1, 1, 512)
    codes, rope, scales = unpack(quantize(rows), 1)  # one token per block
    out = np.zeros((rows.shape[0], KVQ_BYTES), np.uint8)
    out[:, :128] = np.ascontiguousarray(rope.reshape(-1, 64)).view(np.uint8)
    out[:, 128:576] = codes.reshape(-1, 448)
    out[:, 576:583] = scales.reshape(-1, 7)
    return out.reshape(lead + (KVQ_BYTES,))


def dequant_640(rows: np.ndarray) -> np.ndarray:
    """640-byte rows ``[..., 640]`` (any one-byte dtype) -> bf16 ``[..., 512]`` ([NoPE 448, RoPE 64]):
    ``decode(code) * 2^(byte - 127)`` (exact; NaN codes / the NaN scale byte give NaN, overflow inf)."""
    from .formats import decode, encode

    b = np.ascontiguousarray(rows).view(np.uint8)
    lead = b.shape[:-1]
    b = b.reshape(-1, KVQ_BYTES)
    vals = decode(b[:, 128:576], "float8_e4m3fn").reshape(-1, 7, 64)
    s = decode(b[:, 576:583], "float8_e8m0")[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        prod = (vals * s).reshape(-1, 448)
    out = np.empty((b.shape[0], 512), np.uint16)
    out[:, :448] = np.where(np.isnan(prod), np.uint16(0x7FC0), encode(prod, "bfloat16", rounding="rint"))
    out[:, 448:] = np.ascontiguousarray(b[:, :128]).view(np.uint16)
    return out.view(_QDT["bfloat16"]).reshape(lead + (512,))
