"""Public hypothesis strategies: complete, valid (and, separately, invalid) argument sets for every operator.

Every strategy draws a ``dict`` of the operator's arguments (NumPy arrays and plain Python values, the
parameter names of the public function) that passes the operator's :class:`~qsfa._contract.Contract`
(``tests/test_strategies.py`` checks this for every operator). Structure (shapes, dtypes, layouts, modes,
lengths, block tables, slot mappings, sparse indices) is drawn by hypothesis and shrinks; bulk array
contents come from a NumPy generator seeded by a drawn integer, so large arrays stay cheap.

    from qsfa import strategies as qst
    @given(qst.valid_args("kv_quant_sparse_flash_attention", layout_kv="PA_BSND"))
    def test_something(args): ...

* :func:`valid_args(op, bounds=None, **pins) <valid_args>` - the strategy of one operator (:data:`STRATEGIES`);
  ``pins`` fix a drawn choice to a value or to a tuple of allowed values (``key_dtype=("int8",)``).
* :func:`invalid_args(op, ...) <invalid_args>` - :class:`InvalidArgs` records ``(args, constraint)`` whose
  arguments violate exactly the named constraint (it is the first one the contract reports).
* :class:`Bounds` / :func:`bounds` - size limits; the defaults come from the active hypothesis profile
  (:data:`qsfa._profiles.SIZE_BOUNDS`: ``ci`` small, ``nightly`` large).

What the attention strategies exercise: BSND / TND queries with per-batch lengths (padding rows past
``actQ`` included), BSND / TND / PA_BSND KV with random physical block order, spare blocks and junk in
unused block-table entries; sparse indices that are causally valid for the row (distinct entries below
``ceil(min(actKV, threshold) / sparse_block_size)``), optionally mixed with non-causal entries (at or past the
row's limit: they select nothing, and they push causal entries past the ``ceil(threshold / sbs)`` positions
that are read), then ``-1`` padding, optionally followed by junk that must be ignored (reading stops at the
first ``-1``). Every KV row that no query may read (tokens past
``actKV``, spare blocks, TND tail) is **poisoned**: packed rows get NaN NoPE codes (FP8 / HiFloat8), NaN
RoPE and NaN scales; float caches get NaN - a backend that reads them produces NaN and fails.

The indexer strategies draw integer-valued (or power-of-two scaled) inputs so every score is exact in
fp32: the top-k order (ties by lower token index, the OPEN ``tie_break`` default) is then exactly defined
and backends can be compared index for index.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, NamedTuple

import ml_dtypes
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from . import _edges as _E
from ._contract import Args, Constraint
from ._profiles import SIZE_BOUNDS, active_profile
from ._values import _exact_codes, _format_values, _group_values, _nope_codes

__all__ = [
    "Bounds",
    "bounds",
    "with_bounds",
    "valid_args",
    "invalid_args",
    "InvalidArgs",
    "STRATEGIES",
    "encode_args",
    "decode_args",
    "pack_fp4_args",
    "unpack_fp4_args",
    "dynamic_block_quant_args",
    "scatter_by_slot_args",
    "c8_cache_write_args",
    "c8_rmsnorm_rope_cache_args",
    "kv_compress_epilog_args",
    "kv_rmsnorm_rope_cache_args",
    "qsfa_args",
    "sfa_args",
    "lightning_indexer_args",
    "quant_lightning_indexer_args",
    "merge_attention_lse_args",
    "slot_mapping",
    "sparse_index_rows",
    "poison_bytes",
    "clone",
    "strided_like",
    "INT64_MAX",
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
        return draw(st.sampled_from(opts))
    return draw(st.sampled_from(tuple(options)))


def _rng(draw) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


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
    limit_blocks = np.asarray(limit_blocks, np.int64)
    r = limit_blocks.size
    nb_max = max(int(limit_blocks.max(initial=0)), 1)
    total = np.broadcast_to(np.asarray(nb_max if total_blocks is None else total_blocks, np.int64), (r,))
    total = np.maximum(total, 1)
    key = rng.random((r, nb_max))
    key[np.arange(nb_max)[None, :] >= limit_blocks[:, None]] = np.inf
    order = np.argsort(key, axis=1, kind="stable")
    take = min(width, nb_max)
    count = np.minimum(limit_blocks, width)
    count = np.clip(np.round(count * np.asarray(fill, np.float64)).astype(np.int64), 0, count)
    idx = np.full((r, width), -1, np.int64)
    pos = np.arange(take)[None, :]
    idx[:, :take] = np.where(pos < count[:, None], order[:, :take], -1)
    if strays > 0:
        room = width - count
        n_stray = np.minimum(room, rng.binomial(np.maximum(room, 0), min(strays, 1.0)))
        lo = limit_blocks
        hi = np.maximum(total, lo + 1)
        vals = lo[:, None] + np.floor(rng.random((r, width)) * (hi - lo)[:, None]).astype(np.int64)
        col = np.arange(width)[None, :]
        is_stray = (col >= count[:, None]) & (col < (count + n_stray)[:, None])
        idx = np.where(is_stray, vals, idx)
        used = count + n_stray
        mix = rng.random((r, width))
        mix[col >= used[:, None]] = np.inf  # keep the -1 tail in place, shuffle the used prefix
        idx = np.take_along_axis(idx, np.argsort(mix, axis=1, kind="stable"), axis=1)
        count = used
    if junk_after:
        junk = rng.integers(-1, int(total.max()) + 1, (r, width))
        after = np.arange(width)[None, :] > count[:, None]
        idx = np.where(after, junk, idx)
    return idx.astype(np.int32)


class InvalidArgs(NamedTuple):
    """An invalid argument set and the one constraint it violates (the first the contract reports)."""

    args: dict
    constraint: Constraint


# ---------------------------------------------------------------------------------------------------
# formats


_ENCODE_INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16")
_NP_IN = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64), "float16": _F16, "bfloat16": _BF16}


@st.composite
def encode_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``formats.encode``: ``x`` (float32 / float64 / float16 / bfloat16, 1-2 dims) of values chosen to hit
    ties, neighbours of ties and range edges; every ``fmt``, ``saturate`` and supported ``rounding``."""
    from .reference import formats as F

    b = _b(bounds)
    pins, edge = _E.take(draw, "formats.encode", pins)
    fmt = _choose(draw, pins, "fmt", F.FORMAT_NAMES)
    saturate = _choose(draw, pins, "saturate", (False, True))
    rounding = _choose(draw, pins, "rounding", (None,) + F.rounding_modes(fmt))
    in_dt = _choose(draw, pins, "x_dtype", _ENCODE_INPUT_DTYPES)
    n = draw(st.integers(1, b.max_elements))
    shape = draw(st.sampled_from([(n,), (1, n)] + ([(2, n // 2)] if n >= 4 and n % 2 == 0 else [])))
    rng = _rng(draw)
    no_specials = fmt in ("int8", "float4_e2m1")
    with np.errstate(over="ignore"):
        x = _format_values(rng, fmt, n, specials=not no_specials or saturate).astype(_NP_IN[in_dt])
        if edge is not None:  # every boundary value in the edge phase; a shrinkable prefix otherwise
            x = _E.encode_values(rng, fmt, saturate).astype(_NP_IN[in_dt])
            x = x if pins.get("edge_full") else x[:draw(st.integers(1, x.size))]
            shape = x.shape
    if no_specials:
        x[np.isnan(x.astype(np.float64))] = 0
        if not saturate:
            bad = F.out_of_range(x, fmt, rounding) | ~np.isfinite(x.astype(np.float64))
            x[bad] = 0
    return dict(x=x.reshape(shape), fmt=fmt, saturate=saturate, rounding=rounding)


@st.composite
def decode_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``formats.decode``: codes of every format in each accepted code dtype (every code value possible)."""
    from .reference import formats as F

    b = _b(bounds)
    pins, edge = _E.take(draw, "formats.decode", pins)
    fmt = _choose(draw, pins, "fmt", F.FORMAT_NAMES)
    dts = F.code_input_dtypes(fmt)
    dt = dts[draw(st.integers(0, len(dts) - 1))]
    n = draw(st.integers(1, b.max_elements))
    rng = _rng(draw)
    hi = 16 if fmt == "float4_e2m1" else 1 << (8 * dt.itemsize)
    codes = rng.integers(0, hi, n).astype(np.uint16 if dt.itemsize == 2 else np.uint8)
    if edge is not None:
        codes = _E.decode_codes(fmt, dt.itemsize)
        n = codes.size
    if draw(st.booleans()):
        codes = codes.reshape(1, n)
    return dict(codes=codes.view(dt), fmt=fmt)


@st.composite
def pack_fp4_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``formats.pack_fp4``: uint8 codes 0..15 with an even last axis; both nibble orders."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "formats.pack_fp4", pins)
    k = draw(st.integers(1, max(1, b.max_elements // 2)))
    lead = draw(st.sampled_from([(), (1,), (3,)]))
    rng = _rng(draw)
    codes = rng.integers(0, 16, lead + (2 * k,)).astype(np.uint8) if edge is None else _E.nibble_pairs()
    return dict(codes=codes, nibble_order=_choose(draw, pins, "nibble_order", ("low_first", "high_first")))


@st.composite
def unpack_fp4_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``formats.unpack_fp4``: any uint8 bytes; both nibble orders."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "formats.unpack_fp4", pins)
    k = draw(st.integers(1, max(1, b.max_elements // 2)))
    lead = draw(st.sampled_from([(), (2,)]))
    rng = _rng(draw)
    packed = rng.integers(0, 256, lead + (k,)).astype(np.uint8) if edge is None else np.arange(256, dtype=np.uint8)
    return dict(packed=packed,
                nibble_order=_choose(draw, pins, "nibble_order", ("low_first", "high_first")))


# ---------------------------------------------------------------------------------------------------
# dynamic_block_quant


_DBQ_CODES = {"int8": (1,), "float8_e5m2": (23, 291), "float8_e4m3fn": (24, 292), "hifloat8": (290,)}


@st.composite
def dynamic_block_quant_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``dynamic_block_quant``: 2-D / 3-D float16 / bfloat16 / float32 ``x`` (edge blocks partial, zero
    blocks, optionally +-inf / nan), every destination (as a name or a torch_npu code), block shapes of the
    chip limits, ``min_scale``, ``dst_type_max`` (HiFloat8) and both ``scale_order`` values (OPEN)."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "dynamic_block_quant", pins)
    dst = _choose(draw, pins, "dst_type", tuple(_DBQ_CODES))
    as_code = draw(st.booleans())
    dst_arg = draw(st.sampled_from(_DBQ_CODES[dst])) if as_code else dst
    xdt = _choose(draw, pins, "x_dtype", ("float16", "bfloat16", "float32"))
    rank = _choose(draw, pins, "x_ndim", (2, 3))
    m = _E.pinned_int(draw, pins, "rows", 1, 6)
    n = draw(st.integers(1, max(1, min(b.max_elements, 320)))) if edge is None else 2 * 128 + 3
    shape = (m, n) if rank == 2 else (draw(st.integers(1, 2)), m, n)
    rb = _choose(draw, pins, "row_block_size", (1, 2, 64, 128))
    cb = _choose(draw, pins, "col_block_size", (1, 64, 128, 192, 256))
    min_scale = _choose(draw, pins, "min_scale", (0.0, 0.0, 1e-3, 0.5, 8.0))
    scale_order = _choose(draw, pins, "scale_order", ("divide", "multiply") if min_scale == 0 else ("divide",))
    dmax = _choose(draw, pins, "dst_type_max", (0.0, 15.0, 56.0, 224.0, 32768.0) if dst == "hifloat8" else (0.0,))
    specials = _choose(draw, pins, "specials", (False, True))
    rng = _rng(draw)
    x = _group_values(rng, shape)
    if edge is not None:
        x = _E.dbq_x(rng, edge, x, dst, dmax, cb)
    if specials:
        sp = rng.random(shape) < 0.03
        x[sp] = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), int(sp.sum()))
    x = x.astype(np.float32 if xdt == "float32" else _NP_IN[xdt])
    return dict(x=x, min_scale=min_scale, round_mode="round" if dst == "hifloat8" else "rint", dst_type=dst_arg,
                row_block_size=rb, col_block_size=cb, dst_type_max=dmax, scale_order=scale_order)


# ---------------------------------------------------------------------------------------------------
# cache writers


@st.composite
def scatter_by_slot_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``scatter_by_slot``: a paged cache ``[block_num, block_size, *row]`` of any dtype prefilled with random
    bytes, rows of its dtype, distinct slots with ``-1`` skips (int32 / int64)."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "scatter_by_slot", pins)
    dt = _choose(draw, pins, "cache_dtype", ("uint8", "int8", "float16", "bfloat16", "float32", "int32"))
    bn = draw(st.integers(1, 4))
    bs = _E.block_size(draw, pins, min(b.max_block_size, 16), edge)
    row = draw(st.sampled_from([(1, 8), (16,), (2, 4), (1, 1)]))
    t = _E.tokens(draw(st.integers(1, b.max_tokens)), edge)
    rng = _rng(draw)
    npdt = np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)
    cache = poison_bytes(rng, (bn, bs) + row, npdt)
    rows = poison_bytes(rng, (t,) + row, npdt)
    slots = slot_mapping(rng, t, bn * bs, skip_fraction=draw(st.sampled_from([0.0, 0.25, 0.6])),
                         dtype=_choose(draw, pins, "slot_dtype", ("int64", "int32")))
    return dict(cache=cache, rows=rows, slot_mapping=_E.slots_edge(slots, edge, bn * bs, bs))


def _c8_cache(draw, rng, pins, b: Bounds, t: int, rope: bool, edge=None):
    bn = draw(st.integers(1, 4))
    bs = _E.block_size(draw, pins, max(1, min(b.max_block_size, 16)), edge)
    cdt = _choose(draw, pins, "cache_dtype", ("uint8", "int8", "float8_e4m3fn"))
    npdt = {"uint8": np.dtype(np.uint8), "int8": np.dtype(np.int8),
            "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}[cdt]
    cache = poison_bytes(rng, (bn, bs, 1, 656 if rope else 528), npdt)
    slots = slot_mapping(rng, t, bn * bs, skip_fraction=draw(st.sampled_from([0.0, 0.25, 0.5])),
                         dtype=_choose(draw, pins, "slot_dtype", ("int64", "int32")))
    return cache, _E.slots_edge(slots, edge, bn * bs, bs)


@st.composite
def c8_cache_write_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``c8_cache_write``: ``k_nope [T, 512]`` (per-tile magnitudes over five decades, all-zero tiles),
    ``k_rope [T, 64]`` or None (rope 0), a random-byte packed cache (uint8 / int8 / float8_e4m3fn), slots
    with ``-1``, ``key_dtype`` int8 / float8_e4m3fn and both ``scale_order`` values (OPEN)."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "c8_cache_write", pins)
    qdt = _choose(draw, pins, "dtype", ("bfloat16", "float16"))
    rope = _choose(draw, pins, "rope", (True, False))
    t = _E.tokens(draw(st.integers(1, b.max_tokens)), edge)
    rng = _rng(draw)
    k_nope = _group_values(rng, (t, 512)).astype(np.float32)
    key_dtype = _choose(draw, pins, "key_dtype", ("int8", "float8_e4m3fn"))
    if edge is not None and edge.startswith("ties:"):
        k_nope = _E.c8_ties(rng, t, key_dtype)
    elif edge == "zero_tiles":
        k_nope = _E.zero_tiles(k_nope, 128)
    k_nope = np.clip(k_nope, -6e4, 6e4).astype(_QDT[qdt])
    k_rope = rng.standard_normal((t, 64)).astype(_QDT[qdt]) if rope else None
    cache, slots = _c8_cache(draw, rng, pins, b, t, rope, edge)
    return dict(k_nope=k_nope, k_rope=k_rope, slot_mapping=slots, kv_cache=cache, key_dtype=key_dtype,
                scale_order=_choose(draw, pins, "scale_order", ("divide", "multiply")))


@st.composite
def c8_rmsnorm_rope_cache_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``c8_rmsnorm_rope_cache``: ``kv [T, 512 + rope]``, ``gamma [512]``, half-split cos/sin ``[T, 64]``
    (None at rope 0), epsilon, a random-byte packed cache and slots with ``-1``."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "c8_rmsnorm_rope_cache", pins)
    qdt = _QDT[_choose(draw, pins, "dtype", ("bfloat16", "float16"))]
    rope = _choose(draw, pins, "rope_head_dim", (64, 0))
    t = _E.tokens(draw(st.integers(1, b.max_tokens)), edge)
    rng = _rng(draw)
    kv = (rng.standard_normal((t, 512 + rope)) * 10.0 ** rng.uniform(-2, 1, (t, 1))).astype(qdt)
    gamma = (1 + 0.25 * rng.standard_normal(512)).astype(qdt)
    key_dtype = _choose(draw, pins, "key_dtype", ("int8", "float8_e4m3fn"))
    if edge is not None and edge.startswith("ties:"):
        nope, g = _E.c8r_ties(rng, t, key_dtype)
        kv[:, :512], gamma = nope.astype(qdt), g.astype(qdt)
    elif pins.get("small_norm"):  # mean square ~1e-6: the epsilon is not negligible
        kv = (kv.astype(np.float32) * 1e-3).astype(qdt)
    cos = sin = None
    if rope:
        ang = rng.uniform(0, 2 * np.pi, (t, 32))
        cos = np.concatenate([np.cos(ang)] * 2, axis=-1).astype(qdt)
        sin = np.concatenate([np.sin(ang)] * 2, axis=-1).astype(qdt)
    cache, slots = _c8_cache(draw, rng, pins, b, t, bool(rope), edge)
    return dict(kv=kv, gamma=gamma, cos=cos, sin=sin, slot_mapping=slots, kv_cache=cache,
                epsilon=_choose(draw, pins, "epsilon", (1e-6, 1e-5)), rope_head_dim=rope, key_dtype=key_dtype,
                scale_order=_choose(draw, pins, "scale_order", ("divide", "multiply")))


def strided_like(a: np.ndarray, strides) -> np.ndarray:
    """A fresh array with ``a``'s values laid out with (positive) byte ``strides``; the gaps hold 0xA5."""
    item = a.dtype.itemsize
    span = sum((n - 1) * s for n, s in zip(a.shape, strides)) + item if a.size else item
    # as_strided goes through the array interface, which does not know ml_dtypes (bfloat16, float8): stride
    # an unsigned integer carrier of the same size and view it as the dtype afterwards
    carrier = np.dtype(f"u{item}") if item in (1, 2, 4, 8) else a.dtype
    buf = np.full(-(-span // item) * item, 0xA5, np.uint8).view(carrier)
    out = np.lib.stride_tricks.as_strided(buf, shape=a.shape, strides=tuple(strides)).view(a.dtype)
    out[...] = a
    return out


def clone(a):
    """A copy of ``a`` that keeps a non-contiguous layout (see :func:`strided_like`); other values as they are."""
    if not isinstance(a, np.ndarray):
        return a
    if a.flags.c_contiguous:
        return a.copy()
    return strided_like(a, a.strides)


@st.composite
def kv_compress_epilog_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``kv_compress_epilog``: bf16 ``x [..., d]`` (1 or 2 leading dims), a random-byte uint8 cache with
    ``headDim >= kvCacheCol`` that may be strided along blockNum, slots with ``-1``, every ``quant_mode``,
    group size, ``round_scale``, ``x_scale`` and the OPEN ``pad_to`` / ``fp4_nibble_order``."""
    from .reference.kv_compress_epilog import kv_cache_col

    b = _b(bounds)
    pins, edge = _E.take(draw, "kv_compress_epilog", pins)
    mode = _choose(draw, pins, "quant_mode", (0, 1, 2))
    gs = _choose(draw, pins, "quant_group_size", (16, 32, 64) if mode == 2 else (64, 16, 128))
    d = _choose(draw, pins, "d", (128, 192, 256, 576))
    pad_to = _choose(draw, pins, "pad_to", (32, 128))
    t = _E.tokens(draw(st.integers(1, b.max_tokens)), edge)
    lead = (t,) if draw(st.booleans()) or t % 2 else (2, t // 2)
    rng = _rng(draw)
    x = _group_values(rng, lead + (d,))
    if edge is not None and edge.split(":")[0] in ("zero_groups", "ties", "mode"):
        x2 = x.reshape(-1, d)
        x2[:, :d - 64] = _E.kce_nope(rng, edge, x2[:, :d - 64], mode, gs)
    x = x.astype(_BF16)
    col = kv_cache_col(d, mode, gs, pad_to)
    head = col + draw(st.sampled_from([0, 0, 7, 32]))
    bn = draw(st.integers(1, 4))
    bs = _E.block_size(draw, pins, min(b.max_block_size, 8), edge)
    cache = poison_bytes(rng, (bn, bs, 1, head), np.uint8)
    if draw(st.booleans()):  # blockNum stride larger than a block: a non-contiguous view
        item = cache.strides
        cache = strided_like(cache, (item[0] + 64 * draw(st.integers(1, 3)),) + item[1:])
    slots = slot_mapping(rng, int(np.prod(lead)), bn * bs, skip_fraction=draw(st.sampled_from([0.0, 0.3])),
                         dtype=_choose(draw, pins, "slot_dtype", ("int64", "int32")))
    slots = _E.slots_edge(slots, edge, bn * bs, bs).reshape(lead)
    return dict(cache=cache, x=x, slot_mapping=slots, quant_group_size=gs, quant_mode=mode,
                round_scale=_choose(draw, pins, "round_scale", (True, False)),
                x_scale=_choose(draw, pins, "x_scale", (1.0, 0.37, 3.0)), pad_to=pad_to,
                fp4_nibble_order=_choose(draw, pins, "fp4_nibble_order", ("low_first", "high_first")))


_KRR_MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")


@st.composite
def kv_rmsnorm_rope_cache_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``kv_rmsnorm_rope_cache``: V1 / V2, all six cache modes, 16-bit and 8-bit caches (int8, FP8, HiFloat8
    with static scales and optional offsets in every parameter shape), ``[B, N, 1, Dk]`` cos/sin, skipped
    tokens; built by :func:`qsfa.ops.cache.kv_rmsnorm_rope_cache_example` from drawn knobs and kept only if
    the contract accepts them."""
    from .ops.cache import KRR_CONTRACT, kv_rmsnorm_rope_cache_example

    b = _b(bounds)
    pins, edge = _E.take(draw, "kv_rmsnorm_rope_cache", pins)
    version = _choose(draw, pins, "version", (1, 2))
    mode = _choose(draw, pins, "cache_mode", _KRR_MODES)
    dtype = _choose(draw, pins, "dtype", ("bfloat16", "float16"))
    fmts = ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8", dtype)
    k_fmt = _choose(draw, pins, "k_fmt", fmts)
    ckv_fmt = _choose(draw, pins, "ckv_fmt", fmts)
    heads = 1 if version == 1 else _choose(draw, pins, "heads", (1, 2, 4, 8) if b.max_heads >= 8 else (1, 2))
    dk = draw(st.sampled_from((32, 64)))
    dv = draw(st.sampled_from((32, 64, 128)))
    rope = dk if version == 1 else draw(st.sampled_from(tuple(r for r in (16, 32, 64) if r <= dk)))
    any8 = k_fmt in fmts[:4] or ckv_fmt in fmts[:4]
    bs_opts = tuple(x for x in (16, 32, 64) if x <= max(b.max_block_size, 32) and (x % 32 == 0 or not any8))
    block_size = draw(st.sampled_from(bs_opts)) if mode != "Norm" else None
    seq = _E.pinned_int(draw, pins, "seq", 1, max(1, b.max_q_tokens))
    batch = _E.pinned_int(draw, pins, "batch", 1, b.max_batch)
    offsets = _choose(draw, pins, "offsets", (False, True)) and any8
    param_shape = draw(st.sampled_from(("ND", "D", "1D", "1")))
    rng = _rng(draw)
    args = kv_rmsnorm_rope_cache_example(
        rng, version=version, cache_mode=mode, dtype=dtype, k_fmt=k_fmt, ckv_fmt=ckv_fmt, batch=batch,
        heads=heads, seq=seq, dv=dv, dk=dk, rope=rope, block_size=block_size,
        cache_seq=seq + draw(st.integers(0, 2)) if mode == "Norm" else None, offsets=offsets,
        cos_seq1=draw(st.booleans()), param_shape=param_shape, skip=draw(st.booleans()),
        is_output_kv=draw(st.booleans()), sentinel=int(rng.integers(0, 256)))
    args["epsilon"] = _choose(draw, pins, "epsilon", (1e-5, 1e-6))
    if edge is not None:
        args = _E.krr_edge(rng, args, edge)
    assume(KRR_CONTRACT.first_violation(Args(args)) is None)
    return args


# ---------------------------------------------------------------------------------------------------
# attention: shared structure (layouts, lengths, block tables, sparse indices, poisoning)


@dataclass
class _KvPlan:
    """Where each logical KV token lives (storage rows no token maps to are never read)."""

    layout_kv: str
    key_lead: tuple  # leading shape of the key storage (before [1, W])
    act_kv: np.ndarray  # [B]
    flat_of: np.ndarray  # [B, max_kv] flat storage row of (b, j), -1 past actKV
    block_table: np.ndarray | None
    lens_kv: np.ndarray | None  # actual_seq_lengths_kv as passed (None = implied)
    block_size: int = 0


@dataclass
class _QPlan:
    layout_query: str
    q_lead: tuple  # (B, Q_S) or (T,)
    act_q: np.ndarray
    lens_q: np.ndarray | None
    batch: np.ndarray  # [R] batch of each query row
    pos: np.ndarray  # [R]
    valid: np.ndarray  # [R] real (not padding) rows


def _lengths(draw, n: int, lo: int, hi: int) -> np.ndarray:
    """``n`` sequence lengths in [lo, hi] drawn by hypothesis (so a failing example shrinks to short ones)."""
    return np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), np.int64)


def _plan_query(draw, rng, b: Bounds, layout_query: str, batch: int, pins) -> _QPlan:
    max_q = max(1, b.max_q_tokens)
    if layout_query == "BSND":
        q_s = _E.pinned_int(draw, pins, "q_tokens", 1, max_q)
        explicit = _choose(draw, pins, "explicit_lengths", (False, True))
        act_q = (_lengths(draw, batch, 0, q_s) if explicit and draw(st.integers(0, 9)) < 7 else np.full(batch, q_s))
        act_q = _E.query_lengths(act_q.astype(np.int64), pins, q_s)
        lens = act_q.astype(np.int32) if explicit else None
        bb = np.repeat(np.arange(batch), q_s)
        pos = np.tile(np.arange(q_s), batch)
        return _QPlan("BSND", (batch, q_s), act_q, lens, bb, pos, pos < act_q[bb])
    act_q = np.maximum(_lengths(draw, batch, 0, max_q), pins.get("q_tokens", 0)).astype(np.int64)
    if act_q.sum() == 0:
        act_q[0] = 1
    act_q = _E.query_lengths(act_q, pins, max_q)
    ends = np.cumsum(act_q)
    extra = int(draw(st.sampled_from([0, 0, 1, 2])))
    t = int(ends[-1]) + extra
    r = np.arange(t)
    bb = np.searchsorted(ends, r, side="right")
    valid = bb < batch
    starts = np.concatenate([[0], ends[:-1]])
    bc = np.minimum(bb, batch - 1)
    pos = np.where(valid, r - starts[bc], 0)
    return _QPlan("TND", (t,), act_q, ends.astype(np.int32), np.where(valid, bc, 0), pos, valid)


def _plan_kv(draw, rng, b: Bounds, layout_kv: str, batch: int, pins, *, block_sizes, act_kv=None) -> _KvPlan:
    max_kv = max(1, b.max_kv_tokens)
    if act_kv is None:
        act_kv = _lengths(draw, batch, 0, max_kv)
        if draw(st.booleans()):  # long sequences are the interesting ones
            act_kv = np.maximum(act_kv, _lengths(draw, batch, max_kv // 2, max_kv))
        act_kv = _E.kv_lengths(act_kv, pins)
    mk = max(int(act_kv.max(initial=0)), 1)
    j = np.arange(mk)[None, :]
    live = j < act_kv[:, None]
    if layout_kv == "BSND":
        kv_s = mk + int(draw(st.sampled_from([0, 0, 1, 3])))
        explicit = _choose(draw, pins, "explicit_lengths", (False, True))
        if not explicit:
            act_kv = np.full(batch, kv_s, np.int64)
            mk = kv_s
            j = np.arange(mk)[None, :]
            live = j < act_kv[:, None]
        flat = np.where(live, np.arange(batch)[:, None] * kv_s + j, -1)
        return _KvPlan("BSND", (batch, kv_s), act_kv, flat, None,
                       act_kv.astype(np.int32) if explicit else None)
    if layout_kv == "TND":
        ends = np.cumsum(act_kv)
        kv_t = max(int(ends[-1]) + int(draw(st.sampled_from([0, 0, 2]))), 1)
        starts = np.concatenate([[0], ends[:-1]])
        flat = np.where(live, starts[:, None] + j, -1)
        return _KvPlan("TND", (kv_t,), act_kv, flat, None, ends.astype(np.int32))
    bs = int(_choose(draw, pins, "block_size", tuple(block_sizes)))
    need = -(-act_kv // bs)
    width = max(int(need.max(initial=0)), 1) + int(draw(st.sampled_from([0, 0, 1])))
    used = int(need.sum())
    nb = used + int(draw(st.sampled_from([0, 1, 2])))
    nb = max(nb, 1)
    phys = rng.permutation(nb)
    bt = rng.integers(-1, nb, (batch, width)).astype(np.int64)  # junk in unused entries
    col = np.arange(width)[None, :]
    used_mask = col < need[:, None]
    bt[used_mask] = phys[:used]
    blk = np.take_along_axis(bt, np.broadcast_to(np.minimum(j // bs, width - 1), (batch, mk)), axis=1)
    flat = np.where(live, blk * bs + j % bs, -1)
    return _KvPlan("PA_BSND", (nb, bs), act_kv, flat, bt.astype(np.int32), act_kv.astype(np.int32), bs)


def _row_limits(q: _QPlan, act_kv: np.ndarray, sparse_mode: int):
    akv = act_kv[q.batch]
    thr = akv - q.act_q[q.batch] + q.pos + 1 if sparse_mode == 3 else akv.copy()
    thr = np.where(q.valid, thr, 0)
    return thr, np.clip(np.minimum(akv, thr), 0, None)


def _indices(draw, rng, q: _QPlan, kv: _KvPlan, sparse_mode: int, sbs: int, width: int, pins) -> np.ndarray:
    _, limit = _row_limits(q, kv.act_kv, sparse_mode)
    lb = -(-limit // sbs)
    fill = pins["fill"] if "fill" in pins else 1.0 if draw(st.booleans()) else rng.uniform(0, 1, limit.size)
    junk = _choose(draw, pins, "junk_after_minus1", (False, True))
    strays = _choose(draw, pins, "stray_entries", (0.0, 0.5, 1.0))
    total = -(-kv.act_kv[q.batch] // sbs)  # per row: strays below actKV (past it only when no room is left)
    idx = sparse_index_rows(rng, lb, width, fill=fill, junk_after=junk, total_blocks=total, strays=float(strays))
    return idx.reshape(q.q_lead + (1, width))


def _place_rows(kv: _KvPlan, logical: np.ndarray, poison_row: np.ndarray) -> np.ndarray:
    """Storage ``[*key_lead, 1, W]`` holding ``logical [B, max_kv, W]`` at the planned rows; every other row is
    ``poison_row [W]``."""
    n_rows = int(np.prod(kv.key_lead))
    w = logical.shape[-1]
    out = np.empty((n_rows, w), logical.dtype)
    out[:] = poison_row
    live = kv.flat_of >= 0
    out[kv.flat_of[live]] = logical[:, : kv.flat_of.shape[1]][live]
    return out.reshape(kv.key_lead + (1, w))


def _store_q(x: np.ndarray, q: _QPlan) -> np.ndarray:
    """Query-like data ``[R, ...]`` in the query's leading shape."""
    return np.ascontiguousarray(x.reshape(q.q_lead + x.shape[1:]))


def _attention_common(draw, b: Bounds, pins, *, heads_options, block_sizes):
    layout_query = _choose(draw, pins, "layout_query", ("BSND", "TND"))
    layout_kv = _choose(draw, pins, "layout_kv", (layout_query, "PA_BSND"))
    if layout_kv != "PA_BSND":  # without paging the KV layout is the query's (a pinned KV layout wins)
        layout_query = layout_kv
    batch = _E.pinned_int(draw, pins, "batch", 1, b.max_batch)
    heads = tuple(h for h in heads_options if h <= b.max_heads) or (heads_options[0],)
    n_heads = _choose(draw, pins, "n_heads", heads)
    sparse_mode = _choose(draw, pins, "sparse_mode", (3, 0))
    rng = _rng(draw)
    q = _plan_query(draw, rng, b, layout_query, batch, pins)
    kv = _plan_kv(draw, rng, b, layout_kv, batch, pins, block_sizes=block_sizes)
    return rng, q, kv, n_heads, sparse_mode


def _pa_block_sizes(b: Bounds, mult=16):
    opts = tuple(x for x in (16, 32, 48, 64, 128) if x % mult == 0 and x <= max(b.max_block_size, 16))
    return opts or (16,)


# ---------------------------------------------------------------------------------------------------
# kv_quant_sparse_flash_attention


@st.composite
def qsfa_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``kv_quant_sparse_flash_attention``: packed rows (int8 / FP8 E4M3FN / HiFloat8 NoPE, rope 0 or 64,
    bf16 / fp16 query) in BSND / TND / PA_BSND with poisoned unused rows; causal sparse indices with -1
    padding (non-causal strays and junk after the first -1 included); sparse_mode 0 / 3, sparse_block_size
    1-16 (1 with HiFloat8, which needs sparse_size 2048 and exists on Ascend 950 only), every supported Q_N
    up to ``max_heads``; LSE on/off; precision and the OPEN probability_rounding.

    pins (a value or a tuple of allowed values): ``layout_query``, ``layout_kv``, ``key_dtype``,
    ``rope_head_dim``, ``dtype``, ``n_heads``, ``sparse_mode``, ``sparse_block_size``, ``return_softmax_lse``,
    ``precision``, ``probability_rounding``, ``value_is_key``, ``key_array``, ``scale_value``,
    ``explicit_lengths``, ``junk_after_minus1``, ``stray_entries`` (fraction: 0.0, 0.5, 1.0)."""
    from .ops.attention import QSFA_QUERY_HEADS

    b = _b(bounds)
    pins, _ = _E.take(draw, "kv_quant_sparse_flash_attention", pins)
    key_fmt = _choose(draw, pins, "key_dtype", ("int8", "float8_e4m3fn", "hifloat8"))
    rope = 64 if key_fmt == "hifloat8" else _choose(draw, pins, "rope_head_dim", (64, 0))
    qname = _choose(draw, pins, "dtype", ("bfloat16", "float16"))
    qdt = _QDT[qname]
    # HiFloat8 KV is an Ascend 950 format and 950 supports sparse_block_size 1 only (seed 000)
    sbs = 1 if key_fmt == "hifloat8" else _choose(draw, pins, "sparse_block_size", (1, 2, 4, 8, 16))
    rng, q, kv, n_heads, sparse_mode = _attention_common(draw, b, pins, heads_options=QSFA_QUERY_HEADS,
                                                         block_sizes=_pa_block_sizes(b))
    width = 2048 if key_fmt == "hifloat8" else _E.sparse_width(draw, pins, b.max_sparse, kv.act_kv, sbs)
    idx = _indices(draw, rng, q, kv, sparse_mode, sbs, width, pins)

    # logical packed rows [B, max_kv, W]
    bsz, mk = kv.flat_of.shape
    codes, smag = _nope_codes(rng, (bsz, mk, 512), key_fmt)
    scales = (smag * rng.uniform(0.5, 1.5, (bsz, mk, 4))).astype("<f4")
    parts = [codes]
    if rope:
        parts.append(rng.uniform(-1, 1, (bsz, mk, 64)).astype(qdt).view(np.uint8))
    parts.append(scales.view(np.uint8))
    logical = np.concatenate(parts, axis=-1)
    nan_code = _NAN_CODE[key_fmt]
    poison = np.empty(logical.shape[-1], np.uint8)
    poison[:512] = nan_code if nan_code is not None else 0x7F
    if rope:
        poison[512:640] = np.full(64, _NAN16[qname], np.uint16).view(np.uint8)
    poison[-16:] = np.full(4, np.nan, "<f4").view(np.uint8)
    key = _place_rows(kv, logical, poison)
    arr = _choose(draw, pins, "key_array", {"int8": ("int8", "uint8"), "float8_e4m3fn": ("float8_e4m3fn", "uint8"),
                                            "hifloat8": ("uint8",)}[key_fmt])
    key = key.view({"int8": np.int8, "uint8": np.uint8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}[arr])
    value_is_key = _choose(draw, pins, "value_is_key", (True, True, False))
    value = key if value_is_key else np.ascontiguousarray(key[..., :512])

    rows = q.batch.size
    query = _store_q(rng.uniform(-1, 1, (rows, n_heads, 512 + rope)).astype(qdt), q)
    scale = _choose(draw, pins, "scale_value", ((512 + 64) ** -0.5, 0.1, 0.02))
    return dict(query=query, key=key, value=value, sparse_indices=idx, scale_value=float(scale),
                key_quant_mode=2, value_quant_mode=2, key_dequant_scale=None, value_dequant_scale=None,
                block_table=kv.block_table, actual_seq_lengths_query=q.lens_q, actual_seq_lengths_kv=kv.lens_kv,
                sparse_block_size=sbs, layout_query=q.layout_query, layout_kv=kv.layout_kv,
                sparse_mode=sparse_mode, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2,
                quant_scale_repo_mode=1, tile_size=128, rope_head_dim=rope,
                return_softmax_lse=_choose(draw, pins, "return_softmax_lse", (False, True)), key_dtype=key_fmt,
                precision=_choose(draw, pins, "precision", ("faithful", "faithful", "exact")),
                probability_rounding=_choose(draw, pins, "probability_rounding", ("unnormalised", "normalised")))


# ---------------------------------------------------------------------------------------------------
# sparse_flash_attention


@st.composite
def sfa_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``sparse_flash_attention``: float KV (bf16 / fp16) in BSND / TND / PA_BSND with NaN in every unused
    row, value or None (V = key), optional query_rope / key_rope, sinks (+ the OPEN lse_includes_sink),
    sparse_block_size 1-128 (dividing block_size under PA), causal sparse indices with -1 padding.

    pins: as :func:`qsfa_args` plus ``rope``, ``has_value``, ``sinks``, ``attention_mode``."""
    from .ops.attention import SFA_QUERY_HEADS

    b = _b(bounds)
    pins, _ = _E.take(draw, "sparse_flash_attention", pins)
    qname = _choose(draw, pins, "dtype", ("bfloat16", "float16"))
    qdt = _QDT[qname]
    rng, q, kv, n_heads, sparse_mode = _attention_common(draw, b, pins, heads_options=SFA_QUERY_HEADS,
                                                         block_sizes=_pa_block_sizes(b))
    sbs_opts = (1, 2, 4, 8, 16, 32, 64, 128)
    if kv.layout_kv == "PA_BSND":
        sbs_opts = tuple(s for s in sbs_opts if kv.block_size % s == 0)
    sbs = _choose(draw, pins, "sparse_block_size", sbs_opts)
    width = _E.sparse_width(draw, pins, b.max_sparse, kv.act_kv, sbs)
    idx = _indices(draw, rng, q, kv, sparse_mode, sbs, width, pins)
    bsz, mk = kv.flat_of.shape
    rope = _choose(draw, pins, "rope", (True, False))
    has_value = _choose(draw, pins, "has_value", (True, False))
    nan_row = lambda w: np.full(w, np.nan, np.float32).astype(qdt)  # noqa: E731
    key = _place_rows(kv, rng.uniform(-1, 1, (bsz, mk, 512)).astype(qdt), nan_row(512))
    value = _place_rows(kv, rng.uniform(-1, 1, (bsz, mk, 512)).astype(qdt), nan_row(512)) if has_value else None
    rows = q.batch.size
    qr = kr = None
    if rope:
        qr = _store_q(rng.uniform(-1, 1, (rows, n_heads, 64)).astype(qdt), q)
        kr = _place_rows(kv, rng.uniform(-1, 1, (bsz, mk, 64)).astype(qdt), nan_row(64))
    sinks = None
    if _choose(draw, pins, "sinks", (False, False, True)):
        sinks = rng.uniform(-2, 2, n_heads).astype(np.float32)
    lse = False if kv.layout_kv == "PA_BSND" else _choose(draw, pins, "return_softmax_lse", (False, True))
    query = _store_q(rng.uniform(-1, 1, (rows, n_heads, 512)).astype(qdt), q)
    return dict(query=query, key=key, value=value, sparse_indices=idx,
                scale_value=float(_choose(draw, pins, "scale_value", ((512 + 64) ** -0.5, 0.1))),
                block_table=kv.block_table, actual_seq_lengths_query=q.lens_q, actual_seq_lengths_kv=kv.lens_kv,
                query_rope=qr, key_rope=kr, sparse_block_size=sbs, layout_query=q.layout_query,
                layout_kv=kv.layout_kv, sparse_mode=sparse_mode, pre_tokens=INT64_MAX, next_tokens=INT64_MAX,
                attention_mode=_choose(draw, pins, "attention_mode", (2, 2, 0)), return_softmax_lse=lse,
                sinks=sinks, lse_includes_sink=_choose(draw, pins, "lse_includes_sink", (False, True)),
                precision=_choose(draw, pins, "precision", ("faithful", "faithful", "exact")),
                probability_rounding=_choose(draw, pins, "probability_rounding", ("unnormalised", "normalised")))


# ---------------------------------------------------------------------------------------------------
# lightning indexers


@st.composite
def lightning_indexer_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``lightning_indexer``: integer-valued query / key / weights (scores exact in fp32, so ties are decided
    by the OPEN tie_break alone), N1 up to ``min(64, max_heads)``, every KV layout with NaN in unused rows,
    sparse_count up to ``max_sparse``, return_value (not under PA_BSND)."""
    b = _b(bounds)
    pins, _ = _E.take(draw, "lightning_indexer", pins)
    qname = _choose(draw, pins, "dtype", ("bfloat16", "float16"))
    qdt = _QDT[qname]
    rng, q, kv, n_heads, sparse_mode = _attention_common(draw, b, pins, heads_options=tuple(range(1, 65)),
                                                         block_sizes=_pa_block_sizes(b))
    bsz, mk = kv.flat_of.shape
    key_rows = rng.integers(-3, 4, (bsz, mk, 128))
    if pins.get("constant_rows"):  # every key equal: every score of a row equal (ties everywhere)
        key_rows[:] = key_rows[:1, :1]
    key = _place_rows(kv, key_rows.astype(qdt), np.full(128, np.nan, np.float32).astype(qdt))
    rows = q.batch.size
    query = _store_q(rng.integers(-3, 4, (rows, n_heads, 128)).astype(qdt), q)
    wdt = _choose(draw, pins, "weights_dtype", (qname, "float32"))
    weights = _store_q(rng.integers(-2, 3, (rows, n_heads)).astype(np.float32).astype(_QDT.get(wdt, np.float32)), q)
    ret = False if kv.layout_kv == "PA_BSND" else _choose(draw, pins, "return_value", (False, True))
    return dict(query=query, key=key, weights=weights, actual_seq_lengths_query=q.lens_q,
                actual_seq_lengths_key=kv.lens_kv, block_table=kv.block_table, layout_query=q.layout_query,
                layout_key=kv.layout_kv, sparse_count=_E.pinned_int(draw, pins, "sparse_count", 1, max(1, b.max_sparse)),
                sparse_mode=sparse_mode, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, return_value=ret,
                tie_break="lower_index")


@st.composite
def quant_lightning_indexer_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``quant_lightning_indexer``: int8 / FP8 E4M3FN / HiFloat8 codes of integer value in [-4, 4], dequant
    scales in {1/4, 1/2, 1} and weights in [-2, 2] (so every partial sum is a multiple of 1/16 below 2^18:
    scores exact in fp32), float16 / float32 scales, every KV layout; unused key rows hold NaN codes where the
    format has one."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "quant_lightning_indexer", pins)
    fmt = _choose(draw, pins, "format", ("int8", "float8_e4m3fn", "hifloat8"))
    rng, q, kv, n_heads, sparse_mode = _attention_common(draw, b, pins, heads_options=tuple(range(1, 65)),
                                                         block_sizes=_pa_block_sizes(b))
    bsz, mk = kv.flat_of.shape
    rows = q.batch.size
    poison = np.full(128, _NAN_CODE[fmt] if _NAN_CODE[fmt] is not None else 0x7F, np.uint8)
    key_codes = _exact_codes(rng, (bsz, mk, 128), fmt)
    if pins.get("constant_rows"):  # every key equal: every score of a row equal (ties everywhere)
        key_codes[:] = key_codes[:1, :1]
    key = _place_rows(kv, key_codes, poison)
    query = _store_q(_exact_codes(rng, (rows, n_heads, 128), fmt), q)
    named = fmt == "hifloat8" or draw(st.booleans())
    arr = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "hifloat8": np.uint8}[fmt]
    if named and fmt != "hifloat8" and draw(st.booleans()):
        arr = np.uint8  # codes as raw bytes, the format given by name
    qd = kd = fmt if named else None
    wdt = _QDT[_choose(draw, pins, "weights_dtype", ("float16", "bfloat16"))]
    sdt = np.dtype(_choose(draw, pins, "scale_dtype", ("float16", "float32")))
    weights = _store_q(rng.integers(-2, 3, (rows, n_heads)).astype(wdt), q)
    qs = _store_q(np.exp2(rng.integers(-2, 1, (rows, n_heads))).astype(sdt), q)
    ks = np.exp2(rng.integers(-2, 1, kv.key_lead + (1,))).astype(sdt)
    if pins.get("constant_rows"):
        ks[:] = 1
    args = dict(query=query.view(arr), key=key.view(arr), weights=weights, query_dequant_scale=qs,
                key_dequant_scale=ks, query_quant_mode=0, key_quant_mode=0, actual_seq_lengths_query=q.lens_q,
                actual_seq_lengths_key=kv.lens_kv, block_table=kv.block_table, layout_query=q.layout_query,
                layout_key=kv.layout_kv,
                sparse_count=_E.pinned_int(draw, pins, "sparse_count", 1, max(1, min(2048, b.max_sparse))),
                sparse_mode=sparse_mode, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, query_dtype=qd,
                key_dtype=kd, tie_break="lower_index")
    if edge == "scale_order" and not pins.get("exact_scores") and sdt == np.float32:
        args = _E.qli_scale_order(rng, args, kv.flat_of, fmt)
    return args


# ---------------------------------------------------------------------------------------------------
# merge_attention_lse


@st.composite
def merge_attention_lse_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``merge_attention_lse``: P partial results (float16 / bfloat16 / float32 / float64) with float32 /
    float64 statistics, empty shards (max = sum = 0) included, BSND or TND."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "merge_attention_lse", pins)
    layout = _choose(draw, pins, "layout_query", ("BSND", "TND"))
    parts = _choose(draw, pins, "parts", (1, 2, 3))
    n = draw(st.integers(1, min(8, b.max_heads)))
    d = draw(st.sampled_from((8, 64, 512)))
    odt = _choose(draw, pins, "out_dtype", ("bfloat16", "float16", "float32", "float64"))
    sdt = np.dtype(_choose(draw, pins, "stat_dtype", ("float32", "float64")))
    rng = _rng(draw)
    if layout == "BSND":
        bb, s = draw(st.integers(1, b.max_batch)), draw(st.integers(1, b.max_q_tokens))
        lead, stat = (parts, bb, s, n), (parts, bb, 1, s, n)
    else:
        t = draw(st.integers(1, b.max_batch * b.max_q_tokens))
        lead, stat = (parts, t, n), (parts, 1, t, n)
    out = rng.uniform(-2, 2, lead + (d,)).astype(_NP_IN.get(odt, np.float64))
    m = rng.uniform(-20, 20, stat).astype(sdt)
    s = rng.uniform(1, 300, stat).astype(sdt)
    empty = rng.random(stat) < 0.15
    m[empty] = 0
    s[empty] = 0
    if edge is not None:
        m, s = _E.merge_stats(rng, edge, stat, sdt)
    return dict(attention_out=out, softmax_max=m, softmax_sum=s, layout_query=layout)


# ---------------------------------------------------------------------------------------------------
# registry


#: operator name -> strategy builder ``f(bounds=None, **pins)``
STRATEGIES: dict[str, Callable[..., st.SearchStrategy]] = {
    "formats.encode": encode_args,
    "formats.decode": decode_args,
    "formats.pack_fp4": pack_fp4_args,
    "formats.unpack_fp4": unpack_fp4_args,
    "dynamic_block_quant": dynamic_block_quant_args,
    "scatter_by_slot": scatter_by_slot_args,
    "c8_cache_write": c8_cache_write_args,
    "c8_rmsnorm_rope_cache": c8_rmsnorm_rope_cache_args,
    "kv_compress_epilog": kv_compress_epilog_args,
    "kv_rmsnorm_rope_cache": kv_rmsnorm_rope_cache_args,
    "kv_quant_sparse_flash_attention": qsfa_args,
    "sparse_flash_attention": sfa_args,
    "lightning_indexer": lightning_indexer_args,
    "quant_lightning_indexer": quant_lightning_indexer_args,
    "merge_attention_lse": merge_attention_lse_args,
}


def valid_args(op: str, bounds: Bounds | None = None, *, chip: str | None = None, **pins) -> st.SearchStrategy:
    """A strategy of valid argument dicts for operator ``op``.

    bounds: size limits (default: the active profile's). chip: also keep only arguments within that chip
    family's limits ("A2", "A3", "950"; None = the reference's union). pins: fix drawn choices (see each
    operator's strategy)."""
    try:
        make = STRATEGIES[op]
    except KeyError:
        raise KeyError(f"no strategy for operator {op!r}; known: {sorted(STRATEGIES)}") from None
    s = make(bounds, **pins)
    if chip is not None:
        from ._dispatch import operator

        contract = operator(op).contract
        s = s.filter(lambda a: contract.first_violation(Args(a), chip) is None)
    return s


def _violation_id(contract, args, chip):
    try:
        hit = contract.first_violation(Args(args), chip)
    except Exception:  # a check that cannot even read the broken arguments: not the rule we want
        return None
    return None if hit is None else hit[0].id


def invalid_args(op: str, bounds: Bounds | None = None, *, chip: str | None = None,
                 constraints: Any = None, **pins) -> st.SearchStrategy:
    """A strategy of :class:`InvalidArgs` for ``op``: a valid argument set broken by one constraint's
    ``violate`` function, such that exactly that constraint is the first the contract reports.

    The constraint is drawn from those that apply to ``chip`` (None: the operator's own rules, as the
    reference validates); ``constraints`` restricts them to given ids. The base is a drawn valid set; when
    the constraint's violate function does not make that base fire exactly this rule, the contract's own
    ``example`` is the base (tests/test_contracts.py guarantees that one works), and the draw is discarded
    only if that fails too."""
    from ._contract import copy_args
    from ._dispatch import operator

    contract = operator(op).contract
    cands = [c for c in contract.constraints if c.violate is not None and c.drawn and c.applies_to(chip)
             and (constraints is None or c.id in set(constraints))]
    if not cands:
        raise ValueError(f"no constraint of {op!r} applies (chip={chip!r}, constraints={constraints!r})")

    @st.composite
    def strat(draw):
        c = draw(st.sampled_from(cands))
        base = draw(valid_args(op, bounds, **pins))
        bad = None
        try:
            with np.errstate(all="ignore"):
                bad = c.violate(copy_args(base))
        except Exception:
            bad = None
        if bad is None or _violation_id(contract, bad, chip) != c.id:
            seed = draw(st.integers(0, 2**16))
            try:
                with np.errstate(all="ignore"):
                    bad = c.violate(contract.example(np.random.default_rng(seed)))
            except Exception:
                bad = None
            assume(bad is not None and _violation_id(contract, bad, chip) == c.id)
        return InvalidArgs(bad, c)

    return strat()


def with_bounds(b: Bounds, **changes) -> Bounds:
    """A copy of ``b`` with some fields changed."""
    return replace(b, **changes)


from . import strategies_more  # noqa: E402,F401  (registers the strategies of the operators it covers)
