"""Hypothesis strategy of the DeepSeek-V4 ``compressor`` (docs/numerics/compressor.md).

Edges (registered in :data:`qsfa._edges.EDGES`, tried before the random draws):

* ``group_full`` - every batch starts on a group boundary and brings exactly cmp_ratio tokens (one full group,
  nothing left in the state);
* ``residual_max`` - every batch ends cmp_ratio - 1 tokens past a group boundary (the longest residual the next
  call completes);
* ``one_token`` - decode: one token per batch, some of them completing a group whose other slots are in the state;
* ``uneven_batch`` - TH x with ``cu_seqlens [0, 12, 23]`` from position 0 (vLLM-Ascend #9496's batched prefill);
* ``ring`` - cache_mode 2 (one ring-buffer block per batch, Ascend 950);
* ``c128`` - C128A (cmp_ratio 128, coff 1, D 512), the group's earlier tokens in the state.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from .. import _edges as _E
from .._contract import Args
from ._common import _b, _choose, _rng, Bounds

__all__ = ["compressor_args", "quant_compressor_args", "vllm_compressor_args"]

CMP, QCMP = "compressor", "quant_compressor"
_E.EDGES.setdefault(CMP, ("group_full", "residual_max", "one_token", "uneven_batch", "ring", "c128"))
_C4 = ((4, 2, 128), (4, 2, 512))
_E._PINS.update({
    (CMP, "group_full"): dict(layout="TH", scenario=_C4),
    (CMP, "residual_max"): dict(layout="TH", scenario=_C4),
    (CMP, "one_token"): dict(layout="TH", scenario=_C4),
    (CMP, "uneven_batch"): dict(layout="TH", scenario=_C4),
    (CMP, "ring"): dict(cache_mode=2),
    (CMP, "c128"): dict(scenario=((128, 1, 512),)),
})

_E.EDGES.setdefault(QCMP, _E.EDGES[CMP])
_E._PINS.update({(QCMP, e): p for (op, e), p in list(_E._PINS.items()) if op == CMP})

_SCENARIOS = ((4, 2, 128), (4, 2, 128), (4, 2, 512), (128, 1, 512))


def _lengths(draw, edge, r, nb, cap):
    """(starts, lengths) per batch for the edge."""
    if edge == "uneven_batch":
        return [0, 0], [12, 11]
    starts, lens = [], []
    for _ in range(nb):
        if edge == "group_full":
            s, n = r * draw(st.integers(0, 2)), r
        elif edge == "residual_max":
            s = draw(st.integers(0, 2 * r))
            n = (s // r + 1) * r + r - 1 - s
        elif edge == "one_token":
            s, n = draw(st.sampled_from([r - 1, 2 * r - 1, r, 3])), 1
        elif r == 128:
            s = draw(st.integers(120, 130))
            n = draw(st.integers(1, 9))
        else:
            s, n = draw(st.integers(0, 9)), draw(st.integers(0, cap))
        starts.append(s)
        lens.append(n)
    return starts, lens


@st.composite
def compressor_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``compressor``: C4Li (most draws), C4A and C128A; BSH or TH x with H 1024, bf16 / fp16; starts that put
    earlier tokens of a group in the state; seqused None or shorter; a paged state (cache_mode 1, random block
    ids) or a ring buffer (cache_mode 2); the edges of the module docstring."""
    from ..ops.compressor import CMP_CONTRACT

    pins, edge = _E.take(draw, CMP, pins)
    b = _b(bounds)
    r, cf, d = _choose(draw, pins, "scenario", _SCENARIOS)
    mode = _choose(draw, pins, "cache_mode", (1, 1, 2))
    layout = _choose(draw, pins, "layout", ("TH", "BSH"))
    xdt = ml_dtypes.bfloat16 if _choose(draw, pins, "x_dtype", ("bfloat16", "float16")) == "bfloat16" else np.float16
    nb = 2 if edge == "uneven_batch" else draw(st.integers(1, max(1, min(b.max_batch, 3))))
    cap = max(1, min(b.max_tokens, 12))
    starts, lens = _lengths(draw, edge, r, nb, cap)
    if layout == "BSH":
        lens = [max(lens)] * nb
    rng = _rng(draw)
    h = 1024
    t = sum(lens)
    x = (rng.standard_normal((t, h)) * 0.5).astype(xdt)
    if layout == "BSH":
        x = x.reshape(nb, lens[0], h)
    wkv = (rng.standard_normal((cf * d, h)) * 0.03).astype(xdt)
    wgate = (rng.standard_normal((cf * d, h)) * 0.03).astype(xdt)
    ape = rng.standard_normal((r, cf * d)).astype(np.float32)
    seqused = None
    if edge is None and draw(st.booleans()):
        seqused = np.array([draw(st.integers(0, n)) for n in lens], np.int32)
    smax = max(s + n for s, n in zip(starts, lens)) if nb else 0
    if mode == 2:
        bs = cf * r + max(lens) - 1 + draw(st.integers(0, 2))
        nblk = nb + draw(st.integers(0, 1))
        table = rng.permutation(nblk)[:nb].astype(np.int32)
    else:
        bs = draw(st.sampled_from((1, 2, 4, 8) if r == 4 else (32, 64, 128)))
        width = -(-max(smax, 1) // bs)
        nblk = 1 + nb * width
        table = (1 + rng.permutation(nb * width)).astype(np.int32).reshape(nb, width)
        if draw(st.booleans()):  # an entry 0: that block is not written
            table[rng.integers(nb), rng.integers(width)] = 0
    state = rng.standard_normal((nblk, bs, 2 * cf * d)).astype(np.float32)
    args = dict(x=x, wkv=wkv, wgate=wgate, state_cache=state, ape=ape, state_block_table=table,
                cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32) if layout == "TH" else None,
                seqused=seqused, start_pos=np.array(starts, np.int32), cmp_ratio=r, coff=cf, cache_mode=mode,
                precision="faithful")
    assume(CMP_CONTRACT.first_violation(Args(args)) is None)
    return args


