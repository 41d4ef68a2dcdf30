"""Hypothesis strategies of the attention group (docs/numerics/attention.md, docs/numerics/indexer.md):
QSFA, SFA, the lightning indexers and the LSE merge."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from .. import _edges as _E
from .._values import _exact_codes, _nope_codes, as_dtype
from ._common import _b, _choose, _NAN16, _NAN_CODE, _QDT, _rng, Bounds, bounds, INT64_MAX, sparse_index_rows
from ._common import draw_flags, int_lists, sampled
from .formats import _NP_IN

__all__ = [
    "qsfa_args",
    "sfa_args",
    "lightning_indexer_args",
    "quant_lightning_indexer_args",
    "merge_attention_lse_args",
]


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
    return np.array(draw(int_lists(lo, hi, n)), np.int64)


def _common_flags(layout_query: str, layout_kv: str) -> list:
    """The flags (:func:`~qsfa.strategies._common.draw_flags`) of the shared attention plan for these layouts."""
    specs = [("sparse_mode", (3, 0))]
    if layout_query == "BSND":  # explicit query lengths, and whether they are drawn (7 in 10) or all Q_S
        specs += [("explicit_q", (False, True), "explicit_lengths"), ("q_lengths_drawn", (True,) * 7 + (False,) * 3)]
    else:  # padding rows after the last batch
        specs += [("q_extra", (0, 0, 1, 2))]
    specs += [("long_kv", (False, True))]  # long sequences are the interesting ones
    if layout_kv == "BSND":
        specs += [("kv_extra", (0, 0, 1, 3)), ("explicit_kv", (False, True), "explicit_lengths")]
    elif layout_kv == "TND":
        specs += [("kv_extra", (0, 0, 2))]
    else:  # spare block-table columns, spare physical blocks
        specs += [("bt_extra", (0, 0, 1)), ("nb_extra", (0, 1, 2))]
    return specs


def _plan_query(draw, rng, b: Bounds, layout_query: str, batch: int, pins, f: dict) -> _QPlan:
    max_q = max(1, b.max_q_tokens)
    if layout_query == "BSND":
        q_s = _E.pinned_int(draw, pins, "q_tokens", 1, max_q)
        explicit = f["explicit_q"]
        act_q = (_lengths(draw, batch, 0, q_s) if explicit and f["q_lengths_drawn"] else np.full(batch, q_s))
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
    extra = int(f["q_extra"])
    t = int(ends[-1]) + extra
    r = np.arange(t)
    bb = np.searchsorted(ends, r, side="right")
    valid = bb < batch
    starts = np.concatenate([[0], ends[:-1]])
    bc = np.minimum(bb, batch - 1)
    pos = np.where(valid, r - starts[bc], 0)
    return _QPlan("TND", (t,), act_q, ends.astype(np.int32), np.where(valid, bc, 0), pos, valid)


def _plan_kv(draw, rng, b: Bounds, layout_kv: str, batch: int, pins, f: dict, *, block_sizes,
             act_kv=None) -> _KvPlan:
    max_kv = max(1, b.max_kv_tokens)
    if act_kv is None:
        act_kv = _lengths(draw, batch, 0, max_kv)
        if f["long_kv"]:
            act_kv = np.maximum(act_kv, _lengths(draw, batch, max_kv // 2, max_kv))
        act_kv = _E.kv_lengths(act_kv, pins)
    mk = max(int(act_kv.max(initial=0)), 1)
    j = np.arange(mk)[None, :]
    live = j < act_kv[:, None]
    if layout_kv == "BSND":
        kv_s = mk + int(f["kv_extra"])
        explicit = f["explicit_kv"]
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
        kv_t = max(int(ends[-1]) + int(f["kv_extra"]), 1)
        starts = np.concatenate([[0], ends[:-1]])
        flat = np.where(live, starts[:, None] + j, -1)
        return _KvPlan("TND", (kv_t,), act_kv, flat, None, ends.astype(np.int32))
    bs = int(_choose(draw, pins, "block_size", tuple(block_sizes)))
    need = -(-act_kv // bs)
    width = max(int(need.max(initial=0)), 1) + int(f["bt_extra"])
    used = int(need.sum())
    nb = used + int(f["nb_extra"])
    nb = max(nb, 1)
    phys = rng.permutation(nb)
    bt = rng.integers(-1, nb, (batch, width)).astype(np.int64)  # junk in unused entries
    col = np.arange(width)[None, :]
    used_mask = col < need[:, None]
    bt[used_mask] = phys[:used]
    blk = bt[np.arange(batch)[:, None], np.minimum(j // bs, width - 1)]
    flat = np.where(live, blk * bs + j % bs, -1)
    return _KvPlan("PA_BSND", (nb, bs), act_kv, flat, bt.astype(np.int32), act_kv.astype(np.int32), bs)


def _row_limits(q: _QPlan, act_kv: np.ndarray, sparse_mode: int):
    akv = act_kv[q.batch]
    thr = akv - q.act_q[q.batch] + q.pos + 1 if sparse_mode == 3 else akv.copy()
    thr = np.where(q.valid, thr, 0)
    return thr, np.maximum(np.minimum(akv, thr), 0)


#: flags of :func:`_indices` (drawn with the plan's, :func:`_attention_common`)
_INDEX_FLAGS = [("fill_full", (False, True)), ("junk_after_minus1", (False, True)),
                ("stray_entries", (0.0, 0.5, 1.0))]


def _indices(draw, rng, q: _QPlan, kv: _KvPlan, sparse_mode: int, sbs: int, width: int, pins, f: dict) -> np.ndarray:
    _, limit = _row_limits(q, kv.act_kv, sparse_mode)
    lb = -(-limit // sbs)
    fill = pins["fill"] if "fill" in pins else 1.0 if f["fill_full"] else rng.uniform(0, 1, limit.size)
    junk = f["junk_after_minus1"]
    strays = f["stray_entries"]
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


def _attention_common(draw, b: Bounds, pins, *, heads_options, block_sizes, flags=()):
    """Layouts, batch, heads, the query / KV plans and the rng of an attention-group draw; ``flags``: the calling
    strategy's own small choices, drawn folded with the plan's (:func:`~qsfa.strategies._common.draw_flags`).
    Returns ``(rng, q, kv, n_heads, sparse_mode, f)`` with ``f`` every flag's value."""
    layout_query = _choose(draw, pins, "layout_query", ("BSND", "TND"))
    layout_kv = _choose(draw, pins, "layout_kv", (layout_query, "PA_BSND"))
    if layout_kv != "PA_BSND":  # without paging the KV layout is the query's (a pinned KV layout wins)
        layout_query = layout_kv
    batch = _E.pinned_int(draw, pins, "batch", 1, b.max_batch)
    heads = tuple(h for h in heads_options if h <= b.max_heads) or (heads_options[0],)
    n_heads = _choose(draw, pins, "n_heads", heads)
    f = draw_flags(draw, pins, _common_flags(layout_query, layout_kv) + list(flags))
    rng = _rng(draw)
    q = _plan_query(draw, rng, b, layout_query, batch, pins, f)
    kv = _plan_kv(draw, rng, b, layout_kv, batch, pins, f, block_sizes=block_sizes)
    return rng, q, kv, n_heads, f["sparse_mode"], f


