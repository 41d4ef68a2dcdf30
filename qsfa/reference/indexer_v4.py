"""Oracle of the DeepSeek-V4 quantised lightning indexer over compressed keys (docs/numerics/indexer.md#vllm_quant_lightning_indexer).

vLLM-Ascend's ``npu_vllm_quant_lightning_indexer``: the key cache holds *compressed* tokens (one per
``cmp_ratio`` original tokens); ``actual_seq_lengths_key`` counts original tokens. For query row ``i`` (position
``p`` inside its batch, ``actQ`` rows, ``actKV`` original key tokens) the visible compressed tokens are
``j < n(i)`` with

    n(i) = min((actKV - actQ + p + 1) // cmp_ratio, actKV // cmp_ratio)     sparse_mode 3 (right-down causal)
    n(i) = actKV // cmp_ratio                                               sparse_mode 0

(C integer division; a negative numerator gives no token). The score follows the kernel's rounding points, which
differ by code format (and so by chip, the op_host forcing int8 on Atlas A2/A3 and FP8 E4M3FN on the 950):

int8 (A2/A3):  t_h = fp16(ReLU(q_h . k_j) * 2^-10)   (the fixpipe's DEQF16 with scale 2^-10, ReLU before it)
               u_h = fp16(w_h * sq_h)                  (vector multiply of the two float16 inputs)
               score = RN32(RN32(sum_h u_h * t_h) * sk_j)   (cube: exact fp16 products, fp32 sum over the 64 heads)
FP8 (950):     d_h = RN32(q_h . k_j),  u_h = RN32(w_h * sq_h)
               score = bf16_away(RN32(RN32(sum_h RN32(u_h * ReLU(d_h))) * sk_j))
               (the 950 kernel sorts 16-bit keys: the fp32 score cast to bfloat16 with CAST_ROUND, half away from 0)

Each fp32 sum is modelled as the correctly rounded value of the exact sum (the kernels' order is not
documented), as in :mod:`qsfa.reference.indexer`. The indices of the ``min(sparse_count, n(i))`` largest
scores come out in descending order, padded with -1; equal scores keep increasing token order (``tie_break``,
**OPEN**). ``metadata`` (the tiling of ``npu_vllm_quant_lightning_indexer_metadata``) does not change the result
and is ignored. ``return_value`` must be False (op_host); sparse_values is the empty float32 ``[0]``.
"""

from __future__ import annotations

import numpy as np

from .attention import certified_f32, decode_nope, exact_sum_f32, sum_error_bound
from .attn_layout import flat_rows, kv_map, query_rows
from .indexer import TIE_BREAKS, top_k_desc

__all__ = ["vllm_quant_lightning_indexer", "quant_lightning_indexer_v2", "quant_lightning_indexer_v2_scores",
           "visible_compressed", "visible_v2",
           "bf16_round_away", "select_top_k", "score_table", "QLI2_FORMATS", "PRECISIONS"]

_DEQ_SCALE = 2.0 ** -10  # SetFixpipePreQuantFlag(0x3a800000)
#: quant_lightning_indexer_v2's quant_mode -> code format (op_host: 2 int8 on A2/A3; 1 FP8 E4M3FN, 4 HiFloat8 on 950)
QLI2_FORMATS = {2: "int8", 1: "float8_e4m3fn", 4: "hifloat8"}
PRECISIONS = ("faithful", "exact")


