"""Front door of ``scatter_by_slot``: rows written into a cache at slot indices
(docs/numerics/cache-writers.md#scatter_by_slot).

Contract, example and front door; the computation is :mod:`qsfa.reference.scatter`, the tests
tests/test_scatter.py.
"""

from __future__ import annotations

import numpy as np

from .._arrays import dtype_name
from .._checks import dtype_in, is_array, ndim_in
from .._contract import Contract, params
from .._dispatch import define_operator, run
from .._errors import Raw
from ..reference import scatter as _sc
from ._cache_rules import _edit, _rule, _slot_rules, SLOT_DTYPES

__all__ = [
    "scatter_by_slot",
]


# --------------------------------------------------------------------------------------- scatter_by_slot

SC = "scatter_by_slot"
SC_SRC = "docs/numerics/cache-writers.md#scatter_by_slot"


def _sc_example(rng):
    cache = np.full((3, 4, 1, 8), 17, np.uint8)
    rows = rng.integers(0, 256, (5, 1, 8), dtype=np.uint8)
    return dict(cache=cache, rows=rows, slot_mapping=np.array([0, 5, -1, 11, 3], np.int64))


def _sc_rows_shape(a):
    want = (np.asarray(a.slot_mapping).size,) + tuple(a.cache.shape[2:])
    return None if tuple(a.rows.shape) == want else tuple(a.rows.shape)


SC_CONTRACT = Contract(
    op=SC,
    constraints=[
        is_array(SC, "cache", source=SC_SRC),
        is_array(SC, "rows", source=SC_SRC),
        is_array(SC, "slot_mapping", source=SC_SRC),
        _rule(SC, "cache_ndim", "cache", "dim", "a paged cache has at least 2 dimensions [block_num, block_size, ...]",
              lambda a: None if a.cache.ndim >= 2 else a.cache.ndim,
              _edit(lambda o: o.update(cache=o["cache"].reshape(-1))), source=SC_SRC),
        dtype_in(SC, "slot_mapping", SLOT_DTYPES, source=SC_SRC),
        ndim_in(SC, "slot_mapping", (1,), source=SC_SRC),
        _rule(SC, "rows_dtype", "rows", "dtype", "must have the cache's dtype (either may be the one meant: the cache "
              "takes any dtype, the rows are copied into it byte for byte)",
              lambda a: None if a.rows.dtype == a.cache.dtype else
              Raw(f"{dtype_name(a.rows)} (cache: {dtype_name(a.cache)})"),
              _edit(lambda o: o.update(rows=o["rows"].astype(np.int16))), dtype=True, source=SC_SRC),
        _rule(SC, "rows_shape", "rows", "shape", "must be [len(slot_mapping), *cache.shape[2:]]", _sc_rows_shape,
              _edit(lambda o: o.update(rows=o["rows"][:-1])), source=SC_SRC),
        *_slot_rules(SC, "slot_mapping", lambda a: a["cache"].shape[0] * a["cache"].shape[1], source=SC_SRC),
    ],
    example=_sc_example,
    inplace=("cache",),
    params=params("cache:array rows:array slot_mapping:array"),
)


def _sc_reference(cache, rows, slot_mapping):
    return _sc.scatter_by_slot(cache, rows, slot_mapping)


define_operator(SC, SC_CONTRACT, outputs=("cache",), reference=_sc_reference,
                doc="Write rows into a paged cache by slot; -1 skips.")


def scatter_by_slot(cache, rows, slot_mapping, backend="reference", *, chip=None):
    """Write ``rows[t]`` to ``cache[s // block_size, s % block_size]`` for each slot ``s = slot_mapping[t]``.

    cache:        ``[block_num, block_size, *row_shape]`` any dtype, updated in place and returned.
    rows:         ``[T, *row_shape]`` of the cache's dtype.
    slot_mapping: ``[T]`` int32 / int64; ``-1`` skips the token (its destination keeps its bytes); other
                  values must lie in ``[0, block_num * block_size)`` and must not repeat (rejected before
                  any write).
    """
    return run(SC, dict(cache=cache, rows=rows, slot_mapping=slot_mapping), backend, chip=chip)
