"""Public front doors of the cache writers (docs/numerics/cache-writers.md), one module per operator:

* ``scatter_by_slot`` - :mod:`qsfa.ops.scatter`;
* ``c8_cache_write`` / ``c8_rmsnorm_rope_cache`` - :mod:`qsfa.ops.c8_cache`;
* ``kv_compress_epilog`` - :mod:`qsfa.ops.kv_compress_epilog`;
* ``kv_rmsnorm_rope_cache`` - :mod:`qsfa.ops.kv_rmsnorm_rope_cache`;
* ``kv_compress_epilog_vllm`` - :mod:`qsfa.ops.kv_compress_epilog_vllm`;
* ``indexer_quant_cache`` / ``indexer_compress_epilog_v2`` - :mod:`qsfa.ops.indexer_cache`;
* ``scatter_pa_kv_cache_with_k_scale`` - :mod:`qsfa.ops.k_scale_cache`.

The rules they share are in :mod:`qsfa.ops._cache_rules`. This module re-exports their public names so
``from qsfa.ops.cache import c8_cache_write`` keeps working.
"""

from __future__ import annotations

from .c8_cache import c8_cache_write, c8_rmsnorm_rope_cache
from .kv_compress_epilog import kv_compress_epilog
from .indexer_cache import indexer_compress_epilog_v2, indexer_quant_cache
from .k_scale_cache import scatter_pa_kv_cache_with_k_scale
from .kv_compress_epilog_vllm import kv_compress_epilog_vllm
from .kv_rmsnorm_rope_cache import kv_rmsnorm_rope_cache, kv_rmsnorm_rope_cache_example
from .scatter import scatter_by_slot

__all__ = [
    "scatter_by_slot",
    "c8_cache_write",
    "c8_rmsnorm_rope_cache",
    "kv_rmsnorm_rope_cache",
    "kv_compress_epilog",
    "kv_rmsnorm_rope_cache_example",
    "kv_compress_epilog_vllm",
    "indexer_quant_cache",
    "indexer_compress_epilog_v2",
    "scatter_pa_kv_cache_with_k_scale",
]
