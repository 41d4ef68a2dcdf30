"""Public front doors of the cache writers (docs/numerics/cache-writers.md).

Operators (each = one :class:`~qsfa._contract.Contract` holding every documented rule as data, plus the
reference computation in :mod:`qsfa.reference`):

* :func:`scatter_by_slot` - the shared scatter of rows into a paged cache by slot (docs/numerics/cache-writers.md#scatter_by_slot);
* :func:`c8_cache_write` - the QSFA C8 writer's quantise + pack + scatter stage (bit-exact, kernel-checked);
* :func:`c8_rmsnorm_rope_cache` - RMSNorm + interleave RoPE + :func:`c8_cache_write` (vllm-ascend's writer);
* :func:`kv_rmsnorm_rope_cache` - torch_npu ``npu_kv_rmsnorm_rope_cache`` / ``_v2`` (docs/numerics/cache-writers.md#kv_rmsnorm_rope_cache);
* :func:`kv_compress_epilog` - aclnn KvCompressEpilog (docs/numerics/cache-writers.md#kv_compress_epilog).

Every cache is listed in its contract's ``inplace``; a rejected call writes nothing.
"""

from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import all_finite, dtype_in, edit_params, is_array, is_bool, is_int, is_num, ndim_in, rule, set_param, set_params
from .._contract import Contract, copy_args, one_of, params
from .. import chips as _chips
from .._dispatch import define_operator, run
from ..reference import c8_cache as _c8
from ..reference import kv_compress_epilog as _kce
from ..reference import kv_rmsnorm_rope_cache as _krr
from ..reference import scatter as _sc
from ..reference.packing import nz_columns

__all__ = [
    "scatter_by_slot",
    "c8_cache_write",
    "c8_rmsnorm_rope_cache",
    "kv_rmsnorm_rope_cache",
    "kv_compress_epilog",
    "kv_rmsnorm_rope_cache_example",
]

BF16 = ml_dtypes.bfloat16
FLOAT16_NAMES = ("float16", "bfloat16")
SLOT_DTYPES = ("int32", "int64")


# ------------------------------------------------------------------------------------------- helpers


_rule, _with, _edit = rule, set_params, edit_params
_is_bool, _is_int, _is_num = is_bool, is_int, is_num


def _same_dtype(op, param, ref, *, optional=False, source="", violate=None):
    """``param`` must have ``ref``'s dtype."""

    def check(a):
        v = a.get(param)
        if v is None:
            return None if optional else "None"
        r = a[ref]
        return None if dtype_name(v) == dtype_name(r) else dtype_name(v)

    def default_violate(args):
        out = copy_args(args)
        v = out.get(param)
        v = np.zeros((1,), np.float32) if v is None else v
        other = np.float16 if dtype_name(args[ref]) != "float16" else BF16
        out[param] = v.astype(np.float32).astype(other)
        return out

    return _rule(op, f"{param}_dtype_matches_{ref}", param, "dtype", f"must have the same dtype as {ref}",
                 check, violate if violate is not None else default_violate, dtype=True, source=source)


def _slot_rules(op, param, num_slots, *, source, example_valid_slot=0):
    """Range and uniqueness of a flat slot array (-1 = skip)."""

    def rng_check(a):
        s = np.asarray(a[param]).reshape(-1).astype(np.int64)
        n = num_slots(a)
        bad = (s < -1) | (s >= n)
        if bad.any():
            i = int(np.argmax(bad))
            return f"{int(s[i])} at position {i} (valid: -1 or [0, {n}))"
        return None

    def uniq_check(a):
        s = np.asarray(a[param]).reshape(-1).astype(np.int64)
        v = s[s != -1]
        if not v.size:
            return None
        u, c = np.unique(v, return_counts=True)
        return None if (c == 1).all() else f"slot {int(u[np.argmax(c > 1)])} repeated"

    def break_range(out):
        s = out[param].copy()
        s.reshape(-1)[0] = num_slots(out) + 7
        out[param] = s

    def break_unique(out):
        s = out[param].copy()
        flat = s.reshape(-1)
        valid = np.flatnonzero(flat != -1)
        flat[valid[1]] = flat[valid[0]]
        out[param] = s

    return [
        _rule(op, f"{param}_range", param, "value", "every slot must be -1 (skip) or inside the cache",
              rng_check, _edit(break_range), source=source),
        _rule(op, f"{param}_unique", param, "value", "slots other than -1 must not repeat (concurrent writes)",
              uniq_check, _edit(break_unique), source=source),
    ]


# --------------------------------------------------------------------------------------- scatter_by_slot

SC = "scatter_by_slot"
SC_SRC = "docs/numerics/cache-writers.md#scatter_by_slot"


def _sc_example(rng):
    cache = np.full((3, 4, 1, 8), 17, np.uint8)
    rows = rng.integers(0, 256, (5, 1, 8), dtype=np.uint8)
    return dict(cache=cache, rows=rows, slot_mapping=np.array([0, 5, -1, 11, 3], np.int64))


def _sc_rows_shape(a):
    want = (np.asarray(a.slot_mapping).size,) + tuple(a.cache.shape[2:])
    return None if tuple(a.rows.shape) == want else tuple(a.rows.shape)


SC_CONTRACT = Contract(
    op=SC,
    constraints=[
        is_array(SC, "cache", source=SC_SRC),
        is_array(SC, "rows", source=SC_SRC),
        is_array(SC, "slot_mapping", source=SC_SRC),
        _rule(SC, "cache_ndim", "cache", "dim", "a paged cache has at least 2 dimensions [block_num, block_size, ...]",
              lambda a: None if a.cache.ndim >= 2 else a.cache.ndim,
              _edit(lambda o: o.update(cache=o["cache"].reshape(-1))), source=SC_SRC),
        dtype_in(SC, "slot_mapping", SLOT_DTYPES, source=SC_SRC),
        ndim_in(SC, "slot_mapping", (1,), source=SC_SRC),
        _rule(SC, "rows_dtype", "rows", "dtype", "must have the cache's dtype",
              lambda a: None if a.rows.dtype == a.cache.dtype else dtype_name(a.rows),
              _edit(lambda o: o.update(rows=o["rows"].astype(np.int16))), dtype=True, source=SC_SRC),
        _rule(SC, "rows_shape", "rows", "shape", "must be [len(slot_mapping), *cache.shape[2:]]", _sc_rows_shape,
              _edit(lambda o: o.update(rows=o["rows"][:-1])), source=SC_SRC),
        *_slot_rules(SC, "slot_mapping", lambda a: a["cache"].shape[0] * a["cache"].shape[1], source=SC_SRC),
    ],
    example=_sc_example,
    inplace=("cache",),
    params=params("cache:array rows:array slot_mapping:array"),
)


def _sc_reference(cache, rows, slot_mapping):
    return _sc.scatter_by_slot(cache, rows, slot_mapping)


define_operator(SC, SC_CONTRACT, outputs=("cache",), reference=_sc_reference,
                doc="Write rows into a paged cache by slot; -1 skips.")


def scatter_by_slot(cache, rows, slot_mapping, backend="reference", *, chip=None):
    """Write ``rows[t]`` to ``cache[s // block_size, s % block_size]`` for each slot ``s = slot_mapping[t]``.

    cache:        ``[block_num, block_size, *row_shape]`` any dtype, updated in place and returned.
    rows:         ``[T, *row_shape]`` of the cache's dtype.
    slot_mapping: ``[T]`` int32 / int64; ``-1`` skips the token (its destination keeps its bytes); other
                  values must lie in ``[0, block_num * block_size)`` and must not repeat (rejected before
                  any write).
    """
    return run(SC, dict(cache=cache, rows=rows, slot_mapping=slot_mapping), backend, chip=chip)


# ------------------------------------------------------------------------------------------ C8 writers

