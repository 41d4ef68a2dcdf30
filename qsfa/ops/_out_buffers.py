"""``attention_out=``: a caller's buffer (for example an ``np.memmap``) that the attention operators write their
output into, row chunk by row chunk, so a long prefill's golden streams to disk (issue 15).

The buffer is checked like any in-place buffer before anything runs (the rules below join the operator's
contract; ``tests/test_contracts.py`` breaks each one): a NumPy array of exactly the output's shape and dtype
(the query dtype; float64 with ``precision="exact"``), C-contiguous, writable, sharing no memory with another
argument. The reference backend writes it in place and returns it as the first output; the device backends
produce their own tensors, so there it is rejected with a clear error.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .._buffers import shares_memory
from .._errors import InvalidArgument, Raw

__all__ = ["attention_out_rules", "expected_out", "reject_on_device"]

NAME = "attention_out"
_SOURCE = "qsfa: attention_out= buffers (docs/architecture.md, in-place buffers)"


def expected_out(a, dv_of: Callable) -> tuple[tuple, np.dtype]:
    """(shape, dtype) of the attention output for the arguments ``a``."""
    q = a["query"]
    exact = a.get("precision", "faithful") == "exact"
    return tuple(q.shape[:-1]) + (int(dv_of(a)),), np.dtype(np.float64) if exact else np.dtype(q.dtype)


def attention_out_rules(n, dv_of: Callable) -> list:
    """The ``attention_out`` constraints of an attention contract (``n``: its ``Names``; ``dv_of(args)``: the
    output's last dimension)."""
    from ._attention_rules import edit, rule

    def buf(a):
        v = a.get(NAME)
        return v if isinstance(v, np.ndarray) else None

    def set_out(make):
        def change(a):
            shape, dt = expected_out(a, dv_of)
            a[NAME] = make(a, shape, dt)

        return edit(n, change)

    def check_array(a):
        v = a.get(NAME)
        return None if v is None or isinstance(v, np.ndarray) else Raw(type(v).__name__)

    def check_shape(a):
        v = buf(a)
        return None if v is None or tuple(v.shape) == expected_out(a, dv_of)[0] else tuple(v.shape)

    def check_dtype(a):
        v = buf(a)
        return None if v is None or v.dtype == expected_out(a, dv_of)[1] else str(v.dtype)

    def check_contiguous(a):
        v = buf(a)
        return None if v is None or v.flags.c_contiguous else Raw(f"strides {tuple(v.strides)}")

    def check_writable(a):
        v = buf(a)
        return None if v is None or v.flags.writeable else Raw("a read-only array")

    def check_alias(a):
        v = buf(a)
        if v is None or v.size == 0:
            return None
        for k, w in a.items():
            if k != NAME and isinstance(w, np.ndarray) and w.size and shares_memory(v, w):
                return Raw(f"shares memory with {k}")
        return None

    def readonly(a, shape, dt):
        v = np.zeros(shape, dt)
        v.flags.writeable = False
        return v

    def strided(a, shape, dt):
        return np.zeros(shape[:-1] + (2 * shape[-1],), dt)[..., ::2]

    def aliased(a, shape, dt):
        q = a["query"]
        size = int(np.prod(shape))
        whole = np.zeros(max(q.size, size) if dt == q.dtype else 1, q.dtype)
        if dt != q.dtype:  # pragma: no cover - the examples are faithful (query dtype)
            raise AssertionError("aliasing example needs the query dtype")
        a["query"] = whole[:q.size].reshape(q.shape)
        a["query"][...] = q
        return whole[:size].reshape(shape)

    def r(cid, kind, reason, check, make, dtype=False):
        c = rule(n, f"{NAME}_{cid}", NAME, kind, reason, check, set_out(make), dtype=dtype, source=_SOURCE)
        # a read-only or aliased buffer does not survive the copies invalid-argument strategies make (as the
        # generic in-place rules of qsfa._buffers): tests/test_contracts.py breaks them, strategies do not draw them
        return dataclasses.replace(c, drawn=False) if cid in ("writable", "aliasing") else c

    return [
        r("array", "type", "must be a NumPy array (an np.memmap included) or None", check_array,
          lambda a, s, d: [0.0], dtype=True),
        r("shape", "shape", "must have the output's shape (query's with the last dimension the value width)",
          check_shape, lambda a, s, d: np.zeros(s[:-1] + (s[-1] + 1,), d)),
        r("dtype", "dtype", "must have the output's dtype (the query dtype; float64 with precision='exact')",
          check_dtype, lambda a, s, d: np.zeros(s, np.float32), dtype=True),
        r("contiguous", "layout", "must be C-contiguous (it is written row chunk by row chunk)", check_contiguous,
          strided),
        r("writable", "value", "an output buffer must be writable", check_writable, readonly),
        r("aliasing", "value", "an output buffer must not share memory with another argument", check_alias,
          aliased),
    ]


def reject_on_device(backend: str, attention_out) -> None:
    """attention_out= is a reference-backend feature: a device backend returns its own tensors."""
    if attention_out is None:
        return
    from .._dispatch import get_backend

    name = get_backend(backend).name
    if name != "reference":
        raise InvalidArgument("value", NAME, Raw("an array"),
                              f"attention_out= buffers are written by the reference backend only, not by {name!r} "
                              "(a device backend returns its own tensor: copy it out)")
