"""Front doors of DeepSeek-V4 shared-KV sparse attention (docs/numerics/attention-v4.md).

* ``sparse_flash_mla`` - aclnnSparseFlashMla / ``cann_ops_transformer.ops.sparse_flash_mla`` (SWA / CSA / HCA over a
  float16 / bfloat16 KV; A2, A3, 950);
* ``sparse_attn_sharedkv`` - the experimental ``npu_sparse_attn_sharedkv`` (vLLM-Ascend ``_C_ascend`` / ``custom``
  twins; A3): the same computation with other argument conventions (``seqused_kv`` for the window cache, no
  ``cmp_residual_kv``: the compressed cache holds ``floor(seqused_kv / cmp_ratio)`` tokens and the remainder is
  ``seqused_kv % cmp_ratio``; layout ``PA_ND``).

``quant_sparse_flash_mla`` (aclnnQuantSparseFlashMla, Ascend 950: HiFloat8 Q / K / V with per-tensor descales) shares
the token selection and has its own arithmetic (:mod:`qsfa.reference.sharedkv_hif8`).

Both run one reference, :func:`qsfa.reference.sharedkv.sharedkv_attention`; each has its own contract (every rule of
its public doc, chip limits as ``chips=`` rules) and case builder. ``metadata`` (the ``*_metadata`` operator's task
list) is scheduling, not numerics: the reference ignores it. Tests: tests/test_sharedkv.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import dtype_in, is_array
from .. import chips as _chips
from .._contract import Contract, one_of, params
from .._dispatch import define_operator, run
from ..reference import sharedkv as _ref
from ._attention_rules import (
    _kv_storage, _Q_DTYPES, bool_rule, choice_rule, edit, finite_rule, is_int, is_real, Names, rule, setting,
)
from ._out_buffers import add_buffers, attention_out_rules

__all__ = [
    "sparse_flash_mla",
    "sparse_attn_sharedkv",
    "sfm_case",
    "sas_case",
    "mq_case",
    "kqs_case",
    "kv_quant_sparse_attn_sharedkv",
    "KQS_CONTRACT",
    "mixed_quant_sparse_flash_mla",
    "MQ_CONTRACT",
    "SFM_CONTRACT",
    "SAS_CONTRACT",
    "quant_sparse_flash_mla",
    "QS_CONTRACT",
    "qs_case",
]

SFM = "sparse_flash_mla"
SAS = "sparse_attn_sharedkv"
MQ = "mixed_quant_sparse_flash_mla"
KQS = "kv_quant_sparse_attn_sharedkv"
QS = "quant_sparse_flash_mla"
SFM_SOURCE = ("docs/numerics/attention-v4.md#sparse_flash_mla; cannmirror/ops-transformer "
              "attention/sparse_flash_mla/docs/aclnnSparseFlashMla.md")
MQ_SOURCE = ("docs/numerics/attention-v4.md#mixed_quant_sparse_flash_mla; cannmirror/ops-transformer "
             "attention/mixed_quant_sparse_flash_mla/README.md")
KQS_SOURCE = ("docs/numerics/attention-v4.md#kv_quant_sparse_attn_sharedkv; vllm-project/vllm-ascend "
              "csrc/attention/kv_quant_sparse_attn_sharedkv/README.md")
QS_SOURCE = ("docs/numerics/attention-v4.md#quant_sparse_flash_mla; cannmirror/ops-transformer@5992a2b "
             "attention/quant_sparse_flash_mla/op_host/quant_sparse_flash_mla_check_*.cpp")
SAS_SOURCE = ("docs/numerics/attention-v4.md#sparse_attn_sharedkv; cannmirror/ops-transformer "
              "experimental/attention/sparse_attn_sharedkv/README.md")
HEAD_DIM = 512
TOPK_SIZES = (512, 1024)
MAX_HEADS = 128
_POW2_HEADS = tuple(2 ** i for i in range(8))
_PA = {SFM: "PA_BBND", SAS: "PA_ND", MQ: "PA_BBND", KQS: "PA_ND", QS: "PA_BBND"}
_KV_BYTES = {1: _ref.MODE1_BYTES, 2: _ref.MODE2_BYTES}


# ==================================================================================================
# case builders


def _cu(per_batch):
    return np.concatenate([[0], np.cumsum(per_batch)]).astype(np.int32)


def _case(op, *, scenario="CSA", layout_q="BSND", layout_kv=None, qdtype="bfloat16", batch=2, s1=2, s2=9, n1=2,
          k=512, block_size=16, ratio=None, seed=0, quant_mode=None):
    pa = _PA[op]
    layout_kv = layout_kv or ("BSND" if op == SFM else pa)
    quant_mode = quant_mode or (2 if layout_kv == pa else 1)
    ratio = ratio if ratio is not None else {"SWA": 1, "CSA": 4, "HCA": 128}[scenario]
    rng = np.random.default_rng(seed)
    qdt = _Q_DTYPES["bfloat16" if op == QS else qdtype]
    q = rng.uniform(-1, 1, (batch, s1, n1, HEAD_DIM)).astype(qdt)
    ori = rng.uniform(-1, 1, (batch, s2, 1, HEAD_DIM)).astype(qdt)
    s3 = s2 // ratio
    has_cmp = scenario != "SWA"
    cmp = rng.uniform(-1, 1, (batch, max(s3, 1), 1, HEAD_DIM)).astype(qdt) if has_cmp else None
    if op == QS:  # HiFloat8 codes (TA rounding) of the same values, carried in uint8
        from ..reference.formats import encode

        q, ori = encode(q, "hifloat8"), encode(ori, "hifloat8")
        cmp = None if cmp is None else encode(cmp, "hifloat8")
    a = dict(q=q if layout_q == "BSND" else np.ascontiguousarray(q.reshape(-1, n1, HEAD_DIM)))
    a.update(ori_kv=ori, cmp_kv=cmp, ori_sparse_indices=None, cmp_sparse_indices=None, ori_block_table=None,
             cmp_block_table=None, cu_seqlens_q=_cu([s1] * batch) if layout_q == "TND" else None,
             cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None)
    if layout_kv == "TND":
        a["ori_kv"] = np.ascontiguousarray(ori.reshape(-1, 1, HEAD_DIM))
        a["cu_seqlens_ori_kv"] = _cu([s2] * batch)
        if has_cmp:
            a["cmp_kv"] = np.ascontiguousarray(cmp.reshape(-1, 1, HEAD_DIM))
            a["cu_seqlens_cmp_kv"] = _cu([cmp.shape[1]] * batch)
    elif layout_kv == pa:
        a["ori_kv"], a["ori_block_table"] = _kv_storage(ori, layout_kv="PA", block_size=block_size, kv_s=s2)
        if has_cmp:
            a["cmp_kv"], a["cmp_block_table"] = _kv_storage(cmp, layout_kv="PA", block_size=block_size,
                                                            kv_s=cmp.shape[1])
    if scenario == "CSA":
        idx = np.full((batch, s1, 1, k), -1, np.int32)
        for i in range(s1):  # as an indexer gives: distinct tokens below the row's causal bound, then -1
            bound = min(max((s2 - s1 + i + 1) // ratio, 0), s3, k)
            for b in range(batch):
                idx[b, i, 0, :bound] = rng.permutation(bound)
        a["cmp_sparse_indices"] = idx if layout_q == "BSND" else np.ascontiguousarray(idx.reshape(-1, 1, k))
    lens = np.full(batch, s2, np.int32)
    if op == MQ:  # quantised rows of the same values
        for p in ("ori_kv", "cmp_kv"):
            if a[p] is not None:
                a[p] = (_ref.pack_mode1(a[p]) if quant_mode == 1 else _pack_mode2(a[p])).view(_FP8)
    if op == KQS:
        for p in ("ori_kv", "cmp_kv"):
            if a[p] is not None:
                a[p] = _ref.pack_640(a[p]).view(_FP8)
    if op in (SFM, MQ, QS):
        a.update(seqused_ori_kv=lens if layout_kv == pa else None,
                 seqused_cmp_kv=np.full(batch, s3, np.int32) if has_cmp and layout_kv == pa else None,
                 cmp_residual_kv=np.full(batch, s2 % ratio, np.int32) if has_cmp else None,
                 ori_topk_length=None, cmp_topk_length=None)
    else:
        a.update(seqused_kv=lens if layout_kv == pa else None)
    a.update(sinks=rng.uniform(-1, 1, n1).astype(np.float32), metadata=np.zeros(1024, np.int32),
             softmax_scale=HEAD_DIM ** -0.5, cmp_ratio=ratio, ori_mask_mode=4, cmp_mask_mode=3 if has_cmp else 0,
             ori_win_left=127, ori_win_right=0, layout_q=layout_q, layout_kv=layout_kv)
    if op in (SFM, MQ, QS):
        a["topk_value_mode"] = 1
    if op == QS:
        a.update(quant_mode=1, q_descale=np.array([0.75], np.float32), ori_kv_descale=np.array([1.25], np.float32),
                 cmp_kv_descale=np.array([0.5], np.float32) if has_cmp else None)
    if op == MQ:
        a.update(quant_mode=quant_mode, rope_head_dim=64)
    if op == KQS:
        a.update(kv_quant_mode=1, tile_size=64, rope_head_dim=64)
    a.update(return_softmax_lse=False, precision="faithful")
    return a


_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _pack_mode2(blocks):
    """bf16 ``[block_num, block_size, 1, 512]`` -> quant_mode 2 blocks ``[block_num, block_size, 1, 584]``."""
    from ..reference import flashmla_model1 as m1

    nb, bs = blocks.shape[0], blocks.shape[1]
    return np.ascontiguousarray(m1.quantize(blocks)[:, : bs * _ref.MODE2_BYTES]).reshape(nb, bs, 1, _ref.MODE2_BYTES)


def sfm_case(**kw):
    """A small valid ``sparse_flash_mla`` argument set: scenario "SWA" / "CSA" / "HCA", layouts, dtype, sizes."""
    return _case(SFM, **kw)


def mq_case(**kw):
    """A small valid ``mixed_quant_sparse_flash_mla`` argument set (as :func:`sfm_case`; default layout_kv PA_BBND,
    quant_mode 2 = the MODEL1 blocks, 64 query heads; quant_mode=1 gives 608-byte rows)."""
    kw.setdefault("n1", 64)
    return _case(MQ, **kw)


def kqs_case(**kw):
    """A small valid ``kv_quant_sparse_attn_sharedkv`` argument set (sharedkv conventions, 640-byte rows,
    layout PA_ND, 64 query heads)."""
    kw.setdefault("n1", 64)
    return _case(KQS, **kw)


def qs_case(**kw):
    """A small valid ``quant_sparse_flash_mla`` argument set (as :func:`sfm_case`: HiFloat8 codes of the same
    uniform values, descales 0.75 / 1.25 / 0.5, default layout_kv PA_BBND, 64 query heads)."""
    kw.setdefault("n1", 64)
    kw.setdefault("layout_kv", "PA_BBND")
    return _case(QS, **kw)


def sas_case(**kw):
    """A small valid ``sparse_attn_sharedkv`` argument set (as :func:`sfm_case`; default layout_kv "PA_ND" and
    64 query heads, the README's only values)."""
    kw.setdefault("n1", 64)
    return _case(SAS, **kw)


# ==================================================================================================
# rules (shared by both contracts; names that differ: the PA layout, seqused_kv vs seqused_ori_kv / _cmp_kv)


def _batch(a):
    return int(a.q.shape[0]) if a.layout_q == "BSND" else int(np.asarray(a.cu_seqlens_q).size) - 1


def _kv_ndim(a):
    return 3 if a.layout_kv == "TND" else 4


def _rank(n, p, want, reason):
    def check(a):
        v = a.get(p)
        return None if v is None or v.ndim == want(a) else v.ndim

    return rule(n, f"{p}_ndim", p, "dim", reason, check, edit(n, lambda a: a.update({p: a[p][None]})))


def _len_rule(n, p, size, reason):
    """A [size(a)] int32 length vector; violated by one of three entries (the cases have B = 2)."""
    def check(a):
        v = a.get(p)
        return None if v is None or v.shape == (size(a),) else tuple(v.shape)

    return rule(n, f"{p}_shape", p, "shape", reason, check, edit(n, setting(**{p: np.zeros(3, np.int32)})))


def _rules(op):
    mq = op == MQ
    kqs = op == KQS
    quant = mq or kqs
    qs = op == QS  # HiFloat8 q / K / V codes with per-tensor descales
    sfm = op in (SFM, MQ, QS)  # the sparse_flash_mla parameter set (seqused_ori_kv / _cmp_kv, cmp_residual_kv, ...)
    src = {SFM: SFM_SOURCE, SAS: SAS_SOURCE, MQ: MQ_SOURCE, KQS: KQS_SOURCE, QS: QS_SOURCE}[op]
    pa = _PA[op]
    n = Names(op, {SFM: sfm_case, SAS: sas_case, MQ: mq_case, KQS: kqs_case, QS: qs_case}[op], source=src)
    lens_kv = "seqused_ori_kv" if sfm else "seqused_kv"
    arrays = ["ori_sparse_indices", "cmp_sparse_indices", "ori_block_table", "cmp_block_table", "cu_seqlens_q",
              "cu_seqlens_ori_kv", "cu_seqlens_cmp_kv", "seqused_q", lens_kv, "metadata"]
    if sfm:
        arrays += ["seqused_cmp_kv", "cmp_residual_kv", "ori_topk_length", "cmp_topk_length"]
    r = [is_array(op, "q", source=src)]
    r += [is_array(op, p, optional=True, source=src) for p in ["ori_kv", "cmp_kv", "sinks"] + arrays]
    required = ["ori_kv"] + ([] if op in (SFM, QS) else ["softmax_scale", "cmp_ratio"]) + (
        ["quant_mode", "rope_head_dim"] if mq else []) + (["tile_size"] if kqs else []) + (
        ["quant_mode", "q_descale", "ori_kv_descale"] if qs else [])
    for p in required:
        r.append(rule(n, f"{p}_required", p, "value",
                      "must be given (every scenario reads ori_kv)" if p == "ori_kv" else
                      "must be given (the public signature defaults to None but names no value for it)",
                      (lambda p_: lambda a: None if a.get(p_) is not None else "None")(p), edit(n, setting(**{p: None}))))
    if qs:  # op_host quant_sparse_flash_mla_def.cpp: q / ori_kv / cmp_kv DT_HIFLOAT8 (NumPy carrier: uint8)
        r += [dtype_in(op, p, ("uint8",), source=src) for p in ("q", "ori_kv", "cmp_kv")]
        r += [is_array(op, p, optional=True, source=src) for p in _QS_DESCALES]
        r += [dtype_in(op, p, ("float32",), source=src) for p in _QS_DESCALES]
        r += _qs_rules(n)
    else:
        r.append(dtype_in(op, "q", ("bfloat16",) if quant else ("float16", "bfloat16"), source=src))
    for p in ("ori_kv", "cmp_kv") if quant else ():
        r.append(dtype_in(op, p, ("float8_e4m3fn", "uint8", "int8"), source=src))
    if kqs:
        r.append(choice_rule(n, "kv_quant_mode", (1,), bad=2))
        r.append(choice_rule(n, "tile_size", (64,), bad=32))
        r.append(choice_rule(n, "rope_head_dim", (64,), bad=0))
    if quant:
        r.append(rule(n, "cmp_kv_dtype_same", "cmp_kv", "dtype", "must have ori_kv's dtype",
                      lambda a: None if a.get("cmp_kv") is None or a.cmp_kv.dtype == a.ori_kv.dtype
                      else dtype_name(a.cmp_kv), edit(n, lambda a: a.update(cmp_kv=a["cmp_kv"].view(np.uint8))),
                      dtype=True))
    if mq:
        r.append(choice_rule(n, "quant_mode", _ref.QUANT_MODES, bad=3))
        r.append(choice_rule(n, "rope_head_dim", (64,), bad=32))
    for p in ("ori_kv", "cmp_kv") if not (quant or qs) else ():
        def same(a, p=p):
            v = a.get(p)
            return None if v is None or v.dtype == a.q.dtype else dtype_name(v)

        def change(a, p=p):
            a[p] = a[p].astype(np.float16 if a["q"].dtype != np.float16 else _Q_DTYPES["bfloat16"])

        r.append(rule(n, f"{p}_dtype", p, "dtype", "must have q's dtype", same, edit(n, change), dtype=True))
    r.append(dtype_in(op, "sinks", ("float32",), source=src))
    r += [dtype_in(op, p, ("int32",), source=src) for p in arrays]
    r.append(choice_rule(n, "layout_q", ("BSND", "TND"), bad="BNSD"))
    r.append(choice_rule(n, "layout_kv", ("BSND", "TND", pa), bad="PA_NZ"))
    r.append(rule(n, "layout_agreement", "layout_kv", "value",
                  f"without PageAttention ({pa}) layout_kv must equal layout_q",
                  lambda a: None if a.layout_kv in (pa, a.layout_q) else f"{a.layout_kv} with layout_q {a.layout_q}",
                  edit(n, setting(layout_kv="TND"))))
    if mq:
        r.append(rule(n, "quant_mode_layout", "quant_mode", "value",
                      "quant_mode 2 (MODEL1 blocks: every token's data, then every token's scales) needs layout_kv "
                      "PA_BBND", lambda a: None if a.quant_mode != 2 or a.layout_kv == "PA_BBND"
                      else f"2 with layout_kv {a.layout_kv}",
                      edit(n, setting(quant_mode=2), quant_mode=1, layout_kv="BSND")))
    # attributes
    r.append(rule(n, "softmax_scale_value", "softmax_scale", "value", "must be a finite real number",
                  lambda a: None if is_real(a.softmax_scale) and np.isfinite(a.softmax_scale) else a.softmax_scale,
                  edit(n, setting(softmax_scale=float("nan")))))
    r.append(rule(n, "cmp_ratio_value", "cmp_ratio", "value", "must be an integer in [1, 128]",
                  lambda a: None if is_int(a.cmp_ratio) and 1 <= a.cmp_ratio <= 128 else a.cmp_ratio,
                  edit(n, setting(cmp_ratio=0))))
    r.append(choice_rule(n, "ori_mask_mode", (0, 3, 4), bad=1))
    r.append(choice_rule(n, "cmp_mask_mode", (0, 3), bad=1))
    for p in ("ori_win_left", "ori_win_right"):
        r.append(rule(n, f"{p}_value", p, "value", "must be -1 (unlimited) or >= 0",
                      (lambda p_: lambda a: None if is_int(a[p_]) and a[p_] >= -1 else a[p_])(p), edit(n, setting(**{p: -2}))))
    if sfm:
        r.append(choice_rule(n, "topk_value_mode", (1,), bad=0))
    r.append(_rank(n, "q", lambda a: 4 if a.layout_q == "BSND" else 3,
                   "must be [B, S1, N1, D] (layout_q BSND) or [T1, N1, D] (TND)"))
    for p in ("ori_kv", "cmp_kv"):
        r.append(_rank(n, p, _kv_ndim, f"must be [B, S, N2, D] (BSND), [T, N2, D] (TND) or "
                                       f"[block_num, block_size, N2, D] ({pa})"))
    for p in ("q", "ori_kv", "cmp_kv"):
        def empty(a, p=p):
            v = a.get(p)
            return None if v is None or v.size else tuple(v.shape)

        r.append(rule(n, f"{p}_nonempty", p, "shape", "empty tensors are not supported", empty,
                      edit(n, (lambda p_: lambda a: a.update({p_: a[p_][:0]}))(p))))
    for p in ("ori_kv", "cmp_kv") if kqs else ():
        r.append(rule(n, f"{p}_row_bytes", p, "shape", f"the last dimension must be {_ref.KVQ_BYTES}",
                      (lambda p_: lambda a: None if a.get(p_) is None or a[p_].shape[-1] == _ref.KVQ_BYTES
                       else tuple(a[p_].shape))(p),
                      edit(n, (lambda p_: lambda a: a.update({p_: np.ascontiguousarray(a[p_][..., :512])}))(p))))
    for p in ("ori_kv", "cmp_kv") if mq else ():
        r.append(rule(n, f"{p}_row_bytes", p, "shape",
                      f"the last dimension must be {_ref.MODE1_BYTES} (quant_mode 1) or {_ref.MODE2_BYTES} (quant_mode 2)",
                      (lambda p_: lambda a: None if a.get(p_) is None or a[p_].shape[-1] == _KV_BYTES[a.quant_mode]
                       else tuple(a[p_].shape))(p),
                      edit(n, (lambda p_: lambda a: a.update({p_: np.ascontiguousarray(a[p_][..., :512])}))(p))))
    for p in ("q",) if quant else ("q", "ori_kv", "cmp_kv"):
        r.append(rule(n, f"{p}_head_dim", p, "shape", f"D (the last dimension) must be {HEAD_DIM}",
                      (lambda p_: lambda a: None if a.get(p_) is None or a[p_].shape[-1] == HEAD_DIM
                       else tuple(a[p_].shape))(p),
                      edit(n, (lambda p_: lambda a: a.update({p_: np.ascontiguousarray(a[p_][..., :256])}))(p))))
    for p in ("ori_kv", "cmp_kv"):
        r.append(rule(n, f"{p}_heads", p, "shape", "N2 (dimension -2) must be 1",
                      (lambda p_: lambda a: None if a.get(p_) is None or a[p_].shape[-2] == 1
                       else tuple(a[p_].shape))(p),
                      edit(n, (lambda p_: lambda a: a.update({p_: np.ascontiguousarray(np.repeat(a[p_], 2, -2))}))(p))))
    r.append(rule(n, "q_heads", "q", "shape", f"N1 (dimension -2) must be in [1, {MAX_HEADS}]",
                  lambda a: None if 1 <= a.q.shape[-2] <= MAX_HEADS else tuple(a.q.shape),
                  edit(n, n1=MAX_HEADS + 1)))
    # scenarios and the arguments each needs
    r.append(rule(n, "cmp_sparse_indices_needs_cmp_kv", "cmp_sparse_indices", "value",
                  "is given only with cmp_kv (CSA: ori_kv + cmp_kv + cmp_sparse_indices)",
                  lambda a: None if a.get("cmp_sparse_indices") is None or a.get("cmp_kv") is not None else "a tensor",
                  edit(n, setting(cmp_kv=None))))
    r.append(rule(n, "ori_sparse_indices_unsupported", "ori_sparse_indices", "value",
                  "sparse selection over ori_kv is not supported: pass None",
                  lambda a: None if a.get("ori_sparse_indices") is None else "a tensor",
                  edit(n, setting(ori_sparse_indices=np.zeros((1,), np.int32)))))
    if sfm:
        for p in ("ori_topk_length", "cmp_topk_length"):
            r.append(rule(n, f"{p}_reserved", p, "value", "is reserved: pass None or an empty tensor",
                          (lambda p_: lambda a: None if a.get(p_) is None or a[p_].size == 0 else "a non-empty tensor")(p),
                          edit(n, setting(**{p: np.zeros((2,), np.int32)}))))
    r.append(_rank(n, "cmp_sparse_indices", lambda a: 4 if a.layout_q == "BSND" else 3,
                   "must be [B, S1, N2, K] (layout_q BSND) or [T1, N2, K] (TND)"))
    r.append(rule(n, "cmp_sparse_indices_shape", "cmp_sparse_indices", "shape", "must be q.shape[:-2] + (1, K), K >= 1",
                  lambda a: None if a.get("cmp_sparse_indices") is None or (
                      a.cmp_sparse_indices.shape[:-2] == a.q.shape[:-2] and a.cmp_sparse_indices.shape[-2] == 1
                      and a.cmp_sparse_indices.shape[-1] >= 1) else tuple(a.cmp_sparse_indices.shape),
                  edit(n, lambda a: a.update(cmp_sparse_indices=np.ascontiguousarray(a["cmp_sparse_indices"][:1])))))
    r.append(rule(n, "cmp_sparse_indices_values", "cmp_sparse_indices", "value", "entries must be >= -1 (-1: none)",
                  lambda a: None if a.get("cmp_sparse_indices") is None or not a.cmp_sparse_indices.size
                  or a.cmp_sparse_indices.min() >= -1 else int(a.cmp_sparse_indices.min()),
                  edit(n, lambda a: a["cmp_sparse_indices"].__setitem__((0,) * a["cmp_sparse_indices"].ndim, -2))))
    # lengths and tables
    r.append(rule(n, "cu_seqlens_q_required", "cu_seqlens_q", "value", "is required when layout_q is TND",
                  lambda a: None if a.layout_q != "TND" or a.get("cu_seqlens_q") is not None else "None",
                  edit(n, setting(cu_seqlens_q=None), layout_q="TND", layout_kv=pa)))
    r.append(rule(n, "cu_seqlens_q_values", "cu_seqlens_q", "value",
                  "must be [B + 1] prefix sums: starts at 0, non-decreasing, last = T1 (q.shape[0])",
                  lambda a: None if a.get("cu_seqlens_q") is None or a.layout_q != "TND" or _prefix_ok(
                      a.cu_seqlens_q, a.q.shape[0]) else "not prefix sums of q's tokens",
                  edit(n, lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][::-1].copy()), layout_q="TND",
                       layout_kv=pa)))
    r.append(rule(n, "cu_seqlens_ori_kv_required", "cu_seqlens_ori_kv", "value", "is required when layout_kv is TND",
                  lambda a: None if a.layout_kv != "TND" or a.get("cu_seqlens_ori_kv") is not None else "None",
                  edit(n, setting(cu_seqlens_ori_kv=None), layout_q="TND", layout_kv="TND")))
    r.append(rule(n, "cu_seqlens_cmp_kv_required", "cu_seqlens_cmp_kv", "value",
                  "is required when layout_kv is TND and cmp_kv is given",
                  lambda a: None if a.layout_kv != "TND" or a.get("cmp_kv") is None
                  or a.get("cu_seqlens_cmp_kv") is not None else "None",
                  edit(n, setting(cu_seqlens_cmp_kv=None), layout_q="TND", layout_kv="TND")))
    for p, kv in (("cu_seqlens_ori_kv", "ori_kv"), ("cu_seqlens_cmp_kv", "cmp_kv")):
        r.append(rule(n, f"{p}_values", p, "value",
                      f"must be [B + 1] prefix sums of {kv}'s tokens (starts at 0, non-decreasing, last <= T)",
                      (lambda p_, kv_: lambda a: None if a.get(p_) is None or a.layout_kv != "TND" or a.get(kv_) is None
                       or (np.asarray(a[p_]).size == _batch(a) + 1 and _prefix_ok(a[p_], a[kv_].shape[0], le=True))
                       else "not prefix sums of the batch's tokens")(p, kv),
                      edit(n, (lambda p_: lambda a: a.update({p_: a[p_][:-1]}))(p), layout_q="TND", layout_kv="TND")))
    r.append(rule(n, f"{lens_kv}_required", lens_kv, "value", f"is required when layout_kv is {pa}",
                  lambda a: None if a.layout_kv != pa or a.get(lens_kv) is not None else "None",
                  edit(n, setting(**{lens_kv: None}), layout_kv=pa)))
    r.append(rule(n, "ori_block_table_required", "ori_block_table", "value", f"is required when layout_kv is {pa}",
                  lambda a: None if a.layout_kv != pa or a.get("ori_block_table") is not None else "None",
                  edit(n, setting(ori_block_table=None), layout_kv=pa)))
    r.append(rule(n, "cmp_block_table_required", "cmp_block_table", "value",
                  f"is required when layout_kv is {pa} and cmp_kv is given",
                  lambda a: None if a.layout_kv != pa or a.get("cmp_kv") is None
                  or a.get("cmp_block_table") is not None else "None",
                  edit(n, setting(cmp_block_table=None), layout_kv=pa)))
    if qs:  # quant_sparse_flash_mla_check_single_para.cpp: "should be in range (0, 1024]"
        r.append(rule(n, "block_size", "ori_kv", "shape", f"a {pa} block size must be in [1, 1024]",
                      lambda a: None if a.layout_kv != pa or all(
                          1 <= a[p].shape[1] <= 1024 for p in ("ori_kv", "cmp_kv") if a.get(p) is not None)
                      else tuple(a.ori_kv.shape), edit(n, layout_kv=pa, block_size=1025, s2=1100)))
    else:
        r.append(rule(n, "block_size", "ori_kv", "shape", f"a {pa} block size must be a multiple of 16 in [16, 1024]",
                      lambda a: None if a.layout_kv != pa or all(
                          a[p].shape[1] % 16 == 0 and 16 <= a[p].shape[1] <= 1024 for p in ("ori_kv", "cmp_kv")
                          if a.get(p) is not None) else tuple(a.ori_kv.shape),
                      edit(n, layout_kv=pa, block_size=8)))
    batch_vecs = ["seqused_q", lens_kv] + (["seqused_cmp_kv", "cmp_residual_kv"] if sfm else [])
    for p in batch_vecs:
        r.append(_len_rule(n, p, _batch, "must be [B]"))
    r.append(rule(n, "batch", "ori_kv", "shape", "a BSND ori_kv / cmp_kv must have q's batch size",
                  lambda a: None if a.layout_kv != "BSND" or all(a[p].shape[0] == _batch(a) for p in ("ori_kv", "cmp_kv")
                                                                  if a.get(p) is not None) else tuple(a.ori_kv.shape),
                  edit(n, lambda a: a.update(ori_kv=np.ascontiguousarray(a["ori_kv"][:1])), layout_kv="BSND")))
    for p, kv, want_len in (("ori_block_table", "ori_kv", lambda a: _ori_lens(a, lens_kv)),
                            ("cmp_block_table", "cmp_kv", lambda a: _cmp_lens(a, lens_kv, sfm))):
        r.append(rule(n, f"{p}_shape", p, "shape",
                      "must be [B, >= ceil(max length / block_size)] with each batch's blocks in [0, block_num)",
                      (lambda p_, kv_, wl: lambda a: None if a.get(p_) is None or a.layout_kv != pa or a.get(kv_) is None
                       or _table_ok(a[p_], _batch(a), wl(a), a[kv_].shape[0], a[kv_].shape[1])
                       else tuple(a[p_].shape))(p, kv, want_len),
                      edit(n, (lambda p_: lambda a: a.update({p_: np.ascontiguousarray(a[p_][:, :0])}))(p), layout_kv=pa)))
    r.append(rule(n, f"{lens_kv}_values", lens_kv, "value", "lengths must be >= 0 and fit ori_kv (BSND: <= S2)",
                  lambda a: None if a.get(lens_kv) is None or (
                      np.asarray(a[lens_kv]).min(initial=0) >= 0 and (
                          a.layout_kv != "BSND" or np.asarray(a[lens_kv]).max(initial=0) <= a.ori_kv.shape[1]))
                  else np.asarray(a[lens_kv]).tolist(),
                  edit(n, lambda a: a.update({lens_kv: np.full_like(a[lens_kv], -1)}), layout_kv=pa)))
    if sfm:
        r.append(rule(n, "seqused_cmp_kv_values", "seqused_cmp_kv", "value",
                      "lengths must be >= 0 and fit cmp_kv (BSND: <= S3)",
                      lambda a: None if a.get("seqused_cmp_kv") is None or a.get("cmp_kv") is None or (
                          a.seqused_cmp_kv.min(initial=0) >= 0 and (
                              a.layout_kv != "BSND" or a.seqused_cmp_kv.max(initial=0) <= a.cmp_kv.shape[1]))
                      else a.seqused_cmp_kv.tolist(),
                      edit(n, lambda a: a.update(seqused_cmp_kv=np.full_like(a["seqused_cmp_kv"], -1)), layout_kv=pa)))
        r.append(rule(n, "cmp_residual_kv_required", "cmp_residual_kv", "value",
                      "is required with cmp_kv (CSA / HCA)" if qs else
                      "is required with cmp_kv when cmp_ratio != 1 and cmp_mask_mode is 3",
                      (lambda a: None if a.get("cmp_kv") is None or a.get("cmp_residual_kv") is not None else "None")
                      if qs else
                      (lambda a: None if a.get("cmp_kv") is None or a.cmp_ratio == 1 or a.cmp_mask_mode != 3
                       or a.get("cmp_residual_kv") is not None else "None"),
                      edit(n, setting(cmp_residual_kv=None))))
        r.append(rule(n, "cmp_residual_kv_values", "cmp_residual_kv", "value", "entries must be in [0, cmp_ratio)",
                      lambda a: None if a.get("cmp_residual_kv") is None or (
                          a.cmp_residual_kv.min(initial=0) >= 0 and a.cmp_residual_kv.max(initial=0) < a.cmp_ratio)
                      else a.cmp_residual_kv.tolist(),
                      edit(n, lambda a: a.update(cmp_residual_kv=np.full_like(a["cmp_residual_kv"], a["cmp_ratio"])))))
    r.append(rule(n, "sinks_shape", "sinks", "shape", "must be [N1] (one logit per query head)",
                  lambda a: None if a.get("sinks") is None or a.sinks.shape == (a.q.shape[-2],) else tuple(a.sinks.shape),
                  edit(n, lambda a: a.update(sinks=np.zeros(3, np.float32)))))
    r.append(rule(n, "sinks_values", "sinks", "value", "must not be NaN or +inf (-inf: no sink)",
                  lambda a: None if a.get("sinks") is None or not (np.isnan(a.sinks) | (a.sinks == np.inf)).any()
                  else "NaN or +inf", edit(n, lambda a: a["sinks"].__setitem__(0, np.nan))))
    r.append(rule(n, "metadata_shape", "metadata", "shape", "must be [1024] (the *_metadata operator's output)",
                  lambda a: None if a.get("metadata") is None or a.metadata.shape == (1024,) else tuple(a.metadata.shape),
                  edit(n, lambda a: a.update(metadata=a["metadata"][:8]))))
    r.append(bool_rule(n, "return_softmax_lse"))
    r.append(choice_rule(n, "precision", _ref.PRECISIONS,
                         source="docs/numerics/attention-v4.md#precision (qsfa's parameter)"))
    if not qs:
        r.append(finite_rule(n, "q"))
    if not (quant or qs):
        r.append(finite_rule(n, "ori_kv"))
        r.append(finite_rule(n, "cmp_kv"))
    elif mq:
        r.append(rule(n, "lengths_consistent", "cmp_residual_kv", "value",
                      "with seqused_ori_kv, seqused_cmp_kv and cmp_residual_kv all given, seqused_ori_kv must equal "
                      "seqused_cmp_kv * cmp_ratio + cmp_residual_kv", lambda a: None if any(
                          a.get(p) is None for p in ("seqused_ori_kv", "seqused_cmp_kv", "cmp_residual_kv")) or (
                          np.asarray(a.seqused_ori_kv, np.int64) == np.asarray(a.seqused_cmp_kv, np.int64) * a.cmp_ratio
                          + np.asarray(a.cmp_residual_kv, np.int64)).all() else "inconsistent lengths",
                      edit(n, lambda a: a.update(seqused_ori_kv=a["seqused_ori_kv"] - 1))))
    # the caller's output buffer (qsfa/ops/_out_buffers.py): q's shape, the output dtype (bfloat16 for HiFloat8 q)
    r += attention_out_rules(n, lambda a: a["q"].shape[-1], query="q", dtype_of=(lambda a: _BF16) if qs else None,
                             dtype_what="bfloat16 (HiFloat8 q)" if qs else "q's dtype")
    # chip limits
    r += _chip_rules(n, op, sfm)
    return r


