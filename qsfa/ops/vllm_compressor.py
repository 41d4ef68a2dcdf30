"""Front door of vLLM-Ascend's own compressor, ``torch.ops._C_ascend.compressor``: ``vllm_compressor``.

The DeepSeek-V4 compressor (:mod:`qsfa.ops.compressor`, one shared reference core) followed by RMSNorm of each
compressed row and RoPE of its last ``rope_head_dim`` lanes, as vLLM-Ascend builds it for Atlas A2, A3 and Ascend
950 (vllm-project/vllm-ascend@182b75e ``csrc/attention/compressor/``, ``csrc/torch_binding.cpp`` l.819-885 and
l.2225-2236, ``csrc/build_aclnn.sh`` l.92-212). Reference: :mod:`qsfa.reference.vllm_compressor`; numerics in
``docs/numerics/compressor.md#vllm_compressor``. ``state_cache`` is written in place; a rejected call writes nothing.
"""

from __future__ import annotations

import numpy as np

from .._arrays import dtype_name
from .._checks import all_finite, dtype_in, edit_params, rule, set_param
from .._contract import Contract, copy_args, params
from .._dispatch import define_operator, run
from .._errors import Raw
from ..reference import compressor as _cr
from ..reference import vllm_compressor as _vr
from .compressor import BF16, _example as _cmp_example, _nb, _numerics, _rules

__all__ = ["vllm_compressor", "VCMP", "VCMP_CONTRACT", "vllm_compressor_case"]

VCMP = "vllm_compressor"
SRC = ("vllm-project/vllm-ascend@182b75e csrc/attention/compressor/ (op_host/compressor_def.cpp, "
       "op_host/arch32/compressor_tiling.{h,cpp}, op_host/arch35/compressor_tiling.{h,cpp}) and csrc/torch_binding.cpp "
       "l.819-885; docs/numerics/compressor.md#vllm_compressor")
#: cmp_ratio values the host accepts (DAY0_SCOPE is not defined: arch32/compressor_tiling.h l.39, l.226-232)
CMP_RATIOS = (2, 4, 8, 16, 32, 64, 128)
HEAD_DIMS = (128, 512)
ROPE_HEAD_DIMS = (64,)
#: rules of the compressor that vLLM-Ascend's host code states differently (replaced below)
_REPLACED = ("scenario", "state_cache_shape", "a2_unsupported", "a3_cache_mode")


def _d(a):
    return a.wkv.shape[0] // a.coff if a.coff in (1, 2) and a.wkv.shape[0] % a.coff == 0 else None


def _rope_rows(a):
    """Leading shape of rope_sin / rope_cos (and of cmp_kv): [B, ceil(S / r)] BSH, [min(T, T // r + B)] TH."""
    return _cr.cmp_rows(a.x.shape, int(a.cmp_ratio), _nb(a)) if a.cmp_ratio > 0 else None


def _rope_shape(p):
    def check(a):
        v = a[p]
        want = _rope_rows(a)
        if want is None or v.shape == tuple(want) + (a.rope_head_dim,):
            return None
        return Raw(f"{tuple(v.shape)}, expected {tuple(want) + (a.rope_head_dim,)}")

    return check


def _to_f32(*names):
    def edit(o):
        for n in names:
            o[n] = np.asarray(o[n]).astype(np.float32)

    return edit


