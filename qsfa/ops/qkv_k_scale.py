"""Front door of ``qkv_rms_norm_rope_cache_with_k_scale`` (Ascend 950; docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale).

``cann_ops_transformer.qkv_rms_norm_rope_cache_with_k_scale_`` (aclnnQkvRmsNormRopeCacheWithKScale), its RoPE
scenario: RMSNorm + RoPE + a bf16 rotation GEMM + per-token-head FP8 quantisation of Q and K, V scaled per head to
FP8, K / V / K-scale caches written by slot. Reference :mod:`qsfa.reference.qkv_k_scale` (which writes the caches
through :mod:`qsfa.reference.k_scale_cache`); tests tests/test_qkv_k_scale.py. Sources: cannmirror/ops-transformer@c4f5cf7
``posembedding/qkv_rms_norm_rope_cache_with_k_scale/`` (README.md, op_kernel/arch35/). The M-RoPE and M-RoPE MX
scenarios of the newer README are not modelled.
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

__all__ = ["qkv_rms_norm_rope_cache_with_k_scale", "qkv_case", "QKV_CONTRACT"]

QKV = "qkv_rms_norm_rope_cache_with_k_scale"
QKV_SOURCE = ("docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale; cannmirror/ops-transformer@c4f5cf7 "
              "posembedding/qkv_rms_norm_rope_cache_with_k_scale/README.md")
D = 128
_BF16 = ml_dtypes.bfloat16
_E4M3 = ml_dtypes.float8_e4m3fn


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
                layout_q_out=layout_q_out, epsilon=1e-6, q_quant_mode="PerTokenPerHead",
                k_quant_mode="PerTokenPerHead", zero_head="zero")


_N = Names(QKV, qkv_case, source=QKV_SOURCE)


def _heads(a):
    return tuple(int(h) for h in a.head_nums)


def _t(a) -> int:
    return int(a.qkv.shape[0] if a.layout_qkv == "TND" else a.qkv.shape[1])


def _shape_rule(cid, p, reason, want, change, **variant):
    return rule(_N, cid, p, "shape", reason,
                lambda a: None if tuple(a[p].shape) == tuple(want(a)) else tuple(a[p].shape), edit(_N, change, **variant))


def _rules():
    n = _N
    arrays = ("qkv", "q_gamma", "k_gamma", "cos_sin", "slot_mapping", "k_cache", "v_cache", "k_scale_cache",
              "query_start_loc", "seq_lens", "rotation", "v_scale")
    r = [is_array(QKV, p, source=QKV_SOURCE) for p in arrays]
    for p, dts in (("qkv", ("bfloat16",)), ("q_gamma", ("float32",)), ("k_gamma", ("float32",)),
                   ("cos_sin", ("float32",)), ("slot_mapping", ("int32",)), ("k_cache", ("float8_e4m3fn",)),
                   ("v_cache", ("float8_e4m3fn",)), ("k_scale_cache", ("float32",)), ("query_start_loc", ("int32",)),
                   ("seq_lens", ("int32",)), ("rotation", ("bfloat16",)), ("v_scale", ("float32",))):
        r.append(dtype_in(QKV, p, dts, source=QKV_SOURCE))
    for p in ("rotation", "v_scale"):  # keyword arguments defaulting to None, read by the RoPE scenario
        r.append(rule(n, f"{p}_required", p, "value", "must be given (the RoPE scenario reads it; README)",
                      (lambda p_: lambda a: None if a.get(p_) is not None else "None")(p), edit(n, setting(**{p: None}))))
    r.append(choice_rule(n, "q_quant_mode", ("PerTokenPerHead",), bad="NoQuant",
                         source=QKV_SOURCE + " (the RoPE scenario; M-RoPE / MX not modelled)"))
    r.append(choice_rule(n, "k_quant_mode", ("PerTokenPerHead",), bad="Mx",
                         source=QKV_SOURCE + " (the RoPE scenario; M-RoPE / MX not modelled)"))
    r.append(choice_rule(n, "layout_qkv", ("TND", "NTD")))
    r.append(choice_rule(n, "layout_q_out", ("TND", "NTD")))
    r.append(rule(n, "layout_pair", "layout_q_out", "value",
                  "layout_qkv -> layout_q_out must be NTD -> NTD, TND -> TND or TND -> NTD (README)",
                  lambda a: None if not (a.layout_qkv == "NTD" and a.layout_q_out == "TND") else a.layout_q_out,
                  edit(n, setting(layout_q_out="TND"), layout_qkv="NTD")))
    r.append(choice_rule(n, "zero_head", _ref.ZERO_HEAD, source="docs/numerics/open-facts.md#qkv-zero-head"))

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
    r.append(_shape_rule("v_scale_shape", "v_scale", "must be [Nv] (README, the RoPE scenario)",
                         lambda a: (_heads(a)[2],), lambda a: a.update(v_scale=np.ones(3, np.float32))))
    r.append(rule(n, "k_cache_shape", "k_cache", "shape", "must be [BlockNum, Nk, BlockSize, 128] (README)",
                  lambda a: None if a.k_cache.ndim == 4 and a.k_cache.shape[1] == _heads(a)[1]
                  and a.k_cache.shape[3] == D and a.k_cache.shape[2] > 0 else tuple(a.k_cache.shape),
                  edit(n, lambda a: a.update(k_cache=np.ascontiguousarray(a["k_cache"][:, :1])))))
    r.append(_shape_rule("v_cache_shape", "v_cache", "must have k_cache's shape [BlockNum, Nv, BlockSize, 128]",
                         lambda a: a.k_cache.shape, lambda a: a.update(v_cache=np.ascontiguousarray(a["v_cache"][:1]))))
    r.append(_shape_rule("k_scale_cache_shape", "k_scale_cache", "must be [BlockNum, Nk, BlockSize, 1] (README)",
                         lambda a: a.k_cache.shape[:3] + (1,),
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
    for p in ("qkv", "q_gamma", "k_gamma", "cos_sin", "rotation", "v_scale"):
        r.append(finite_rule(n, p))
    r.append(rule(n, "epsilon_value", "epsilon", "value", "must be a finite float32 > 0",
                  lambda a: None if np.isfinite(a.epsilon) and a.epsilon > 0 else a.epsilon,
                  edit(n, setting(epsilon=-1.0))))
    r.append(rule(n, "a2a3_unsupported", "qkv", "value", f"{QKV} runs on Ascend 950 only (README)",
                  lambda a: "Atlas A2/A3", edit(n), chips=("A2", "A3")))
    return r


QKV_CONTRACT = Contract(
    op=QKV, constraints=_rules(), example=lambda rng: qkv_case(), inplace=("k_cache", "v_cache", "k_scale_cache"),
    params=params("qkv:array q_gamma:array k_gamma:array cos_sin:array slot_mapping:array k_cache:array v_cache:array"
                  " k_scale_cache:array query_start_loc:array seq_lens:array head_nums:any rotation:array?"
                  " v_scale:array? layout_qkv:str layout_q_out:str epsilon:float32 q_quant_mode:str k_quant_mode:str"
                  " zero_head:str"))


def _reference(**args):
    return _ref.qkv_rms_norm_rope_cache_with_k_scale(**args)


define_operator(QKV, QKV_CONTRACT, outputs=("q_out", "q_scale", "k_cache", "v_cache", "k_scale_cache"),
                reference=_reference,
                doc="RMSNorm + RoPE + bf16 rotation + per-token-head FP8 of Q / K, V to FP8, caches by slot (950).")


def qkv_rms_norm_rope_cache_with_k_scale(qkv, q_gamma, k_gamma, cos_sin, slot_mapping, k_cache, v_cache,
                                         k_scale_cache, query_start_loc, seq_lens, head_nums, *, rotation=None,
                                         v_scale=None, layout_qkv="TND", layout_q_out="NTD", epsilon=1e-6,
                                         q_quant_mode="PerTokenPerHead", k_quant_mode="PerTokenPerHead",
                                         zero_head="zero", chip=None, backend="reference"):
    """``cann_ops_transformer.qkv_rms_norm_rope_cache_with_k_scale_`` (Ascend 950), the RoPE scenario
    (docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale): writes ``k_cache`` / ``v_cache``
    (float8_e4m3fn ``[BlockNum, Nk, BlockSize, 128]``) and ``k_scale_cache`` (float32 ``[BlockNum, Nk,
    BlockSize, 1]``) in place and returns ``(q_out, q_scale, k_cache, v_cache, k_scale_cache)``.

    qkv bfloat16 ``[T, Nq+Nk+Nv, 128]`` (TND) or ``[Nq+Nk+Nv, T, 128]`` (NTD); head_nums ``[Nq, Nk, Nv]``
    (Nq = 8 Nk <= 64, Nk = Nv); q_gamma / k_gamma float32 [128]; cos_sin float32 ``[MaxSeqLen, 128]``;
    query_start_loc int32 ``[B+1]`` and seq_lens int32 ``[B]`` place each token; rotation bfloat16 [128, 128]
    and v_scale float32 ``[Nv]`` are required. q_out float8_e4m3fn ``[Nq, T, 128]`` (layout_q_out NTD) or
    ``[T, Nq, 128]``, q_scale float32 ``[Nq, T]`` / ``[T, Nq]``. zero_head: what an all-zero Q / K head's codes
    are (OPEN, docs/numerics/open-facts.md#qkv-zero-head).
    """
    args = dict(qkv=qkv, q_gamma=q_gamma, k_gamma=k_gamma, cos_sin=cos_sin, slot_mapping=slot_mapping,
                k_cache=k_cache, v_cache=v_cache, k_scale_cache=k_scale_cache, query_start_loc=query_start_loc,
                seq_lens=seq_lens, head_nums=head_nums, rotation=rotation, v_scale=v_scale, layout_qkv=layout_qkv,
                layout_q_out=layout_q_out, epsilon=epsilon, q_quant_mode=q_quant_mode, k_quant_mode=k_quant_mode,
                zero_head=zero_head)
    return run(QKV, args, backend, chip=chip)