def _chip_rules(n, op, sfm):
    if op == QS:
        return _qs_chip_rules(n)
    if op == MQ:
        return _mq_chip_rules(n)
    if op == KQS:
        return _kqs_chip_rules(n)
    a23 = ("A2", "A3") if sfm else ("A3",)
    out = []
    if not sfm:
        out.append(rule(n, "chip_supported", "q", "value", "sparse_attn_sharedkv runs on Atlas A3 only (README)",
                        lambda a: "Atlas A2 or Ascend 950", edit(n), chips=("A2", "950")))
        out.append(rule(n, "chip_layout_kv", "layout_kv", "value", "only PA_ND is supported (README)",
                        lambda a: None if a.layout_kv == "PA_ND" else a.layout_kv, edit(n, layout_kv="BSND"),
                        chips=("A3",)))
        out.append(rule(n, "chip_q_heads", "q", "shape", "N1 must be 64 (README)",
                        lambda a: None if a.q.shape[-2] == 64 else tuple(a.q.shape), edit(n, n1=2), chips=("A3",)))
        out.append(rule(n, "chip_return_softmax_lse", "return_softmax_lse", "value", "only False is supported (README)",
                        lambda a: None if not a.return_softmax_lse else True,
                        edit(n, setting(return_softmax_lse=True)), chips=("A3",)))
    else:
        out.append(rule(n, "chip_q_heads_pow2", "q", "shape", f"N1 must be {one_of(_POW2_HEADS)} (A2 / A3)",
                        lambda a: None if a.q.shape[-2] in _POW2_HEADS else tuple(a.q.shape), edit(n, n1=3), chips=a23))
        out.append(rule(n, "chip_q_heads_950", "q", "shape", "N1 = 1 is not supported on Ascend 950",
                        lambda a: None if a.q.shape[-2] != 1 else tuple(a.q.shape), edit(n, n1=1), chips=("950",)))
        out.append(rule(n, "chip_seqused_q", "seqused_q", "value", "seqused_q is not supported yet: pass None",
                        lambda a: None if a.get("seqused_q") is None else "a tensor",
                        edit(n, setting(seqused_q=np.array([1, 1], np.int32))), chips=("A2", "A3", "950")))
    out.append(rule(n, "chip_topk", "cmp_sparse_indices", "shape",
                    f"K must be {one_of(TOPK_SIZES if sfm else (512,))}",
                    lambda a: None if a.get("cmp_sparse_indices") is None
                    or a.cmp_sparse_indices.shape[-1] in (TOPK_SIZES if sfm else (512,)) else tuple(a.cmp_sparse_indices.shape),
                    edit(n, k=8), chips=(a23 + ("950",)) if sfm else ("A3",)))
    out.append(rule(n, "chip_mask_modes", "ori_mask_mode", "value",
                    "ori_mask_mode must be 4 and, with cmp_kv, cmp_mask_mode 3", lambda a: None if a.ori_mask_mode == 4
                    and (a.get("cmp_kv") is None or a.cmp_mask_mode == 3) else a.ori_mask_mode,
                    edit(n, setting(ori_mask_mode=3)), chips=a23))
    out.append(rule(n, "chip_window", "ori_win_left", "value", "ori_win_left must be 127 and ori_win_right 0",
                    lambda a: None if a.ori_win_left == 127 and a.ori_win_right == 0 else a.ori_win_left,
                    edit(n, setting(ori_win_left=63)), chips=a23))
    out.append(rule(n, "chip_cmp_ratio", "cmp_ratio", "value",
                    "cmp_ratio must be 1 for SWA, 4 for CSA (cmp_sparse_indices) and 128 for HCA",
                    lambda a: None if a.cmp_ratio == (1 if a.get("cmp_kv") is None else 4
                                                      if a.get("cmp_sparse_indices") is not None else 128)
                    else a.cmp_ratio, edit(n, setting(cmp_ratio=8)), chips=a23))
    if sfm:  # aclnnSparseFlashMla.md: sinksOptional "必须传入" (the sharedkv README lists it as optional)
        out.append(rule(n, "chip_sinks", "sinks", "value", "sinks must be given", lambda a: None
                        if a.get("sinks") is not None else "None", edit(n, setting(sinks=None)), chips=a23 + ("950",)))
    return out


