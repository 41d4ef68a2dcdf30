"""The C8 sparse-attention pipeline of vLLM-Ascend's SFA layer, end to end, as one plain function.

latent KV -> C8 cache writer (RMSNorm + RoPE + int8/FP8 tile quant + pack + scatter) -> lightning indexer
(top-k over the indexer-key cache) -> QSFA over the packed cache with the indexer's indices.

It calls the public, validating operators (``qsfa.c8_rmsnorm_rope_cache``, ``qsfa.scatter_by_slot``,
``qsfa.lightning_indexer``, ``qsfa.kv_quant_sparse_flash_attention``) with one ``backend``, so every step
is checked by its contract and the same call exercises a kernel backend stage by stage. Use it to make
realistic inputs: caches written by the real writer, indices that really come from an indexer.
"""

from __future__ import annotations

__all__ = ["c8_pipeline"]


def c8_pipeline(query, kv, gamma, cos, sin, index_query, index_key, weights, slot_mapping, kv_cache, index_cache,
                block_table, actual_seq_lengths_query, actual_seq_lengths_kv, *, scale_value, epsilon=1e-6,
                rope_head_dim=64, key_dtype="int8", sparse_count=2048, sparse_mode=3, layout_query="TND",
                return_softmax_lse=False, backend="reference", precision="faithful",
                probability_rounding="unnormalised"):
    """Write this step's tokens into the caches, select tokens with the indexer, attend with QSFA.

    Parameters (one paged cache pair shared by all batches, ``layout_kv = layout_key = "PA_BSND"``):
      query:        ``[T_q, Q_N, 512 + rope]`` (TND) or ``[B, S, Q_N, 512 + rope]`` (BSND), float16 / bfloat16.
      kv, gamma, cos, sin: the latent KV ``[T_new, 512 + rope]`` of the new tokens and the RMSNorm weight /
                    RoPE tables, as :func:`qsfa.c8_rmsnorm_rope_cache` takes them.
      index_query:  ``[T_q, N1, 128]`` / ``[B, S, N1, 128]`` indexer query (query dtype).
      index_key:    ``[T_new, 1, 128]`` indexer keys of the new tokens (index_cache's dtype).
      weights:      ``[T_q, N1]`` / ``[B, S, N1]`` indexer head weights.
      slot_mapping: ``[T_new]`` global slots of the new tokens (-1 skips), for both caches.
      kv_cache:     ``[block_num, block_size, 1, 656 | 528]`` one-byte packed cache (updated in place).
      index_cache:  ``[block_num, block_size, 1, 128]`` float16 / bfloat16 indexer-key cache (updated in place).
      block_table, actual_seq_lengths_query (prefix sums for TND), actual_seq_lengths_kv (per-batch lengths
                    after this step's tokens): as the attention operators.
      scale_value, rope_head_dim, key_dtype ("int8" / "float8_e4m3fn"), sparse_count (indexer top-k),
      sparse_mode, return_softmax_lse, precision, probability_rounding: passed on.
      epsilon:      RMSNorm eps of the cache writer.
      backend:      used for every step.
    Returns ``(attention_out, softmax_max, softmax_sum, sparse_indices)``.
    """
    import qsfa

    qsfa.c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slot_mapping, kv_cache, epsilon=epsilon,
                               rope_head_dim=rope_head_dim, key_dtype=key_dtype, backend=backend)
    qsfa.scatter_by_slot(index_cache, index_key, slot_mapping, backend=backend)
    sparse_indices, _ = qsfa.lightning_indexer(
        index_query, index_cache, weights, actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_kv, block_table=block_table, layout_query=layout_query,
        layout_key="PA_BSND", sparse_count=sparse_count, sparse_mode=sparse_mode, backend=backend)
    out, mx, sm = qsfa.kv_quant_sparse_flash_attention(
        query, kv_cache, kv_cache, sparse_indices, scale_value, block_table=block_table,
        actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
        layout_query=layout_query, layout_kv="PA_BSND", sparse_mode=sparse_mode, rope_head_dim=rope_head_dim,
        return_softmax_lse=return_softmax_lse, key_dtype=key_dtype, backend=backend, precision=precision,
        probability_rounding=probability_rounding)
    return out, mx, sm, sparse_indices
