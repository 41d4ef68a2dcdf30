"""Token selection and layout arithmetic shared by sparse attention (SFA/QSFA) and the lightning indexer.

Everything here is integer bookkeeping on small arrays (one entry per query row, or per index entry of a
chunk of rows); the floating-point work lives in :mod:`qsfa.reference.attention` and
:mod:`qsfa.reference.indexer`.

Layouts (docs/numerics/attention.md#layouts, seed 000):

* query ``BSND`` ``[B, Q_S, N, D]`` (row ``r = b * Q_S + i``) or ``TND`` ``[Q_T, N, D]`` with
  ``actual_seq_lengths_query`` as prefix sums (row ``r`` belongs to the batch whose prefix range holds it).
* key ``BSND`` ``[B, KV_S, 1, D]``, ``TND`` ``[KV_T, 1, D]`` (prefix sums) or ``PA_BSND``
  ``[block_num, block_size, 1, D]`` with ``block_table [B, max_blocks]``: token ``j`` of batch ``b`` lives
  at block ``block_table[b, j // block_size]``, row ``j % block_size``.

Token selection for query row ``i`` of batch ``b`` (``actQ``, ``actKV`` = that batch's lengths):

* ``threshold = actKV - actQ + i + 1`` (sparse_mode 3, right-down causal) or ``actKV`` (sparse_mode 0);
* only the first ``min(sparse_size, ceil(threshold / sbs))`` index entries are read (none when
  ``threshold <= 0``), and reading stops at the first negative entry (-1);
* entry ``t`` selects tokens ``[t * sbs, t * sbs + sbs)`` clipped to ``[0, min(actKV, threshold))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["QueryRows", "KvMap", "query_rows", "kv_map", "row_limits", "selected_tokens", "flat_rows"]


@dataclass
class QueryRows:
    """Per query row: its batch, its position inside the batch and whether it is a real (not padding) row."""

    batch: np.ndarray  # int64 [R]
    pos: np.ndarray  # int64 [R], position i inside the batch (0 for padding rows)
    valid: np.ndarray  # bool [R], False for BSND rows past actQ and TND rows past the last prefix sum
    act_q: np.ndarray  # int64 [B], per-batch query lengths
    n_batch: int


@dataclass
class KvMap:
    """Per batch KV lengths and the map (batch, token) -> flat row of the key storage."""

    act_kv: np.ndarray  # int64 [B]
    layout: str
    start: np.ndarray | None = None  # TND: first flat row of each batch
    seq: int = 0  # BSND: KV_S
    block_table: np.ndarray | None = None  # PA: int64 [B, max_blocks]
    block_size: int = 0

    def storage_rows(self, batch: np.ndarray, tok: np.ndarray) -> np.ndarray:
        """Flat row index (into ``key.reshape(-1, D)``) of token ``tok`` of batch ``batch`` (broadcast).

        ``tok`` must already be clipped to valid tokens (callers replace invalid ones by 0)."""
        batch = np.asarray(batch, dtype=np.int64)
        tok = np.asarray(tok, dtype=np.int64)
        if self.layout == "PA_BSND":
            blk = self.block_table[batch, tok // self.block_size]
            return blk * self.block_size + tok % self.block_size
        if self.layout == "TND":
            return self.start[batch] + tok
        return batch * self.seq + tok


def _i64(a) -> np.ndarray:
    return np.asarray(a).astype(np.int64, copy=False).reshape(-1)


def query_rows(layout_query: str, n_rows_or_shape, actual_seq_lengths_query) -> QueryRows:
    """Row bookkeeping for a query of ``layout_query``.

    ``n_rows_or_shape``: the query's leading shape ``(B, Q_S)`` for BSND or ``(Q_T,)`` for TND.
    ``actual_seq_lengths_query``: per-batch lengths (BSND; ``None`` = ``Q_S``) or prefix sums (TND).
    """
    if layout_query == "BSND":
        b, s = (int(x) for x in n_rows_or_shape[:2])
        act_q = np.full(b, s, np.int64) if actual_seq_lengths_query is None else _i64(actual_seq_lengths_query)
        batch = np.repeat(np.arange(b, dtype=np.int64), s)
        pos = np.tile(np.arange(s, dtype=np.int64), b)
        valid = pos < act_q[batch]
        return QueryRows(batch, pos, valid, act_q, b)
    (t,) = (int(x) for x in n_rows_or_shape[:1])
    ends = _i64(actual_seq_lengths_query)
    starts = np.concatenate([[0], ends[:-1]]) if ends.size else ends
    act_q = ends - starts
    r = np.arange(t, dtype=np.int64)
    batch = np.searchsorted(ends, r, side="right").astype(np.int64)
    valid = batch < ends.size
    batch_c = np.minimum(batch, max(ends.size - 1, 0))
    pos = np.where(valid, r - (starts[batch_c] if ends.size else 0), 0)
    return QueryRows(np.where(valid, batch_c, 0), pos, valid, act_q, int(ends.size))


def kv_map(layout_kv: str, key_shape, actual_seq_lengths_kv, n_batch: int, block_table=None) -> KvMap:
    """KV bookkeeping for a key of ``layout_kv`` and leading shape ``key_shape`` (see module docstring)."""
    if layout_kv == "PA_BSND":
        bt = np.asarray(block_table).astype(np.int64)
        return KvMap(_i64(actual_seq_lengths_kv), "PA_BSND", block_table=bt, block_size=int(key_shape[1]))
    if layout_kv == "TND":
        ends = _i64(actual_seq_lengths_kv)
        starts = np.concatenate([[0], ends[:-1]]) if ends.size else ends
        return KvMap(ends - starts, "TND", start=starts)
    s = int(key_shape[1])
    act = np.full(n_batch, s, np.int64) if actual_seq_lengths_kv is None else _i64(actual_seq_lengths_kv)
    return KvMap(act, "BSND", seq=s)


def row_limits(rows: QueryRows, act_kv: np.ndarray, sparse_mode: int):
    """Per row ``(threshold, limit)``: the causal threshold and ``limit = min(actKV, threshold)`` (>= 0).

    Padding rows get threshold 0 (they see nothing)."""
    akv = act_kv[rows.batch]
    if sparse_mode == 3:
        thr = akv - rows.act_q[rows.batch] + rows.pos + 1
    else:
        thr = akv.copy()
    thr = np.where(rows.valid, thr, 0)
    return thr, np.clip(np.minimum(akv, thr), 0, None)


def selected_tokens(indices: np.ndarray, threshold: np.ndarray, limit: np.ndarray, sparse_block_size: int):
    """Tokens selected by ``indices [c, K]`` for rows with ``threshold`` / ``limit`` ``[c]``.

    Returns ``(tok int64 [c, K * sbs], valid bool [c, K * sbs])``; ``tok`` is 0 where not valid. Column
    ``t * sbs + u`` is token ``indices[:, t] * sbs + u``.
    """
    sbs = int(sparse_block_size)
    idx = np.asarray(indices).astype(np.int64, copy=False)
    c, k = idx.shape
    n_read = np.where(threshold > 0, np.minimum(k, -(-threshold // sbs)), 0)
    neg = idx < 0
    first_neg = np.where(neg.any(axis=1), neg.argmax(axis=1), k)
    n_read = np.minimum(n_read, first_neg)
    entry_ok = np.arange(k)[None, :] < n_read[:, None]
    if sbs == 1:
        tok = idx
        ok = entry_ok
    else:
        tok = (idx[:, :, None] * sbs + np.arange(sbs)[None, None, :]).reshape(c, k * sbs)
        ok = np.repeat(entry_ok, sbs, axis=1)
    valid = ok & (tok >= 0) & (tok < limit[:, None])
    return np.where(valid, tok, 0), valid


class _RowGather:
    """``a.reshape(-1, D)[ids]`` for an ``a`` whose strides allow no 2-D view (a view of a bigger cache, a
    broadcast one): gathers only the rows asked for."""

    def __init__(self, a: np.ndarray):
        self.a, self.lead = a, a.shape[:-1]

    def __getitem__(self, ids):
        ids = np.asarray(ids, np.int64)
        rows = self.a[np.unravel_index(ids.reshape(-1), self.lead)]
        return rows.reshape(ids.shape + self.a.shape[-1:])


def flat_rows(a: np.ndarray):
    """Row access ``[flat row id] -> row`` to the rows ``[..., D]`` of a KV array: a 2-D view of ``a`` when its
    strides allow one (``a.reshape(-1, D)`` without a copy), else an indexer that gathers just the rows indexed, so a
    cache that is a strided or broadcast view of a bigger tensor is never copied whole."""
    lead = [(n, st) for n, st in zip(a.shape[:-1], a.strides[:-1]) if n != 1]  # (size-1 axes never matter)
    if any(n == 0 for n, _ in lead) or all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1)):
        return a.reshape(-1, a.shape[-1])  # the leading axes merge into one: a view (checked before: no copy)
    return _RowGather(a)
