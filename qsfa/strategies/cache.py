"""Hypothesis strategies of the cache writers (docs/numerics/cache-writers.md): ``scatter_by_slot``,
``c8_cache_write``, ``c8_rmsnorm_rope_cache``, ``kv_compress_epilog``, ``kv_compress_epilog_vllm`` and
``kv_rmsnorm_rope_cache``."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from .. import _edges as _E
from .._contract import Args
from .._values import _group_values, as_dtype
from ._common import _b, _BF16, _choose, _QDT, _rng, Bounds, bounds, poison_bytes, slot_mapping

__all__ = [
    "scatter_by_slot_args",
    "c8_cache_write_args",
    "c8_rmsnorm_rope_cache_args",
    "kv_compress_epilog_args",
    "kv_rmsnorm_rope_cache_args",
    "clone",
    "strided_like",
    "kv_compress_epilog_vllm_args",
]


#: the C8 writers' scale orders a strategy draws: None (the chip's ``npu_dynamic_block_quant`` order, "reciprocal"
#: on A2/A3 and "divide" on the 950: docs/numerics/chips.md#c8-cache-writers) first, so that a failing example
#: shrinks to the default, then every explicit order of qsfa.reference.quant.SCALE_ORDERS
C8_SCALE_ORDER_CHOICES = (None, "divide", "reciprocal", "reciprocal_multiply", "multiply")


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


def _c8_cache(draw, rng, pins, b: Bounds, t: int, rope: bool, edge=None, key_dtype="int8"):
    """A random-byte packed cache: uint8 / int8, or float8_e4m3fn for FP8 codes (a float8 array holds FP8 codes
    only: the writers' key_dtype_matches_kv_cache rule), and its slots."""
    bn = draw(st.integers(1, 4))
    bs = _E.block_size(draw, pins, max(1, min(b.max_block_size, 16)), edge)
    cdt = _choose(draw, pins, "cache_dtype",
                  ("uint8", "int8", "float8_e4m3fn") if key_dtype == "float8_e4m3fn" else ("uint8", "int8"))
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
    with ``-1``, ``key_dtype`` int8 / float8_e4m3fn and every ``scale_order`` (None: the chip's order)."""
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
    k_rope = as_dtype(rng.standard_normal((t, 64)), _QDT[qdt]) if rope else None
    cache, slots = _c8_cache(draw, rng, pins, b, t, rope, edge, key_dtype)
    return dict(k_nope=k_nope, k_rope=k_rope, slot_mapping=slots, kv_cache=cache, key_dtype=key_dtype,
                scale_order=_choose(draw, pins, "scale_order", C8_SCALE_ORDER_CHOICES))


@st.composite
def c8_rmsnorm_rope_cache_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``c8_rmsnorm_rope_cache``: ``kv [T, 512 + rope]``, ``gamma [512]``, half-split cos/sin ``[T, 64]``
    (None at rope 0), epsilon, a random-byte packed cache, slots with ``-1`` and every ``scale_order`` (None: the
    chip's order)."""
    b = _b(bounds)
    pins, edge = _E.take(draw, "c8_rmsnorm_rope_cache", pins)
    qdt = _QDT[_choose(draw, pins, "dtype", ("bfloat16", "float16"))]
    rope = _choose(draw, pins, "rope_head_dim", (64, 0))
    t = _E.tokens(draw(st.integers(1, b.max_tokens)), edge)
    rng = _rng(draw)
    kv = as_dtype(rng.standard_normal((t, 512 + rope)) * 10.0 ** rng.uniform(-2, 1, (t, 1)), qdt)
    gamma = as_dtype(1 + 0.25 * rng.standard_normal(512), qdt)
    key_dtype = _choose(draw, pins, "key_dtype", ("int8", "float8_e4m3fn"))
    if edge is not None and edge.startswith("ties:"):
        nope, g = _E.c8r_ties(rng, t, key_dtype)
        kv[:, :512], gamma = as_dtype(nope, qdt), as_dtype(g, qdt)
    elif pins.get("small_norm"):  # mean square ~1e-6: the epsilon is not negligible
        kv = (kv.astype(np.float32) * 1e-3).astype(qdt)
    cos = sin = None
    if rope:
        ang = rng.uniform(0, 2 * np.pi, (t, 32))
        cos = as_dtype(np.concatenate([np.cos(ang)] * 2, axis=-1), qdt)
        sin = as_dtype(np.concatenate([np.sin(ang)] * 2, axis=-1), qdt)
    cache, slots = _c8_cache(draw, rng, pins, b, t, bool(rope), edge, key_dtype)
    return dict(kv=kv, gamma=gamma, cos=cos, sin=sin, slot_mapping=slots, kv_cache=cache,
                epsilon=_choose(draw, pins, "epsilon", (1e-6, 1e-5)), rope_head_dim=rope, key_dtype=key_dtype,
                scale_order=_choose(draw, pins, "scale_order", C8_SCALE_ORDER_CHOICES))


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
    from ..reference.kv_compress_epilog import kv_cache_col

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
    tokens; built by :func:`qsfa.ops.kv_rmsnorm_rope_cache.kv_rmsnorm_rope_cache_example` from drawn knobs and kept only if
    the contract accepts them."""
    from ..ops.kv_rmsnorm_rope_cache import KRR_CONTRACT, kv_rmsnorm_rope_cache_example

    b = _b(bounds)
    pins, edge = _E.take(draw, "kv_rmsnorm_rope_cache", pins)
    version = _choose(draw, pins, "version", (1, 2))
    mode = _choose(draw, pins, "cache_mode", _KRR_MODES)
    dtype = _choose(draw, pins, "dtype", ("bfloat16", "float16"))
    fmts = tuple(pins.get("eight_bit", ("int8", "float8_e4m3fn", "float8_e5m2", "hifloat8"))) + (dtype,)
    k_fmt = _choose(draw, pins, "k_fmt", fmts)
    ckv_fmt = _choose(draw, pins, "ckv_fmt", fmts)
    if "eight_bit" in pins:  # the chip's 8-bit formats win over an edge's (qsfa.strategies.chips)
        k_fmt, ckv_fmt = (f if f in fmts else fmts[0] for f in (k_fmt, ckv_fmt))
    heads = 1 if version == 1 else _choose(draw, pins, "heads", (1, 2, 4, 8) if b.max_heads >= 8 else (1, 2))
    dk = draw(st.sampled_from((32, 64)))
    dv = draw(st.sampled_from((32, 64, 128)))
    rope = dk if version == 1 else draw(st.sampled_from(tuple(r for r in (16, 32, 64) if r <= dk)))
    any8 = k_fmt in fmts[:-1] or ckv_fmt in fmts[:-1]
    bs_opts = tuple(x for x in (16, 32, 64) if x <= max(b.max_block_size, 32) and (x % 32 == 0 or not any8))
    block_size = draw(st.sampled_from(bs_opts)) if mode != "Norm" else None
    seq = _E.pinned_int(draw, pins, "seq", 1, max(1, b.max_q_tokens))
    batch = _E.pinned_int(draw, pins, "batch", 1, b.max_batch)
    offsets = _choose(draw, pins, "offsets", (False, True)) and any8
    param_shape = _choose(draw, pins, "param_shape", ("ND", "D", "1D", "1"))
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


@st.composite
def kv_compress_epilog_vllm_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``kv_compress_epilog_vllm``: bf16 ``x [T, d]`` (d 128..576, partial last groups included; now and then a
    group whose amax is 448 * 2^k, the doubled power-of-two scale), both layouts, group sizes 64 / 128, E4M3FN
    and E5M2 caches of random bytes (layout 1 ``[N, 1, head_dim >= row]``, layout 2 ``[nb, bs, 1, X]``), strided
    along dimension 0 half the time, slots with -1."""
    import ml_dtypes

    from ..reference import kv_compress_epilog_vllm as kv

    b = _b(bounds)
    layout = _choose(draw, pins, "layout", (1, 2))
    gs = _choose(draw, pins, "quant_group_size", (64, 128))
    d = _choose(draw, pins, "d", (128, 192, 208, 512, 576))
    fmt = _choose(draw, pins, "cache_dtype", ("float8_e4m3fn", "float8_e5m2"))
    t = draw(st.integers(1, b.max_tokens))
    rng = _rng(draw)
    x = _group_values(rng, (t, d))
    if draw(st.booleans()):  # a group with amax 448 * 2^k: scale exactly a power of two before rounding
        x[0, 0] = np.float32(448.0 * 2.0 ** int(rng.integers(-6, 3)))
    x = x.astype(_BF16)
    if layout == 1:
        n_slots = t + draw(st.integers(0, 4))
        shape = (n_slots, 1, kv.kv_cache_col(d, gs) + draw(st.sampled_from([0, 0, 7, 128])))
        num = n_slots
    else:
        bs = draw(st.integers(1, min(b.max_block_size, 8)))
        nb = draw(st.integers(1, 3))
        shape = (nb, bs, 1, kv.value_per_token(d) + kv.scale_per_token(d, gs) + draw(st.sampled_from([0, 0, 8])))
        num = nb * bs
    cache = poison_bytes(rng, shape, np.uint8)
    if draw(st.booleans()):  # dimension 0 strided: rows / blocks further apart than their size
        item = cache.strides
        cache = strided_like(cache, (item[0] + 64 * draw(st.integers(1, 3)),) + item[1:])
    cache = cache.view(getattr(ml_dtypes, fmt))
    slots = slot_mapping(rng, t, num, skip_fraction=draw(st.sampled_from([0.0, 0.3])),
                         dtype=_choose(draw, pins, "slot_dtype", ("int64", "int32")))
    return dict(kv_compress_cache=cache, x=x, slot_mapping=slots, quant_group_size=gs, quant_mode=2,
                round_scale_flag=_choose(draw, pins, "round_scale_flag", (True, False)), layout=layout)


def _with_hifloat8_keys(base, op):
    """``base`` (a C8 writer strategy) with ``key_dtype`` drawn from int8 / float8_e4m3fn / hifloat8 and, for
    HiFloat8, the OPEN ``dst_type_max`` from 0 (= 32768) and the values torch_npu documents."""

    @st.composite
    def strat(draw, bounds: Bounds | None = None, **pins) -> dict:
        key = _choose(draw, {**_E.edge_pins(op, pins.get("edge")), **pins}, "key_dtype",  # a pinned edge's key first
                      ("int8", "float8_e4m3fn", "hifloat8"))
        args = draw(base(bounds, **{k: v for k, v in pins.items() if k not in ("dst_type_max", "key_dtype")}, key_dtype=key))
        args["dst_type_max"] = (_choose(draw, pins, "dst_type_max", (0.0, 15.0, 56.0, 224.0, 32768.0))
                                if key == "hifloat8" else 0.0)
        return args

    strat.__doc__ = f"{base.__doc__ or ''} (HiFloat8 keys and dst_type_max added by qsfa.strategies.cache)"
    return strat