@st.composite
def quant_compressor_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``quant_compressor``: a :func:`compressor_args` draw (the same edges) with x, wkv and wgate as HiFloat8 codes
    of ``randn`` values (x scaled by 4) and fp32 descales (x_descale in [0.05, 1], weight descales in [1e-3, 0.02])."""
    from ..formats import encode
    from ..ops.compressor import QCMP_CONTRACT

    a = draw(compressor_args(bounds, **pins))
    rng = _rng(draw)
    cd = a["wkv"].shape[0]

    def codes(v, scale):
        return encode((rng.standard_normal(v.shape) * scale).astype(np.float32), "hifloat8", saturate=True)

    a.update(x=codes(a["x"], 4.0), wkv=codes(a["wkv"], 1.0), wgate=codes(a["wgate"], 1.0),
             x_descale=np.array([draw(st.sampled_from([0.05, 0.37, 1.0]))], np.float32),
             wkv_descale=(rng.random(cd) * 0.02 + 1e-3).astype(np.float32),
             wgate_descale=(rng.random(cd) * 0.02 + 1e-3).astype(np.float32), quant_mode=1)
    assume(QCMP_CONTRACT.first_violation(Args(a)) is None)
    return a


# ------------------------------------------------------------------------------------------- vllm_compressor

VCMP = "vllm_compressor"
#: the compressor's edges, then each rotary_mode (rope_head_dim is always 64, the only value)
_E.EDGES.setdefault(VCMP, _E.EDGES[CMP] + ("rotary_half", "rotary_interleave"))
_E._PINS.update({(VCMP, e): p for (op, e), p in list(_E._PINS.items()) if op == CMP})
_E._PINS.update({(VCMP, "rotary_half"): dict(rotary_mode=1, layout="TH"),
                 (VCMP, "rotary_interleave"): dict(rotary_mode=2, layout="TH")})


@st.composite
def vllm_compressor_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``vllm_compressor``: a :func:`compressor_args` draw (its edges too) plus what vLLM-Ascend's kernel adds -
    ``norm_weight`` ``1 + 0.1 randn`` and sin / cos tables of random angles, one row per cmp_kv row. Each draw is one
    chip's combination (pin ``chip_kind``): "a2a3" (norm_weight in x's dtype, tables in x's dtype or fp32,
    cache_mode 1) or "950" (both fp32; every ring-buffer draw). rotary_mode 1 or 2, norm_eps 1e-6 or 1e-5."""
    from ..ops.vllm_compressor import VCMP_CONTRACT
    from ..reference.compressor import cmp_rows

    pins, edge = _E.take(draw, VCMP, pins)
    kind = pins.pop("chip_kind", None)
    rotary = pins.pop("rotary_mode", None)
    base = dict(pins)
    if edge in _E.EDGES[CMP]:
        base["edge"] = edge
    elif edge is None:  # D 128 most of the time: the norm and RoPE lanes are the same, the draws cheaper
        base.setdefault("scenario", ((4, 2, 128), (4, 2, 128), (4, 2, 128), (4, 2, 512), (128, 1, 512)))
    a = draw(compressor_args(bounds, **base))
    if kind is None:
        kind = "950" if a["cache_mode"] == 2 else draw(st.sampled_from(("a2a3", "a2a3", "950")))
    assume(kind == "950" or a["cache_mode"] == 1)
    rng = _rng(draw)
    d = a["wkv"].shape[0] // a["coff"]
    nb = a["x"].shape[0] if a["x"].ndim == 3 else a["cu_seqlens"].size - 1
    rows = cmp_rows(a["x"].shape, a["cmp_ratio"], nb)
    ang = rng.uniform(-np.pi, np.pi, rows + (64,))
    tdt = np.float32 if kind == "950" else draw(st.sampled_from((np.float32, a["x"].dtype)))
    a.update(norm_weight=(1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32 if kind == "950" else a["x"].dtype),
             rope_sin=np.sin(ang).astype(tdt), rope_cos=np.cos(ang).astype(tdt), rope_head_dim=64,
             norm_eps=draw(st.sampled_from((1e-6, 1e-5))),
             rotary_mode=int(rotary) if rotary is not None else draw(st.sampled_from((1, 2))))
    assume(VCMP_CONTRACT.first_violation(Args(a)) is None)
    return a
