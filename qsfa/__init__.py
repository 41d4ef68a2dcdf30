"""qsfa: golden oracle, dispatch API and kernels for quantised sparse MLA attention on Ascend NPUs.

The public operators take ``backend="reference" | "npu" | "triton"`` and the parameter names of
torch_npu. ``qsfa.reference`` is the NumPy + ml_dtypes oracle; ``qsfa.formats`` the number formats;
``qsfa.layouts`` the byte layouts of the caches.

Submodules and operators are imported lazily, so ``import qsfa`` stays cheap and never imports torch.
"""

from __future__ import annotations

import importlib

from ._errors import (
    BackendError,
    BackendUnavailable,
    InvalidArgument,
    InvalidDtype,
    NotImplementedByBackend,
    UnknownBackend,
    UnsupportedByBackend,
)

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    # dispatch
    "backends": "qsfa._dispatch",
    "register_backend": "qsfa._dispatch",
    "unregister_backend": "qsfa._dispatch",
    "register_impl": "qsfa._dispatch",
    "Backend": "qsfa._dispatch",
    "operators": "qsfa._dispatch",
    # chips
    "resolve_chip": "qsfa.chips",
    # threads of the reference oracle
    "set_num_threads": "qsfa.reference.parallel",
    "get_num_threads": "qsfa.reference.parallel",
    "set_workset_mib": "qsfa.reference.parallel",
    "get_workset_mib": "qsfa.reference.parallel",
    # quantisation
    "dynamic_block_quant": "qsfa.ops.quant",
    # cache writers
    "kv_rmsnorm_rope_cache": "qsfa.ops.kv_rmsnorm_rope_cache",
    "kv_compress_epilog": "qsfa.ops.kv_compress_epilog",
    "kv_compress_epilog_vllm": "qsfa.ops.kv_compress_epilog_vllm",
    "indexer_quant_cache": "qsfa.ops.indexer_cache",
    "indexer_compress_epilog_v2": "qsfa.ops.indexer_cache",
    "scatter_pa_kv_cache_with_k_scale": "qsfa.ops.k_scale_cache",
    "compressor": "qsfa.ops.compressor",
    "quant_compressor": "qsfa.ops.compressor",
    "vllm_compressor": "qsfa.ops.vllm_compressor",
    "c8_cache_write": "qsfa.ops.c8_cache",
    "c8_rmsnorm_rope_cache": "qsfa.ops.c8_cache",
    "scatter_by_slot": "qsfa.ops.scatter",
    # attention
    "attention": "qsfa.ops.attention",
    "kv_quant_sparse_flash_attention": "qsfa.ops.attention",
    "sparse_flash_attention": "qsfa.ops.attention",
    "lightning_indexer": "qsfa.ops.indexer",
    "quant_lightning_indexer": "qsfa.ops.indexer",
    "vllm_quant_lightning_indexer": "qsfa.ops.indexer_v4",
    "quant_lightning_indexer_v2": "qsfa.ops.quant_lightning_indexer_v2",
    "qkv_rms_norm_rope_cache_with_k_scale": "qsfa.ops.qkv_k_scale",
    "merge_attention_lse": "qsfa.ops.lse",
    "attention_error_budget": "qsfa.ops.attention",
    "c8_pipeline": "qsfa.ops.attention",
    # DeepSeek-V4 shared-KV attention
    "sparse_flash_mla": "qsfa.ops.sharedkv",
    "sparse_attn_sharedkv": "qsfa.ops.sharedkv",
    "mixed_quant_sparse_flash_mla": "qsfa.ops.sharedkv",
    "kv_quant_sparse_attn_sharedkv": "qsfa.ops.sharedkv",
    "quant_sparse_flash_mla": "qsfa.ops.sharedkv",
}

_SUBMODULES = {
    "formats",
    "layouts",
    "reference",
    "strategies",
    "conformance",
    "golden",
    "compare",
    "chips",
    "npu",
    "ops",
    "chain",
}

__all__ = sorted(set(_LAZY) | _SUBMODULES | {
    "BackendError",
    "BackendUnavailable",
    "InvalidArgument",
    "InvalidDtype",
    "NotImplementedByBackend",
    "UnknownBackend",
    "UnsupportedByBackend",
})


def __getattr__(name):
    if name in _SUBMODULES:
        mod = importlib.import_module(f"qsfa.{name}")
        globals()[name] = mod
        return mod
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'qsfa' has no attribute {name!r}")


def __dir__():
    return __all__