def _quant_950_rules(n, c):
    """The 950 limits both quantised front doors share: 64 or 128 heads, top-k 512, mask modes 4 / 3, the
    127 / 0 band window."""
    return [
        rule(n, "chip_q_heads", "q", "shape", "N1 must be 64 or 128", lambda a: None if a.q.shape[-2] in (64, 128)
             else tuple(a.q.shape), edit(n, n1=2), chips=c),
        rule(n, "chip_topk", "cmp_sparse_indices", "shape", f"K must be {one_of(TOPK_SIZES)}",
             lambda a: None if a.get("cmp_sparse_indices") is None or a.cmp_sparse_indices.shape[-1] in TOPK_SIZES
             else tuple(a.cmp_sparse_indices.shape), edit(n, k=8), chips=c),
        rule(n, "chip_mask_modes", "ori_mask_mode", "value", "ori_mask_mode must be 4 and, with cmp_kv, cmp_mask_mode 3",
             lambda a: None if a.ori_mask_mode == 4 and (a.get("cmp_kv") is None or a.cmp_mask_mode == 3)
             else a.ori_mask_mode, edit(n, setting(ori_mask_mode=3)), chips=c),
        rule(n, "chip_window", "ori_win_left", "value", "ori_win_left must be 127 and ori_win_right 0",
             lambda a: None if a.ori_win_left == 127 and a.ori_win_right == 0 else a.ori_win_left,
             edit(n, setting(ori_win_left=63)), chips=c),
    ]


