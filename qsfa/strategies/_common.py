"""Shared pieces of the hypothesis strategies: size bounds, drawing helpers and the index / slot builders
used by several operator families (see :mod:`qsfa.strategies`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from .._contract import Constraint
from .._profiles import SIZE_BOUNDS, active_profile

__all__ = [
    "Bounds",
    "bounds",
    "InvalidArgs",
    "slot_mapping",
    "sparse_index_rows",
    "poison_bytes",
    "INT64_MAX",
    "draw_flags",
]


INT64_MAX = 2**63 - 1
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F16 = np.dtype(np.float16)
_QDT = {"bfloat16": _BF16, "float16": _F16}
#: NaN bit patterns used to poison never-read memory
_NAN16 = {"bfloat16": np.uint16(0x7FC0), "float16": np.uint16(0x7E00)}
_NAN_CODE = {"float8_e4m3fn": 0x7F, "hifloat8": 0x80, "float8_e5m2": 0x7F, "int8": None}


# ---------------------------------------------------------------------------------------------------
# bounds


@dataclass(frozen=True)
class Bounds:
    """Upper bounds on the sizes the strategies draw.

    max_batch, max_q_tokens (query rows per batch), max_kv_tokens (KV tokens per batch), max_sparse
    (sparse_size / sparse_count), max_heads (query heads), max_block_size (paged caches): from
    :data:`qsfa._profiles.SIZE_BOUNDS`. max_tokens (tokens of one cache-writer call) and max_elements
    (elements of a format / quant array) are derived: ``max_batch * max_q_tokens * 2`` and
    ``4 * max_kv_tokens``.
    """

    max_batch: int
    max_q_tokens: int
    max_kv_tokens: int
    max_sparse: int
    max_heads: int
    max_block_size: int
    max_tokens: int = 0
    max_elements: int = 0

    def __post_init__(self):
        if self.max_tokens <= 0:
            object.__setattr__(self, "max_tokens", max(4, 2 * self.max_batch * self.max_q_tokens))
        if self.max_elements <= 0:
            object.__setattr__(self, "max_elements", max(16, 4 * self.max_kv_tokens))
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Invalid value for {f.name}, actual: {v!r}, reason: must be an integer >= 1.")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def bounds(profile: str | None = None, **overrides) -> Bounds:
    """The :class:`Bounds` of a hypothesis profile (default: the active one, ``QSFA_HYPOTHESIS_PROFILE`` or
    ``ci``), with ``overrides`` (e.g. ``max_kv_tokens=32``) applied."""
    name = profile or active_profile()
    if name not in SIZE_BOUNDS:
        raise ValueError(f"Invalid value for profile, actual: {name!r}, reason: must be one of {sorted(SIZE_BOUNDS)}.")
    return Bounds(**{**SIZE_BOUNDS[name], **overrides})


def _b(b: Bounds | None) -> Bounds:
    return bounds() if b is None else b


# ---------------------------------------------------------------------------------------------------
# small helpers


def _choose(draw, pins: dict, name: str, options):
    """Draw ``name`` from ``options``, or from the pinned value(s) when ``name`` is pinned."""
    if name in pins:
        p = pins[name]
        opts = tuple(p) if isinstance(p, (tuple, list, frozenset, set)) else (p,)
        if not opts:
            raise ValueError(f"pin {name!r} allows no value")
        return draw(sampled(opts))
    return draw(sampled(tuple(options)))


_SCALARS = frozenset((bool, int, float, str, type(None)))
_SAMPLED: dict = {}


def sampled(opts: tuple) -> st.SearchStrategy:
    """``st.sampled_from(opts)``, one strategy object per distinct tuple of plain scalars: a fresh
    ``sampled_from`` is validated and labelled again on every draw, which was ~30% of drawing an attention
    example (issue 15). Draws are the same as with a fresh strategy. The cache key holds each option's type (and a
    float's repr), so ``(False, True)`` and ``(0, 1)``, or ``0.0`` and ``-0.0``, stay distinct."""
    types = tuple(map(type, opts))
    key = (types, tuple(map(repr, opts)) if float in types else opts)
    try:
        return _SAMPLED[key]
    except KeyError:
        pass
    except TypeError:  # unhashable options
        return st.sampled_from(opts)
    s = st.sampled_from(opts)
    if _SCALARS.issuperset(types):
        _SAMPLED[key] = s
    return s


