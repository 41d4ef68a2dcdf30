"""Public front doors of the attention group: QSFA, SFA, the lightning indexers, the LSE merge (docs/numerics/attention.md,
docs/numerics/indexer.md).

Operators (one :class:`~qsfa._contract.Contract` each, every documented rule a constraint with a
``violate`` function; chip limits as ``chips=`` constraints):

* ``kv_quant_sparse_flash_attention`` - QSFA over packed int8 / FP8 / HiFloat8 rows (seed 000);
* ``sparse_flash_attention`` - SFA over a float16 / bfloat16 KV (torch_npu ``npu_sparse_flash_attention``);
* ``lightning_indexer`` / ``quant_lightning_indexer`` - top-k token selection (docs/numerics/indexer.md#lightning_indexer);
* ``merge_attention_lse`` - the context-parallel merge of partial results.

Plain functions over those operators: :func:`attention` (routes by key dtype as vLLM-Ascend does),
:func:`attention_error_budget` (faithful - exact) and :func:`c8_pipeline` (cache writer -> indexer -> QSFA).
The computations are :mod:`qsfa.reference.attention`, :mod:`qsfa.reference.indexer`,
:mod:`qsfa.reference.lse` and :mod:`qsfa.reference.pipeline`.

The case builders (:func:`qsfa_case`, :func:`sfa_case`, :func:`indexer_case`, :func:`merge_case`) return
small valid argument sets; they are the contracts' examples and the bases of the violate functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import ml_dtypes
import numpy as np

from .._arrays import dtype_name, is_torch, to_numpy
from .._checks import dtype_in, is_array
from .._contract import Constraint, Contract, copy_args, one_of, params
from .. import chips as _chips
from ._out_buffers import attention_out_rules, reject_on_device
from .._dispatch import define_operator, run
from .._errors import InvalidArgument, Raw
from ..reference import attention as _ref
from ..reference import indexer as _ref_li
from ..reference import lse as _ref_lse
from ..reference import pipeline as _ref_pipeline
from ..reference.attention import PRECISIONS, PROBABILITY_ROUNDINGS
from ..reference.indexer import TIE_BREAKS

__all__ = [
    "kv_quant_sparse_flash_attention",
    "sparse_flash_attention",
    "attention",
    "lightning_indexer",
    "quant_lightning_indexer",
    "merge_attention_lse",
    "attention_error_budget",
    "c8_pipeline",
    "qsfa_case",
    "sfa_case",
    "indexer_case",
    "merge_case",
    "QSFA_CONTRACT",
    "SFA_CONTRACT",
    "LI_CONTRACT",
    "QLI_CONTRACT",
    "MERGE_CONTRACT",
]

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
        rule(n, "actual_seq_lengths_query_size", lq, "shape",
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
        rule(n, f"{lk}_size", lk, "shape", "must have B entries (one per batch)", k_size,
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


def qsfa_case(*, layout_query="BSND", layout_kv="BSND", explicit_lengths=False, block_size=16, rope=64,
              key_fmt="int8", n_heads=1, sparse=2, qdtype="bfloat16", sparse_block_size=1, batch=2, q_s=2,
              kv_s=4, seed=0):
    """A small valid QSFA argument set (packed rows built with qsfa.reference.packing.pack_rows)."""
    from ..reference.packing import pack_rows

    rng = np.random.default_rng(seed)
    qdt = _Q_DTYPES[qdtype]
    q = rng.uniform(-1, 1, (batch, q_s, n_heads, 512 + rope)).astype(qdt)
    codes = _nope_codes(rng, (batch, kv_s, 1, 512), key_fmt)
    k_rope = rng.uniform(-1, 1, (batch, kv_s, 1, rope)).astype(qdt) if rope else None
    scales = rng.uniform(0.01, 0.1, (batch, kv_s, 1, 4)).astype(np.float32)
    rows = pack_rows(codes, k_rope, scales)
    key, bt = _kv_storage(rows, layout_kv=layout_kv, block_size=block_size, kv_s=kv_s)
    key = key.view(np.int8) if key_fmt == "int8" else key.view(ml_dtypes.float8_e4m3fn) if key_fmt == \
        "float8_e4m3fn" else key
    idx = np.full((batch, q_s, 1, sparse), -1, np.int32)
    idx[..., : min(sparse, kv_s)] = np.arange(min(sparse, kv_s), dtype=np.int32)
    lq = _lengths(layout_query, [q_s] * batch) if (explicit_lengths or layout_query == "TND") else None
    lk = _lengths(layout_kv, [kv_s] * batch) if (explicit_lengths or layout_kv != "BSND") else None
    return dict(query=_query_store(q, layout_query), key=key, value=key, sparse_indices=_query_store(idx, layout_query),
                scale_value=(512 + 64) ** -0.5, key_quant_mode=2, value_quant_mode=2, key_dequant_scale=None,
                value_dequant_scale=None, block_table=bt, actual_seq_lengths_query=lq, actual_seq_lengths_kv=lk,
                sparse_block_size=sparse_block_size, layout_query=layout_query, layout_kv=layout_kv, sparse_mode=3,
                pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2, quant_scale_repo_mode=1,
                tile_size=128, rope_head_dim=rope, return_softmax_lse=False, key_dtype=key_fmt,
                precision="faithful", probability_rounding="unnormalised")


def sfa_case(*, layout_query="BSND", layout_kv="BSND", explicit_lengths=False, block_size=16, rope=True,
             n_heads=1, sparse=2, qdtype="bfloat16", sparse_block_size=1, batch=2, q_s=2, kv_s=4, value=True,
             seed=0):
    """A small valid SFA argument set."""
    rng = np.random.default_rng(seed)
    qdt = _Q_DTYPES[qdtype]
    q = rng.uniform(-1, 1, (batch, q_s, n_heads, 512)).astype(qdt)
    k = rng.uniform(-1, 1, (batch, kv_s, 1, 512)).astype(qdt)
    key, bt = _kv_storage(k, layout_kv=layout_kv, block_size=block_size, kv_s=kv_s)
    qr = kr = None
    if rope:
        qr = _query_store(rng.uniform(-1, 1, (batch, q_s, n_heads, 64)).astype(qdt), layout_query)
        kr, _ = _kv_storage(rng.uniform(-1, 1, (batch, kv_s, 1, 64)).astype(qdt), layout_kv=layout_kv,
                            block_size=block_size, kv_s=kv_s)
    v = None
    if value:
        v, _ = _kv_storage(rng.uniform(-1, 1, (batch, kv_s, 1, 512)).astype(qdt), layout_kv=layout_kv,
                           block_size=block_size, kv_s=kv_s)
    idx = np.full((batch, q_s, 1, sparse), -1, np.int32)
    idx[..., : min(sparse, kv_s)] = np.arange(min(sparse, kv_s), dtype=np.int32)
    lq = _lengths(layout_query, [q_s] * batch) if (explicit_lengths or layout_query == "TND") else None
    lk = _lengths(layout_kv, [kv_s] * batch) if (explicit_lengths or layout_kv != "BSND") else None
    return dict(query=_query_store(q, layout_query), key=key, value=v, sparse_indices=_query_store(idx, layout_query),
                scale_value=(512 + 64) ** -0.5, block_table=bt, actual_seq_lengths_query=lq,
                actual_seq_lengths_kv=lk, query_rope=qr, key_rope=kr, sparse_block_size=sparse_block_size,
                layout_query=layout_query, layout_kv=layout_kv, sparse_mode=3, pre_tokens=INT64_MAX,
                next_tokens=INT64_MAX, attention_mode=2, return_softmax_lse=False, sinks=None,
                lse_includes_sink=False, precision="faithful", probability_rounding="unnormalised")


def indexer_case(*, layout_query="BSND", layout_kv="BSND", explicit_lengths=False, block_size=16, n_heads=8,
                 sparse_count=4, qdtype="bfloat16", weights_dtype=None, batch=2, q_s=2, kv_s=6, seed=0,
                 quant=False, fmt="int8"):
    """A small valid (quant_)lightning_indexer argument set."""
    rng = np.random.default_rng(seed)
    qdt = _Q_DTYPES[qdtype]
    if quant:
        q = _nope_codes(rng, (batch, q_s, n_heads, 128), fmt)
        k = _nope_codes(rng, (batch, kv_s, 1, 128), fmt)
        cast = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "hifloat8": np.uint8}[fmt]
        q, k = q.view(cast), k.view(cast)
    else:
        q = rng.uniform(-1, 1, (batch, q_s, n_heads, 128)).astype(qdt)
        k = rng.uniform(-1, 1, (batch, kv_s, 1, 128)).astype(qdt)
    key, bt = _kv_storage(k, layout_kv=layout_kv, block_size=block_size, kv_s=kv_s)
    wdt = np.dtype(weights_dtype) if weights_dtype is not None else (np.dtype(np.float16) if quant else qdt)
    w = rng.uniform(-1, 1, (batch, q_s, n_heads)).astype(wdt)
    lq = _lengths(layout_query, [q_s] * batch) if (explicit_lengths or layout_query == "TND") else None
    lk = _lengths(layout_kv, [kv_s] * batch) if (explicit_lengths or layout_kv != "BSND") else None
    args = dict(query=_query_store(q, layout_query), key=key, weights=_query_store(w, layout_query),
                actual_seq_lengths_query=lq, actual_seq_lengths_key=lk, block_table=bt, layout_query=layout_query,
                layout_key=layout_kv, sparse_count=sparse_count, sparse_mode=3, pre_tokens=INT64_MAX,
                next_tokens=INT64_MAX, tie_break="lower_index")
    if quant:
        qs = rng.uniform(0.01, 0.1, (batch, q_s, n_heads)).astype(np.float16)
        ks, _ = _kv_storage(rng.uniform(0.01, 0.1, (batch, kv_s, 1)).astype(np.float16)[..., None],
                            layout_kv=layout_kv, block_size=block_size, kv_s=kv_s)
        args.update(query_dequant_scale=_query_store(qs, layout_query), key_dequant_scale=ks[..., 0],
                    query_quant_mode=0, key_quant_mode=0, query_dtype=fmt if fmt == "hifloat8" else None,
                    key_dtype=fmt if fmt == "hifloat8" else None)
    else:
        args.update(return_value=False)
    return args


# ==================================================================================================
# QSFA: kv_quant_sparse_flash_attention

QSFA = "kv_quant_sparse_flash_attention"
QSFA_SOURCE = "docs/numerics/attention.md#kv_quant_sparse_flash_attention; seed 000 (QSFA operator guide); vllm-ascend QSFA custom op"
QSFA_KEY_FORMATS = ("int8", "float8_e4m3fn", "hifloat8")
QSFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 48, 64, 128)
QSFA_SPARSE_BLOCK_SIZES = (1, 2, 4, 8, 16)
_N_QSFA = Names(QSFA, qsfa_case, source=QSFA_SOURCE)


def _repeat_kv_heads(a):
    a["key"] = np.ascontiguousarray(np.repeat(a["key"], 2, axis=-2))
    a["value"] = a["key"]


def _qsfa_rules():
    n = _N_QSFA
    r = []
    r += [is_array(QSFA, p, source=QSFA_SOURCE) for p in ("query", "key", "value", "sparse_indices")]
    r += [is_array(QSFA, p, optional=True, source=QSFA_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv")]
    r.append(dtype_in(QSFA, "query", ("float16", "bfloat16"), source=QSFA_SOURCE))
    r.append(dtype_in(QSFA, "key", ("int8", "uint8", "float8_e4m3fn"), source=QSFA_SOURCE))
    r.append(choice_rule(n, "key_dtype", QSFA_KEY_FORMATS))

    def fp8_array(a):
        return None if dtype_name(a.key) != "float8_e4m3fn" or a.key_dtype == "float8_e4m3fn" else a.key_dtype

    def fp8_change(a):
        a["key"] = a["key"].view(ml_dtypes.float8_e4m3fn)
        a["value"] = a["key"]

    r.append(rule(n, "key_dtype_matches_key", "key_dtype", "value",
                  "a float8_e4m3fn key array holds FP8 codes: key_dtype must be 'float8_e4m3fn'", fp8_array,
                  edit(n, fp8_change)))
    r.append(rule(n, "value_dtype", "value", "dtype", "must have the key's dtype (value follows key)",
                  lambda a: None if a.value.dtype == a.key.dtype else dtype_name(a.value),
                  edit(n, lambda a: a.update(value=a["value"].view(np.uint8))), dtype=True))
    r.append(dtype_in(QSFA, "sparse_indices", ("int32",), source=QSFA_SOURCE))
    r += [dtype_in(QSFA, p, ("int32",), source=QSFA_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv")]
    r += layout_rules(n)
    r += rank_rules(n, extra=(("sparse_indices", 4, 3, "number of dimensions must be 4 for layout_query BSND "
                                                       "and 3 for TND"),))
    r += nonempty_rules(n, ("query", "key"))
    r.append(rule(n, "rope_head_dim_value", "rope_head_dim", "value", "must be one of {0, 64}",
                  lambda a: None if is_int(a.rope_head_dim) and a.rope_head_dim in (0, 64) else a.rope_head_dim,
                  edit(n, setting(rope_head_dim=32))))
    r.append(rule(n, "query_head_dim", "query", "shape",
                  "Q_D (last dimension) must be 512 + rope_head_dim (512 for rope 0, 576 for rope 64)",
                  lambda a: None if a.query.shape[-1] == 512 + a.rope_head_dim else tuple(a.query.shape),
                  edit(n, setting(rope_head_dim=0))))

    def kv_d_change(a):
        a["rope_head_dim"] = 0
        a["query"] = np.ascontiguousarray(a["query"][..., :512])

    r.append(rule(n, "key_head_dim", "key", "shape",
                  "KV_D (bytes per packed row) must be 512 + 2 * rope_head_dim + 16 (528 for rope 0, 656 for rope 64)",
                  lambda a: None if a.key.shape[-1] == 512 + 2 * a.rope_head_dim + 16 else tuple(a.key.shape),
                  edit(n, kv_d_change)))
    r.append(rule(n, "kv_heads", "key", "shape", "KV_N (dimension -2) must be 1",
                  lambda a: None if a.key.shape[-2] == 1 else tuple(a.key.shape),
                  edit(n, _repeat_kv_heads)))
    r.append(rule(n, "query_heads", "query", "shape", f"Q_N (dimension -2) must be {one_of(QSFA_QUERY_HEADS)}",
                  lambda a: None if a.query.shape[-2] in QSFA_QUERY_HEADS else tuple(a.query.shape),
                  edit(n, n_heads=3)))
    r += sparse_indices_rules(n)
    r.append(fixed_value(n, "key_quant_mode", 2, "only 2 (per-tile quantisation) is supported", 1))
    r.append(fixed_value(n, "value_quant_mode", 2, "only 2 (per-tile quantisation) is supported", 1))
    r.append(fixed_value(n, "attention_mode", 2, "only 2 (MLA-absorb: V is the dequantised K NoPE) is supported", 0))
    r.append(fixed_value(n, "quant_scale_repo_mode", 1,
                         "only 1 (combine: scales stored inside the packed row) is supported", 0))
    r.append(fixed_value(n, "tile_size", 128, "only 128 is supported", 64))
    r += mode_rules(n)
    r.append(rule(n, "sparse_block_size_value", "sparse_block_size", "value",
                  f"must be {one_of(QSFA_SPARSE_BLOCK_SIZES)}",
                  lambda a: None if is_int(a.sparse_block_size) and a.sparse_block_size in QSFA_SPARSE_BLOCK_SIZES
                  else a.sparse_block_size, edit(n, setting(sparse_block_size=3))))
    for p in ("key_dequant_scale", "value_dequant_scale"):
        r.append(rule(n, f"{p}_reserved", p, "value", "reserved parameter: must be None",
                      (lambda p_: lambda a: None if a.get(p_) is None else "a tensor")(p),
                      edit(n, setting(**{p: np.ones((1,), np.float32)}))))
    r += length_rules(n)
    # sparse_block_size always divides a PA block size here (block_size % 16 == 0, sbs <= 16): no extra rule.

    def value_shape(a):
        k, v = a.key.shape, a.value.shape
        return None if v == k or v == k[:-1] + (512,) else tuple(v)

    r.append(rule(n, "value_shape", "value", "shape",
                  "must be the packed key itself (same shape) or a NoPE tensor of the key's shape with last "
                  "dimension 512", value_shape,
                  edit(n, lambda a: a.update(value=np.ascontiguousarray(a["value"][..., :100])))))

    def hif8_rope(a):
        return None if a.key_dtype != "hifloat8" or a.rope_head_dim == 64 else a.rope_head_dim

    def hif8_rope_change(a):
        a["rope_head_dim"] = 0
        a["query"] = np.ascontiguousarray(a["query"][..., :512])
        k = a["key"]
        a["key"] = np.ascontiguousarray(np.concatenate([k[..., :512], k[..., 640:]], axis=-1))
        a["value"] = a["key"]

    r.append(rule(n, "hifloat8_rope_head_dim", "rope_head_dim", "value", "HiFloat8 KV supports only rope_head_dim 64",
                  hif8_rope, edit(n, hif8_rope_change, key_fmt="hifloat8", sparse=2048)))
    r.append(rule(n, "hifloat8_sparse_size", "sparse_indices", "shape",
                  "HiFloat8 KV supports only sparse_size 2048",
                  lambda a: None if a.key_dtype != "hifloat8" or a.sparse_indices.shape[-1] == 2048
                  else tuple(a.sparse_indices.shape), edit(n, key_fmt="hifloat8")))
    r.append(scale_value_rule(n))
    r.append(bool_rule(n, "return_softmax_lse"))
    r.append(finite_rule(n, "query"))
    r.append(choice_rule(n, "precision", PRECISIONS, source="docs/numerics/attention.md#rounding-points (qsfa's parameter, not torch_npu's)"))
    r.append(choice_rule(n, "probability_rounding", PROBABILITY_ROUNDINGS,
                         source="docs/numerics/open-facts.md#probability_rounding"))
    # chip limits (seed 000 constraint section)
    r.append(rule(n, "a2a3_query_heads", "query", "shape", "Atlas A2/A3 do not support Q_N = 48",
                  lambda a: None if a.query.shape[-2] != 48 else tuple(a.query.shape), edit(n, n_heads=48),
                  chips=("A2", "A3")))
    r.append(rule(n, "a2a3_key_dtype", "key_dtype", "value", "Atlas A2/A3 support only int8 KV",
                  lambda a: None if a.key_dtype == "int8" else a.key_dtype, edit(n, key_fmt="float8_e4m3fn"),
                  chips=("A2", "A3")))
    r.append(rule(n, "950_sparse_block_size", "sparse_block_size", "value", "Ascend 950 supports only sparse_block_size 1",
                  lambda a: None if a.sparse_block_size == 1 else a.sparse_block_size,
                  edit(n, setting(sparse_block_size=2)), chips=("950",)))
    r.append(rule(n, "950_return_softmax_lse", "return_softmax_lse", "value",
                  "Ascend 950 writes only the attention output: return_softmax_lse must be False",
                  lambda a: None if not a.return_softmax_lse else a.return_softmax_lse,
                  edit(n, setting(return_softmax_lse=True)), chips=("950",)))
    r += attention_out_rules(n, lambda a: 512)
    return r


QSFA_CONTRACT = Contract(op=QSFA, constraints=_qsfa_rules(), example=lambda rng: {**qsfa_case(), "attention_out": None},
                         params=params(
    "query:array key:array value:array sparse_indices:array scale_value:float key_quant_mode:int value_quant_mode:int"
    " key_dequant_scale:array? value_dequant_scale:array? block_table:array? actual_seq_lengths_query:array?"
    " actual_seq_lengths_kv:array? sparse_block_size:int layout_query:str layout_kv:str sparse_mode:int"
    " pre_tokens:int next_tokens:int attention_mode:int quant_scale_repo_mode:int tile_size:int rope_head_dim:int"
    " return_softmax_lse:bool key_dtype:str precision:str probability_rounding:str attention_out:array?"))


def _qsfa_reference(**args):
    return _ref.kv_quant_sparse_flash_attention(**args)


define_operator(QSFA, QSFA_CONTRACT, outputs=("attention_out", "softmax_max", "softmax_sum"),
                reference=_qsfa_reference, numerics=_chips.qsfa_numerics,
                doc="Sparse flash attention over a packed int8/fp8/HiFloat8 KV cache (QSFA).")


def kv_quant_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, key_quant_mode=2,
                                    value_quant_mode=2, key_dequant_scale=None, value_dequant_scale=None,
                                    block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                                    sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                                    pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2,
                                    quant_scale_repo_mode=1, tile_size=128, rope_head_dim=64,
                                    return_softmax_lse=False, key_dtype="int8", chip=None, backend="reference",
                                    precision="faithful", probability_rounding="unnormalised", attention_out=None):
    """Sparse flash attention over a packed quantised KV cache (vllm-ascend ``npu_kv_quant_sparse_flash_attention``).

    Computes per query row and head ``softmax(scale_value * q . K_sel^T) @ V_sel`` over the tokens the
    row's ``sparse_indices`` select, with K = dequantised packed rows (NoPE ``decode(code) * tile_scale``
    then the RoPE) and V = the dequantised NoPE (MLA-absorb). Rounding points, token selection and the
    empty-row rules: :mod:`qsfa.reference.attention`.

    Parameters (torch_npu / vllm-ascend names):
      query:  float16 / bfloat16 ``[B, Q_S, Q_N, Q_D]`` (layout_query "BSND") or ``[Q_T, Q_N, Q_D]``
              ("TND"); Q_D = 512 + rope_head_dim; Q_N in {1, 2, 4, 8, 16, 32, 48 (950 only), 64, 128}.
      key:    packed rows, int8 / uint8 / float8_e4m3fn ``[B, KV_S, 1, KV_D]`` (BSND), ``[KV_T, 1, KV_D]``
              (TND) or ``[block_num, block_size, 1, KV_D]`` (PA_BSND); KV_D = 528 (rope 0) or 656 (rope 64)
              bytes: NoPE codes [0, 512), RoPE (query dtype) [512, 640), 4 fp32 scales last.
      value:  the same packed array, or a ``[..., 1, 512]`` NoPE tensor of the key's dtype; not read.
      sparse_indices: int32 ``[B, Q_S, 1, sparse_size]`` / ``[Q_T, 1, sparse_size]``; entry t selects
              tokens [t * sparse_block_size, (t + 1) * sparse_block_size); -1 ends a row.
      scale_value: float, multiplies q . k.
      key_quant_mode, value_quant_mode (2), attention_mode (2), quant_scale_repo_mode (1), tile_size (128),
      pre_tokens / next_tokens (2^63-1): the only supported values.
      key_dequant_scale, value_dequant_scale: reserved, must be None.
      block_table: int32 ``[B, >= ceil(max KV_S / block_size)]`` (PA_BSND only).
      actual_seq_lengths_query / actual_seq_lengths_kv: int32 ``[B]`` lengths, or prefix sums for TND;
              required for TND (and for the KV under PA_BSND).
      sparse_block_size: 1, 2, 4, 8, 16 (Ascend 950: 1). sparse_mode: 3 (right-down causal) or 0.
      rope_head_dim: 0 or 64. return_softmax_lse: also return softmax_max / softmax_sum (not on 950).
      key_dtype: NoPE format, "int8" (A2/A3), "float8_e4m3fn", "hifloat8" (950; HiFloat8 needs
              sparse_size 2048 and rope 64). A float8_e4m3fn key array needs key_dtype="float8_e4m3fn".
      chip: None | "A2" | "A3" | "950": the chip whose limits and rounding points (K, P, output) the call
              models; None = the npu device's chip, else the rule of :func:`qsfa.resolve_chip` (950 when the
              call breaks an A2/A3 limit, else A2). docs/numerics/chips.md.
      backend: "reference" | "npu" | "triton".
      precision: "faithful" (the kernel's rounding points) or "exact" (float64, no rounding; float64 out).
      probability_rounding: **OPEN** - "unnormalised" (default; round exp(s - max), divide by the fp32 sum
              after P @ V, as the kernels do) or "normalised" (round softmax probabilities; vLLM-Ascend's
              test golden).
      attention_out: optional NumPy buffer (an ``np.memmap`` for a long prefill) of the output's shape and dtype,
              C-contiguous, writable, sharing no memory with the inputs; the reference writes the output into it
              chunk by chunk and returns it (reference backend only).
    Returns ``(attention_out, softmax_max, softmax_sum)``: attention_out in the query dtype (float64 for
    exact) ``[B, Q_S, Q_N, 512]`` / ``[Q_T, Q_N, 512]``; softmax_max / softmax_sum float32 ``[B, 1, Q_S, Q_N]``
    (BSND) / ``[1, Q_T, Q_N]`` (TND) when return_softmax_lse, else empty ``[0]``.
    """
    args = dict(query=query, key=key, value=value, sparse_indices=sparse_indices, scale_value=scale_value,
                key_quant_mode=key_quant_mode, value_quant_mode=value_quant_mode,
                key_dequant_scale=key_dequant_scale, value_dequant_scale=value_dequant_scale, block_table=block_table,
                actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_kv=actual_seq_lengths_kv,
                sparse_block_size=sparse_block_size, layout_query=layout_query, layout_kv=layout_kv,
                sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
                attention_mode=attention_mode, quant_scale_repo_mode=quant_scale_repo_mode, tile_size=tile_size,
                rope_head_dim=rope_head_dim, return_softmax_lse=return_softmax_lse, key_dtype=key_dtype,
                precision=precision, probability_rounding=probability_rounding)
    reject_on_device(backend, attention_out)
    if attention_out is not None:
        args["attention_out"] = attention_out
    return run(QSFA, args, backend, chip=chip)


# ==================================================================================================
# SFA: sparse_flash_attention

SFA = "sparse_flash_attention"
SFA_SOURCE = "docs/numerics/attention.md#sparse_flash_attention; torch_npu npu_sparse_flash_attention doc and meta registration"
SFA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SFA_SPARSE_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
_N_SFA = Names(SFA, sfa_case, source=SFA_SOURCE)


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


def _sfa_rules():
    n = _N_SFA
    r = []
    r += [is_array(SFA, p, source=SFA_SOURCE) for p in ("query", "key", "sparse_indices")]
    r += [is_array(SFA, p, optional=True, source=SFA_SOURCE)
          for p in ("value", "query_rope", "key_rope", "sinks", "block_table", "actual_seq_lengths_query",
                    "actual_seq_lengths_kv")]
    r.append(dtype_in(SFA, "query", ("float16", "bfloat16"), source=SFA_SOURCE))
    for p in ("key", "value", "query_rope", "key_rope"):
        def same(a, p=p):
            v = a.get(p)
            return None if v is None or v.dtype == a.query.dtype else dtype_name(v)

        def change(a, p=p):
            other = np.float16 if a["query"].dtype == _BF16 else _BF16
            a[p] = a[p].astype(other)

        r.append(rule(n, f"{p}_dtype", p, "dtype", "must have the query's dtype", same, edit(n, change), dtype=True))
    r.append(dtype_in(SFA, "sinks", ("float32",), source=SFA_SOURCE))
    r.append(dtype_in(SFA, "sparse_indices", ("int32",), source=SFA_SOURCE))
    r += [dtype_in(SFA, p, ("int32",), source=SFA_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv")]
    r += layout_rules(n)
    r += rank_rules(n, extra=(("sparse_indices", 4, 3, "number of dimensions must be 4 for layout_query BSND "
                                                       "and 3 for TND"),
                              ("query_rope", 4, 3, "number of dimensions must be that of query")))
    r.append(_ndim_rule(n, "value", lambda a: a.key.ndim, "number of dimensions must be that of key"))
    r.append(_ndim_rule(n, "key_rope", lambda a: a.key.ndim, "number of dimensions must be that of key"))
    r += nonempty_rules(n, ("query", "key", "value"))
    r += _head_dim_and_kv_head_rules(n, 512, "KV_N")
    r.append(rule(n, "query_heads", "query", "shape", f"Q_N (dimension -2) must be {one_of(SFA_QUERY_HEADS)}",
                  lambda a: None if a.query.shape[-2] in SFA_QUERY_HEADS else tuple(a.query.shape),
                  edit(n, n_heads=3)))
    r.append(rule(n, "rope_pair", "key_rope", "value", "query_rope and key_rope must be given together",
                  lambda a: None if (a.get("query_rope") is None) == (a.get("key_rope") is None) else "None"
                  if a.get("key_rope") is None else "a tensor", edit(n, setting(key_rope=None))))
    r.append(rule(n, "query_rope_shape", "query_rope", "shape", "must be query.shape[:-1] + (64,)",
                  lambda a: None if a.get("query_rope") is None or a.query_rope.shape == a.query.shape[:-1] + (64,)
                  else tuple(a.query_rope.shape),
                  edit(n, lambda a: a.update(query_rope=np.ascontiguousarray(a["query_rope"][..., :32])))))
    r += sparse_indices_rules(n)
    r += mode_rules(n)
    r.append(rule(n, "attention_mode_value", "attention_mode", "value",
                  "must be 0 or 2 (2: MLA-absorb, the only mode the NPU kernels document)",
                  lambda a: None if is_int(a.attention_mode) and a.attention_mode in (0, 2) else a.attention_mode,
                  edit(n, setting(attention_mode=1))))
    r.append(rule(n, "sparse_block_size_value", "sparse_block_size", "value",
                  f"must be a power of two in [1, 128]: {one_of(SFA_SPARSE_BLOCK_SIZES)}",
                  lambda a: None if is_int(a.sparse_block_size) and a.sparse_block_size in SFA_SPARSE_BLOCK_SIZES
                  else a.sparse_block_size, edit(n, setting(sparse_block_size=3))))
    r += length_rules(n)
    r.append(sbs_divides_block_size(n))
    r.append(rule(n, "value_shape", "value", "shape", "must have the key's shape",
                  lambda a: None if a.get("value") is None or a.value.shape == a.key.shape else tuple(a.value.shape),
                  edit(n, lambda a: a.update(value=np.ascontiguousarray(a["value"][..., :256])))))
    r.append(rule(n, "key_rope_shape", "key_rope", "shape", "must be key.shape[:-1] + (64,)",
                  lambda a: None if a.get("key_rope") is None or a.key_rope.shape == a.key.shape[:-1] + (64,)
                  else tuple(a.key_rope.shape),
                  edit(n, lambda a: a.update(key_rope=np.ascontiguousarray(a["key_rope"][..., :32])))))

    def lse_pa(a):
        return None if not (a.return_softmax_lse and a.layout_kv == "PA_BSND") else "True with layout_kv PA_BSND"

    r.append(rule(n, "return_softmax_lse_layout", "return_softmax_lse", "value",
                  "softmax_max / softmax_sum are returned only when layout_kv is not PA_BSND (torch_npu doc)", lse_pa,
                  edit(n, setting(return_softmax_lse=True), layout_kv="PA_BSND")))
    r.append(rule(n, "sinks_shape", "sinks", "shape", "must be [Q_N] (one logit per query head)",
                  lambda a: None if a.get("sinks") is None or a.sinks.shape == (a.query.shape[-2],)
                  else tuple(a.sinks.shape), edit(n, setting(sinks=np.zeros((3,), np.float32)))))
    r.append(scale_value_rule(n))
    r.append(bool_rule(n, "return_softmax_lse"))
    r.append(bool_rule(n, "lse_includes_sink"))
    r.append(finite_rule(n, "query"))
    r.append(finite_rule(n, "query_rope"))
    r += [key_rows_finite_rule(n, p) for p in ("key", "value", "key_rope")]
    r.append(rule(  # (finite_rule's violate needs an array in the example; sinks is None there)
        n, "sinks_finite", "sinks", "value", "must not contain inf or nan",
        lambda a: None if a.get("sinks") is None or np.isfinite(a.sinks).all() else "non-finite",
        edit(n, setting(sinks=np.array([np.nan], np.float32)))))
    r.append(choice_rule(n, "precision", PRECISIONS, source="docs/numerics/attention.md#rounding-points (qsfa's parameter, not torch_npu's)"))
    r.append(choice_rule(n, "probability_rounding", PROBABILITY_ROUNDINGS,
                         source="docs/numerics/open-facts.md#probability_rounding"))
    r.append(rule(n, "chip_attention_mode", "attention_mode", "value", "the NPU kernels support only attention_mode 2",
                  lambda a: None if a.attention_mode == 2 else a.attention_mode, edit(n, setting(attention_mode=0)),
                  chips=("A2", "A3", "950")))
    r.append(rule(n, "a2a3_sinks", "sinks", "value", "sinks are supported on Ascend 950 only",
                  lambda a: None if a.get("sinks") is None else "a tensor",
                  edit(n, setting(sinks=np.zeros((1,), np.float32))), chips=("A2", "A3")))
    r += attention_out_rules(n, lambda a: (a["key"] if a.get("value") is None else a["value"]).shape[-1])
    return r


SFA_CONTRACT = Contract(op=SFA, constraints=_sfa_rules(), example=lambda rng: {**sfa_case(), "attention_out": None},
                        params=params(
    "query:array key:array value:array? sparse_indices:array scale_value:float block_table:array?"
    " actual_seq_lengths_query:array? actual_seq_lengths_kv:array? query_rope:array? key_rope:array?"
    " sparse_block_size:int layout_query:str layout_kv:str sparse_mode:int pre_tokens:int next_tokens:int"
    " attention_mode:int return_softmax_lse:bool sinks:array? lse_includes_sink:bool precision:str"
    " probability_rounding:str attention_out:array?"))


def _sfa_reference(**args):
    return _ref.sparse_flash_attention(**args)


define_operator(SFA, SFA_CONTRACT, outputs=("attention_out", "softmax_max", "softmax_sum"),
                numerics=_chips.sfa_numerics, reference=_sfa_reference, doc="Sparse flash attention over a float16/bfloat16 KV (SFA).")


def sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                           actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                           key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                           pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2,
                           return_softmax_lse=False, sinks=None, lse_includes_sink=False, chip=None,
                           backend="reference", precision="faithful", probability_rounding="unnormalised",
                           attention_out=None):
    """Sparse flash attention over a float KV (torch_npu ``npu_sparse_flash_attention``).

    Computes per query row and head ``softmax(scale_value * [q, q_rope] . [k, k_rope]^T) @ v`` over the
    tokens selected by ``sparse_indices`` (rules and rounding points: :mod:`qsfa.reference.attention`;
    K and V are already in the query dtype, so the only roundings are P and the output).

    Parameters (torch_npu names):
      query:  float16 / bfloat16 ``[B, Q_S, Q_N, 512]`` (BSND) or ``[Q_T, Q_N, 512]`` (TND), Q_N in
              {1, 2, 4, ..., 128}.
      key:    same dtype, ``[B, KV_S, 1, 512]`` / ``[KV_T, 1, 512]`` / ``[block_num, block_size, 1, 512]``.
      value:  same dtype and shape as key, or None (V = key; torch_npu allows it from CANN 9.2).
      sparse_indices, scale_value, block_table, actual_seq_lengths_query / _kv, sparse_block_size (a power of
              two in [1, 128], dividing block_size under PA_BSND), layout_query, layout_kv, sparse_mode,
              pre_tokens / next_tokens: as :func:`kv_quant_sparse_flash_attention`.
      query_rope / key_rope: optional ``[..., Q_N, 64]`` / ``[..., 1, 64]`` RoPE parts (both or neither).
      attention_mode: 2 (MLA-absorb; the default here, the only mode the NPU documents) or 0 (accepted by the
              reference: the same formula).
      return_softmax_lse: also return softmax_max / softmax_sum (not with layout_kv PA_BSND).
      sinks:  optional float32 ``[Q_N]`` (Ascend 950): one extra logit per head in the softmax denominator,
              ``out = out_without_sink / (1 + exp(sink - lse))``.
      lse_includes_sink: **OPEN** (default False, as FlashMLA / FlashInfer): whether the returned
              softmax_sum includes ``exp(sink - softmax_max)``.
      chip, backend, precision, probability_rounding: as :func:`kv_quant_sparse_flash_attention` (the chip
              selects the P and output roundings).
    attention_out: optional output buffer, as :func:`kv_quant_sparse_flash_attention`.
    Returns ``(attention_out like query, softmax_max, softmax_sum)`` (LSE shapes as QSFA; empty ``[0]``
    when not requested).
    """
    args = dict(query=query, key=key, value=value, sparse_indices=sparse_indices, scale_value=scale_value,
                block_table=block_table, actual_seq_lengths_query=actual_seq_lengths_query,
                actual_seq_lengths_kv=actual_seq_lengths_kv, query_rope=query_rope, key_rope=key_rope,
                sparse_block_size=sparse_block_size, layout_query=layout_query, layout_kv=layout_kv,
                sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens,
                attention_mode=attention_mode, return_softmax_lse=return_softmax_lse, sinks=sinks,
                lse_includes_sink=lse_includes_sink, precision=precision,
                probability_rounding=probability_rounding)
    reject_on_device(backend, attention_out)
    if attention_out is not None:
        args["attention_out"] = attention_out
    return run(SFA, args, backend, chip=chip)


# ==================================================================================================
# lightning_indexer

LI = "lightning_indexer"
LI_SOURCE = "docs/numerics/indexer.md#lightning_indexer; torch_npu npu_lightning_indexer doc (Ascend/op-plugin) and meta registration"
LI_SPARSE_COUNTS = tuple(range(1, 2049)) + (3072, 4096, 5120, 6144, 7168, 8192)
INDEXER_HEADS_950 = (8, 16, 24, 32, 64)
_N_LI = Names(LI, indexer_case, layout_kv="layout_key", lens_kv="actual_seq_lengths_key", source=LI_SOURCE)


def _indexer_shape_rules(n: Names, op: str, src: str):
    r = []
    r += _head_dim_and_kv_head_rules(n, 128, "N2")
    r.append(rule(n, "query_heads", "query", "shape", "N1 (dimension -2) must be in [1, 64]",
                  lambda a: None if 1 <= a.query.shape[-2] <= 64 else tuple(a.query.shape), edit(n, n_heads=72)))
    r.append(rule(n, "weights_shape", "weights", "shape", "must be query.shape[:-1] ([B, S1, N1] or [T, N1])",
                  lambda a: None if a.weights.shape == a.query.shape[:-1] else tuple(a.weights.shape),
                  edit(n, lambda a: a.update(weights=np.ascontiguousarray(a["weights"][..., :1])))))
    return r


def _li_rules():
    n = _N_LI
    r = [is_array(LI, p, source=LI_SOURCE) for p in ("query", "key", "weights")]
    r += [is_array(LI, p, optional=True, source=LI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key")]
    r.append(dtype_in(LI, "query", ("float16", "bfloat16"), source=LI_SOURCE))

    def key_change(a):
        a["key"] = a["key"].astype(np.float16 if a["query"].dtype == _BF16 else _BF16)

    r.append(rule(n, "key_dtype", "key", "dtype", "must have the query's dtype",
                  lambda a: None if a.key.dtype == a.query.dtype else dtype_name(a.key), edit(n, key_change),
                  dtype=True))
    r.append(dtype_in(LI, "weights", ("float16", "bfloat16", "float32"), source=LI_SOURCE))

    def w_change(a):
        a["weights"] = a["weights"].astype(np.float16 if a["query"].dtype == _BF16 else _BF16)

    r.append(rule(n, "weights_dtype_matches", "weights", "dtype",
                  "a float16 / bfloat16 weights tensor must have the query's dtype",
                  lambda a: None if a.weights.dtype in (np.float32, a.query.dtype) else dtype_name(a.weights),
                  edit(n, w_change), dtype=True))
    r += [dtype_in(LI, p, ("int32",), source=LI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key")]
    r += layout_rules(n)
    r += rank_rules(n, extra=(("weights", 3, 2, "number of dimensions must be 3 ([B, S1, N1]) for layout_query "
                                                "BSND and 2 ([T, N1]) for TND"),))
    r += nonempty_rules(n, ("query", "key"))
    r += _indexer_shape_rules(n, LI, LI_SOURCE)
    r.append(rule(n, "sparse_count_value", "sparse_count", "value",
                  "must be in [1, 2048] or one of {3072, 4096, 5120, 6144, 7168, 8192}",
                  lambda a: None if is_int(a.sparse_count) and a.sparse_count in LI_SPARSE_COUNTS else a.sparse_count,
                  edit(n, setting(sparse_count=2049))))
    r += mode_rules(n)
    r += length_rules(n, kv_seq_dim_name="S2")
    r.append(bool_rule(n, "return_value"))
    r.append(rule(n, "return_value_layout", "return_value", "value",
                  "sparse_values are returned only when layout_key is not PA_BSND (torch_npu doc)",
                  lambda a: None if not (a.return_value and a.layout_key == "PA_BSND") else True,
                  edit(n, setting(return_value=True), layout_kv="PA_BSND")))
    r.append(finite_rule(n, "query"))
    r.append(finite_rule(n, "weights"))
    r.append(key_rows_finite_rule(n))
    r.append(choice_rule(n, "tie_break", TIE_BREAKS, source="docs/numerics/open-facts.md#tie_break"))
    r.append(rule(n, "950_query_heads", "query", "shape", f"Ascend 950 supports N1 {one_of(INDEXER_HEADS_950)}",
                  lambda a: None if a.query.shape[-2] in INDEXER_HEADS_950 else tuple(a.query.shape),
                  edit(n, n_heads=4), chips=("950",)))
    r.append(rule(n, "950_weights_dtype", "weights", "dtype", "Ascend 950 does not support float32 weights",
                  lambda a: None if a.weights.dtype != np.float32 else "float32",
                  edit(n, weights_dtype=np.float32), chips=("950",), dtype=True))
    return r


LI_CONTRACT = Contract(op=LI, constraints=_li_rules(),
                       example=lambda rng: {**indexer_case(), "tie_break": "lower_index"}, params=params(
    "query:array key:array weights:array actual_seq_lengths_query:array? actual_seq_lengths_key:array?"
    " block_table:array? layout_query:str layout_key:str sparse_count:int sparse_mode:int pre_tokens:int"
    " next_tokens:int return_value:bool tie_break:str"))


def _li_reference(**args):
    return _ref_li.lightning_indexer(**args)


define_operator(LI, LI_CONTRACT, outputs=("sparse_indices", "sparse_values"), reference=_li_reference,
                doc="Top-k token selection for sparse attention (lightning indexer).")


def lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                      block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                      pre_tokens=INT64_MAX, next_tokens=INT64_MAX, return_value=False, tie_break="lower_index",
                      chip=None, backend="reference"):
    """The ``sparse_count`` best KV tokens per query row (torch_npu ``npu_lightning_indexer``, docs/numerics/indexer.md#lightning_indexer).

    ``score(i, j) = sum_h weights[i, h] * ReLU(query[i, h] . key[j])`` in fp32 over the tokens row i may
    see (right-down causal for sparse_mode 3, as sparse attention); the indices of the
    ``min(sparse_count, visible)`` largest scores in descending order, padded with -1.

    Parameters (torch_npu names):
      query:   float16 / bfloat16 ``[B, S1, N1, 128]`` (BSND) or ``[T, N1, 128]`` (TND); N1 in [1, 64]
               (Ascend 950: 8, 16, 24, 32, 64).
      key:     query's dtype, ``[B, S2, 1, 128]`` / ``[T2, 1, 128]`` / ``[block_count, block_size, 1, 128]``.
      weights: ``[B, S1, N1]`` / ``[T, N1]``, float32 or the query's dtype (950: not float32).
      actual_seq_lengths_query / actual_seq_lengths_key, block_table, layout_query, layout_key, sparse_mode,
      pre_tokens / next_tokens: as :func:`kv_quant_sparse_flash_attention`.
      sparse_count: K, in [1, 2048] or 3072 ... 8192 (step 1024).
      return_value: also return the selected scores (query dtype; not with layout_key PA_BSND).
      tie_break: **OPEN** - "lower_index" (the only choice: equal scores in increasing token order).
    Returns ``(sparse_indices int32 [B, S1, 1, K] / [T, 1, K], sparse_values)``; sparse_values has the
    indices' shape and the query dtype (-inf at -1 entries) when return_value, else is empty ``[0]``.
    """
    args = dict(query=query, key=key, weights=weights, actual_seq_lengths_query=actual_seq_lengths_query,
                actual_seq_lengths_key=actual_seq_lengths_key, block_table=block_table, layout_query=layout_query,
                layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode, pre_tokens=pre_tokens,
                next_tokens=next_tokens, return_value=return_value, tie_break=tie_break)
    return run(LI, args, backend, chip=chip)


# ==================================================================================================
# quant_lightning_indexer

QLI = "quant_lightning_indexer"
QLI_SOURCE = "docs/numerics/indexer.md#quant_lightning_indexer; torch_npu npu_quant_lightning_indexer doc (Ascend/op-plugin) and meta registration"
QLI_FORMATS = ("int8", "float8_e4m3fn", "hifloat8")
_N_QLI = Names(QLI, lambda **kw: indexer_case(quant=True, **kw), layout_kv="layout_key",
               lens_kv="actual_seq_lengths_key", source=QLI_SOURCE)


def _code_format(arr, named):
    """The code format of a quantised indexer tensor, or None when the dtype / name pair is inconsistent."""
    dt = dtype_name(arr)
    if named is None:
        return {"int8": "int8", "float8_e4m3fn": "float8_e4m3fn"}.get(dt)
    ok = {"int8": ("int8",), "float8_e4m3fn": ("float8_e4m3fn",), "uint8": QLI_FORMATS}.get(dt, ())
    return named if named in ok else None


def _qli_rules():
    n = _N_QLI
    r = [is_array(QLI, p, source=QLI_SOURCE)
         for p in ("query", "key", "weights", "query_dequant_scale", "key_dequant_scale")]
    r += [is_array(QLI, p, optional=True, source=QLI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key")]
    r.append(dtype_in(QLI, "query", ("int8", "uint8", "float8_e4m3fn"), source=QLI_SOURCE))
    r.append(dtype_in(QLI, "key", ("int8", "uint8", "float8_e4m3fn"), source=QLI_SOURCE))
    r.append(choice_rule(n, "query_dtype", (None,) + QLI_FORMATS))
    r.append(choice_rule(n, "key_dtype", (None,) + QLI_FORMATS))
    for p, named in (("query", "query_dtype"), ("key", "key_dtype")):
        def fmt_check(a, p=p, named=named):
            return None if _code_format(a[p], a.get(named)) is not None else \
                f"{dtype_name(a[p])} array with {named}={a.get(named)!r}"

        def fmt_change(a, p=p):
            a[p] = a[p].view(np.uint8)

        r.append(rule(n, f"{p}_format", named, "value",
                      "int8 / float8_e4m3fn arrays take None or their own name; uint8 codes need an explicit "
                      f"{named} ({one_of(QLI_FORMATS)})", fmt_check, edit(n, fmt_change), dtype=False))

    def same_fmt(a):
        qf, kf = _code_format(a.query, a.get("query_dtype")), _code_format(a.key, a.get("key_dtype"))
        return None if qf == kf else f"query {qf}, key {kf}"

    def same_fmt_change(a):
        a["key"] = a["key"].view(np.uint8)
        a["key_dtype"] = "hifloat8"

    r.append(rule(n, "formats_match", "key_dtype", "value", "query and key must hold the same code format",
                  same_fmt, edit(n, same_fmt_change)))
    r.append(dtype_in(QLI, "weights", ("float16", "bfloat16"), source=QLI_SOURCE))
    r.append(dtype_in(QLI, "query_dequant_scale", ("float16", "float32"), source=QLI_SOURCE))
    r.append(dtype_in(QLI, "key_dequant_scale", ("float16", "float32"), source=QLI_SOURCE))
    r += [dtype_in(QLI, p, ("int32",), source=QLI_SOURCE)
          for p in ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_key")]
    r += layout_rules(n)
    r += rank_rules(n, extra=(("weights", 3, 2, "number of dimensions must be 3 ([B, S1, N1]) for layout_query "
                                                "BSND and 2 ([T, N1]) for TND"),
                              ("query_dequant_scale", 3, 2, "number of dimensions must be that of weights")))
    r.append(_ndim_rule(n, "key_dequant_scale", lambda a: a.key.ndim - 1,
                        "number of dimensions must be key's minus one (key.shape[:-1])"))
    r += nonempty_rules(n, ("query", "key"))
    r += _indexer_shape_rules(n, QLI, QLI_SOURCE)
    r.append(rule(n, "query_dequant_scale_shape", "query_dequant_scale", "shape", "must be query.shape[:-1]",
                  lambda a: None if a.query_dequant_scale.shape == a.query.shape[:-1]
                  else tuple(a.query_dequant_scale.shape),
                  edit(n, lambda a: a.update(query_dequant_scale=np.ascontiguousarray(a["query_dequant_scale"][..., :1])))))
    r.append(fixed_value(n, "query_quant_mode", 0, "only 0 (per-token-head quantisation) is supported", 1))
    r.append(fixed_value(n, "key_quant_mode", 0, "only 0 (per-token-head quantisation) is supported", 1))
    r.append(rule(n, "sparse_count_value", "sparse_count", "value", "must be in [1, 2048]",
                  lambda a: None if is_int(a.sparse_count) and 1 <= a.sparse_count <= 2048 else a.sparse_count,
                  edit(n, setting(sparse_count=3072))))
    r += mode_rules(n)
    r += length_rules(n, kv_seq_dim_name="S2")
    r.append(rule(n, "key_dequant_scale_shape", "key_dequant_scale", "shape",
                  "must be key.shape[:-1] ([B, S2, 1], [T2, 1] or [block_count, block_size, 1])",
                  lambda a: None if a.key_dequant_scale.shape == a.key.shape[:-1] else tuple(a.key_dequant_scale.shape),
                  edit(n, lambda a: a.update(key_dequant_scale=np.ascontiguousarray(a["key_dequant_scale"][:, :1])))))
    for p in ("weights", "query_dequant_scale", "key_dequant_scale"):
        r.append(finite_rule(n, p))
    r.append(choice_rule(n, "tie_break", TIE_BREAKS, source="docs/numerics/open-facts.md#tie_break"))

    def a2a3(a):
        f = _code_format(a.query, a.get("query_dtype"))
        dts = (dtype_name(a.weights), dtype_name(a.query_dequant_scale), dtype_name(a.key_dequant_scale))
        return None if f == "int8" and dts == ("float16",) * 3 else f"{f} with {dts}"

    r.append(rule(n, "a2a3_dtypes", "query", "dtype",
                  "Atlas A2/A3 support int8 query/key with float16 weights and dequant scales only", a2a3,
                  edit(n, fmt="float8_e4m3fn"), chips=("A2", "A3"), dtype=True))
    combos = {"float8_e4m3fn": (("bfloat16", "float32", "float32"), ("float16", "float16", "float16")),
              "hifloat8": (("bfloat16", "float32", "float32"),), "int8": (("float16", "float16", "float16"),)}

    def c950(a):
        f = _code_format(a.query, a.get("query_dtype"))
        dts = (dtype_name(a.weights), dtype_name(a.query_dequant_scale), dtype_name(a.key_dequant_scale))
        return None if dts in combos.get(f, ()) else f"{f} with {dts}"

    r.append(rule(n, "950_dtypes", "weights", "dtype",
                  "Ascend 950 supports (weights, query_dequant_scale, key_dequant_scale) = (bfloat16, float32, "
                  "float32) or (float16, float16, float16) for float8_e4m3fn, (bfloat16, float32, float32) for "
                  "hifloat8 and (float16, float16, float16) for int8", c950,
                  edit(n, fmt="hifloat8"), chips=("950",), dtype=True))
    r.append(rule(n, "950_query_heads", "query", "shape", f"Ascend 950 supports N1 {one_of(INDEXER_HEADS_950)}",
                  lambda a: None if a.query.shape[-2] in INDEXER_HEADS_950 else tuple(a.query.shape),
                  edit(n, n_heads=4), chips=("950",)))
    return r


QLI_CONTRACT = Contract(op=QLI, constraints=_qli_rules(),
                        example=lambda rng: {**indexer_case(quant=True), "tie_break": "lower_index"}, params=params(
    "query:array key:array weights:array actual_seq_lengths_query:array? actual_seq_lengths_key:array?"
    " block_table:array? layout_query:str layout_key:str sparse_count:int sparse_mode:int pre_tokens:int"
    " next_tokens:int query_dequant_scale:array key_dequant_scale:array query_quant_mode:int key_quant_mode:int"
    " query_dtype:str? key_dtype:str? tie_break:str"))


def _qli_reference(**args):
    return _ref_li.quant_lightning_indexer(**args)


define_operator(QLI, QLI_CONTRACT, outputs=("sparse_indices",), reference=_qli_reference,
                doc="Top-k token selection from per-token-head quantised query and key.")


def quant_lightning_indexer(query, key, weights, query_dequant_scale, key_dequant_scale, query_quant_mode=0,
                            key_quant_mode=0, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                            block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                            sparse_mode=3, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, query_dtype=None,
                            key_dtype=None, tie_break="lower_index", chip=None, backend="reference"):
    """Lightning indexer on quantised inputs (torch_npu ``npu_quant_lightning_indexer``).

    ``score(i, j) = sum_h weights[i, h] * ReLU((query_dequant_scale[i, h] * key_dequant_scale[j]) *
    (query[i, h] . key[j]))`` in fp32 over decoded codes; top-k as :func:`lightning_indexer`.

    Parameters (torch_npu names): query / key one-byte codes - int8 (A2/A3), float8_e4m3fn or HiFloat8
    (uint8 with query_dtype / key_dtype "hifloat8") - shaped as :func:`lightning_indexer`'s (N1 in [1, 64]);
    weights float16 / bfloat16 ``[B, S1, N1]`` / ``[T, N1]``; query_dequant_scale float16 / float32 of the
    weights' shape; key_dequant_scale float16 / float32 ``key.shape[:-1]``; query_quant_mode /
    key_quant_mode 0 (per token-head); sparse_count in [1, 2048]; the chip dtype combinations are in the
    contract. Returns sparse_indices int32 ``[B, S1, 1, K]`` / ``[T, 1, K]``.
    """
    args = dict(query=query, key=key, weights=weights, query_dequant_scale=query_dequant_scale,
                key_dequant_scale=key_dequant_scale, query_quant_mode=query_quant_mode, key_quant_mode=key_quant_mode,
                actual_seq_lengths_query=actual_seq_lengths_query, actual_seq_lengths_key=actual_seq_lengths_key,
                block_table=block_table, layout_query=layout_query, layout_key=layout_key, sparse_count=sparse_count,
                sparse_mode=sparse_mode, pre_tokens=pre_tokens, next_tokens=next_tokens, query_dtype=query_dtype,
                key_dtype=key_dtype, tie_break=tie_break)
    return run(QLI, args, backend, chip=chip)


# ==================================================================================================
# merge_attention_lse

MERGE = "merge_attention_lse"
MERGE_SOURCE = "docs/numerics/attention.md#merge_attention_lse (context-parallel merge of partial results)"


def merge_case(*, layout_query="BSND", parts=2, seed=0):
    rng = np.random.default_rng(seed)
    if layout_query == "BSND":
        out = rng.uniform(-1, 1, (parts, 1, 2, 2, 8)).astype(_BF16)
        stat_shape = (parts, 1, 1, 2, 2)
    else:
        out = rng.uniform(-1, 1, (parts, 3, 2, 8)).astype(_BF16)
        stat_shape = (parts, 1, 3, 2)
    m = rng.uniform(-2, 2, stat_shape).astype(np.float32)
    s = rng.uniform(1, 5, stat_shape).astype(np.float32)
    return dict(attention_out=out, softmax_max=m, softmax_sum=s, layout_query=layout_query)


_N_MERGE = Names(MERGE, merge_case, source=MERGE_SOURCE)


def _merge_rules():
    n = _N_MERGE
    r = [is_array(MERGE, p, source=MERGE_SOURCE) for p in ("attention_out", "softmax_max", "softmax_sum")]
    r.append(dtype_in(MERGE, "attention_out", ("float16", "bfloat16", "float32", "float64"), source=MERGE_SOURCE))
    r.append(dtype_in(MERGE, "softmax_max", ("float32", "float64"), source=MERGE_SOURCE))
    r.append(rule(n, "softmax_sum_dtype", "softmax_sum", "dtype", "must have softmax_max's dtype",
                  lambda a: None if a.softmax_sum.dtype == a.softmax_max.dtype else dtype_name(a.softmax_sum),
                  edit(n, lambda a: a.update(softmax_sum=a["softmax_sum"].astype(np.float64))), dtype=True))
    r.append(choice_rule(n, "layout_query", LAYOUTS_Q, bad="BNSD"))
    r.append(rule(n, "attention_out_ndim", "attention_out", "dim",
                  "must be [P, B, S, N, D] (BSND) or [P, T, N, D] (TND): partial results stacked on axis 0",
                  lambda a: None if a.attention_out.ndim == (5 if a.layout_query == "BSND" else 4)
                  else a.attention_out.ndim, edit(n, lambda a: a.update(attention_out=a["attention_out"][None]))))

    def stat_shape(a):
        o = a.attention_out.shape
        want = (o[0], o[1], 1, o[2], o[3]) if a.layout_query == "BSND" else (o[0], 1, o[1], o[2])
        return None if a.softmax_max.shape == want else tuple(a.softmax_max.shape)

    r.append(rule(n, "softmax_max_shape", "softmax_max", "shape",
                  "must be [P, B, 1, S, N] (BSND) or [P, 1, T, N] (TND) matching attention_out", stat_shape,
                  edit(n, lambda a: a.update(softmax_max=a["softmax_max"][:1]))))
    r.append(rule(n, "softmax_sum_shape", "softmax_sum", "shape", "must have softmax_max's shape",
                  lambda a: None if a.softmax_sum.shape == a.softmax_max.shape else tuple(a.softmax_sum.shape),
                  edit(n, lambda a: a.update(softmax_sum=a["softmax_sum"][:1]))))
    r.append(rule(n, "parts", "attention_out", "shape", "at least one partial result is needed (P >= 1)",
                  lambda a: None if a.attention_out.shape[0] >= 1 else tuple(a.attention_out.shape),
                  edit(n, lambda a: a.update(attention_out=a["attention_out"][:0], softmax_max=a["softmax_max"][:0],
                                             softmax_sum=a["softmax_sum"][:0]))))
    r.append(rule(n, "softmax_sum_values", "softmax_sum", "value", "must be finite and >= 0 (0 marks an empty shard)",
                  lambda a: None if (np.isfinite(a.softmax_sum) & (a.softmax_sum >= 0)).all() else "negative or non-finite",
                  edit(n, lambda a: a.update(softmax_sum=-a["softmax_sum"]))))
    r.append(rule(n, "softmax_max_values", "softmax_max", "value", "must be finite",
                  lambda a: None if np.isfinite(a.softmax_max).all() else "non-finite",
                  edit(n, lambda a: a.update(softmax_max=a["softmax_max"] * np.float32(np.inf)))))
    r.append(finite_rule(n, "attention_out"))
    return r


MERGE_CONTRACT = Contract(op=MERGE, constraints=_merge_rules(), example=lambda rng: merge_case(), params=params(
    "attention_out:array softmax_max:array softmax_sum:array layout_query:str"))


def _merge_reference(attention_out, softmax_max, softmax_sum, layout_query):
    return _ref_lse.merge_attention_lse(attention_out, softmax_max, softmax_sum, layout_query=layout_query)


define_operator(MERGE, MERGE_CONTRACT, outputs=("attention_out", "softmax_max", "softmax_sum"),
                reference=_merge_reference, doc="Merge partial attention results over disjoint token shards.")


def _stack(parts, name):
    """A sequence of P partial arrays (all NumPy or all torch, one shape) stacked on a new axis 0.

    Anything else is passed through unchanged, so the contract's generic type rule rejects it by name:
    like every operator, merge_attention_lse does not turn Python lists of numbers into arrays."""
    if not isinstance(parts, (list, tuple)) or not parts:
        return parts
    if all(is_torch(p) for p in parts):
        kind = "torch"
    elif all(isinstance(p, np.ndarray) for p in parts):
        kind = "numpy"
    else:
        return parts
    shapes = {tuple(p.shape) for p in parts}
    dtypes = {dtype_name(p) for p in parts}
    if len(shapes) > 1 or len(dtypes) > 1:
        raise InvalidArgument("shape", name, Raw(f"parts of shapes {sorted(shapes)}, dtypes {sorted(dtypes)}"),
                              "the partial results must all have one shape and dtype")
    if kind == "torch":
        import torch

        return torch.stack(list(parts))
    return np.stack(parts)


def merge_attention_lse(attention_out, softmax_max, softmax_sum, *, layout_query="BSND", chip=None,
                        backend="reference"):
    """Merge partial attention results computed over disjoint shards of each row's selected tokens.

    ``m = max m_p``, ``w_p = l_p exp(m_p - m)``, ``l = sum w_p``, ``out = sum w_p out_p / l`` in float64
    (docs/numerics/attention.md#merge_attention_lse); an empty shard (``m_p = l_p = 0``) carries no weight and does not take part in the max;
    a row with only empty shards gives ``out = 0, m = l = 0``. See :mod:`qsfa.reference.lse`.

    attention_out: the P partial outputs, a sequence of arrays / tensors or an array stacked on axis 0 (``[P, B, S, N, D]``
    BSND / ``[P, T, N, D]`` TND; float16 / bfloat16 / float32 / float64). softmax_max, softmax_sum: the
    matching statistics (``[P, B, 1, S, N]`` / ``[P, 1, T, N]``, float32 or float64), as returned by the
    attention operators with return_softmax_lse=True. Returns ``(attention_out, softmax_max,
    softmax_sum)`` of one unsplit call, in the input dtypes.
    """
    args = dict(attention_out=_stack(attention_out, "attention_out"), softmax_max=_stack(softmax_max, "softmax_max"),
                softmax_sum=_stack(softmax_sum, "softmax_sum"), layout_query=layout_query)
    return run(MERGE, args, backend, chip=chip)


# ==================================================================================================
# front door, error budget, pipeline


def attention(query, key, value=None, sparse_indices=None, scale_value=None, *, query_rope=None, key_rope=None,
              block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None, sparse_block_size=1,
              layout_query="BSND", layout_kv="BSND", sparse_mode=3, return_softmax_lse=False, sinks=None,
              key_dtype=None, rope_head_dim=None, chip=None, backend="reference", precision="faithful",
              probability_rounding="unnormalised", attention_out=None):
    """Sparse attention, routed by the key's dtype exactly as vLLM-Ascend does.

    vllm_ascend/device/device_op.py (``execute_sparse_flash_attention_process``) sends a KV cache of dtype
    int8 / float8_e4m3fn / float8_e5m2 to the kv-quant kernel (QSFA) and any other (float16 / bfloat16) to
    ``npu_sparse_flash_attention`` (SFA) with ``value = key``. qsfa carries HiFloat8 as uint8, so a uint8
    key is QSFA too. A float8_e5m2 key is routed to QSFA and rejected there (QSFA has no E5M2 NoPE).

    Parameters:
      query:       the NoPE query ``[..., Q_N, 512]`` (BSND / TND), float16 / bfloat16.
      key:         packed QSFA rows (one-byte dtype) or a float KV ``[..., 1, 512]``.
      value:       SFA: ``[..., 1, 512]`` or None (V = key); QSFA: ignored (V = dequantised K NoPE).
      sparse_indices, scale_value: as the operators (both required).
      query_rope:  ``[..., Q_N, 64]`` or None. QSFA: concatenated to query; SFA: query_rope.
      key_rope:    SFA only (QSFA's RoPE is inside the packed rows); must be None for QSFA.
      sinks:       SFA only (Ascend 950).
      key_dtype:   QSFA NoPE format; default: "float8_e4m3fn" for an FP8 array, else "int8".
      rope_head_dim: QSFA; default from the packed width (656 -> 64, 528 -> 0).
      block_table, actual_seq_lengths_query / _kv, sparse_block_size, layout_query, layout_kv, sparse_mode,
      return_softmax_lse, chip, backend, precision, probability_rounding: as the operators.
    attention_out: optional output buffer (an ``np.memmap``), as :func:`kv_quant_sparse_flash_attention`.
    Returns ``(attention_out, softmax_max, softmax_sum)`` of the operator it routes to.
    """
    from ..reference.attention import is_quant_key

    if sparse_indices is None or scale_value is None:
        raise InvalidArgument("value", "sparse_indices" if sparse_indices is None else "scale_value", "None",
                              "sparse_indices and scale_value are required")
    common = dict(block_table=block_table, actual_seq_lengths_query=actual_seq_lengths_query,
                  actual_seq_lengths_kv=actual_seq_lengths_kv, sparse_block_size=sparse_block_size,
                  layout_query=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode,
                  return_softmax_lse=return_softmax_lse, chip=chip, backend=backend, precision=precision,
                  probability_rounding=probability_rounding, attention_out=attention_out)
    if is_quant_key(key):
        if key_rope is not None:
            raise InvalidArgument("value", "key_rope", "a tensor",
                                  "a packed QSFA key carries its RoPE inside the rows; pass key_rope=None")
        if sinks is not None:
            raise InvalidArgument("value", "sinks", "a tensor", "sinks are an SFA (float KV) feature")
        q = query
        if query_rope is not None:
            q = _concat_last(query, query_rope)
        if rope_head_dim is None:
            rope_head_dim = {656: 64, 528: 0}.get(int(key.shape[-1]), 64)
        if key_dtype is None:
            key_dtype = "float8_e4m3fn" if dtype_name(key) == "float8_e4m3fn" else "int8"
        return kv_quant_sparse_flash_attention(q, key, key if value is None else value, sparse_indices, scale_value,
                                               rope_head_dim=rope_head_dim, key_dtype=key_dtype, **common)
    return sparse_flash_attention(query, key, value, sparse_indices, scale_value, query_rope=query_rope,
                                  key_rope=key_rope, sinks=sinks, **common)


def _concat_last(a, b):
    if is_torch(a):
        import torch

        return torch.cat([a, b], dim=-1)
    return np.concatenate([np.asarray(a), np.asarray(b)], axis=-1)


def attention_error_budget(query, key, value=None, sparse_indices=None, scale_value=None, **kwargs):
    """Per output element ``faithful - exact`` (float64 NumPy array) for the arguments of :func:`attention`.

    Runs the reference twice (``precision="faithful"`` and ``"exact"``; any ``precision`` / ``backend``
    argument is ignored) and returns the difference: the error the kernel's rounding points cost on this
    input. Rows that select nothing give 0. The derivation of a bound for it is in the docstring of
    :func:`qsfa.reference.attention.attention_error_budget` and checked in tests/test_attention_precision.py.
    """
    kwargs = dict(kwargs)
    kwargs.pop("precision", None)
    kwargs.pop("backend", None)
    kwargs["return_softmax_lse"] = False
    f = attention(query, key, value, sparse_indices, scale_value, precision="faithful", **kwargs)[0]
    e = attention(query, key, value, sparse_indices, scale_value, precision="exact", **kwargs)[0]
    f = to_numpy(f) if is_torch(f) else f
    e = to_numpy(e) if is_torch(e) else e
    return f.astype(np.float64) - e


#: the end-to-end C8 pipeline (a plain function over the dispatching operators)
c8_pipeline = _ref_pipeline.c8_pipeline
