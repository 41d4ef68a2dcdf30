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

    All or nothing, as every operator: a call that any step refuses leaves ``kv_cache`` and ``index_cache``
    byte-identical. The two writers' contracts are checked on the caller's caches first (read-only, aliased or
    mistyped caches, bad slots, scalars); then every step runs on scratch copies of the two caches - the indexer
    and QSFA read what the writers wrote, so their contracts (block_table, lengths, heads, sparse_count,
    scale_value, precision, ...) can only be checked after the writes - and only when the last step has
    succeeded are the copies written into the caller's caches (the cost: one copy of each cache).
    """
    import qsfa
    from .._dispatch import check_call

    write_kv = dict(kv=kv, gamma=gamma, cos=cos, sin=sin, slot_mapping=slot_mapping, epsilon=epsilon,
                    rope_head_dim=rope_head_dim, key_dtype=key_dtype, backend=backend)
    write_index = dict(index_key=index_key, slot_mapping=slot_mapping, backend=backend)
    with _named(_SCATTER):
        _check_writers(check_call, write_kv, kv_cache, write_index, index_cache)

    kv_scratch, index_scratch = _scratch(kv_cache), _scratch(index_cache)
    qsfa.c8_rmsnorm_rope_cache(kv_cache=kv_scratch, **write_kv)
    qsfa.scatter_by_slot(index_scratch, index_key, slot_mapping, backend=backend)
    with _named(_INDEXER):
        sparse_indices, _ = qsfa.lightning_indexer(
            index_query, index_scratch, weights, actual_seq_lengths_query=actual_seq_lengths_query,
            actual_seq_lengths_key=actual_seq_lengths_kv, block_table=block_table, layout_query=layout_query,
            layout_key="PA_BSND", sparse_count=sparse_count, sparse_mode=sparse_mode, backend=backend)
    with _named(_QSFA):
        out, mx, sm = qsfa.kv_quant_sparse_flash_attention(
            query, kv_scratch, kv_scratch, sparse_indices, scale_value, block_table=block_table,
            actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
            layout_query=layout_query, layout_kv="PA_BSND", sparse_mode=sparse_mode, rope_head_dim=rope_head_dim,
            return_softmax_lse=return_softmax_lse, key_dtype=key_dtype, backend=backend, precision=precision,
            probability_rounding=probability_rounding)
    _commit(kv_cache, kv_scratch)
    _commit(index_cache, index_scratch)
    return out, mx, sm, sparse_indices


#: a step's parameter -> the pipeline's parameter it receives (an error names what the caller passed)
_SCATTER = {"cache": "index_cache", "rows": "index_key"}
_INDEXER = {"query": "index_query", "key": "index_cache", "actual_seq_lengths_key": "actual_seq_lengths_kv"}
_QSFA = {"key": "kv_cache", "value": "kv_cache"}


class _named:
    """Re-raise a step's InvalidArgument / InvalidDtype naming the pipeline's parameter instead of the step's."""

    def __init__(self, names):
        self.names = names

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        from .._errors import InvalidArgument, InvalidDtype

        if isinstance(e, (InvalidArgument, InvalidDtype)) and e.param in self.names:
            raise type(e)(e.kind, self.names[e.param], e.actual, e.reason, constraint_id=e.constraint_id) from None
        return False


def _check_writers(check_call, write_kv, kv_cache, write_index, index_cache):
    """The writers' contracts on the caller's caches (nothing computed or written), and the two caches distinct."""
    from .._arrays import is_torch
    from .._buffers import shares_memory, tensors_may_share
    from .._errors import InvalidArgument, Raw

    backend = write_kv["backend"]
    check_call("c8_rmsnorm_rope_cache", {**{k: v for k, v in write_kv.items() if k != "backend"},
                                         "kv_cache": kv_cache, "scale_order": None, "dst_type_max": None}, backend)
    check_call("scatter_by_slot", {"cache": index_cache, "rows": write_index["index_key"],
                                   "slot_mapping": write_index["slot_mapping"]}, backend)
    if is_torch(kv_cache) and is_torch(index_cache):
        shared = tensors_may_share(kv_cache, index_cache)
    else:
        shared = not is_torch(kv_cache) and not is_torch(index_cache) and shares_memory(kv_cache, index_cache)
    if shared:
        raise InvalidArgument("value", "index_cache", Raw("shares memory with kv_cache"),
                              "the two caches the pipeline writes must not share memory")


def _scratch(cache):
    """A private copy of a cache (same kind, device and layout) that the steps write first."""
    from .._arrays import is_torch

    return cache.clone() if is_torch(cache) else cache.copy()


def _commit(cache, scratch):
    """Write a scratch copy back into the caller's cache."""
    from .._arrays import is_torch

    if is_torch(cache):
        cache.copy_(scratch)
    else:
        cache[...] = scratch