_STRATS: dict = {}


def ints(lo: int, hi: int) -> st.SearchStrategy:
    """``st.integers(lo, hi)``, built once per bounds (hypothesis' own strategy cache costs ~20 us a lookup)."""
    key = ("i", int(lo), int(hi))
    s = _STRATS.get(key)
    if s is None:
        s = _STRATS[key] = st.integers(int(lo), int(hi))
    return s


def int_lists(lo: int, hi: int, n: int) -> st.SearchStrategy:
    """``st.lists(st.integers(lo, hi), min_size=n, max_size=n)``, built once per arguments (see :func:`ints`)."""
    key = ("l", int(lo), int(hi), int(n))
    s = _STRATS.get(key)
    if s is None:
        s = _STRATS[key] = st.lists(ints(lo, hi), min_size=int(n), max_size=int(n))
    return s


BOOLEANS = st.booleans()

#: the largest product of option counts one folded draw of :func:`draw_flags` holds: hypothesis draws an integer
#: in ``[0, n)`` uniformly for ``n <= 257`` (wider ranges follow its long-tailed distribution, which would make
#: the high digits almost always 0)
FOLD_MAX = 256


def draw_flags(draw, pins: dict, specs) -> dict:
    """Several small independent choices as few hypothesis choices (issue 15): ``specs`` is a sequence of
    ``(name, options)`` or ``(name, options, pin)``; returns ``{name: value}``.

    A choice pinned in ``pins`` (under ``pin``, default its name; a value, or a tuple of allowed values) takes its
    options from the pin, as :func:`_choose`; one allowed value costs no draw. The others are packed in order into
    groups whose option counts multiply to at most :data:`FOLD_MAX`, each group one ``integers(0, product - 1)``
    draw decoded in mixed radix (the first choice of a group is its lowest digit). A uniform integer gives each
    choice the distribution of its own ``sampled_from`` (repeated options weigh as there), and a draw that shrinks
    to 0 gives every choice its first option - the simplest draw is the one separate draws had (so the edge
    examples, drawn as the simplest examples, do not change). Meant for flags and modes; sizes, layouts and dtypes
    stay draws of their own, so shrinking can reduce them one by one."""
    out = {}
    group: list = []
    prod = 1

    def flush():
        v = int(draw(ints(0, prod - 1)))
        for name, opts in group:
            v, d = divmod(v, len(opts))
            out[name] = opts[d]

    for spec in specs:
        name, options = spec[0], spec[1]
        pin = spec[2] if len(spec) > 2 else name
        if pin in pins:
            p = pins[pin]
            opts = tuple(p) if isinstance(p, (tuple, list, frozenset, set)) else (p,)
            if not opts:
                raise ValueError(f"pin {pin!r} allows no value")
        else:
            opts = tuple(options)
        if len(opts) == 1:
            out[name] = opts[0]
            continue
        if len(opts) > FOLD_MAX:
            raise ValueError(f"choice {name!r} has {len(opts)} options, more than one folded draw holds")
        if prod * len(opts) > FOLD_MAX:
            flush()
            group, prod = [], 1
        group.append((name, opts))
        prod *= len(opts)
    if group:
        flush()
    return out


def _rng(draw) -> np.random.Generator:
    return np.random.default_rng(draw(ints(0, 2**32 - 1)))


