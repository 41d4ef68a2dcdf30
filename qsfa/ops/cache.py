"""Public front doors of the cache writers (SPEC.md 3.2-3.5).

Operators (each = one :class:`~qsfa._contract.Contract` holding every documented rule as data, plus the
reference computation in :mod:`qsfa.reference`):

* :func:`scatter_by_slot` - the shared scatter of rows into a paged cache by slot (SPEC.md 3.5);
* :func:`c8_cache_write` - the QSFA C8 writer's quantise + pack + scatter stage (bit-exact, kernel-checked);
* :func:`c8_rmsnorm_rope_cache` - RMSNorm + interleave RoPE + :func:`c8_cache_write` (vllm-ascend's writer);
* :func:`kv_rmsnorm_rope_cache` - torch_npu ``npu_kv_rmsnorm_rope_cache`` / ``_v2`` (SPEC.md 3.3);
* :func:`kv_compress_epilog` - aclnn KvCompressEpilog (SPEC.md 3.4).

Every cache is listed in its contract's ``inplace``; a rejected call writes nothing.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import all_finite, dtype_in, is_array, ndim_in, set_param
from .._contract import Constraint, Contract, copy_args, one_of
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


def _rule(op, cid, param, kind, reason, check, violate, *, dtype=False, chips=None, source=""):
    return Constraint(id=f"{op}.{cid}", param=param, kind=kind, reason=reason, check=check, dtype=dtype,
                      chips=frozenset(chips) if chips else None, violate=violate, source=source)


def _with(**kw):
    """A violate function that overrides some parameters (arrays copied first)."""

    def violate(args):
        out = copy_args(args)
        out.update(kw)
        return out

    return violate


def _edit(fn):
    """A violate function ``fn(args_copy) -> None`` that edits a copy in place."""

    def violate(args):
        out = copy_args(args)
        fn(out)
        return out

    return violate


def _same_dtype(op, param, ref, *, optional=False, source=""):
    """``param`` must have ``ref``'s dtype."""

    def check(a):
        v = a.get(param)
        if v is None:
            return None if optional else "None"
        r = a[ref]
        return None if dtype_name(v) == dtype_name(r) else dtype_name(v)

    def violate(args):
        out = copy_args(args)
        v = out.get(param)
        v = np.zeros((1,), np.float32) if v is None else v
        other = np.float16 if dtype_name(args[ref]) != "float16" else BF16
        out[param] = v.astype(np.float32).astype(other)
        return out

    return _rule(op, f"{param}_dtype_matches_{ref}", param, "dtype", f"must have the same dtype as {ref}",
                 check, violate, dtype=True, source=source)


def _is_bool(v):
    return isinstance(v, (bool, np.bool_))


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_num(v):
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


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
SC_SRC = "SPEC.md 3.5"


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
)


def _sc_reference(cache, rows, slot_mapping):
    return _sc.scatter_by_slot(cache, rows, slot_mapping)


define_operator(SC, SC_CONTRACT, outputs=("cache",), reference=_sc_reference,
                doc="Write rows into a paged cache by slot; -1 skips.")


def scatter_by_slot(cache, rows, slot_mapping, backend="reference"):
    """Write ``rows[t]`` to ``cache[s // block_size, s % block_size]`` for each slot ``s = slot_mapping[t]``.

    cache:        ``[block_num, block_size, *row_shape]`` any dtype, updated in place and returned.
    rows:         ``[T, *row_shape]`` of the cache's dtype.
    slot_mapping: ``[T]`` int32 / int64; ``-1`` skips the token (its destination keeps its bytes); other
                  values must lie in ``[0, block_num * block_size)`` and must not repeat (rejected before
                  any write).
    """
    return run(SC, dict(cache=cache, rows=rows, slot_mapping=slot_mapping), backend)


# ------------------------------------------------------------------------------------------ C8 writers

C8 = "c8_cache_write"
C8R = "c8_rmsnorm_rope_cache"
C8_SRC = "SPEC.md 3.2; vllm-ascend vllm_ascend/attention/sfa_v1.py (custom_kv_rmsnorm_rope, _store_parallel_kv)"
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


