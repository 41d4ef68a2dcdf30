"""Hypothesis strategies of the DeepSeek-V4 cache writers: ``indexer_quant_cache``, ``indexer_compress_epilog_v2``
and ``scatter_pa_kv_cache_with_k_scale`` (docs/numerics/cache-writers.md#indexer_quant_cache,
#indexer_compress_epilog_v2, #scatter_pa_kv_cache_with_k_scale).

Their edges are registered here, in :data:`qsfa._edges.EDGES` (edges first: the conformance runner tries each one
before the random draws):

* ``ties:fp8`` / ``ties:mxfp8`` / ``ties:e5m2`` - every group's amax is ``FMAX * 2^k``, so the scale is exactly
  ``2^k`` (``FMAX * fp32(1/FMAX)`` rounds to 1) and every other value ``+-m * 2^k`` is an FP8 rounding midpoint;
* ``ties:mxfp4`` - per group of 32 one ``+-4 * 2^k`` (byte 127 + k, multiplier 2^-k) and E2M1 midpoints
  ``+-m * 2^k`` (0.25, 0.75, ..., 5), plus ``7 * 2^k`` (saturates to 6);
* ``fp16_sticky`` - float16 x whose low byte is in (0, 8): the kernel's sticky bit decides the E2M1 rounding;
* ``zero_groups`` - all-zero MX groups, an all-zero token and signed zeros (0 / 0 and 0 * Inf keep x);
* ``hifloat8`` - the HiFloat8 mode with an x_scale other than 1;
* ``minus1:first`` / ``minus1:last`` / ``full`` - the slot edges of every cache writer;
* scatter_pa_kv_cache_with_k_scale: ``out_of_range_slots`` (slots -7 and num_slots + 3, skipped like -1),
  ``e5m2``, ``strided`` (caches with blocks apart, a non-contiguous key);
* qkv_rms_norm_rope_cache_with_k_scale (docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale):
  ``zero_head``, ``v_saturate``, ``layout_qkv:NTD``, ``history``, ``rotation:identity`` (see their pins); its M-RoPE
  scenario: ``mrope`` (positions drawn over 48 rows, section [24, 12, 8]), ``mrope:zero_k`` (every K head all zero: scale 0),
  ``mrope:int8_ties`` (K rows ``+-1 x gamma`` with amax ``127 x 2^k``: scale exactly ``2^k`` and INT8 midpoints
  ``n + 0.5``) and ``mrope:pow2_amax`` (the same rows with amax exactly ``2^k``); its M-RoPE MX scenario: ``mx``,
  ``mx:zero_k`` (every K input zero on one core, 8 tokens, Nk 2: the batch path's 0 x Inf next to the row path's
  +-0), ``mx:pow2_amax`` (K rows ``+-gamma`` with every 32-lane amax a power of two) and ``mx:tie`` (every amax
  ``448 x 2^k``: the scale keeps ``2^k`` and the group's top code is 448).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from .. import _edges as _E
from .._contract import Args
from ._common import _b, _choose, _rng, Bounds, poison_bytes, slot_mapping
from .cache import strided_like

__all__ = ["indexer_quant_cache_args", "indexer_compress_epilog_v2_args", "scatter_pa_kv_cache_with_k_scale_args",
           "qkv_rms_norm_rope_cache_with_k_scale_args"]

IQC, ICE2, SPKS = "indexer_quant_cache", "indexer_compress_epilog_v2", "scatter_pa_kv_cache_with_k_scale"
_SLOTS = ("minus1:first", "minus1:last", "full")

_E.EDGES.setdefault(IQC, ("ties:fp8", "ties:mxfp8", "ties:e5m2", "ties:mxfp4", "fp16_sticky", "zero_groups",
                         "hifloat8") + _SLOTS)
_E.EDGES.setdefault(ICE2, ("ties:fp8", "zero_groups") + _SLOTS)
_E.EDGES.setdefault(SPKS, ("out_of_range_slots", "e5m2", "strided") + _SLOTS)
_E._PINS.update({
    (IQC, "ties:fp8"): dict(quant_mode="fp8", cache_dtype="float8_e4m3fn", x_dtype="bfloat16"),
    (IQC, "ties:mxfp8"): dict(quant_mode="mxfp8", cache_dtype="float8_e4m3fn", x_dtype="bfloat16"),
    (IQC, "ties:e5m2"): dict(quant_mode=("fp8", "mxfp8"), cache_dtype="float8_e5m2", x_dtype="bfloat16"),
    (IQC, "ties:mxfp4"): dict(quant_mode="mxfp4", x_dtype="bfloat16"),
    (IQC, "fp16_sticky"): dict(quant_mode="mxfp4", x_dtype="float16"),
    (IQC, "zero_groups"): dict(quant_mode=("mxfp8", "fp8", "mxfp4")),
    (IQC, "hifloat8"): dict(quant_mode="hifloat8", x_scale=0.37),
    (SPKS, "e5m2"): dict(fmt="float8_e5m2", heads=2),
    (SPKS, "out_of_range_slots"): dict(min_tokens=3, slot_dtype="int64"),
    (SPKS, "strided"): dict(strided=True),
    (ICE2, "ties:fp8"): dict(x_dtype="bfloat16", d=256),
    (ICE2, "zero_groups"): dict(d=160),
})

_FMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _mxfp4_ties(rng, t, d):
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0])
    g = d // 32
    k = rng.integers(-6, 4, (t, g))
    x = rng.choice(mids, (t, d)) * np.where(rng.random((t, d)) < 0.5, -1.0, 1.0)
    x[:, ::32] = 4.0 * np.where(rng.random((t, g)) < 0.5, -1.0, 1.0)
    return (x * np.repeat(np.exp2(k), 32, axis=1)).astype(np.float32)


def _x(draw, rng, t, d, edge, mode, cfmt, xdt):
    x = rng.standard_normal((t, d)) * np.exp2(rng.integers(-8, 8, (t, 1)))
    if edge in ("ties:fp8", "ties:mxfp8", "ties:e5m2"):
        tile = 32 if mode == "mxfp8" else (128 if mode == "epilog" else d)
        x = _E.tie_tiles(rng, t, d, tile, cfmt, _FMAX[cfmt])
    elif edge == "ties:mxfp4":
        x = _mxfp4_ties(rng, t, d)
    elif edge == "zero_groups":
        x = _E.zero_tiles(x, 32, every=2)
        x[-1] = 0
        x[-1, ::3] = -0.0
    x = x.astype(ml_dtypes.bfloat16 if xdt == "bfloat16" else np.float16)
    if edge == "fp16_sticky":
        b = x.view(np.uint16)
        b[:] = (b & np.uint16(0xFF00)) | rng.integers(1, 8, b.shape).astype(np.uint16)
    return x


def _slots(draw, rng, pins, edge, t, num):
    s = slot_mapping(rng, t, num, skip_fraction=draw(st.sampled_from([0.0, 0.3])), dtype="int32")
    return _E.slots_edge(s, edge if edge in _SLOTS else None, num, 1).astype(np.int32)


def _cache(draw, rng, shape, dtype):
    c = poison_bytes(rng, shape, dtype)
    if draw(st.booleans()):  # the block dimension strided: blocks further apart than their size
        c = strided_like(c, (c.strides[0] + 32 * draw(st.integers(1, 3)),) + c.strides[1:])
    return c


@st.composite
def indexer_quant_cache_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``indexer_quant_cache``: every quant_mode, E4M3FN / E5M2 caches, bf16 / fp16 x ``[T, d]`` (d 32..256 in
    steps of 32), 4-D caches of random bytes (head_dim and scale width up to 8 wider, the block dimension strided half
    the time), int32 slots with -1; the edges of the module docstring."""
    from ..ops.indexer_cache import IQC_CONTRACT
    from ..reference import indexer_cache as ic

    pins, edge = _E.take(draw, IQC, pins)
    b = _b(bounds)
    mode = _choose(draw, pins, "quant_mode", ic.QUANT_MODES)
    cfmt = _choose(draw, pins, "cache_dtype", ("float8_e4m3fn", "float8_e5m2"))
    xdt = _choose(draw, pins, "x_dtype", ("bfloat16", "float16"))
    d = 32 * _choose(draw, pins, "groups", (1, 2, 3, 4, 8))
    t = draw(st.integers(2, max(2, b.max_tokens)))
    rng = _rng(draw)
    x = _x(draw, rng, t, d, edge, mode, cfmt, xdt)
    bs = draw(st.integers(1, min(b.max_block_size, 8)))
    nb = -(-t // bs) + draw(st.integers(0, 2))
    cdt = getattr(ml_dtypes, cfmt) if mode in ("fp8", "mxfp8") else np.uint8
    sdt = np.uint8 if mode in ("mxfp8", "mxfp4") else np.float32
    cache = _cache(draw, rng, (nb, bs, 1, ic.cache_width(d, mode) + draw(st.sampled_from([0, 0, 8]))), cdt)
    cs = _cache(draw, rng, (nb, bs, 1, ic.scale_cols(d, mode) + draw(st.sampled_from([0, 3]))), sdt)
    if sdt == np.float32:
        cs[...] = np.float32(-3.5)  # random bytes would hold NaNs, which == cannot compare
    args = dict(x=x, cache=cache, cache_scale=cs, slot_mapping=_slots(draw, rng, pins, edge, t, nb * bs),
                quant_mode=mode, round_scale=_choose(draw, pins, "round_scale", (True, False)),
                x_scale=_choose(draw, pins, "x_scale", (1.0, 0.37, 3.0)))
    assume(IQC_CONTRACT.first_violation(Args(args)) is None)
    return args


@st.composite
def indexer_compress_epilog_v2_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``indexer_compress_epilog_v2``: bf16 / fp16 x ``[T, d]`` (d 64..384, partial last groups included), uint8 block
    caches of random bytes (head_dim up to 16 wider, the block dimension strided half the time), int32 slots with -1;
    the edges of the module docstring."""
    from ..ops.indexer_cache import ICE2_CONTRACT

    pins, edge = _E.take(draw, ICE2, pins)
    b = _b(bounds)
    xdt = _choose(draw, pins, "x_dtype", ("bfloat16", "float16"))
    d = _choose(draw, pins, "d", (64, 128, 160, 256, 384))
    t = draw(st.integers(2, max(2, b.max_tokens)))
    rng = _rng(draw)
    x = _x(draw, rng, t, d, edge, "epilog", "float8_e4m3fn", xdt)
    bs = draw(st.integers(1, min(b.max_block_size, 8)))
    nb = -(-t // bs) + draw(st.integers(0, 2))
    cache = _cache(draw, rng, (nb, bs, 1, d + 4 * -(-d // 128) + draw(st.sampled_from([0, 0, 16]))), np.uint8)
    args = dict(x=x, indexer_compress_cache=cache, slot_mapping=_slots(draw, rng, pins, edge, t, nb * bs), layout=2)
    assume(ICE2_CONTRACT.first_violation(Args(args)) is None)
    return args


@st.composite
def scatter_pa_kv_cache_with_k_scale_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``scatter_pa_kv_cache_with_k_scale``: random FP8 bytes ``key [T, N, Dk]`` / ``value [T, N, Dv]``, fp32
    ``key_scale``, BNBD caches of random bytes (fp32 scale cache of finite values), int32 / int64 slots with -1;
    the edges of the module docstring."""
    from ..ops.k_scale_cache import SPKS_CONTRACT

    pins, edge = _E.take(draw, SPKS, pins)
    b = _b(bounds)
    fmt = getattr(ml_dtypes, _choose(draw, pins, "fmt", ("float8_e4m3fn", "float8_e5m2")))
    lo = int(pins.get("min_tokens", 1))
    t = draw(st.integers(lo, max(lo, b.max_tokens)))
    n = _choose(draw, pins, "heads", (1, 2, 3))
    dk, dv = (_choose(draw, pins, p, (8, 16, 64, 128)) for p in ("dk", "dv"))
    bs = draw(st.integers(1, min(b.max_block_size, 8)))
    nb = -(-t // bs) + draw(st.integers(0, 2))
    rng = _rng(draw)
    strided = bool(pins.get("strided", False))
    key = poison_bytes(rng, (t, n, 2 * dk if strided else dk), fmt)
    if strided:
        key = key[:, :, ::2]
    kc = _cache(draw, rng, (nb, n, bs, dk), fmt) if not strided else \
        strided_like(poison_bytes(rng, (nb, n, bs, dk), fmt), (n * bs * dk + 64, bs * dk, dk, 1))
    vc = _cache(draw, rng, (nb, n, bs, dv), fmt)
    ksc = _cache(draw, rng, (nb, n, bs, 1), np.float32)
    ksc[...] = rng.standard_normal(ksc.shape).astype(np.float32)
    s = slot_mapping(rng, t, nb * bs, skip_fraction=draw(st.sampled_from([0.0, 0.3])),
                     dtype=_choose(draw, pins, "slot_dtype", ("int32", "int64")))
    s = _E.slots_edge(s, edge if edge in _SLOTS else None, nb * bs, 1)
    if edge == "out_of_range_slots":
        s[0] = -7
        s[-1] = nb * bs + 3
    args = dict(key=key, value=poison_bytes(rng, (t, n, dv), fmt), key_cache=kc, value_cache=vc, slot_mapping=s,
                key_scale=rng.standard_normal((t, n)).astype(np.float32), key_scale_cache=ksc, cache_layout="BNBD")
    assume(SPKS_CONTRACT.first_violation(Args(args)) is None)
    return args


QKVS = "qkv_rms_norm_rope_cache_with_k_scale"
# edges: every Q head all zero (scale 0: docs/numerics/open-facts.md#qkv-zero-head), V past the FP8 range (SAT),
# the NTD input layout, a long history (positions far from 0), the identity rotation (the bf16 operand unchanged)
_E.EDGES.setdefault(QKVS, ("zero_head", "v_saturate", "layout_qkv:NTD", "history", "rotation:identity", "mrope",
                           "mrope:zero_k", "mrope:int8_ties", "mrope:pow2_amax", "mx", "mx:zero_k", "mx:pow2_amax",
                           "mx:tie"))
_E._PINS.update({
    (QKVS, "zero_head"): dict(zero_q=True),
    (QKVS, "v_saturate"): dict(v_scale_big=True),
    (QKVS, "layout_qkv:NTD"): dict(layout_qkv="NTD"),
    (QKVS, "history"): dict(history=64),
    (QKVS, "rotation:identity"): dict(identity=True),
    (QKVS, "mrope"): dict(mrope=True, section=(24, 12, 8), max_seq=48),
    (QKVS, "mrope:zero_k"): dict(mrope=True, zero_k=True),
    (QKVS, "mrope:int8_ties"): dict(mrope=True, exact_k="ties"),
    (QKVS, "mrope:pow2_amax"): dict(mrope=True, exact_k="pow2"),
    (QKVS, "mx"): dict(mrope=True, mx=True),
    (QKVS, "mx:zero_k"): dict(mrope=True, mx=True, zero_k_input=True, aiv=1, nq=16, t=8),
    (QKVS, "mx:pow2_amax"): dict(mrope=True, mx=True, exact_mx="pow2"),
    (QKVS, "mx:tie"): dict(mrope=True, mx=True, exact_mx="tie"),
})


def _exact_mx_rows(a, kind, k, seed):
    """Make every K head's M-RoPE row exactly ``+-k_gamma``: qkv rows of +-1 (RMS exactly 1), cos 1 / sin 0 in every
    cos_sin row, and a k_gamma whose every 32-lane amax is ``2^k`` ("pow2") or ``448 x 2^k`` ("tie")."""
    rng = np.random.default_rng(seed)
    qkv = np.where(rng.random(a["qkv"].shape) < 0.5, -1.0, 1.0).astype(a["qkv"].dtype)
    cs = np.zeros_like(a["cos_sin"])
    cs[:, :64] = 1.0
    top = 1.0 if kind == "pow2" else 448.0
    g = rng.uniform(-top, top, 128)
    g[np.arange(4) * 32 + rng.integers(0, 32, 4)] = top
    a.update(qkv=qkv, cos_sin=cs, epsilon=float(np.float32(1e-45)), k_gamma=(g * 2.0 ** k).astype(np.float32))


def _exact_k_rows(a, kind, k, seed):
    """Make every K head's rotated row exactly ``+-k_gamma`` (module docstring): qkv rows of +-1 (RMS exactly 1
    with an epsilon that vanishes in the sum), cos 1 / sin 0 in every cos_sin row, the identity rotation, and a
    bf16-exact k_gamma whose amax is ``127 x 2^k`` ("ties", the other lanes INT8 midpoints ``(n + 0.5) 2^k``) or
    ``2^k`` ("pow2")."""
    rng = np.random.default_rng(seed)
    qkv = np.where(rng.random(a["qkv"].shape) < 0.5, -1.0, 1.0).astype(a["qkv"].dtype)
    cs = np.zeros_like(a["cos_sin"])
    cs[:, :64] = 1.0
    g = (rng.integers(-127, 127, 128) + 0.5) if kind == "ties" else rng.integers(-127, 128, 128) / 128.0
    g[rng.integers(0, 128)] = 127.0 if kind == "ties" else 1.0
    a.update(qkv=qkv, cos_sin=cs, rotation=np.eye(128, dtype=a["rotation"].dtype), epsilon=float(np.float32(1e-45)),
             k_gamma=(g * 2.0 ** k).astype(np.float32))


@st.composite
def qkv_rms_norm_rope_cache_with_k_scale_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``qkv_rms_norm_rope_cache_with_k_scale`` (RoPE scenario): bf16 QKV with Nq in {8, 16, 32, 64} (Nk = Nv =
    Nq / 8), TND or NTD, requests cut at random with a history before them, a random orthogonal bf16 rotation,
    unique slots scattered over one or two spare blocks; one draw in four the M-RoPE scenario (TND, drawn T / H / W
    positions and section, INT8 K cache; half of those the MX scenario with a drawn core count); the edges above."""
    from ..ops.qkv_k_scale import mrope_case, mx_case, qkv_case

    pins, edge = _E.take(draw, QKVS, pins)
    b = _b(bounds)
    if pins.get("mrope", draw(st.integers(0, 3)) == 3):  # the M-RoPE scenario (one draw in four): TND in and out
        nq = int(_choose(draw, pins, "nq", tuple(h for h in (8, 16, 32, 64) if h <= max(8, b.max_heads))))
        t = draw(st.integers(1, max(1, b.max_q_tokens)))
        block_size = int(_choose(draw, pins, "block_size", (16, 32)))
        h, w = draw(st.integers(0, 21)), draw(st.integers(0, 21))
        section = tuple(pins.get("section", (draw(st.integers(0, 64 - h - w)), h, w)))
        mx = pins.get("mx", False if pins.get("exact_k") or pins.get("zero_k") else draw(st.booleans()))
        t = int(pins.get("t", t))
        make = mx_case if mx else mrope_case
        a = make(t=t, nq=nq, nk=nq // 8, block_num=-(-t // block_size) + draw(st.integers(0, 1)),
                 block_size=block_size, max_seq=max(t, int(pins.get("max_seq", t + draw(st.integers(0, 47))))),
                 section=section, seed=draw(st.integers(0, 2**32 - 1)))
        if pins.get("zero_k"):
            a["k_gamma"] = np.zeros_like(a["k_gamma"])
        if pins.get("exact_k"):
            _exact_k_rows(a, pins["exact_k"], draw(st.integers(-20, 20)), draw(st.integers(0, 2**32 - 1)))
        if mx:
            a["mx_aiv_num"] = int(pins.get("aiv", draw(st.sampled_from((1, 2, 64)))))
            if pins.get("zero_k_input"):
                a["qkv"][:, nq:nq + nq // 8] = 0
            if pins.get("exact_mx"):
                _exact_mx_rows(a, pins["exact_mx"], draw(st.integers(-20, 20)), draw(st.integers(0, 2**32 - 1)))
        return a
    nq = int(_choose(draw, pins, "nq", tuple(h for h in (8, 16, 32, 64) if h <= max(8, b.max_heads))))
    layout_qkv = _choose(draw, pins, "layout_qkv", ("TND", "NTD"))
    layout_q_out = _choose(draw, pins, "layout_q_out", ("NTD", "TND") if layout_qkv == "TND" else ("NTD",))
    if layout_qkv == "NTD":
        layout_q_out = "NTD"
    t = draw(st.integers(1, max(1, b.max_q_tokens)))
    batch = draw(st.integers(1, t))
    block_size = int(_choose(draw, pins, "block_size", (16, 32)))
    block_num = -(-t // block_size) + draw(st.integers(0, 1))
    hist = int(pins.get("history", draw(st.integers(0, 16))))
    a = qkv_case(t=t, nq=nq, nk=nq // 8, batch=batch, layout_qkv=layout_qkv, layout_q_out=layout_q_out,
                 block_num=block_num, block_size=block_size, max_seq=t + hist, seed=draw(st.integers(0, 2**32 - 1)))
    if pins.get("zero_q"):
        a["q_gamma"] = np.zeros_like(a["q_gamma"])
    if pins.get("v_scale_big"):
        a["v_scale"] = np.full_like(a["v_scale"], 1000.0)
    if pins.get("identity"):
        a["rotation"] = np.eye(128, dtype=a["rotation"].dtype)
    return a
