"""Front door of the DeepSeek-V4 quantised lightning indexer over compressed keys (docs/numerics/indexer.md#vllm_quant_lightning_indexer).

``vllm_quant_lightning_indexer``: vLLM-Ascend's ``torch.ops._C_ascend.npu_vllm_quant_lightning_indexer``
(``cmp_ratio``, ``metadata``, ``return_value``); the computation is :mod:`qsfa.reference.indexer_v4`, the
tests tests/test_indexer_v4.py. Sources: vllm-project/vllm-ascend@182b75e ``csrc/torch_binding.cpp`` (schema),
``csrc/attention/vllm_quant_lightning_indexer/op_host/vllm_quant_lightning_indexer_tiling.cpp`` (checks),
``.../README.md`` and the kernels under ``.../op_kernel/arch32`` (A2/A3) and ``arch35`` (950).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import dtype_in, is_array
from .._contract import Contract, params
from .._dispatch import define_operator, run
from ..reference import indexer_v4 as _ref
from ..reference.indexer import TIE_BREAKS
from ._attention_rules import (
    _kv_storage, _lengths, _nope_codes, _query_store, choice_rule, edit, finite_rule, fixed_value,
    INT64_MAX, is_int, length_rules, mode_rules, Names, nonempty_rules, rank_rules, rule, setting,
)
from ._attention_rules import _head_dim_and_kv_head_rules, _ndim_rule

__all__ = ["vllm_quant_lightning_indexer", "vqli_case", "VQLI_CONTRACT", "CMP_RATIOS_A2A3", "CMP_RATIOS_950"]

VQLI = "vllm_quant_lightning_indexer"
_REPO = "vllm-project/vllm-ascend@182b75e csrc/attention/vllm_quant_lightning_indexer/"
VQLI_SOURCE = (f"docs/numerics/indexer.md#vllm_quant_lightning_indexer; {_REPO}op_host/"
               "vllm_quant_lightning_indexer_tiling.cpp and README.md")
CMP_RATIOS_A2A3 = (1, 2, 4, 8, 16, 32, 64, 128)
CMP_RATIOS_950 = (1, 4, 128)
SPARSE_LIMIT = 2048
HEADS = 64



def paged_key_rules(n, compressed_len, item: str, metadata_op: str) -> list:
    """The block-table value rule and the metadata shape rule the V4 indexers share: ``compressed_len(a)`` gives
    each batch's compressed key length, ``item`` names a batch in the message, ``metadata_op`` the metadata
    operator whose [1024] int32 tiling ``metadata`` is."""
    def bt_values(a):
        if a.get("block_table") is None:
            return None
        bt = np.asarray(a.block_table).astype(np.int64)
        bs, nb = a.key.shape[1], a.key.shape[0]
        need = -(-compressed_len(a) // bs)
        bad = (np.arange(bt.shape[1])[None, :] < need[:, None]) & ((bt < 0) | (bt >= nb))
        if not bad.any():
            return None
        b, j = (int(x) for x in np.argwhere(bad)[0])
        return f"block_table[{b}, {j}] = {int(bt[b, j])}"

    def bt_bad(a):
        bt = a["block_table"].copy()
        bt[0, 0] = a["key"].shape[0]
        a["block_table"] = bt

    return [rule(n, "block_table_values", "block_table", "value",
                 f"entries covering each {item}'s compressed length must be block ids in [0, block_count)",
                 bt_values, edit(n, bt_bad)),
            rule(n, "metadata_shape", "metadata", "shape",
                 f"must be the [1024] int32 tiling of {metadata_op} (or None)",
                 lambda a: None if a.get("metadata") is None or tuple(a.metadata.shape) == (1024,)
                 else tuple(a.metadata.shape), edit(n, setting(metadata=np.zeros(8, np.int32))))]

def vqli_case(*, layout_query="BSND", layout_kv="PA_BSND", explicit_lengths=False, block_size=16, n_heads=HEADS,
              sparse_count=4, batch=2, q_s=2, kv_s=6, cmp_ratio=4, seed=0, fmt="int8", act_kv_orig=None):
    """A small valid vllm_quant_lightning_indexer argument set: ``kv_s`` compressed key tokens per batch,
    ``actual_seq_lengths_key = kv_s * cmp_ratio`` original tokens (or ``act_kv_orig``). The key is always paged
    (``layout_kv`` is accepted for the shared rule builders and ignored)."""
    rng = np.random.default_rng(seed)
    cast = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}[fmt]
    q = _nope_codes(rng, (batch, q_s, n_heads, 128), fmt).view(cast)
    k = _nope_codes(rng, (batch, kv_s, 1, 128), fmt).view(cast)
    key, bt = _kv_storage(k, layout_kv="PA_BSND", block_size=block_size, kv_s=kv_s)
    sdt = np.float16 if fmt == "int8" else np.float32
    w = rng.uniform(-1, 1, (batch, q_s, n_heads)).astype(sdt)
    qs = rng.uniform(0.01, 0.1, (batch, q_s, n_heads)).astype(sdt)
    ks, _ = _kv_storage(rng.uniform(0.01, 0.1, (batch, kv_s, 1)).astype(sdt)[..., None], layout_kv="PA_BSND",
                        block_size=block_size, kv_s=kv_s)
    lq = _lengths(layout_query, [q_s] * batch) if (explicit_lengths or layout_query == "TND") else None
    lk = np.asarray(act_kv_orig if act_kv_orig is not None else [kv_s * cmp_ratio] * batch, np.int32)
    return dict(query=_query_store(q, layout_query), key=key, weights=_query_store(w, layout_query),
                query_dequant_scale=_query_store(qs, layout_query), key_dequant_scale=ks[..., 0],
                query_quant_mode=0, key_quant_mode=0, actual_seq_lengths_query=lq, actual_seq_lengths_key=lk,
                block_table=bt, metadata=None, layout_query=layout_query, layout_key="PA_BSND",
                sparse_count=sparse_count, sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX,
                cmp_ratio=cmp_ratio, return_value=False, tie_break="lower_index")


_N = Names(VQLI, vqli_case, layout_kv="layout_key", lens_kv="actual_seq_lengths_key", source=VQLI_SOURCE)
# generic length rules that cannot apply to a key that is always paged, or that must count compressed tokens
_DROPPED = {f"{VQLI}.{c}" for c in ("block_table_unused", "key_batch", "actual_seq_lengths_key_prefix",
                                    "actual_seq_lengths_key_range", "block_table_values")}


def _compressed(a):
    return np.asarray(a.actual_seq_lengths_key, np.int64).reshape(-1) // int(a.cmp_ratio)


def _vqli_rules():
    n = _N
    r = [is_array(VQLI, p, source=VQLI_SOURCE)
         for p in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale")]
    r += [is_array(VQLI, p, optional=True, source=VQLI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key", "metadata")]
    r.append(dtype_in(VQLI, "query", ("int8", "float8_e4m3fn"), source=VQLI_SOURCE))
    r.append(rule(n, "key_dtype", "key", "dtype", "must have the query's dtype (op_host)",
                  lambda a: None if a.key.dtype == a.query.dtype else dtype_name(a.key),
                  edit(n, lambda a: a.update(key=a["key"].view(ml_dtypes.float8_e4m3fn))), dtype=True))
    r.append(dtype_in(VQLI, "weights", ("float16", "float32"), source=VQLI_SOURCE))
    r.append(dtype_in(VQLI, "query_dequant_scale", ("float16", "float32"), source=VQLI_SOURCE))
    r.append(rule(n, "key_dequant_scale_dtype", "key_dequant_scale", "dtype",
                  "must have query_dequant_scale's dtype (op_host)",
                  lambda a: None if a.key_dequant_scale.dtype == a.query_dequant_scale.dtype
                  else dtype_name(a.key_dequant_scale),
                  edit(n, lambda a: a.update(key_dequant_scale=a["key_dequant_scale"].astype(np.float32))),
                  dtype=True))
    r += [dtype_in(VQLI, p, ("int32",), source=VQLI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key", "metadata")]
    r.append(rule(n, "layout_query_value", "layout_query", "value", "must be 'BSND' or 'TND'",
                  lambda a: None if a.layout_query in ("BSND", "TND") else a.layout_query,
                  edit(n, setting(layout_query="BNSD"))))
    r.append(rule(n, "layout_key_value", "layout_key", "value", "must be 'PA_BSND' (op_host: only PA_BSND)",
                  lambda a: None if a.layout_key == "PA_BSND" else a.layout_key, edit(n, setting(layout_key="TND"))))
    r += rank_rules(n, extra=(("weights", 3, 2, "number of dimensions must be 3 ([B, S1, N1]) for layout_query "
                                                "BSND and 2 ([T, N1]) for TND"),
                              ("query_dequant_scale", 3, 2, "number of dimensions must be that of weights")))
    r.append(_ndim_rule(n, "key_dequant_scale", lambda a: a.key.ndim - 1,
                        "number of dimensions must be key's minus one ([block_count, block_size, 1])"))
    r += nonempty_rules(n, ("query", "key"))
    r += _head_dim_and_kv_head_rules(n, 128, "N2")
    r.append(rule(n, "query_heads", "query", "shape", f"N1 (dimension -2) must be {HEADS} (op_host: G = 64)",
                  lambda a: None if a.query.shape[-2] == HEADS else tuple(a.query.shape), edit(n, n_heads=32)))
    for p in ("weights", "query_dequant_scale"):
        r.append(rule(n, f"{p}_shape", p, "shape", "must be query.shape[:-1]",
                      lambda a, p=p: None if a[p].shape == a.query.shape[:-1] else tuple(a[p].shape),
                      edit(n, lambda a, p=p: a.update({p: np.ascontiguousarray(a[p][..., :1])}))))
    r.append(fixed_value(n, "query_quant_mode", 0, "only 0 (per-token-head quantisation) is supported", 1))
    r.append(fixed_value(n, "key_quant_mode", 0, "only 0 (per-token-head quantisation) is supported", 1))
    r.append(rule(n, "sparse_count_value", "sparse_count", "value", f"must be in [1, {SPARSE_LIMIT}] (op_host)",
                  lambda a: None if is_int(a.sparse_count) and 1 <= a.sparse_count <= SPARSE_LIMIT else a.sparse_count,
                  edit(n, setting(sparse_count=SPARSE_LIMIT + 1))))
    r.append(rule(n, "cmp_ratio_value", "cmp_ratio", "value", "must be a power of 2 in [1, 128] (op_host)",
                  lambda a: None if is_int(a.cmp_ratio) and a.cmp_ratio in CMP_RATIOS_A2A3 else a.cmp_ratio,
                  edit(n, setting(cmp_ratio=3))))
    r += mode_rules(n)
    lengths = [c for c in length_rules(n, kv_seq_dim_name="S2") if c.id not in _DROPPED]
    r += lengths
    r.append(rule(n, "key_dequant_scale_shape", "key_dequant_scale", "shape",
                  "must be key.shape[:-1] ([block_count, block_size, 1])",
                  lambda a: None if a.key_dequant_scale.shape == a.key.shape[:-1] else tuple(a.key_dequant_scale.shape),
                  edit(n, lambda a: a.update(key_dequant_scale=np.ascontiguousarray(a["key_dequant_scale"][:, :1])))))

    def k_range(a):
        v = np.asarray(a.actual_seq_lengths_key, np.int64).reshape(-1)
        if (v < 0).any():
            return int(v.min())
        cap = a.block_table.shape[1] * a.key.shape[1]
        c = _compressed(a)
        return None if int(c.max(initial=0)) <= cap else int(v.max())

    def k_bad_range(a):
        v = a["actual_seq_lengths_key"].copy()
        v[-1] = (a["block_table"].shape[1] * a["key"].shape[1] + 1) * a["cmp_ratio"]
        a["actual_seq_lengths_key"] = v

    r.append(rule(n, "actual_seq_lengths_key_range", "actual_seq_lengths_key", "value",
                  "lengths (original, uncompressed tokens) must be >= 0 and actual_seq_lengths_key // cmp_ratio "
                  "compressed tokens must be covered by block_table (block_table.shape[1] * block_size)",
                  k_range, edit(n, k_bad_range)))

    r += paged_key_rules(n, _compressed, "sequence", "npu_vllm_quant_lightning_indexer_metadata")
    r.append(rule(n, "return_value_value", "return_value", "value",
                  "must be False (op_host: returnValues only supported False)",
                  lambda a: None if a.get("return_value") is False or a.get("return_value") is np.False_
                  else a.get("return_value"), edit(n, setting(return_value=True))))
    for p in ("weights", "query_dequant_scale", "key_dequant_scale"):
        r.append(finite_rule(n, p))
    r.append(choice_rule(n, "tie_break", TIE_BREAKS, source="docs/numerics/open-facts.md#tie_break"))

    def a2a3(a):
        dts = (dtype_name(a.query), dtype_name(a.weights), dtype_name(a.query_dequant_scale))
        return None if dts == ("int8", "float16", "float16") else f"{dts}"

    r.append(rule(n, "a2a3_dtypes", "query", "dtype",
                  "Atlas A2/A3 support int8 query/key with float16 weights and dequant scales only (op_host)", a2a3,
                  edit(n, fmt="float8_e4m3fn"), chips=("A2", "A3"), dtype=True))

    def c950(a):
        dts = (dtype_name(a.query), dtype_name(a.weights), dtype_name(a.query_dequant_scale))
        return None if dts == ("float8_e4m3fn", "float32", "float32") else f"{dts}"

    r.append(rule(n, "950_dtypes", "query", "dtype",
                  "Ascend 950 supports float8_e4m3fn query/key with float32 weights and dequant scales only (op_host)",
                  c950, edit(n, fmt="int8"), chips=("950",), dtype=True))
    r.append(rule(n, "950_cmp_ratio", "cmp_ratio", "value", "Ascend 950 supports cmp_ratio 1, 4 or 128 (op_host)",
                  lambda a: None if a.cmp_ratio in CMP_RATIOS_950 else a.cmp_ratio,
                  edit(n, setting(cmp_ratio=8), fmt="float8_e4m3fn"), chips=("950",)))
    return r


VQLI_CONTRACT = Contract(op=VQLI, constraints=_vqli_rules(), example=lambda rng: vqli_case(), params=params(
    "query:array key:array weights:array query_dequant_scale:array key_dequant_scale:array query_quant_mode:int"
    " key_quant_mode:int actual_seq_lengths_query:array? actual_seq_lengths_key:array? block_table:array?"
    " metadata:array? layout_query:str layout_key:str sparse_count:int sparse_mode:int pre_tokens:int"
    " next_tokens:int cmp_ratio:int return_value:bool tie_break:str"))


def _reference(**args):
    return _ref.vllm_quant_lightning_indexer(**args)


define_operator(VQLI, VQLI_CONTRACT, outputs=("sparse_indices", "sparse_values"), reference=_reference,
                doc="V4 lightning indexer over a compressed, quantised key cache (cmp_ratio).")


def vllm_quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode=0,
                                 key_quant_mode=0, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                                 block_table=None, metadata=None, layout_query="BSND", layout_key="BSND",
                                 sparse_count=2048, sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX,
                                 cmp_ratio=1, return_value=False, tie_break="lower_index", chip=None,
                                 backend="reference"):
    """Top-k compressed key tokens per query row: vLLM-Ascend's ``torch.ops._C_ascend.npu_vllm_quant_lightning_indexer``
    (docs/numerics/indexer.md#vllm_quant_lightning_indexer).

    Names and defaults are the registered schema's (layout_key defaults to "BSND" there, yet the op_host accepts
    only "PA_BSND", so pass it). query / key: int8 (Atlas A2/A3) or float8_e4m3fn (950) ``[B, S1, 64, 128]`` /
    ``[T, 64, 128]`` and ``[block_count, block_size, 1, 128]`` (compressed tokens); weights and
    query_dequant_scale ``query.shape[:-1]`` (A2/A3 float16, 950 float32); key_dequant_scale ``key.shape[:-1]``
    (query_dequant_scale's dtype); actual_seq_lengths_key counts original tokens (``// cmp_ratio`` are
    compressed); cmp_ratio a power of 2 in [1, 128] (950: 1, 4, 128); sparse_count in [1, 2048]; metadata: the
    tiling from ``npu_vllm_quant_lightning_indexer_metadata`` - the reference ignores it and the npu backend
    computes it when None; return_value must be False. Returns ``(sparse_indices int32 [B, S1, 1, K] / [T, 1, K],
    sparse_values float32 [0])``.
    """
    args = dict(query=query, key=key, weights=weights, query_dequant_scale=query_dequant_scale,
                key_dequant_scale=key_dequant_scale, query_quant_mode=query_quant_mode, key_quant_mode=key_quant_mode,
                actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_key=actual_seq_lengths_key,
                block_table=block_table, metadata=metadata, layout_query=layout_query, layout_key=layout_key,
                sparse_count=sparse_count, sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
                cmp_ratio=cmp_ratio, return_value=return_value, tie_break=tie_break)
    return run(VQLI, args, backend, chip=chip)
