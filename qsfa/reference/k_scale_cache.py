"""``scatter_pa_kv_cache_with_k_scale`` (Ascend 950): FP8 K / V and the per-head fp32 K scale written by slot into
BNBD paged caches. Documented in ``docs/numerics/cache-writers.md#scatter_pa_kv_cache_with_k_scale``.

Source: cannmirror/ops-transformer@7904813 ``attention/scatter_pa_kv_cache_with_k_scale/``
(``op_kernel/arch35/scatter_pa_kv_cache_with_k_scale_simt.h``: one element per thread,
``cache[slot // block_size, head, slot % block_size, elem] = key[token, head, elem]``; a slot below 0 or at / above
``num_blocks * block_size`` skips its token; ``op_api/aclnn_scatter_pa_kv_cache_with_k_scale.cpp``: dtypes and ranks)
and its Python page ``docs/scatter_pa_kv_cache_with_k_scale.md``. A pure byte copy: no rounding anywhere.
"""

from __future__ import annotations

import numpy as np

__all__ = ["valid_slots", "scatter_pa_kv_cache_with_k_scale"]


def valid_slots(slot_mapping, num_slots: int) -> np.ndarray:
    """Boolean mask of the tokens the kernel writes: ``0 <= slot < num_slots``."""
    s = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
    return (s >= 0) & (s < num_slots)


def scatter_pa_kv_cache_with_k_scale(key, value, key_cache, value_cache, slot_mapping, key_scale, key_scale_cache,
                                     *, cache_layout: str = "BNBD"):
    """Write ``key [T, N, Dk]``, ``value [T, N, Dv]`` and ``key_scale [T, N]`` into ``key_cache [nb, N, bs, Dk]``,
    ``value_cache [nb, N, bs, Dv]`` and ``key_scale_cache [nb, N, bs, 1]`` at their slots, in place (any strides);
    returns the three caches."""
    assert cache_layout == "BNBD", "only the BNBD layout exists"
    nb, _, bs, _ = key_cache.shape
    s = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
    keep = valid_slots(s, nb * bs)
    blk, off = s[keep] // bs, s[keep] % bs
    key_cache.view(np.uint8)[blk, :, off, :] = np.asarray(key).view(np.uint8)[keep]
    value_cache.view(np.uint8)[blk, :, off, :] = np.asarray(value).view(np.uint8)[keep]
    key_scale_cache[blk, :, off, 0] = np.asarray(key_scale, np.float32)[keep]
    return key_cache, value_cache, key_scale_cache
