"""Constraint builders and argument helpers shared by the attention-group contracts.

Used by :mod:`qsfa.ops.attention` (QSFA, SFA), :mod:`qsfa.ops.indexer` (the lightning indexers) and
:mod:`qsfa.ops.lse` (the LSE merge). Every builder returns :class:`~qsfa._contract.Constraint` objects whose
violate function rebuilds a valid argument set of the operator (its case builder, ``Names.make``) and
breaks exactly one rule; only parameter names differ between the operators. The rules are documented in
docs/numerics/attention.md and docs/numerics/indexer.md. Generic builders live in :mod:`qsfa._checks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from .._arrays import dtype_name
from .._contract import Constraint, copy_args, one_of, params
from .._errors import Raw


# ==================================================================================================
# constraint builders shared by the contracts below
#
# Every builder returns Constraint objects whose violate function rebuilds a valid argument set of the
# operator (its case builder, ``Names.make``) and breaks exactly one rule. The layout / length /
# block-table rules (seed 000 parameter table; torch_npu docs of npu_sparse_flash_attention,
# npu_lightning_indexer, npu_quant_lightning_indexer) are shared; only parameter names differ.

LAYOUTS_Q = ("BSND", "TND")
LAYOUTS_KV = ("BSND", "TND", "PA_BSND")
INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Names:
    """The operator's name, its parameter names and its case builder.

    make(**variant) -> a valid argument dict (NumPy); variants used here: ``layout_query``,
    ``layout_kv`` (the KV/key layout whatever its parameter name), ``explicit_lengths`` (pass
    actual_seq_lengths_* even where optional), ``block_size``.
    """

    op: str
    make: Callable[..., dict]
    layout_kv: str = "layout_kv"
    lens_kv: str = "actual_seq_lengths_kv"
    key: str = "key"
    source: str = ""


def rule(n: Names, cid, param, kind, reason, check, violate, *, dtype=False, chips=None, source=None):
    return Constraint(id=f"{n.op}.{cid}", param=param, kind=kind, reason=reason, check=check, dtype=dtype,
                      chips=frozenset(chips) if chips else None, violate=violate,
                      source=source if source is not None else n.source)


def edit(n: Names, change: Callable[[dict], None] | None = None, **variant):
    """A violate function: build ``n.make(**variant)`` and apply ``change`` (in place) to it."""

    def violate(_args):
        out = copy_args(n.make(**variant))
        if change is not None:
            change(out)
        return out

    return violate


def setting(**kw):
    def change(a):
        a.update(kw)

    return change


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def kv_layout(a, n: Names):
    return a[n.layout_kv]


def n_batch(a) -> int:
    """B: query.shape[0] (BSND) or the number of query prefix sums (TND)."""
    if a["layout_query"] == "BSND":
        return int(a["query"].shape[0])
    lens = a.get("actual_seq_lengths_query")
    return 0 if lens is None else int(np.asarray(lens).size)


def act_kv(a, n: Names) -> np.ndarray:
    """Per-batch KV lengths (after the length rules passed)."""
    lens = a.get(n.lens_kv)
    key = a[n.key]
    lay = a[n.layout_kv]
    if lay == "BSND":
        return np.full(n_batch(a), key.shape[1], np.int64) if lens is None else np.asarray(lens, np.int64)
    lens = np.asarray(lens, np.int64).reshape(-1)
    if lay == "TND":
        return np.diff(np.concatenate([[0], lens]))
    return lens


# --------------------------------------------------------------------------------------------------
# layouts and ranks


def layout_rules(n: Names):
    return [
        rule(n, "layout_query_value", "layout_query", "value", f"must be {one_of(LAYOUTS_Q)}",
             lambda a: None if a.layout_query in LAYOUTS_Q else a.layout_query, edit(n, setting(layout_query="BNSD"))),
        rule(n, f"{n.layout_kv}_value", n.layout_kv, "value", f"must be {one_of(LAYOUTS_KV)}",
             lambda a: None if a[n.layout_kv] in LAYOUTS_KV else a[n.layout_kv],
             edit(n, setting(**{n.layout_kv: "PA_NZ"}))),
        rule(n, "layout_agreement", n.layout_kv, "value",
             "without PageAttention (PA_BSND) the KV layout must equal layout_query",
             lambda a: None if a[n.layout_kv] in ("PA_BSND", a.layout_query)
             else f"{a[n.layout_kv]} with layout_query {a.layout_query}",
             edit(n, setting(**{n.layout_kv: "TND"}))),
    ]


def _ndim_rule(n: Names, param, want: Callable, reason, **variant):
    def check(a):
        v = a.get(param)
        if v is None:
            return None
        w = want(a)
        return None if v.ndim == w else v.ndim

    def change(a):
        a[param] = np.ascontiguousarray(a[param][None])

    return rule(n, f"{param}_ndim", param, "dim", reason, check, edit(n, change, **variant))


def rank_rules(n: Names, extra: tuple = ()):
    """query / key / sparse-like ranks by layout; ``extra``: (param, ndim_bsnd, ndim_tnd, reason) for
    tensors whose rank follows layout_query."""
    out = [
        _ndim_rule(n, "query", lambda a: 4 if a.layout_query == "BSND" else 3,
                   "number of dimensions must be 4 for layout_query BSND ([B, S, N, D]) and 3 for TND ([T, N, D])"),
        _ndim_rule(n, n.key, lambda a: 3 if a[n.layout_kv] == "TND" else 4,
                   "number of dimensions must be 4 for BSND ([B, S, N, D]) and PA_BSND ([block_num, block_size, "
                   "N, D]) and 3 for TND ([T, N, D])"),
    ]
    for param, nb, nt, reason in extra:
        out.append(_ndim_rule(n, param, (lambda nb_, nt_: lambda a: nb_ if a.layout_query == "BSND" else nt_)(nb, nt),
                              reason))
    return out


def nonempty_rules(n: Names, params):
    out = []
    for p in params:
        def check(a, p=p):
            v = a.get(p)
            return None if v is None or v.size else tuple(v.shape)

        def change(a, p=p):
            a[p] = a[p][:0]

        out.append(rule(n, f"{p}_nonempty", p, "shape", "empty tensors are not supported", check, edit(n, change)))
    return out


# --------------------------------------------------------------------------------------------------
# modes


def mode_rules(n: Names, *, sparse_mode=True):
    out = []
    if sparse_mode:
        out.append(rule(n, "sparse_mode_value", "sparse_mode", "value",
                        "must be one of {0, 3} (0: all selected tokens, 3: right-down causal)",
                        lambda a: None if is_int(a.sparse_mode) and a.sparse_mode in (0, 3) else a.sparse_mode,
                        edit(n, setting(sparse_mode=1))))
    for p in ("pre_tokens", "next_tokens"):
        out.append(rule(n, f"{p}_value", p, "value", f"only the default 2^63-1 ({INT64_MAX}) is supported",
                        (lambda p_: lambda a: None if a[p_] == INT64_MAX and is_int(a[p_]) else a[p_])(p),
                        edit(n, setting(**{p: 2048}))))
    return out


def fixed_value(n: Names, param, value, reason, bad):
    return rule(n, f"{param}_value", param, "value", reason,
                lambda a: None if is_int(a[param]) and a[param] == value else a[param], edit(n, setting(**{param: bad})))


# --------------------------------------------------------------------------------------------------
# sparse indices


def sparse_indices_rules(n: Names, param="sparse_indices"):
    def shape_check(a):
        si = a[param]
        if a.layout_query == "BSND":
            want = (a.query.shape[0], a.query.shape[1], 1)
            got = si.shape[:3]
        else:
            want = (a.query.shape[0], 1)
            got = si.shape[:2]
        return None if tuple(got) == tuple(want) else tuple(si.shape)

    def shape_change(a):
        a[param] = np.ascontiguousarray(np.concatenate([a[param], a[param]], axis=0))

    def size_change(a):
        a[param] = a[param][..., :0]

    def value_change(a):
        v = a[param].copy()
        v.reshape(-1)[0] = -2
        a[param] = v

    return [
        rule(n, f"{param}_shape", param, "shape",
             "must be [B, Q_S, KV_N, sparse_size] for layout_query BSND and [Q_T, KV_N, sparse_size] for TND, "
             "with B, Q_S / Q_T those of query and KV_N = 1", shape_check, edit(n, shape_change)),
        rule(n, "sparse_size", param, "shape", "sparse_size (the last dimension) must be greater than 0",
             lambda a: None if a[param].shape[-1] > 0 else tuple(a[param].shape), edit(n, size_change)),
        rule(n, f"{param}_values", param, "value",
             "entries must be >= -1 (valid indices first, -1 padding after them)",
             lambda a: None if (a[param].size == 0 or int(a[param].min()) >= -1) else int(a[param].min()),
             edit(n, value_change)),
    ]


# --------------------------------------------------------------------------------------------------
# lengths and block table


def _lens(a, p):
    v = a.get(p)
    return None if v is None else np.asarray(v).astype(np.int64).reshape(-1)


def _doubled_lengths(param):
    """A change that makes a lengths array twice as long as the batch."""

    def change(a):
        a[param] = np.concatenate([a[param], a[param]]).astype(np.int32)

    return change


def _decreasing_prefix(param):
    """A change that makes a prefix-sum lengths array decrease (first = last, last = 0)."""

    def change(a):
        v = a[param].copy()
        v[0] = v[-1]
        v[-1] = 0
        a[param] = v

    return change


def length_rules(n: Names, kv_seq_dim_name="KV_S"):
    """actual_seq_lengths_query / _kv (or _key) and block_table rules, in dependency order."""
    lq, lk = "actual_seq_lengths_query", n.lens_kv

    def q_required(a):
        return "None" if a.layout_query == "TND" and a.get(lq) is None else None

    def k_required(a):
        return "None" if a[n.layout_kv] in ("TND", "PA_BSND") and a.get(lk) is None else None

    def ndim1(p):
        def check(a):
            v = a.get(p)
            return None if v is None or v.ndim == 1 else v.ndim
        return check

    def to2d(p):
        def change(a):
            a[p] = a[p].reshape(1, -1)
        return change

    def q_size(a):
        v = _lens(a, lq)
        if v is None:
            return None
        if a.layout_query == "BSND":
            return None if v.size == a.query.shape[0] else v.size
        return None if v.size >= 1 else v.size

    def q_range(a):
        v = _lens(a, lq)
        if v is None:
            return None
        if (v < 0).any():
            return int(v.min())
        lim = a.query.shape[1] if a.layout_query == "BSND" else a.query.shape[0]
        return None if int(v.max(initial=0)) <= lim else int(v.max())

    def q_prefix(a):
        v = _lens(a, lq)
        if v is None or a.layout_query != "TND":
            return None
        return None if (np.diff(v) >= 0).all() else v

    def bt_required(a):
        pa = a[n.layout_kv] == "PA_BSND"
        has = a.get("block_table") is not None
        if pa and not has:
            return "None"
        return None

    def bt_unused(a):
        return None if a[n.layout_kv] == "PA_BSND" or a.get("block_table") is None else "a block_table"

    def bt_ndim(a):
        bt = a.get("block_table")
        return None if bt is None or bt.ndim == 2 else bt.ndim

    def bt_rows(a):
        bt = a.get("block_table")
        if bt is None:
            return None
        return None if bt.shape[0] == n_batch(a) else bt.shape[0]

    def block_size(a):
        if a[n.layout_kv] != "PA_BSND":
            return None
        bs = a[n.key].shape[1]
        return None if bs % 16 == 0 and 0 < bs <= 1024 else bs

    def k_size(a):
        v = _lens(a, lk)
        if v is None:
            return None
        return None if v.size == n_batch(a) else v.size

    def key_batch(a):
        if a[n.layout_kv] != "BSND":
            return None
        return None if a[n.key].shape[0] == n_batch(a) else a[n.key].shape[0]

    def k_range(a):
        v = _lens(a, lk)
        if v is None:
            return None
        if (v < 0).any():
            return int(v.min())
        lay = a[n.layout_kv]
        key = a[n.key]
        if lay == "BSND":
            lim = key.shape[1]
        elif lay == "TND":
            lim = key.shape[0]
        else:
            lim = a.block_table.shape[1] * key.shape[1]
        return None if int(v.max(initial=0)) <= lim else int(v.max())

    def k_prefix(a):
        v = _lens(a, lk)
        if v is None or a[n.layout_kv] != "TND":
            return None
        return None if (np.diff(v) >= 0).all() else v

    def bt_values(a):
        if a[n.layout_kv] != "PA_BSND":
            return None
        bt = np.asarray(a.block_table).astype(np.int64)
        bs = a[n.key].shape[1]
        nb = a[n.key].shape[0]
        need = -(-act_kv(a, n) // bs)
        used = np.arange(bt.shape[1])[None, :] < need[:, None]
        bad = used & ((bt < 0) | (bt >= nb))
        if not bad.any():
            return None
        b, j = (int(x) for x in np.argwhere(bad)[0])
        return f"block_table[{b}, {j}] = {int(bt[b, j])}"

    # violates
    q_bad_size = _doubled_lengths(lq)

    def q_bad_range(a):
        v = a[lq].copy()
        v[-1] = (a["query"].shape[1] if a["layout_query"] == "BSND" else a["query"].shape[0]) + 1
        a[lq] = v

    q_bad_prefix = _decreasing_prefix(lq)

    k_bad_size = _doubled_lengths(lk)

    def k_bad_range(a):
        v = a[lk].copy()
        key = a[n.key]
        lay = a[n.layout_kv]
        lim = key.shape[1] if lay == "BSND" else key.shape[0] if lay == "TND" else a["block_table"].shape[1] * key.shape[1]
        v[-1] = lim + 1
        a[lk] = v

    k_bad_prefix = _decreasing_prefix(lk)

    def bt_bad_values(a):
        bt = a["block_table"].copy()
        bt[0, 0] = a[n.key].shape[0]
        a["block_table"] = bt

    def key_bad_batch(a):
        a[n.key] = np.ascontiguousarray(np.concatenate([a[n.key], a[n.key]], axis=0))

    def bt_bad_rows(a):
        a["block_table"] = np.ascontiguousarray(np.concatenate([a["block_table"], a["block_table"]], axis=0))

    def bad_block_size(a):
        key = a[n.key]
        a[n.key] = np.ascontiguousarray(np.concatenate([key, key[:, :8]], axis=1))

    pa = dict(**{"layout_kv": "PA_BSND"})
    tnd = dict(layout_query="TND", layout_kv="TND")
    return [
        rule(n, "actual_seq_lengths_query_required", lq, "value",
             "must be given (prefix sums) when layout_query is TND", q_required, edit(n, setting(**{lq: None}), **tnd)),
        rule(n, "actual_seq_lengths_query_ndim", lq, "dim", "must be a 1-D tensor of length B", ndim1(lq),
             edit(n, to2d(lq), explicit_lengths=True)),
        rule(n, "actual_seq_lengths_query_entries", lq, "shape",
             "must have B entries (B = query.shape[0]) for BSND; at least one prefix sum for TND", q_size,
             edit(n, q_bad_size, explicit_lengths=True)),
        rule(n, "actual_seq_lengths_query_range", lq, "value",
             "lengths must be >= 0 and at most Q_S (BSND) or the last prefix sum at most Q_T (TND)", q_range,
             edit(n, q_bad_range, explicit_lengths=True)),
        rule(n, "actual_seq_lengths_query_prefix", lq, "value",
             "TND prefix sums must be non-decreasing", q_prefix, edit(n, q_bad_prefix, **tnd)),
        rule(n, "block_table_required", "block_table", "value", "must be given when the KV layout is PA_BSND",
             bt_required, edit(n, setting(block_table=None), **pa)),
        rule(n, "block_table_unused", "block_table", "value",
             "is only used with PageAttention (KV layout PA_BSND); pass None", bt_unused,
             edit(n, lambda a: a.update(block_table=np.zeros((n_batch(a), 1), np.int32)))),
        rule(n, "block_table_ndim", "block_table", "dim", "must be 2-D [B, max_blocks_per_sequence]", bt_ndim,
             edit(n, lambda a: a.update(block_table=a["block_table"][None]), **pa)),
        rule(n, "block_table_rows", "block_table", "shape", "the first dimension must be B", bt_rows,
             edit(n, bt_bad_rows, **pa)),
        rule(n, "block_size", n.key, "shape",
             "PA_BSND block_size (dimension 1) must be a multiple of 16 and at most 1024", block_size,
             edit(n, bad_block_size, **pa)),
        rule(n, "key_batch", n.key, "shape", "BSND KV must have the query's batch size B in dimension 0",
             key_batch, edit(n, key_bad_batch)),
        rule(n, f"{lk}_required", lk, "value", "must be given when the KV layout is TND (prefix sums) or PA_BSND",
             k_required, edit(n, setting(**{lk: None}), **pa)),
        rule(n, f"{lk}_ndim", lk, "dim", "must be a 1-D tensor of length B", ndim1(lk),
             edit(n, to2d(lk), explicit_lengths=True)),
        rule(n, f"{lk}_entries", lk, "shape", "must have B entries (one per batch)", k_size,
             edit(n, k_bad_size, explicit_lengths=True)),
        rule(n, f"{lk}_range", lk, "value",
             f"lengths must be >= 0 and at most {kv_seq_dim_name} (BSND), the last prefix sum at most KV_T (TND), "
             "or covered by block_table (PA_BSND: at most block_table.shape[1] * block_size)", k_range,
             edit(n, k_bad_range, explicit_lengths=True)),
        rule(n, f"{lk}_prefix", lk, "value", "TND prefix sums must be non-decreasing", k_prefix,
             edit(n, k_bad_prefix, **tnd)),
        rule(n, "block_table_values", "block_table", "value",
             "entries covering each sequence's actual length must be block ids in [0, block_num)", bt_values,
             edit(n, bt_bad_values, **pa)),
    ]


def sbs_divides_block_size(n: Names, bad_sbs=32, block_size=48):
    def check(a):
        if a[n.layout_kv] != "PA_BSND":
            return None
        bs = a[n.key].shape[1]
        return None if bs % a.sparse_block_size == 0 else f"{a.sparse_block_size} with block_size {bs}"

    return rule(n, "sparse_block_size_divides_block_size", "sparse_block_size", "value",
                "under PageAttention sparse_block_size must divide block_size", check,
                edit(n, setting(sparse_block_size=bad_sbs), layout_kv="PA_BSND", block_size=block_size))


_EXP_MASK16 = {"bfloat16": 0x7F80, "float16": 0x7C00}


def first_nonfinite(v: np.ndarray, chunk: int = 1 << 22):
    """Flat index of the first inf / nan of a float array, or None; bounded memory (chunks of bit tests for
    the 16-bit floats), so checking a multi-GB query costs no multi-GB temporaries."""
    name = dtype_name(v)
    flat = v.reshape(-1)
    mask = _EXP_MASK16.get(name)
    for start in range(0, flat.size, chunk):
        part = flat[start:start + chunk]
        if mask is not None:
            bad = (part.view(np.uint16) & mask) == mask
        else:
            bad = ~np.isfinite(part.astype(np.float64, copy=False))
        if bad.any():
            return start + int(bad.argmax())
    return None


def finite_rule(n: Names, param):
    def check(a):
        v = a.get(param)
        if v is None or not v.size:
            return None
        i = first_nonfinite(v)
        if i is None:
            return None
        idx = tuple(int(x) for x in np.unravel_index(i, v.shape))
        return Raw(f"{float(v.reshape(-1)[i])} at index {idx}")

    def change(a):
        v = a[param].copy()
        v.reshape(-1)[0] = np.nan
        a[param] = v

    return rule(n, f"{param}_finite", param, "value", "must not contain inf or nan", check, edit(n, change))


def _key_rows_read(a, n: Names, param=None):
    """``(rows, where)``: the rows of ``param`` (default the key; any array in the key's layout) the call reads
    (``[R, ..., D]``) and, per row, ``(batch, token)``.

    Only tokens below each batch's KV length are read; rows past it (a paged cache's unused slots,
    padding) may hold anything."""
    key, lay, lens = a[param or n.key], a[n.layout_kv], act_kv(a, n)
    lens = np.maximum(lens, 0)
    b_idx = np.repeat(np.arange(lens.size), lens)
    t_idx = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    if lay == "BSND":
        t_idx = np.minimum(t_idx, key.shape[1] - 1)
        return key[b_idx, t_idx], (b_idx, t_idx)
    if lay == "TND":
        return key[:b_idx.size], (b_idx, t_idx)
    bs = key.shape[1]  # PA_BSND: [block_num, block_size, N, D] through block_table
    blk = np.asarray(a["block_table"])[b_idx, t_idx // bs]
    return key[blk, t_idx % bs], (b_idx, t_idx)


def key_rows_finite_rule(n: Names, param=None):
    """No inf / nan in a row of the key (or of ``param``, an array in the key's layout: value, key_rope) that
    the call reads, as the query rules: a non-finite score silently drops a token from the indexer's top-k and
    turns attention rows into NaN."""
    param = param or n.key

    def check(a):
        if a.get(param) is None:
            return None
        rows, (b_idx, t_idx) = _key_rows_read(a, n, param)
        if not rows.size:
            return None
        i = first_nonfinite(rows)
        if i is None:
            return None
        r = i // int(np.prod(rows.shape[1:]))
        return Raw(f"{float(rows.reshape(-1)[i])} in batch {int(b_idx[r])}, token {int(t_idx[r])}")

    def change(a):
        v = a[param].copy()
        v.reshape(-1)[0] = np.inf
        a[param] = v

    return rule(n, f"{param}_finite", param, "value",
                f"the {param} rows within the KV lengths must not contain inf or nan", check, edit(n, change))


_F32_EXP = np.uint32(0x7F800000)
#: per one-byte NoPE format: a 256-entry table, True for the codes that decode to inf / nan (None: every code finite)
_BAD_CODES: dict = {}


def _nonfinite_codes(fmt: str):
    if fmt not in _BAD_CODES:
        from ..reference.attention import decode_nope

        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~np.isfinite(decode_nope(np.arange(256, dtype=np.uint8), fmt, np.float64))
        _BAD_CODES[fmt] = bad if bad.any() else None
    return _BAD_CODES[fmt]


#: SWAR constants: in each 16-bit (32-bit) lane of a uint64, ``(w & EXP) + ONE`` sets the lane's top bit exactly
#: when the lane's exponent field is all ones (inf / nan), and never carries into the next lane
_SWAR16 = {0x7F80: (np.uint64(0x7F807F807F807F80), np.uint64(0x0080008000800080)),
           0x7C00: (np.uint64(0x7C007C007C007C00), np.uint64(0x0400040004000400))}
_SWAR16_TOP = np.uint64(0x8000800080008000)
_SWAR32 = (np.uint64(0x7F8000007F800000), np.uint64(0x0080000000800000), np.uint64(0x8000000080000000))


def _any_exp_all_ones(words: np.ndarray, exp: np.uint64, one: np.uint64, top: np.uint64) -> bool:
    """Whether any lane of the uint64 ``words`` (any shape / strides) has an all-ones exponent (three passes)."""
    w = np.bitwise_and(words, exp)
    w += one
    return bool(np.bitwise_or.reduce(w, axis=None) & top)


def _packed_faults(rows: np.ndarray, rope: int, bad_codes, qmask, lo: int = 0) -> np.ndarray | None:
    """Per packed QSFA row (uint8 ``[m, kvd - lo]``: the row's bytes from ``lo`` on, any row stride): whether a tile
    scale, a RoPE value or (where the format has any; ``lo`` 0) a NoPE code is not finite; None when no row has
    one (tested first, on 64-bit words)."""
    off = 512 + 2 * rope - lo
    sc, rb = rows[:, off:off + 16], rows[:, 512 - lo:off]
    clean = not _any_exp_all_ones(sc.view("<u8"), *_SWAR32)
    if clean and rope:
        clean = not _any_exp_all_ones(rb.view("<u8"), *_SWAR16[int(qmask)], _SWAR16_TOP)
    if clean and bad_codes is not None:
        clean = not bad_codes[rows[:, :512]].any()
    if clean:
        return None
    bad = ((sc.view("<u4") & _F32_EXP) == _F32_EXP).any(axis=1)
    if rope:
        bad |= ((rb.view("<u2") & qmask) == qmask).any(axis=1)
    if bad_codes is not None:
        bad |= bad_codes[rows[:, :512]].any(axis=1)
    return bad


def _describe_packed_fault(row: np.ndarray, rope: int, bad_codes, qmask, q_dtype, fmt: str) -> str:
    off = 512 + 2 * rope
    sc = row[off:off + 16].view("<u4")
    t = np.flatnonzero((sc & _F32_EXP) == _F32_EXP)
    if t.size:
        return f"{float(sc[t[0]:t[0] + 1].view('<f4')[0])} (the scale of NoPE tile {int(t[0])})"
    if rope:
        rb = row[512:off].view("<u2")
        d = np.flatnonzero((rb & qmask) == qmask)
        if d.size:
            return f"{float(rb[d[0]:d[0] + 1].view(q_dtype)[0])} (RoPE element {int(d[0])})"
    d = int(np.flatnonzero(bad_codes[row[:512]])[0])
    return f"code 0x{int(row[d]):02X} (NoPE element {d}: not a finite {fmt} value)"


def _selected_storage_rows(a, n: Names, entries: int = 1 << 19):
    """Per chunk of query rows: ``(storage [c, W], valid [c, W], batch [c], token [c, W])`` - the flat row of
    ``key.reshape(-1, D)`` of every token the rows' sparse indices select (qsfa.reference.attn_layout: causal
    threshold, -1 padding, sparse_block_size, KV lengths), at most ``entries`` tokens a chunk."""
    from ..reference.attention import _rows_and_kv
    from ..reference.attn_layout import row_limits, selected_tokens

    rows, kvm = _rows_and_kv(a.query, a[n.key], a.layout_query, a[n.layout_kv], a.get("actual_seq_lengths_query"),
                             a.get(n.lens_kv), a.get("block_table"))
    thr, limit = row_limits(rows, kvm.act_kv, a.sparse_mode)
    idx = np.asarray(a.sparse_indices).reshape(rows.batch.size, -1)
    sbs = int(a.sparse_block_size)
    step = max(1, entries // max(idx.shape[1] * sbs, 1))
    for s in range(0, rows.batch.size, step):
        tok, valid = selected_tokens(idx[s:s + step], thr[s:s + step], limit[s:s + step], sbs)
        b = rows.batch[s:s + step]
        yield kvm.storage_rows(b[:, None], tok), valid, b, tok


#: packed rows per piece of the finiteness check (bounded temporaries)
_SCAN_ROWS = 1 << 16


def packed_rows_finite_rule(n: Names):
    """QSFA: every packed key row the call reads - the tokens its sparse indices select - holds finite tile
    scales, finite RoPE values and NoPE codes that decode to finite values (a NaN or inf there turns attention rows
    into NaN, as it would on the chip). Rows nothing selects may hold anything. Only the distinct rows read, and
    only their checked columns, are gathered (any strides)."""

    def check(a):
        key, rope, fmt = a.get(n.key), a.get("rope_head_dim"), a.get("key_dtype")
        if key is None or rope not in (0, 64) or key.shape[-1] != 512 + 2 * rope + 16:
            return None
        bad_codes = _nonfinite_codes(fmt)
        q_name = dtype_name(a.query)
        qmask = np.uint16(_EXP_MASK16.get(q_name, 0x7F80))
        lo = 0 if bad_codes is not None else 512  # int8 codes are always finite: the scales and RoPE only
        lead = key.shape[:-1]
        n_store = int(np.prod(lead, dtype=np.int64))
        bytes_ = key.view(np.uint8) if key.dtype.itemsize == 1 else key
        if key.flags.c_contiguous and n_store <= max(4096, 2 * a.sparse_indices.size * int(a.sparse_block_size)):
            store = bytes_.reshape(n_store, -1)[:, lo:]  # a small cache, or one the call reads most of: all rows
            if all(_packed_faults(store[i:i + _SCAN_ROWS], rope, bad_codes, qmask, lo) is None  # in place first
                   for i in range(0, n_store, _SCAN_ROWS)):
                return None
        picked = [st[valid] for st, valid, _, _ in _selected_storage_rows(a, n)]
        n_picked = sum(p.size for p in picked)
        if n_store <= 8 * n_picked:  # distinct rows read: a mark per storage row, or a sort of the few picked
            read = np.zeros(n_store, bool)
            for p in picked:
                read[p] = True
            ids = np.flatnonzero(read)
        else:
            ids = np.unique(np.concatenate(picked)) if picked else np.zeros(0, np.int64)
        picked = None
        bad_ids = []
        for i in range(0, ids.size, _SCAN_ROWS):
            part = ids[i:i + _SCAN_ROWS]
            rows = bytes_[np.unravel_index(part, lead) + (slice(lo, None),)]  # [m, kvd - lo], a copy
            faults = _packed_faults(rows, rope, bad_codes, qmask, lo)
            if faults is not None:
                bad_ids.append(part[faults])
        if not bad_ids:
            return None
        bad_ids = np.unique(np.concatenate(bad_ids))
        for st, valid, b, tok in _selected_storage_rows(a, n):  # the first selected token in a bad row
            hit = valid & np.isin(st, bad_ids)
            if hit.any():
                r, j = np.unravel_index(int(hit.argmax()), hit.shape)
                row = np.ascontiguousarray(bytes_[np.unravel_index(int(st[r, j]), lead)])
                what = _describe_packed_fault(row, rope, bad_codes, qmask, _Q_DTYPES.get(q_name, _BF16), fmt)
                return Raw(f"{what} in batch {int(b[r])}, token {int(tok[r, j])}")
        return None

    def change(a):
        k = a[n.key].copy()
        k.reshape(-1, k.shape[-1]).view(np.uint8)[:, -16:-12] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
        a[n.key] = k
        a["value"] = k

    return rule(n, "key_rows_finite", n.key, "value",
                "the packed key rows its sparse indices select must hold finite tile scales, finite RoPE values and "
                "NoPE codes that decode to finite values", check, edit(n, change))


def scale_value_rule(n: Names):
    return rule(n, "scale_value_value", "scale_value", "value", "must be a finite real number",
                lambda a: None if is_real(a.scale_value) and math.isfinite(a.scale_value) else a.scale_value,
                edit(n, setting(scale_value=float("nan"))))


def choice_rule(n: Names, param, allowed, bad="bogus", source=None):
    return rule(n, f"{param}_value", param, "value", f"must be {one_of(allowed)}",
                lambda a: None if a.get(param) in allowed else a.get(param), edit(n, setting(**{param: bad})),
                source=source)


def bool_rule(n: Names, param):
    return rule(n, f"{param}_value", param, "type", "must be a bool",
                lambda a: None if isinstance(a.get(param), (bool, np.bool_)) else a.get(param),
                edit(n, setting(**{param: "yes"})), dtype=True)


# ==================================================================================================
# case builders (valid argument sets; the contracts' examples and the bases of the violate functions)

_BF16 = np.dtype(ml_dtypes.bfloat16)
_Q_DTYPES = {"bfloat16": _BF16, "float16": np.dtype(np.float16)}


def _lengths(layout, per_batch):
    per_batch = np.asarray(per_batch, np.int64)
    return (np.cumsum(per_batch) if layout == "TND" else per_batch).astype(np.int32)


def _kv_storage(rows, *, layout_kv, block_size, kv_s):
    """rows [B, kv_s, 1, W] -> (key in layout_kv, block_table or None, per-batch lengths)."""
    b = rows.shape[0]
    if layout_kv == "BSND":
        return rows, None
    if layout_kv == "TND":
        return np.ascontiguousarray(rows.reshape(b * kv_s, *rows.shape[2:])), None
    per = -(-kv_s // block_size)
    nb = b * per + 1  # one spare block
    key = np.zeros((nb, block_size) + rows.shape[2:], rows.dtype)
    bt = np.zeros((b, per), np.int32)
    for bi in range(b):  # a handful of blocks: batches stored in reverse block order
        for j in range(per):
            blk = nb - 1 - (bi * per + j)
            bt[bi, j] = blk
            seg = rows[bi, j * block_size:(j + 1) * block_size]
            key[blk, :seg.shape[0]] = seg
    return key, bt


def _query_store(x, layout_query):
    return x if layout_query == "BSND" else np.ascontiguousarray(x.reshape(-1, *x.shape[2:]))


def _hif8_codes(rng, shape):
    """Random finite HiFloat8 codes of moderate magnitude (0x08-0x3F and their negatives)."""
    mag = rng.integers(0x08, 0x40, size=shape, dtype=np.uint8)
    sign = rng.integers(0, 2, size=shape, dtype=np.uint8) << 7
    return mag | sign


def _nope_codes(rng, shape, key_fmt):
    if key_fmt == "int8":
        return rng.integers(-64, 64, size=shape).astype(np.int8).view(np.uint8)
    if key_fmt == "float8_e4m3fn":
        return rng.uniform(-4, 4, size=shape).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return _hif8_codes(rng, shape)


def _head_dim_and_kv_head_rules(n: Names, d: int, kv_heads_name: str) -> list:
    """query and key last dimension must be ``d``; the KV head dimension (-2) must be 1 (SFA, indexers)."""
    rules = []
    for param in ("query", "key"):
        rules.append(rule(n, f"{param}_head_dim", param, "shape", f"D (last dimension) must be {d}",
                          lambda a, p=param: None if a[p].shape[-1] == d else tuple(a[p].shape),
                          edit(n, lambda a, p=param: a.update({p: np.ascontiguousarray(a[p][..., :d // 2])}))))
    rules.append(rule(n, "kv_heads", "key", "shape", f"{kv_heads_name} (dimension -2) must be 1",
                      lambda a: None if a.key.shape[-2] == 1 else tuple(a.key.shape),
                      edit(n, lambda a: a.update(key=np.ascontiguousarray(np.repeat(a["key"], 2, axis=-2))))))
    return rules
