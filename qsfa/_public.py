"""The argument rules of the public helpers that are not operators (``qsfa.formats``' scale rules and format
queries, ``qsfa.layouts``' byte-layout helpers, ``qsfa.compare``), so they refuse a bad argument the way the
operators do: ``Invalid <kind> for <param>, actual: <value>, reason: <why>.`` (InvalidArgument / InvalidDtype),
never a ZeroDivisionError, KeyError or reshape error from inside NumPy (issue 27).

:func:`checked` wraps a helper with declared parameter types - the operators' :class:`~qsfa._contract.Param`
types plus ``values`` (anything ``np.asarray`` turns into a numeric array: an array, a tensor on the CPU, a list
or a number; a masked array, structured / object / string dtypes refused as for the operators) - and value rules
``name=(ok(value, arguments) -> bool, reason)`` checked in order after the types (a None value is left to the
helper: optional parameters). The reference functions stay bare (the
oracle's pure math); the public names wrap them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import numpy as np

from ._contract import Param, array_kind_problem
from ._errors import InvalidArgument, InvalidDtype, Raw

__all__ = ["checked", "positive_int", "nonnegative_int", "one_of_values"]


def _values_problem(v):
    """Why ``v`` cannot be read as a numeric array, or None."""
    from ._arrays import is_torch

    if is_torch(v):
        return None if str(v.layout) == "torch.strided" else Raw(f"a {str(v.layout).replace('torch.', '')} tensor")
    if v is None:
        return Raw("None")
    if isinstance(v, (str, bytes)):
        return Raw(f"{v!r} ({type(v).__name__})")
    if isinstance(v, np.ndarray):
        why = array_kind_problem(v)
        return None if why is None else Raw(why)
    try:
        a = np.asarray(v)
    except (ValueError, TypeError, RuntimeError) as e:
        return Raw(f"{type(v).__name__} ({type(e).__name__}: {str(e)[:60]})")
    why = array_kind_problem(a)
    return None if why is None else Raw(f"{type(v).__name__} giving an {why}")


def positive_int(v, a=None) -> bool:
    return v >= 1


def nonnegative_int(v, a=None) -> bool:
    return v >= 0


def one_of_values(values) -> Callable:
    values = tuple(values)
    return lambda v, a=None: v in values


def checked(spec: str, **rules):
    """Decorator: check the parameters named in ``spec`` (``"x:values group:int rounding:str?"``) and then the
    value ``rules`` (``group=(positive_int, "must be a positive integer")``) before calling the helper. NumPy
    numbers passed for ``int`` / ``float`` parameters are taken as the Python numbers of their value."""
    decl = {}
    for item in spec.split():
        name, _, t = item.partition(":")
        opt = t.endswith("?")
        t = t.rstrip("?")
        decl[name] = (t, opt) if t == "values" else Param(name, t, opt)

    def deco(fn):
        sig = inspect.signature(fn)
        missing = (set(decl) | set(rules)) - set(sig.parameters)
        if missing:
            raise RuntimeError(f"checked({fn.__name__}): no parameters {sorted(missing)}")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:
                raise InvalidArgument("value", "arguments", Raw(f"the arguments of {fn.__name__}"), str(e)) from None
            bound.apply_defaults()
            a = bound.arguments
            for name, p in decl.items():
                v = a[name]
                if isinstance(p, tuple):  # "values"
                    if v is None and p[1]:
                        continue
                    bad = _values_problem(v)
                    if bad is not None:
                        raise InvalidDtype("type", name, bad, "must be a numeric array, tensor, list or number"
                                           + (" or None" if p[1] else ""))
                    continue
                if p.type == "int" and isinstance(v, np.integer):
                    v = a[name] = int(v)
                elif p.type in ("float", "float32") and isinstance(v, np.floating):
                    v = a[name] = float(v)
                bad = p.offending(v)
                if bad is not None:
                    raise InvalidDtype("type", name, bad, p.reason)
            for name, (ok, reason) in rules.items():
                v = a[name]
                if v is not None and not ok(v, a):
                    raise InvalidArgument("value", name, v, reason)
            return fn(*bound.args, **bound.kwargs)

        return wrapper

    return deco
