"""Front door of ``scatter_pa_kv_cache_with_k_scale`` (Ascend 950; listed in :mod:`qsfa.ops.cache`).

``torch.ops.cann_ops_transformer.scatter_pa_kv_cache_with_k_scale``: FP8 K / V rows and their per-head fp32 K scales
copied into BNBD paged caches by slot. Reference :mod:`qsfa.reference.k_scale_cache`; numerics in
``docs/numerics/cache-writers.md#scatter_pa_kv_cache_with_k_scale``. Every cache is in the contract's ``inplace``; a
rejected call writes nothing.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import dtype_in, edit_params, rule, set_param
from .._contract import Contract, copy_args, params
from .._dispatch import define_operator, run
from ..reference import k_scale_cache as _ks

__all__ = ["scatter_pa_kv_cache_with_k_scale", "SPKS", "SPKS_CONTRACT"]

SPKS = "scatter_pa_kv_cache_with_k_scale"
SPKS_SRC = ("cannmirror/ops-transformer@7904813 attention/scatter_pa_kv_cache_with_k_scale/ (op_api/"
            "aclnn_scatter_pa_kv_cache_with_k_scale.cpp, op_kernel/arch35/scatter_pa_kv_cache_with_k_scale_simt.h, "
            "docs/scatter_pa_kv_cache_with_k_scale.md); docs/numerics/cache-writers.md#scatter_pa_kv_cache_with_k_scale")
FP8 = ("float8_e4m3fn", "float8_e5m2")


def _example(rng):
    t, n, dk, dv, nb, bs = 4, 2, 16, 8, 3, 4
    key = rng.integers(0, 256, (t, n, dk), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    value = rng.integers(0, 256, (t, n, dv), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    kc = np.full((nb, n, bs, dk), 0x11, np.uint8).view(ml_dtypes.float8_e4m3fn)
    vc = np.full((nb, n, bs, dv), 0x22, np.uint8).view(ml_dtypes.float8_e4m3fn)
    return dict(key=key, value=value, key_cache=kc, value_cache=vc, slot_mapping=np.array([5, -1, 0, 11], np.int32),
                key_scale=rng.random((t, n)).astype(np.float32), key_scale_cache=np.zeros((nb, n, bs, 1), np.float32),
                cache_layout="BNBD")


def _same(p, ref, what):
    return rule(SPKS, f"{p}_dtype_matches_{ref}", p, "dtype", f"must have {ref}'s dtype ({what})",
                lambda a: None if dtype_name(a[p]) == dtype_name(a[ref]) else dtype_name(a[p]),
                lambda args: {**copy_args(args), p: copy_args(args)[p].view(np.uint8)},
                dtype=True, source=SPKS_SRC)


def _ndim(p, n):
    return rule(SPKS, f"{p}_ndim", p, "dim", f"must have {n} dimensions", lambda a: None if a[p].ndim == n else a[p].ndim,
                edit_params(lambda o: o.update({p: o[p][None]})), source=SPKS_SRC)


def _shape(cid, p, reason, want, violate):
    return rule(SPKS, cid, p, "shape", reason,
                lambda a: None if tuple(a[p].shape) == tuple(want(a)) else tuple(a[p].shape),
                edit_params(violate), source=SPKS_SRC)


def _unique(a):
    nb, _, bs, _ = a.key_cache.shape
    s = np.asarray(a.slot_mapping).reshape(-1).astype(np.int64)
    v = s[_ks.valid_slots(s, nb * bs)]
    u, c = np.unique(v, return_counts=True)
    return None if (c <= 1).all() else f"slot {int(u[np.argmax(c > 1)])} repeated"


def _break_unique(o):
    s = o["slot_mapping"].copy()
    s[-1] = s[0]
    o["slot_mapping"] = s


SPKS_CONTRACT = Contract(
    op=SPKS,
    constraints=[
        dtype_in(SPKS, "key", FP8, source=SPKS_SRC),
        _same("value", "key", "key and value share one FP8 format"),
        _same("key_cache", "key", "the cache holds the key's codes"),
        _same("value_cache", "key", "the cache holds the value's codes"),
        dtype_in(SPKS, "slot_mapping", ("int32", "int64"), source=SPKS_SRC),
        dtype_in(SPKS, "key_scale", ("float32",), source=SPKS_SRC),
        dtype_in(SPKS, "key_scale_cache", ("float32",), source=SPKS_SRC),
        rule(SPKS, "cache_layout_value", "cache_layout", "value", "must be 'BNBD' (the only layout)",
             lambda a: None if a.cache_layout == "BNBD" else a.cache_layout, set_param("cache_layout", "BSND"),
             source=SPKS_SRC),
        _ndim("key", 3), _ndim("value", 3), _ndim("slot_mapping", 1), _ndim("key_scale", 2),
        _ndim("key_cache", 4), _ndim("value_cache", 4), _ndim("key_scale_cache", 4),
        rule(SPKS, "head_size", "key", "shape", "key and value head sizes must not be 0",
             lambda a: None if a.key.shape[-1] and a.value.shape[-1] else tuple(a.key.shape),
             edit_params(lambda o: o.update(key=o["key"][..., :0], key_cache=o["key_cache"][..., :0])), source=SPKS_SRC),
        _shape("value_tokens_heads", "value", "must be [num_tokens, num_head, v_head_size] with key's first two",
               lambda a: a.key.shape[:2] + a.value.shape[2:], lambda o: o.update(value=o["value"][:, :1])),
        _shape("slot_mapping_shape", "slot_mapping", "must be [num_tokens]", lambda a: a.key.shape[:1],
               lambda o: o.update(slot_mapping=o["slot_mapping"][:-1])),
        _shape("key_scale_shape", "key_scale", "must be [num_tokens, num_head]", lambda a: a.key.shape[:2],
               lambda o: o.update(key_scale=o["key_scale"][:, :1])),
        _shape("key_cache_shape", "key_cache", "must be [num_blocks, num_head, block_size, k_head_size]",
               lambda a: (a.key_cache.shape[0], a.key.shape[1], a.key_cache.shape[2], a.key.shape[2]),
               lambda o: o.update(key_cache=o["key_cache"][..., :-1])),
        _shape("value_cache_shape", "value_cache", "must be [num_blocks, num_head, block_size, v_head_size] with "
               "key_cache's blocks", lambda a: a.key_cache.shape[:3] + a.value.shape[2:],
               lambda o: o.update(value_cache=o["value_cache"][:, :, :-1])),
        _shape("key_scale_cache_shape", "key_scale_cache", "must be [num_blocks, num_head, block_size, 1]",
               lambda a: a.key_cache.shape[:3] + (1,), lambda o: o.update(key_scale_cache=o["key_scale_cache"][:-1])),
        rule(SPKS, "slot_mapping_unique", "slot_mapping", "value",
             "slots inside the cache must not repeat (concurrent writes; slots outside [0, num_blocks * block_size) "
             "are skipped)", _unique, edit_params(_break_unique), source=SPKS_SRC),
        rule(SPKS, "a2a3_unsupported", "key_cache", "value", f"{SPKS} runs on Ascend 950 only (its aclnn page)",
             lambda a: "Atlas A2/A3", lambda args: copy_args(args), chips=("A2", "A3"), source=SPKS_SRC),
    ],
    example=_example,
    inplace=("key_cache", "value_cache", "key_scale_cache"),
    params=params("key:array value:array key_cache:array value_cache:array slot_mapping:array key_scale:array"
                  " key_scale_cache:array cache_layout:str"),
)


def _reference(key, value, key_cache, value_cache, slot_mapping, key_scale, key_scale_cache, cache_layout):
    return _ks.scatter_pa_kv_cache_with_k_scale(key, value, key_cache, value_cache, slot_mapping, key_scale,
                                                key_scale_cache, cache_layout=cache_layout)


define_operator(SPKS, SPKS_CONTRACT, outputs=("key_cache", "value_cache", "key_scale_cache"), reference=_reference,
                doc="FP8 K / V and per-head fp32 K scales scattered by slot into BNBD caches (Ascend 950).")


def scatter_pa_kv_cache_with_k_scale(key, value, key_cache, value_cache, slot_mapping, key_scale, key_scale_cache, *,
                                     cache_layout="BNBD", chip=None, backend="reference"):
    """``cann_ops_transformer.scatter_pa_kv_cache_with_k_scale`` (Ascend 950): copy ``key [T, N, Dk]`` /
    ``value [T, N, Dv]`` (float8_e4m3fn or float8_e5m2, one format) and ``key_scale [T, N]`` (float32) into
    ``key_cache [nb, N, bs, Dk]`` / ``value_cache [nb, N, bs, Dv]`` / ``key_scale_cache [nb, N, bs, 1]`` at
    ``[slot // bs, :, slot % bs]``, in place; slots outside ``[0, nb * bs)`` skip their token (-1 included), slots
    inside must be unique. slot_mapping int32 / int64 ``[T]``; any strides. Returns the three caches.
    Numerics (a byte copy): docs/numerics/cache-writers.md#scatter_pa_kv_cache_with_k_scale.
    """
    args = dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
                key_scale=key_scale, key_scale_cache=key_scale_cache, cache_layout=cache_layout)
    return run(SPKS, args, backend, chip=chip)