C8 = "c8_cache_write"
C8R = "c8_rmsnorm_rope_cache"
C8_SRC = "docs/numerics/cache-writers.md#c8_cache_write; vllm-ascend vllm_ascend/attention/sfa_v1.py (custom_kv_rmsnorm_rope, _store_parallel_kv)"
SCALE_ORDERS = ("divide", "multiply")


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
    ok = _is_num(v) and math.isfinite(v) and 0 <= v <= 32768 and (v == 0 or a.key_dtype == "hifloat8")
    return None if ok else v


def _c8_key_rules(op):
    return [
        _rule(op, "key_dtype_value", "key_dtype", "value", f"must be {one_of(_c8.KEY_DTYPES)}",
              lambda a: None if a.key_dtype in _c8.KEY_DTYPES else a.key_dtype, set_param("key_dtype", "int4"),
              source=C8_SRC),
        _rule(op, "dst_type_max_value", "dst_type_max", "value",
              "must be a number in [0, 32768] (0 = HiFloat8's 32768), and 0 unless key_dtype is 'hifloat8'",
              _c8_dst_type_max, set_param("dst_type_max", 15.0),
              source="docs/numerics/open-facts.md#hifloat8-c8-nope"),
        _rule(op, "scale_order_value", "scale_order", "value",
              f"must be {one_of(SCALE_ORDERS)} (docs/numerics/open-facts.md#scale_order OPEN: x / s or x * 127 / amax)",
              lambda a: None if a.scale_order in SCALE_ORDERS else a.scale_order, set_param("scale_order", "bogus"),
              source="docs/numerics/open-facts.md#scale_order"),
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
                kv_cache=cache, key_dtype="int8", scale_order="divide", dst_type_max=0.0)


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
              lambda a: None if a.k_rope is None or tuple(a.k_rope.shape) == (_t(a), 64) else tuple(a.k_rope.shape),
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
    params=params("k_nope:array k_rope:array? slot_mapping:array kv_cache:array key_dtype:str scale_order:str"
                  " dst_type_max:float?"),
)


def _c8_reference(k_nope, k_rope, slot_mapping, kv_cache, key_dtype, scale_order, dst_type_max=None):
    return _c8.c8_cache_write(k_nope, k_rope, slot_mapping, kv_cache, key_dtype=key_dtype, scale_order=scale_order,
                              dst_type_max=dst_type_max or 0.0)


define_operator(C8, C8_CONTRACT, outputs=("kv_cache",), reference=_c8_reference,
                doc="QSFA C8 writer stage 2: per-tile dynamic quant of the NoPE, pack 656/528-byte rows, scatter.")


def c8_cache_write(k_nope, k_rope, slot_mapping, kv_cache, *, key_dtype="int8", scale_order="divide",
                   dst_type_max=0.0, chip=None, backend="reference"):
    """Quantise, pack and scatter one packed QSFA row per token (the kernel-checkable C8 writer stage).

    For token t with slot s = slot_mapping[t] (-1: nothing written), row ``kv_cache[s // bs, s % bs, 0]``
    receives: bytes [0, 512) the NoPE quantised per 1x128 tile, then the 64 RoPE values' raw 16-bit bytes
    (rope 64 only), then the 4 tile scales as little-endian fp32 (docs/numerics/layouts.md#packed-qsfa-row). Bytes of other rows are
    untouched.

    key_dtype "int8" (A2/A3): ``s = amax / 127`` (fp32), ``q = clamp(RINT(x / s), -127, 127)``; an all-zero
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
      scale_order:  **OPEN** (docs/numerics/open-facts.md#scale_order): "divide" (default, ``x / s``) or "multiply" (``x * fp32(127 / amax)``).
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
                kv_cache=cache, epsilon=1e-6, rope_head_dim=64, key_dtype="int8", scale_order="divide",
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
    params=params("kv:array gamma:array cos:array? sin:array? slot_mapping:array kv_cache:array epsilon:float"
                  " rope_head_dim:int key_dtype:str scale_order:str dst_type_max:float?"),
)


def _c8r_reference(kv, gamma, cos, sin, slot_mapping, kv_cache, epsilon, rope_head_dim, key_dtype, scale_order,
                   dst_type_max=None):
    return _c8.c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slot_mapping, kv_cache, epsilon=epsilon,
                                     rope_head_dim=rope_head_dim, key_dtype=key_dtype, scale_order=scale_order,
                                     dst_type_max=dst_type_max or 0.0)


define_operator(C8R, C8R_CONTRACT, outputs=("kv_cache",), reference=_c8r_reference,
                doc="QSFA C8 writer: RMSNorm + interleave RoPE + c8_cache_write (vllm-ascend custom_kv_rmsnorm_rope).")


def c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slot_mapping, kv_cache, *, epsilon=1e-6, rope_head_dim=64,
                          key_dtype="int8", scale_order="divide", dst_type_max=0.0, chip=None,
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
      key_dtype, scale_order, dst_type_max: as :func:`c8_cache_write`.
    Returns ``kv_cache``.
    """
    args = dict(kv=kv, gamma=gamma, cos=cos, sin=sin, slot_mapping=slot_mapping, kv_cache=kv_cache,
                epsilon=epsilon, rope_head_dim=rope_head_dim, key_dtype=key_dtype, scale_order=scale_order,
                dst_type_max=dst_type_max)
    return run(C8R, args, backend, chip=chip)


# --------------------------------------------------------------------------------- kv_compress_epilog

KCE = "kv_compress_epilog"
KCE_SRC = "docs/numerics/cache-writers.md#kv_compress_epilog; seed 002 (KvCompressEpilog)"


def _kce_d(a):
    return a.x.shape[-1]


def _kce_col(a):
    return _kce.kv_cache_col(_kce_d(a), a.quant_mode, a.quant_group_size, a.pad_to)


def _kce_example(rng):
    x = (rng.standard_normal((5, 576)) * 2).astype(BF16)
    cache = np.full((3, 4, 1, 672), 17, np.uint8)
    return dict(cache=cache, x=x, slot_mapping=np.array([0, 5, -1, 11, 3], np.int64), quant_group_size=64,
                quant_mode=1, round_scale=True, x_scale=1.0, pad_to=32, fp4_nibble_order="low_first")


def _kce_cache_strides(a):
    c = a.cache
    item = c.dtype.itemsize
    ok = c.strides[3] == item and (c.shape[1] <= 1 or c.strides[1] == c.shape[3] * item * c.shape[2])
    return None if ok else f"strides {c.strides}"


def _kce_d_rule(a):
    d = _kce_d(a)
    return None if d % 64 == 0 and 64 < d <= 8192 else d


def _kce_gs(a):
    if a.quant_mode != 2:
        return None
    return None if a.quant_group_size in (16, 32, 64) else a.quant_group_size


