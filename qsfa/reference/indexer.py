"""Lightning indexer oracles (docs/numerics/indexer.md#lightning_indexer): ``npu_lightning_indexer`` and ``npu_quant_lightning_indexer``.

For query row ``i`` of batch ``b`` and every KV token ``j`` the row may see (``j < min(actKV,
threshold)``, the same right-down causal rule as sparse attention, :mod:`qsfa.reference.attn_layout`):

    score(i, j) = sum_h w[i, h] * ReLU(q[i, h] . k[j])                          (lightning_indexer)
    score(i, j) = sum_h w[i, h] * ReLU((sq[i, h] * sk[j]) * (qc[i, h] . kc[j]))  (quant_lightning_indexer)

evaluated in fp32 (docs/numerics/indexer.md#lightning_indexer): the dot product of exact products accumulated in fp32, the scale product
``sq * sk`` one fp32 multiply (the doc's ``(Scale_Q @ Scale_K^T) * (Q @ K^T)``) times it, ReLU, times the fp32
weight, summed over heads in fp32. Both accumulations (``q . k`` and the sum over heads) are modelled as the
correctly rounded fp32 value of the exact sum (round to nearest even; an exact zero sum is +0), computed as in
:mod:`qsfa.reference.attention` (float64 sums proven exact or certified, exact sums where undecided), so the scores
and hence the indices are the same on every machine. The output is the indices of the ``min(sparse_count,
valid)`` largest scores in descending score order, padded with -1. Ties: **OPEN** - parameter ``tie_break``,
default ``"lower_index"`` (equal scores keep increasing token order: a stable descending sort). A kernel that
sums in fp32 in its own order lands within a few ulps of these scores and may swap near-ties.

``return_value`` (lightning_indexer): the selected scores rounded to the query dtype (RINT), shape of the
indices; padding entries hold ``-inf`` (the value of a padding entry is not documented).
A row that sees no token (BSND padding rows past actQ included) is all -1.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .attention import _dot_f32, _qdt_name, certified_f32, decode_nope, exact_sum_f32, row_facts, sum_error_bound
from .attn_layout import flat_rows, kv_map, query_rows, row_limits

__all__ = ["lightning_indexer", "lightning_indexer_scores", "quant_lightning_indexer", "top_k_desc", "TIE_BREAKS"]

TIE_BREAKS = ("lower_index",)
_QDT = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


def top_k_desc(scores: np.ndarray, k: int, n_valid: np.ndarray):
    """Per row: the indices of the ``min(k, n_valid)`` largest ``scores`` (descending, equal scores by
    increasing index) and their scores; the rest -1 / -inf. ``scores [c, S]`` float32 with invalid columns
    already ``-inf``; ``n_valid [c]``."""
    c, s = scores.shape
    kk = min(k, s)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :kk]
    vals = np.take_along_axis(scores, order, axis=1)
    take = np.arange(kk)[None, :] < np.minimum(n_valid, k)[:, None]
    idx = np.full((c, k), -1, np.int32)
    val = np.full((c, k), -np.inf, np.float32)
    idx[:, :kk] = np.where(take, order, -1)
    val[:, :kk] = np.where(take, vals, -np.inf)
    return idx, val


def _run(query_rows, key_rows, head_weights, *, rows, kvm, sparse_count, sparse_mode, chunk_size,
         key_scale_rows=None, query_scale=None):
    """Shared driver. query_rows(r) -> (q [c, N1, D], facts [c, N1]) and key_rows(flat rows) -> (k [n, D],
    facts [n]): float64 holding the 16-bit values / decoded codes (exact) and their (2-norm bound, lq) row facts
    (:func:`qsfa.reference.attention.row_facts`); head_weights(r) -> [c, N1] fp32; key_scale_rows(flat rows) ->
    [n] fp32 or None; query_scale(r) -> [c, N1] fp32 or None."""
    n_rows = rows.batch.size
    thr, limit = row_limits(rows, kvm.act_kv, sparse_mode)
    idx_out = np.full((n_rows, sparse_count), -1, np.int32)
    val_out = np.full((n_rows, sparse_count), -np.inf, np.float32)
    for b in range(rows.n_batch):  # one KV sequence at a time (its keys are gathered once)
        rb = np.nonzero((rows.batch == b) & (limit > 0))[0]
        if rb.size == 0:
            continue
        s_b = int(limit[rb].max())
        flat = kvm.storage_rows(np.full(s_b, b), np.arange(s_b))
        k, (k_norm, k_lq) = key_rows(flat)  # [S, D] float64
        kt, k_facts = k.T[None], (k_norm[None], k_lq[None])  # [1, D, S]
        ks = None if key_scale_rows is None else key_scale_rows(flat)  # [S]
        n1 = head_weights(rb[:1]).shape[1]
        step = max(1, int(chunk_size) * 64 // max(n1 * s_b, 1))
        for start in range(0, rb.size, step):
            r = rb[start:start + step]
            q, (q_norm, q_lq) = query_rows(r)
            c = r.size
            # RN32(q_h . k_j): exact products, correctly rounded sum (one float64 matmul)
            dots = _dot_f32(q.reshape(1, c * n1, -1), kt, (q_norm.reshape(1, -1), q_lq.reshape(1, -1)),
                            k_facts).reshape(c, n1, s_b)
            if ks is not None:
                dots *= query_scale(r)[:, :, None] * ks[None, None, :]  # fp32: (sq * sk) * dot
            np.maximum(dots, 0, out=dots)
            dots *= head_weights(r)[:, :, None]  # fp32
            # sum over heads: RN32 of the exact sum of the fp32 terms
            approx = np.add.reduce(dots, axis=1, dtype=np.float64)  # [c, S]
            bound = sum_error_bound(n1, np.add.reduce(np.abs(dots), axis=1, dtype=np.float64))
            sc = certified_f32(approx, bound, lambda i: exact_sum_f32(
                dots[i // s_b, :, i % s_b].astype(np.float64)))
            sc += np.float32(0)  # -0 -> +0
            sc[np.arange(s_b)[None, :] >= limit[r][:, None]] = -np.inf
            i, v = top_k_desc(sc, sparse_count, limit[r])
            idx_out[r] = i
            val_out[r] = v
    return idx_out, val_out


def _rows16(x, qdt):
    """16-bit rows -> (float64 values, row facts)."""
    x64 = x.astype(np.float64)
    return x64, row_facts(x64, x.view(np.uint16), qdt)


def _rows8(codes, fmt):
    """One-byte code rows (uint8) -> (decoded float64 values, row facts)."""
    x64 = decode_nope(codes, fmt, np.float64)
    return x64, row_facts(x64, codes, fmt)


def _shape(x, layout_query, lead):
    return x.reshape(*lead, 1, x.shape[-1])


def _lead(query, layout_query):
    return tuple(query.shape[:2]) if layout_query == "BSND" else tuple(query.shape[:1])


def lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                      block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                      pre_tokens=2**63 - 1, next_tokens=2**63 - 1, return_value=False, tie_break="lower_index",
                      chunk_size=4096):
    """Top-k token indices per query row (oracle of ``qsfa.lightning_indexer``; see the module docstring).

    query float16/bfloat16 ``[B, S1, N1, 128]`` / ``[T, N1, 128]``; key same dtype ``[B, S2, 1, 128]`` /
    ``[T2, 1, 128]`` / ``[block_count, block_size, 1, 128]``; weights ``[B, S1, N1]`` / ``[T, N1]``
    (float16 / bfloat16 / float32). Returns ``(sparse_indices int32 [B, S1, 1, K] / [T, 1, K],
    sparse_values)`` with sparse_values of the query dtype and the same shape (empty ``[0]`` unless
    return_value).
    """
    assert tie_break in TIE_BREAKS, tie_break
    lead = _lead(query, layout_query)
    rows = query_rows(layout_query, lead, actual_seq_lengths_query)
    kvm = kv_map(layout_key, key.shape, actual_seq_lengths_key, rows.n_batch, block_table)
    n1, d = query.shape[-2], query.shape[-1]
    q2 = query.reshape(-1, n1, d)
    k2 = flat_rows(key)
    w2 = weights.reshape(-1, n1)
    qname = _qdt_name(query)
    idx, val = _run(lambda r: _rows16(q2[r], qname), lambda f: _rows16(k2[f], qname),
                    lambda r: w2[r].astype(np.float32), rows=rows, kvm=kvm, sparse_count=int(sparse_count),
                    sparse_mode=sparse_mode, chunk_size=chunk_size)
    idx = _shape(idx, layout_query, lead)
    qdt = query.dtype
    if not return_value:
        return idx, np.zeros((0,), qdt)
    return idx, _shape(val, layout_query, lead).astype(qdt)  # RINT (ml_dtypes / NumPy casts)


def lightning_indexer_scores(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                             block_table=None, layout_query="BSND", layout_key="BSND", sparse_mode=3,
                             chunk_size=4096, **_ignored):
    """The fp32 score of every candidate token the indexer ranks (the ones :func:`lightning_indexer` selects its
    top-k from, same arithmetic): ``[B, S1, 1, S] / [T, 1, S]``, ``S`` the longest KV sequence, -inf where a token
    is not a candidate (beyond the row's causal limit or its sequence). The golden scores
    :func:`qsfa.compare.compare_topk` judges a top-k set against. Other indexer arguments are ignored."""
    lead = _lead(query, layout_query)
    rows = query_rows(layout_query, lead, actual_seq_lengths_query)
    kvm = kv_map(layout_key, key.shape, actual_seq_lengths_key, rows.n_batch, block_table)
    n1, d = query.shape[-2], query.shape[-1]
    q2, k2, w2 = query.reshape(-1, n1, d), flat_rows(key), weights.reshape(-1, n1)
    qname = _qdt_name(query)
    s_max = max(int(np.max(kvm.act_kv, initial=0)), 1)
    idx, val = _run(lambda r: _rows16(q2[r], qname), lambda f: _rows16(k2[f], qname),
                    lambda r: w2[r].astype(np.float32), rows=rows, kvm=kvm, sparse_count=s_max,
                    sparse_mode=sparse_mode, chunk_size=chunk_size)  # every candidate, ranked
    table = np.full(idx.shape, -np.inf, np.float32)
    r, j = np.nonzero(idx >= 0)
    table[r, idx[r, j]] = val[r, j]
    return _shape(table, layout_query, lead)


def quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode=0,
                            key_quant_mode=0, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                            block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                            sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1, query_dtype=None,
                            key_dtype=None, tie_break="lower_index", chunk_size=4096):
    """Top-k token indices from per-token-head quantised query / key (oracle of
    ``qsfa.quant_lightning_indexer``; see the module docstring).

    query / key: one-byte codes (int8, float8_e4m3fn, or uint8 HiFloat8 with query_dtype / key_dtype
    "hifloat8") shaped like :func:`lightning_indexer`'s; query_dequant_scale ``[B, S1, N1]`` / ``[T, N1]``
    and key_dequant_scale ``key.shape[:-1]`` (float16 / float32); weights float16 / bfloat16.
    Returns sparse_indices int32 ``[B, S1, 1, K]`` / ``[T, 1, K]``.
    """
    assert tie_break in TIE_BREAKS, tie_break
    qfmt = _fmt(query, query_dtype)
    kfmt = _fmt(key, key_dtype)
    lead = _lead(query, layout_query)
    rows = query_rows(layout_query, lead, actual_seq_lengths_query)
    kvm = kv_map(layout_key, key.shape, actual_seq_lengths_key, rows.n_batch, block_table)
    n1, d = query.shape[-2], query.shape[-1]
    q2 = np.ascontiguousarray(query).view(np.uint8).reshape(-1, n1, d)
    k2 = flat_rows(key.view(np.uint8))
    w2 = weights.reshape(-1, n1)
    qs2 = query_dequant_scale.reshape(-1, n1)
    ks1 = key_dequant_scale.reshape(-1)
    idx, _ = _run(lambda r: _rows8(q2[r], qfmt), lambda f: _rows8(k2[f], kfmt),
                  lambda r: w2[r].astype(np.float32), rows=rows, kvm=kvm, sparse_count=int(sparse_count),
                  sparse_mode=sparse_mode, chunk_size=chunk_size,
                  key_scale_rows=lambda f: ks1[f].astype(np.float32),
                  query_scale=lambda r: qs2[r].astype(np.float32))
    return _shape(idx, layout_query, lead)


def _fmt(a, named):
    if named is not None:
        return named
    name = np.dtype(a.dtype)
    if name == np.dtype(ml_dtypes.float8_e4m3fn):
        return "float8_e4m3fn"
    return "int8"
