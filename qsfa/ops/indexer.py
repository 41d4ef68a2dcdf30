"""Front doors of the lightning indexers: top-k token selection (docs/numerics/indexer.md).

* ``lightning_indexer`` - over float16 / bfloat16 query and key (torch_npu ``npu_lightning_indexer``);
* ``quant_lightning_indexer`` - over int8 / FP8 / HiFloat8 codes with dequant scales
  (``npu_quant_lightning_indexer``).

Contracts, case builder (:func:`indexer_case`) and front doors; the computation is
:mod:`qsfa.reference.indexer`, the shared rule builders :mod:`qsfa.ops._attention_rules`, the tests
tests/test_indexer.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import dtype_in, is_array
from .._contract import Contract, one_of, params
from .._dispatch import define_operator, run
from ..reference import indexer as _ref_li
from ..reference.indexer import TIE_BREAKS
from ._attention_rules import (
    _BF16, _head_dim_and_kv_head_rules, _kv_storage, _lengths, _ndim_rule, _nope_codes, _Q_DTYPES, _query_store,
    bool_rule, choice_rule, edit, finite_rule, fixed_value, INT64_MAX, is_int, key_rows_finite_rule, layout_rules,
    length_rules, mode_rules, Names, nonempty_rules, rank_rules, rule, setting,
)

__all__ = [
    "lightning_indexer",
    "quant_lightning_indexer",
    "indexer_case",
    "LI_CONTRACT",
    "QLI_CONTRACT",
]


def indexer_case(*, layout_query="BSND", layout_kv="BSND", explicit_lengths=False, block_size=16, n_heads=8,
                 sparse_count=4, qdtype="bfloat16", weights_dtype=None, batch=2, q_s=2, kv_s=6, seed=0,
                 quant=False, fmt="int8"):
    """A small valid (quant_)lightning_indexer argument set."""
    rng = np.random.default_rng(seed)
    qdt = _Q_DTYPES[qdtype]
    if quant:
        q = _nope_codes(rng, (batch, q_s, n_heads, 128), fmt)
        k = _nope_codes(rng, (batch, kv_s, 1, 128), fmt)
        cast = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "hifloat8": np.uint8}[fmt]
        q, k = q.view(cast), k.view(cast)
    else:
        q = rng.uniform(-1, 1, (batch, q_s, n_heads, 128)).astype(qdt)
        k = rng.uniform(-1, 1, (batch, kv_s, 1, 128)).astype(qdt)
    key, bt = _kv_storage(k, layout_kv=layout_kv, block_size=block_size, kv_s=kv_s)
    wdt = np.dtype(weights_dtype) if weights_dtype is not None else (np.dtype(np.float16) if quant else qdt)
    w = rng.uniform(-1, 1, (batch, q_s, n_heads)).astype(wdt)
    lq = _lengths(layout_query, [q_s] * batch) if (explicit_lengths or layout_query == "TND") else None
    lk = _lengths(layout_kv, [kv_s] * batch) if (explicit_lengths or layout_kv != "BSND") else None
    args = dict(query=_query_store(q, layout_query), key=key, weights=_query_store(w, layout_query),
                actual_seq_lengths_query=lq, actual_seq_lengths_key=lk, block_table=bt, layout_query=layout_query,
                layout_key=layout_kv, sparse_count=sparse_count, sparse_mode=3, pre_tokens=INT64_MAX,
                next_tokens=INT64_MAX, tie_break="lower_index")
    if quant:
        qs = rng.uniform(0.01, 0.1, (batch, q_s, n_heads)).astype(np.float16)
        ks, _ = _kv_storage(rng.uniform(0.01, 0.1, (batch, kv_s, 1)).astype(np.float16)[..., None],
                            layout_kv=layout_kv, block_size=block_size, kv_s=kv_s)
        args.update(query_dequant_scale=_query_store(qs, layout_query), key_dequant_scale=ks[..., 0],
                    query_quant_mode=0, key_quant_mode=0, query_dtype=fmt if fmt == "hifloat8" else None,
                    key_dtype=fmt if fmt == "hifloat8" else None)
    else:
        args.update(return_value=False)
    return args


# ==================================================================================================
# lightning_indexer

LI = "lightning_indexer"
LI_SOURCE = "docs/numerics/indexer.md#lightning_indexer; torch_npu npu_lightning_indexer doc (Ascend/op-plugin) and meta registration"
LI_SPARSE_COUNTS = tuple(range(1, 2049)) + (3072, 4096, 5120, 6144, 7168, 8192)
INDEXER_HEADS_950 = (8, 16, 24, 32, 64)
_N_LI = Names(LI, indexer_case, layout_kv="layout_key", lens_kv="actual_seq_lengths_key", source=LI_SOURCE)


def _indexer_shape_rules(n: Names, op: str, src: str):
    r = []
    r += _head_dim_and_kv_head_rules(n, 128, "N2")
    r.append(rule(n, "query_heads", "query", "shape", "N1 (dimension -2) must be in [1, 64]",
                  lambda a: None if 1 <= a.query.shape[-2] <= 64 else tuple(a.query.shape), edit(n, n_heads=72)))
    r.append(rule(n, "weights_shape", "weights", "shape", "must be query.shape[:-1] ([B, S1, N1] or [T, N1])",
                  lambda a: None if a.weights.shape == a.query.shape[:-1] else tuple(a.weights.shape),
                  edit(n, lambda a: a.update(weights=np.ascontiguousarray(a["weights"][..., :1])))))
    return r


def _li_rules():
    n = _N_LI
    r = [is_array(LI, p, source=LI_SOURCE) for p in ("query", "key", "weights")]
    r += [is_array(LI, p, optional=True, source=LI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key")]
    r.append(dtype_in(LI, "query", ("float16", "bfloat16"), source=LI_SOURCE))

    def key_change(a):
        a["key"] = a["key"].astype(np.float16 if a["query"].dtype == _BF16 else _BF16)

    r.append(rule(n, "key_dtype", "key", "dtype", "must have the query's dtype",
                  lambda a: None if a.key.dtype == a.query.dtype else dtype_name(a.key), edit(n, key_change),
                  dtype=True))
    r.append(dtype_in(LI, "weights", ("float16", "bfloat16", "float32"), source=LI_SOURCE))

    def w_change(a):
        a["weights"] = a["weights"].astype(np.float16 if a["query"].dtype == _BF16 else _BF16)

    r.append(rule(n, "weights_dtype_matches", "weights", "dtype",
                  "a float16 / bfloat16 weights tensor must have the query's dtype",
                  lambda a: None if a.weights.dtype in (np.float32, a.query.dtype) else dtype_name(a.weights),
                  edit(n, w_change), dtype=True))
    r += [dtype_in(LI, p, ("int32",), source=LI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key")]
    r += layout_rules(n)
    r += rank_rules(n, extra=(("weights", 3, 2, "number of dimensions must be 3 ([B, S1, N1]) for layout_query "
                                                "BSND and 2 ([T, N1]) for TND"),))
    r += nonempty_rules(n, ("query", "key"))
    r += _indexer_shape_rules(n, LI, LI_SOURCE)
    r.append(rule(n, "sparse_count_value", "sparse_count", "value",
                  "must be in [1, 2048] or one of {3072, 4096, 5120, 6144, 7168, 8192}",
                  lambda a: None if is_int(a.sparse_count) and a.sparse_count in LI_SPARSE_COUNTS else a.sparse_count,
                  edit(n, setting(sparse_count=2049))))
    r += mode_rules(n)
    r += length_rules(n, kv_seq_dim_name="S2")
    r.append(bool_rule(n, "return_value"))
    r.append(rule(n, "return_value_layout", "return_value", "value",
                  "sparse_values are returned only when layout_key is not PA_BSND (torch_npu doc)",
                  lambda a: None if not (a.return_value and a.layout_key == "PA_BSND") else True,
                  edit(n, setting(return_value=True), layout_kv="PA_BSND")))
    r.append(finite_rule(n, "query"))
    r.append(finite_rule(n, "weights"))
    r.append(key_rows_finite_rule(n))
    r.append(choice_rule(n, "tie_break", TIE_BREAKS, source="docs/numerics/open-facts.md#tie_break"))
    r.append(rule(n, "950_query_heads", "query", "shape", f"Ascend 950 supports N1 {one_of(INDEXER_HEADS_950)}",
                  lambda a: None if a.query.shape[-2] in INDEXER_HEADS_950 else tuple(a.query.shape),
                  edit(n, n_heads=4), chips=("950",)))
    r.append(rule(n, "950_weights_dtype", "weights", "dtype", "Ascend 950 does not support float32 weights",
                  lambda a: None if a.weights.dtype != np.float32 else "float32",
                  edit(n, weights_dtype=np.float32), chips=("950",), dtype=True))
    return r


LI_CONTRACT = Contract(op=LI, constraints=_li_rules(),
                       example=lambda rng: {**indexer_case(), "tie_break": "lower_index"}, params=params(
    "query:array key:array weights:array actual_seq_lengths_query:array? actual_seq_lengths_key:array?"
    " block_table:array? layout_query:str layout_key:str sparse_count:int sparse_mode:int pre_tokens:int"
    " next_tokens:int return_value:bool tie_break:str"))


def _li_reference(**args):
    return _ref_li.lightning_indexer(**args)


define_operator(LI, LI_CONTRACT, outputs=("sparse_indices", "sparse_values"), reference=_li_reference,
                doc="Top-k token selection for sparse attention (lightning indexer).")


def lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                      block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                      pre_tokens=INT64_MAX, next_tokens=INT64_MAX, return_value=False, tie_break="lower_index",
                      chip=None, backend="reference"):
    """The ``sparse_count`` best KV tokens per query row (torch_npu ``npu_lightning_indexer``, docs/numerics/indexer.md#lightning_indexer).

    ``score(i, j) = sum_h weights[i, h] * ReLU(query[i, h] . key[j])`` in fp32 over the tokens row i may
    see (right-down causal for sparse_mode 3, as sparse attention); the indices of the
    ``min(sparse_count, visible)`` largest scores in descending order, padded with -1.

    Parameters (torch_npu names):
      query:   float16 / bfloat16 ``[B, S1, N1, 128]`` (BSND) or ``[T, N1, 128]`` (TND); N1 in [1, 64]
               (Ascend 950: 8, 16, 24, 32, 64).
      key:     query's dtype, ``[B, S2, 1, 128]`` / ``[T2, 1, 128]`` / ``[block_count, block_size, 1, 128]``.
      weights: ``[B, S1, N1]`` / ``[T, N1]``, float32 or the query's dtype (950: not float32).
      actual_seq_lengths_query / actual_seq_lengths_key, block_table, layout_query, layout_key, sparse_mode,
      pre_tokens / next_tokens: as :func:`kv_quant_sparse_flash_attention`.
      sparse_count: K, in [1, 2048] or 3072 ... 8192 (step 1024).
      return_value: also return the selected scores (query dtype; not with layout_key PA_BSND).
      tie_break: **OPEN** - "lower_index" (the only choice: equal scores in increasing token order).
    Returns ``(sparse_indices int32 [B, S1, 1, K] / [T, 1, K], sparse_values)``; sparse_values has the
    indices' shape and the query dtype (-inf at -1 entries) when return_value, else is empty ``[0]``.
    """
    args = dict(query=query, key=key, weights=weights, actual_seq_lengths_query=actual_seq_lengths_query,
                actual_seq_lengths_key=actual_seq_lengths_key, block_table=block_table, layout_query=layout_query,
                layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                next_tokens=next_tokens, return_value=return_value, tie_break=tie_break)
    return run(LI, args, backend, chip=chip)


# ==================================================================================================
# quant_lightning_indexer

QLI = "quant_lightning_indexer"
QLI_SOURCE = "docs/numerics/indexer.md#quant_lightning_indexer; torch_npu npu_quant_lightning_indexer doc (Ascend/op-plugin) and meta registration"
QLI_FORMATS = ("int8", "float8_e4m3fn", "hifloat8")
_N_QLI = Names(QLI, lambda **kw: indexer_case(quant=True, **kw), layout_kv="layout_key",
               lens_kv="actual_seq_lengths_key", source=QLI_SOURCE)


def _code_format(arr, named):
    """The code format of a quantised indexer tensor, or None when the dtype / name pair is inconsistent."""
    dt = dtype_name(arr)
    if named is None:
        return {"int8": "int8", "float8_e4m3fn": "float8_e4m3fn"}.get(dt)
    ok = {"int8": ("int8",), "float8_e4m3fn": ("float8_e4m3fn",), "uint8": QLI_FORMATS}.get(dt, ())
    return named if named in ok else None


def _qli_rules():
    n = _N_QLI
    r = [is_array(QLI, p, source=QLI_SOURCE)
         for p in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale")]
    r += [is_array(QLI, p, optional=True, source=QLI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key")]
    r.append(dtype_in(QLI, "query", ("int8", "uint8", "float8_e4m3fn"), source=QLI_SOURCE))
    r.append(dtype_in(QLI, "key", ("int8", "uint8", "float8_e4m3fn"), source=QLI_SOURCE))
    r.append(choice_rule(n, "query_dtype", (None,) + QLI_FORMATS))
    r.append(choice_rule(n, "key_dtype", (None,) + QLI_FORMATS))
    for p, named in (("query", "query_dtype"), ("key", "key_dtype")):
        def fmt_check(a, p=p, named=named):
            return None if _code_format(a[p], a.get(named)) is not None else \
                f"{dtype_name(a[p])} array with {named}={a.get(named)!r}"

        def fmt_change(a, p=p):
            a[p] = a[p].view(np.uint8)

        r.append(rule(n, f"{p}_format", named, "value",
                      "int8 / float8_e4m3fn arrays take None or their own name; uint8 codes need an explicit "
                      f"{named} ({one_of(QLI_FORMATS)})", fmt_check, edit(n, fmt_change), dtype=False))

    def same_fmt(a):
        qf, kf = _code_format(a.query, a.get("query_dtype")), _code_format(a.key, a.get("key_dtype"))
        return None if qf == kf else f"query {qf}, key {kf}"

    def same_fmt_change(a):
        a["key"] = a["key"].view(np.uint8)
        a["key_dtype"] = "hifloat8"

    r.append(rule(n, "formats_match", "key_dtype", "value", "query and key must hold the same code format",
                  same_fmt, edit(n, same_fmt_change)))
    r.append(dtype_in(QLI, "weights", ("float16", "bfloat16"), source=QLI_SOURCE))
    r.append(dtype_in(QLI, "query_dequant_scale", ("float16", "float32"), source=QLI_SOURCE))
    r.append(dtype_in(QLI, "key_dequant_scale", ("float16", "float32"), source=QLI_SOURCE))
    r += [dtype_in(QLI, p, ("int32",), source=QLI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key")]
    r += layout_rules(n)
    r += rank_rules(n, extra=(("weights", 3, 2, "number of dimensions must be 3 ([B, S1, N1]) for layout_query "
                                                "BSND and 2 ([T, N1]) for TND"),
                              ("query_dequant_scale", 3, 2, "number of dimensions must be that of weights")))
    r.append(_ndim_rule(n, "key_dequant_scale", lambda a: a.key.ndim - 1,
                        "number of dimensions must be key's minus one (key.shape[:-1])"))
    r += nonempty_rules(n, ("query", "key"))
    r += _indexer_shape_rules(n, QLI, QLI_SOURCE)
    r.append(rule(n, "query_dequant_scale_shape", "query_dequant_scale", "shape", "must be query.shape[:-1]",
                  lambda a: None if a.query_dequant_scale.shape == a.query.shape[:-1]
                  else tuple(a.query_dequant_scale.shape),
                  edit(n, lambda a: a.update(query_dequant_scale=np.ascontiguousarray(a["query_dequant_scale"][..., :1])))))
    r.append(fixed_value(n, "query_quant_mode", 0, "only 0 (per-token-head quantisation) is supported", 1))
    r.append(fixed_value(n, "key_quant_mode", 0, "only 0 (per-token-head quantisation) is supported", 1))
    r.append(rule(n, "sparse_count_value", "sparse_count", "value", "must be in [1, 2048]",
                  lambda a: None if is_int(a.sparse_count) and 1 <= a.sparse_count <= 2048 else a.sparse_count,
                  edit(n, setting(sparse_count=3072))))
    r += mode_rules(n)
    r += length_rules(n, kv_seq_dim_name="S2")
    r.append(rule(n, "key_dequant_scale_shape", "key_dequant_scale", "shape",
                  "must be key.shape[:-1] ([B, S2, 1], [T2, 1] or [block_count, block_size, 1])",
                  lambda a: None if a.key_dequant_scale.shape == a.key.shape[:-1] else tuple(a.key_dequant_scale.shape),
                  edit(n, lambda a: a.update(key_dequant_scale=np.ascontiguousarray(a["key_dequant_scale"][:, :1])))))
    for p in ("weights", "query_dequant_scale", "key_dequant_scale"):
        r.append(finite_rule(n, p))
    r.append(choice_rule(n, "tie_break", TIE_BREAKS, source="docs/numerics/open-facts.md#tie_break"))

    def a2a3(a):
        f = _code_format(a.query, a.get("query_dtype"))
        dts = (dtype_name(a.weights), dtype_name(a.query_dequant_scale), dtype_name(a.key_dequant_scale))
        return None if f == "int8" and dts == ("float16",) * 3 else f"{f} with {dts}"

    r.append(rule(n, "a2a3_dtypes", "query", "dtype",
                  "Atlas A2/A3 support int8 query/key with float16 weights and dequant scales only", a2a3,
                  edit(n, fmt="float8_e4m3fn"), chips=("A2", "A3"), dtype=True))
    combos = {"float8_e4m3fn": (("bfloat16", "float32", "float32"), ("float16", "float16", "float16")),
              "hifloat8": (("bfloat16", "float32", "float32"),), "int8": (("float16", "float16", "float16"),)}

    def c950(a):
        f = _code_format(a.query, a.get("query_dtype"))
        dts = (dtype_name(a.weights), dtype_name(a.query_dequant_scale), dtype_name(a.key_dequant_scale))
        return None if dts in combos.get(f, ()) else f"{f} with {dts}"

    r.append(rule(n, "950_dtypes", "weights", "dtype",
                  "Ascend 950 supports (weights, query_dequant_scale, key_dequant_scale) = (bfloat16, float32, "
                  "float32) or (float16, float16, float16) for float8_e4m3fn, (bfloat16, float32, float32) for "
                  "hifloat8 and (float16, float16, float16) for int8", c950,
                  edit(n, fmt="hifloat8"), chips=("950",), dtype=True))
    r.append(rule(n, "950_query_heads", "query", "shape", f"Ascend 950 supports N1 {one_of(INDEXER_HEADS_950)}",
                  lambda a: None if a.query.shape[-2] in INDEXER_HEADS_950 else tuple(a.query.shape),
                  edit(n, n_heads=4), chips=("950",)))
    return r


QLI_CONTRACT = Contract(op=QLI, constraints=_qli_rules(),
                        example=lambda rng: {**indexer_case(quant=True), "tie_break": "lower_index"}, params=params(
    "query:array key:array weights:array actual_seq_lengths_query:array? actual_seq_lengths_key:array?"
    " block_table:array? layout_query:str layout_key:str sparse_count:int sparse_mode:int pre_tokens:int"
    " next_tokens:int query_dequant_scale:array key_dequant_scale:array query_quant_mode:int key_quant_mode:int"
    " query_dtype:str? key_dtype:str? tie_break:str"))


def _qli_reference(**args):
    return _ref_li.quant_lightning_indexer(**args)


define_operator(QLI, QLI_CONTRACT, outputs=("sparse_indices",), reference=_qli_reference,
                doc="Top-k token selection from per-token-head quantised query and key.")


def quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode=0,
                            key_quant_mode=0, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                            block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                            sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, query_dtype=None,
                            key_dtype=None, tie_break="lower_index", chip=None, backend="reference"):
    """Lightning indexer on quantised inputs (torch_npu ``npu_quant_lightning_indexer``).

    ``score(i, j) = sum_h weights[i, h] * ReLU((query_dequant_scale[i, h] * key_dequant_scale[j]) *
    (query[i, h] . key[j]))`` in fp32 over decoded codes; top-k as :func:`lightning_indexer`.

    Parameters (torch_npu names): query / key one-byte codes - int8 (A2/A3), float8_e4m3fn or HiFloat8
    (uint8 with query_dtype / key_dtype "hifloat8") - shaped as :func:`lightning_indexer`'s (N1 in [1, 64]);
    weights float16 / bfloat16 ``[B, S1, N1]`` / ``[T, N1]``; query_dequant_scale float16 / float32 of the
    weights' shape; key_dequant_scale float16 / float32 ``key.shape[:-1]``; query_quant_mode /
    key_quant_mode 0 (per token-head); sparse_count in [1, 2048]; the chip dtype combinations are in the
    contract. Returns sparse_indices int32 ``[B, S1, 1, K]`` / ``[T, 1, K]``.
    """
    args = dict(query=query, key=key, weights=weights, query_dequant_scale=query_dequant_scale,
                key_dequant_scale=key_dequant_scale, query_quant_mode=query_quant_mode, key_quant_mode=key_quant_mode,
                actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_key=actual_seq_lengths_key,
                block_table=block_table, layout_query=layout_query, layout_key=layout_key, sparse_count=sparse_count,
                sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens, query_dtype=query_dtype,
                key_dtype=key_dtype, tie_break=tie_break)
    return run(QLI, args, backend, chip=chip)
