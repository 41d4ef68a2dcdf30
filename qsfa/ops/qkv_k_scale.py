"""Front door of ``qkv_rms_norm_rope_cache_with_k_scale`` (Ascend 950; docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale).

``cann_ops_transformer.qkv_rms_norm_rope_cache_with_k_scale_`` (aclnnQkvRmsNormRopeCacheWithKScale), its RoPE
scenario: RMSNorm + RoPE + a bf16 rotation GEMM + per-token-head FP8 quantisation of Q and K, V scaled per head to
FP8, K / V / K-scale caches written by slot; and its M-RoPE scenario (``mrope_position`` / ``mrope_section``: three
position streams, bf16 Q, INT8 K) and its M-RoPE MX scenario (``q_quant_mode = k_quant_mode = "Mx"``: MXFP8 Q and K with
E8M0 scales per 32 lanes, no rotation). Reference :mod:`qsfa.reference.qkv_k_scale` (which writes the caches through
:mod:`qsfa.reference.k_scale_cache`); tests tests/test_qkv_k_scale.py. Sources: cannmirror/ops-transformer@c4f5cf7
``posembedding/qkv_rms_norm_rope_cache_with_k_scale/`` (README.md, op_kernel/arch35/); the M-RoPE scenario from
hicann/ops-transformer@c0dda0b (``op_host/op_api/..._checker.h``, ``torch_extension/cann_ops_transformer/docs/zh/
qkv_rms_norm_rope_cache_with_k_scale.md``); the MX scenario from recursion-ascend/ops-transformer@a093e95
(``op_host/op_tiling/arch35/..._base_tiling.cpp``, ``op_kernel/arch35/..._mrope_mx_*.h``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import dtype_in, is_array
from .._contract import Contract, params
from .._dispatch import define_operator, run
from .._errors import Raw
from ..reference import qkv_k_scale as _ref
from ._attention_rules import choice_rule, edit, finite_rule, is_int, Names, rule, setting

__all__ = ["qkv_rms_norm_rope_cache_with_k_scale", "qkv_case", "mrope_case", "mx_case", "QKV_CONTRACT"]

QKV = "qkv_rms_norm_rope_cache_with_k_scale"
QKV_SOURCE = ("docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale; cannmirror/ops-transformer@c4f5cf7 "
              "posembedding/qkv_rms_norm_rope_cache_with_k_scale/README.md")
MROPE_SOURCE = ("docs/numerics/cache-writers.md#m-rope-scenario; hicann/ops-transformer@c0dda0b "
                "torch_extension/cann_ops_transformer/docs/zh/qkv_rms_norm_rope_cache_with_k_scale.md")
MX_SOURCE = ("docs/numerics/cache-writers.md#m-rope-mx-scenario; recursion-ascend/ops-transformer@a093e95 "
             "posembedding/qkv_rms_norm_rope_cache_with_k_scale/op_host/op_tiling/arch35/"
             "qkv_rms_norm_rope_cache_with_k_scale_base_tiling.cpp")
D = 128
_BF16 = ml_dtypes.bfloat16
_E4M3 = ml_dtypes.float8_e4m3fn
_E8M0 = ml_dtypes.float8_e8m0fnu


def qkv_case(*, t=4, nq=16, nk=2, batch=2, layout_qkv="TND", layout_q_out="NTD", block_num=2, block_size=16,
             max_seq=32, seed=0):
    """A small valid argument set: ``t`` tokens split over ``batch`` requests with some history, slots scattered
    over the blocks, caches pre-filled with a marker byte."""
    rng = np.random.default_rng(seed)
    n = nq + 2 * nk
    qkv = rng.standard_normal((t, n, D)).astype(_BF16)
    if layout_qkv == "NTD":
        qkv = np.ascontiguousarray(qkv.transpose(1, 0, 2))
    ang = rng.uniform(0, 2 * np.pi, (max_seq, D // 2))
    cos_sin = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    cuts = np.sort(rng.choice(np.arange(1, t), size=batch - 1, replace=False)) if batch > 1 else np.array([], int)
    qsl = np.concatenate([[0], cuts, [t]]).astype(np.int32)
    local = np.diff(qsl)
    seq_lens = (local + rng.integers(0, max_seq - t + 1, batch)).astype(np.int32)
    slots = rng.permutation(block_num * block_size)[:t].astype(np.int32)
    return dict(qkv=qkv, q_gamma=rng.uniform(0.5, 1.5, D).astype(np.float32),
                k_gamma=rng.uniform(0.5, 1.5, D).astype(np.float32), cos_sin=cos_sin, slot_mapping=slots,
                k_cache=np.full((block_num, nk, block_size, D), 0x11, np.uint8).view(_E4M3),
                v_cache=np.full((block_num, nk, block_size, D), 0x22, np.uint8).view(_E4M3),
                k_scale_cache=np.full((block_num, nk, block_size, 1), -1.0, np.float32),
                query_start_loc=qsl, seq_lens=seq_lens, head_nums=[nq, nk, nk],
                rotation=(rng.standard_normal((D, D)) / np.sqrt(D)).astype(_BF16),
                v_scale=rng.uniform(0.5, 2.0, nk).astype(np.float32), layout_qkv=layout_qkv,
                layout_q_out=layout_q_out, epsilon=1e-6, mrope_position=None, mrope_section=None,
                q_quant_mode="PerTokenPerHead", q_out_dtype="float8_e4m3fn", k_quant_mode="PerTokenPerHead",
                zero_head="zero", mx_aiv_num=None, mx_ub_bytes=None)


def mrope_case(*, t=4, nq=16, nk=2, block_num=2, block_size=16, max_seq=32, section=(22, 12, 10), seed=0):
    """A small valid argument set of the M-RoPE scenario: ``qkv_case``'s arrays (TND in and out) with T / H / W
    positions ``[T, 3]`` drawn from the table's rows, ``mrope_section`` ``section``, an int8 K cache, a per-lane
    ``v_scale [Nk, 128]``, no query_start_loc / seq_lens, bf16 Q unquantised."""
    a = qkv_case(t=t, nq=nq, nk=nk, batch=1, layout_qkv="TND", layout_q_out="TND", block_num=block_num,
                 block_size=block_size, max_seq=max_seq, seed=seed)
    rng = np.random.default_rng(seed + 1)
    a.update(query_start_loc=None, seq_lens=None, mrope_position=rng.integers(0, max_seq, (t, 3)).astype(np.int32),
             mrope_section=list(section), q_quant_mode="NoQuant", q_out_dtype="bfloat16",
             k_cache=np.full(a["k_cache"].shape, 0x11, np.int8),
             v_scale=rng.uniform(0.5, 2.0, (nk, D)).astype(np.float32))
    return a


def mx_case(*, t=4, nq=16, nk=2, block_num=2, block_size=16, max_seq=32, section=(22, 12, 10), seed=0):
    """A small valid argument set of the M-RoPE MX scenario: ``mrope_case``'s arrays with ``q_quant_mode =
    k_quant_mode = "Mx"``, ``q_out_dtype`` float8_e4m3fn, no rotation, an FP8 K cache and an E8M0 K-scale cache
    ``[BlockNum, Nk, BlockSize, 4]`` pre-filled with a marker byte."""
    a = mrope_case(t=t, nq=nq, nk=nk, block_num=block_num, block_size=block_size, max_seq=max_seq, section=section,
                   seed=seed)
    a.update(q_quant_mode="Mx", k_quant_mode="Mx", q_out_dtype="float8_e4m3fn", rotation=None,
             k_cache=np.full(a["k_cache"].shape, 0x11, np.uint8).view(_E4M3),
             k_scale_cache=np.full(a["k_cache"].shape[:3] + (4,), 0x33, np.uint8).view(_E8M0))
    return a


def _case(mrope=False, mx=False, **kw):
    return mx_case(**kw) if mx else mrope_case(**kw) if mrope else qkv_case(**kw)


_N = Names(QKV, _case, source=QKV_SOURCE)


def _mrope(a) -> bool:
    return a.get("mrope_position") is not None


def _mx(a) -> bool:
    """The M-RoPE MX scenario (the host's ``ResolveScene``: M-RoPE with q_quant_mode and k_quant_mode "Mx")."""
    return _mrope(a) and a.get("q_quant_mode") == "Mx"


def _scene(a) -> str:
    return ("mx" if _mx(a) else "int8") if _mrope(a) else "rope"


def _heads(a):
    return tuple(int(h) for h in a.head_nums)


def _t(a) -> int:
    return int(a.qkv.shape[0] if a.layout_qkv == "TND" else a.qkv.shape[1])


def _shape_rule(cid, p, reason, want, change, **variant):
    return rule(_N, cid, p, "shape", reason,
                lambda a: None if a[p] is None or tuple(a[p].shape) == tuple(want(a)) else tuple(a[p].shape),
                edit(_N, change, **variant))


def _section(a):
    v = a.get("mrope_section")
    return [] if v is None else v


def _scenario_rules():
    """The rules that tell the two scenarios apart (hicann/ops-transformer@c0dda0b ``..._checker.h``
    ``DetermineScene``, ``CheckRopeSceneParams``, ``CheckMropeSceneParams``; the torch_extension doc's table)."""
    n, src = _N, MROPE_SOURCE

    def sources_ok(a):
        has_sec = not (isinstance(_section(a), (list, tuple)) and len(_section(a)) == 0)
        return None if _mrope(a) == has_sec else ("mrope_position given" if _mrope(a) else repr(_section(a)))

    r = [rule(n, "mrope_inputs_together", "mrope_section", "value",
              "mrope_position and a non-empty mrope_section must be given together (None / [] both for RoPE)",
              sources_ok, edit(n, setting(mrope_section=None), mrope=True), source=src),
         rule(n, "rope_positions_by_scenario", "query_start_loc", "value",
              "query_start_loc and seq_lens must both be arrays in the RoPE scenario and both None in the M-RoPE "
              "scenario (mrope_position given)",
              lambda a: None if all((a.get(p) is None) == _mrope(a) for p in ("query_start_loc", "seq_lens"))
              else ("not None" if _mrope(a) else "None"),
              edit(n, lambda a: a.update(query_start_loc=np.array([0, 4], np.int32)), mrope=True), source=src)]
    r.append(rule(n, "q_quant_mode_by_scenario", "q_quant_mode", "value",
                  "must be 'PerTokenPerHead' in the RoPE scenario and 'NoQuant' or 'Mx' in the M-RoPE scenarios",
                  lambda a: None if (a.get("q_quant_mode") in ("NoQuant", "Mx")) == _mrope(a)
                  else a.get("q_quant_mode"),
                  edit(n, setting(q_quant_mode="PerTokenPerHead"), mrope=True), source=src))
    want_q = {"rope": "float8_e4m3fn", "int8": "bfloat16", "mx": "float8_e4m3fn"}
    r.append(rule(n, "q_out_dtype_by_scenario", "q_out_dtype", "value",
                  "must be 'float8_e4m3fn' in the RoPE and M-RoPE MX scenarios and 'bfloat16' in the M-RoPE INT8 one",
                  lambda a: None if a.get("q_out_dtype") == want_q[_scene(a)] else a.get("q_out_dtype"),
                  edit(n, setting(q_out_dtype="float8_e4m3fn"), mrope=True), source=src))
    r.append(rule(n, "k_quant_mode_by_scenario", "k_quant_mode", "value",
                  "must be 'Mx' exactly when q_quant_mode is 'Mx' (the host resolves three scenes: RoPE with "
                  "PerTokenPerHead / PerTokenPerHead, M-RoPE with NoQuant / PerTokenPerHead, M-RoPE with Mx / Mx)",
                  lambda a: None if (a.get("k_quant_mode") == "Mx") == _mx(a) else a.get("k_quant_mode"),
                  edit(n, setting(k_quant_mode="PerTokenPerHead"), mx=True), source=MX_SOURCE))
    r.append(rule(n, "k_cache_dtype_by_scenario", "k_cache", "dtype",
                  "must be float8_e4m3fn in the RoPE and M-RoPE MX scenarios and int8 in the M-RoPE INT8 scenario",
                  lambda a: None if dtype_name(a.k_cache) == ("int8" if _scene(a) == "int8" else "float8_e4m3fn")
                  else dtype_name(a.k_cache),
                  edit(n, lambda a: a.update(k_cache=np.zeros(a["k_cache"].shape, np.uint8).view(_E4M3)), mrope=True),
                  dtype=True, source=src))
    r.append(rule(n, "k_scale_cache_dtype_by_scenario", "k_scale_cache", "dtype",
                  "must be float8_e8m0fnu in the M-RoPE MX scenario and float32 otherwise (the host's scene traits)",
                  lambda a: None if dtype_name(a.k_scale_cache) == ("float8_e8m0fnu" if _mx(a) else "float32")
                  else dtype_name(a.k_scale_cache),
                  edit(n, lambda a: a.update(k_scale_cache=np.zeros(a["k_scale_cache"].shape, np.float32)), mx=True),
                  dtype=True, source=MX_SOURCE))
    r.append(rule(n, "rotation_absent_mx", "rotation", "value",
                  "must be None in the M-RoPE MX scenario (the host requires rotation present exactly when the scene "
                  "rotates; MX does not)",
                  lambda a: None if not _mx(a) or a.get("rotation") is None else "given",
                  edit(n, lambda a: a.update(rotation=np.eye(D, dtype=_BF16)), mx=True), source=MX_SOURCE))
    r.append(rule(n, "mrope_layouts", "layout_q_out", "value",
                  "the M-RoPE scenario supports only layout_qkv TND -> layout_q_out TND",
                  lambda a: None if not _mrope(a) or (a.layout_qkv, a.layout_q_out) == ("TND", "TND")
                  else f"{a.layout_qkv} -> {a.layout_q_out}", edit(n, setting(layout_q_out="NTD"), mrope=True),
                  source=src))

    def section_ok(a):
        v = _section(a)
        if not _mrope(a):
            return None
        if not isinstance(v, (list, tuple)) or len(v) != 3 or not all(is_int(x) for x in v):
            return repr(v)
        t, h, w = (int(x) for x in v)
        return None if min(t, h, w) >= 0 and h <= 21 and w <= 21 and t + h + w <= D // 2 else [t, h, w]

    r.append(rule(n, "mrope_section_value", "mrope_section", "value",
                  "must be [t, h, w] with t, h, w >= 0, h <= 21, w <= 21 and t + h + w <= 64 (D = 128)", section_ok,
                  edit(n, setting(mrope_section=[22, 22, 10]), mrope=True), source=src))
    r.append(rule(n, "zero_head_mrope", "zero_head", "value",
                  "must be 'zero' in the M-RoPE INT8 scenario (its K is INT8, which has no NaN code; Q is not "
                  "quantised)",
                  lambda a: None if _scene(a) != "int8" or a.get("zero_head", "zero") == "zero" else a.zero_head,
                  edit(n, setting(zero_head="nan"), mrope=True), source="docs/numerics/open-facts.md#qkv-zero-head"))
    return r


def _mrope_position_rules():
    n = _N
    r = [rule(n, "mrope_position_shape", "mrope_position", "shape", "must be [T, 3] (T / H / W positions per token)",
              lambda a: None if not _mrope(a) or tuple(a.mrope_position.shape) == (_t(a), 3)
              else tuple(a.mrope_position.shape),
              edit(n, lambda a: a.update(mrope_position=a["mrope_position"][:, :2].copy()), mrope=True),
              source=MROPE_SOURCE)]

    def values_ok(a):
        if not _mrope(a) or not a.mrope_position.size:
            return None
        p = np.asarray(a.mrope_position, np.int64)
        bad = (p < 0) | (p >= a.cos_sin.shape[0])
        return Raw(f"position {int(p[bad][0])}") if bad.any() else None

    def values_bad(a):
        p = a["mrope_position"].copy()
        p[0, 1] = a["cos_sin"].shape[0]
        a["mrope_position"] = p

    r.append(rule(n, "mrope_position_values", "mrope_position", "value",
                  "every position must be a row of cos_sin: 0 <= value < MaxSeqLen", values_ok,
                  edit(n, values_bad, mrope=True), source=MROPE_SOURCE))
    return r


def _rules():
    n = _N
    arrays = ("qkv", "q_gamma", "k_gamma", "cos_sin", "slot_mapping", "k_cache", "v_cache", "k_scale_cache",
              "query_start_loc", "seq_lens", "rotation", "v_scale")
    r = [is_array(QKV, p, source=QKV_SOURCE, optional=p in ("query_start_loc", "seq_lens")) for p in arrays]
    r.append(is_array(QKV, "mrope_position", optional=True, source=MROPE_SOURCE))
    for p, dts in (("qkv", ("bfloat16",)), ("q_gamma", ("float32",)), ("k_gamma", ("float32",)),
                   ("cos_sin", ("float32",)), ("slot_mapping", ("int32",)),
                   ("k_cache", ("float8_e4m3fn", "int8")), ("mrope_position", ("int32",)),
                   ("v_cache", ("float8_e4m3fn",)), ("k_scale_cache", ("float32", "float8_e8m0fnu")),
                   ("query_start_loc", ("int32",)),
                   ("seq_lens", ("int32",)), ("rotation", ("bfloat16",)), ("v_scale", ("float32",))):
        r.append(dtype_in(QKV, p, dts, source=QKV_SOURCE))
    for p in ("rotation", "v_scale"):  # keyword arguments defaulting to None, read by the RoPE scenario
        r.append(rule(n, f"{p}_required", p, "value", "must be given (the RoPE scenario reads it; README)",
                      (lambda p_: lambda a: None if a.get(p_) is not None or (p_ == "rotation" and _mx(a))
                       else "None")(p), edit(n, setting(**{p: None}))))
    r.append(choice_rule(n, "q_quant_mode", ("PerTokenPerHead", "NoQuant", "Mx"), source=MX_SOURCE))
    r.append(choice_rule(n, "q_out_dtype", ("float8_e4m3fn", "bfloat16"), bad="float16", source=MROPE_SOURCE))
    r.append(choice_rule(n, "k_quant_mode", ("PerTokenPerHead", "Mx"), bad="MX", source=MX_SOURCE))
    r.append(choice_rule(n, "layout_qkv", ("TND", "NTD")))
    r.append(choice_rule(n, "layout_q_out", ("TND", "NTD")))
    r.append(rule(n, "layout_pair", "layout_q_out", "value",
                  "layout_qkv -> layout_q_out must be NTD -> NTD, TND -> TND or TND -> NTD (README)",
                  lambda a: None if not (a.layout_qkv == "NTD" and a.layout_q_out == "TND") else a.layout_q_out,
                  edit(n, setting(layout_q_out="TND"), layout_qkv="NTD")))
    r.append(choice_rule(n, "zero_head", _ref.ZERO_HEAD, source="docs/numerics/open-facts.md#qkv-zero-head"))
    r.extend(_scenario_rules())

    def heads_ok(a):
        h = a.head_nums
        if not isinstance(h, (list, tuple)) or len(h) != 3 or not all(is_int(v) for v in h):
            return repr(h)
        nq, nk, nv = (int(v) for v in h)
        return None if 0 < nq <= 64 and nq == 8 * nk and nk == nv else [nq, nk, nv]

    r.append(rule(n, "head_nums_value", "head_nums", "value",
                  "must be [Nq, Nk, Nv] with 0 < Nq <= 64, Nq = 8 * Nk and Nk = Nv (README)", heads_ok,
                  edit(n, setting(head_nums=[16, 2, 1]))))
    r.append(rule(n, "qkv_shape", "qkv", "shape",
                  "must be [T, Nq + Nk + Nv, 128] (TND) or [Nq + Nk + Nv, T, 128] (NTD): D = 128 only (README)",
                  lambda a: None if a.qkv.ndim == 3 and a.qkv.shape[-1] == D
                  and a.qkv.shape[1 if a.layout_qkv == "TND" else 0] == sum(_heads(a)) else tuple(a.qkv.shape),
                  edit(n, lambda a: a.update(qkv=np.ascontiguousarray(a["qkv"][:, :-1])))))
    for p in ("q_gamma", "k_gamma"):
        r.append(_shape_rule(f"{p}_shape", p, "must be [128]", lambda a: (D,),
                             lambda a, p=p: a.update({p: a[p][:64].copy()})))
    r.append(rule(n, "cos_sin_shape", "cos_sin", "shape", "must be [MaxSeqLen, 128] (cos in [:64], sin in [64:])",
                  lambda a: None if a.cos_sin.ndim == 2 and a.cos_sin.shape[1] == D else tuple(a.cos_sin.shape),
                  edit(n, lambda a: a.update(cos_sin=a["cos_sin"][:, :64].copy()))))
    r.append(_shape_rule("rotation_shape", "rotation", "must be [128, 128] (README: BF16 [D, D])",
                         lambda a: (D, D), lambda a: a.update(rotation=a["rotation"][:64].copy())))
    r.append(_shape_rule("v_scale_shape", "v_scale", "must be [Nv] in the RoPE scenario (README) and [Nv, 128] in "
                         "the M-RoPE one (torch_extension doc)",
                         lambda a: (_heads(a)[2],) + ((D,) if _mrope(a) else ()),
                         lambda a: a.update(v_scale=np.ones(3, np.float32))))
    r.append(rule(n, "k_cache_shape", "k_cache", "shape", "must be [BlockNum, Nk, BlockSize, 128] (README)",
                  lambda a: None if a.k_cache.ndim == 4 and a.k_cache.shape[1] == _heads(a)[1]
                  and a.k_cache.shape[3] == D and a.k_cache.shape[2] > 0 else tuple(a.k_cache.shape),
                  edit(n, lambda a: a.update(k_cache=np.ascontiguousarray(a["k_cache"][:, :1])))))
    r.append(_shape_rule("v_cache_shape", "v_cache", "must have k_cache's shape [BlockNum, Nv, BlockSize, 128]",
                         lambda a: a.k_cache.shape, lambda a: a.update(v_cache=np.ascontiguousarray(a["v_cache"][:1]))))
    r.append(_shape_rule("k_scale_cache_shape", "k_scale_cache", "must be [BlockNum, Nk, BlockSize, 1] (README), "
                         "[BlockNum, Nk, BlockSize, 4] in the M-RoPE MX scenario (one E8M0 byte per 32 lanes)",
                         lambda a: a.k_cache.shape[:3] + (4 if _mx(a) else 1,),
                         lambda a: a.update(k_scale_cache=np.ascontiguousarray(a["k_scale_cache"][:1]))))
    r.append(_shape_rule("slot_mapping_shape", "slot_mapping", "must be [T]", lambda a: (_t(a),),
                         lambda a: a.update(slot_mapping=a["slot_mapping"][:-1].copy())))

    def slots_ok(a):
        s = np.asarray(a.slot_mapping, np.int64)
        cap = a.k_cache.shape[0] * a.k_cache.shape[2]
        if s.size and (s.min() < 0 or s.max() >= cap):
            return Raw(f"slot {int(s[(s < 0) | (s >= cap)][0])} outside [0, {cap})")
        u, c = np.unique(s, return_counts=True)
        return None if (c <= 1).all() else Raw(f"slot {int(u[np.argmax(c > 1)])} repeated")

    def slots_bad(a):
        s = a["slot_mapping"].copy()
        s[-1] = s[0]
        a["slot_mapping"] = s

    r.append(rule(n, "slot_mapping_values", "slot_mapping", "value",
                  "slots must be in [0, BlockNum * BlockSize) (README) and not repeat (README: the result of repeated "
                  "slots is undefined)", slots_ok, edit(n, slots_bad)))

    def qsl_ok(a):
        if _mrope(a):
            return None
        c = np.asarray(a.query_start_loc, np.int64)
        if c.ndim != 1 or c.size < 2:
            return Raw(f"shape {tuple(c.shape)}")
        if c[0] != 0 or (np.diff(c) < 0).any() or c[-1] != _t(a):
            return c.tolist()
        return None

    r.append(rule(n, "query_start_loc_values", "query_start_loc", "value",
                  "must be [B + 1] non-decreasing prefix sums from 0 to T (README)", qsl_ok,
                  edit(n, lambda a: a.update(query_start_loc=a["query_start_loc"][::-1].copy()))))

    def sl_ok(a):
        if _mrope(a):
            return None
        c = np.asarray(a.query_start_loc, np.int64)
        s = np.asarray(a.seq_lens, np.int64)
        if s.shape != (c.size - 1,):
            return Raw(f"shape {tuple(s.shape)}")
        if (s < np.diff(c)).any():
            return s.tolist()
        pos = _ref.positions(c, s, _t(a))
        return None if pos.size == 0 or pos.max() < a.cos_sin.shape[0] else Raw(f"position {int(pos.max())}")

    r.append(rule(n, "seq_lens_values", "seq_lens", "value",
                  "must be [B] with seq_lens[b] >= the request's tokens in qkv, and every position "
                  "seq_lens[b] - tokens + i must be a row of cos_sin (README)", sl_ok,
                  edit(n, lambda a: a.update(seq_lens=np.full_like(a["seq_lens"], 1000)))))
    r.extend(_mrope_position_rules())
    for p in ("qkv", "q_gamma", "k_gamma", "cos_sin", "rotation", "v_scale"):
        r.append(finite_rule(n, p))
    r.append(rule(n, "epsilon_value", "epsilon", "value", "must be a finite float32 > 0",
                  lambda a: None if np.isfinite(a.epsilon) and a.epsilon > 0 else a.epsilon,
                  edit(n, setting(epsilon=-1.0))))
    for p in ("mx_aiv_num", "mx_ub_bytes"):
        r.append(rule(n, f"{p}_value", p, "value", "must be >= 1 (a platform figure the MX host tiling reads; "
                      "docs/numerics/open-facts.md#qkv-mx-platform)",
                      (lambda p_: lambda a: None if a.get(p_) is None or int(a.get(p_)) >= 1 else a.get(p_))(p),
                      edit(n, setting(**{p: 0})), source=MX_SOURCE))

    def tile_ok(a):
        if not _mx(a):
            return None
        nq, nk, _ = _heads(a)
        ub = _ref.MX_UB_BYTES if a.get("mx_ub_bytes") is None else int(a.mx_ub_bytes)
        return None if _ref.mx_token_tile(_t(a), nq, nk, ub) else Raw(f"{ub} bytes")

    r.append(rule(n, "mx_ub_tile", "mx_ub_bytes", "value",
                  "must hold the M-RoPE MX kernel's UB layout for a token tile of 1 (the host fails NO_UB_TILE)",
                  tile_ok, edit(n, setting(mx_ub_bytes=4096), mx=True), source=MX_SOURCE))
    r.append(rule(n, "a2a3_unsupported", "qkv", "value", f"{QKV} runs on Ascend 950 only (README)",
                  lambda a: "Atlas A2/A3", edit(n), chips=("A2", "A3")))
    return r


QKV_CONTRACT = Contract(
    op=QKV, constraints=_rules(), example=lambda rng: qkv_case(), inplace=("k_cache", "v_cache", "k_scale_cache"),
    params=params("qkv:array q_gamma:array k_gamma:array cos_sin:array slot_mapping:array k_cache:array v_cache:array"
                  " k_scale_cache:array query_start_loc:array? seq_lens:array? head_nums:any rotation:array?"
                  " v_scale:array? layout_qkv:str layout_q_out:str epsilon:float32 mrope_position:array?"
                  " mrope_section:any? q_quant_mode:str q_out_dtype:str k_quant_mode:str zero_head:str mx_aiv_num:int?"
                  " mx_ub_bytes:int?"))


def _reference(**args):
    for p, default in (("mx_aiv_num", _ref.MX_AIV_NUM), ("mx_ub_bytes", _ref.MX_UB_BYTES)):
        if args.get(p) is None:  # a caller of run() without the platform figures: the 950 defaults
            args[p] = default
    return _ref.qkv_rms_norm_rope_cache_with_k_scale(**args)


define_operator(QKV, QKV_CONTRACT, outputs=("q_out", "q_scale", "k_cache", "v_cache", "k_scale_cache"),
                reference=_reference,
                doc="RMSNorm + RoPE (or M-RoPE) + bf16 rotation + per-token-head FP8 Q / K (or bf16 Q, INT8 K), V to "
                    "FP8, caches by slot (950).")


def qkv_rms_norm_rope_cache_with_k_scale(qkv, q_gamma, k_gamma, cos_sin, slot_mapping, k_cache, v_cache,
                                         k_scale_cache, query_start_loc, seq_lens, head_nums, *, rotation=None,
                                         v_scale=None, layout_qkv="TND", layout_q_out="NTD", epsilon=1e-6,
                                         mrope_position=None, mrope_section=None, q_quant_mode="PerTokenPerHead",
                                         q_out_dtype="float8_e4m3fn", k_quant_mode="PerTokenPerHead",
                                         zero_head="zero", mx_aiv_num=None, mx_ub_bytes=None, chip=None,
                                         backend="reference"):
    """``cann_ops_transformer.qkv_rms_norm_rope_cache_with_k_scale_`` (Ascend 950), the RoPE scenario
    (docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale), or the M-RoPE scenario when
    ``mrope_position`` is given (docs/numerics/cache-writers.md#m-rope-scenario). RoPE: writes ``k_cache`` / ``v_cache``
    (float8_e4m3fn ``[BlockNum, Nk, BlockSize, 128]``) and ``k_scale_cache`` (float32 ``[BlockNum, Nk,
    BlockSize, 1]``) in place and returns ``(q_out, q_scale, k_cache, v_cache, k_scale_cache)``.

    qkv bfloat16 ``[T, Nq+Nk+Nv, 128]`` (TND) or ``[Nq+Nk+Nv, T, 128]`` (NTD); head_nums ``[Nq, Nk, Nv]``
    (Nq = 8 Nk <= 64, Nk = Nv); q_gamma / k_gamma float32 [128]; cos_sin float32 ``[MaxSeqLen, 128]``;
    query_start_loc int32 ``[B+1]`` and seq_lens int32 ``[B]`` place each token; rotation bfloat16 [128, 128]
    and v_scale float32 ``[Nv]`` are required. q_out float8_e4m3fn ``[Nq, T, 128]`` (layout_q_out NTD) or
    ``[T, Nq, 128]``, q_scale float32 ``[Nq, T]`` / ``[T, Nq]``. zero_head: what an all-zero Q / K head's codes
    are (OPEN, docs/numerics/open-facts.md#qkv-zero-head).

    M-RoPE: query_start_loc = seq_lens = None, mrope_position int32 ``[T, 3]`` (T / H / W rows of cos_sin per
    token), mrope_section ``[t, h, w]``, q_quant_mode "NoQuant", q_out_dtype "bfloat16", k_cache int8, v_scale
    float32 ``[Nv, 128]``, TND -> TND only; returns q_out bfloat16 ``[T, Nq, 128]`` and q_scale None.

    M-RoPE MX (docs/numerics/cache-writers.md#m-rope-mx-scenario): as M-RoPE with q_quant_mode = k_quant_mode =
    "Mx", q_out_dtype "float8_e4m3fn", rotation None, k_cache float8_e4m3fn and k_scale_cache float8_e8m0fnu
    ``[BlockNum, Nk, BlockSize, 4]``; returns q_out float8_e4m3fn ``[T, Nq, 128]`` and q_scale float8_e8m0fnu
    ``[T, Nq, 4]``. Which rows are normalised first (row path) or late (16-row batch path) follows the host tiling,
    which reads ``mx_aiv_num`` (vector cores) and ``mx_ub_bytes`` (UB size) from the platform: None means 64 and
    262144 (OPEN, docs/numerics/open-facts.md#qkv-mx-platform). zero_head also names the code of a 0 x Inf product
    of the batch path.
    """
    args = dict(qkv=qkv, q_gamma=q_gamma, k_gamma=k_gamma, cos_sin=cos_sin, slot_mapping=slot_mapping,
                k_cache=k_cache, v_cache=v_cache, k_scale_cache=k_scale_cache, query_start_loc=query_start_loc,
                seq_lens=seq_lens, head_nums=head_nums, rotation=rotation, v_scale=v_scale, layout_qkv=layout_qkv,
                layout_q_out=layout_q_out, epsilon=epsilon, mrope_position=mrope_position, mrope_section=mrope_section,
                q_quant_mode=q_quant_mode, q_out_dtype=q_out_dtype, k_quant_mode=k_quant_mode, zero_head=zero_head,
                mx_aiv_num=mx_aiv_num, mx_ub_bytes=mx_ub_bytes)
    return run(QKV, args, backend, chip=chip)
