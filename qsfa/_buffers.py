"""Generic rules every contract gets for its array parameters and in-place buffers.

:class:`~qsfa._contract.Contract` puts these constraints right after its generic type constraints and
before every hand-written rule, so a call that would write an in-place buffer it cannot hold (read-only,
``bool``, internally overlapping, aliased with another argument), or that declares an array larger than
this machine's memory, is rejected before anything is computed or written - a rejected call leaves
every buffer byte-identical (``tests/test_hostile_*.py``).

* ``<op>.<param>_size`` (every array): the logical size (``size * itemsize``) must not exceed this
  machine's physical memory. Only a broadcast / stride-0 view can declare more; validation and the
  reference materialise their inputs, so such a call would otherwise run for minutes or die in a bare
  ``MemoryError``.
* ``<op>.<param>_writable`` (in-place): the buffer must be writable.
* ``<op>.<param>_holds_bytes`` (in-place): not ``bool`` (a cache holds arbitrary bytes; NumPy would
  collapse them to 0/1).
* ``<op>.<param>_overlap`` (in-place): no two elements share memory (``expand``-ed / stride-0 views).
* ``<op>.<param>_aliasing`` (in-place): shares no memory with any other array argument.
"""

from __future__ import annotations

import os

import numpy as np

from ._contract import Constraint, copy_args
from ._errors import Raw

__all__ = ["memory_bytes", "self_overlaps", "strided_overlaps", "tensor_layout_overlaps", "tensors_may_share",
           "shares_memory", "distinct_bytes", "array_rules", "inplace_rules"]

_SOURCE = "qsfa contract: generic buffer rule (docs/architecture.md)"


