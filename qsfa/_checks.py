"""Builders for the constraints that recur across operators (dtype sets, ranks, value sets, finiteness).

Each builder returns a :class:`~qsfa._contract.Constraint` with a ``violate`` function that breaks a
valid argument set in the most direct way, so operator contracts stay short and every rule stays
testable. Operator-specific rules are written as plain ``Constraint(...)`` in the operator's module.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ._arrays import dtype_name, numpy_dtype
from ._contract import Constraint, copy_args, one_of
from ._errors import Raw

__all__ = [
    "rule", "dtype_in", "ndim_in", "value_in", "all_finite", "is_array", "bad_dtype_for", "set_param", "set_params",
    "edit_params", "is_int", "is_bool", "is_num",
]

# Dtypes tried, in order, when a violate function needs "some dtype that is not allowed".
_DTYPE_CANDIDATES = ("float64", "int16", "float32", "float16", "int32", "uint8", "int64", "int8")


def bad_dtype_for(allowed: Iterable[str]) -> str:
    allowed = set(allowed)
    for d in _DTYPE_CANDIDATES:
        if d not in allowed:
            return d
    raise RuntimeError("no disallowed dtype candidate")


def rule(op: str, cid: str, param: str, kind: str, reason: str, check, violate, *, dtype: bool = False,
         chips=None, source: str = "") -> Constraint:
    """A :class:`Constraint` with id ``"<op>.<cid>"`` (the long form, for operator-specific rules)."""
    return Constraint(id=f"{op}.{cid}", param=param, kind=kind, reason=reason, check=check, dtype=dtype,
                      chips=frozenset(chips) if chips else None, violate=violate, source=source)


def set_params(**values):
    """A violate function that overrides some parameters (arrays of the base are copied first)."""

    def violate(args):
        out = copy_args(args)
        out.update(values)
        return out

    return violate


def set_param(name: str, value: Any):
    """A violate function that sets one parameter to a fixed value."""
    return set_params(**{name: value})


def edit_params(fn):
    """A violate function ``fn(args_copy) -> None`` that edits a copy of the base in place."""

    def violate(args):
        out = copy_args(args)
        fn(out)
        return out

    return violate


def is_bool(v) -> bool:
    return isinstance(v, (bool, np.bool_))


def is_int(v) -> bool:
    """A Python or NumPy integer that is not a bool."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_num(v) -> bool:
    """A Python or NumPy real number that is not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _recast(a: np.ndarray, dt: str) -> np.ndarray:
    return np.zeros(a.shape, dtype=numpy_dtype(dt)) if a.size else a.astype(numpy_dtype(dt))


def is_array(op: str, param: str, *, optional: bool = False, source: str = "") -> Constraint:
    """The parameter must be an array (NumPy or torch), not a list or scalar."""

    def check(a):
        v = a.get(param)
        if v is None:
            return None if optional else "None"
        return None if isinstance(v, np.ndarray) else type(v).__name__

    return Constraint(
        id=f"{op}.{param}_is_array", param=param, kind="type",
        reason="must be a NumPy array or torch tensor" + (" (or None)" if optional else ""),
        check=check, dtype=True, violate=set_param(param, "not an array"), source=source,
    )


def dtype_in(op: str, param: str, allowed: Iterable[str], *, optional: bool = False, source: str = "",
             cid: str | None = None) -> Constraint:
    allowed = tuple(allowed)

    def check(a):
        v = a.get(param)
        if v is None:
            return None
        name = dtype_name(v)
        return None if name in allowed else name

    def violate(args):
        out = copy_args(args)
        v = out.get(param)
        if v is None:
            v = np.zeros((1,), np.float32)
        out[param] = _recast(np.asarray(v), bad_dtype_for(allowed))
        return out

    return Constraint(
        id=cid or f"{op}.{param}_dtype", param=param, kind="dtype",
        reason=f"must be {one_of(allowed)}", check=check, dtype=True, violate=violate, source=source,
    )


def ndim_in(op: str, param: str, allowed: Iterable[int], *, source: str = "", cid: str | None = None) -> Constraint:
    allowed = tuple(allowed)

    def check(a):
        v = a.get(param)
        if v is None:
            return None
        return None if v.ndim in allowed else v.ndim

    def violate(args):
        out = copy_args(args)
        v = out[param]
        n = max(allowed) + 1
        while v.ndim < n:
            v = v[None]
        out[param] = np.ascontiguousarray(v)
        return out

    return Constraint(
        id=cid or f"{op}.{param}_ndim", param=param, kind="dim",
        reason=f"number of dimensions must be {one_of(allowed)}", check=check, violate=violate, source=source,
    )


def value_in(op: str, param: str, allowed: Iterable, *, bad: Any = None, source: str = "",
             cid: str | None = None, chips=None) -> Constraint:
    allowed = tuple(allowed)

    def check(a):
        v = a.get(param)
        return None if v in allowed else ("None" if v is None else v)

    if bad is None:
        if all(isinstance(x, str) for x in allowed):
            bad = "bogus"
        else:
            bad = max(x for x in allowed if not isinstance(x, str)) + 1
    return Constraint(
        id=cid or f"{op}.{param}_value", param=param, kind="value",
        reason=f"must be {one_of(allowed)}", check=check, violate=set_param(param, bad), source=source,
        chips=frozenset(chips) if chips else None,
    )


#: exponent field of the 16-bit floats (all ones: inf or nan)
_EXP_MASK16 = {"bfloat16": 0x7F80, "float16": 0x7C00}


def _any_all_ones_exponent16(v: np.ndarray, mask: int) -> bool:
    """Whether a 16-bit float array holds an inf or nan: ``(bits & 0x7FFF) >= mask`` (the exponent field, just
    below the sign bit, is all ones) for some element. A C-contiguous array is scanned in cache-sized pieces with
    one reused buffer (no whole-array temporaries: issue 15, the C8 writers validate megabytes per call)."""
    if not v.flags.c_contiguous:
        return bool(((v.view(np.uint16) & np.uint16(mask)) == mask).any())
    bits = v.reshape(-1).view(np.uint16)
    step = 1 << 16
    buf = np.empty(min(bits.size, step), np.uint16)
    for s0 in range(0, bits.size, step):
        part = bits[s0:s0 + step]
        b = buf[:part.size]
        np.bitwise_and(part, np.uint16(0x7FFF), out=b)
        if b.max() >= mask:
            return True
    return False


def all_finite(op: str, param: str, *, source: str = "", cid: str | None = None) -> Constraint:
    """No inf/nan anywhere in a floating-point array (many Ascend ops forbid them)."""

    def check(a):
        v = a.get(param)
        if v is None or v.dtype.kind not in "fV":  # ml_dtypes' float types have kind "V"
            return None
        mask = _EXP_MASK16.get(dtype_name(v))
        if mask is not None and v.size:  # 16-bit floats: an all-ones exponent field, tested on the bits
            if not _any_all_ones_exponent16(v, mask):
                return None
        f = v.astype(np.float32)
        bad = ~np.isfinite(f)
        if not bad.any():
            return None
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        return Raw(f"{f[idx]} at index {idx}")

    def violate(args):
        out = copy_args(args)
        v = out[param].copy()
        v.reshape(-1)[0] = np.nan
        out[param] = v
        return out

    return Constraint(
        id=cid or f"{op}.{param}_finite", param=param, kind="value",
        reason="must not contain inf or nan", check=check, violate=violate, source=source,
    )