def _pa_block_sizes(b: Bounds, mult=16):
    opts = tuple(x for x in (16, 32, 48, 64, 128) if x % mult == 0 and x <= max(b.max_block_size, 16))
    return opts or (16,)


def _uniform16(rng, shape, qdt) -> np.ndarray:
    """Uniform values in [-1, 1) in the 16-bit query dtype, drawn in float32 (half the cost of float64 draws and
    a float64 -> bfloat16 cast; issue 15)."""
    return (rng.random(shape, np.float32) * np.float32(2) - np.float32(1)).astype(qdt)


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
    from ..ops.attention import QSFA_QUERY_HEADS

    b = _b(bounds)
    pins, _ = _E.take(draw, "kv_quant_sparse_flash_attention", pins)
    key_fmt = _choose(draw, pins, "key_dtype", ("int8", "float8_e4m3fn", "hifloat8"))
    rope = 64 if key_fmt == "hifloat8" else _choose(draw, pins, "rope_head_dim", (64, 0))
    qname = _choose(draw, pins, "dtype", ("bfloat16", "float16"))
    qdt = _QDT[qname]
    # HiFloat8 KV is an Ascend 950 format and 950 supports sparse_block_size 1 only (seed 000)
    sbs = 1 if key_fmt == "hifloat8" else _choose(draw, pins, "sparse_block_size", (1, 2, 4, 8, 16))
    key_arrays = {"int8": ("int8", "uint8"), "float8_e4m3fn": ("float8_e4m3fn", "uint8"), "hifloat8": ("uint8",)}
    flags = [*_INDEX_FLAGS, ("key_array", key_arrays[key_fmt]), ("value_is_key", (True, True, False)),
             ("scale_value", ((512 + 64) ** -0.5, 0.1, 0.02)), ("return_softmax_lse", (False, True)),
             ("precision", ("faithful", "faithful", "exact")), ("probability_rounding", ("unnormalised", "normalised"))]
    rng, q, kv, n_heads, sparse_mode, f = _attention_common(draw, b, pins, heads_options=QSFA_QUERY_HEADS,
                                                            block_sizes=_pa_block_sizes(b), flags=flags)
    width = 2048 if key_fmt == "hifloat8" else _E.sparse_width(draw, pins, b.max_sparse, kv.act_kv, sbs)
    idx = _indices(draw, rng, q, kv, sparse_mode, sbs, width, pins, f)

    # packed rows, drawn for the live tokens only (the storage's other rows are poison): row i of ``block`` is
    # token i of the live (batch, position) pairs in row-major order, stored at flat row ``live_rows[i]``
    live_rows = kv.flat_of[kv.flat_of >= 0]
    n_live = live_rows.size
    width_b = 512 + 2 * rope + 16
    block = np.empty((n_live, width_b), np.uint8)
    block[:, :512], smag = _nope_codes(rng, (n_live, 512), key_fmt)
    block[:, -16:] = (smag * rng.uniform(0.5, 1.5, (n_live, 4))).astype("<f4").view(np.uint8)
    if rope:
        block[:, 512:640] = _uniform16(rng, (n_live, 64), qdt).view(np.uint8)
    nan_code = _NAN_CODE[key_fmt]
    poison = np.empty(width_b, np.uint8)
    poison[:512] = nan_code if nan_code is not None else 0x7F
    if rope:
        poison[512:640] = np.full(64, _NAN16[qname], np.uint16).view(np.uint8)
    poison[-16:] = np.full(4, np.nan, "<f4").view(np.uint8)
    key = np.empty((int(np.prod(kv.key_lead)), width_b), np.uint8)
    key[:] = poison
    key[live_rows] = block
    key = key.reshape(kv.key_lead + (1, width_b))
    arr = f["key_array"]
    key = key.view({"int8": np.int8, "uint8": np.uint8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}[arr])
    value_is_key = f["value_is_key"]
    value = key if value_is_key else np.ascontiguousarray(key[..., :512])

    rows = q.batch.size
    query = _store_q(_uniform16(rng, (rows, n_heads, 512 + rope), qdt), q)
    scale = f["scale_value"]
    return dict(query=query, key=key, value=value, sparse_indices=idx, scale_value=float(scale),
                key_quant_mode=2, value_quant_mode=2, key_dequant_scale=None, value_dequant_scale=None,
                block_table=kv.block_table, actual_seq_lengths_query=q.lens_q, actual_seq_lengths_kv=kv.lens_kv,
                sparse_block_size=sbs, layout_query=q.layout_query, layout_kv=kv.layout_kv,
                sparse_mode=sparse_mode, pre_tokens=INT64_MAX, next_tokens=INT64_MAX, attention_mode=2,
                quant_scale_repo_mode=1, tile_size=128, rope_head_dim=rope,
                return_softmax_lse=f["return_softmax_lse"], key_dtype=key_fmt, precision=f["precision"],
                probability_rounding=f["probability_rounding"])


