"""Front doors of the C8 cache writers: ``c8_cache_write`` and ``c8_rmsnorm_rope_cache``
(docs/numerics/cache-writers.md#c8_cache_write, docs/numerics/cache-writers.md#c8_rmsnorm_rope_cache).

Contracts, examples and front doors; the computation is :mod:`qsfa.reference.c8_cache`, the tests
tests/test_c8_cache.py and tests/test_c8_hif8.py.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .. import chips as _chips
from .._arrays import dtype_name
from .._checks import all_finite, dtype_in, is_array, ndim_in, set_param
from .._contract import Contract, one_of, params
from .._dispatch import define_operator, run
from .._errors import Raw
from ..reference import c8_cache as _c8
from ..reference.quant import SCALE_ORDERS
from ._cache_rules import _edit, _is_int, _is_num, _rule, _same_dtype, _slot_rules, BF16, FLOAT16_NAMES, SLOT_DTYPES

__all__ = [
    "c8_cache_write",
    "c8_rmsnorm_rope_cache",
]


# ------------------------------------------------------------------------------------------ C8 writers

C8 = "c8_cache_write"
C8R = "c8_rmsnorm_rope_cache"
C8_SRC = "docs/numerics/cache-writers.md#c8_cache_write; vllm-ascend vllm_ascend/attention/sfa_v1.py (custom_kv_rmsnorm_rope, _store_parallel_kv)"


def _c8_width(rope_present: bool) -> int:
    return 656 if rope_present else 528


def _c8_cache_rules(op, *, rope_present, cache="kv_cache"):
    def check_itemsize(a):
        c = a[cache]
        return None if c.dtype.itemsize == 1 else dtype_name(c)

    def check_shape(a):
        c = a[cache]
        want_w = _c8_width(rope_present(a))
        return None if c.shape[2] == 1 and c.shape[3] == want_w else tuple(c.shape)

    def break_shape(out):
        c = out[cache]
        out[cache] = np.zeros(c.shape[:3] + (c.shape[3] + 16,), c.dtype)

    return [
        ndim_in(op, cache, (4,), source=C8_SRC),
        _rule(op, f"{cache}_dtype", cache, "dtype", "a packed cache holds bytes: uint8, int8 or float8_e4m3fn",
              check_itemsize, _edit(lambda o: o.update({cache: o[cache].astype(np.float16)})), dtype=True,
              source=C8_SRC),
        _rule(op, f"{cache}_shape", cache, "shape",
              "must be [block_num, block_size, 1, 656] with RoPE (rope 64) or [..., 528] without (rope 0)",
              check_shape, _edit(break_shape), source=C8_SRC),
    ]


def _c8_dst_type_max(a):
    v = a.get("dst_type_max")
    v = 0.0 if v is None else v  # None (or absent) = 0 = HiFloat8's 32768
    ok = _is_num(v) and math.isfinite(v) and (v == 0 or 1 <= v <= 32768) and (v == 0 or a.key_dtype == "hifloat8")
    return None if ok else v


def _c8_key_rules(op):
    return [
        _rule(op, "key_dtype_value", "key_dtype", "value", f"must be {one_of(_c8.KEY_DTYPES)}",
              lambda a: None if a.key_dtype in _c8.KEY_DTYPES else a.key_dtype, set_param("key_dtype", "int4"),
              source=C8_SRC),
        _rule(op, "dst_type_max_value", "dst_type_max", "value",
              "must be 0 (HiFloat8's 32768) or a number in [1, 32768] (below 1 the scale amax / dst_type_max "
              "leaves the data's range: 5e-324 is 0 in float32 and gave +Inf scales), and 0 unless key_dtype is "
              "'hifloat8'",
              _c8_dst_type_max, set_param("dst_type_max", 15.0),
              source="docs/numerics/open-facts.md#hifloat8-c8-nope"),
        _rule(op, "scale_order_value", "scale_order", "value",
              f"must be None (the chip's order) or {one_of(SCALE_ORDERS)}",
              lambda a: None if a.scale_order is None or a.scale_order in SCALE_ORDERS else a.scale_order,
              set_param("scale_order", "bogus"), source="docs/numerics/chips.md#c8-cache-writers"),
        _rule(op, "key_dtype_matches_kv_cache", "key_dtype", "value",
              "a float8_e4m3fn kv_cache holds FP8 codes: key_dtype must be 'float8_e4m3fn' (attention reads such an "
              "array as FP8 whatever was written into it)",
              lambda a: None if dtype_name(a.kv_cache) != "float8_e4m3fn" or a.key_dtype == "float8_e4m3fn"
              else a.key_dtype,
              _edit(lambda o: o.update(kv_cache=o["kv_cache"].view(ml_dtypes.float8_e4m3fn), key_dtype="int8")),
              source="docs/numerics/attention.md#kv_quant_sparse_flash_attention"),
        _rule(op, "a2a3_key_dtype", "key_dtype", "value", "Atlas A2/A3 packed caches are int8 only",
              lambda a: None if a.key_dtype == "int8" else a.key_dtype, set_param("key_dtype", "float8_e4m3fn"),
              chips=("A2", "A3"), source=C8_SRC),
    ]


def _c8_example(rng):
    t = 5
    k_nope = (rng.standard_normal((t, 512)) * 3).astype(BF16)
    k_rope = rng.standard_normal((t, 64)).astype(BF16)
    cache = np.full((3, 4, 1, 656), 17, np.uint8)
    return dict(k_nope=k_nope, k_rope=k_rope, slot_mapping=np.array([0, 5, -1, 11, 3], np.int64),
                kv_cache=cache, key_dtype="int8", scale_order=None, dst_type_max=0.0)


def _t(a, name="k_nope"):
    return a[name].shape[0]


C8_CONTRACT = Contract(
    op=C8,
    constraints=[
        is_array(C8, "k_nope", source=C8_SRC),
        is_array(C8, "k_rope", optional=True, source=C8_SRC),
        is_array(C8, "slot_mapping", source=C8_SRC),
        is_array(C8, "kv_cache", source=C8_SRC),
        dtype_in(C8, "k_nope", FLOAT16_NAMES, source=C8_SRC),
        ndim_in(C8, "k_nope", (2,), source=C8_SRC),
        _rule(C8, "k_nope_width", "k_nope", "shape", "must be [T, 512] (kv_lora_rank 512)",
              lambda a: None if a.k_nope.shape[1] == 512 else tuple(a.k_nope.shape),
              _edit(lambda o: o.update(k_nope=o["k_nope"][:, :384])), source=C8_SRC),
        _same_dtype(C8, "k_rope", "k_nope", optional=True, source=C8_SRC),
        _rule(C8, "k_rope_shape", "k_rope", "shape", "must be [T, 64] (rope_head_dim 64; None for rope 0)",
              lambda a: None if a.k_rope is None or tuple(a.k_rope.shape) == (_t(a), 64) else
              Raw(f"{tuple(a.k_rope.shape)} (k_nope has T = {_t(a)} rows)"),
              _edit(lambda o: o.update(k_rope=o["k_rope"][:, :32])), source=C8_SRC),
        dtype_in(C8, "slot_mapping", SLOT_DTYPES, source=C8_SRC),
        _rule(C8, "slot_mapping_shape", "slot_mapping", "shape", "must be [T], one slot per token",
              lambda a: None if tuple(a.slot_mapping.shape) == (_t(a),) else tuple(a.slot_mapping.shape),
              _edit(lambda o: o.update(slot_mapping=o["slot_mapping"][:-1])), source=C8_SRC),
        *_c8_cache_rules(C8, rope_present=lambda a: a.get("k_rope") is not None),
        *_c8_key_rules(C8),
        all_finite(C8, "k_nope", source=C8_SRC),
        all_finite(C8, "k_rope", source=C8_SRC),
        *_slot_rules(C8, "slot_mapping", lambda a: a["kv_cache"].shape[0] * a["kv_cache"].shape[1], source=C8_SRC),
    ],
    example=_c8_example,
    inplace=("kv_cache",),
    params=params("k_nope:array k_rope:array? slot_mapping:array kv_cache:array key_dtype:str scale_order:str?"
                  " dst_type_max:float32?"),
)


def _c8_reference(k_nope, k_rope, slot_mapping, kv_cache, key_dtype, scale_order, dst_type_max=None):
    return _c8.c8_cache_write(k_nope, k_rope, slot_mapping, kv_cache, key_dtype=key_dtype,
                              scale_order=scale_order or "divide", dst_type_max=dst_type_max or 0.0)


define_operator(C8, C8_CONTRACT, outputs=("kv_cache",), reference=_c8_reference, numerics=_chips.c8_numerics,
                doc="QSFA C8 writer stage 2: per-tile dynamic quant of the NoPE, pack 656/528-byte rows, scatter.")


def c8_cache_write(k_nope, k_rope, slot_mapping, kv_cache, *, key_dtype="int8", scale_order=None,
                   dst_type_max=0.0, chip=None, backend="reference"):
    """Quantise, pack and scatter one packed QSFA row per token (the kernel-checkable C8 writer stage).

    For token t with slot s = slot_mapping[t] (-1: nothing written), row ``kv_cache[s // bs, s % bs, 0]``
    receives: bytes [0, 512) the NoPE quantised per 1x128 tile, then the 64 RoPE values' raw 16-bit bytes
    (rope 64 only), then the 4 tile scales as little-endian fp32 (docs/numerics/layouts.md#packed-qsfa-row). Bytes of other rows are
    untouched.

    key_dtype "int8" (A2/A3): ``s = amax / 127`` (fp32), ``q = clamp(RINT(x / s), -127, 127)`` (in the chip's
    order of that arithmetic, ``scale_order`` below); an all-zero
    tile gives ``s = 0, q = 0`` (docs/numerics/open-facts.md#zero-tile, OPEN on hardware). "float8_e4m3fn" (950, vllm-ascend's A5 branch
    calls ``npu_dynamic_block_quant(dst_type=float8_e4m3fn)``): ``s = amax / 448``, ``q = E4M3FN(x / s)``
    RINT + saturation. "hifloat8" (950; **OPEN**, docs/numerics/open-facts.md#hifloat8-c8-nope - no public
    writer fixes it): the same call with ``dst_type=hifloat8``, ``s = amax / TYPE_MAX``, ``q = HiF8(ROUND, SAT)``
    with TYPE_MAX = ``dst_type_max`` (0 = 32768).

    Parameters:
      k_nope:       ``[T, 512]`` float16 / bfloat16 (already normalised).
      k_rope:       ``[T, 64]`` of k_nope's dtype (already rotated), or None for rope 0 (528-byte rows).
      slot_mapping: ``[T]`` int32 / int64; -1 skips; otherwise unique and < block_num * block_size.
      kv_cache:     ``[block_num, block_size, 1, 656 | 528]`` uint8 / int8 / float8_e4m3fn, updated in place.
      key_dtype:    "int8" (default), "float8_e4m3fn" or "hifloat8".
      dst_type_max: HiFloat8 only (**OPEN**): the TYPE_MAX of its scale, 0 (default: 32768) or any value up to 32768
                    (torch_npu documents 15, 56, 224, 32768).
      scale_order:  None (default): the chip's ``npu_dynamic_block_quant`` order (docs/numerics/chips.md#c8-cache-writers),
                    A2/A3 "reciprocal" (``q = x * fp32(fp32(1 / amax) * TYPE_MAX)``, ``s = amax * fp32(1 / TYPE_MAX)``),
                    950 "divide" (``q = x / s``, ``s = amax / TYPE_MAX``); or an explicit "divide", "reciprocal",
                    "reciprocal_multiply", "multiply" (qsfa.reference.quant).
      chip:         None (A2 for an int8 cache, 950 for FP8 / HiFloat8: qsfa.resolve_chip), "A2", "A3" or "950".
    Returns ``kv_cache``.
    """
    args = dict(k_nope=k_nope, k_rope=k_rope, slot_mapping=slot_mapping, kv_cache=kv_cache, key_dtype=key_dtype,
                scale_order=scale_order, dst_type_max=dst_type_max)
    return run(C8, args, backend, chip=chip)


def _c8r_example(rng):
    t = 5
    kv = (rng.standard_normal((t, 576)) * 2).astype(BF16)
    gamma = (1 + 0.1 * rng.standard_normal(512)).astype(BF16)
    ang = rng.random((t, 32)) * 6.28
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1).astype(BF16)
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1).astype(BF16)
    cache = np.full((3, 4, 1, 656), 17, np.uint8)
    return dict(kv=kv, gamma=gamma, cos=cos, sin=sin, slot_mapping=np.array([0, 5, -1, 11, 3], np.int64),
                kv_cache=cache, epsilon=1e-6, rope_head_dim=64, key_dtype="int8", scale_order=None,
                dst_type_max=0.0)


def _c8r_rope(a):
    return a.rope_head_dim if a.rope_head_dim in (0, 64) else 0


def _c8r_cos_check(name):
    def check(a):
        v = a.get(name)
        r = _c8r_rope(a)
        if r == 0:
            return None if v is None else tuple(v.shape)
        if v is None:
            return "None"
        if dtype_name(v) != dtype_name(a.kv):
            return dtype_name(v)
        return None if tuple(v.shape) == (a.kv.shape[0], r) else tuple(v.shape)

    return _rule(C8R, f"{name}_shape", name, "shape",
                 "must be [T, rope_head_dim] with kv's dtype when rope_head_dim is 64, and None at rope 0",
                 check, _edit(lambda o: o.update({name: o[name][:, :32]})), source=C8_SRC)


C8R_CONTRACT = Contract(
    op=C8R,
    constraints=[
        is_array(C8R, "kv", source=C8_SRC),
        is_array(C8R, "gamma", source=C8_SRC),
        is_array(C8R, "cos", optional=True, source=C8_SRC),
        is_array(C8R, "sin", optional=True, source=C8_SRC),
        is_array(C8R, "slot_mapping", source=C8_SRC),
        is_array(C8R, "kv_cache", source=C8_SRC),
        dtype_in(C8R, "kv", FLOAT16_NAMES, source=C8_SRC),
        ndim_in(C8R, "kv", (2,), source=C8_SRC),
        _rule(C8R, "rope_head_dim_value", "rope_head_dim", "value", "must be one of {0, 64}",
              lambda a: None if _is_int(a.rope_head_dim) and a.rope_head_dim in (0, 64) else a.rope_head_dim,
              set_param("rope_head_dim", 32), source=C8_SRC),
        _rule(C8R, "kv_width", "kv", "shape", "must be [T, 512 + rope_head_dim]",
              lambda a: None if a.kv.shape[1] == 512 + a.rope_head_dim else tuple(a.kv.shape),
              _edit(lambda o: o.update(kv=o["kv"][:, :520])), source=C8_SRC),
        _same_dtype(C8R, "gamma", "kv", source=C8_SRC),
        _rule(C8R, "gamma_shape", "gamma", "shape", "must be [512] (the NoPE RMSNorm weight)",
              lambda a: None if tuple(a.gamma.shape) == (512,) else tuple(a.gamma.shape),
              _edit(lambda o: o.update(gamma=o["gamma"][:256])), source=C8_SRC),
        _c8r_cos_check("cos"),
        _c8r_cos_check("sin"),
        _rule(C8R, "epsilon_value", "epsilon", "value", "must be a finite number > 0",
              lambda a: None if _is_num(a.epsilon) and math.isfinite(a.epsilon) and a.epsilon > 0 else a.epsilon,
              set_param("epsilon", 0.0), source=C8_SRC),
        dtype_in(C8R, "slot_mapping", SLOT_DTYPES, source=C8_SRC),
        _rule(C8R, "slot_mapping_shape", "slot_mapping", "shape", "must be [T], one slot per token",
              lambda a: None if tuple(a.slot_mapping.shape) == (a.kv.shape[0],) else tuple(a.slot_mapping.shape),
              _edit(lambda o: o.update(slot_mapping=o["slot_mapping"][:-1])), source=C8_SRC),
        *_c8_cache_rules(C8R, rope_present=lambda a: a.rope_head_dim == 64),
        *_c8_key_rules(C8R),
        all_finite(C8R, "kv", source=C8_SRC),
        all_finite(C8R, "gamma", source=C8_SRC),
        all_finite(C8R, "cos", source=C8_SRC),
        all_finite(C8R, "sin", source=C8_SRC),
        *_slot_rules(C8R, "slot_mapping", lambda a: a["kv_cache"].shape[0] * a["kv_cache"].shape[1],
                     source=C8_SRC),
    ],
    example=_c8r_example,
    inplace=("kv_cache",),
    params=params("kv:array gamma:array cos:array? sin:array? slot_mapping:array kv_cache:array epsilon:float32"
                  " rope_head_dim:int key_dtype:str scale_order:str? dst_type_max:float32?"),
)


def _c8r_reference(kv, gamma, cos, sin, slot_mapping, kv_cache, epsilon, rope_head_dim, key_dtype, scale_order,
                   dst_type_max=None):
    return _c8.c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slot_mapping, kv_cache, epsilon=epsilon,
                                     rope_head_dim=rope_head_dim, key_dtype=key_dtype,
                                     scale_order=scale_order or "divide", dst_type_max=dst_type_max or 0.0)


define_operator(C8R, C8R_CONTRACT, outputs=("kv_cache",), reference=_c8r_reference, numerics=_chips.c8_numerics,
                doc="QSFA C8 writer: RMSNorm + interleave RoPE + c8_cache_write (vllm-ascend custom_kv_rmsnorm_rope).")


def c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slot_mapping, kv_cache, *, epsilon=1e-6, rope_head_dim=64,
                          key_dtype="int8", scale_order=None, dst_type_max=0.0, chip=None,
                          backend="reference"):
    """The QSFA C8 cache writer from a latent KV: RMSNorm + interleave RoPE + :func:`c8_cache_write`.

    Mirrors vllm-ascend (vllm_ascend/attention/sfa_v1.py ``custom_kv_rmsnorm_rope`` then
    ``_store_parallel_kv``): ``k_nope = npu_rms_norm(kv[:, :512], gamma, eps)`` and
    ``k_rope = npu_interleave_rope(kv[:, 512:], cos, sin)``, both returned in kv's dtype, then
    ``npu_dynamic_block_quant`` of k_nope (1x128 tiles), concatenation and ``npu_scatter_nd_update_``.

    Rounding points: (1) RMSNorm in fp32 (``gamma * (x / sqrt(sum(x^2) * fp32(1/512) + eps))``) rounded RINT
    to kv's dtype; (2) interleave RoPE in fp32 (two products, one add) rounded RINT to kv's dtype - these
    16-bit values are the stored RoPE bytes; (3) the quantiser reads the rounded NoPE (exact fp32 upcast).
    Stage (1) is not bit-reproducible across implementations (sum order); stages (2)-(3) and the packing are.

    Parameters:
      kv:            ``[T, 512 + rope_head_dim]`` float16 / bfloat16 (the kv_a projection output).
      gamma:         ``[512]`` kv's dtype (kv_a_layernorm.weight).
      cos, sin:      ``[T, 64]`` kv's dtype (half-split tables as npu_interleave_rope takes them); None at rope 0.
      slot_mapping:  ``[T]`` int32 / int64, -1 = skip.
      kv_cache:      ``[block_num, block_size, 1, 656 | 528]`` one-byte dtype, updated in place.
      epsilon:       RMSNorm eps; default 1e-6 = DeepSeek-V3.2's rms_norm_eps, which vllm-ascend passes
                     (kv_a_layernorm.variance_epsilon; custom_kv_rmsnorm_rope's own default is 1e-5).
      rope_head_dim: 64 (656-byte rows) or 0 (528-byte rows, RoPE skipped).
      key_dtype, scale_order, dst_type_max, chip: as :func:`c8_cache_write` (scale_order None: the chip's order).
    Returns ``kv_cache``.
    """
    args = dict(kv=kv, gamma=gamma, cos=cos, sin=sin, slot_mapping=slot_mapping, kv_cache=kv_cache,
                epsilon=epsilon, rope_head_dim=rope_head_dim, key_dtype=key_dtype, scale_order=scale_order,
                dst_type_max=dst_type_max)
    return run(C8R, args, backend, chip=chip)