def _mq_chip_rules(n):
    c = ("950",)
    return [
        rule(n, "chip_supported", "q", "value", "mixed_quant_sparse_flash_mla runs on Ascend 950 only (README)",
             lambda a: "Atlas A2/A3", edit(n), chips=("A2", "A3")),
        *_quant_950_rules(n, c),
        rule(n, "chip_return_softmax_lse", "return_softmax_lse", "value",
             "softmax_lse is reserved (its output is invalid): pass False", lambda a: None
             if not a.return_softmax_lse else True, edit(n, setting(return_softmax_lse=True)), chips=c),
    ]


def _kqs_chip_rules(n):
    c = ("950",)
    return [
        rule(n, "chip_supported", "q", "value", "kv_quant_sparse_attn_sharedkv runs on Ascend 950 only (vLLM-Ascend "
             "routes it from its A5 adaptor)", lambda a: "Atlas A2/A3", edit(n), chips=("A2", "A3")),
        rule(n, "chip_layout_kv", "layout_kv", "value", "only PA_ND is supported",
             lambda a: None if a.layout_kv == "PA_ND" else a.layout_kv, edit(n, layout_kv="BSND"), chips=c),
        *_quant_950_rules(n, c),
        rule(n, "chip_cmp_ratio", "cmp_ratio", "value", "cmp_ratio must be 1 (SWA), 4 or 128",
             lambda a: None if a.cmp_ratio == (1 if a.get("cmp_kv") is None else a.cmp_ratio) and
             (a.get("cmp_kv") is None or a.cmp_ratio in (4, 128)) else a.cmp_ratio,
             edit(n, setting(cmp_ratio=8)), chips=c),
        rule(n, "chip_sinks", "sinks", "value", "sinks must be given", lambda a: None
             if a.get("sinks") is not None else "None", edit(n, setting(sinks=None)), chips=c),
        rule(n, "chip_return_softmax_lse", "return_softmax_lse", "value",
             "softmax_lse is documented as invalid: pass False", lambda a: None
             if not a.return_softmax_lse else True, edit(n, setting(return_softmax_lse=True)), chips=c),
    ]