# ---------------------------------------------------------------------------------------------------
# sparse_flash_attention


@st.composite
def sfa_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``sparse_flash_attention``: float KV (bf16 / fp16) in BSND / TND / PA_BSND with NaN in every unused
    row, value or None (V = key), optional query_rope / key_rope, sinks (+ the OPEN lse_includes_sink),
    sparse_block_size 1-128 (dividing block_size under PA), causal sparse indices with -1 padding.

    pins: as :func:`qsfa_args` plus ``rope``, ``has_value``, ``sinks``, ``attention_mode``."""
    from ..ops.attention import SFA_QUERY_HEADS

    b = _b(bounds)
    pins, _ = _E.take(draw, "sparse_flash_attention", pins)
    qname = _choose(draw, pins, "dtype", ("bfloat16", "float16"))
    qdt = _QDT[qname]
    flags = [*_INDEX_FLAGS, ("rope", (True, False)), ("has_value", (True, False)), ("sinks", (False, False, True)),
             ("return_softmax_lse", (False, True)), ("scale_value", ((512 + 64) ** -0.5, 0.1)),
             ("attention_mode", (2, 2, 0)), ("lse_includes_sink", (False, True)),
             ("precision", ("faithful", "faithful", "exact")), ("probability_rounding", ("unnormalised", "normalised"))]
    rng, q, kv, n_heads, sparse_mode, f = _attention_common(draw, b, pins, heads_options=SFA_QUERY_HEADS,
                                                            block_sizes=_pa_block_sizes(b), flags=flags)
    sbs_opts = (1, 2, 4, 8, 16, 32, 64, 128)
    if kv.layout_kv == "PA_BSND":
        sbs_opts = tuple(s for s in sbs_opts if kv.block_size % s == 0)
    sbs = _choose(draw, pins, "sparse_block_size", sbs_opts)
    width = _E.sparse_width(draw, pins, b.max_sparse, kv.act_kv, sbs)
    idx = _indices(draw, rng, q, kv, sparse_mode, sbs, width, pins, f)
    bsz, mk = kv.flat_of.shape
    rope = f["rope"]
    has_value = f["has_value"]
    nan_row = lambda w: np.full(w, np.nan, np.float32).astype(qdt)  # noqa: E731
    key = _place_rows(kv, as_dtype(rng.uniform(-1, 1, (bsz, mk, 512)), qdt), nan_row(512))
    value = _place_rows(kv, as_dtype(rng.uniform(-1, 1, (bsz, mk, 512)), qdt), nan_row(512)) if has_value else None
    rows = q.batch.size
    qr = kr = None
    if rope:
        qr = _store_q(as_dtype(rng.uniform(-1, 1, (rows, n_heads, 64)), qdt), q)
        kr = _place_rows(kv, as_dtype(rng.uniform(-1, 1, (bsz, mk, 64)), qdt), nan_row(64))
    sinks = None
    if f["sinks"]:
        sinks = rng.uniform(-2, 2, n_heads).astype(np.float32)
    lse = False if kv.layout_kv == "PA_BSND" else f["return_softmax_lse"]
    query = _store_q(as_dtype(rng.uniform(-1, 1, (rows, n_heads, 512)), qdt), q)
    return dict(query=query, key=key, value=value, sparse_indices=idx, scale_value=float(f["scale_value"]),
                block_table=kv.block_table, actual_seq_lengths_query=q.lens_q, actual_seq_lengths_kv=kv.lens_kv,
                query_rope=qr, key_rope=kr, sparse_block_size=sbs, layout_query=q.layout_query,
                layout_kv=kv.layout_kv, sparse_mode=sparse_mode, pre_tokens=INT64_MAX, next_tokens=INT64_MAX,
                attention_mode=f["attention_mode"], return_softmax_lse=lse, sinks=sinks,
                lse_includes_sink=f["lse_includes_sink"], precision=f["precision"],
                probability_rounding=f["probability_rounding"])


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
    rng, q, kv, n_heads, sparse_mode, _ = _attention_common(draw, b, pins, heads_options=tuple(range(1, 65)),
                                                            block_sizes=_pa_block_sizes(b))
    bsz, mk = kv.flat_of.shape
    key_rows = rng.integers(-3, 4, (bsz, mk, 128))
    if pins.get("constant_rows"):  # every key equal: every score of a row equal (ties everywhere)
        key_rows[:] = key_rows[:1, :1]
    key = _place_rows(kv, key_rows.astype(qdt), np.full(128, np.nan, np.float32).astype(qdt))
    rows = q.batch.size
    query = _store_q(rng.integers(-3, 4, (rows, n_heads, 128)).astype(qdt), q)
    if "weights_dtype" in pins:
        wdt = _choose(draw, pins, "weights_dtype", (qname, "float32"))
    else:  # the query dtype or float32 (pin weights_float32=False: the 950's rule 950_weights_dtype)
        wdt = "float32" if _choose(draw, pins, "weights_float32", (False, True)) else qname
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
    rng, q, kv, n_heads, sparse_mode, _ = _attention_common(draw, b, pins, heads_options=tuple(range(1, 65)),
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
    if "weights_scale" in pins:  # {format: ((weights dtype, scale dtype), ...)}: the 950's rule 950_dtypes
        wname, sname = draw(sampled(tuple(pins["weights_scale"][fmt])))
        wdt, sdt = _QDT[wname], np.dtype(sname)
    else:
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
    m = as_dtype(rng.uniform(-20, 20, stat), sdt)
    s = as_dtype(rng.uniform(1, 300, stat), sdt)
    empty = rng.random(stat) < 0.15
    m[empty] = 0
    s[empty] = 0
    if edge is not None:
        m, s = _E.merge_stats(rng, edge, stat, sdt)
    return dict(attention_out=out, softmax_max=m, softmax_sum=s, layout_query=layout)
