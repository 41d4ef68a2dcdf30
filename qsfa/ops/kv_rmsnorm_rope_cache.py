"""Front door of ``kv_rmsnorm_rope_cache``: RMSNorm + RoPE + optional quantisation into the K / CKV caches
(docs/numerics/cache-writers.md#kv_rmsnorm_rope_cache).

Contract (every cache mode, format and chip rule a constraint), the example builder
(:func:`kv_rmsnorm_rope_cache_example`) and the front door; the computation is
:mod:`qsfa.reference.kv_rmsnorm_rope_cache`, the tests tests/test_kv_rmsnorm_rope_cache.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import all_finite, dtype_in, is_array, ndim_in, set_param
from .._contract import Contract, copy_args, one_of, params
from .. import chips as _chips
from .._dispatch import define_operator, run
from ..reference import kv_rmsnorm_rope_cache as _krr
from ..reference.packing import nz_columns
from ._cache_rules import _edit, _is_bool, _is_num, _rule, _same_dtype, BF16, FLOAT16_NAMES

__all__ = [
    "kv_rmsnorm_rope_cache",
    "kv_rmsnorm_rope_cache_example",
]


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
                  " epsilon:float32 cache_mode:str is_output_kv:bool k_cache_dtype:str? ckv_cache_dtype:str?"),
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