def memory_bytes() -> int:
    """This machine's physical memory in bytes (2**40 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def self_overlaps(a: np.ndarray) -> bool:
    """Whether two elements of ``a`` may share memory (stride 0, or strides that interleave)."""
    return strided_overlaps(a.shape, a.strides, a.itemsize)


def strided_overlaps(shape, strides, itemsize: int) -> bool:
    """:func:`self_overlaps` from a shape, byte strides and the element size (NumPy arrays or tensors).

    Sorted by absolute stride, each dimension must step over everything the smaller ones span; a layout
    that fails this is reported as overlapping (exotic non-overlapping interleavings included). An empty array has
    no two elements to share memory, whatever its strides (NumPy gives some empty views stride 0).
    """
    if 0 in tuple(shape):
        return False
    dims = sorted((abs(st), n) for n, st in zip(shape, strides) if n > 1)
    span = itemsize
    for st, n in dims:
        if st < span:
            return True
        span += st * (n - 1)
    return False


def tensor_layout_overlaps(t) -> bool:
    """:func:`strided_overlaps` of a torch tensor (on any device: read from its strides, not its data)."""
    item = t.element_size()
    return strided_overlaps(tuple(t.shape), tuple(s * item for s in t.stride()), item)


def tensors_may_share(a, b) -> bool:
    """Whether two strided torch tensors on one device may share bytes: the same storage and intersecting
    byte spans (conservative: interleaved views of one storage count as sharing)."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        item = t.element_size()
        lo = t.data_ptr()
        return lo, lo + item + sum((n - 1) * st * item for n, st in zip(t.shape, t.stride()) if n > 0)

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def shares_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Exact overlap test with bounded work; too hard to decide counts as shared."""
    if not np.may_share_memory(a, b):
        return False
    try:
        return bool(np.shares_memory(a, b, max_work=100_000))
    except np.exceptions.TooHardError:  # pragma: no cover - needs pathological strides
        return True


def distinct_bytes(a) -> bytes:
    """The bytes of ``a`` with stride-0 axes collapsed (a snapshot of a huge broadcast view stays small)."""
    a = np.asarray(a)
    shape = tuple(1 if st == 0 else n for n, st in zip(a.shape, a.strides))
    return np.lib.stride_tricks.as_strided(a, shape, a.strides, writeable=False).tobytes()


def _arrays(a):
    return [(k, v) for k, v in a.items() if isinstance(v, np.ndarray)]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3g} GiB"


def array_rules(op: str, name: str) -> list[Constraint]:
    def check(a):
        v = a.get(name)
        if not isinstance(v, np.ndarray):
            return None
        need = v.size * v.dtype.itemsize  # Python ints: no overflow
        if need <= memory_bytes():
            return None
        return Raw(f"shape {tuple(v.shape)} ({_gib(need)} of {v.dtype})")

    def violate(args):
        out = copy_args(args)
        v = out[name] if isinstance(out.get(name), np.ndarray) else np.zeros((1,), np.float32)
        v = np.ascontiguousarray(v)
        if v.ndim == 0 or v.size == 0:
            v = np.zeros((1,) * max(v.ndim, 1), v.dtype)
        rest = int(np.prod(v.shape[1:]))
        n0 = -(-(1 << 50) // max(rest * v.itemsize, 1))  # 1 PiB: beyond any machine's memory
        out[name] = np.lib.stride_tricks.as_strided(v, shape=(n0, *v.shape[1:]), strides=(0, *v.strides[1:]),
                                                    writeable=False)
        return out

    return [Constraint(id=f"{op}.{name}_size", param=name, kind="shape", drawn=False,
                       reason=f"its logical size exceeds this machine's memory ({_gib(memory_bytes())}); only a "
                              "broadcast / stride-0 view can declare that much, and the reference materialises it",
                       check=check, violate=violate, source=_SOURCE)]


def inplace_rules(op: str, name: str) -> list[Constraint]:
    def writable(a):
        v = a.get(name)
        return None if not isinstance(v, np.ndarray) or v.flags.writeable else Raw("a read-only array")

    def make_readonly(args):
        out = copy_args(args)
        out[name].flags.writeable = False
        return out

    def holds_bytes(a):
        v = a.get(name)
        return None if not isinstance(v, np.ndarray) or v.dtype.kind != "b" else "bool"

    def make_bool(args):
        out = copy_args(args)
        out[name] = np.zeros(out[name].shape, np.bool_)
        return out

    def overlap(a):
        v = a.get(name)
        if not isinstance(v, np.ndarray) or not self_overlaps(v):
            return None
        return Raw(f"shape {tuple(v.shape)} with strides {tuple(v.strides)}")

    def make_overlapping(args):
        out = copy_args(args)
        v = out[name]
        ax = next(i for i, n in enumerate(v.shape) if n > 1)
        strides = tuple(0 if i == ax else s for i, s in enumerate(v.strides))
        out[name] = np.lib.stride_tricks.as_strided(v, v.shape, strides, writeable=True)
        return out

    def aliasing(a):
        v = a.get(name)
        if not isinstance(v, np.ndarray) or v.size == 0:
            return None
        for k, w in _arrays(a):
            if k != name and w.size and shares_memory(v, w):
                return Raw(f"shares memory with {k}")
        return None

    def make_aliased(args):
        out = copy_args(args)
        v = out[name]
        k, w = next((k, w) for k, w in _arrays(out) if k != name and w.size)
        buf = np.zeros(max(v.nbytes, w.nbytes) + 16, np.uint8)
        other = buf[:w.nbytes].view(w.dtype).reshape(w.shape)
        other[...] = w
        out[k] = other
        out[name] = buf[:v.nbytes].view(v.dtype).reshape(v.shape)
        return out

    def r(cid, kind, reason, check, violate, dtype=False):
        return Constraint(id=f"{op}.{name}_{cid}", param=name, kind=kind, reason=reason, check=check,
                          dtype=dtype, violate=violate, source=_SOURCE, drawn=cid == "holds_bytes")

    return [
        r("writable", "value", "an in-place buffer must be writable", writable, make_readonly),
        r("holds_bytes", "dtype", "an in-place buffer must not be bool (it holds arbitrary bytes)", holds_bytes,
          make_bool, dtype=True),
        r("overlap", "layout", "an in-place buffer must not overlap itself (no stride-0 / expand()-ed views)",
          overlap, make_overlapping),
        r("aliasing", "value", "an in-place buffer must not share memory with another argument", aliasing,
          make_aliased),
    ]