KCE_CONTRACT = Contract(
    op=KCE,
    constraints=[
        is_array(KCE, "cache", source=KCE_SRC),
        is_array(KCE, "x", source=KCE_SRC),
        is_array(KCE, "slot_mapping", source=KCE_SRC),
        dtype_in(KCE, "cache", ("uint8",), source=KCE_SRC),
        ndim_in(KCE, "cache", (4,), source=KCE_SRC),
        _rule(KCE, "cache_heads", "cache", "shape", "must be [blockNum, blockSize, 1, headDim]",
              lambda a: None if a.cache.shape[2] == 1 else tuple(a.cache.shape),
              _edit(lambda o: o.update(cache=np.zeros((3, 4, 2, 672), np.uint8))), source=KCE_SRC),
        _rule(KCE, "cache_strides", "cache", "layout",
              "only the blockNum dimension may be non-contiguous (rows must be dense)", _kce_cache_strides,
              _edit(lambda o: o.update(cache=np.zeros((3, 4, 1, 1344), np.uint8)[..., ::2])), source=KCE_SRC),
        dtype_in(KCE, "x", ("bfloat16",), source=KCE_SRC),
        _rule(KCE, "x_ndim", "x", "dim", "must have at least 2 dimensions [..., d]",
              lambda a: None if a.x.ndim >= 2 else a.x.ndim,
              _edit(lambda o: o.update(x=o["x"][0], slot_mapping=np.array(0, np.int64))), source=KCE_SRC),
        _rule(KCE, "x_last_dim", "x", "shape", "d must satisfy d % 64 == 0 and 64 < d <= 8192", _kce_d_rule,
              _edit(lambda o: o.update(x=o["x"][:, :560])), source=KCE_SRC),
        dtype_in(KCE, "slot_mapping", SLOT_DTYPES, source=KCE_SRC),
        _rule(KCE, "slot_mapping_shape", "slot_mapping", "shape", "must be x.shape[:-1]",
              lambda a: None if tuple(a.slot_mapping.shape) == tuple(a.x.shape[:-1]) else tuple(a.slot_mapping.shape),
              _edit(lambda o: o.update(slot_mapping=o["slot_mapping"][:-1])), source=KCE_SRC),
        _rule(KCE, "quant_mode_value", "quant_mode", "value", "must be one of {0, 1, 2}",
              lambda a: None if _is_int(a.quant_mode) and a.quant_mode in (0, 1, 2) else a.quant_mode,
              set_param("quant_mode", 3), source=KCE_SRC),
        _rule(KCE, "quant_group_size_value", "quant_group_size", "value",
              "quant_mode 2 supports quant_group_size 16, 32 or 64", _kce_gs,
              _with(quant_mode=2, quant_group_size=128), source=KCE_SRC),
        _rule(KCE, "round_scale_type", "round_scale", "type", "must be a bool",
              lambda a: None if _is_bool(a.round_scale) else a.round_scale, set_param("round_scale", 1),
              source=KCE_SRC),
        _rule(KCE, "x_scale_value", "x_scale", "value", "must be a finite number",
              lambda a: None if _is_num(a.x_scale) and math.isfinite(a.x_scale) else a.x_scale,
              set_param("x_scale", float("inf")), source=KCE_SRC),
        _rule(KCE, "pad_to_value", "pad_to", "value", "must be one of {32, 128} (docs/numerics/open-facts.md#pad_to OPEN)",
              lambda a: None if _is_int(a.pad_to) and a.pad_to in (32, 128) else a.pad_to, set_param("pad_to", 64),
              source="docs/numerics/open-facts.md#pad_to (OPEN: padding granularity)"),
        _rule(KCE, "fp4_nibble_order_value", "fp4_nibble_order", "value",
              "must be one of {'low_first', 'high_first'} (docs/numerics/open-facts.md#nibble_order OPEN)",
              lambda a: None if a.fp4_nibble_order in ("low_first", "high_first") else a.fp4_nibble_order,
              set_param("fp4_nibble_order", "bogus"), source="docs/numerics/open-facts.md#nibble_order (OPEN: FP4 nibble order)"),
        _rule(KCE, "head_dim", "cache", "shape", "headDim (cache.shape[3]) must be >= kvCacheCol, the bytes per row",
              lambda a: None if a.cache.shape[3] >= _kce_col(a) else f"headDim {a.cache.shape[3]} < kvCacheCol "
              f"{_kce_col(a)}", _edit(lambda o: o.update(cache=np.zeros((3, 4, 1, 512), np.uint8))),
              source=KCE_SRC),
        all_finite(KCE, "x", source=KCE_SRC),
        *_slot_rules(KCE, "slot_mapping", lambda a: a["cache"].shape[0] * a["cache"].shape[1], source=KCE_SRC),
        _rule(KCE, "a2a3_unsupported", "cache", "value", "KvCompressEpilog runs on Ascend 950 only",
              lambda a: "Atlas A2/A3", lambda args: copy_args(args), chips=("A2", "A3"), source=KCE_SRC),
    ],
    example=_kce_example,
    inplace=("cache",),
    params=params("cache:array x:array slot_mapping:array quant_group_size:int quant_mode:int round_scale:bool"
                  " x_scale:float pad_to:int fp4_nibble_order:str"),
)


def _kce_reference(cache, x, slot_mapping, quant_group_size, quant_mode, round_scale, x_scale, pad_to,
                   fp4_nibble_order):
    return _kce.kv_compress_epilog(cache, x, slot_mapping, quant_group_size=quant_group_size, quant_mode=quant_mode,
                                   round_scale=round_scale, x_scale=x_scale, pad_to=pad_to,
                                   fp4_nibble_order=fp4_nibble_order)


define_operator(KCE, KCE_CONTRACT, outputs=("cache",), reference=_kce_reference,
                doc="KvCompressEpilog: group-quantise bf16 rows (FP8 / HiF8 + FP4) and scatter them by slot.")


def kv_compress_epilog(cache, x, slot_mapping, *, quant_group_size=64, quant_mode=1, round_scale=True, x_scale=1.0,
                       pad_to=32, fp4_nibble_order="low_first", chip=None, backend="reference"):
    """Quantise bf16 rows ``x [..., d]`` and scatter them into ``cache`` by slot (aclnn KvCompressEpilog).

    With n = d - 64 NoPE columns first and the last 64 columns the RoPE, each written row is
    (:func:`qsfa.reference.kv_compress_epilog.kv_cache_col` bytes; bytes from there to headDim untouched):

    * mode 0: [0,128) RoPE bf16 raw bits | n FP8 E4M3FN codes | n/64 bf16 scales | zero pad to ``pad_to``;
    * mode 1: [0,128) RoPE bf16 raw bits | n FP8 E4M3FN codes | n/64 E8M0 scale bytes (no pad);
    * mode 2: [0,64) RoPE HiFloat8 of ``x * x_scale`` | n/2 packed FP4 E2M1 bytes | n/gs bf16 scales | zero pad.

    Modes 0/1 use groups of 64 (quant_group_size ignored): ``s = max(amax, 1e-4) * fp32(1/448)``, ceiled to a
    power of two when ``round_scale``; ``q = E4M3FN(RINT, clamp(x / s, +-448))``; mode 0 stores
    ``BF16_RINT(s)``, mode 1 the floor-exponent byte of s (with round_scale=False the data used the unrounded
    s - the kernel's quirk, kept). Mode 2: stored ``BF16_RINT(amax * fp32(1/6))``; codes
    ``E2M1(RINT, clamp(bf16(x) * BF16_RINT(6/amax), +-6))`` with the product rounded to bf16.

    Parameters:
      cache:            uint8 ``[blockNum, blockSize, 1, headDim]``, in place; may be strided along blockNum
                        (the writes land in the caller's buffer).
      x:                bfloat16 ``[..., d]``, d % 64 == 0, 64 < d <= 8192.
      slot_mapping:     int32 / int64 of shape ``x.shape[:-1]``; -1 skips a token; others unique and in range.
      quant_group_size: 16, 32 or 64 (mode 2 only; (d - 64) % gs == 0 follows from d % 64 == 0).
      quant_mode:       0 (bf16 scales), 1 (E8M0 scales, default), 2 (HiF8 RoPE + FP4 NoPE).
      round_scale:      ceil the group scales to powers of two (modes 0/1).
      x_scale:          mode 2's static RoPE multiplier (fp32).
      pad_to:           **OPEN** (docs/numerics/open-facts.md#pad_to): row padding granularity of modes 0 and 2, default 32 (tiling
                        code and docs); 128 per an older comment. Not an aclnn argument.
      fp4_nibble_order: **OPEN** (docs/numerics/open-facts.md#nibble_order): "low_first" (default: element 2i in the low nibble) or
                        "high_first". Not an aclnn argument.
    Returns ``cache``.
    """
    args = dict(cache=cache, x=x, slot_mapping=slot_mapping, quant_group_size=quant_group_size, quant_mode=quant_mode,
                round_scale=round_scale, x_scale=x_scale, pad_to=pad_to, fp4_nibble_order=fp4_nibble_order)
    return run(KCE, args, backend, chip=chip)


# ----------------------------------------------------------------------------- kv_rmsnorm_rope_cache

