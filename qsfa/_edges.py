"""Edge cases first: the boundaries kernels break at, for every operator strategy of :mod:`qsfa.strategies`.

Each operator has a tuple of named *edges* (:data:`EDGES`). An edge is a set of pins (choices it fixes: a
format, a rounding mode, a block size, a layout) plus, where needed, constructed array contents: values on the
rounding midpoints (ties) of the target format, one float32 ulp either side of them, powers of two and their
neighbours (E8M0 and scale boundaries), values at and past the saturation point, all-zero tiles and groups,
-1 at the first, a middle and the last slot, block sizes above 16 (paged attention caches: 32, 48, 128, 1024),
rows selecting more than 256 tokens (attention; in bf16 an odd count above 256, which bf16 cannot hold), near-ties whose order depends on the order of scale multiplications (indexer), merge inputs
whose maxima overflow a naive exp.

How they are used:

* A strategy takes ``edge`` as a pin (``valid_args(op, edge="...")``); without it a draw is typical.
* The conformance runner (:mod:`qsfa.conformance.runner`) runs the simplest example of every edge of the
  operator as an explicit hypothesis example before the random ones, so every edge is exercised in the
  ``ci`` profile at the cost of one example each (``hypothesis.find`` with the generate phase only: no search,
  no shrinking; the edge example is already minimal).

Edges may exceed the profile's size bounds where the boundary lies beyond them (rows selecting > 256 tokens,
block sizes 32): they are single explicit examples, not the bulk of the run. Runs with bounds below the ``ci``
profile's (the Triton interpreter's tiny shapes, ``--bound max_kv_tokens=...`` under 96) have no edge phase.

Number facts used (docs/numerics/formats.md, docs/numerics/quantisers.md): a tie of the int8 cast is
``j + 0.5``; with ``amax = TYPE_MAX * 2^k`` the dynamic scale ``amax / TYPE_MAX`` is exactly ``2^k``, so
``x = m * 2^k`` quantises the midpoint ``m`` exactly; KvCompressEpilog's FP4 multiplier ``bf16(6 / amax)`` is
exactly ``2^-k`` for ``amax = 6 * 2^k``; with ``x = +-1`` RMSNorm returns ``gamma`` once rounded to 16 bits
(``x / rms`` is ``1 - 5e-7`` in fp32), so a tie pattern in ``gamma`` reaches the C8 quantiser unchanged.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

__all__ = ["EDGES", "take", "encode_values", "decode_codes", "tie_tiles", "order_split_tiles", "slots_edge",
           "block_size", "pinned_int"]

_FMTS = ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8", "float4_e2m1", "float8_e8m0", "bfloat16", "float16")
_ROUNDINGS = {"int8": ("rint", "round"), "float8_e4m3fn": ("rint", "round"), "float8_e5m2": ("rint", "round"),
              "hifloat8": ("round", "hybrid"), "float4_e2m1": ("rint", "round"),
              "float8_e8m0": ("floor", "ceil", "rint", "round"), "bfloat16": ("rint", "round"),
              "float16": ("rint", "round")}
_DBQ_DST = ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8")
_SLOT_EDGES = ("minus1:first", "minus1:middle", "minus1:last", "full", "block_size:17", "block_size:32")
_ATTN_EDGES = ("long_rows", "long_rows:bf16_odd", "pa_block_size:32", "pa_block_size:48", "pa_block_size:128",
               "pa_block_size:1024", "batches:distinct_q", "empty_rows", "minus1_junk", "sparse_mode:0",
               "sparse_block_size:4", "lse")

#: operator -> its edges (names), in the order the runner tries them
EDGES: dict[str, tuple[str, ...]] = {
    "formats.encode": tuple(f"{f}/{r}" for f in _FMTS for r in _ROUNDINGS[f]) + tuple(f"{f}/saturate" for f in _FMTS),
    "formats.decode": _FMTS,
    "formats.pack_fp4": ("low_first", "high_first"),
    "formats.unpack_fp4": ("low_first", "high_first"),
    "dynamic_block_quant": tuple(f"{k}:{d}" for d in _DBQ_DST for k in ("ties", "zero", "saturate", "order"))
    + ("row_blocks:int8", "dst_type_max:56"),
    "scatter_by_slot": _SLOT_EDGES,
    "c8_cache_write": ("ties:int8", "ties:float8_e4m3fn", "zero_tiles", "rope0") + _SLOT_EDGES,
    "c8_rmsnorm_rope_cache": ("ties:int8", "ties:float8_e4m3fn", "rope0", "epsilon") + _SLOT_EDGES,
    "kv_compress_epilog": ("zero_groups:0", "zero_groups:1", "zero_groups:2", "e8m0_floor", "ties:0", "ties:1",
                           "ties:2", "mode:0", "mode:2") + _SLOT_EDGES,
    "kv_rmsnorm_rope_cache": ("int8_ties", "int8_saturate", "minus1:first", "minus1:last", "epsilon", "v2"),
    "kv_quant_sparse_flash_attention": _ATTN_EDGES + ("rope0",),
    "sparse_flash_attention": _ATTN_EDGES + ("sinks",),
    "lightning_indexer": ("ties", "full_rows", "pa_block_size:32", "batches:distinct_q", "empty_rows",
                          "batches:distinct_kv"),
    "quant_lightning_indexer": ("ties", "full_rows", "pa_block_size:32", "batches:distinct_q", "scale_order",
                                "batches:distinct_kv"),
    "merge_attention_lse": ("empty_shards", "large_max"),
}

#: the pins an edge fixes (explicit pins of a caller win over these)
_PINS: dict[tuple[str, str], dict] = {}
for _f in _FMTS:
    for _r in _ROUNDINGS[_f]:
        _PINS[("formats.encode", f"{_f}/{_r}")] = dict(fmt=_f, rounding=_r, saturate=False, x_dtype="float32")
    _PINS[("formats.encode", f"{_f}/saturate")] = dict(fmt=_f, rounding=None, saturate=True, x_dtype="float32")
    _PINS[("formats.decode", _f)] = dict(fmt=_f)
for _op in ("formats.pack_fp4", "formats.unpack_fp4"):
    for _o in ("low_first", "high_first"):
        _PINS[(_op, _o)] = dict(nibble_order=_o)
for _d in _DBQ_DST:
    _base = dict(dst_type=_d, x_ndim=2, row_block_size=1, col_block_size=128, specials=False, scale_order="divide")
    for _k in ("ties", "zero", "order"):
        _PINS[("dynamic_block_quant", f"{_k}:{_d}")] = dict(_base, min_scale=0.0)
    _PINS[("dynamic_block_quant", f"saturate:{_d}")] = dict(_base, min_scale=8.0)
    if _d == "hifloat8":
        for _k in ("ties", "zero", "order", "saturate"):
            _PINS[("dynamic_block_quant", f"{_k}:{_d}")]["dst_type_max"] = 224.0
_PINS[("dynamic_block_quant", "row_blocks:int8")] = dict(dst_type="int8", row_block_size=2, rows=4, min_scale=0.0,
                                                         specials=False)
_PINS[("dynamic_block_quant", "dst_type_max:56")] = dict(dst_type="hifloat8", dst_type_max=56.0, min_scale=0.0)
for _op in ("c8_cache_write", "c8_rmsnorm_rope_cache"):
    for _d in ("int8", "float8_e4m3fn"):
        _PINS[(_op, f"ties:{_d}")] = dict(key_dtype=_d, scale_order="divide")
_PINS[("c8_cache_write", "rope0")] = dict(rope=False)
_PINS[("c8_rmsnorm_rope_cache", "rope0")] = dict(rope_head_dim=0)
_PINS[("c8_rmsnorm_rope_cache", "epsilon")] = dict(epsilon=1e-5, small_norm=True)
for _m in (0, 1, 2):
    # round_scale off: with it the floored zero-group scale and a wrong one both ceil to 2^-22
    _PINS[("kv_compress_epilog", f"zero_groups:{_m}")] = dict(quant_mode=_m, round_scale=False)
    _PINS[("kv_compress_epilog", f"ties:{_m}")] = dict(quant_mode=_m, round_scale=True, x_scale=1.0)
_PINS[("kv_compress_epilog", "e8m0_floor")] = dict(quant_mode=1, round_scale=False)
_PINS[("kv_compress_epilog", "mode:0")] = dict(quant_mode=0, round_scale=False)
_PINS[("kv_compress_epilog", "mode:2")] = dict(quant_mode=2, round_scale=False, x_scale=0.37)
for _e in ("int8_ties", "int8_saturate"):
    _PINS[("kv_rmsnorm_rope_cache", _e)] = dict(version=1, k_fmt="int8", seq=3)
for _e, _v in (("minus1:first", 1), ("minus1:last", 1), ("epsilon", 1), ("v2", 2)):
    _PINS[("kv_rmsnorm_rope_cache", _e)] = dict(version=_v, seq=3, batch=2, offsets=True, k_fmt="hifloat8",
                                               ckv_fmt="float8_e4m3fn", cache_mode="Norm")
_PINS[("kv_rmsnorm_rope_cache", "epsilon")].update(epsilon=1e-6, small_norm=True)
_PINS[("kv_quant_sparse_flash_attention", "rope0")] = dict(rope_head_dim=0, key_dtype=("int8", "float8_e4m3fn"))
_PINS[("sparse_flash_attention", "sinks")] = dict(sinks=True, layout_kv=("BSND", "TND"), return_softmax_lse=True)
for _op in ("kv_quant_sparse_flash_attention", "sparse_flash_attention", "lightning_indexer",
            "quant_lightning_indexer"):
    _PINS[(_op, "pa_block_size:32")] = dict(layout_kv="PA_BSND", layout_key="PA_BSND", block_size=32)
    _PINS[(_op, "pa_block_size:48")] = dict(layout_kv="PA_BSND", layout_key="PA_BSND", block_size=48)
    _PINS[(_op, "batches:distinct_q")] = dict(batch=2, explicit_lengths=True, sparse_mode=3, distinct_act_q=True,
                                              fill=1.0)
    _PINS[(_op, "empty_rows")] = dict(batch=2, explicit_lengths=True, empty_batch=True)
    _PINS[(_op, "batches:distinct_kv")] = dict(batch=2, explicit_lengths=True, sparse_mode=0, distinct_kv=True,
                                               distinct_act_q=True)
    _PINS[(_op, "minus1_junk")] = dict(junk_after_minus1=True, stray_entries=1.0, fill=0.5)
    _PINS[(_op, "sparse_mode:0")] = dict(sparse_mode=0, fill=1.0)
    _PINS[(_op, "sparse_block_size:4")] = dict(sparse_block_size=4)
    _PINS[(_op, "lse")] = dict(return_softmax_lse=True)
    _PINS[(_op, "long_rows")] = dict(min_kv=257, fill=1.0, sparse_block_size=(1, 16), batch=1, dtype="float16",
                                     explicit_lengths=False, return_softmax_lse=True)
    # bf16 rows selecting 257 and 259 tokens (3 query rows, causal): counts above 256 that bf16 cannot hold, so a
    # softmax sum rounded to bf16 shows (uniform_scores: every probability 1, the sum is the count)
    _PINS[(_op, "long_rows:bf16_odd")] = dict(min_kv=259, fill=1.0, sparse_block_size=1, batch=1, dtype="bfloat16",
                                              explicit_lengths=False, return_softmax_lse=True)
    # the V4 operators page with blocks up to 1024 tokens; -1 mid-row with junk after it (reading stops there)
    for _n in (128, 1024):
        _PINS[(_op, f"pa_block_size:{_n}")] = dict(layout_kv="PA_BSND", layout_key="PA_BSND", block_size=_n,
                                                  junk_after_minus1=True, fill=0.5, sparse_block_size=1, batch=1)
    _PINS[(_op, "full_rows")] = dict(min_kv=40, sparse_count=7)
    _PINS[(_op, "ties")] = dict(constant_rows=True)
    _PINS[(_op, "scale_order")] = dict(scale_dtype="float32", format=("int8", "float8_e4m3fn"), min_kv=8)
    # every attention / indexer edge: several query rows per batch, and wide index rows (indexers: every token
    # ranked) - the simplest draw would otherwise select a single token of a single row
    _wide = dict(q_tokens=3, min_kv=24)
    _wide.update(wide=True) if "attention" in _op else _wide.update(sparse_count=256)
    for _e in EDGES[_op]:
        _PINS[(_op, _e)] = {**_wide, **_PINS.get((_op, _e), {})}
_PINS[("merge_attention_lse", "empty_shards")] = dict(parts=(2, 3))
_PINS[("merge_attention_lse", "large_max")] = dict(parts=(2, 3), stat_dtype="float32")

# DeepSeek-V4 shared-KV attention (qsfa.strategies.sharedkv)
_V4_EDGES = ("window_band", "first_rows", "no_cmp_token", "topk_all_minus1", "topk_at_bound", "sinks:-inf", "sinks:0",
             "sinks:huge", "block_size:1024", "one_token", "long_rows")
EDGES["sparse_flash_mla"] = _V4_EDGES + ("residual:0", "residual:max")
EDGES["sparse_attn_sharedkv"] = _V4_EDGES
EDGES["mixed_quant_sparse_flash_mla"] = _V4_EDGES + ("quant_mode:1", "quant_mode:2")
EDGES["kv_quant_sparse_attn_sharedkv"] = _V4_EDGES
EDGES["quant_sparse_flash_mla"] = _V4_EDGES + ("residual:0", "residual:max", "descales:apart")
for _op, _pa in (("sparse_flash_mla", "PA_BBND"), ("sparse_attn_sharedkv", "PA_ND"),
                 ("mixed_quant_sparse_flash_mla", "PA_BBND"), ("kv_quant_sparse_attn_sharedkv", "PA_ND"),
                 ("quant_sparse_flash_mla", "PA_BBND")):
    _PINS[(_op, "window_band")] = dict(ori_mask_mode=4, ori_win_left=3, ori_win_right=0, s1=3, s2=12,
                                       sinks="none")  # a 4-token band: its first and last tokens matter
    _PINS[(_op, "first_rows")] = dict(ori_mask_mode=4, layout_q="BSND", s1=4, s2=2)
    _PINS[(_op, "no_cmp_token")] = dict(scenario="HCA", cmp_ratio=16, s1=2, s2=5)
    _PINS[(_op, "topk_all_minus1")] = dict(scenario="CSA", topk="all_minus1")
    _PINS[(_op, "topk_at_bound")] = dict(scenario="CSA", topk="at_bound", k=(4, 8), s2=24)
    _PINS[(_op, "sinks:-inf")] = dict(sinks="-inf", return_softmax_lse=True)
    _PINS[(_op, "sinks:0")] = dict(sinks="zero", return_softmax_lse=True)
    _PINS[(_op, "sinks:huge")] = dict(sinks="huge")
    _PINS[(_op, "block_size:1024")] = dict(layout_kv=_pa, block_size=1024, s2=40)
    _PINS[(_op, "one_token")] = dict(scenario="SWA", batch=1, s1=1, s2=1)
    _PINS[(_op, "long_rows")] = dict(scenario="HCA", cmp_ratio=16, ori_mask_mode=4, ori_win_left=-1, batch=1, s1=1,
                                     s2=600, precision="faithful")
_PINS[("mixed_quant_sparse_flash_mla", "quant_mode:1")] = dict(quant_mode=1, scenario="CSA", s2=24)
_PINS[("mixed_quant_sparse_flash_mla", "quant_mode:2")] = dict(quant_mode=2, layout_kv="PA_BBND", scenario="HCA",
                                                               cmp_ratio=4, s2=40)
_PINS[("sparse_flash_mla", "residual:0")] = dict(scenario=("CSA", "HCA"), residual="zero", cmp_mask_mode=3, s2=30)
_PINS[("sparse_flash_mla", "residual:max")] = dict(scenario=("CSA", "HCA"), residual="max", cmp_mask_mode=3, s2=30)
_PINS[("quant_sparse_flash_mla", "residual:0")] = _PINS[("sparse_flash_mla", "residual:0")]
_PINS[("quant_sparse_flash_mla", "residual:max")] = _PINS[("sparse_flash_mla", "residual:max")]
# ori and cmp descales far apart (1/32 vs 8 vs 1/8): a descale applied to the wrong part or twice shows
_PINS[("quant_sparse_flash_mla", "descales:apart")] = dict(descales="apart", scenario=("CSA", "HCA"), s2=300,
                                                           ori_win_left=127, precision="faithful")


#: False turns the edges off (no edge draws, no edge phase): the catalogue as it was before them, for measuring
#: their effect (``python -m qsfa.conformance.campaign --without-edges``)
ENABLED = True


def take(draw, op: str, pins: dict):
    """The edge of an operator strategy and its pins merged under ``pins``: ``(pins, edge)``. ``pins["edge"]``
    names it (or a tuple to draw from); without it the draw is typical (None) and respects the bounds."""
    edges = EDGES.get(op, ())
    if "edge" in pins:
        e = pins["edge"]
        if isinstance(e, (tuple, list)):
            e = draw(st.sampled_from(tuple(e)))
    else:  # random draws stay typical and within the bounds; the edges run in the edge phase
        e = None
    if e is not None and e not in edges:
        raise ValueError(f"Invalid value for edge, actual: {e!r}, reason: {op} has the edges {edges}.")
    out = {k: v for k, v in pins.items() if k != "edge"}
    if e is not None:
        out = {**_PINS.get((op, e), {}), **out}
    return out, e


def edge_pins(op: str, edge) -> dict:
    """The pins edge ``edge`` of ``op`` fixes ({} for None or a tuple of edges)."""
    return dict(_PINS.get((op, edge), {})) if isinstance(edge, str) else {}


def pinned_int(draw, pins: dict, name: str, lo: int, hi: int) -> int:
    """``pins[name]`` when pinned (a value, or a tuple to draw from), else an integer drawn in [lo, hi]."""
    from .strategies._common import ints, sampled

    if name in pins:
        p = pins[name]
        return int(draw(sampled(tuple(p)))) if isinstance(p, (tuple, list)) else int(p)
    return draw(ints(lo, hi))


def block_size(draw, pins: dict, hi: int, edge: str | None) -> int:
    """A paged-cache block size in [1, hi]; the ``block_size:N`` edges force N (above 16 on purpose)."""
    if edge and edge.startswith("block_size:"):
        return int(edge.split(":")[1])
    return pinned_int(draw, pins, "block_size", 1, hi)


# ---------------------------------------------------------------------------------------------------
# formats


def _sample(rng, a: np.ndarray, k: int) -> np.ndarray:
    """``a`` if it has at most ``k`` entries, else its 4 smallest, 4 largest and ``k - 8`` random others."""
    a = np.sort(np.asarray(a))
    if a.size <= k:
        return a
    mid = rng.choice(a[4:-4], k - 8, replace=False)
    return np.concatenate([a[:4], mid, a[-4:]])


def encode_values(rng, fmt: str, saturate: bool) -> np.ndarray:
    """float64 values at the rounding boundaries of ``fmt``: midpoints (ties of every rounding mode), one
    float32 ulp either side of them, powers of two and one ulp either side (E8M0 floor / ceil), the largest
    finite value, the overflow midpoint above it and twice it (saturation), the smallest subnormal and half of
    it, zeros. Negated copies too, except for E8M0."""
    from .reference import formats as F

    mf = F.max_finite(fmt)
    mids, rep = _format_tables(fmt)
    mids = _sample(rng, mids, 48)
    m32 = mids.astype(np.float32)
    near = np.concatenate([np.nextafter(m32, np.float32(np.inf)), np.nextafter(m32, np.float32(0))])
    near = _sample(rng, near, 32).astype(np.float64)
    if fmt == "float8_e8m0":
        e = np.arange(-126, 128)
    else:
        e = np.arange(int(np.floor(np.log2(rep[0]))), int(np.floor(np.log2(rep[-1]))) + 1)
    p = np.exp2(_sample(rng, e, 24).astype(np.float64)).astype(np.float32)
    pw = np.concatenate([p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(0))]).astype(np.float64)
    tiny = float(rep[0])
    edge = [mf, tiny, tiny / 2, tiny * 1.5, 0.0]
    if saturate or fmt not in ("int8", "float4_e2m1"):
        over_mid = mf + (mf - rep[-2]) / 2  # the midpoint between max finite and the next (absent) step
        edge += [over_mid, float(np.nextafter(np.float32(over_mid), np.float32(0))), 2 * mf]
        if saturate:
            edge += [np.inf]
    groups = [mids, near, pw, np.array(edge, np.float64)]
    if fmt != "float8_e8m0":
        groups += [-g for g in groups]
    # round robin over the kinds: any prefix of a few values holds one of each (a shrunk case stays short)
    v = np.full((len(groups), max(g.size for g in groups)), np.nan)
    for i, g in enumerate(groups):
        v[i, :g.size] = g
    v = v.T.reshape(-1)
    return v[~np.isnan(v)]


@functools.lru_cache(maxsize=None)
def _format_tables(fmt: str):
    """(positive midpoints, positive finite representable values), sorted, of ``fmt``."""
    from .reference import formats as F

    mids = np.abs(F.midpoints(fmt))
    rep = np.abs(F.representable_values(fmt))
    rep = rep[np.isfinite(rep) & (rep > 0)]
    return np.unique(mids[mids > 0]), np.unique(rep)


def decode_codes(fmt: str, itemsize: int) -> np.ndarray:
    """Every code of ``fmt`` (uint8 / uint16)."""
    if fmt == "float4_e2m1":
        return np.arange(16, dtype=np.uint8)
    return np.arange(1 << (8 * itemsize), dtype=np.uint16 if itemsize == 2 else np.uint8)


def nibble_pairs() -> np.ndarray:
    """uint8 codes ``[512]``: every (first, second) pair of FP4 codes once."""
    a = np.arange(256)
    return np.stack([a & 15, a >> 4], axis=-1).reshape(-1).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------
# quantisers


_TYPE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "hifloat8": 32768.0,
             "float4_e2m1": 6.0}


def _tie_mids(fmt: str, type_max: float) -> np.ndarray:
    """Positive rounding midpoints of ``fmt`` below ``type_max`` (int8: j + 0.5)."""
    from .reference import formats as F

    if fmt == "int8":
        m = np.arange(int(type_max)) + 0.5
    else:
        m = np.abs(F.midpoints(fmt))
    m = np.unique(m[(m >= 2.0 ** -8) & (m < type_max)])  # above the float16 subnormals after scaling
    # values of 8 significant bits or fewer: exact in bfloat16 / float16 inputs
    _, e = np.frexp(m)
    return m[(m * np.exp2(9 - e.astype(np.float64))) % 2 == 0] if m.size else m


def tie_tiles(rng, rows: int, n: int, tile: int, fmt: str, type_max: float, *, k_range=(-4, 4)) -> np.ndarray:
    """float32 ``[rows, n]``: per tile of ``tile`` columns, element 0 is ``+-type_max * 2^k`` (the amax: the
    dynamic scale is exactly ``2^k``) and the others ``+-m * 2^k`` for rounding midpoints ``m`` of ``fmt``, so
    every quantised value is an exact tie. Every value is exact in bfloat16."""
    mids = _tie_mids(fmt, type_max)
    k_hi = min(k_range[1], int(np.floor(np.log2(6e4 / type_max))))  # amax * 2^k stays finite in float16
    k_range = (min(k_range[0], k_hi), k_hi)
    x = rng.choice(mids, (rows, n)) * np.where(rng.random((rows, n)) < 0.5, -1.0, 1.0)
    nt = -(-n // tile)
    k = rng.integers(k_range[0], k_range[1] + 1, (rows, nt))
    x = x * np.repeat(np.exp2(k), tile, axis=1)[:, :n]
    first = np.arange(0, n, tile)
    x[:, first] = type_max * np.exp2(k) * np.where(rng.random((rows, nt)) < 0.5, -1.0, 1.0)
    return x.astype(np.float32)


def _cast(y: np.ndarray, dst: str) -> np.ndarray:
    from .reference import formats as F

    if dst == "int8":
        return np.clip(np.rint(y), -127, 127)
    return F.encode(np.clip(y, -_TYPE_MAX[dst], _TYPE_MAX[dst]), dst, saturate=True,
                    rounding="round" if dst == "hifloat8" else "rint")


@functools.lru_cache(maxsize=None)
def _order_split_table(dst: str, type_max: float) -> tuple:
    """(amax [A], xs list of float32 arrays): bfloat16 values ``x <= amax`` whose code differs between
    ``x / fp32(amax / T)`` and ``x * fp32(T / amax)`` (the two OPEN scale orders; docs/numerics/quantisers.md)."""
    bf = np.arange(0x3F80, 0x4000, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)  # [1, 2)
    tm = np.float32(type_max)
    xs_all = np.concatenate([bf * np.float32(2.0 ** -j) for j in range(0, 8)])
    amaxs, lists = [], []
    for a in bf:
        scale = a / tm
        r = np.float32(tm / a)
        x = xs_all[xs_all <= a]
        with np.errstate(over="ignore"):
            c1 = _cast((x / scale).astype(np.float32), dst)
            c2 = _cast((x * r).astype(np.float32), dst)
        hit = x[c1 != c2]
        if hit.size:
            amaxs.append(a)
            lists.append(hit)
    return np.array(amaxs, np.float32), tuple(lists)


def order_split_tiles(rng, rows: int, n: int, tile: int, dst: str, type_max: float) -> np.ndarray | None:
    """float32 ``[rows, n]`` whose tiles quantise differently under the two scale orders (None if ``dst`` has
    no such values); scaled by powers of two per tile."""
    amaxs, lists = _order_split_table(dst, float(type_max))
    if not amaxs.size:
        return None
    nt = -(-n // tile)
    x = np.zeros((rows, n), np.float32)
    for r in range(rows):  # rows x tiles: a handful
        for t in range(nt):
            i = int(rng.integers(amaxs.size))
            w = min(tile, n - t * tile)
            vals = rng.choice(lists[i], w) * np.where(rng.random(w) < 0.5, -1, 1)
            vals[0] = amaxs[i]
            x[r, t * tile:t * tile + w] = vals * np.float32(2.0 ** int(rng.integers(-3, 4)))
    return x


def zero_tiles(x: np.ndarray, tile: int, *, every: int = 2) -> np.ndarray:
    """``x`` (last axis in tiles of ``tile``) with every ``every``-th tile all zero (the first one included)."""
    x = np.array(x, copy=True)
    n = x.shape[-1]
    for t in range(0, -(-n // tile), every):
        x[..., t * tile:(t + 1) * tile] = 0
    return x


# ---------------------------------------------------------------------------------------------------
# slots


def slots_edge(slots: np.ndarray, edge: str | None, num_slots: int, block_size_: int) -> np.ndarray:
    """Apply a slot edge to a drawn slot mapping: -1 at the first / a middle / the last position, no -1 at all
    (every token written), or (block-size edges) the first token aimed at the last row of block 0."""
    if edge is None:
        return slots
    s = np.array(slots, copy=True).reshape(-1)
    t = s.size
    if edge == "full" or edge.startswith("block_size:"):
        free = np.setdiff1d(np.arange(num_slots), s[s >= 0])
        neg = np.flatnonzero(s < 0)
        s[neg[:free.size]] = free[:neg.size]
        if edge.startswith("block_size:") and block_size_ - 1 < num_slots:
            j = np.flatnonzero(s == block_size_ - 1)
            if j.size:
                s[j[0]] = s[0]
            s[0] = block_size_ - 1
    elif edge.startswith("minus1:"):
        pos = {"first": 0, "middle": t // 2, "last": t - 1}[edge.split(":")[1]]
        s[pos] = -1
    return s.reshape(np.shape(slots)).astype(np.asarray(slots).dtype)


# ---------------------------------------------------------------------------------------------------
# attention and indexers


def scale_order_pairs(rng, n: int) -> np.ndarray:
    """float32 rows ``[n, 4]`` = (sq, sk1, sk2, d2 / d1 as a ratio code) such that the indexer scores
    ``RN(RN(sq * sk) * d)`` of two tokens order differently from ``RN(RN(d * sq) * sk)`` (docs/numerics/
    indexer.md: the scale product is one fp32 multiply): a tie or an order flip in one, not the other.
    Returned columns: sq, sk1, sk2, d1, d2 (d integers in 1..8)."""
    out = []
    tries = 0
    while len(out) < n and tries < 200:
        tries += 1
        m = 4096
        sq = rng.uniform(0.5, 2, m).astype(np.float32)
        sk1 = rng.uniform(0.5, 2, m).astype(np.float32)
        d1 = rng.integers(1, 9, m).astype(np.float32)
        d2 = rng.integers(1, 9, m).astype(np.float32)
        base = (sk1.astype(np.float64) * d1 / d2).astype(np.float32)
        for step in range(-3, 4):
            sk2 = base
            for _ in range(abs(step)):
                sk2 = np.nextafter(sk2, np.float32(np.inf) if step > 0 else np.float32(0))
            a1 = (sq * sk1).astype(np.float32) * d1
            a2 = (sq * sk2).astype(np.float32) * d2
            b1 = (d1 * sq).astype(np.float32) * sk1
            b2 = (d2 * sq).astype(np.float32) * sk2
            hit = (a1 >= a2) != (b1 >= b2)  # token 0 ranks first (ties: lower index) in one order only
            for i in np.flatnonzero(hit)[: n - len(out)]:
                out.append((sq[i], sk1[i], sk2[i], d1[i], d2[i]))
            if len(out) >= n:
                break
    return np.array(out, np.float32).reshape(-1, 5)


def merge_stats(rng, edge: str, shape, sdt) -> tuple[np.ndarray, np.ndarray]:
    """(softmax_max, softmax_sum) for a merge edge: ``empty_shards``: every maximum negative and shard 0 empty
    (max = sum = 0); ``large_max``: maxima in [90, 3000] (exp of a raw maximum overflows fp32 above 88.7)."""
    if edge == "empty_shards":
        m = rng.uniform(-30, -1, shape)
        s = rng.uniform(1, 300, shape)
        m[0] = 0
        s[0] = 0
    else:
        m = rng.uniform(90, 3000, shape)
        s = rng.uniform(1, 300, shape)
    return m.astype(sdt), s.astype(sdt)


def dbq_x(rng, edge: str, x: np.ndarray, dst: str, dst_type_max: float, col_block: int) -> np.ndarray:
    """``x`` (float32, last axis in column blocks) rebuilt for a dynamic_block_quant edge (``kind:dst``)."""
    kind = edge.split(":")[0]
    if kind not in ("order", "ties", "zero", "saturate"):
        return x
    tm = float(dst_type_max or _TYPE_MAX[dst])
    rows = int(np.prod(x.shape[:-1]))
    n = x.shape[-1]
    if kind == "order":
        y = order_split_tiles(rng, rows, n, col_block, dst, tm)
        kind = "ties" if y is None else kind
    if kind == "ties":
        y = tie_tiles(rng, rows, n, col_block, dst, tm)
    elif kind == "zero":
        y = zero_tiles(x.reshape(rows, n), col_block)
        y[:, (n // col_block) * col_block:] = 0  # the partial edge block too
    elif kind == "saturate":  # with min_scale 8 the scale is 1/8: x * 8 spans [-8 T, 8 T]
        y = rng.uniform(-1, 1, (rows, n)) * tm
        y[:, 0], y[:, -1] = -tm, tm
    return np.asarray(y, np.float32).reshape(x.shape)


def tokens(t: int, edge: str | None) -> int:
    """At least 3 tokens under a slot edge (so 'first', 'middle' and 'last' differ)."""
    return max(t, 3) if edge is not None and (edge.startswith("minus1:") or edge.startswith("block_size:")
                                              or edge == "full") else t


def c8_ties(rng, t: int, key_dtype: str) -> np.ndarray:
    """``k_nope [t, 512]`` float32 whose 128-wide tiles quantise to exact ties (see :func:`tie_tiles`)."""
    return tie_tiles(rng, t, 512, 128, key_dtype, _TYPE_MAX[key_dtype], k_range=(-3, 3))


def c8r_ties(rng, t: int, key_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``(nope, gamma)``: NoPE ``+-1`` and a tie pattern in ``gamma [512]``. RMSNorm of +-1 is +-(1 - 5e-7)
    in fp32 (epsilon 1e-6 / 1e-5), which rounds back to +-gamma in bf16 / fp16, so the C8 quantiser sees
    exact ties."""
    gamma = tie_tiles(rng, 1, 512, 128, key_dtype, _TYPE_MAX[key_dtype], k_range=(-3, 0))[0]
    nope = np.where(rng.random((t, 512)) < 0.5, -1.0, 1.0).astype(np.float32)
    return nope, gamma