_QS_DESCALES = ("q_descale", "ori_kv_descale", "cmp_kv_descale")
_QS_DOC = "hicann/ops-transformer@0568343 torch_extension/cann_ops_transformer/docs/zh/quant_sparse_flash_mla.md"
_QS_KERNEL = ("cannmirror/ops-transformer@5992a2b attention/quant_sparse_flash_mla/op_kernel/arch35/"
              "quant_sparse_flash_mla_csa_block_vector.h")


def _qs_s1(a):
    """Each batch's query length (BSND: S1; TND: the cu_seqlens_q differences)."""
    if a.layout_q == "BSND":
        return np.full(int(a.q.shape[0]), int(a.q.shape[1]), np.int64)
    c = np.asarray(a.cu_seqlens_q, np.int64)
    return c[1:] - c[:-1]


def _qs_rules(n):
    """quant_sparse_flash_mla's own rules: quant_mode, the descales, the SWA cmp_ratio, seqused_q."""
    src_k = f"docs/numerics/attention-v4.md#quant_sparse_flash_mla; {_QS_KERNEL} (InitGlobalBuffer reads element 0)"
    out = [choice_rule(n, "quant_mode", (1,), bad=2,
                       source="cannmirror/ops-transformer@5992a2b attention/quant_sparse_flash_mla/op_host/"
                              "quant_sparse_flash_mla_check_feature.cpp (quant_mode only support 1)"),
           rule(n, "cmp_kv_descale_required", "cmp_kv_descale", "value", "is required with cmp_kv (CSA / HCA)",
                lambda a: None if a.get("cmp_kv") is None or a.get("cmp_kv_descale") is not None else "None",
                edit(n, setting(cmp_kv_descale=None)), source=src_k),
           rule(n, "cmp_kv_descale_without_cmp_kv", "cmp_kv_descale", "value", "is not supported without cmp_kv",
                lambda a: None if a.get("cmp_kv") is not None or a.get("cmp_kv_descale") is None
                or a.get("cmp_sparse_indices") is not None else "a tensor",
                edit(n, setting(cmp_kv_descale=np.ones(1, np.float32)), scenario="SWA"), source=_QS_DOC),
           rule(n, "window_needs_band", "ori_win_left", "value",
                "ori_win_left and ori_win_right may be >= 0 only with ori_mask_mode 4 (otherwise -1)",
                lambda a: None if a.ori_mask_mode not in (0, 3) or (a.ori_win_left == -1 and a.ori_win_right == -1)
                else f"{a.ori_win_left} / {a.ori_win_right} with ori_mask_mode {a.ori_mask_mode}",
                edit(n, setting(ori_mask_mode=3)), source=_QS_DOC),
           rule(n, "seqused_cmp_kv_required", "seqused_cmp_kv", "value",
                "is required when layout_kv is PA_BBND and cmp_kv is given",
                lambda a: None if a.layout_kv != "PA_BBND" or a.get("cmp_kv") is None
                or a.get("seqused_cmp_kv") is not None else "None",
                edit(n, setting(seqused_cmp_kv=None), layout_kv="PA_BBND"), source=_QS_DOC)]
    for p in _QS_DESCALES:
        out.append(rule(n, f"{p}_shape", p, "shape", "must be [1] (one fp32 per-tensor descale)",
                        (lambda p_: lambda a: None if a.get(p_) is None or a[p_].shape == (1,)
                         else tuple(a[p_].shape))(p),
                        edit(n, (lambda p_: lambda a: a.update({p_: np.ones(2, np.float32)}))(p)), source=src_k))
        out.append(rule(n, f"{p}_values", p, "value", "must be finite",
                        (lambda p_: lambda a: None if a.get(p_) is None or a[p_].shape != (1,)
                         or np.isfinite(a[p_]).all() else float(a[p_].reshape(-1)[0]))(p),
                        edit(n, (lambda p_: lambda a: a.update({p_: np.array([np.inf], np.float32)}))(p)),
                        source=src_k))
    out.append(rule(n, "cmp_ratio_swa", "cmp_ratio", "value", "must be 1 without cmp_kv (SWA)",
                    lambda a: None if a.get("cmp_kv") is not None or a.get("cmp_sparse_indices") is not None
                    or a.cmp_ratio == 1 else a.cmp_ratio,
                    edit(n, setting(cmp_ratio=4), scenario="SWA"),
                    source="cannmirror/ops-transformer@5992a2b attention/quant_sparse_flash_mla/op_host/"
                           "quant_sparse_flash_mla_check_existance.cpp (CheckCmpRatioExistence)"))
    out.append(rule(n, "seqused_q_full", "seqused_q", "value",
                    "qsfa models seqused_q only at each batch's full query length (the golden moves the causal "
                    "threshold with it; docs/numerics/open-facts.md#quant-sparse-flash-mla-seqused-q)",
                    lambda a: None if a.get("seqused_q") is None or np.asarray(a.seqused_q).shape != (_batch(a),)
                    or (np.asarray(a.seqused_q, np.int64) == _qs_s1(a)).all() else np.asarray(a.seqused_q).tolist(),
                    edit(n, setting(seqused_q=np.array([1, 1], np.int32)))))
    return out


