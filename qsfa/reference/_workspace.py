"""Per-thread scratch buffers reused across calls of the attention oracle (issue 15).

The faithful attention holds its K / V and score matrices in float64 (tens of MB per chunk). A fresh array of
that size is a fresh ``mmap`` whose every page faults on first write, which cost the decode about as much as
the dequantisation itself. :func:`scratch` hands out views of buffers kept per thread (so the thread pool of
:mod:`qsfa.reference.parallel` never shares one) and per name (so two live arrays never share one); a call
asks for the same names in the same order every time, so steady-state calls allocate nothing large.

Contents are undefined (like ``np.empty``); a view must not outlive the next request of its name in the same
thread (the oracle only uses them inside one chunk). :func:`release` frees the calling thread's buffers;
buffers above ``MAX_KEEP_BYTES`` in total are never kept.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["scratch", "release", "MAX_KEEP_BYTES"]

#: buffers of one thread are kept while their total stays below this (default 512 MiB)
MAX_KEEP_BYTES = 512 << 20

_local = threading.local()


def scratch(name: str, shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` / ``dtype``, a view of this thread's buffer ``name``."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    need = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    buf = bufs.get(name)
    if buf is None or buf.nbytes < need:
        bufs.pop(name, None)
        buf = np.empty(max(need, 64), np.uint8)  # large buffers are page aligned (mmap); views are aligned
        if sum(b.nbytes for b in bufs.values()) + buf.nbytes <= MAX_KEEP_BYTES:
            bufs[name] = buf
    return buf[:need].view(dtype).reshape(shape)


def release() -> None:
    """Drop the calling thread's buffers."""
    _local.bufs = {}