@functools.lru_cache(maxsize=None)
def _fp4_split_table() -> tuple:
    """(amax [A], xs): bfloat16 values ``x <= amax`` whose FP4 code differs between the multiplier
    ``bf16(6 / amax)`` (KvCompressEpilog mode 2) and the unrounded fp32 ``6 / amax``."""
    from .reference import formats as F

    bf = np.arange(0x3F80, 0x4000, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)  # [1, 2)
    xs_all = np.concatenate([bf * np.float32(2.0 ** -j) for j in range(0, 5)])
    amaxs, lists = [], []
    for a in bf:
        inv32 = np.float32(6.0) / a
        inv16 = np.float32(ml_dtypes.bfloat16(inv32))
        x = xs_all[xs_all <= a]
        codes = [F.encode(np.clip(np.float32(ml_dtypes.bfloat16(1)) * (x * i).astype(ml_dtypes.bfloat16)
                                  .astype(np.float32), -6, 6), "float4_e2m1", saturate=True) for i in (inv16, inv32)]
        hit = x[codes[0] != codes[1]]
        if hit.size:
            amaxs.append(a)
            lists.append(hit)
    return np.array(amaxs, np.float32), tuple(lists)


def fp4_split_tiles(rng, rows: int, n: int, group: int) -> np.ndarray:
    """float32 ``[rows, n]`` whose FP4 groups quantise differently with a bf16-rounded and an fp32 multiplier."""
    amaxs, lists = _fp4_split_table()
    x = np.zeros((rows, n), np.float32)
    for r in range(rows):  # rows x groups: a handful
        for t in range(-(-n // group)):
            i = int(rng.integers(amaxs.size))
            w = min(group, n - t * group)
            vals = rng.choice(lists[i], w) * np.where(rng.random(w) < 0.5, -1, 1)
            vals[0] = amaxs[i]
            x[r, t * group:t * group + w] = vals * np.float32(2.0 ** int(rng.integers(-3, 4)))
    return x


def kce_nope(rng, edge: str, x: np.ndarray, mode: int, group_size: int) -> np.ndarray:
    """NoPE columns ``x [T, n]`` (float32) for a KvCompressEpilog edge: ``zero_groups:m`` zeroes every other
    quantisation group; ``ties:0|1`` (round_scale on) puts fp8 midpoints times the power-of-two group scale
    ``round_scale(max(amax, 1e-4) * fp32(1/448))`` of an amax of ``448 * 2^k``; ``ties:2`` puts FP4 midpoints
    times ``2^k`` with amax ``6 * 2^k`` (the bf16 multiplier 6 / amax is then exactly 2^-k)."""
    kind = edge.split(":")[0]
    g = 64 if mode in (0, 1) else group_size
    if kind == "zero_groups":
        return zero_tiles(x, g)
    t, n = x.shape
    if kind == "mode":
        return fp4_split_tiles(rng, t, n, g) if mode == 2 else x
    if mode == 2:
        return tie_tiles(rng, t, n, g, "float4_e2m1", 6.0, k_range=(-3, 3))
    from .reference.scales import fp8_group_scale, round_scale_pow2

    k = rng.integers(-3, 4, (t, -(-n // g)))
    amax = (448.0 * np.exp2(k)).astype(np.float32)
    s = round_scale_pow2(fp8_group_scale(amax)).astype(np.float64)
    mids = _tie_mids("float8_e4m3fn", 448.0)
    y = rng.choice(mids, (t, n)) * np.where(rng.random((t, n)) < 0.5, -1.0, 1.0) * np.repeat(s, g, axis=1)[:, :n]
    y = np.clip(y, -np.repeat(amax, g, axis=1)[:, :n], np.repeat(amax, g, axis=1)[:, :n])
    y[:, ::g] = amax * np.where(rng.random(amax.shape) < 0.5, -1.0, 1.0)
    return y.astype(np.float32)


def krr_edge(rng, args: dict, edge: str) -> dict:
    """A kv_rmsnorm_rope_cache argument set changed for an edge. ``int8_ties`` / ``int8_saturate`` (V1, int8
    k_cache): the RoPE input becomes half-integers in [-127.5, 127.5] / values in +-[126, 300], with cos = 1,
    sin = 0 and k_rope_scale = 1, so the static quantiser sees exact ties / values past both saturation
    points (-128 and 127). ``minus1:first|last``: index -1 at the first / last token (or chunk)."""
    a = dict(args)
    if edge == "epsilon":  # mean square ~1e-6: the epsilon is not negligible
        a["kv"] = (np.asarray(a["kv"], np.float32) * 1e-3).astype(a["kv"].dtype)
        return a
    if edge == "v2":
        return a
    if edge.startswith("minus1:"):
        idx = np.array(a["index"], copy=True)
        idx.reshape(-1)[0 if edge.endswith("first") else -1] = -1
        a["index"] = idx
        return a
    dv = np.asarray(a["gamma"]).shape[-1]
    kv = np.array(a["kv"], copy=True)
    shape = kv[..., dv:].shape
    if edge == "int8_ties":
        vals = rng.integers(-128, 128, shape) + 0.5
    else:
        vals = rng.uniform(126, 300, shape) * np.where(rng.random(shape) < 0.5, -1, 1)
        vals.reshape(-1)[:4] = (-128.5, -127.5, 127.5, 128.0)[: vals.size]
    kv[..., dv:] = vals.astype(kv.dtype)
    a["kv"] = kv
    a["cos"] = np.ones_like(a["cos"])
    a["sin"] = np.zeros_like(a["sin"])
    a["k_rope_scale"] = np.ones_like(a["k_rope_scale"])
    a["k_rope_offset"] = None
    return a


def query_lengths(act_q: np.ndarray, pins: dict, q_max: int) -> np.ndarray:
    """Per-batch query lengths under the ``distinct_act_q`` pin: batch 0 longest, the others shorter (so a
    kernel that reads batch 0's length for every batch gets other causal thresholds)."""
    if not pins.get("distinct_act_q") or act_q.size < 2:
        return act_q
    first = max(2, min(int(act_q[0]), q_max)) if q_max >= 2 else 1
    out = np.maximum(first - 1 - np.arange(act_q.size), 1)
    out[0] = first
    return out.astype(act_q.dtype)


def kv_lengths(act_kv: np.ndarray, pins: dict) -> np.ndarray:
    """Per-batch KV lengths under the ``min_kv`` (at least this many tokens; may exceed the profile's bound),
    ``distinct_kv`` (every batch a different length) and ``empty_batch`` (batch 0 has no token: its rows select
    nothing) pins."""
    a = np.array(act_kv, copy=True)
    if "min_kv" in pins:
        a = np.maximum(a, int(pins["min_kv"]))
    if "block_size" in pins and not np.ndim(pins["block_size"]):
        a = np.maximum(a, 2 * int(pins["block_size"]))  # tokens past row 16 of a block
    if pins.get("distinct_kv") and a.size > 1:  # batch b sees a shorter key than batch b - 1
        a = np.maximum(int(a.max()) - 3 * np.arange(a.size), 1)
    if pins.get("empty_batch") and a.size > 1:
        a[0] = 0
        a[1:] = np.maximum(a[1:], 1)
    return a


def sparse_width(draw, pins: dict, max_sparse: int, act_kv: np.ndarray, sbs: int) -> int:
    """The sparse index width: drawn up to ``max_sparse``, or wide enough for every token (``min_kv``, ``wide``)."""
    from .strategies._common import ints

    if "min_kv" in pins or pins.get("wide"):
        return -(-max(int(act_kv.max(initial=1)), 1) // sbs) + draw(ints(0, 2))
    return draw(ints(1, max(1, max_sparse)))


def code_of(value: float, fmt: str) -> int:
    from .reference import formats as F

    return int(F.encode(np.array([value], np.float32), fmt, saturate=True)[0])


def qli_scale_order(rng, args: dict, flat_of: np.ndarray, fmt: str) -> dict:
    """A quant_lightning_indexer argument set whose tokens 0 and 1 of every batch score equal-or-flipped
    depending on the order of the scale multiplications (:func:`scale_order_pairs`): one head weighted 1,
    query ``e_0``, key row ``d * e_0``, float32 dequant scales; every other token scores 0."""
    a = dict(args)
    (sq, sk1, sk2, d1, d2) = scale_order_pairs(rng, 1)[0]
    q = np.zeros_like(np.ascontiguousarray(a["query"]).view(np.uint8))
    q[..., 0] = code_of(1.0, fmt)
    k = np.zeros_like(np.ascontiguousarray(a["key"]).view(np.uint8))
    kf = k.reshape(-1, k.shape[-1])
    ks = np.ones(np.shape(a["key_dequant_scale"]), np.float32)
    ksf = ks.reshape(-1)
    for b in range(flat_of.shape[0]):
        for j, (d, s) in enumerate(((d1, sk1), (d2, sk2))):
            if j < flat_of.shape[1] and flat_of[b, j] >= 0:
                kf[flat_of[b, j], 0] = code_of(float(d), fmt)
                ksf[flat_of[b, j]] = s
    w = np.zeros(np.shape(a["weights"]), np.float32)
    w[..., 0] = 1
    a["query"] = q.view(a["query"].dtype)
    a["key"] = k.view(a["key"].dtype)
    a["weights"] = w.astype(a["weights"].dtype)
    a["query_dequant_scale"] = np.full(np.shape(a["query_dequant_scale"]), sq, np.float32)
    a["key_dequant_scale"] = ks
    return a