def _qs_chip_rules(n):
    c = ("950",)
    host = "cannmirror/ops-transformer@5992a2b attention/quant_sparse_flash_mla/op_host/"
    return [
        rule(n, "chip_supported", "q", "value", "quant_sparse_flash_mla runs on Ascend 950 only (op_def: ascend950)",
             lambda a: "Atlas A2/A3", edit(n), chips=("A2", "A3"), source=host + "quant_sparse_flash_mla_def.cpp"),
        rule(n, "chip_window", "ori_win_left", "value", "ori_win_left must be 127 and ori_win_right 0",
             lambda a: None if a.ori_win_left == 127 and a.ori_win_right == 0 else a.ori_win_left,
             edit(n, setting(ori_win_left=63)), chips=c, source=host + "quant_sparse_flash_mla_check_feature.cpp"),
        rule(n, "chip_sinks", "sinks", "value", "sinks must be given", lambda a: None
             if a.get("sinks") is not None else "None", edit(n, setting(sinks=None)), chips=c,
             source=host + "quant_sparse_flash_mla_check_single_para.cpp"),
        # the kernel's own check that metadata is given (check_single_para.cpp) is met by the npu backend, which
        # runs quant_sparse_flash_mla_metadata first when the caller passes None, as for every V4 attention door
    ]


def _prefix_ok(v, total, le=False):
    v = np.asarray(v, np.int64).reshape(-1)
    if v.size < 2 or v[0] != 0 or (np.diff(v) < 0).any():
        return False
    return v[-1] <= total if le else v[-1] == total


def _ori_lens(a, lens_kv):
    v = a.get(lens_kv)
    return None if v is None else np.asarray(v, np.int64)


def _cmp_lens(a, lens_kv, sfm):
    if sfm and a.get("seqused_cmp_kv") is not None:
        return np.asarray(a.seqused_cmp_kv, np.int64)
    v = a.get(lens_kv)
    return None if v is None else np.asarray(v, np.int64) // max(int(a.cmp_ratio), 1)


