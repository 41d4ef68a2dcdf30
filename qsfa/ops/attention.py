"""Front doors of sparse attention: QSFA and SFA (docs/numerics/attention.md).

* ``kv_quant_sparse_flash_attention`` - QSFA over packed int8 / FP8 / HiFloat8 rows (seed 000);
* ``sparse_flash_attention`` - SFA over a float16 / bfloat16 KV (torch_npu ``npu_sparse_flash_attention``).

Each has its :class:`~qsfa._contract.Contract` (every documented rule a constraint with a ``violate``
function; chip limits as ``chips=`` constraints) and its case builder (:func:`qsfa_case`, :func:`sfa_case`:
small valid argument sets, the contracts' examples and the bases of the violate functions). Plain functions
over them: :func:`attention` (routes by key dtype as vLLM-Ascend does), :func:`attention_error_budget`
(faithful - exact) and :func:`c8_pipeline` (cache writer -> indexer -> QSFA). The computations are
:mod:`qsfa.reference.attention` and :mod:`qsfa.reference.pipeline`; the tests are tests/test_attention_*.py.

The other operators of the attention group have their own modules - the lightning indexers in
:mod:`qsfa.ops.indexer`, the LSE merge in :mod:`qsfa.ops.lse` - and the rule builders they share are in
:mod:`qsfa.ops._attention_rules`; their public names are re-exported here, so
``from qsfa.ops.attention import lightning_indexer`` keeps working.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name, is_torch, to_numpy
from .._checks import dtype_in, is_array
from .._contract import Contract, one_of, params
from .. import chips as _chips
from ._out_buffers import add_buffers, attention_out_rules, lse_out_rules, OUT_BUFFERS, reject_on_device
from .._dispatch import define_operator, run
from .._errors import InvalidArgument, InvalidDtype, Raw
from ..reference import attention as _ref
from ..reference import pipeline as _ref_pipeline
from ..reference.attention import PRECISIONS, PROBABILITY_ROUNDINGS
from ._attention_rules import (
    _BF16, _head_dim_and_kv_head_rules, _kv_storage, _lengths, _ndim_rule, _nope_codes, _Q_DTYPES, _query_store,
    bool_rule, choice_rule, edit, finite_rule, fixed_value, INT64_MAX, is_int, key_rows_finite_rule, layout_rules,
    length_rules, mode_rules, Names, nonempty_rules, packed_rows_finite_rule, rank_rules, rule, sbs_divides_block_size,
    scale_value_rule, setting, sparse_indices_rules,
)

__all__ = [
    "kv_quant_sparse_flash_attention",
    "sparse_flash_attention",
    "attention",
    "lightning_indexer",
    "quant_lightning_indexer",
    "merge_attention_lse",
    "attention_error_budget",
    "c8_pipeline",
    "qsfa_case",
    "sfa_case",
    "indexer_case",
    "merge_case",
    "QSFA_CONTRACT",
    "SFA_CONTRACT",
    "LI_CONTRACT",
    "QLI_CONTRACT",
    "MERGE_CONTRACT",
]


def qsfa_case(*, layout_query="BSND", layout_kv="BSND", explicit_lengths=False, block_size=16, rope=64,
              key_fmt="int8", n_heads=1, sparse=2, qdtype="bfloat16", sparse_block_size=1, batch=2, q_s=2,
              kv_s=4, seed=0):
    """A small valid QSFA argument set (packed rows built with qsfa.reference.packing.pack_rows)."""
    from ..reference.packing import pack_rows

    rng = np.random.default_rng(seed)
    qdt = _Q_DTYPES[qdtype]
    q = rng.uniform(-1, 1, (batch, q_s, n_heads, 512 + rope)).astype(qdt)
    codes = _nope_codes(rng, (batch, kv_s, 1, 512), key_fmt)
    k_rope = rng.uniform(-1, 1, (batch, kv_s, 1, rope)).astype(qdt) if rope else None
    scales = rng.uniform(0.01, 0.1, (batch, kv_s, 1, 4)).astype(np.float32)
    rows = pack_rows(codes, k_rope, scales)
    key, bt = _kv_storage(rows, layout_kv=layout_kv, block_size=block_size, kv_s=kv_s)
    key = key.view(np.int8) if key_fmt == "int8" else key.view(ml_dtypes.float8_e4m3fn) if key_fmt == \
        "float8_e4m3fn" else key
    idx = np.full((batch, q_s, 1, sparse), -1, np.int32)
    idx[..., : min(sparse, kv_s)] = np.arange(min(sparse, kv_s), dtype=np.int32)
    lq = _lengths(layout_query, [q_s] * batch) if (explicit_lengths or layout_query == "TND") else None
    lk = _lengths(layout_kv, [kv_s] * batch) if (explicit_lengths or layout_kv != "BSND") else None
    return dict(query=_query_store(q, layout_query), key=key, value=key, sparse_indices=_query_store(idx, layout_query),
                scale_value=(512 + 64) ** -0.5, key_quant_mode=2, value_quant_mode=2, key_dequant_scale=None,
                value_dequant_scale=None, block_table=bt, actual_seq_lengths_query=lq, actual_seq_lengths_kv=lk,
                sparse_block_size=sparse_block_size, layout_query=layout_query, layout_kv=layout_kv, sparse_mode=3,
                pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2, quant_scale_repo_mode=1,
                tile_size=128, rope_head_dim=rope, return_softmax_lse=False, key_dtype=key_fmt,
                precision="faithful", probability_rounding="unnormalised")


def sfa_case(*, layout_query="BSND", layout_kv="BSND", explicit_lengths=False, block_size=16, rope=True,
             n_heads=1, sparse=2, qdtype="bfloat16", sparse_block_size=1, batch=2, q_s=2, kv_s=4, value=True,
             seed=0):
    """A small valid SFA argument set."""
    rng = np.random.default_rng(seed)
    qdt = _Q_DTYPES[qdtype]
    q = rng.uniform(-1, 1, (batch, q_s, n_heads, 512)).astype(qdt)
    k = rng.uniform(-1, 1, (batch, kv_s, 1, 512)).astype(qdt)
    key, bt = _kv_storage(k, layout_kv=layout_kv, block_size=block_size, kv_s=kv_s)
    qr = kr = None
    if rope:
        qr = _query_store(rng.uniform(-1, 1, (batch, q_s, n_heads, 64)).astype(qdt), layout_query)
        kr, _ = _kv_storage(rng.uniform(-1, 1, (batch, kv_s, 1, 64)).astype(qdt), layout_kv=layout_kv,
                            block_size=block_size, kv_s=kv_s)
    v = None
    if value:
        v, _ = _kv_storage(rng.uniform(-1, 1, (batch, kv_s, 1, 512)).astype(qdt), layout_kv=layout_kv,
                           block_size=block_size, kv_s=kv_s)
    idx = np.full((batch, q_s, 1, sparse), -1, np.int32)
    idx[..., : min(sparse, kv_s)] = np.arange(min(sparse, kv_s), dtype=np.int32)
    lq = _lengths(layout_query, [q_s] * batch) if (explicit_lengths or layout_query == "TND") else None
    lk = _lengths(layout_kv, [kv_s] * batch) if (explicit_lengths or layout_kv != "BSND") else None
    return dict(query=_query_store(q, layout_query), key=key, value=v, sparse_indices=_query_store(idx, layout_query),
                scale_value=(512 + 64) ** -0.5, block_table=bt, actual_seq_lengths_query=lq,
                actual_seq_lengths_kv=lk, query_rope=qr, key_rope=kr, sparse_block_size=sparse_block_size,
                layout_query=layout_query, layout_kv=layout_kv, sparse_mode=3, pre_tokens=INT64_MAX,
                next_tokens=INT64_MAX, attention_mode=2, return_softmax_lse=False, sinks=None,
                lse_includes_sink=False, precision="faithful", probability_rounding="unnormalised")


# ==================================================================================================
# QSFA: kv_quant_sparse_flash_attention

QSFA = "kv_quant_sparse_flash_attention"
QSFA_SOURCE = "docs/numerics/attention.md#kv_quant_sparse_flash_attention; seed 000 (QSFA operator guide); vllm-ascend QSFA custom op"
QSFA_KEY_FORMATS = ("int8", "float8_e4m3fn", "hifloat8")
QSFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 128)
QSFA_SPARSE_BLOCK_SIZES = (1, 2, 4, 8, 16)
_N_QSFA = Names(QSFA, qsfa_case, source=QSFA_SOURCE)


def _repeat_kv_heads(a):
    a["key"] = np.ascontiguousarray(np.repeat(a["key"], 2, axis=-2))
    a["value"] = a["key"]


def _qsfa_rules():
    n = _N_QSFA
    r = []
    r += [is_array(QSFA, p, source=QSFA_SOURCE) for p in ("query", "key", "value", "sparse_indices")]
    r += [is_array(QSFA, p, optional=True, source=QSFA_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv")]
    r.append(dtype_in(QSFA, "query", ("float16", "bfloat16"), source=QSFA_SOURCE))
    r.append(dtype_in(QSFA, "key", ("int8", "uint8", "float8_e4m3fn"), source=QSFA_SOURCE))
    r.append(choice_rule(n, "key_dtype", QSFA_KEY_FORMATS))

    def fp8_array(a):
        return None if dtype_name(a.key) != "float8_e4m3fn" or a.key_dtype == "float8_e4m3fn" else a.key_dtype

    def fp8_change(a):
        a["key"] = a["key"].view(ml_dtypes.float8_e4m3fn)
        a["value"] = a["key"]

    r.append(rule(n, "key_dtype_matches_key", "key_dtype", "value",
                  "a float8_e4m3fn key array holds FP8 codes: key_dtype must be 'float8_e4m3fn'", fp8_array,
                  edit(n, fp8_change)))
    r.append(rule(n, "value_dtype", "value", "dtype", "must have the key's dtype (value follows key)",
                  lambda a: None if a.value.dtype == a.key.dtype else dtype_name(a.value),
                  edit(n, lambda a: a.update(value=a["value"].view(np.uint8))), dtype=True))
    r.append(dtype_in(QSFA, "sparse_indices", ("int32",), source=QSFA_SOURCE))
    r += [dtype_in(QSFA, p, ("int32",), source=QSFA_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv")]
    r += layout_rules(n)
    r += rank_rules(n, extra=(("sparse_indices", 4, 3, "number of dimensions must be 4 for layout_query BSND "
                                                       "and 3 for TND"),))
    r += nonempty_rules(n, ("query", "key"))
    r.append(rule(n, "rope_head_dim_value", "rope_head_dim", "value", "must be one of {0, 64}",
                  lambda a: None if is_int(a.rope_head_dim) and a.rope_head_dim in (0, 64) else a.rope_head_dim,
                  edit(n, setting(rope_head_dim=32))))
    r.append(rule(n, "query_head_dim", "query", "shape",
                  "Q_D (last dimension) must be 512 + rope_head_dim (512 for rope 0, 576 for rope 64)",
                  lambda a: None if a.query.shape[-1] == 512 + a.rope_head_dim else tuple(a.query.shape),
                  edit(n, setting(rope_head_dim=0))))

    def kv_d_change(a):
        a["rope_head_dim"] = 0
        a["query"] = np.ascontiguousarray(a["query"][..., :512])

    r.append(rule(n, "key_head_dim", "key", "shape",
                  "KV_D (bytes per packed row) must be 512 + 2 * rope_head_dim + 16 (528 for rope 0, 656 for rope 64)",
                  lambda a: None if a.key.shape[-1] == 512 + 2 * a.rope_head_dim + 16 else tuple(a.key.shape),
                  edit(n, kv_d_change)))
    r.append(rule(n, "kv_heads", "key", "shape", "KV_N (dimension -2) must be 1",
                  lambda a: None if a.key.shape[-2] == 1 else tuple(a.key.shape),
                  edit(n, _repeat_kv_heads)))
    r.append(rule(n, "query_heads", "query", "shape", f"Q_N (dimension -2) must be {one_of(QSFA_QUERY_HEADS)}",
                  lambda a: None if a.query.shape[-2] in QSFA_QUERY_HEADS else tuple(a.query.shape),
                  edit(n, n_heads=3)))
    r += sparse_indices_rules(n)
    r.append(fixed_value(n, "key_quant_mode", 2, "only 2 (per-tile quantisation) is supported", 1))
    r.append(fixed_value(n, "value_quant_mode", 2, "only 2 (per-tile quantisation) is supported", 1))
    r.append(fixed_value(n, "attention_mode", 2, "only 2 (MLA-absorb: V is the dequantised K NoPE) is supported", 0))
    r.append(fixed_value(n, "quant_scale_repo_mode", 1,
                         "only 1 (combine: scales stored inside the packed row) is supported", 0))
    r.append(fixed_value(n, "tile_size", 128, "only 128 is supported", 64))
    r += mode_rules(n)
    r.append(rule(n, "sparse_block_size_value", "sparse_block_size", "value",
                  f"must be {one_of(QSFA_SPARSE_BLOCK_SIZES)}",
                  lambda a: None if is_int(a.sparse_block_size) and a.sparse_block_size in QSFA_SPARSE_BLOCK_SIZES
                  else a.sparse_block_size, edit(n, setting(sparse_block_size=3))))
    for p in ("key_dequant_scale", "value_dequant_scale"):
        r.append(rule(n, f"{p}_reserved", p, "value", "reserved parameter: must be None",
                      (lambda p_: lambda a: None if a.get(p_) is None else "a tensor")(p),
                      edit(n, setting(**{p: np.ones((1,), np.float32)}))))
    r += length_rules(n)
    # sparse_block_size always divides a PA block size here (block_size % 16 == 0, sbs <= 16): no extra rule.

    def value_shape(a):
        k, v = a.key.shape, a.value.shape
        return None if v == k or v == k[:-1] + (512,) else tuple(v)

    r.append(rule(n, "value_shape", "value", "shape",
                  "must be the packed key itself (same shape) or a NoPE tensor of the key's shape with last "
                  "dimension 512", value_shape,
                  edit(n, lambda a: a.update(value=np.ascontiguousarray(a["value"][..., :100])))))

    def hif8_rope(a):
        return None if a.key_dtype != "hifloat8" or a.rope_head_dim == 64 else a.rope_head_dim

    def hif8_rope_change(a):
        a["rope_head_dim"] = 0
        a["query"] = np.ascontiguousarray(a["query"][..., :512])
        k = a["key"]
        a["key"] = np.ascontiguousarray(np.concatenate([k[..., :512], k[..., 640:]], axis=-1))
        a["value"] = a["key"]

    r.append(rule(n, "hifloat8_rope_head_dim", "rope_head_dim", "value", "HiFloat8 KV supports only rope_head_dim 64",
                  hif8_rope, edit(n, hif8_rope_change, key_fmt="hifloat8", sparse=2048)))
    r.append(rule(n, "hifloat8_sparse_size", "sparse_indices", "shape",
                  "HiFloat8 KV supports only sparse_size 2048",
                  lambda a: None if a.key_dtype != "hifloat8" or a.sparse_indices.shape[-1] == 2048
                  else tuple(a.sparse_indices.shape), edit(n, key_fmt="hifloat8")))
    r.append(scale_value_rule(n))
    r.append(bool_rule(n, "return_softmax_lse"))
    r.append(finite_rule(n, "query"))
    r.append(packed_rows_finite_rule(n))
    r.append(choice_rule(n, "precision", PRECISIONS, source="docs/numerics/attention.md#rounding-points (qsfa's parameter, not torch_npu's)"))
    r.append(choice_rule(n, "probability_rounding", PROBABILITY_ROUNDINGS,
                         source="docs/numerics/open-facts.md#probability_rounding"))
    # chip limits (seed 000 constraint section)
    r.append(rule(n, "a2a3_query_heads", "query", "shape", "Atlas A2/A3 do not support Q_N = 48",
                  lambda a: None if a.query.shape[-2] != 48 else tuple(a.query.shape), edit(n, n_heads=48),
                  chips=("A2", "A3")))
    r.append(rule(n, "a2a3_key_dtype", "key_dtype", "value", "Atlas A2/A3 support only int8 KV",
                  lambda a: None if a.key_dtype == "int8" else a.key_dtype, edit(n, key_fmt="float8_e4m3fn"),
                  chips=("A2", "A3")))
    r.append(rule(n, "950_sparse_block_size", "sparse_block_size", "value", "Ascend 950 supports only sparse_block_size 1",
                  lambda a: None if a.sparse_block_size == 1 else a.sparse_block_size,
                  edit(n, setting(sparse_block_size=2)), chips=("950",)))
    r.append(rule(n, "950_return_softmax_lse", "return_softmax_lse", "value",
                  "Ascend 950 writes only the attention output: return_softmax_lse must be False",
                  lambda a: None if not a.return_softmax_lse else a.return_softmax_lse,
                  edit(n, setting(return_softmax_lse=True)), chips=("950",)))
    r += attention_out_rules(n, lambda a: 512)
    r += lse_out_rules(n)
    return r


QSFA_CONTRACT = Contract(op=QSFA, constraints=_qsfa_rules(), example=lambda rng: {**qsfa_case(), "attention_out": None,
                                                       "softmax_max_out": None, "softmax_sum_out": None},
                         params=params(
    "query:array key:array value:array sparse_indices:array scale_value:float32 key_quant_mode:int value_quant_mode:int"
    " key_dequant_scale:array? value_dequant_scale:array? block_table:array? actual_seq_lengths_query:array?"
    " actual_seq_lengths_kv:array? sparse_block_size:int layout_query:str layout_kv:str sparse_mode:int"
    " pre_tokens:int next_tokens:int attention_mode:int quant_scale_repo_mode:int tile_size:int rope_head_dim:int"
    " return_softmax_lse:bool key_dtype:str precision:str probability_rounding:str attention_out:array?"
    " softmax_max_out:array? softmax_sum_out:array?"), out_buffers=OUT_BUFFERS)


def _qsfa_reference(**args):
    return _ref.kv_quant_sparse_flash_attention(**args)


define_operator(QSFA, QSFA_CONTRACT, outputs=("attention_out", "softmax_max", "softmax_sum"),
                reference=_qsfa_reference, numerics=_chips.qsfa_numerics,
                doc="Sparse flash attention over a packed int8/fp8/HiFloat8 KV cache (QSFA).")


def kv_quant_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, key_quant_mode=2,
                                    value_quant_mode=2, key_dequant_scale=None, value_dequant_scale=None,
                                    block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                                    sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                                    pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2,
                                    quant_scale_repo_mode=1, tile_size=128, rope_head_dim=64,
                                    return_softmax_lse=False, key_dtype="int8", chip=None, backend="reference",
                                    precision="faithful", probability_rounding="unnormalised", attention_out=None,
                                    softmax_max_out=None, softmax_sum_out=None):
    """Sparse flash attention over a packed quantised KV cache (vllm-ascend ``npu_kv_quant_sparse_flash_attention``).

    Computes per query row and head ``softmax(scale_value * q . K_sel^T) @ V_sel`` over the tokens the
    row's ``sparse_indices`` select, with K = dequantised packed rows (NoPE ``decode(code) * tile_scale``
    then the RoPE) and V = the dequantised NoPE (MLA-absorb). Rounding points, token selection and the
    empty-row rules: :mod:`qsfa.reference.attention`.

    Parameters (torch_npu / vllm-ascend names):
      query:  float16 / bfloat16 ``[B, Q_S, Q_N, Q_D]`` (layout_query "BSND") or ``[Q_T, Q_N, Q_D]``
              ("TND"); Q_D = 512 + rope_head_dim; Q_N in {1, 2, 4, 8, 16, 32, 48 (950 only), 64, 128}.
      key:    packed rows, int8 / uint8 / float8_e4m3fn ``[B, KV_S, 1, KV_D]`` (BSND), ``[KV_T, 1, KV_D]``
              (TND) or ``[block_num, block_size, 1, KV_D]`` (PA_BSND); KV_D = 528 (rope 0) or 656 (rope 64)
              bytes: NoPE codes [0, 512), RoPE (query dtype) [512, 640), 4 fp32 scales last.
      value:  the same packed array, or a ``[..., 1, 512]`` NoPE tensor of the key's dtype; not read.
      sparse_indices: int32 ``[B, Q_S, 1, sparse_size]`` / ``[Q_T, 1, sparse_size]``; entry t selects
              tokens [t * sparse_block_size, (t + 1) * sparse_block_size); -1 ends a row.
      scale_value: float, multiplies q . k.
      key_quant_mode, value_quant_mode (2), attention_mode (2), quant_scale_repo_mode (1), tile_size (128),
      pre_tokens / next_tokens (2^63-1): the only supported values.
      key_dequant_scale, value_dequant_scale: reserved, must be None.
      block_table: int32 ``[B, >= ceil(max KV_S / block_size)]`` (PA_BSND only).
      actual_seq_lengths_query / actual_seq_lengths_kv: int32 ``[B]`` lengths, or prefix sums for TND;
              required for TND (and for the KV under PA_BSND).
      sparse_block_size: 1, 2, 4, 8, 16 (Ascend 950: 1). sparse_mode: 3 (right-down causal) or 0.
      rope_head_dim: 0 or 64. return_softmax_lse: also return softmax_max / softmax_sum (not on 950).
      key_dtype: NoPE format, "int8" (A2/A3), "float8_e4m3fn", "hifloat8" (950; HiFloat8 needs
              sparse_size 2048 and rope 64). A float8_e4m3fn key array needs key_dtype="float8_e4m3fn".
      chip: None | "A2" | "A3" | "950": the chip whose limits and rounding points (K, P, output) the call
              models; None = the npu device's chip, else the rule of :func:`qsfa.resolve_chip` (950 when the
              call breaks an A2/A3 limit, else A2). docs/numerics/chips.md.
      backend: "reference" | "npu" | "triton".
      precision: "faithful" (the kernel's rounding points), "exact" (float64, no rounding; float64 out) or
        "benchmark" (a GPU-like fp32 computation for the dual-benchmark standards; docs/numerics/attention.md#rounding-points).
      probability_rounding: **OPEN** - "unnormalised" (default; round exp(s - max), divide by the fp32 sum
              after P @ V, as the kernels do) or "normalised" (round softmax probabilities; vLLM-Ascend's
              test golden).
      attention_out: optional NumPy buffer (an ``np.memmap`` for a long prefill) of the output's shape and dtype,
              C-contiguous, writable, sharing no memory with the inputs; the reference writes the output into it
              chunk by chunk and returns it (reference backend only).
      softmax_max_out, softmax_sum_out: optional NumPy buffers for the LSE outputs, with return_softmax_lse=True:
              float32 (float64 for exact) of their shape, C-contiguous, writable, sharing no memory with another
              argument; written chunk by chunk and returned (reference backend only; qsfa/ops/_out_buffers.py).
    Returns ``(attention_out, softmax_max, softmax_sum)``: attention_out in the query dtype (float64 for
    exact) ``[B, Q_S, Q_N, 512]`` / ``[Q_T, Q_N, 512]``; softmax_max / softmax_sum float32 ``[B, 1, Q_S, Q_N]``
    (BSND) / ``[1, Q_T, Q_N]`` (TND) when return_softmax_lse, else empty ``[0]``.
    """
    args = dict(query=query, key=key, value=value, sparse_indices=sparse_indices, scale_value=scale_value,
                key_quant_mode=key_quant_mode, value_quant_mode=value_quant_mode,
                key_dequant_scale=key_dequant_scale, value_dequant_scale=value_dequant_scale, block_table=block_table,
                actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
                sparse_block_size=sparse_block_size, layout_query=layout_query, layout_kv=layout_kv,
                sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
                attention_mode=attention_mode, quant_scale_repo_mode=quant_scale_repo_mode, tile_size=tile_size,
                rope_head_dim=rope_head_dim, return_softmax_lse=return_softmax_lse, key_dtype=key_dtype,
                precision=precision, probability_rounding=probability_rounding)
    reject_on_device(backend, attention_out, softmax_max_out, softmax_sum_out)
    add_buffers(args, attention_out, softmax_max_out, softmax_sum_out)
    return run(QSFA, args, backend, chip=chip)


# ==================================================================================================
# SFA: sparse_flash_attention

SFA = "sparse_flash_attention"
SFA_SOURCE = "docs/numerics/attention.md#sparse_flash_attention; torch_npu npu_sparse_flash_attention doc and meta registration"
SFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SFA_SPARSE_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
_N_SFA = Names(SFA, sfa_case, source=SFA_SOURCE)


def _sfa_rules():
    n = _N_SFA
    r = []
    r += [is_array(SFA, p, source=SFA_SOURCE) for p in ("query", "key", "sparse_indices")]
    r += [is_array(SFA, p, optional=True, source=SFA_SOURCE)
          for p in ("value", "query_rope", "key_rope", "sinks", "block_table", "actual_seq_lengths_query",
                    "actual_seq_lengths_kv")]
    r.append(dtype_in(SFA, "query", ("float16", "bfloat16"), source=SFA_SOURCE))
    for p in ("key", "value", "query_rope", "key_rope"):
        def same(a, p=p):
            v = a.get(p)
            return None if v is None or v.dtype == a.query.dtype else dtype_name(v)

        def change(a, p=p):
            other = np.float16 if a["query"].dtype == _BF16 else _BF16
            a[p] = a[p].astype(other)

        r.append(rule(n, f"{p}_dtype", p, "dtype", "must have the query's dtype", same, edit(n, change), dtype=True))
    r.append(dtype_in(SFA, "sinks", ("float32",), source=SFA_SOURCE))
    r.append(dtype_in(SFA, "sparse_indices", ("int32",), source=SFA_SOURCE))
    r += [dtype_in(SFA, p, ("int32",), source=SFA_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv")]
    r += layout_rules(n)
    r += rank_rules(n, extra=(("sparse_indices", 4, 3, "number of dimensions must be 4 for layout_query BSND "
                                                       "and 3 for TND"),
                              ("query_rope", 4, 3, "number of dimensions must be that of query")))
    r.append(_ndim_rule(n, "value", lambda a: a.key.ndim, "number of dimensions must be that of key"))
    r.append(_ndim_rule(n, "key_rope", lambda a: a.key.ndim, "number of dimensions must be that of key"))
    r += nonempty_rules(n, ("query", "key", "value"))
    r += _head_dim_and_kv_head_rules(n, 512, "KV_N")
    r.append(rule(n, "query_heads", "query", "shape", f"Q_N (dimension -2) must be {one_of(SFA_QUERY_HEADS)}",
                  lambda a: None if a.query.shape[-2] in SFA_QUERY_HEADS else tuple(a.query.shape),
                  edit(n, n_heads=3)))
    r.append(rule(n, "rope_pair", "key_rope", "value", "query_rope and key_rope must be given together",
                  lambda a: None if (a.get("query_rope") is None) == (a.get("key_rope") is None) else "None"
                  if a.get("key_rope") is None else "a tensor", edit(n, setting(key_rope=None))))
    r.append(rule(n, "query_rope_shape", "query_rope", "shape", "must be query.shape[:-1] + (64,)",
                  lambda a: None if a.get("query_rope") is None or a.query_rope.shape == a.query.shape[:-1] + (64,)
                  else tuple(a.query_rope.shape),
                  edit(n, lambda a: a.update(query_rope=np.ascontiguousarray(a["query_rope"][..., :32])))))
    r += sparse_indices_rules(n)
    r += mode_rules(n)
    r.append(rule(n, "attention_mode_value", "attention_mode", "value",
                  "must be 0 or 2 (2: MLA-absorb, the only mode the NPU kernels document)",
                  lambda a: None if is_int(a.attention_mode) and a.attention_mode in (0, 2) else a.attention_mode,
                  edit(n, setting(attention_mode=1))))
    r.append(rule(n, "sparse_block_size_value", "sparse_block_size", "value",
                  f"must be a power of two in [1, 128]: {one_of(SFA_SPARSE_BLOCK_SIZES)}",
                  lambda a: None if is_int(a.sparse_block_size) and a.sparse_block_size in SFA_SPARSE_BLOCK_SIZES
                  else a.sparse_block_size, edit(n, setting(sparse_block_size=3))))
    r += length_rules(n)
    r.append(sbs_divides_block_size(n))
    r.append(rule(n, "value_shape", "value", "shape", "must have the key's shape",
                  lambda a: None if a.get("value") is None or a.value.shape == a.key.shape else tuple(a.value.shape),
                  edit(n, lambda a: a.update(value=np.ascontiguousarray(a["value"][..., :256])))))
    r.append(rule(n, "key_rope_shape", "key_rope", "shape", "must be key.shape[:-1] + (64,)",
                  lambda a: None if a.get("key_rope") is None or a.key_rope.shape == a.key.shape[:-1] + (64,)
                  else tuple(a.key_rope.shape),
                  edit(n, lambda a: a.update(key_rope=np.ascontiguousarray(a["key_rope"][..., :32])))))

    def lse_pa(a):
        return None if not (a.return_softmax_lse and a.layout_kv == "PA_BSND") else "True with layout_kv PA_BSND"

    r.append(rule(n, "return_softmax_lse_layout", "return_softmax_lse", "value",
                  "softmax_max / softmax_sum are returned only when layout_kv is not PA_BSND (torch_npu doc)", lse_pa,
                  edit(n, setting(return_softmax_lse=True), layout_kv="PA_BSND")))
    r.append(rule(n, "sinks_shape", "sinks", "shape", "must be [Q_N] (one logit per query head)",
                  lambda a: None if a.get("sinks") is None or a.sinks.shape == (a.query.shape[-2],)
                  else tuple(a.sinks.shape), edit(n, setting(sinks=np.zeros((3,), np.float32)))))
    r.append(scale_value_rule(n))
    r.append(bool_rule(n, "return_softmax_lse"))
    r.append(bool_rule(n, "lse_includes_sink"))
    r.append(finite_rule(n, "query"))
    r.append(finite_rule(n, "query_rope"))
    r += [key_rows_finite_rule(n, p) for p in ("key", "value", "key_rope")]
    r.append(rule(  # (finite_rule's violate needs an array in the example; sinks is None there)
        n, "sinks_finite", "sinks", "value", "must not contain inf or nan",
        lambda a: None if a.get("sinks") is None or np.isfinite(a.sinks).all() else "non-finite",
        edit(n, setting(sinks=np.array([np.nan], np.float32)))))
    r.append(choice_rule(n, "precision", PRECISIONS, source="docs/numerics/attention.md#rounding-points (qsfa's parameter, not torch_npu's)"))
    r.append(choice_rule(n, "probability_rounding", PROBABILITY_ROUNDINGS,
                         source="docs/numerics/open-facts.md#probability_rounding"))
    r.append(rule(n, "chip_attention_mode", "attention_mode", "value", "the NPU kernels support only attention_mode 2",
                  lambda a: None if a.attention_mode == 2 else a.attention_mode, edit(n, setting(attention_mode=0)),
                  chips=("A2", "A3", "950")))
    r.append(rule(n, "a2a3_sinks", "sinks", "value", "sinks are supported on Ascend 950 only",
                  lambda a: None if a.get("sinks") is None else "a tensor",
                  edit(n, setting(sinks=np.zeros((1,), np.float32))), chips=("A2", "A3")))
    r += attention_out_rules(n, lambda a: (a["key"] if a.get("value") is None else a["value"]).shape[-1])
    r += lse_out_rules(n)
    return r


SFA_CONTRACT = Contract(op=SFA, constraints=_sfa_rules(), example=lambda rng: {**sfa_case(), "attention_out": None,
                                                       "softmax_max_out": None, "softmax_sum_out": None},
                        params=params(
    "query:array key:array value:array? sparse_indices:array scale_value:float32 block_table:array?"
    " actual_seq_lengths_query:array? actual_seq_lengths_kv:array? query_rope:array? key_rope:array?"
    " sparse_block_size:int layout_query:str layout_kv:str sparse_mode:int pre_tokens:int next_tokens:int"
    " attention_mode:int return_softmax_lse:bool sinks:array? lse_includes_sink:bool precision:str"
    " probability_rounding:str attention_out:array?"
    " softmax_max_out:array? softmax_sum_out:array?"), out_buffers=OUT_BUFFERS)


def _sfa_reference(**args):
    return _ref.sparse_flash_attention(**args)


define_operator(SFA, SFA_CONTRACT, outputs=("attention_out", "softmax_max", "softmax_sum"),
                numerics=_chips.sfa_numerics, reference=_sfa_reference, doc="Sparse flash attention over a float16/bfloat16 KV (SFA).")


def sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                           actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                           key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                           pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2,
                           return_softmax_lse=False, sinks=None, lse_includes_sink=False, chip=None,
                           backend="reference", precision="faithful", probability_rounding="unnormalised",
                           attention_out=None, softmax_max_out=None, softmax_sum_out=None):
    """Sparse flash attention over a float KV (torch_npu ``npu_sparse_flash_attention``).

    Computes per query row and head ``softmax(scale_value * [q, q_rope] . [k, k_rope]^T) @ v`` over the
    tokens selected by ``sparse_indices`` (rules and rounding points: :mod:`qsfa.reference.attention`;
    K and V are already in the query dtype, so the only roundings are P and the output).

    Parameters (torch_npu names):
      query:  float16 / bfloat16 ``[B, Q_S, Q_N, 512]`` (BSND) or ``[Q_T, Q_N, 512]`` (TND), Q_N in
              {1, 2, 4, ..., 128}.
      key:    same dtype, ``[B, KV_S, 1, 512]`` / ``[KV_T, 1, 512]`` / ``[block_num, block_size, 1, 512]``.
      value:  same dtype and shape as key, or None (V = key; torch_npu allows it from CANN 9.2).
      sparse_indices, scale_value, block_table, actual_seq_lengths_query / _kv, sparse_block_size (a power of
              two in [1, 128], dividing block_size under PA_BSND), layout_query, layout_kv, sparse_mode,
              pre_tokens / next_tokens: as :func:`kv_quant_sparse_flash_attention`.
      query_rope / key_rope: optional ``[..., Q_N, 64]`` / ``[..., 1, 64]`` RoPE parts (both or neither).
      attention_mode: 2 (MLA-absorb; the default here, the only mode the NPU documents) or 0 (accepted by the
              reference: the same formula).
      return_softmax_lse: also return softmax_max / softmax_sum (not with layout_kv PA_BSND).
      sinks:  optional float32 ``[Q_N]`` (Ascend 950): one extra logit per head in the softmax denominator,
              ``out = out_without_sink / (1 + exp(sink - lse))``.
      lse_includes_sink: **OPEN** (default False, as FlashMLA / FlashInfer): whether the returned
              softmax_sum includes ``exp(sink - softmax_max)``.
      chip, backend, precision, probability_rounding: as :func:`kv_quant_sparse_flash_attention` (the chip
              selects the P and output roundings).
    attention_out, softmax_max_out, softmax_sum_out: optional output buffers, as
    :func:`kv_quant_sparse_flash_attention`.
    Returns ``(attention_out like query, softmax_max, softmax_sum)`` (LSE shapes as QSFA; empty ``[0]``
    when not requested).
    """
    args = dict(query=query, key=key, value=value, sparse_indices=sparse_indices, scale_value=scale_value,
                block_table=block_table, actual_seq_lengths_query=actual_seq_lengths_query,
                actual_seq_lengths_kv=actual_seq_lengths_kv, query_rope=query_rope, key_rope=key_rope,
                sparse_block_size=sparse_block_size, layout_query=layout_query, layout_kv=layout_kv,
                sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
                attention_mode=attention_mode, return_softmax_lse=return_softmax_lse, sinks=sinks,
                lse_includes_sink=lse_includes_sink, precision=precision,
                probability_rounding=probability_rounding)
    reject_on_device(backend, attention_out, softmax_max_out, softmax_sum_out)
    add_buffers(args, attention_out, softmax_max_out, softmax_sum_out)
    return run(SFA, args, backend, chip=chip)


# ==================================================================================================
# front door, error budget, pipeline


def attention(query, key, value=None, sparse_indices=None, scale_value=None, *, query_rope=None, key_rope=None,
              block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None, sparse_block_size=1,
              layout_query="BSND", layout_kv="BSND", sparse_mode=3, return_softmax_lse=False, sinks=None,
              key_dtype=None, rope_head_dim=None, chip=None, backend="reference", precision="faithful",
              probability_rounding="unnormalised", attention_out=None, softmax_max_out=None,
              softmax_sum_out=None):
    """Sparse attention, routed by the key's dtype exactly as vLLM-Ascend does.

    vllm_ascend/device/device_op.py (``execute_sparse_flash_attention_process``) sends a KV cache of dtype
    int8 / float8_e4m3fn / float8_e5m2 to the kv-quant kernel (QSFA) and any other (float16 / bfloat16) to
    ``npu_sparse_flash_attention`` (SFA) with ``value = key``. qsfa carries HiFloat8 as uint8, so a uint8
    key is QSFA too. A float8_e5m2 key is routed to QSFA and rejected there (QSFA has no E5M2 NoPE).

    Parameters:
      query:       the NoPE query ``[..., Q_N, 512]`` (BSND / TND), float16 / bfloat16.
      key:         packed QSFA rows (one-byte dtype) or a float KV ``[..., 1, 512]``.
      value:       SFA: ``[..., 1, 512]`` or None (V = key); QSFA: ignored (V = dequantised K NoPE).
      sparse_indices, scale_value: as the operators (both required).
      query_rope:  ``[..., Q_N, 64]`` or None. QSFA: concatenated to query; SFA: query_rope.
      key_rope:    SFA only (QSFA's RoPE is inside the packed rows); must be None for QSFA.
      sinks:       SFA only (Ascend 950).
      key_dtype:   QSFA NoPE format; default: "float8_e4m3fn" for an FP8 array, else "int8".
      rope_head_dim: QSFA; default from the packed width (656 -> 64, 528 -> 0).
      block_table, actual_seq_lengths_query / _kv, sparse_block_size, layout_query, layout_kv, sparse_mode,
      return_softmax_lse, chip, backend, precision, probability_rounding: as the operators.
    attention_out, softmax_max_out, softmax_sum_out: optional output buffers (``np.memmap``), as
    :func:`kv_quant_sparse_flash_attention`.
    Returns ``(attention_out, softmax_max, softmax_sum)`` of the operator it routes to.
    """
    from ..reference.attention import is_quant_key

    query, key = _routing_array("query", query), _routing_array("key", key)
    if sparse_indices is None or scale_value is None:
        raise InvalidArgument("value", "sparse_indices" if sparse_indices is None else "scale_value", "None",
                              "sparse_indices and scale_value are required")
    common = dict(block_table=block_table, actual_seq_lengths_query=actual_seq_lengths_query,
                  actual_seq_lengths_kv=actual_seq_lengths_kv, sparse_block_size=sparse_block_size,
                  layout_query=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode,
                  return_softmax_lse=return_softmax_lse, chip=chip, backend=backend, precision=precision,
                  probability_rounding=probability_rounding, attention_out=attention_out,
                  softmax_max_out=softmax_max_out, softmax_sum_out=softmax_sum_out)
    if is_quant_key(key):
        if key_rope is not None:
            raise InvalidArgument("value", "key_rope", "a tensor",
                                  "a packed QSFA key carries its RoPE inside the rows; pass key_rope=None")
        if sinks is not None:
            raise InvalidArgument("value", "sinks", "a tensor", "sinks are an SFA (float KV) feature")
        q = query
        if query_rope is not None:
            q = _concat_last(query, _query_rope_like(query, query_rope))
        if rope_head_dim is None:
            rope_head_dim = {656: 64, 528: 0}.get(int(key.shape[-1]) if key.ndim else 0, 64)
        if key_dtype is None:
            key_dtype = "float8_e4m3fn" if dtype_name(key) == "float8_e4m3fn" else "int8"
        return kv_quant_sparse_flash_attention(q, key, key if value is None else value, sparse_indices, scale_value,
                                               rope_head_dim=rope_head_dim, key_dtype=key_dtype, **common)
    return sparse_flash_attention(query, key, value, sparse_indices, scale_value, query_rope=query_rope,
                                  key_rope=key_rope, sinks=sinks, **common)


def _routing_array(name, v):
    """``query`` / ``key`` as :func:`attention` routes them: a NumPy array or torch tensor (a NumPy scalar is the 0-d
    array it stands for, as for the operators); anything else is refused by name before the routing reads its
    dtype."""
    from .._contract import Param

    if is_torch(v):
        return v
    if isinstance(v, np.generic):
        v = np.asarray(v)
    p = Param(name, "array")
    bad = p.offending(v)
    if bad is not None:
        raise InvalidDtype("type", name, bad, p.reason)
    return v


def _query_rope_like(query, query_rope):
    """QSFA takes the query with its RoPE part concatenated: ``query_rope`` must be an array of the query's kind
    (NumPy / torch), rank, leading dimensions and dtype, or the concatenation fails (or promotes) inside NumPy."""
    query_rope = _routing_array("query_rope", query_rope)
    if is_torch(query) != is_torch(query_rope):
        kinds = {True: "a torch tensor", False: "a NumPy array"}
        raise InvalidDtype("type", "query_rope", Raw(kinds[is_torch(query_rope)]),
                           f"must be of the query's kind ({kinds[is_torch(query)]})")
    if query_rope.ndim != query.ndim:
        raise InvalidArgument("dim", "query_rope", query_rope.ndim, f"number of dimensions must be that of query "
                                                                    f"({query.ndim})")
    if tuple(query_rope.shape[:-1]) != tuple(query.shape[:-1]):
        raise InvalidArgument("shape", "query_rope", tuple(query_rope.shape),
                              f"must be query.shape[:-1] + (rope,) = {tuple(query.shape[:-1])} + (rope,)")
    if dtype_name(query_rope) != dtype_name(query):
        raise InvalidDtype("dtype", "query_rope", dtype_name(query_rope), f"must be the query's dtype "
                                                                          f"({dtype_name(query)})")
    return query_rope


def _concat_last(a, b):
    if is_torch(a):
        import torch

        return torch.cat([a, b], dim=-1)
    return np.concatenate([np.asarray(a), np.asarray(b)], axis=-1)


def attention_error_budget(query, key, value=None, sparse_indices=None, scale_value=None, **kwargs):
    """Per output element ``faithful - exact`` (float64 NumPy array) for the arguments of :func:`attention`.

    Runs the reference twice (``precision="faithful"`` and ``"exact"``; any ``precision`` / ``backend``
    argument is ignored) and returns the difference: the error the kernel's rounding points cost on this
    input. Rows that select nothing give 0. The derivation of a bound for it is in the docstring of
    :func:`qsfa.reference.attention.attention_error_budget` and checked in tests/test_attention_precision.py.
    """
    kwargs = dict(kwargs)
    kwargs.pop("precision", None)
    kwargs.pop("backend", None)
    kwargs["return_softmax_lse"] = False
    f = attention(query, key, value, sparse_indices, scale_value, precision="faithful", **kwargs)[0]
    e = attention(query, key, value, sparse_indices, scale_value, precision="exact", **kwargs)[0]
    f = to_numpy(f) if is_torch(f) else f
    e = to_numpy(e) if is_torch(e) else e
    return f.astype(np.float64) - e


#: the end-to-end C8 pipeline (a plain function over the dispatching operators)
c8_pipeline = _ref_pipeline.c8_pipeline


# The indexers and the LSE merge live in their own modules (see the docstring); their public names
# are re-exported so the attention group's import paths keep working.
from .indexer import (  # noqa: E402,F401
    indexer_case, LI_CONTRACT, lightning_indexer, QLI_CONTRACT, quant_lightning_indexer,
)
from .lse import merge_attention_lse, merge_case, MERGE_CONTRACT  # noqa: E402,F401