KRR = "kv_rmsnorm_rope_cache"
KRR_SRC = "docs/numerics/cache-writers.md#kv_rmsnorm_rope_cache; seed 004 (aclnnKvRmsNormRopeCacheV2); torch_npu npu_kv_rmsnorm_rope_cache meta"
KRR_MODES = _krr.CACHE_MODES
KRR_FORMATS = _krr.QUANT_FORMATS + _krr.FLOAT_FORMATS
QUANT_PARAMS = (("k_rope_scale", "k_rope_offset", "k"), ("c_kv_scale", "c_kv_offset", "ckv"))
_NZ_MODES = ("PA_NZ", "PA_BLK_NZ")
_BLK_MODES = ("PA_BLK_BNSD", "PA_BLK_NZ")
_ARRAY_OF_FORMAT = {
    "int8": np.dtype(np.int8),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "hifloat8": np.dtype(np.uint8),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(BF16),
}
#: cache array dtypes each format may be stored in (a uint8 buffer may carry any 8-bit format)
_FORMAT_ARRAYS = {
    "int8": ("int8", "uint8"),
    "float8_e4m3fn": ("float8_e4m3fn", "uint8"),
    "float8_e5m2": ("float8_e5m2", "uint8"),
    "hifloat8": ("uint8",),
    "float16": ("float16",),
    "bfloat16": ("bfloat16",),
}
_QUANT_SCALE = {"int8": 24.0, "float8_e4m3fn": 60.0, "float8_e5m2": 200.0, "hifloat8": 500.0}


