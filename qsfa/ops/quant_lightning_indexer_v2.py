"""Front door of ops-transformer's QuantLightningIndexerV2 (docs/numerics/indexer.md#quant_lightning_indexer_v2).

``quant_lightning_indexer_v2``: the DeepSeek-V4 quantised lightning indexer with per-token-head dequant scales
(int8 on Atlas A2/A3, FP8 E4M3FN or HiFloat8 on the 950) and the V4 argument names (``cu_seqlens_q/k``,
``seqused_q/k``, ``cmp_residual_k``, ``quant_mode``, ``layout_q/k``, ``topk``, ``mask_mode``). Its computation is
the one of ``vllm_quant_lightning_indexer`` (:func:`qsfa.reference.indexer_v4.select_top_k`, one reference for
both front doors); tests: tests/test_quant_lightning_indexer_v2.py. Sources: cannmirror/ops-transformer@1ecdfd4
``attention/quant_lightning_indexer_v2/op_host/quant_lightning_indexer_v2_tiling.cpp`` (checks),
``.../tests/pytest/quant_lightning_indexer_v2_golden.py`` (CPU golden and the torch schema it calls); both files
and the package callable (torch_extension/cann_ops_transformer/ops/quant_lightning_indexer.py) are still there at
25fb6b9, the snapshot the npu backend's recorded schema comes from.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import dtype_in, is_array
from .._contract import Contract, one_of, params
from .._dispatch import define_operator, run
from ..reference import indexer_v4 as _ref
from ..reference.indexer import TIE_BREAKS
from .indexer_v4 import paged_key_rules
from ._attention_rules import _kv_storage, _nope_codes, choice_rule, edit, finite_rule, is_int, Names, rule, setting

__all__ = ["quant_lightning_indexer_v2", "qli2_case", "QLI2_CONTRACT", "QLI2_QUANT_MODES"]

QLI2 = "quant_lightning_indexer_v2"
_REPO = "cannmirror/ops-transformer@1ecdfd4 attention/quant_lightning_indexer_v2/"
QLI2_SOURCE = (f"docs/numerics/indexer.md#quant_lightning_indexer_v2; {_REPO}op_host/"
               "quant_lightning_indexer_v2_tiling.cpp")
_GOLDEN = f"{_REPO}tests/pytest/quant_lightning_indexer_v2_golden.py"
#: quant_mode -> (query/key dtype as carried, weights / scale dtype); HiFloat8 codes travel as uint8
QLI2_QUANT_MODES = {2: ("int8", "float16"), 1: ("float8_e4m3fn", "float32"), 4: ("uint8", "float32")}
_FMT_MODE = {"int8": 2, "float8_e4m3fn": 1, "hifloat8": 4}
CMP_RATIOS = (1, 2, 4, 8, 16, 32, 64, 128)
CMP_RATIOS_950 = (1, 4, 128)
SPARSE_LIMIT = 2048
HEADS = 64
KEY_LAYOUTS = ("PA_BBND", "BSND", "TND")


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def qli2_case(*, fmt="int8", layout_q="BSND", layout_k="PA_BBND", batch=2, q_s=2, kv_s=6, cmp_ratio=4, mask_mode=3,
              topk=4, block_size=16, residual=1, seed=0):
    """A small valid quant_lightning_indexer_v2 argument set: ``kv_s`` compressed key tokens per batch, the
    original length ``kv_s * cmp_ratio + residual`` (cmp_residual_k given where the op_host requires it)."""
    rng = np.random.default_rng(seed)
    qm = _FMT_MODE[fmt]
    cast = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "hifloat8": np.uint8}[fmt]
    q = _nope_codes(rng, (batch, q_s, HEADS, 128), fmt).view(cast)
    k = _nope_codes(rng, (batch, kv_s, 1, 128), fmt).view(cast)
    key, bt = _kv_storage(k, layout_kv="PA" if layout_k == "PA_BBND" else layout_k, block_size=block_size, kv_s=kv_s)
    sdt = np.float16 if fmt == "int8" else np.float32
    w = rng.uniform(-1, 1, (batch, q_s, HEADS)).astype(sdt)
    if fmt == "hifloat8":
        qs = np.array([0.05], sdt)
        ks = np.array([0.07], sdt)
    else:
        qs = rng.uniform(0.01, 0.1, (batch, q_s, HEADS)).astype(sdt)
        ks = rng.uniform(0.01, 0.1, key.shape[:-1]).astype(sdt)
    if layout_q == "TND":
        q, w = q.reshape(batch * q_s, HEADS, 128), w.reshape(batch * q_s, HEADS)
        qs = qs if fmt == "hifloat8" else qs.reshape(batch * q_s, HEADS)
    need_res = cmp_ratio != 1 and mask_mode != 0
    return dict(query=q, key=key, weights=w, query_dequant_scale=qs, key_dequant_scale=ks, topk=topk, quant_mode=qm,
                cu_seqlens_q=_cu([q_s] * batch) if layout_q == "TND" else None,
                cu_seqlens_k=_cu([kv_s] * batch) if layout_k == "TND" else None,
                seqused_q=None, seqused_k=None if layout_k == "TND" else np.full(batch, kv_s, np.int32),
                cmp_residual_k=np.full(batch, residual, np.int32) if need_res else None,
                block_table=bt, output_idx_offset=None, metadata=None, max_seqlen_q=-1, layout_q=layout_q,
                layout_k=layout_k, mask_mode=mask_mode, cmp_ratio=cmp_ratio, return_value=0, tie_break="lower_index",
                precision="faithful")


_N = Names(QLI2, qli2_case, layout_kv="layout_k", lens_kv="seqused_k", source=QLI2_SOURCE)


def _b(a) -> int:
    """The batch size: query's dimension 0 (BSND) or cu_seqlens_q's length - 1 (TND)."""
    return int(a.query.shape[0]) if a.layout_q == "BSND" else int(a.cu_seqlens_q.size) - 1


def _pa(a) -> bool:
    return a.layout_k == "PA_BBND"


def _vec(a, p):
    return np.asarray(a[p], np.int64).reshape(-1)


def _s2(a) -> np.ndarray:
    """Compressed key tokens per batch."""
    if a.layout_k == "TND":
        c = _vec(a, "cu_seqlens_k")
        return c[1:] - c[:-1]
    if a.get("seqused_k") is None:
        return np.full(_b(a), a.key.shape[1], np.int64)
    return _vec(a, "seqused_k")


def _prefix_problem(v, total):
    if v.ndim != 1:
        return f"shape {tuple(v.shape)}"
    c = np.asarray(v, np.int64)
    if c.size < 2:
        return f"{c.size} entries"
    if c[0] != 0:
        return f"starts at {int(c[0])}"
    if (np.diff(c) < 0).any():
        return "decreasing"
    if c[-1] > total:
        return f"ends at {int(c[-1])} > {total}"
    return None


def _set(**kw):
    return setting(**kw)


def _rules():
    n = _N
    r = [is_array(QLI2, p, source=QLI2_SOURCE)
         for p in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale")]
    opt = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "cmp_residual_k", "block_table",
           "output_idx_offset", "metadata")
    r += [is_array(QLI2, p, optional=True, source=QLI2_SOURCE) for p in opt]
    r.append(rule(n, "quant_mode_value", "quant_mode", "value",
                  "must be 2 (int8, Atlas A2/A3), 1 (FP8 E4M3FN, 950) or 4 (HiFloat8, 950) (op_host)",
                  lambda a: None if is_int(a.quant_mode) and a.quant_mode in QLI2_QUANT_MODES else a.quant_mode,
                  edit(n, _set(quant_mode=3))))
    r.append(dtype_in(QLI2, "query", ("int8", "float8_e4m3fn", "uint8"), source=QLI2_SOURCE))
    r.append(rule(n, "query_dtype_for_quant_mode", "query", "dtype",
                  "must be int8 for quant_mode 2, float8_e4m3fn for 1 and HiFloat8 codes (uint8) for 4 (op_host)",
                  lambda a: None if dtype_name(a.query) == QLI2_QUANT_MODES[a.quant_mode][0] else dtype_name(a.query),
                  edit(n, _set(quant_mode=1)), dtype=True))
    r.append(rule(n, "key_dtype", "key", "dtype", "must have the query's dtype (op_host)",
                  lambda a: None if a.key.dtype == a.query.dtype else dtype_name(a.key),
                  edit(n, lambda a: a.update(key=a["key"].view(np.uint8))), dtype=True))
    r.append(dtype_in(QLI2, "weights", ("float16", "float32"), source=QLI2_SOURCE))
    r.append(dtype_in(QLI2, "query_dequant_scale", ("float16", "float32"), source=QLI2_SOURCE))
    r.append(rule(n, "key_dequant_scale_dtype", "key_dequant_scale", "dtype",
                  "must have query_dequant_scale's dtype (op_host)",
                  lambda a: None if a.key_dequant_scale.dtype == a.query_dequant_scale.dtype
                  else dtype_name(a.key_dequant_scale),
                  edit(n, lambda a: a.update(key_dequant_scale=a["key_dequant_scale"].astype(np.float32))),
                  dtype=True))
    r += [dtype_in(QLI2, p, ("int32",), source=QLI2_SOURCE) for p in opt if p != "output_idx_offset"]
    r.append(rule(n, "layout_q_value", "layout_q", "value", "must be 'BSND' or 'TND' (op_host)",
                  lambda a: None if a.layout_q in ("BSND", "TND") else a.layout_q, edit(n, _set(layout_q="BNSD"))))
    r.append(rule(n, "layout_k_value", "layout_k", "value", f"must be {one_of(KEY_LAYOUTS)} (op_host)",
                  lambda a: None if a.layout_k in KEY_LAYOUTS else a.layout_k, edit(n, _set(layout_k="PA_BSND"))))
    r.append(rule(n, "layout_k_matches_layout_q", "layout_k", "value",
                  "outside of PA_BBND, layout_k must equal layout_q (op_host)",
                  lambda a: None if _pa(a) or a.layout_k == a.layout_q else a.layout_k,
                  edit(n, _set(layout_k="TND", cu_seqlens_k=_cu([6, 6]), seqused_k=None, block_table=None),
                       fmt="float8_e4m3fn", layout_k="BSND")))
    # presence of the optional tensors per layout (op_host GetAndCheckOptionalInput)
    r.append(rule(n, "cu_seqlens_q_presence", "cu_seqlens_q", "value",
                  "is required when layout_q is TND and must be None when it is BSND (op_host)",
                  lambda a: None if (a.get("cu_seqlens_q") is not None) == (a.layout_q == "TND")
                  else ("None" if a.get("cu_seqlens_q") is None else "given"),
                  edit(n, _set(cu_seqlens_q=None), layout_q="TND")))
    r.append(rule(n, "cu_seqlens_k_presence", "cu_seqlens_k", "value",
                  "is required when layout_k is TND and must be None otherwise (op_host)",
                  lambda a: None if (a.get("cu_seqlens_k") is not None) == (a.layout_k == "TND")
                  else ("None" if a.get("cu_seqlens_k") is None else "given"),
                  edit(n, _set(cu_seqlens_k=np.array([0, 6, 12], np.int32)))))
    r.append(rule(n, "block_table_presence", "block_table", "value",
                  "is required when layout_k is PA_BBND and must be None otherwise (op_host)",
                  lambda a: None if (a.get("block_table") is not None) == _pa(a)
                  else ("None" if a.get("block_table") is None else "given"), edit(n, _set(block_table=None))))
    r.append(rule(n, "seqused_k_required", "seqused_k", "value", "is required when layout_k is PA_BBND (op_host)",
                  lambda a: None if not _pa(a) or a.get("seqused_k") is not None else "None",
                  edit(n, _set(seqused_k=None))))
    r.append(rule(n, "seqused_with_tnd", "seqused_q", "value",
                  "must be None with a TND layout: qsfa models TND lengths from cu_seqlens_q / cu_seqlens_k only "
                  f"(the public golden ignores seqused there, {_GOLDEN})",
                  lambda a: None if not ((a.layout_q == "TND" and a.get("seqused_q") is not None)
                                         or (a.layout_k == "TND" and a.get("seqused_k") is not None)) else "given",
                  edit(n, _set(seqused_q=np.array([2, 2], np.int32)), layout_q="TND")))
    r.append(rule(n, "cmp_residual_k_presence", "cmp_residual_k", "value",
                  "is required when cmp_ratio is not 1 and mask_mode is not 0, and must be None otherwise (op_host)",
                  lambda a: None if (a.get("cmp_residual_k") is not None) == (a.cmp_ratio != 1 and a.mask_mode != 0)
                  else ("None" if a.get("cmp_residual_k") is None else "given"),
                  edit(n, _set(cmp_residual_k=None))))
    r.append(rule(n, "output_idx_offset_value", "output_idx_offset", "value",
                  f"must be None: the golden ({_GOLDEN}) passes None and qsfa does not model an offset",
                  lambda a: None if a.get("output_idx_offset") is None else "given",
                  edit(n, _set(output_idx_offset=np.zeros(2, np.int32)))))
    # ranks and shapes
    r.append(rule(n, "query_rank", "query", "shape", "number of dimensions must be 4 (BSND) or 3 (TND)",
                  lambda a: None if a.query.ndim == (4 if a.layout_q == "BSND" else 3) else a.query.ndim,
                  edit(n, lambda a: a.update(query=a["query"][0]))))
    r.append(rule(n, "key_rank", "key", "shape", "number of dimensions must be 4 (PA_BBND, BSND) or 3 (TND)",
                  lambda a: None if a.key.ndim == (3 if a.layout_k == "TND" else 4) else a.key.ndim,
                  edit(n, lambda a: a.update(key=a["key"][0]))))
    r.append(rule(n, "block_table_rank", "block_table", "shape", "number of dimensions must be 2",
                  lambda a: None if a.get("block_table") is None or a.block_table.ndim == 2 else a.block_table.ndim,
                  edit(n, lambda a: a.update(block_table=a["block_table"].reshape(-1)))))
    for p in ("query", "key"):
        r.append(rule(n, f"{p}_head_dim", p, "shape", "D (last dimension) must be 128 (op_host)",
                      lambda a, p=p: None if a[p].shape[-1] == 128 else tuple(a[p].shape),
                      edit(n, lambda a, p=p: a.update({p: np.ascontiguousarray(a[p][..., :64])}))))
    r.append(rule(n, "kv_heads", "key", "shape", "N2 (dimension -2) must be 1 (op_host)",
                  lambda a: None if a.key.shape[-2] == 1 else tuple(a.key.shape),
                  edit(n, lambda a: a.update(key=np.ascontiguousarray(np.repeat(a["key"], 2, axis=-2))))))
    r.append(rule(n, "query_heads", "query", "shape", f"N1 (dimension -2) must be {HEADS} (op_host: G = 64)",
                  lambda a: None if a.query.shape[-2] == HEADS else tuple(a.query.shape),
                  edit(n, lambda a: a.update(query=np.ascontiguousarray(a["query"][..., :32, :])))))
    r.append(rule(n, "weights_shape", "weights", "shape", "must be query.shape[:-1] (op_host)",
                  lambda a: None if a.weights.shape == a.query.shape[:-1] else tuple(a.weights.shape),
                  edit(n, lambda a: a.update(weights=np.ascontiguousarray(a["weights"][..., :1])))))

    def scale_want(a, p):
        if a.quant_mode == 4:
            return (1,)
        return tuple((a.query if p == "query_dequant_scale" else a.key).shape[:-1])

    for p in ("query_dequant_scale", "key_dequant_scale"):
        base = p.split("_")[0]
        r.append(rule(n, f"{p}_shape", p, "shape",
                      f"must be [1] (one scale) for quant_mode 4 and {base}.shape[:-1] otherwise (op_host)",
                      lambda a, p=p: None if tuple(a[p].shape) == scale_want(a, p) else tuple(a[p].shape),
                      edit(n, lambda a, p=p: a.update({p: np.ascontiguousarray(a[p].reshape(-1))}))))
    r.append(rule(n, "topk_value", "topk", "value", f"must be in [1, {SPARSE_LIMIT}] (op_host)",
                  lambda a: None if is_int(a.topk) and 1 <= a.topk <= SPARSE_LIMIT else a.topk,
                  edit(n, _set(topk=SPARSE_LIMIT + 1))))
    r.append(rule(n, "cmp_ratio_value", "cmp_ratio", "value", "must be a power of 2 in [1, 128] (op_host)",
                  lambda a: None if is_int(a.cmp_ratio) and a.cmp_ratio in CMP_RATIOS else a.cmp_ratio,
                  edit(n, _set(cmp_ratio=3))))
    r.append(rule(n, "mask_mode_value", "mask_mode", "value", "must be 0 or 3 (op_host)",
                  lambda a: None if is_int(a.mask_mode) and a.mask_mode in (0, 3) else a.mask_mode,
                  edit(n, _set(mask_mode=1))))
    r.append(rule(n, "return_value_value", "return_value", "value",
                  "must be 0 / False (op_host: returnValue only supported False)",
                  lambda a: None if a.return_value in (0, False) and not isinstance(a.return_value, float)
                  else a.return_value, edit(n, _set(return_value=1))))
    r.append(rule(n, "block_size_value", "key", "shape",
                  "block_size (key dimension 1) must be a multiple of 16 in (0, 1024] for PA_BBND (op_host)",
                  lambda a: None if not _pa(a) or (a.key.shape[1] % 16 == 0 and 0 < a.key.shape[1] <= 1024)
                  else tuple(a.key.shape), edit(n, block_size=8)))
    # lengths
    r.append(rule(n, "cu_seqlens_q_values", "cu_seqlens_q", "value",
                  "must be [B + 1] prefix sums starting at 0, non-decreasing, at most query's T",
                  lambda a: None if a.get("cu_seqlens_q") is None else _prefix_problem(a.cu_seqlens_q,
                                                                                     a.query.shape[0]),
                  edit(n, lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"][::-1].copy()), layout_q="TND")))
    r.append(rule(n, "cu_seqlens_k_values", "cu_seqlens_k", "value",
                  "must be [B + 1] prefix sums starting at 0, non-decreasing, at most key's T, with cu_seqlens_q's B",
                  lambda a: None if a.get("cu_seqlens_k") is None else (
                      _prefix_problem(a.cu_seqlens_k, a.key.shape[0])
                      or (None if a.cu_seqlens_k.size == _b(a) + 1 else f"{a.cu_seqlens_k.size} entries")),
                  edit(n, lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"][:2].copy()), fmt="float8_e4m3fn",
                       layout_q="TND", layout_k="TND")))
    for p, bad in (("seqused_q", np.array([1, 1, 1], np.int32)), ("seqused_k", np.array([6, 6, 6], np.int32)),
                   ("cmp_residual_k", np.array([1, 1, 1], np.int32))):
        r.append(rule(n, f"{p}_shape", p, "shape", "must hold one entry per batch ([B]) (op_host)",
                      lambda a, p=p: None if a.get(p) is None or tuple(a[p].shape) == (_b(a),) else tuple(a[p].shape),
                      edit(n, _set(**{p: bad}))))
    r.append(rule(n, "seqused_q_values", "seqused_q", "value", "entries must be in [0, S1] (query dimension 1)",
                  lambda a: None if a.get("seqused_q") is None or (
                      _vec(a, "seqused_q").min(initial=0) >= 0
                      and _vec(a, "seqused_q").max(initial=0) <= a.query.shape[1]) else a.seqused_q.tolist(),
                  edit(n, _set(seqused_q=np.array([3, 1], np.int32)))))

    def k_range(a):
        if a.get("seqused_k") is None:
            return None
        v = _vec(a, "seqused_k")
        cap = a.block_table.shape[1] * a.key.shape[1] if _pa(a) else a.key.shape[1]
        return None if v.min(initial=0) >= 0 and v.max(initial=0) <= cap else v.tolist()

    r.append(rule(n, "seqused_k_values", "seqused_k", "value",
                  "compressed lengths must be >= 0 and fit the key (PA_BBND: block_table.shape[1] * block_size; "
                  "BSND: key dimension 1)", k_range, edit(n, _set(seqused_k=np.array([6, 40], np.int32)))))
    r.append(rule(n, "block_table_batch", "block_table", "shape", "dimension 0 must be the batch size B (op_host)",
                  lambda a: None if a.get("block_table") is None or a.block_table.shape[0] == _b(a)
                  else tuple(a.block_table.shape),
                  edit(n, lambda a: a.update(block_table=np.concatenate([a["block_table"]] * 2)))))

    r += paged_key_rules(n, _s2, "batch", "quant_lightning_indexer_metadata (op_host)")
    for p in ("weights", "query_dequant_scale", "key_dequant_scale"):
        r.append(finite_rule(n, p))
    r.append(choice_rule(n, "tie_break", TIE_BREAKS, source="docs/numerics/open-facts.md#tie_break"))
    r.append(choice_rule(n, "precision", _ref.PRECISIONS,
                         source="docs/numerics/indexer.md#quant_lightning_indexer_v2 (qsfa's parameter)"))
    # chips (op_host: DAV_2201 = Atlas A2/A3, DAV_3510 = Ascend 950)

    def a2a3(a):
        dts = (a.quant_mode, dtype_name(a.weights), dtype_name(a.query_dequant_scale))
        return None if dts == (2, "float16", "float16") else f"{dts}"

    r.append(rule(n, "a2a3_quant_mode", "quant_mode", "value",
                  "Atlas A2/A3 support quant_mode 2 (int8) with float16 weights and dequant scales only (op_host)",
                  a2a3, edit(n, fmt="float8_e4m3fn", layout_k="BSND"), chips=("A2", "A3")))
    r.append(rule(n, "a2a3_layout_k", "layout_k", "value", "Atlas A2/A3 support layout_k PA_BBND only (op_host)",
                  lambda a: None if _pa(a) else a.layout_k, edit(n, layout_k="BSND"), chips=("A2", "A3")))

    def c950(a):
        dts = (a.quant_mode, dtype_name(a.weights), dtype_name(a.query_dequant_scale))
        return None if dts[0] in (1, 4) and dts[1:] == ("float32", "float32") else f"{dts}"

    r.append(rule(n, "950_quant_mode", "quant_mode", "value",
                  "Ascend 950 supports quant_mode 1 (FP8 E4M3FN) or 4 (HiFloat8) with float32 weights and dequant "
                  "scales only (op_host)", c950, edit(n, fmt="int8"), chips=("950",)))
    r.append(rule(n, "950_cmp_ratio", "cmp_ratio", "value", "Ascend 950 supports cmp_ratio 1, 4 or 128 (op_host)",
                  lambda a: None if a.cmp_ratio in CMP_RATIOS_950 else a.cmp_ratio,
                  edit(n, fmt="float8_e4m3fn", cmp_ratio=8), chips=("950",)))
    return r


QLI2_CONTRACT = Contract(op=QLI2, constraints=_rules(), example=lambda rng: qli2_case(), params=params(
    "query:array key:array weights:array query_dequant_scale:array key_dequant_scale:array topk:int quant_mode:int"
    " cu_seqlens_q:array? cu_seqlens_k:array? seqused_q:array? seqused_k:array? cmp_residual_k:array?"
    " block_table:array? output_idx_offset:array? metadata:array? max_seqlen_q:int layout_q:str layout_k:str"
    " mask_mode:int cmp_ratio:int return_value:int tie_break:str precision:str"))


def _reference(**args):
    return _ref.quant_lightning_indexer_v2(**args)


define_operator(QLI2, QLI2_CONTRACT, outputs=("sparse_indices", "sparse_values"), reference=_reference,
                doc="V4 quantised lightning indexer with per-token-head scales (ops-transformer QLI v2).")


def quant_lightning_indexer_v2(query, key, weights, query_dequant_scale, key_dequant_scale, topk, quant_mode, *,
                               cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                               cmp_residual_k=None, block_table=None, output_idx_offset=None, metadata=None,
                               max_seqlen_q=-1, layout_q="BSND", layout_k="BSND", mask_mode=0, cmp_ratio=1,
                               return_value=0, tie_break="lower_index", precision="faithful", chip=None,
                               backend="reference"):
    """Top-k compressed key tokens per query row: ops-transformer's QuantLightningIndexerV2, called as
    ``torch.ops.cann_ops_transformer.quant_lightning_indexer`` (docs/numerics/indexer.md#quant_lightning_indexer_v2).

    Names and defaults are the torch schema's. query / key: int8 (quant_mode 2, Atlas A2/A3), float8_e4m3fn
    (quant_mode 1, 950) or HiFloat8 codes as uint8 (quant_mode 4, 950), ``[B, S1, 64, 128]`` / ``[T, 64, 128]`` and
    ``[block_count, block_size, 1, 128]`` (PA_BBND) / ``[B, S2, 1, 128]`` (BSND) / ``[T2, 1, 128]`` (TND),
    compressed tokens; weights ``query.shape[:-1]`` (float16 for mode 2, float32 otherwise); dequant scales per
    token-head (``query.shape[:-1]`` / ``key.shape[:-1]``) or ``[1]`` for mode 4. seqused_k / cu_seqlens_k count
    compressed tokens; the original length is ``seqused_k * cmp_ratio + cmp_residual_k``. metadata (the tiling
    of quant_lightning_indexer_metadata) and max_seqlen_q do not change the result. precision: "faithful"
    (the kernels' rounding points) or "exact" (float64 scores). Returns ``(sparse_indices int32
    [B, S1, 1, topk] / [T, 1, topk], sparse_values bfloat16 [0])``.
    """
    args = dict(query=query, key=key, weights=weights, query_dequant_scale=query_dequant_scale,
                key_dequant_scale=key_dequant_scale, topk=topk, quant_mode=quant_mode, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k, cmp_residual_k=cmp_residual_k,
                block_table=block_table, output_idx_offset=output_idx_offset, metadata=metadata,
                max_seqlen_q=max_seqlen_q, layout_q=layout_q, layout_k=layout_k, mask_mode=mask_mode,
                cmp_ratio=cmp_ratio, return_value=return_value, tie_break=tie_break, precision=precision)
    return run(QLI2, args, backend, chip=chip)