def visible_compressed(rows, act_kv_orig: np.ndarray, sparse_mode: int, cmp_ratio: int) -> np.ndarray:
    """Per query row: the number of compressed key tokens it sees (``n(i)`` of the module docstring)."""
    akv = act_kv_orig[rows.batch]
    full = akv // cmp_ratio
    if sparse_mode == 3:
        num = akv - rows.act_q[rows.batch] + rows.pos + 1
        n = np.where(num > 0, num // cmp_ratio, 0)  # C division: a negative numerator -> <= 0
        n = np.minimum(n, full)
    else:
        n = full
    return np.where(rows.valid, np.clip(n, 0, None), 0).astype(np.int64)


def bf16_round_away(x: np.ndarray) -> np.ndarray:
    """float32 -> the float32 value of its bfloat16 rounding, ties away from zero (CAST_ROUND)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    out = ((bits + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)
    return np.where(np.isfinite(x), out, x).astype(np.float32)


def _exact_rows(terms: np.ndarray) -> np.ndarray:
    """RN32 of the exact sum over axis 1 of ``terms [c, n, s]`` (every term an exact float64 value): [c, s]."""
    c, n, s = terms.shape
    approx = np.add.reduce(terms, axis=1, dtype=np.float64)
    bound = sum_error_bound(n, np.add.reduce(np.abs(terms), axis=1, dtype=np.float64))
    out = certified_f32(approx, bound, lambda i: exact_sum_f32(terms[i // s, :, i % s].astype(np.float64)))
    return out + np.float32(0)  # -0 -> +0


def _dots(q, k, fmt):
    """``q_h . k_j`` of query codes ``q [c, N1, D]`` and key codes ``k [S, D]`` (uint8 views): the exact values
    (float64) for int8 / FP8 E4M3FN, whose 128-term sums are exact in float64 (at most 51 significant bits), and
    for HiFloat8 (a span of 2^75 between its smallest and largest products) their fp32 roundings RN32, certified
    and completed by an exact sum where float64 cannot decide."""
    qd = decode_nope(q, fmt, np.float64)
    kd = decode_nope(k, fmt, np.float64)
    dots = np.einsum("chd,sd->chs", qd, kd)
    if fmt != "hifloat8":
        return dots
    bound = sum_error_bound(qd.shape[-1], np.einsum("chd,sd->chs", np.abs(qd), np.abs(kd)))
    c, h, s = dots.shape

    def exact(i):
        ci, hi, si = i // (h * s), (i // s) % h, i % s
        return exact_sum_f32(qd[ci, hi, :] * kd[si, :])  # HiFloat8 x HiFloat8: exact in float64

    return certified_f32(dots, bound, exact).astype(np.float64)


def _scores(q, k, w, sq, sk, fmt, precision="faithful"):
    """Scores ``[c, S]`` for query codes ``q [c, N1, D]``, key codes ``k [S, D]`` (uint8 views), weights / query
    scales ``[c, N1]`` and key scales ``[S]`` in their stored dtypes. ``precision="exact"``: the float64 value of
    ``sum_h w_h sq_h ReLU(q_h . k_j) sk_j`` with no rounding point (float64 [c, S])."""
    dots = _dots(q, k, fmt)
    if precision == "exact":
        u = w.astype(np.float64) * sq.astype(np.float64)
        return np.einsum("ch,chs->cs", u, np.maximum(dots, 0.0)) * sk.astype(np.float64)[None, :]
    if fmt == "int8":
        t = np.maximum(dots, 0.0) * _DEQ_SCALE
        t = t.astype(np.float16).astype(np.float64)  # DEQF16 (RN)
        u = (w.astype(np.float16) * sq.astype(np.float16)).astype(np.float64)  # fp16 multiply (RN)
        terms = u[:, :, None] * t  # fp16 x fp16: exact in fp32 and float64
    else:
        d = dots.astype(np.float32)
        u = w.astype(np.float32) * sq.astype(np.float32)
        terms = (u[:, :, None] * np.maximum(d, np.float32(0))).astype(np.float64)  # fp32 products (RN)
    s = _exact_rows(terms)
    score = s * sk.astype(np.float32)[None, :]
    if fmt != "int8":
        score = bf16_round_away(score)
    return score


def select_top_k(rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, k_out, *, chunk_rows=64, precision="faithful"):
    """The shared core of the V4 indexers: per query row of ``rows`` (:class:`~qsfa.reference.attn_layout.QueryRows`)
    the indices of the ``min(k_out, limit)`` best of its first ``limit`` compressed key tokens (-1 padded).
    ``row_of(b, j)``: flat storage rows of tokens ``j`` of batch ``b``; ``q2 [R, N1, D]`` / ``k2`` (uint8 code
    views), ``w2`` / ``qs2 [R, N1]``, ``ks1`` (flat per storage row) in their stored dtypes."""
    idx_out = np.full((rows.batch.size, k_out), -1, np.int32)
    for b in range(rows.n_batch):
        rb = np.nonzero((rows.batch == b) & (limit > 0))[0]
        if rb.size == 0:
            continue
        s_b = int(limit[rb].max())
        flat = row_of(b, np.arange(s_b))
        kb, ksb = k2[flat], ks1[flat]
        for start in range(0, rb.size, chunk_rows):
            r = rb[start:start + chunk_rows]
            sc = _scores(q2[r], kb, w2[r], qs2[r], ksb, fmt, precision)
            sc[np.arange(s_b)[None, :] >= limit[r][:, None]] = -np.inf
            idx_out[r], _ = top_k_desc(sc, k_out, limit[r])
    return idx_out


def score_table(rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, *, dtype, chunk_rows=64, precision="faithful"):
    """The scores :func:`select_top_k` ranks, ``[R, S]`` in ``dtype`` (S the most tokens any row sees, at least 1),
    ``-inf`` past a row's visible tokens: what ``qsfa.compare.compare_topk`` needs to judge a device's indices fair
    to ties (docs/numerics/comparison.md#top-k-criterion)."""
    out = np.full((rows.batch.size, max(1, int(limit.max(initial=0)))), -np.inf, dtype)
    for b in range(rows.n_batch):
        rb = np.nonzero((rows.batch == b) & (limit > 0))[0]
        if rb.size == 0:
            continue
        s_b = int(limit[rb].max())
        flat = row_of(b, np.arange(s_b))
        kb, ksb = k2[flat], ks1[flat]
        for start in range(0, rb.size, chunk_rows):
            r = rb[start:start + chunk_rows]
            sc = _scores(q2[r], kb, w2[r], qs2[r], ksb, fmt, precision).astype(dtype)
            sc[np.arange(s_b)[None, :] >= limit[r][:, None]] = -np.inf
            out[r, :s_b] = sc
    return out


def vllm_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode=0,
                                 key_quant_mode=0, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                                 block_table=None, metadata=None, layout_query="BSND", layout_key="PA_BSND",
                                 sparse_count=2048, sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1,
                                 cmp_ratio=1, return_value=False, tie_break="lower_index", chunk_rows=64):
    """Top-k compressed-token indices per query row (see the module docstring).

    query int8 / float8_e4m3fn ``[B, S1, 64, 128]`` (BSND) or ``[T, 64, 128]`` (TND); key of the same dtype
    ``[block_count, block_size, 1, 128]`` (PA_BSND, compressed tokens); weights and query_dequant_scale
    ``query.shape[:-1]``; key_dequant_scale ``key.shape[:-1]``. Returns ``(sparse_indices int32
    [B, S1, 1, K] / [T, 1, K], sparse_values float32 [0])``.
    """
    assert tie_break in TIE_BREAKS, tie_break
    assert not return_value
    rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, lead = _vllm_inputs(
        query, key, weights, query_dequant_scale, key_dequant_scale, actual_seq_lengths_query,
        actual_seq_lengths_key, block_table, layout_query, layout_key, sparse_mode, cmp_ratio)
    k_out = int(sparse_count)
    idx_out = select_top_k(rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, k_out, chunk_rows=chunk_rows)
    idx = idx_out.reshape(*lead, 1, k_out)
    return idx, np.zeros((0,), np.float32)


def _vllm_inputs(query, key, weights, query_dequant_scale, key_dequant_scale, actual_seq_lengths_query,
                 actual_seq_lengths_key, block_table, layout_query, layout_key, sparse_mode, cmp_ratio):
    """What :func:`select_top_k` / :func:`score_table` read, for the vLLM-Ascend front door's arguments."""
    fmt = "int8" if np.dtype(query.dtype) == np.int8 else "float8_e4m3fn"
    cmp_ratio = int(cmp_ratio)
    lead = tuple(query.shape[:2]) if layout_query == "BSND" else tuple(query.shape[:1])
    rows = query_rows(layout_query, lead, actual_seq_lengths_query)
    act_orig = np.asarray(actual_seq_lengths_key, np.int64).reshape(-1)
    kvm = kv_map(layout_key, key.shape, act_orig // cmp_ratio, rows.n_batch, block_table)
    n1, d = query.shape[-2], query.shape[-1]
    q2 = np.ascontiguousarray(query).view(np.uint8).reshape(-1, n1, d)
    k2 = flat_rows(np.ascontiguousarray(key).view(np.uint8))
    w2, qs2, ks1 = weights.reshape(-1, n1), query_dequant_scale.reshape(-1, n1), key_dequant_scale.reshape(-1)
    limit = visible_compressed(rows, act_orig, sparse_mode, cmp_ratio)
    return rows, lambda b, j: kvm.storage_rows(np.full(j.size, b), j), q2, k2, w2, qs2, ks1, limit, fmt, lead



def visible_v2(rows, s2: np.ndarray, residual: np.ndarray, mask_mode: int, cmp_ratio: int) -> np.ndarray:
    """quant_lightning_indexer_v2, per query row: the compressed key tokens it sees. ``s2 [B]`` counts compressed
    tokens, ``residual [B]`` the original tokens past the last complete one (cmp_residual_k, 0 when None): the
    original length is ``s2 * cmp_ratio + residual`` and mask_mode 3 gives
    ``min(floor((s2 * cmp_ratio + residual - actQ + p + 1) / cmp_ratio), s2)`` (none for a negative numerator)."""
    s2b = s2[rows.batch]
    if mask_mode == 3:
        num = s2b * cmp_ratio + residual[rows.batch] - rows.act_q[rows.batch] + rows.pos + 1
        n = np.minimum(np.where(num > 0, num // cmp_ratio, 0), s2b)
    else:
        n = s2b
    return np.where(rows.valid, np.clip(n, 0, None), 0).astype(np.int64)


def _ints(a):
    return None if a is None else np.asarray(a, np.int64).reshape(-1)


def _v2_inputs(query, key, weights, query_dequant_scale, key_dequant_scale, quant_mode, cu_seqlens_q, cu_seqlens_k,
               seqused_q, seqused_k, cmp_residual_k, block_table, layout_q, layout_k, mask_mode, cmp_ratio):
    """quant_lightning_indexer_v2's arguments as the core's: (rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, lead)."""
    fmt = QLI2_FORMATS[int(quant_mode)]
    cmp_ratio = int(cmp_ratio)
    n1, d = query.shape[-2], query.shape[-1]
    if layout_q == "BSND":
        lead = tuple(query.shape[:2])
        rows = query_rows("BSND", lead, seqused_q)
    else:
        lead = tuple(query.shape[:1])
        rows = query_rows("TND", lead, _ints(cu_seqlens_q)[1:])
    nb = rows.n_batch
    if layout_k == "TND":
        kvm = kv_map("TND", key.shape, _ints(cu_seqlens_k)[1:], nb)
    elif layout_k == "BSND":
        kvm = kv_map("BSND", key.shape, _ints(seqused_k), nb)
    else:
        kvm = kv_map("PA_BSND", key.shape, _ints(seqused_k), nb, block_table)
    residual = np.zeros(nb, np.int64) if cmp_residual_k is None else _ints(cmp_residual_k)
    limit = visible_v2(rows, kvm.act_kv, residual, int(mask_mode), cmp_ratio)
    q2 = np.ascontiguousarray(query).view(np.uint8).reshape(-1, n1, d)
    k2 = np.ascontiguousarray(key).view(np.uint8).reshape(-1, d)
    w2 = np.asarray(weights).reshape(-1, n1)
    qs = np.asarray(query_dequant_scale).reshape(-1)
    qs2 = np.broadcast_to(qs[:1], w2.shape) if fmt == "hifloat8" else qs.reshape(-1, n1)
    ks1 = np.asarray(key_dequant_scale).reshape(-1)
    if fmt == "hifloat8":
        ks1 = np.broadcast_to(ks1[:1], (k2.shape[0],))
    return rows, (lambda b, j: kvm.storage_rows(np.full(j.size, b), j)), q2, k2, w2, qs2, ks1, limit, fmt, lead


_V2_LAYOUT_ARGS = ("quant_mode", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "cmp_residual_k",
                   "block_table", "layout_q", "layout_k", "mask_mode", "cmp_ratio")


def quant_lightning_indexer_v2(query, key, weights, query_dequant_scale, key_dequant_scale, topk, quant_mode, *,
                               cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                               cmp_residual_k=None, block_table=None, output_idx_offset=None, metadata=None,
                               max_seqlen_q=-1, layout_q="BSND", layout_k="BSND", mask_mode=0, cmp_ratio=1,
                               return_value=0, tie_break="lower_index", precision="faithful", chunk_rows=64):
    """ops-transformer's QuantLightningIndexerV2 (docs/numerics/indexer.md#quant_lightning_indexer_v2): the
    computation of :func:`vllm_quant_lightning_indexer` (the same :func:`select_top_k` core and score rounding
    per format) with the V4 names - query rows from ``cu_seqlens_q`` (TND) or ``seqused_q`` (BSND), compressed
    key lengths from ``seqused_k`` (PA_BBND, BSND) or ``cu_seqlens_k`` (TND), the original length
    ``seqused_k * cmp_ratio + cmp_residual_k`` - and HiFloat8 codes (quant_mode 4, uint8, per-tensor ``[1]``
    scales). Returns ``(sparse_indices int32 [B, S1, 1, topk] / [T, 1, topk], sparse_values bfloat16 [0])``;
    ``metadata`` and ``max_seqlen_q`` do not change the result and are ignored."""
    import ml_dtypes

    assert tie_break in TIE_BREAKS, tie_break
    assert precision in PRECISIONS, precision
    assert not return_value and output_idx_offset is None
    rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, lead = _v2_inputs(
        query, key, weights, query_dequant_scale, key_dequant_scale, quant_mode, cu_seqlens_q, cu_seqlens_k,
        seqused_q, seqused_k, cmp_residual_k, block_table, layout_q, layout_k, mask_mode, cmp_ratio)
    k_out = int(topk)
    idx = select_top_k(rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, k_out, chunk_rows=chunk_rows,
                       precision=precision)
    return idx.reshape(*lead, 1, k_out), np.zeros((0,), ml_dtypes.bfloat16)


def quant_lightning_indexer_v2_scores(query, key, weights, query_dequant_scale, key_dequant_scale, quant_mode,
                                      precision="faithful", **kw):
    """The reference's score of every candidate compressed token per query row, ``[B, S1, 1, S] / [T, 1, S]`` (S the
    largest visible count, at least 1; -inf past a row's visible tokens): what ``qsfa.compare.compare_topk`` needs
    to judge a device's indices fair to ties (docs/numerics/comparison.md#top-k-criterion). ``kw``: the other
    arguments of :func:`quant_lightning_indexer_v2` (those that do not place tokens are ignored)."""
    args = {k: kw.get(k) for k in _V2_LAYOUT_ARGS}
    args.update(layout_q=kw.get("layout_q", "BSND"), layout_k=kw.get("layout_k", "BSND"),
                mask_mode=kw.get("mask_mode", 0), cmp_ratio=kw.get("cmp_ratio", 1), quant_mode=quant_mode)
    rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, lead = _v2_inputs(
        query, key, weights, query_dequant_scale, key_dequant_scale, **args)
    out = score_table(rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, dtype=np.float64, precision=precision)
    return out.reshape(*lead, 1, out.shape[-1])


def vllm_quant_lightning_indexer_scores(query, key, weights, query_dequant_scale, key_dequant_scale,
                                        query_quant_mode=0, key_quant_mode=0, *, actual_seq_lengths_query=None,
                                        actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                                        layout_key="PA_BSND", sparse_mode=3, cmp_ratio=1, chunk_rows=64, **_):
    """The score of every compressed candidate that :func:`vllm_quant_lightning_indexer` ranks (the same rounding
    points), ``-inf`` where a row does not see the token: float32 ``[*lead, 1, S]`` with S the most compressed tokens
    any row sees (at least 1), the indices' leading dimensions; for the tie-fair top-k criterion
    (qsfa.compare.compare_topk) of ``golden compare --chain``."""
    rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, lead = _vllm_inputs(
        query, key, weights, query_dequant_scale, key_dequant_scale, actual_seq_lengths_query,
        actual_seq_lengths_key, block_table, layout_query, layout_key, sparse_mode, cmp_ratio)
    out = score_table(rows, row_of, q2, k2, w2, qs2, ks1, limit, fmt, dtype=np.float32, chunk_rows=chunk_rows)
    return out.reshape(*lead, 1, out.shape[-1])