def kv_rmsnorm_rope_cache_example(rng=None, *, version=1, cache_mode="PA_BNSD", dtype="bfloat16", k_fmt="int8",
                                  ckv_fmt="bfloat16", batch=2, heads=1, seq=3, dv=64, dk=32, rope=32,
                                  block_size=None, block_num=None, cache_seq=None, offsets=False, cos_seq1=False,
                                  param_shape="ND", skip=True, is_output_kv=True, sentinel=17):
    """A valid argument set of :func:`kv_rmsnorm_rope_cache` (NumPy; caches prefilled with ``sentinel``).

    version 1: ``kv [B, N, S, dv + dk]``, gamma ``[dv]``, cos/sin ``[B, N, S|1, dk]``.
    version 2: ``kv [B, N, S, dk]`` (the K width), v ``[B, N, S, dv]``, gamma ``[dk]``, cos/sin width ``rope``.
    k_fmt / ckv_fmt: a format of :data:`KRR_FORMATS`; 8-bit formats get a static scale (and an offset with
    ``offsets``); a 16-bit format must equal ``dtype``. ``param_shape``: "ND" ([N, D]), "D", "1D" ([1, D]),
    "1". ``skip``: one token / chunk gets index -1. Used by the contract's example and by the tests.
    """
    rng = np.random.default_rng(0) if rng is None else rng
    kv_dt = _ARRAY_OF_FORMAT[dtype]
    b, n, s = batch, heads, seq
    kd = dk
    d = dk if version == 2 else dv + dk
    rope_w = rope if version == 2 else dk
    any8 = k_fmt in _krr.QUANT_FORMATS or ckv_fmt in _krr.QUANT_FORMATS
    bs = block_size or (32 if any8 else 16)
    kv = rng.standard_normal((b, n, s, d)).astype(np.float32)
    args = dict(kv=kv.astype(kv_dt))
    gamma = (1.0 + 0.25 * rng.standard_normal(d if version == 2 else dv)).astype(kv_dt)
    cs = 1 if cos_seq1 else s
    ang = rng.random((b, n, cs, rope_w // 2)) * 6.283
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1).astype(kv_dt)
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1).astype(kv_dt)
    v = (rng.standard_normal((b, n, s, dv)) * 2).astype(kv_dt) if version == 2 else None
    args.update(gamma=gamma, cos=cos, sin=sin)

    def qparam(width, base):
        shape = {"ND": (n, width), "D": (width,), "1D": (1, width), "1": (1,)}[param_shape]
        return (base * (0.75 + 0.5 * rng.random(shape))).astype(np.float32)

    for (sc, off, which), fmt, width in zip(QUANT_PARAMS, (k_fmt, ckv_fmt), (kd, dv)):
        args[sc] = qparam(width, _QUANT_SCALE[fmt]) if fmt in _krr.QUANT_FORMATS else None
        args[off] = (qparam(width, 1.0) - 1.0) if (offsets and fmt in _krr.QUANT_FORMATS) else None

    if cache_mode == "Norm":
        sc_len = cache_seq or s + 2
        shapes = ((b, n, sc_len, kd), (b, n, sc_len, dv))
        idx = np.stack([rng.permutation(sc_len)[:s] if sc_len >= s else
                        np.concatenate([rng.permutation(sc_len), -np.ones(s - sc_len, np.int64)])
                        for _ in range(b)]).astype(np.int64)
        if skip:
            idx[0, 0] = -1
    else:
        chunks = -(-s // bs)
        blocks_needed = b * chunks if cache_mode in _BLK_MODES else -(-(b * s) // bs)
        bn = block_num or blocks_needed + 1
        shapes = ((bn, bs, n, kd), (bn, bs, n, dv))
        if cache_mode in _BLK_MODES:
            idx = (rng.permutation(bn)[:b * chunks] * bs).astype(np.int64)
        else:
            idx = rng.permutation(bn * bs)[:b * s].astype(np.int64)
        if skip:
            idx[0] = -1

    def cache(shape, fmt):
        arr = np.full(shape, sentinel, np.uint8).view(np.uint8)
        dt = _ARRAY_OF_FORMAT[fmt]
        if dt.itemsize == 2:
            arr = np.full(shape, sentinel, np.uint16).view(dt)
        else:
            arr = arr.view(dt)
        if cache_mode in _NZ_MODES:
            c = nz_columns(dt)
            bn_, bs_, n_, d_ = shape
            d1 = -(-d_ // c)
            nz_shape = (bn_, d1, bs_, 1, c) if n_ == 1 else (bn_, n_, d1, bs_, c)
            full = np.full(nz_shape, sentinel, np.uint8 if dt.itemsize == 1 else np.uint16)
            arr = full.view(dt)
        return arr

    args.update(index=idx, k_cache=cache(shapes[0], k_fmt), ckv_cache=cache(shapes[1], ckv_fmt), v=v,
                epsilon=1e-5, cache_mode=cache_mode, is_output_kv=is_output_kv,
                k_cache_dtype=k_fmt if k_fmt == "hifloat8" else None,
                ckv_cache_dtype=ckv_fmt if ckv_fmt == "hifloat8" else None)
    return {k: args[k] for k in _KRR_PARAMS}


_KRR_PARAMS = ("kv", "gamma", "cos", "sin", "index", "k_cache", "ckv_cache", "k_rope_scale", "c_kv_scale",
               "k_rope_offset", "c_kv_offset", "v", "epsilon", "cache_mode", "is_output_kv", "k_cache_dtype",
               "ckv_cache_dtype")


def _krr_build(**kw):
    """A violate function that ignores the base and builds a fresh argument set."""

    def violate(args):
        return kv_rmsnorm_rope_cache_example(np.random.default_rng(1), **kw)

    return violate


def _nan_into(param, **kw):
    """Build an argument set that has ``param`` and put a NaN into it."""

    def fn(out):
        a = out[param].copy()
        a.reshape(-1)[0] = np.nan
        out[param] = a

    return _krr_build_edit(fn, **kw)


def _krr_build_edit(fn, **kw):
    def violate(args):
        out = kv_rmsnorm_rope_cache_example(np.random.default_rng(1), **kw)
        fn(out)
        return out

    return violate


def _v2(a):
    return a.get("v") is not None


def _dims(a):
    """(Dk, Dv, rope width) implied by kv / gamma / cos / v."""
    d = a.kv.shape[3]
    rope = a.cos.shape[3]
    if _v2(a):
        return d, a.v.shape[3], rope
    dv = a.gamma.shape[0]
    return d - dv, dv, rope


def _fmt(a, which):
    """Resolved format of the k / ckv cache (the name, or inferred from the array dtype), or None."""
    name = a.get("k_cache_dtype" if which == "k" else "ckv_cache_dtype")
    arr = a["k_cache" if which == "k" else "ckv_cache"]
    if name is not None:
        return name
    inferred = dtype_name(arr)
    return inferred if inferred in KRR_FORMATS and inferred != "hifloat8" else None


def _is8(fmt):
    return fmt in _krr.QUANT_FORMATS


def _cache_name(which):
    return "k_cache" if which == "k" else "ckv_cache"


def _logical_cache_shape(a, which):
    """``(blocks, rows, N, D)`` of a cache in the current mode, or None if its rank/layout is wrong."""
    arr = a[_cache_name(which)]
    mode = a.cache_mode
    if mode in _NZ_MODES:
        if arr.ndim != 5:
            return None
        c = nz_columns(arr.dtype)
        if arr.shape[4] != c:
            return None
        if arr.shape[3] == 1:
            return arr.shape[0], arr.shape[2], 1, arr.shape[1] * c
        return arr.shape[0], arr.shape[3], arr.shape[1], arr.shape[2] * c
    if arr.ndim != 4:
        return None
    if mode == "Norm":
        return arr.shape[0], arr.shape[2], arr.shape[1], arr.shape[3]
    return tuple(arr.shape)


def _rows_per_block(a):
    return _logical_cache_shape(a, "k")[1]


def _num_slots(a):
    lk = _logical_cache_shape(a, "k")
    return lk[0] * lk[1]


def _krr_heads(a):
    n = a.kv.shape[1]
    if _v2(a):
        return None if n in (1, 2, 4, 8) else n
    return None if n == 1 else n


def _krr_dims(a):
    d = a.kv.shape[3]
    g = a.gamma.shape[0]
    if _v2(a):
        return None if g == d else f"len(gamma) {g} != D {d}"
    rope = a.cos.shape[3]
    return None if g >= 1 and g + rope == d else f"len(gamma) {g} + cos width {rope} != D {d}"


def _krr_cos_shape(a):
    b, n, s, _ = a.kv.shape
    cb, cn, cs, _ = a.cos.shape
    return None if (cb, cn) == (b, n) and cs in (s, 1) else tuple(a.cos.shape)


def _krr_rope_width(a):
    r = a.cos.shape[3]
    ok = r > 0 and r % 2 == 0 and (not _v2(a) or r <= a.kv.shape[3])
    return None if ok else r


def _krr_fmt_name(p):
    def check(a):
        v = a.get(p)
        return None if v is None or v in KRR_FORMATS else v

    return check


def _krr_fmt_arrays(which):
    def check(a):
        arr = a[_cache_name(which)]
        name = a.get("k_cache_dtype" if which == "k" else "ckv_cache_dtype")
        if name is None:
            inferred = dtype_name(arr)
            if inferred not in KRR_FORMATS or inferred == "hifloat8":
                return f"{inferred} cache without {which}_cache_dtype" if which == "ckv" else \
                    f"{inferred} cache without k_cache_dtype"
            return None
        return None if dtype_name(arr) in _FORMAT_ARRAYS[name] else f"{dtype_name(arr)} array named {name!r}"

    return check


def _krr_float_cache(which):
    def check(a):
        f = _fmt(a, which)
        if _is8(f):
            return None
        return None if f == dtype_name(a.kv) else f

    return check


def _krr_offset_needs_scale(a):
    for sc, off, _ in QUANT_PARAMS:
        if a.get(off) is not None and a.get(sc) is None:
            return f"{off} without {sc}"
    return None


def _krr_scale_needed(a):
    for (sc, _, which) in QUANT_PARAMS:
        if _is8(_fmt(a, which)) and a.get(sc) is None:
            return f"{_cache_name(which)} is {_fmt(a, which)} but {sc} is None"
    return None


def _krr_scale_forbidden(a):
    for (sc, off, which) in QUANT_PARAMS:
        if not _is8(_fmt(a, which)) and (a.get(sc) is not None or a.get(off) is not None):
            return f"{_cache_name(which)} is {_fmt(a, which)} but {sc}/{off} given"
    return None


def _krr_param_shapes(a):
    dk, dv, _ = _dims(a)
    n = a.kv.shape[1]
    for (sc, off, which), width in zip(QUANT_PARAMS, (dk, dv)):
        for p in (sc, off):
            v = a.get(p)
            if v is None:
                continue
            if tuple(v.shape) not in ((n, width), (width,), (1, width), (1,)):
                return f"{p} {tuple(v.shape)}"
    return None


def _krr_param_consistent(a):
    given = [a[p] for sc, off, _ in QUANT_PARAMS for p in (sc, off) if a.get(p) is not None]
    ndims = {v.ndim for v in given}
    ns = {v.shape[0] for v in given if v.ndim == 2}
    return None if len(ndims) <= 1 and len(ns) <= 1 else f"ndims {sorted(ndims)}, N sizes {sorted(ns)}"


def _krr_cache_rank(which):
    def check(a):
        want = 5 if a.cache_mode in _NZ_MODES else 4
        arr = a[_cache_name(which)]
        return None if arr.ndim == want else f"{_cache_name(which)} has {arr.ndim} dims"

    return check


def _krr_nz_align(a):
    if a.cache_mode not in _NZ_MODES:
        return None
    dk, dv, _ = _dims(a)
    for which, width in (("k", dk), ("ckv", dv)):
        c = nz_columns(a[_cache_name(which)].dtype)
        if width % c:
            return f"{'Dk' if which == 'k' else 'Dv'} {width} with {c}-element NZ columns"
    return None


def _krr_cache_shape(which):
    def check(a):
        dk, dv, _ = _dims(a)
        width = dk if which == "k" else dv
        ls = _logical_cache_shape(a, which)
        b, n = a.kv.shape[:2]
        if ls is None or ls[2] != n or ls[3] != width or (a.cache_mode == "Norm" and ls[0] != b):
            return tuple(a[_cache_name(which)].shape)
        return None

    return check


def _krr_caches_agree(a):
    lk, lc = _logical_cache_shape(a, "k"), _logical_cache_shape(a, "ckv")
    return None if lk[:2] == lc[:2] else f"k_cache {lk[:2]} vs ckv_cache {lc[:2]}"


def _krr_norm_len(a):
    if a.cache_mode != "Norm":
        return None
    sc = _logical_cache_shape(a, "k")[1]
    return None if sc >= a.kv.shape[2] else f"Scache {sc} < Skv {a.kv.shape[2]}"


def _krr_block_align(a):
    if a.cache_mode == "Norm":
        return None
    bs = _rows_per_block(a)
    need = {32 if a[_cache_name(w)].dtype.itemsize == 1 else 16 for w in ("k", "ckv")}
    bad = [m for m in need if bs % m]
    return None if not bad else f"block_size {bs} (needs % {max(need)})"


def _krr_index_shape(a):
    b, _, s, _ = a.kv.shape
    if a.cache_mode == "Norm":
        want = (b, s)
    elif a.cache_mode in _BLK_MODES:
        want = (b * -(-s // _rows_per_block(a)),)
    else:
        want = (b * s,)
    return None if tuple(a.index.shape) == want else tuple(a.index.shape)


def _krr_index_range(a):
    idx = a.index.astype(np.int64)
    hi = _rows_per_block(a) if a.cache_mode == "Norm" else _num_slots(a)
    bad = (idx < -1) | (idx >= hi)
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        return f"{int(idx[i])} at {i} (valid: -1 or [0, {hi}))"
    return None


def _krr_index_unique(a):
    idx = a.index.astype(np.int64)
    if a.cache_mode == "Norm":
        for row in idx:
            v = row[row != -1]
            if np.unique(v).size != v.size:
                return f"repeated position in batch row {row.tolist()}"
        return None
    v = idx[idx != -1]
    if a.cache_mode in _BLK_MODES:
        v = v // _rows_per_block(a)
    u, c = np.unique(v, return_counts=True)
    return None if (c == 1).all() else f"{'block' if a.cache_mode in _BLK_MODES else 'slot'} {int(u[c > 1][0])} repeated"


def _krr_is_output_kv(a):
    return None if _is_bool(a.is_output_kv) else a.is_output_kv


def _krr_epsilon(a):
    e = a.epsilon
    return None if _is_num(e) and math.isfinite(e) and e > 0 else e


def _set_index_entry(value_fn):
    def fn(out):
        idx = out["index"].copy()
        flat = idx.reshape(-1)
        valid = np.flatnonzero(flat != -1)
        value_fn(flat, valid)
        out["index"] = idx

    return fn


_A2A3 = ("A2", "A3")


def _chip_a2a3_int8(a):
    for which in ("k", "ckv"):
        f = _fmt(a, which)
        if _is8(f) and f != "int8":
            return f"{_cache_name(which)} {f}"
    return None


def _chip_a2a3_v1_norm_quant(a):
    if _v2(a) or a.cache_mode != "Norm":
        return None
    return None if not (_is8(_fmt(a, "k")) or _is8(_fmt(a, "ckv"))) else "static quantisation in Norm mode (V1)"


def _chip_a2a3_v1_offsets(a):
    if _v2(a):
        return None
    given = [off for _, off, _ in QUANT_PARAMS if a.get(off) is not None]
    return None if not given else ", ".join(given)


def _chip_a2a3_v1_shape1(a):
    if _v2(a):
        return None
    for sc, off, _ in QUANT_PARAMS:
        for p in (sc, off):
            v = a.get(p)
            if v is not None and tuple(v.shape) == (1,):
                return f"{p} (1,)"
    return None


def _chip_a2a3_v1_dims(a):
    if _v2(a):
        return None
    dk, dv, _ = _dims(a)
    return None if (dv, dk) == (512, 64) else f"Dv {dv}, Dk {dk}"


def _chip_a2a3_v2_no_bcast(a):
    if not _v2(a):
        return None
    dk, dv, _ = _dims(a)
    n = a.kv.shape[1]
    for (sc, off, _), width in zip(QUANT_PARAMS, (dk, dv)):
        for p in (sc, off):
            v = a.get(p)
            if v is not None and tuple(v.shape) != (n, width):
                return f"{p} {tuple(v.shape)}"
    return None


KRR_CONTRACT = Contract(
    op=KRR,
    constraints=[
        is_array(KRR, "kv", source=KRR_SRC),
        is_array(KRR, "gamma", source=KRR_SRC),
        is_array(KRR, "cos", source=KRR_SRC),
        is_array(KRR, "sin", source=KRR_SRC),
        is_array(KRR, "index", source=KRR_SRC),
        is_array(KRR, "k_cache", source=KRR_SRC),
        is_array(KRR, "ckv_cache", source=KRR_SRC),
        *[is_array(KRR, p, optional=True, source=KRR_SRC)
          for p in ("k_rope_scale", "c_kv_scale", "k_rope_offset", "c_kv_offset", "v")],
        dtype_in(KRR, "kv", FLOAT16_NAMES, source=KRR_SRC),
        ndim_in(KRR, "kv", (4,), source=KRR_SRC),
        _rule(KRR, "kv_nonempty", "kv", "shape", "empty tensors are not supported",
              lambda a: None if a.kv.size else tuple(a.kv.shape), _edit(lambda o: o.update(kv=o["kv"][:0])),
              source=KRR_SRC),
        _rule(KRR, "cache_mode_value", "cache_mode", "value", f"must be {one_of(KRR_MODES)}",
              lambda a: None if a.cache_mode in KRR_MODES else a.cache_mode, set_param("cache_mode", "BNSD"),
              source=KRR_SRC),
        ndim_in(KRR, "gamma", (1,), source=KRR_SRC),
        _same_dtype(KRR, "gamma", "kv", source=KRR_SRC),
        ndim_in(KRR, "cos", (4,), source=KRR_SRC),
        _same_dtype(KRR, "cos", "kv", source=KRR_SRC),
        _same_dtype(KRR, "sin", "kv", source=KRR_SRC),
        _rule(KRR, "sin_shape", "sin", "shape", "must have cos's shape",
              lambda a: None if a.sin.shape == a.cos.shape else tuple(a.sin.shape),
              _edit(lambda o: o.update(sin=o["sin"][..., :-2])), source=KRR_SRC),
        _rule(KRR, "v_ndim", "v", "dim", "must have 4 dimensions [Bkv, N, Skv, Dv]",
              lambda a: None if a.v is None or a.v.ndim == 4 else a.v.ndim,
              _krr_build_edit(lambda o: o.update(v=o["v"][0]), version=2), source=KRR_SRC),
        _same_dtype(KRR, "v", "kv", optional=True, source=KRR_SRC,
                    violate=_krr_build_edit(lambda o: o.update(v=o["v"].astype(np.float16)), version=2)),
        _rule(KRR, "v_tokens", "v", "shape", "must share kv's [Bkv, N, Skv]",
              lambda a: None if a.v is None or a.v.shape[:3] == a.kv.shape[:3] else tuple(a.v.shape),
              _krr_build_edit(lambda o: o.update(v=o["v"][:, :, :-1]), version=2), source=KRR_SRC),
        _rule(KRR, "heads", "kv", "shape", "N must be 1 (V1, no v) or one of {1, 2, 4, 8} (V2)", _krr_heads,
              _krr_build(heads=2), source=KRR_SRC),
        _rule(KRR, "head_dims", "gamma", "shape",
              "V1: len(gamma) (Dv) + cos width (Dk) must equal kv's D; V2: len(gamma) must equal D", _krr_dims,
              _edit(lambda o: o.update(gamma=o["gamma"][:-1])), source=KRR_SRC),
        _rule(KRR, "cos_shape", "cos", "shape", "must be [Bkv, N, Skv, Dk] or [Bkv, N, 1, Dk]", _krr_cos_shape,
              _edit(lambda o: o.update(cos=o["cos"][:, :, :2], sin=o["sin"][:, :, :2])), source=KRR_SRC),
        _rule(KRR, "rope_width", "cos", "shape", "the RoPE width (Dk) must be even and > 0 (V2: <= D)",
              _krr_rope_width, _edit(lambda o: o.update(gamma=np.concatenate([o["gamma"], o["gamma"][:1]]),
                                                        cos=o["cos"][..., :31], sin=o["sin"][..., :31])),
              source=KRR_SRC),
        dtype_in(KRR, "index", ("int64",), source=KRR_SRC),
        _rule(KRR, "cache_dtype_names", "k_cache_dtype", "value", f"must be None or {one_of(KRR_FORMATS)}",
              _krr_fmt_name("k_cache_dtype"), set_param("k_cache_dtype", "int4"), source=KRR_SRC),
        _rule(KRR, "ckv_cache_dtype_names", "ckv_cache_dtype", "value", f"must be None or {one_of(KRR_FORMATS)}",
              _krr_fmt_name("ckv_cache_dtype"), set_param("ckv_cache_dtype", "int4"), source=KRR_SRC),
        _rule(KRR, "k_cache_format", "k_cache", "dtype",
              "k_cache's dtype must carry k_cache_dtype (a uint8 buffer needs the name, e.g. 'hifloat8')",
              _krr_fmt_arrays("k"), set_param("k_cache_dtype", "hifloat8"), dtype=True, source=KRR_SRC),
        _rule(KRR, "ckv_cache_format", "ckv_cache", "dtype",
              "ckv_cache's dtype must carry ckv_cache_dtype (a uint8 buffer needs the name, e.g. 'hifloat8')",
              _krr_fmt_arrays("ckv"), set_param("ckv_cache_dtype", "float16"), dtype=True, source=KRR_SRC),
        _rule(KRR, "k_cache_float_dtype", "k_cache", "dtype", "a non-quantised cache must have kv's dtype",
              _krr_float_cache("k"), _krr_build(k_fmt="float16", ckv_fmt="bfloat16"), dtype=True, source=KRR_SRC),
        _rule(KRR, "ckv_cache_float_dtype", "ckv_cache", "dtype", "a non-quantised cache must have kv's dtype",
              _krr_float_cache("ckv"), _edit(lambda o: o.update(ckv_cache=o["ckv_cache"].astype(np.float16))),
              dtype=True, source=KRR_SRC),
        *[dtype_in(KRR, p, ("float32",), optional=True, source=KRR_SRC)
          for p in ("k_rope_scale", "c_kv_scale", "k_rope_offset", "c_kv_offset")],
        _rule(KRR, "offset_needs_scale", "k_rope_offset", "value", "an offset without its scale is not allowed",
              _krr_offset_needs_scale,
              _edit(lambda o: o.update(k_rope_offset=np.zeros_like(o["k_rope_scale"]), k_rope_scale=None)),
              source=KRR_SRC),
        _rule(KRR, "scale_needed", "k_rope_scale", "value", "an 8-bit (quantised) cache needs its scale",
              _krr_scale_needed, set_param("k_rope_scale", None), source=KRR_SRC),
        _rule(KRR, "scale_forbidden", "c_kv_scale", "value",
              "a non-quantised (16-bit) cache takes no scale / offset", _krr_scale_forbidden,
              _edit(lambda o: o.update(c_kv_scale=np.ones((1, 64), np.float32))), source=KRR_SRC),
        _rule(KRR, "quant_param_shape", "k_rope_scale", "shape",
              "quant parameters must be [N, D], [D], [1, D] or [1] (D = that cache's last dim)", _krr_param_shapes,
              _edit(lambda o: o.update(k_rope_scale=np.ones((33,), np.float32))), source=KRR_SRC),
        _rule(KRR, "quant_param_consistent", "k_rope_offset", "shape",
              "all quant parameters must have the same number of dims and the same N size", _krr_param_consistent,
              _edit(lambda o: o.update(k_rope_offset=np.zeros((32,), np.float32))), source=KRR_SRC),
        _rule(KRR, "cache_rank", "k_cache", "dim", "caches are 4-D ([..]) in Norm / PA / PA_BNSD / PA_BLK_BNSD "
              "and 5-D NZ storage in PA_NZ / PA_BLK_NZ", _krr_cache_rank("k"),
              _edit(lambda o: o.update(k_cache=o["k_cache"][..., None])), source=KRR_SRC),
        _rule(KRR, "ckv_cache_rank", "ckv_cache", "dim", "caches are 4-D ([..]) in Norm / PA / PA_BNSD / "
              "PA_BLK_BNSD and 5-D NZ storage in PA_NZ / PA_BLK_NZ", _krr_cache_rank("ckv"),
              _edit(lambda o: o.update(ckv_cache=o["ckv_cache"][..., None])), source=KRR_SRC),
        _rule(KRR, "nz_alignment", "k_cache", "shape",
              "NZ modes need Dk and Dv to be multiples of the NZ column (16 elements for 16-bit caches, 32 for "
              "8-bit caches)", _krr_nz_align, _krr_build(cache_mode="PA_NZ", dk=48, dv=64), source=KRR_SRC),
        _rule(KRR, "k_cache_shape", "k_cache", "shape",
              "Norm: [Bkv, N, Scache, Dk]; PA / PA_BNSD / PA_BLK_BNSD: [block_num, block_size, N, Dk]; NZ: "
              "[block_num, Dk//c, block_size, 1, c] (N = 1) or [block_num, N, Dk//c, block_size, c]",
              _krr_cache_shape("k"), _edit(lambda o: o.update(k_cache=o["k_cache"][..., :-1])), source=KRR_SRC),
        _rule(KRR, "ckv_cache_shape", "ckv_cache", "shape",
              "Norm: [Bkv, N, Scache, Dv]; PA / PA_BNSD / PA_BLK_BNSD: [block_num, block_size, N, Dv]; NZ: "
              "[block_num, Dv//c, block_size, 1, c] (N = 1) or [block_num, N, Dv//c, block_size, c]",
              _krr_cache_shape("ckv"), _edit(lambda o: o.update(ckv_cache=o["ckv_cache"][..., :-1])),
              source=KRR_SRC),
        _rule(KRR, "caches_agree", "ckv_cache", "shape",
              "k_cache and ckv_cache must have the same block_num and block_size (Norm: the same Scache)",
              _krr_caches_agree, _edit(lambda o: o.update(ckv_cache=np.concatenate([o["ckv_cache"]] * 2))),
              source=KRR_SRC),
        _rule(KRR, "norm_cache_length", "k_cache", "shape", "Norm mode needs Scache >= Skv", _krr_norm_len,
              _krr_build(cache_mode="Norm", k_fmt="bfloat16", cache_seq=2), source=KRR_SRC),
        _rule(KRR, "block_size_alignment", "k_cache", "shape",
              "block_size must be a multiple of 16 for 16-bit caches and of 32 for 8-bit caches (both when the "
              "caches differ)", _krr_block_align, _krr_build(block_size=16), source=KRR_SRC),
        _rule(KRR, "index_shape", "index", "shape",
              "Norm: [Bkv, Skv]; PA / PA_BNSD / PA_NZ: [Bkv*Skv]; PA_BLK_*: [Bkv*ceil(Skv/block_size)]",
              _krr_index_shape, _edit(lambda o: o.update(index=o["index"][:-1])), source=KRR_SRC),
        _rule(KRR, "index_range", "index", "value",
              "Norm: -1 or a position in [0, Scache); PA modes: -1 or a slot in [0, block_num*block_size)",
              _krr_index_range, _edit(_set_index_entry(lambda f, v: f.__setitem__(v[0], 10 ** 6))), source=KRR_SRC),
        _rule(KRR, "index_unique", "index", "value",
              "PA: slots must not repeat; PA_BLK_*: index // block_size must not repeat; Norm: positions must not "
              "repeat within a batch row", _krr_index_unique,
              _edit(_set_index_entry(lambda f, v: f.__setitem__(v[1], f[v[0]]))), source=KRR_SRC),
        _rule(KRR, "epsilon_value", "epsilon", "value", "must be a finite number > 0", _krr_epsilon,
              set_param("epsilon", -1.0), source=KRR_SRC),
        _rule(KRR, "is_output_kv_type", "is_output_kv", "type", "must be a bool", _krr_is_output_kv,
              set_param("is_output_kv", "yes"), source=KRR_SRC),
        *[all_finite(KRR, p, source=KRR_SRC) for p in ("kv", "gamma", "cos", "sin", "k_rope_scale")],
        *[replace(all_finite(KRR, p, source=KRR_SRC), violate=_nan_into(p, **kw)) for p, kw in (
            ("v", dict(version=2)), ("c_kv_scale", dict(ckv_fmt="int8")), ("k_rope_offset", dict(offsets=True)),
            ("c_kv_offset", dict(ckv_fmt="int8", offsets=True)))],
        _rule(KRR, "950_v1_only", "v", "value", "Ascend 950 supports only V1 (v must be None)",
              lambda a: None if a.v is None else "v given", _krr_build(version=2), chips=("950",), source=KRR_SRC),
        _rule(KRR, "a2a3_int8_only", "k_cache", "dtype", "Atlas A2/A3 quantise to int8 only", _chip_a2a3_int8,
              _krr_build(k_fmt="float8_e4m3fn"), dtype=True, chips=_A2A3, source=KRR_SRC),
        _rule(KRR, "a2a3_v1_norm_no_quant", "cache_mode", "value",
              "Atlas A2/A3 V1 do not quantise in Norm mode", _chip_a2a3_v1_norm_quant,
              _krr_build(cache_mode="Norm"), chips=_A2A3, source=KRR_SRC),
        _rule(KRR, "a2a3_v1_symmetric", "k_rope_offset", "value",
              "Atlas A2/A3 V1 quantise symmetrically only (the kernel would ignore the offset)",
              _chip_a2a3_v1_offsets, _krr_build(offsets=True), chips=_A2A3, source=KRR_SRC),
        _rule(KRR, "a2a3_v1_param_shape", "k_rope_scale", "shape", "Atlas A2/A3 V1 do not take [1] quant parameters",
              _chip_a2a3_v1_shape1, _krr_build(param_shape="1"), chips=_A2A3, source=KRR_SRC),
        _rule(KRR, "a2a3_v2_no_broadcast", "k_rope_scale", "shape",
              "Atlas A2/A3 V2 need [N, D] quant parameters (no broadcast)", _chip_a2a3_v2_no_bcast,
              _krr_build(version=2, param_shape="D", dk=64, rope=32), chips=_A2A3, source=KRR_SRC),
        _rule(KRR, "a2a3_v1_dims", "kv", "shape",
              "Atlas A2/A3 V1 (the DeepSeek MLA kernel) need Dv = 512 (RMSNorm) and Dk = 64 (RoPE)",
              _chip_a2a3_v1_dims, lambda args: copy_args(args), chips=_A2A3,
              source="cannmirror/ops-transformer posembedding/kv_rms_norm_rope_cache/op_host/kv_rms_norm_rope_cache_ds_tiling.cpp"),
    ],
    example=lambda rng: kv_rmsnorm_rope_cache_example(rng),
    inplace=("k_cache", "ckv_cache"),
    params=params("kv:array gamma:array cos:array sin:array index:array k_cache:array ckv_cache:array"
                  " k_rope_scale:array? c_kv_scale:array? k_rope_offset:array? c_kv_offset:array? v:array?"
                  " epsilon:float cache_mode:str is_output_kv:bool k_cache_dtype:str? ckv_cache_dtype:str?"),
)


def _krr_reference(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale, c_kv_scale, k_rope_offset,
                   c_kv_offset, v, epsilon, cache_mode, is_output_kv, k_cache_dtype, ckv_cache_dtype,
                   hifloat8_overflow="saturate"):
    return _krr.kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale=k_rope_scale,
                                      c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset, c_kv_offset=c_kv_offset,
                                      v=v, epsilon=epsilon, cache_mode=cache_mode, is_output_kv=is_output_kv,
                                      k_cache_dtype=k_cache_dtype, ckv_cache_dtype=ckv_cache_dtype,
                                      hifloat8_overflow=hifloat8_overflow)


def _krr_normalise(a):
    out = dict(a)
    out["k_cache_dtype"] = _fmt(a, "k")
    out["ckv_cache_dtype"] = _fmt(a, "ckv")
    return out


KRR_CONTRACT.normalise = _krr_normalise

define_operator(KRR, KRR_CONTRACT, outputs=("k_cache", "ckv_cache", "k_rope", "c_kv"), reference=_krr_reference,
                numerics=_chips.krr_numerics,
                doc="KvRmsNormRopeCache V1/V2: RMSNorm + interleave RoPE + static quant + scatter into two caches.")


def kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, k_rope_scale=None, c_kv_scale=None,
                          k_rope_offset=None, c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                          is_output_kv=False, k_cache_dtype=None, ckv_cache_dtype=None, chip=None,
                          backend="reference"):
    """RMSNorm + interleave RoPE + optional static quantisation, scattered into two caches in place
    (torch_npu ``npu_kv_rmsnorm_rope_cache`` and ``npu_kv_rmsnorm_rope_cache_v2``; docs/numerics/cache-writers.md#kv_rmsnorm_rope_cache).

    V1 (``v`` None; N = 1): ``c_kv = RMSNorm(kv[..., :Dv]) * gamma`` -> ckv_cache and
    ``k_rope = RoPE(kv[..., Dv:])`` (the raw input) -> k_cache, with Dv = len(gamma), Dk = cos width.
    V2 (``v`` given; N in {1, 2, 4, 8}): ``r = RMSNorm(kv)``, ``cat(RoPE(r[..., :rope]), r[..., rope:])`` ->
    k_cache, ``v`` -> ckv_cache. RMSNorm: ``gamma * (x / sqrt(mean(x^2) + epsilon))`` in fp32; interleave RoPE:
    ``cat(x[0::2], x[1::2]) * cos + cat(-x[1::2], x[0::2]) * sin`` in fp32.

    Rounding points (from the cannmirror/ops-transformer kernels): a 16-bit cache gets the fp32 result rounded once (RINT) to the
    cache dtype; an 8-bit cache is quantised from the fp32 result - ``y = x * scale (+ offset)`` in fp32, then
    INT8 ``clamp(RINT(y), -128, 127)``, FP8 RINT + saturation, HiFloat8 ties-away and, on the 950 (the only chip
    with HiFloat8 caches), no saturation (beyond the range: +-Inf; docs/numerics/chips.md); V2 RoPEs the
    fp32 RMSNorm output (no rounding in between). ``k_rope`` / ``c_kv`` are the fp32 results rounded to kv's
    dtype (V2 ``c_kv`` = v).

    Parameters (torch_npu names):
      kv:          ``[Bkv, N, Skv, D]`` float16 / bfloat16.
      gamma:       ``[Dv]`` (V1) or ``[D]`` (V2), kv's dtype.
      cos, sin:    ``[Bkv, N, Skv, Dk]`` or ``[Bkv, N, 1, Dk]``, equal shapes, kv's dtype; Dk even.
      index:       int64; Norm ``[Bkv, Skv]`` positions in [-1, Scache); PA / PA_BNSD / PA_NZ ``[Bkv*Skv]`` unique
                   slots; PA_BLK_* ``[Bkv*ceil(Skv/block_size)]`` chunk start slots. -1 skips.
      k_cache, ckv_cache: updated in place. Norm ``[Bkv, N, Scache, D*]``; PA / PA_BNSD / PA_BLK_BNSD
                   ``[block_num, block_size, N, D*]``; PA_NZ / PA_BLK_NZ NZ storage ``[block_num, D*//c, block_size,
                   1, c]`` (N = 1) or ``[block_num, N, D*//c, block_size, c]`` with c = 16 (16-bit) / 32 (8-bit).
                   16-bit caches must have kv's dtype; 8-bit caches are int8, float8_e4m3fn, float8_e5m2 arrays
                   or uint8 buffers named by ``k_cache_dtype`` / ``ckv_cache_dtype``.
      k_rope_scale, c_kv_scale, k_rope_offset, c_kv_offset: float32 ``[N, D*]``, ``[D*]``, ``[1, D*]`` or ``[1]``;
                   a scale is required for (and only allowed with) an 8-bit cache; an offset needs its scale.
      v:           ``[Bkv, N, Skv, Dv]`` kv's dtype, selects V2.
      epsilon:     RMSNorm eps (> 0).
      cache_mode:  "Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ".
      is_output_kv: also return k_rope / c_kv (honoured in PA* modes, and in Norm for V2 with a quantised
                   cache, as documented; otherwise those outputs are None).
      k_cache_dtype, ckv_cache_dtype: format names ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8",
                   "float16", "bfloat16") as torch_npu's ``_v2`` takes them; None = inferred from the array dtype.
    Returns ``(k_cache, ckv_cache, k_rope, c_kv)``.
    """
    args = dict(kv=kv, gamma=gamma, cos=cos, sin=sin, index=index, k_cache=k_cache, ckv_cache=ckv_cache,
                k_rope_scale=k_rope_scale, c_kv_scale=c_kv_scale, k_rope_offset=k_rope_offset,
                c_kv_offset=c_kv_offset, v=v, epsilon=epsilon, cache_mode=cache_mode, is_output_kv=is_output_kv,
                k_cache_dtype=k_cache_dtype, ckv_cache_dtype=ckv_cache_dtype)
    return run(KRR, args, backend, chip=chip)
