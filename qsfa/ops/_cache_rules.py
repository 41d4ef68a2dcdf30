"""Constraint helpers shared by the cache-writer contracts (docs/numerics/cache-writers.md).

The slot-mapping rules (``_slot_rules``) and the dtype-agreement check used by :mod:`qsfa.ops.scatter`,
:mod:`qsfa.ops.c8_cache`, :mod:`qsfa.ops.kv_compress_epilog`, :mod:`qsfa.ops.kv_rmsnorm_rope_cache` and
:mod:`qsfa.ops.kv_compress_epilog_vllm`. Generic builders live in :mod:`qsfa._checks`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._checks import edit_params, is_bool, is_int, is_num, rule, set_params
from .._contract import copy_args


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