def _c8_key_rules(op):
    return [
        _rule(op, "key_dtype_value", "key_dtype", "value",
              f"must be {one_of(_c8.KEY_DTYPES)} (HiFloat8 NoPE: no public writer defines its scale)",
              lambda a: None if a.key_dtype in _c8.KEY_DTYPES else a.key_dtype, set_param("key_dtype", "hifloat8"),
              source=C8_SRC),
        _rule(op, "scale_order_value", "scale_order", "value",
              f"must be {one_of(SCALE_ORDERS)} (SPEC.md 2 OPEN: x / s or x * 127 / amax)",
              lambda a: None if a.scale_order in SCALE_ORDERS else a.scale_order, set_param("scale_order", "bogus"),
              source="SPEC.md 2"),
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
                kv_cache=cache, key_dtype="int8", scale_order="divide")


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
)


def _c8_reference(k_nope, k_rope, slot_mapping, kv_cache, key_dtype, scale_order):
    return _c8.c8_cache_write(k_nope, k_rope, slot_mapping, kv_cache, key_dtype=key_dtype, scale_order=scale_order)


define_operator(C8, C8_CONTRACT, outputs=("kv_cache",), reference=_c8_reference,
                doc="QSFA C8 writer stage 2: per-tile dynamic quant of the NoPE, pack 656/528-byte rows, scatter.")


def c8_cache_write(k_nope, k_rope, slot_mapping, kv_cache, *, key_dtype="int8", scale_order="divide",
                   backend="reference"):
    """Quantise, pack and scatter one packed QSFA row per token (the kernel-checkable C8 writer stage).

    For token t with slot s = slot_mapping[t] (-1: nothing written), row ``kv_cache[s // bs, s % bs, 0]``
    receives: bytes [0, 512) the NoPE quantised per 1x128 tile, then the 64 RoPE values' raw 16-bit bytes
    (rope 64 only), then the 4 tile scales as little-endian fp32 (SPEC.md 3.2). Bytes of other rows are
    untouched.

    key_dtype "int8" (A2/A3): ``s = amax / 127`` (fp32), ``q = clamp(RINT(x / s), -127, 127)``; an all-zero
    tile gives ``s = 0, q = 0`` (SPEC.md 2, OPEN on hardware). "float8_e4m3fn" (950, vllm-ascend's A5 branch
    calls ``npu_dynamic_block_quant(dst_type=float8_e4m3fn)``): ``s = amax / 448``, ``q = E4M3FN(x / s)``
    RINT + saturation. HiFloat8 NoPE is not offered: no public writer says how its scale is computed.

    Parameters:
      k_nope:       ``[T, 512]`` float16 / bfloat16 (already normalised).
      k_rope:       ``[T, 64]`` of k_nope's dtype (already rotated), or None for rope 0 (528-byte rows).
      slot_mapping: ``[T]`` int32 / int64; -1 skips; otherwise unique and < block_num * block_size.
      kv_cache:     ``[block_num, block_size, 1, 656 | 528]`` uint8 / int8 / float8_e4m3fn, updated in place.
      key_dtype:    "int8" (default) or "float8_e4m3fn".
      scale_order:  **OPEN** (SPEC.md 2): "divide" (default, ``x / s``) or "multiply" (``x * fp32(127 / amax)``).
    Returns ``kv_cache``.
    """
    args = dict(k_nope=k_nope, k_rope=k_rope, slot_mapping=slot_mapping, kv_cache=kv_cache, key_dtype=key_dtype,
                scale_order=scale_order)
    return run(C8, args, backend)


def _c8r_example(rng):
    t = 5
    kv = (rng.standard_normal((t, 576)) * 2).astype(BF16)
    gamma = (1 + 0.1 * rng.standard_normal(512)).astype(BF16)
    ang = rng.random((t, 32)) * 6.28
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1).astype(BF16)
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1).astype(BF16)
    cache = np.full((3, 4, 1, 656), 17, np.uint8)
    return dict(kv=kv, gamma=gamma, cos=cos, sin=sin, slot_mapping=np.array([0, 5, -1, 11, 3], np.int64),
                kv_cache=cache, epsilon=1e-6, rope_head_dim=64, key_dtype="int8", scale_order="divide")


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
)