def _vllm_rules(op, src):
    early = [
        rule(op, "cmp_ratio_value", "cmp_ratio", "value", f"must be one of {CMP_RATIOS} (CMP_RATIO)",
             lambda a: None if a.cmp_ratio in CMP_RATIOS else a.cmp_ratio, set_param("cmp_ratio", 3), source=src),
        rule(op, "rope_head_dim_value", "rope_head_dim", "value", "must be 64 (ROPE_HEAD_DIM)",
             lambda a: None if a.rope_head_dim in ROPE_HEAD_DIMS else a.rope_head_dim,
             set_param("rope_head_dim", 32), source=src),
        rule(op, "norm_eps_value", "norm_eps", "value",
             "must be a finite float32 >= 0 (qsfa's rule: the host code checks nothing, and a NaN, an infinity or a "
             "negative epsilon makes every row's scale undefined)",
             lambda a: None if np.isfinite(a.norm_eps) and a.norm_eps >= 0 else a.norm_eps,
             set_param("norm_eps", -1.0), source=src),
        rule(op, "rotary_mode_value", "rotary_mode", "value", "must be 1 (half) or 2 (interleave) (ROTARY_MODE)",
             lambda a: None if a.rotary_mode in _vr.ROTARY_MODES else a.rotary_mode, set_param("rotary_mode", 0),
             source=src),
        rule(op, "norm_weight_dtype", "norm_weight", "dtype",
             "must have x's dtype (Atlas A2 / A3) or be float32 (Ascend 950)",
             lambda a: None if dtype_name(a.norm_weight) in (dtype_name(a.x), "float32") else
             Raw(f"{dtype_name(a.norm_weight)} with x {dtype_name(a.x)}"),
             edit_params(lambda o: o.update(norm_weight=np.asarray(o["norm_weight"]).astype(np.float16))), dtype=True,
             source=src),
        rule(op, "norm_weight_shape", "norm_weight", "shape",
             "must be 1-D [D] with D = wkv.shape[0] / coff, D in (128, 512) (binding dim 1; CheckFeature headDim)",
             lambda a: None if a.norm_weight.ndim == 1 and _d(a) in HEAD_DIMS and a.norm_weight.shape[0] == _d(a)
             else Raw(f"{tuple(a.norm_weight.shape)} with wkv {tuple(a.wkv.shape)}, coff {a.coff}"),
             edit_params(lambda o: o.update(norm_weight=o["norm_weight"][:-1])), source=src),
    ]
    cache_shape = [
        rule(op, "state_cache_shape", "state_cache", "shape",
             "must be [block_num > 0, block_size >= 1, 2 * coff * D] (binding: 3 dims; CheckFeature blockSize >= 1)",
             lambda a: None if a.state_cache.ndim == 3 and a.state_cache.shape[0] > 0 and a.state_cache.shape[1] >= 1
             and a.state_cache.shape[2] == 2 * a.wkv.shape[0] else tuple(a.state_cache.shape),
             edit_params(lambda o: o.update(state_cache=np.ascontiguousarray(o["state_cache"][..., :-1]))),
             source=src),
    ]
    late = [
        dtype_in(op, "rope_sin", ("float16", "bfloat16", "float32"), source=src),
        rule(op, "rope_dtype", "rope_cos", "dtype", "rope_sin and rope_cos must share one dtype: x's or float32 "
             "(CheckDtypeConsistencyRope)",
             lambda a: None if dtype_name(a.rope_cos) == dtype_name(a.rope_sin) and dtype_name(a.rope_sin) in
             (dtype_name(a.x), "float32") else Raw(f"{dtype_name(a.rope_sin)}, {dtype_name(a.rope_cos)} with x "
                                                   f"{dtype_name(a.x)}"),
             edit_params(lambda o: o.update(rope_cos=np.asarray(o["rope_cos"]).astype(np.float16))), dtype=True,
             source=src),
        rule(op, "norm_rope_one_chip", "rope_sin", "dtype",
             "a float32 norm_weight is the Ascend 950's form, whose sin / cos tables are float32 too (x-dtype tables "
             "come only with an x-dtype norm_weight, on Atlas A2 / A3)",
             lambda a: None if dtype_name(a.norm_weight) != "float32" or dtype_name(a.rope_sin) == "float32" else
             Raw(f"{dtype_name(a.rope_sin)} tables with a float32 norm_weight"),
             edit_params(lambda o: o.update(norm_weight=np.asarray(o["norm_weight"]).astype(np.float32),
                                            rope_sin=o["rope_sin"].astype(BF16), rope_cos=o["rope_cos"].astype(BF16))),
             dtype=True, source=src),
        rule(op, "rope_sin_shape", "rope_sin", "shape",
             "must be [min(T, T // cmp_ratio + B), rope_head_dim] (TH) or [B, ceil(S / cmp_ratio), rope_head_dim] "
             "(BSH): its rows size cmp_kv (binding construct_compressor_output_tensor; CheckShapeConsistencyRope)",
             _rope_shape("rope_sin"), edit_params(lambda o: o.update(rope_sin=o["rope_sin"][:-1])), source=src),
        rule(op, "rope_cos_shape", "rope_cos", "shape", "must have rope_sin's shape",
             lambda a: None if a.rope_cos.shape == a.rope_sin.shape else tuple(a.rope_cos.shape),
             edit_params(lambda o: o.update(rope_cos=o["rope_cos"][:, :-1])), source=src),
        all_finite(op, "norm_weight", source=src),
        all_finite(op, "rope_sin", source=src),
        all_finite(op, "rope_cos", source=src),
        # per chip: arch32 (A2 / A3) and arch35 (950) host code
        rule(op, "a2_a3_cache_mode", "cache_mode", "value",
             "Atlas A2 / A3 support cache_mode 1 only (arch32 CACHE_MODE)",
             lambda a: None if a.cache_mode == 1 else a.cache_mode,
             edit_params(lambda o: (o.update(cache_mode=2, state_block_table=np.array([0, 1], np.int32),
                                             state_cache=np.zeros((5, 12, o["state_cache"].shape[2]), np.float32)))),
             chips=("A2", "A3"), source=src),
        rule(op, "a2_a3_norm_weight_dtype", "norm_weight", "dtype",
             "must have x's dtype on Atlas A2 / A3 (arch32 CheckDtypeConsistencyX)",
             lambda a: None if dtype_name(a.norm_weight) == dtype_name(a.x) else dtype_name(a.norm_weight),
             edit_params(_to_f32("norm_weight")), dtype=True, chips=("A2", "A3"), source=src),
        rule(op, "950_rope_dtype", "rope_sin", "dtype",
             "rope_sin / rope_cos must be float32 on Ascend 950 (arch35 DTYPE_SUPPORT_MAP; arch32 allows float32 "
             "rope only on ascend910b / ascend910_93)",
             lambda a: None if dtype_name(a.rope_sin) == "float32" else dtype_name(a.rope_sin),
             edit_params(lambda o: o.update(rope_sin=o["rope_sin"].astype(BF16), rope_cos=o["rope_cos"].astype(BF16))),
             dtype=True, chips=("950",), source=src),
        rule(op, "950_norm_weight_dtype", "norm_weight", "dtype",
             "must be float32 on Ascend 950 (arch35 DTYPE_SUPPORT_MAP)",
             lambda a: None if dtype_name(a.norm_weight) == "float32" else dtype_name(a.norm_weight),
             lambda args: copy_args(args), dtype=True, chips=("950",), source=src),
    ]
    out = []
    for c in _rules(op, src, "vllm-ascend csrc/attention/compressor/README.md"):
        cid = c.id.split(".", 1)[1]
        if cid == "scenario":
            out += early
        elif cid == "state_cache_shape":
            out += cache_shape
        if cid not in _REPLACED:
            out.append(c)
    return out + late


