"""``attention_out=``, ``softmax_max_out=``, ``softmax_sum_out=``: a caller's buffers (for example ``np.memmap``)
that the attention operators write their outputs into, row chunk by row chunk, so a long prefill's golden streams
to disk and no output exists in memory as a whole (issue 15).

Each buffer is checked like any in-place buffer before anything runs (the rules below join the operator's
contract; ``tests/test_contracts.py`` breaks each one): a NumPy array of exactly the output's shape and dtype,
C-contiguous, writable, sharing no memory with another argument (the other output buffers included).
``attention_out``: the query dtype (float64 with ``precision="exact"``), ``query.shape[:-1] + (dv,)``.
``softmax_max_out`` / ``softmax_sum_out``: float32 (float64 exact), ``[B, 1, Q_S, Q_N]`` (BSND) /
``[1, Q_T, Q_N]`` (TND), and only with ``return_softmax_lse=True`` (without it there is nothing to write).
The reference backend writes them in place and returns them as the outputs; the device backends produce their
own tensors, so there a buffer is rejected with a clear error (the V3.2 doors, :func:`reject_on_device`).

The DeepSeek-V4 shared-KV doors (qsfa/ops/sharedkv.py) take ``attention_out`` alone (their LSE is one small
``softmax_lse``): the query parameter is ``q``, the output dtype q's (bfloat16 for quant_sparse_flash_mla's HiFloat8
codes). There the npu backend copies the device's result into the buffer after the call (qsfa/npu/mapping.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .._buffers import shares_memory
from .._errors import InvalidArgument, Raw

__all__ = ["attention_out_rules", "lse_out_rules", "expected_out", "expected_lse", "reject_on_device",
           "OUT_BUFFERS"]

NAME = "attention_out"
LSE_NAMES = ("softmax_max_out", "softmax_sum_out")
#: every output-buffer parameter, in the order of the outputs they receive
OUT_BUFFERS = (NAME,) + LSE_NAMES
_SOURCE = "qsfa: attention_out= buffers (docs/architecture.md, in-place buffers)"


def expected_out(a, dv_of: Callable, query: str = "query", dtype_of: Callable | None = None) -> tuple[tuple, np.dtype]:
    """(shape, dtype) of the attention output for the arguments ``a`` (``query``: the query parameter's name;
    ``dtype_of(a)``: the faithful output dtype when it is not the query's, e.g. bfloat16 for HiFloat8 codes)."""
    q = a[query]
    exact = a.get("precision", "faithful") == "exact"
    faithful = np.dtype(q.dtype) if dtype_of is None else np.dtype(dtype_of(a))
    return tuple(q.shape[:-1]) + (int(dv_of(a)),), np.dtype(np.float64) if exact else faithful


def expected_lse(a) -> tuple[tuple, np.dtype]:
    """(shape, dtype) of ``softmax_max`` / ``softmax_sum`` for the arguments ``a`` (return_softmax_lse=True)."""
    q = a["query"]
    exact = a.get("precision", "faithful") == "exact"
    lead, heads = tuple(q.shape[:-2]), tuple(q.shape[-2:-1])
    shape = lead[:1] + (1,) + lead[1:] + heads if a.get("layout_query") == "BSND" else (1,) + lead + heads
    return tuple(int(x) for x in shape), np.dtype(np.float64) if exact else np.dtype(np.float32)


def _aliased_with(query: str):
    def make(a, shape, dt):
        """A buffer of ``shape`` / ``dt`` whose bytes overlap the query's (the query is moved into a shared
        buffer)."""
        q = a[query]
        size = int(np.prod(shape)) * dt.itemsize
        whole = np.zeros(max(q.nbytes, size), np.uint8)
        a[query] = whole[:q.nbytes].view(q.dtype).reshape(q.shape)
        a[query][...] = q
        return whole[:size].view(dt).reshape(shape)

    return make


_aliased_with_query = _aliased_with("query")


def _buffer_rules(n, name: str, expected: Callable, what: tuple, extra=(), before=None,
                  aliased=_aliased_with_query) -> list:
    """The type / shape / dtype / layout / writable / aliasing rules of output buffer ``name``; ``expected(a)``
    -> (shape, dtype); ``before(a)`` prepares a violating example (e.g. return_softmax_lse=True)."""
    from ._attention_rules import edit, rule

    def buf(a):
        v = a.get(name)
        return v if isinstance(v, np.ndarray) else None

    def set_out(make):
        def change(a):
            if before is not None:
                before(a)
            shape, dt = expected(a)
            a[name] = make(a, shape, dt)

        return edit(n, change)

    def check_array(a):
        v = a.get(name)
        return None if v is None or isinstance(v, np.ndarray) else Raw(type(v).__name__)

    def check_shape(a):
        v = buf(a)
        return None if v is None or tuple(v.shape) == expected(a)[0] else tuple(v.shape)

    def check_dtype(a):
        v = buf(a)
        return None if v is None or v.dtype == expected(a)[1] else str(v.dtype)

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
            if k != name and isinstance(w, np.ndarray) and w.size and shares_memory(v, w):
                return Raw(f"shares memory with {k}")
        return None

    def readonly(a, shape, dt):
        v = np.zeros(shape, dt)
        v.flags.writeable = False
        return v

    def strided(a, shape, dt):
        return np.zeros(shape[:-1] + (2 * shape[-1],), dt)[..., ::2]

    def r(cid, kind, reason, check, make, dtype=False):
        c = rule(n, f"{name}_{cid}", name, kind, reason, check, set_out(make), dtype=dtype, source=_SOURCE)
        # a read-only or aliased buffer does not survive the copies invalid-argument strategies make (as the
        # generic in-place rules of qsfa._buffers): tests/test_contracts.py breaks them, strategies do not draw them
        return dataclasses.replace(c, drawn=False) if cid in ("writable", "aliasing") else c

    return [
        r("array", "type", "must be a NumPy array (an np.memmap included) or None", check_array,
          lambda a, s, d: [0.0], dtype=True),
        *[r(*e) for e in extra],
        r("shape", "shape", f"must have the output's shape ({what[0]})", check_shape,
          lambda a, s, d: np.zeros(s[:-1] + (s[-1] + 1,), d)),
        r("dtype", "dtype", f"must have the output's dtype ({what[1]})", check_dtype,
          lambda a, s, d: np.zeros(s, np.float16), dtype=True),
        r("contiguous", "layout", "must be C-contiguous (it is written row chunk by row chunk)", check_contiguous,
          strided),
        r("writable", "value", "an output buffer must be writable", check_writable, readonly),
        r("aliasing", "value", "an output buffer must not share memory with another argument", check_alias,
          aliased),
    ]


def lse_out_rules(n) -> list:
    """The ``softmax_max_out`` / ``softmax_sum_out`` constraints of an attention contract (``n``: its ``Names``)."""

    def want_lse(a):
        a["return_softmax_lse"] = True

    out = []
    for name in LSE_NAMES:
        def needs_lse(a, name=name):
            return None if a.get(name) is None or a.get("return_softmax_lse") is True else Raw("a buffer")

        def no_lse(a, shape, dt):
            a["return_softmax_lse"] = False
            return np.zeros(shape, dt)

        extra = [("requires_lse", "value", "is written only with return_softmax_lse=True (pass None, or ask for "
                  "the softmax statistics)", needs_lse, no_lse)]
        out += _buffer_rules(n, name, expected_lse, ("[B, 1, Q_S, Q_N] for BSND, [1, Q_T, Q_N] for TND",
                                                     "float32; float64 with precision='exact'"),
                             extra=extra, before=want_lse)
    return out


def attention_out_rules(n, dv_of: Callable, query: str = "query", dtype_of: Callable | None = None,
                        dtype_what: str = "the query dtype") -> list:
    """The ``attention_out`` constraints of an attention contract (``n``: its ``Names``; ``dv_of(args)``: the
    output's last dimension; ``query``: the query parameter's name; ``dtype_of(args)``: the faithful output dtype
    when it is not the query's, described by ``dtype_what``)."""
    return _buffer_rules(n, NAME, lambda a: expected_out(a, dv_of, query, dtype_of),
                         (f"{query}'s with the last dimension the value width",
                          f"{dtype_what}; float64 with precision='exact'"), aliased=_aliased_with(query))


def reject_on_device(backend: str, attention_out, softmax_max_out=None, softmax_sum_out=None) -> None:
    """Output buffers are a reference-backend feature: a device backend returns its own tensors."""
    given = [k for k, v in zip(OUT_BUFFERS, (attention_out, softmax_max_out, softmax_sum_out)) if v is not None]
    if not given:
        return
    from .._dispatch import get_backend

    name = get_backend(backend).name
    if name != "reference":
        raise InvalidArgument("value", given[0], Raw("an array"),
                              f"{given[0]}= buffers are written by the reference backend only, not by {name!r} "
                              "(a device backend returns its own tensor: copy it out)")


def add_buffers(args: dict, attention_out, softmax_max_out, softmax_sum_out) -> dict:
    """``args`` with the output buffers that were given (an absent one is not a parameter of the call)."""
    for k, v in zip(OUT_BUFFERS, (attention_out, softmax_max_out, softmax_sum_out)):
        if v is not None:
            args[k] = v
    return args