def _table_ok(bt, b, lens, block_num, block_size):
    """Each batch's own blocks (``ceil(len_b / block_size)`` entries) lie in ``[0, block_num)``; entries past them
    are never read (the public goldens pad them with -1)."""
    if bt.ndim != 2 or bt.shape[0] != b:
        return False
    need = 0 if lens is None or not lens.size else int(-(-lens.max() // block_size))
    if bt.shape[1] < need:
        return False
    if lens is None or not need or np.asarray(lens).size != b:  # a wrong length vector is its own rule's error
        return True
    own = np.arange(need)[None, :] < -(-np.asarray(lens, np.int64).reshape(-1, 1) // block_size)
    used = bt[:, :need][own]
    return not used.size or (used.min() >= 0 and used.max() < block_num)


_COMMON_PARAMS = (
    "q:array ori_kv:array? cmp_kv:array? ori_sparse_indices:array? cmp_sparse_indices:array? ori_block_table:array?"
    " cmp_block_table:array? cu_seqlens_q:array? cu_seqlens_ori_kv:array? cu_seqlens_cmp_kv:array? seqused_q:array?"
    " sinks:array? metadata:array? ori_mask_mode:int cmp_mask_mode:int"
    " ori_win_left:int ori_win_right:int layout_q:str layout_kv:str return_softmax_lse:bool precision:str"
    " attention_out:array?")
#: the output buffer every V4 door takes (its LSE is one small tensor: no buffer for it)
_OUT_BUFFERS = ("attention_out",)

SFM_CONTRACT = Contract(op=SFM, constraints=_rules(SFM), example=lambda rng: sfm_case(), params=params(
    _COMMON_PARAMS + " softmax_scale:float32 cmp_ratio:int seqused_ori_kv:array? seqused_cmp_kv:array? cmp_residual_kv:array? ori_topk_length:array?"
    " cmp_topk_length:array? topk_value_mode:int"), out_buffers=_OUT_BUFFERS)
MQ_CONTRACT = Contract(op=MQ, constraints=_rules(MQ), example=lambda rng: mq_case(), params=params(
    _COMMON_PARAMS + " softmax_scale:float32? cmp_ratio:int? seqused_ori_kv:array? seqused_cmp_kv:array?"
    " cmp_residual_kv:array? ori_topk_length:array? cmp_topk_length:array? topk_value_mode:int quant_mode:int?"
    " rope_head_dim:int?"), out_buffers=_OUT_BUFFERS)
KQS_CONTRACT = Contract(op=KQS, constraints=_rules(KQS), example=lambda rng: kqs_case(), params=params(
    _COMMON_PARAMS + " softmax_scale:float32? cmp_ratio:int? seqused_kv:array? kv_quant_mode:int tile_size:int?"
    " rope_head_dim:int"), out_buffers=_OUT_BUFFERS)
QS_CONTRACT = Contract(op=QS, constraints=_rules(QS), example=lambda rng: qs_case(), params=params(
    _COMMON_PARAMS + " softmax_scale:float32 cmp_ratio:int seqused_ori_kv:array? seqused_cmp_kv:array?"
    " cmp_residual_kv:array? ori_topk_length:array? cmp_topk_length:array? topk_value_mode:int quant_mode:int?"
    " q_descale:array? ori_kv_descale:array? cmp_kv_descale:array?"), out_buffers=_OUT_BUFFERS)
SAS_CONTRACT = Contract(op=SAS, constraints=_rules(SAS), example=lambda rng: sas_case(), params=params(
    _COMMON_PARAMS + " softmax_scale:float32? cmp_ratio:int? seqused_kv:array?"), out_buffers=_OUT_BUFFERS)


def _sfm_reference(q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, metadata, ori_topk_length,
                   cmp_topk_length, topk_value_mode, **kw):
    return _ref.sharedkv_attention(q, ori_kv, cmp_kv, cmp_sparse_indices, **kw)


def _sas_reference(q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, metadata, seqused_kv, cmp_ratio,
                   seqused_q, **kw):
    """The sharedkv conventions on the shared core: seqused_kv is the window cache's length and the compressed
    cache holds floor(length / cmp_ratio) tokens with remainder length % cmp_ratio (the golden's bound)."""
    residual = None
    cmp_used = None
    if cmp_kv is not None:
        if seqused_kv is not None:
            s2 = np.asarray(seqused_kv, np.int64)
        elif kw["layout_kv"] == "TND":
            c = np.asarray(kw["cu_seqlens_ori_kv"], np.int64)
            s2 = c[1:] - c[:-1]
        else:
            s2 = np.full(q.shape[0], ori_kv.shape[1], np.int64)
        cmp_used, residual = s2 // cmp_ratio, s2 % cmp_ratio
    return _ref.sharedkv_attention(q, ori_kv, cmp_kv, cmp_sparse_indices, seqused_ori_kv=seqused_kv,
                                   seqused_cmp_kv=cmp_used, cmp_residual_kv=residual, cmp_ratio=cmp_ratio, **kw)


def _mq_reference(q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, metadata, ori_topk_length,
                  cmp_topk_length, topk_value_mode, quant_mode, rope_head_dim, seqused_cmp_kv, **kw):
    """Dequantise every stored row (quant_mode 1: ``decode(code) * bf16 scale`` rounded to bf16 with the chip's
    ``k_rounding``; 2: MODEL1, exact) and run the shared core; seqused_cmp_kv defaults to
    floor(seqused_ori_kv / cmp_ratio) (README)."""
    k_rounding = kw.pop("k_rounding", "rint")

    def deq(x):
        if x is None:
            return None
        if quant_mode == 1:  # 608-byte rows: each decoded where it is read
            return _ref.LazyRows(x, lambda r: _ref.dequant_mode1(r, k_rounding), 512)
        return _ref.dequant_mode2(x)  # MODEL1 blocks keep a row's scales apart from its codes: whole blocks

    if seqused_cmp_kv is None and cmp_kv is not None and kw.get("seqused_ori_kv") is not None:
        seqused_cmp_kv = np.asarray(kw["seqused_ori_kv"], np.int64) // kw["cmp_ratio"]
    return _ref.sharedkv_attention(q, deq(ori_kv), deq(cmp_kv), cmp_sparse_indices, seqused_cmp_kv=seqused_cmp_kv,
                                   **kw)


def _mq_numerics(chip, args):
    """The 950's V4 numerics plus the quant_mode 1 K rounding (RINT, as the golden's bf16 multiply; OPEN for the
    kernel: docs/numerics/open-facts.md#mixed-quant-k-rounding)."""
    return {**_chips.sharedkv_numerics(chip, args), "k_rounding": "rint"}


define_operator(MQ, MQ_CONTRACT, outputs=("attention_out", "softmax_lse"), reference=_mq_reference,
                numerics=_mq_numerics,
                doc="DeepSeek-V4 shared-KV sparse attention over per-token-group FP8 KV, aclnnMixedQuantSparseFlashMla.")


def _kqs_reference(q, ori_kv, cmp_kv, kv_quant_mode, tile_size, rope_head_dim, **kw):
    """640-byte rows dequantised (exact E8M0 scaling) in front of the sharedkv conventions, each where it is read."""
    deq = (lambda x: None if x is None else _ref.LazyRows(x, _ref.dequant_640, 512))
    return _sas_reference(q, deq(ori_kv), deq(cmp_kv), **kw)


define_operator(KQS, KQS_CONTRACT, outputs=("attention_out", "softmax_lse"), reference=_kqs_reference,
                numerics=_chips.sharedkv_numerics,
                doc="DeepSeek-V4 shared-KV sparse attention over 640-byte FP8 rows (vLLM-Ascend, Ascend 950).")


def _qs_reference(q, ori_kv, cmp_kv, ori_sparse_indices, cmp_sparse_indices, metadata, ori_topk_length,
                  cmp_topk_length, topk_value_mode, quant_mode, **kw):
    """The HiFloat8 arithmetic (qsfa.reference.sharedkv_hif8) over the shared token selection; seqused_cmp_kv
    defaults to floor(seqused_ori_kv / cmp_ratio) as the other sparse_flash_mla doors."""
    from ..reference.sharedkv_hif8 import hif8_sharedkv_attention

    if kw.get("seqused_cmp_kv") is None and cmp_kv is not None and kw.get("seqused_ori_kv") is not None:
        kw["seqused_cmp_kv"] = np.asarray(kw["seqused_ori_kv"], np.int64) // kw["cmp_ratio"]
    return hif8_sharedkv_attention(q, ori_kv, cmp_kv, cmp_sparse_indices, **kw)


def _qs_numerics(chip, args):
    """The 950's cells (qsfa.chips.QS_NUMERICS); the operator exists only there, so every chip maps to them."""
    return dict(_chips.QS_NUMERICS)


define_operator(QS, QS_CONTRACT, outputs=("attention_out", "softmax_lse"), reference=_qs_reference,
                numerics=_qs_numerics,
                doc="DeepSeek-V4 shared-KV sparse attention over HiFloat8 Q / K / V with per-tensor descales, "
                    "aclnnQuantSparseFlashMla.")
define_operator(SFM, SFM_CONTRACT, outputs=("attention_out", "softmax_lse"), reference=_sfm_reference,
                numerics=_chips.sharedkv_numerics,
                doc="DeepSeek-V4 shared-KV sparse attention (SWA / CSA / HCA), aclnnSparseFlashMla.")
define_operator(SAS, SAS_CONTRACT, outputs=("attention_out", "softmax_lse"), reference=_sas_reference,
                numerics=_chips.sharedkv_numerics,
                doc="DeepSeek-V4 shared-KV sparse attention, npu_sparse_attn_sharedkv conventions.")


def sparse_flash_mla(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                     ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                     cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                     cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None, metadata=None,
                     softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1,
                     ori_win_right=-1, layout_q="BSND", layout_kv="BSND", topk_value_mode=1,
                     return_softmax_lse=False, chip=None, backend="reference", precision="faithful",
                     attention_out=None):
    """DeepSeek-V4 shared-KV sparse attention (K = V): a window over ``ori_kv`` plus, for CSA, the ``cmp_kv``
    tokens ``cmp_sparse_indices`` select below the causal bound or, for HCA, every ``cmp_kv`` token below it;
    sinks in the denominator. Semantics and rounding: :mod:`qsfa.reference.sharedkv`,
    docs/numerics/attention-v4.md#sparse_flash_mla.

    Parameters and defaults are those of ``cann_ops_transformer.ops.sparse_flash_mla`` (aclnnSparseFlashMla):
      q: float16 / bfloat16 ``[B, S1, N1, 512]`` (layout_q BSND) or ``[T1, N1, 512]`` (TND).
      ori_kv / cmp_kv: q's dtype, ``[B, S, 1, 512]`` (BSND), ``[T, 1, 512]`` (TND) or
          ``[block_num, block_size, 1, 512]`` (PA_BBND, block_size a multiple of 16 up to 1024).
      cmp_sparse_indices: int32 ``[B, S1, 1, K]`` / ``[T1, 1, K]`` (CSA; -1 ends a row; K 512 / 1024 on the NPU).
      ori_block_table / cmp_block_table: int32 ``[B, blocks]`` (PA_BBND).
      cu_seqlens_q / cu_seqlens_ori_kv / cu_seqlens_cmp_kv: int32 ``[B + 1]`` prefix sums (TND).
      seqused_ori_kv / seqused_cmp_kv: int32 ``[B]`` lengths (PA_BBND: seqused_ori_kv required).
      cmp_residual_kv: int32 ``[B]`` in ``[0, cmp_ratio)``: the pre-compression length is
          ``S3 * cmp_ratio + residual`` (required with cmp_kv, cmp_ratio != 1, cmp_mask_mode 3).
      seqused_q: ``[B]``: rows past it are zero (not supported on the NPU yet).
      ori_sparse_indices, ori_topk_length, cmp_topk_length: reserved (None). metadata: ignored by the reference.
      sinks: float32 ``[N1]`` (-inf: no sink). softmax_scale, cmp_ratio (1..128), ori_mask_mode (0, 3, 4),
      cmp_mask_mode (0, 3), ori_win_left / ori_win_right (-1 unlimited), layout_q, layout_kv, topk_value_mode (1),
      return_softmax_lse.
      chip: None | "A2" | "A3" | "950" (limits checked for it); backend: "reference"; precision: "faithful"
          (the kernel's online softmax, query-dtype output) or "exact" (float64).
      attention_out: optional NumPy buffer (an ``np.memmap`` for a long prefill) of the output's shape and dtype
          (q's; float64 for exact), C-contiguous, writable, sharing no memory with any input; checked before
          anything runs, the rows are written into it chunk by chunk and it is returned as the output (the npu
          backend copies its result into it after the call). docs/numerics/attention-v4.md#attention_out.
    Returns ``(attention_out like q, softmax_lse)``: softmax_lse float32 ``[B, 1, S1, N1]`` (BSND) /
    ``[1, T1, N1]`` (TND) including the sink, or an empty ``[0]`` array when return_softmax_lse is False.
    """
    args = dict(q=q, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_sparse_indices=ori_sparse_indices,
                cmp_sparse_indices=cmp_sparse_indices, ori_block_table=ori_block_table,
                cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
                cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q, seqused_ori_kv=seqused_ori_kv,
                seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv, ori_topk_length=ori_topk_length,
                cmp_topk_length=cmp_topk_length, sinks=sinks, metadata=metadata, softmax_scale=softmax_scale,
                cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode,
                ori_win_left=ori_win_left, ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=layout_kv,
                topk_value_mode=topk_value_mode, return_softmax_lse=return_softmax_lse, precision=precision)
    return run(SFM, add_buffers(args, attention_out, None, None), backend, chip=chip)


def sparse_attn_sharedkv(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                         ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                         cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, sinks=None, metadata=None,
                         softmax_scale=None, cmp_ratio=None, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127,
                         ori_win_right=0, layout_q="BSND", layout_kv="PA_ND", return_softmax_lse=False, chip=None,
                         backend="reference", precision="faithful", attention_out=None):
    """The same attention as :func:`sparse_flash_mla` with ``npu_sparse_attn_sharedkv``'s conventions
    (docs/numerics/attention-v4.md#sparse_attn_sharedkv): ``seqused_kv`` is ori_kv's per-batch length; the
    compressed cache holds ``floor(len / cmp_ratio)`` tokens and the causal bound uses ``len`` itself (there is no
    ``cmp_residual_kv``); layout_kv ``"PA_ND"`` (paged; BSND / TND are accepted by the reference); seqused_q is
    ignored (README: "setting seqused_q has no effect"). softmax_scale and cmp_ratio default to None in the public
    signature and must be given (the README names no value for None). ``attention_out``: an optional output buffer
    as :func:`sparse_flash_mla`'s. Returns ``(attention_out, softmax_lse)`` as :func:`sparse_flash_mla`.
    """
    args = dict(q=q, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_sparse_indices=ori_sparse_indices,
                cmp_sparse_indices=cmp_sparse_indices, ori_block_table=ori_block_table,
                cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
                cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q, seqused_kv=seqused_kv, sinks=sinks,
                metadata=metadata, softmax_scale=softmax_scale, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode,
                cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right,
                layout_q=layout_q, layout_kv=layout_kv, return_softmax_lse=return_softmax_lse, precision=precision)
    return run(SAS, add_buffers(args, attention_out, None, None), backend, chip=chip)


def mixed_quant_sparse_flash_mla(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                                 ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                                 cu_seqlens_cmp_kv=None, seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None,
                                 cmp_residual_kv=None, ori_topk_length=None, cmp_topk_length=None, sinks=None,
                                 metadata=None, quant_mode=None, rope_head_dim=None, softmax_scale=None,
                                 cmp_ratio=None, ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1, ori_win_right=-1,
                                 layout_q="BSND", layout_kv="BSND", topk_value_mode=1, return_softmax_lse=False,
                                 chip=None, backend="reference", precision="faithful", attention_out=None):
    """:func:`sparse_flash_mla` over quantised KV rows (aclnnMixedQuantSparseFlashMla, Ascend 950;
    docs/numerics/attention-v4.md#mixed_quant_sparse_flash_mla). q is bfloat16 ``[..., N1, 512]`` ordered
    [NoPE 448, RoPE 64]; ori_kv / cmp_kv are float8_e4m3fn (or uint8) rows: quant_mode 1 ``[..., 1, 608]`` (bf16
    RoPE 64, 448 FP8 E4M3FN NoPE codes, 7 bf16 tile scales, pad), quant_mode 2 ``[block_num, block_size, 1, 584]``
    MODEL1 blocks (PA_BBND). Every row is dequantised to bf16 ([NoPE, RoPE]) and the shared core runs.
    quant_mode, rope_head_dim (64), softmax_scale and cmp_ratio default to None in the public signature and must
    be given. seqused_cmp_kv defaults to floor(seqused_ori_kv / cmp_ratio). ``attention_out``: an optional bfloat16
    (float64 exact) output buffer as :func:`sparse_flash_mla`'s. Returns ``(attention_out, softmax_lse)``."""
    args = dict(q=q, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_sparse_indices=ori_sparse_indices,
                cmp_sparse_indices=cmp_sparse_indices, ori_block_table=ori_block_table,
                cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
                cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q, seqused_ori_kv=seqused_ori_kv,
                seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv, ori_topk_length=ori_topk_length,
                cmp_topk_length=cmp_topk_length, sinks=sinks, metadata=metadata, quant_mode=quant_mode,
                rope_head_dim=rope_head_dim, softmax_scale=softmax_scale, cmp_ratio=cmp_ratio,
                ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left,
                ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=layout_kv, topk_value_mode=topk_value_mode,
                return_softmax_lse=return_softmax_lse, precision=precision)
    return run(MQ, add_buffers(args, attention_out, None, None), backend, chip=chip)


def kv_quant_sparse_attn_sharedkv(q, kv_quant_mode, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None,
                                  cmp_sparse_indices=None, ori_block_table=None, cmp_block_table=None,
                                  cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None, seqused_q=None,
                                  seqused_kv=None, sinks=None, metadata=None, tile_size=None, rope_head_dim=0,
                                  softmax_scale=None, cmp_ratio=None, ori_mask_mode=4, cmp_mask_mode=3,
                                  ori_win_left=127, ori_win_right=0, layout_q="BSND", layout_kv="PA_ND",
                                  return_softmax_lse=False, chip=None, backend="reference", precision="faithful",
                                  attention_out=None):
    """:func:`sparse_attn_sharedkv` over 640-byte FP8 rows (vLLM-Ascend ``npu_kv_quant_sparse_attn_sharedkv``,
    Ascend 950; docs/numerics/attention-v4.md#kv_quant_sparse_attn_sharedkv): per token 64 bf16 RoPE values,
    448 FP8 E4M3FN NoPE codes, 7 E8M0 tile scales (tile_size 64), pad to 640 bytes; the dequantisation is exact.
    kv_quant_mode 1, tile_size 64 and rope_head_dim 64 are the only values (the README's defaults None / 0 must
    be overridden, as vLLM-Ascend does: ``kv_quant_mode=1, tile_size=64, rope_head_dim=64``); softmax_scale and
    cmp_ratio are required. ``attention_out``: an optional bfloat16 (float64 exact) output buffer as
    :func:`sparse_flash_mla`'s. Returns ``(attention_out, softmax_lse)``."""
    args = dict(q=q, kv_quant_mode=kv_quant_mode, ori_kv=ori_kv, cmp_kv=cmp_kv, ori_sparse_indices=ori_sparse_indices,
                cmp_sparse_indices=cmp_sparse_indices, ori_block_table=ori_block_table,
                cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
                cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q, seqused_kv=seqused_kv, sinks=sinks,
                metadata=metadata, tile_size=tile_size, rope_head_dim=rope_head_dim, softmax_scale=softmax_scale,
                cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode,
                ori_win_left=ori_win_left, ori_win_right=ori_win_right, layout_q=layout_q, layout_kv=layout_kv,
                return_softmax_lse=return_softmax_lse, precision=precision)
    return run(KQS, add_buffers(args, attention_out, None, None), backend, chip=chip)


def quant_sparse_flash_mla(q, quant_mode, *, ori_kv=None, cmp_kv=None, q_descale=None, ori_kv_descale=None, cmp_kv_descale=None,
                           ori_sparse_indices=None, cmp_sparse_indices=None, ori_block_table=None,
                           cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None, cu_seqlens_cmp_kv=None,
                           seqused_q=None, seqused_ori_kv=None, seqused_cmp_kv=None, cmp_residual_kv=None,
                           ori_topk_length=None, cmp_topk_length=None, sinks=None, metadata=None,
                           softmax_scale=1.0, cmp_ratio=1, ori_mask_mode=0, cmp_mask_mode=0, ori_win_left=-1,
                           ori_win_right=-1, layout_q="BSND", layout_kv="BSND", topk_value_mode=1,
                           return_softmax_lse=False, chip=None, backend="reference", precision="faithful",
                           attention_out=None):
    """:func:`sparse_flash_mla` over HiFloat8 Q / K / V (aclnnQuantSparseFlashMla, Ascend 950;
    docs/numerics/attention-v4.md#quant_sparse_flash_mla). q ``[B, S1, N1, 512]`` / ``[T1, N1, 512]`` and
    ori_kv / cmp_kv (as :func:`sparse_flash_mla`, N2 = 1) are HiFloat8 codes in uint8 arrays; q_descale,
    ori_kv_descale, cmp_kv_descale are float32 ``[1]`` per-tensor descales (the real q is ``q_descale *
    decode(q)``, likewise K = V). The logits are ``softmax_scale * q_descale * kv_descale * (codes . codes)``; P is
    cast to HiFloat8 after a x16 scale, V's descale is applied to P @ V, the output is bfloat16.
    The signature and defaults are ``cann_ops_transformer.quant_sparse_flash_mla``'s (q and quant_mode positional,
    quant_mode 1 the only value; softmax_scale 1.0; cmp_ratio 1; mask modes 0; window -1 / -1; layouts BSND;
    topk_value_mode 1); the 950 limits of the op_host checks (window 127 / 0, sinks and metadata given) are chip
    rules. ``attention_out``: an optional bfloat16 (float64 exact) output buffer as :func:`sparse_flash_mla`'s (its
    dtype is the output's, not q's uint8). Returns ``(attention_out bfloat16, softmax_lse)``."""
    args = dict(q=q, ori_kv=ori_kv, cmp_kv=cmp_kv, q_descale=q_descale, ori_kv_descale=ori_kv_descale,
                cmp_kv_descale=cmp_kv_descale, ori_sparse_indices=ori_sparse_indices,
                cmp_sparse_indices=cmp_sparse_indices, ori_block_table=ori_block_table,
                cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q, cu_seqlens_ori_kv=cu_seqlens_ori_kv,
                cu_seqlens_cmp_kv=cu_seqlens_cmp_kv, seqused_q=seqused_q, seqused_ori_kv=seqused_ori_kv,
                seqused_cmp_kv=seqused_cmp_kv, cmp_residual_kv=cmp_residual_kv, ori_topk_length=ori_topk_length,
                cmp_topk_length=cmp_topk_length, sinks=sinks, metadata=metadata, quant_mode=quant_mode,
                softmax_scale=softmax_scale, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode,
                cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right,
                layout_q=layout_q, layout_kv=layout_kv, topk_value_mode=topk_value_mode,
                return_softmax_lse=return_softmax_lse, precision=precision)
    return run(QS, add_buffers(args, attention_out, None, None), backend, chip=chip)