def _example(rng):
    a = _cmp_example(rng)
    rows = _cr.cmp_rows(a["x"].shape, a["cmp_ratio"], a["cu_seqlens"].size - 1)
    ang = rng.uniform(-3.0, 3.0, rows + (64,))
    a.update(norm_weight=(1.0 + 0.1 * rng.standard_normal(a["wkv"].shape[0] // a["coff"])).astype(BF16),
             rope_sin=np.sin(ang).astype(np.float32), rope_cos=np.cos(ang).astype(np.float32), rope_head_dim=64,
             norm_eps=1e-6, rotary_mode=2)
    return a


VCMP_CONTRACT = Contract(
    op=VCMP,
    constraints=_vllm_rules(VCMP, SRC),
    example=_example,
    inplace=("state_cache",),
    params=params("x:array wkv:array wgate:array state_cache:array ape:array norm_weight:array rope_sin:array"
                  " rope_cos:array state_block_table:array? cu_seqlens:array? seqused:array? start_pos:array?"
                  " rope_head_dim:int cmp_ratio:int coff:int norm_eps:float32 rotary_mode:int cache_mode:int"
                  " precision:str"),
)


def _reference(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens,
               seqused, start_pos, rope_head_dim, cmp_ratio, coff, norm_eps, rotary_mode, cache_mode,
               precision="faithful", reduce_order="tree"):
    return _vr.vllm_compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table,
                               cu_seqlens, seqused, start_pos, rope_head_dim=int(rope_head_dim),
                               cmp_ratio=int(cmp_ratio), coff=int(coff), norm_eps=float(norm_eps),
                               rotary_mode=int(rotary_mode), cache_mode=int(cache_mode), precision=precision,
                               reduce_order=reduce_order)


define_operator(VCMP, VCMP_CONTRACT, outputs=("cmp_kv", "state_cache"), reference=_reference, numerics=_numerics,
                doc="vLLM-Ascend's DeepSeek-V4 compressor: the compressor, then RMSNorm and RoPE of each compressed "
                    "row, one rounding to x's dtype.")


def vllm_compressor_case(seed=0, *, scenario=(4, 2, 128), lens=(5, 2), starts=(3, 0), layout="TH", rotary_mode=2,
                         chip="A3", norm_eps=1e-6, rope_dtype="float32", **kw):
    """The arguments of a ``vllm_compressor`` call (golden cases, tests): :func:`qsfa.ops.compressor.compressor_case`
    plus norm_weight ``1 + 0.1 randn`` (x's dtype on A2 / A3, fp32 on the 950) and sin / cos tables of random angles
    (``rope_dtype``: "float32" or "x", x's dtype), one row per cmp_kv row."""
    from .compressor import compressor_case

    a = compressor_case(seed, scenario=scenario, lens=lens, starts=starts, layout=layout, **kw)
    rng = np.random.default_rng(seed + 7919)
    r, cf, d = scenario
    nb = len(lens)
    rows = _cr.cmp_rows(a["x"].shape, r, nb)
    ang = rng.uniform(-3.0, 3.0, rows + (64,))
    nw = 1.0 + 0.1 * rng.standard_normal(d)
    tdt = a["x"].dtype if rope_dtype == "x" else np.float32
    a.update(norm_weight=nw.astype(np.float32 if chip == "950" else a["x"].dtype),
             rope_sin=np.sin(ang).astype(tdt), rope_cos=np.cos(ang).astype(tdt),
             state_block_table=a.get("state_block_table"), cu_seqlens=a.get("cu_seqlens"), seqused=a.get("seqused"),
             rope_head_dim=64, cmp_ratio=r, coff=cf, norm_eps=norm_eps, rotary_mode=rotary_mode,
             cache_mode=kw.get("cache_mode", 1))
    return a


def vllm_compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens,
                    seqused, start_pos, rope_head_dim, cmp_ratio, coff, norm_eps, rotary_mode, cache_mode, *,
                    precision="faithful", chip=None, backend="reference"):
    """``torch.ops._C_ascend.compressor`` (vLLM-Ascend; Atlas A2, A3, Ascend 950): :func:`qsfa.compressor`, then
    RMSNorm of every compressed row and RoPE of its last ``rope_head_dim`` lanes. Parameters in the schema's order,
    none with a default (vllm-ascend@182b75e ``csrc/torch_binding.cpp`` l.2226-2234).

    x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos, cmp_ratio, coff,
    cache_mode: as :func:`qsfa.compressor` (cmp_ratio in 2..128, a power of two; D = wkv.shape[0] / coff in
    {128, 512}; cache_mode 2 on the 950 only).
    norm_weight: ``[D]``, x's dtype on A2 / A3, float32 on the 950. norm_eps: the RMSNorm epsilon (fp32).
    rope_sin, rope_cos: ``[min(T, T // cmp_ratio + B), rope_head_dim]`` (TH) or ``[B, ceil(S / cmp_ratio),
    rope_head_dim]`` (BSH), x's dtype or float32 (float32 only on the 950); row i rotates cmp_kv row i.
    rope_head_dim: 64. rotary_mode: 1 half (rotate_half), 2 interleave (vLLM-Ascend passes 2).
    precision: "faithful" (the kernel's rounding points; ``chip`` picks the sum orders) or "exact" (float64).
    Returns ``(cmp_kv, state_cache)``: cmp_kv in x's dtype, shaped like rope_sin with D lanes, padding rows zero.
    Numerics: docs/numerics/compressor.md#vllm_compressor.
    """
    args = dict(x=x, wkv=wkv, wgate=wgate, state_cache=state_cache, ape=ape, norm_weight=norm_weight,
                rope_sin=rope_sin, rope_cos=rope_cos, state_block_table=state_block_table, cu_seqlens=cu_seqlens,
                seqused=seqused, start_pos=start_pos, rope_head_dim=rope_head_dim, cmp_ratio=cmp_ratio, coff=coff,
                norm_eps=norm_eps, rotary_mode=rotary_mode, cache_mode=cache_mode, precision=precision)
    return run(VCMP, args, backend, chip=chip)
