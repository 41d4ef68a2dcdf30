"""Scatter rows into a paged cache by slot (docs/numerics/cache-writers.md#scatter_by_slot): the one routine every cache writer uses.

A paged cache is viewed as ``[block_num, block_size, *row_shape]``. Slot ``s`` addresses block
``s // block_size``, row ``s % block_size``. Slot ``-1`` means "skip this token": the destination bytes
keep exactly the value they had. Duplicate and out-of-range slots are invalid input; the operator
contracts reject them before anything is written, so this module only asserts.

The writes go through NumPy item assignment on the array it is given, so a strided *view* of the
caller's buffer (for example a cache that is non-contiguous along ``block_num``, or the transposed
view of an NZ cache from :func:`qsfa.reference.packing.nz_view`) is updated in place; nothing here
makes a contiguous copy of the cache.
"""

from __future__ import annotations

import numpy as np

__all__ = ["slot_positions", "scatter_by_slot", "check_slots"]


def slot_positions(slot_mapping, block_size: int):
    """Split slots into ``(valid, blocks, rows)``.

    ``valid`` is the boolean mask of slots that are not ``-1``; ``blocks`` and ``rows`` hold
    ``s // block_size`` and ``s % block_size`` of the valid slots only (int64, in token order).
    """
    from .._errors import InvalidArgument

    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size < 1:
        raise InvalidArgument("value", "block_size", block_size, "must be a positive integer")
    s = np.asarray(slot_mapping) if slot_mapping is not None else None
    if s is None or s.dtype.kind not in "iu":
        raise InvalidArgument("dtype", "slot_mapping", None if s is None else str(s.dtype),
                              "must be an integer array of slots (-1 skips a token)")
    s = s.reshape(-1).astype(np.int64)
    if (s < -1).any():
        i = int(np.argmax(s < -1))
        raise InvalidArgument("value", "slot_mapping", int(s[i]), f"slots must be >= -1 (position {i})")
    valid = s != -1
    sv = s[valid]
    return valid, sv // int(block_size), sv % int(block_size)


def check_slots(slot_mapping, num_slots: int) -> str | None:
    """Why ``slot_mapping`` is not a valid set of slots for ``num_slots`` cache rows, or ``None``.

    Valid: every value is ``-1`` or in ``[0, num_slots)`` and no value other than ``-1`` repeats.
    Used by the operator contracts (which turn the answer into an error message).
    """
    s = np.asarray(slot_mapping).reshape(-1).astype(np.int64)
    bad = (s < -1) | (s >= num_slots)
    if bad.any():
        i = int(np.argmax(bad))
        return f"slot {int(s[i])} at position {i} is outside [-1, {num_slots})"
    v = s[s != -1]
    if v.size:
        uniq, counts = np.unique(v, return_counts=True)
        if (counts > 1).any():
            return f"slot {int(uniq[np.argmax(counts > 1)])} appears {int(counts.max())} times"
    return None


def scatter_by_slot(cache: np.ndarray, rows: np.ndarray, slot_mapping) -> np.ndarray:
    """Write ``rows[t]`` to ``cache[s // block_size, s % block_size]`` for every slot ``s != -1``.

    cache:        ``[block_num, block_size, *row_shape]``, written in place (any strides).
    rows:         ``[T, *w]`` where ``w`` equals ``row_shape`` except that the last dimension may be
                  shorter: then only the first ``w[-1]`` elements of each destination row are written
                  and the rest keep their bytes (KvCompressEpilog writes ``kvCacheCol <= headDim``).
                  ``rows.dtype`` must be the cache dtype, or a same-size dtype whose bits are copied.
    slot_mapping: ``[T]`` integers; ``-1`` skips the token. Must be free of duplicates and in range
                  (the contracts check this; here it is only asserted).

    Returns ``cache``.
    """
    rows = np.asarray(rows)
    block_size = cache.shape[1]
    assert rows.shape[0] == np.asarray(slot_mapping).size, "one slot per row"
    assert rows.ndim == cache.ndim - 1, "rows must have cache's row rank"
    assert rows.ndim == 1 or (rows.shape[1:-1] == cache.shape[2:-1] and rows.shape[-1] <= cache.shape[-1])
    assert check_slots(slot_mapping, cache.shape[0] * block_size) is None
    if rows.dtype != cache.dtype:
        assert rows.dtype.itemsize == cache.dtype.itemsize, "rows and cache element sizes differ"
        rows = rows.view(cache.dtype)
    valid, blocks, pos = slot_positions(slot_mapping, block_size)
    if not blocks.size:
        return cache
    src = rows[valid]
    if cache.ndim == 2:  # [block_num, block_size]: one element per slot (no row width to cut)
        cache[blocks, pos] = src
        return cache
    width = rows.shape[-1]
    if width == cache.shape[-1] and cache.flags.c_contiguous:  # one flat row index (faster than two)
        cache.reshape(cache.shape[0] * block_size, *cache.shape[2:])[blocks * block_size + pos] = src
    elif width == cache.shape[-1]:
        cache[blocks, pos] = src
    else:
        cache[blocks, pos, ..., :width] = src
    return cache