def _c8r_reference(kv, gamma, cos, sin, slot_mapping, kv_cache, epsilon, rope_head_dim, key_dtype, scale_order):
    return _c8.c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slot_mapping, kv_cache, epsilon=epsilon,
                                     rope_head_dim=rope_head_dim, key_dtype=key_dtype, scale_order=scale_order)


define_operator(C8R, C8R_CONTRACT, outputs=("kv_cache",), reference=_c8r_reference,
                doc="QSFA C8 writer: RMSNorm + interleave RoPE + c8_cache_write (vllm-ascend custom_kv_rmsnorm_rope).")


def c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slot_mapping, kv_cache, *, epsilon=1e-6, rope_head_dim=64,
                          key_dtype="int8", scale_order="divide", backend="reference"):
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
      key_dtype, scale_order: as :func:`c8_cache_write`.
    Returns ``kv_cache``.
    """
    args = dict(kv=kv, gamma=gamma, cos=cos, sin=sin, slot_mapping=slot_mapping, kv_cache=kv_cache,
                epsilon=epsilon, rope_head_dim=rope_head_dim, key_dtype=key_dtype, scale_order=scale_order)
    return run(C8R, args, backend)


# --------------------------------------------------------------------------------- kv_compress_epilog

KCE = "kv_compress_epilog"
KCE_SRC = "SPEC.md 3.4; seed 002 (KvCompressEpilog)"


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
        _rule(KCE, "pad_to_value", "pad_to", "value", "must be one of {32, 128} (SPEC.md 3.4 OPEN)",
              lambda a: None if _is_int(a.pad_to) and a.pad_to in (32, 128) else a.pad_to, set_param("pad_to", 64),
              source="SPEC.md 3.4 (OPEN: padding granularity)"),
        _rule(KCE, "fp4_nibble_order_value", "fp4_nibble_order", "value",
              "must be one of {'low_first', 'high_first'} (SPEC.md 1.2 OPEN)",
              lambda a: None if a.fp4_nibble_order in ("low_first", "high_first") else a.fp4_nibble_order,
              set_param("fp4_nibble_order", "bogus"), source="SPEC.md 1.2 (OPEN: FP4 nibble order)"),
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
)


def _kce_reference(cache, x, slot_mapping, quant_group_size, quant_mode, round_scale, x_scale, pad_to,
                   fp4_nibble_order):
    return _kce.kv_compress_epilog(cache, x, slot_mapping, quant_group_size=quant_group_size, quant_mode=quant_mode,
                                   round_scale=round_scale, x_scale=x_scale, pad_to=pad_to,
                                   fp4_nibble_order=fp4_nibble_order)


define_operator(KCE, KCE_CONTRACT, outputs=("cache",), reference=_kce_reference,
                doc="KvCompressEpilog: group-quantise bf16 rows (FP8 / HiF8 + FP4) and scatter them by slot.")


def kv_compress_epilog(cache, x, slot_mapping, *, quant_group_size=64, quant_mode=1, round_scale=True, x_scale=1.0,
                       pad_to=32, fp4_nibble_order="low_first", backend="reference"):
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
      pad_to:           **OPEN** (SPEC.md 3.4): row padding granularity of modes 0 and 2, default 32 (tiling
                        code and docs); 128 per an older comment. Not an aclnn argument.
      fp4_nibble_order: **OPEN** (SPEC.md 1.2): "low_first" (default: element 2i in the low nibble) or
                        "high_first". Not an aclnn argument.
    Returns ``cache``.
    """
    args = dict(cache=cache, x=x, slot_mapping=slot_mapping, quant_group_size=quant_group_size, quant_mode=quant_mode,
                round_scale=round_scale, x_scale=x_scale, pad_to=pad_to, fp4_nibble_order=fp4_nibble_order)
    return run(KCE, args, backend)