def _bits16(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


def poison_bytes(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """An array of ``dtype`` filled with random bytes (a prefill whose every byte a correct writer either
    overwrites or leaves as it is)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    return rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt).reshape(shape)


def slot_mapping(rng: np.random.Generator, n_tokens: int, num_slots: int, *, skip_fraction: float = 0.25,
                 dtype="int64") -> np.ndarray:
    """``[n_tokens]`` slots: distinct values in ``[0, num_slots)`` and ``-1`` (skip) for about
    ``skip_fraction`` of the tokens (more when there are fewer slots than tokens)."""
    n_valid = min(n_tokens, num_slots, int(round(n_tokens * (1 - skip_fraction))))
    if skip_fraction > 0 and n_valid == n_tokens and n_tokens > 1 and rng.random() < 0.5:
        n_valid -= 1
    out = np.full(n_tokens, -1, np.int64)
    where = rng.permutation(n_tokens)[:n_valid]
    out[where] = rng.permutation(num_slots)[:n_valid]
    return out.astype(dtype)


def sparse_index_rows(rng: np.random.Generator, limit_blocks: np.ndarray, width: int, *, fill=1.0,
                      junk_after=False, total_blocks: int | None = None, strays: float = 0.0) -> np.ndarray:
    """int32 ``[R, width]`` sparse indices: row r holds distinct entries of ``[0, limit_blocks[r])`` in
    random order (``round(fill * min(width, limit_blocks[r]))`` of them; ``fill`` may be an array), then
    ``-1``.

    strays: about this fraction of the free width also holds *non-causal* entries in
    ``[limit_blocks[r], total_blocks[r])`` (blocks at or past the row's limit: they select nothing;
    ``total_blocks`` may be one number or one per row), shuffled
    among the causal ones - the kernel must clip them, and they push causal entries past the first
    ``ceil(threshold / sbs)`` positions that are read. junk_after: the entries after the first ``-1`` hold
    random values in ``[-1, total_blocks)`` (a reader must stop at the first ``-1``)."""
    # (the same draws and the same result as the straightforward version with np.inf keys, np.clip and
    # np.take_along_axis, in fewer and cheaper NumPy calls: these arrays are tiny and each call's overhead counted;
    # issue 15)
    limit_blocks = np.asarray(limit_blocks, np.int64).reshape(-1)
    r = limit_blocks.size
    nb_max = max(int(limit_blocks.max(initial=0)), 1)
    if total_blocks is None:
        total = np.full(r, nb_max, np.int64)
    else:
        total = np.maximum(np.broadcast_to(np.asarray(total_blocks, np.int64), (r,)), 1)
    col = np.arange(max(nb_max, width))
    key = rng.random((r, nb_max))
    key[col[:nb_max] >= limit_blocks[:, None]] = 2.0  # after every draw in [0, 1): the row's blocks come first
    order = key.argsort(axis=1, kind="stable")
    take = min(width, nb_max)
    cap = np.minimum(limit_blocks, width)
    count = np.minimum(np.maximum(np.rint(cap * np.asarray(fill, np.float64)).astype(np.int64), 0), cap)
    idx = np.full((r, width), -1, np.int64)
    idx[:, :take] = np.where(col[:take] < count[:, None], order[:, :take], -1)
    if strays > 0:
        room = width - count
        n_stray = np.minimum(room, rng.binomial(np.maximum(room, 0), min(strays, 1.0)))
        used = count + n_stray
        m = int(used.max(initial=0))  # columns past every row's strays keep their -1
        lo = limit_blocks
        hi = np.maximum(total, lo + 1)
        vals = lo[:, None] + np.floor(rng.random((r, m)) * (hi - lo)[:, None]).astype(np.int64)
        head = idx[:, :m]
        head[(col[:m] >= count[:, None]) & (col[:m] < used[:, None])] = vals[(col[:m] >= count[:, None])
                                                                             & (col[:m] < used[:, None])]
        # shuffle each row's used prefix, the -1 tail stays: a stable argsort of random keys for narrow rows, a
        # Fisher-Yates permutation per row for wide ones (a 2048-wide HiFloat8 row holds ~1000 strays, and the
        # stable sort of 2048 random keys per row cost about a millisecond per call)
        if m > 64:
            for i in np.flatnonzero(used > 1):
                u = int(used[i])
                head[i, :u] = head[i, rng.permutation(u)]
        else:
            mix = rng.random((r, m))
            mix[col[:m] >= used[:, None]] = 2.0
            idx[:, :m] = head[np.arange(r)[:, None], mix.argsort(axis=1, kind="stable")]
        count = used
    if junk_after:
        junk = rng.integers(-1, int(total.max()) + 1, (r, width))
        idx = np.where(col[:width] > count[:, None], junk, idx)
    return idx.astype(np.int32)


class InvalidArgs(NamedTuple):
    """An invalid argument set and the one constraint it violates (the first the contract reports)."""

    args: dict
    constraint: Constraint
