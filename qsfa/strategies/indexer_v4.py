"""Hypothesis strategies of ``vllm_quant_lightning_indexer`` and ``quant_lightning_indexer_v2``
(docs/numerics/indexer.md#vllm_quant_lightning_indexer, docs/numerics/indexer.md#quant_lightning_indexer_v2).

Edges (drawn first in the edge phase): ``cmp_ratio:4`` and ``cmp_ratio:128`` (the V4 CSA / HCA ratios),
``no_compressed_token`` (a batch whose original key length is below cmp_ratio, and a row of another batch that
the causal rule leaves without a compressed token), ``ties`` (every compressed token of a batch alike: all
scores of a row equal, the k-th included), ``fp8`` (the 950 path, whose bfloat16 sort key ties often).
quant_lightning_indexer_v2 has the same edges plus ``residual:max`` (cmp_residual_k = cmp_ratio - 1: the causal
count one original token short of the next compressed token), ``hifloat8`` (quant_mode 4, per-tensor scales) and
``layout_k:TND`` (a packed key with cu_seqlens_k).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from .. import _edges as _E
from ._common import _b, _choose, Bounds

__all__ = ["vllm_quant_lightning_indexer_args", "quant_lightning_indexer_v2_args"]

VQLI = "vllm_quant_lightning_indexer"
_E.EDGES.setdefault(VQLI, ("cmp_ratio:4", "cmp_ratio:128", "no_compressed_token", "ties", "fp8"))
_E._PINS.update({
    # several causal rows of full length and a top-k wider than what they see: every visible count shows
    (VQLI, "cmp_ratio:4"): dict(cmp_ratio=4, sparse_mode=3, min_q=3, full_q=True, sparse_count=64),
    (VQLI, "cmp_ratio:128"): dict(cmp_ratio=128, sparse_mode=3, min_q=3, full_q=True, sparse_count=64),
    (VQLI, "no_compressed_token"): dict(cmp_ratio=(4, 128), batch=2, sparse_mode=3, starved=True),
    (VQLI, "ties"): dict(constant_keys=True),
    (VQLI, "fp8"): dict(format="float8_e4m3fn", cmp_ratio=(1, 4, 128)),
})
_INT8_RATIOS = (4, 128, 1, 2, 8, 16, 32, 64)
_FP8_RATIOS = (4, 128, 1)


@st.composite
def vllm_quant_lightning_indexer_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``vllm_quant_lightning_indexer``: int8 codes with float16 weights / scales (A2/A3) or FP8 E4M3FN codes with
    float32 ones (950), 64 heads, BSND / TND queries with lengths, a paged compressed key (block_size 16 or 32, the
    blocks of a batch scattered), original key lengths anywhere in ``[0, compressed * cmp_ratio + cmp_ratio)``,
    sparse_mode 0 / 3, metadata None or a [1024] int32 tensor (ignored); the edges of the module docstring."""
    from ..ops.indexer_v4 import HEADS

    pins, edge = _E.take(draw, VQLI, pins)
    b = _b(bounds)
    fmt = _choose(draw, pins, "format", ("int8", "float8_e4m3fn"))
    cmp = int(_choose(draw, pins, "cmp_ratio", _INT8_RATIOS if fmt == "int8" else _FP8_RATIOS))
    batch = int(_choose(draw, pins, "batch", tuple(range(1, max(1, b.max_batch) + 1))))
    layout_query = _choose(draw, pins, "layout_query", ("BSND", "TND"))
    sparse_mode = int(_choose(draw, pins, "sparse_mode", (3, 0)))
    block_size = int(_choose(draw, pins, "block_size", (16, 32)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    lo = max(2 if pins.get("starved") else 1, int(pins.get("min_q", 1)))
    s1 = draw(st.integers(lo, max(lo, b.max_q_tokens)))
    act_q = rng.integers(0 if layout_query == "BSND" else 1, s1 + 1, batch)
    if pins.get("full_q"):
        act_q[:] = s1
    max_c = max(1, b.max_kv_tokens)
    comp = rng.integers(0, max_c + 1, batch)  # compressed tokens per batch
    act_kv = comp * cmp + rng.integers(0, cmp, batch)  # original tokens: the remainder is not compressed yet
    if pins.get("starved"):
        act_kv[0] = rng.integers(0, cmp)  # fewer original tokens than one compressed token
        if batch > 1:  # a causal row before the first complete compressed token
            act_q[1] = max(int(act_q[1]), 2)
            act_kv[1] = cmp + int(act_q[1]) - 2
            comp[1] = 1
    comp = act_kv // cmp
    per = max(1, int(-(-comp.max() // block_size)))
    nb = batch * per + 1
    order = rng.permutation(nb)[:batch * per]
    block_table = order.reshape(batch, per).astype(np.int32)
    cast = np.int8 if fmt == "int8" else ml_dtypes.float8_e4m3fn
    if fmt == "int8":
        key = rng.integers(-64, 65, (nb, block_size, 1, 128)).astype(np.int8)
    else:
        key = rng.uniform(-4, 4, (nb, block_size, 1, 128)).astype(np.float32).astype(cast)
    if pins.get("constant_keys"):
        key[:] = key[:1, :1]
    sdt = np.float16 if fmt == "int8" else np.float32
    ks = rng.uniform(0.01, 0.1, (nb, block_size, 1)).astype(sdt)
    if pins.get("constant_keys"):
        ks[:] = ks[0, 0, 0]
    rows = (batch, s1) if layout_query == "BSND" else (int(act_q.sum()) + draw(st.integers(0, 1)),)
    if fmt == "int8":
        query = rng.integers(-64, 65, rows + (HEADS, 128)).astype(np.int8)
    else:
        query = rng.uniform(-4, 4, rows + (HEADS, 128)).astype(np.float32).astype(cast)
    weights = rng.uniform(-1, 1, rows + (HEADS,)).astype(sdt)
    qs = rng.uniform(0.01, 0.1, rows + (HEADS,)).astype(sdt)
    lq = act_q if layout_query == "BSND" else np.cumsum(act_q)
    lq = None if layout_query == "BSND" and draw(st.booleans()) and (act_q == s1).all() else lq.astype(np.int32)
    meta = np.zeros(1024, np.int32) if draw(st.booleans()) else None
    sparse_count = int(_choose(draw, pins, "sparse_count", tuple(range(1, min(2048, max(1, b.max_sparse)) + 1))))
    return dict(query=query, key=key, weights=weights, query_dequant_scale=qs, key_dequant_scale=ks,
                query_quant_mode=0, key_quant_mode=0, actual_seq_lengths_query=lq,
                actual_seq_lengths_key=act_kv.astype(np.int32), block_table=block_table, metadata=meta,
                layout_query=layout_query, layout_key="PA_BSND", sparse_count=sparse_count, sparse_mode=sparse_mode,
                pre_tokens=2**63 - 1, next_tokens=2**63 - 1, cmp_ratio=cmp, return_value=False,
                tie_break="lower_index")


QLI2 = "quant_lightning_indexer_v2"
_E.EDGES.setdefault(QLI2, ("cmp_ratio:4", "cmp_ratio:128", "residual:max", "no_compressed_token", "ties", "fp8",
                           "hifloat8", "layout_k:TND"))
_E._PINS.update({
    (QLI2, "cmp_ratio:4"): dict(cmp_ratio=4, mask_mode=3, min_q=3, full_q=True, topk=64),
    (QLI2, "cmp_ratio:128"): dict(cmp_ratio=128, mask_mode=3, min_q=3, full_q=True, topk=64),
    # the residual one short of a whole compressed token: the last causal row sees one token more than the first
    (QLI2, "residual:max"): dict(cmp_ratio=(4, 128), mask_mode=3, min_q=2, full_q=True, residual="max", topk=64),
    (QLI2, "no_compressed_token"): dict(cmp_ratio=(4, 128), batch=2, mask_mode=3, starved=True),
    (QLI2, "ties"): dict(constant_keys=True),
    (QLI2, "fp8"): dict(format="float8_e4m3fn", cmp_ratio=(1, 4, 128)),
    (QLI2, "hifloat8"): dict(format="hifloat8", cmp_ratio=(1, 4, 128)),
    (QLI2, "layout_k:TND"): dict(format=("float8_e4m3fn", "hifloat8"), layout_q="TND", layout_k="TND"),
})


@st.composite
def quant_lightning_indexer_v2_args(draw, bounds: Bounds | None = None, **pins) -> dict:
    """``quant_lightning_indexer_v2``: int8 codes with float16 weights / scales (quant_mode 2, A2/A3, paged key) or
    FP8 E4M3FN / HiFloat8 codes with float32 ones (quant_mode 1 / 4, 950; HiFloat8 with one [1] scale each), 64
    heads, BSND / TND queries (seqused_q or cu_seqlens_q), a paged (blocks of a batch scattered), BSND or TND
    compressed key, compressed lengths up to the bounds and residuals in [0, cmp_ratio), mask_mode 0 / 3,
    metadata None or a [1024] int32 tensor (ignored); the edges of the module docstring."""
    from ..ops.quant_lightning_indexer_v2 import HEADS
    from ..ops._attention_rules import _hif8_codes

    pins, edge = _E.take(draw, QLI2, pins)
    b = _b(bounds)
    fmt = _choose(draw, pins, "format", ("int8", "float8_e4m3fn", "hifloat8"))
    cmp = int(_choose(draw, pins, "cmp_ratio", _INT8_RATIOS if fmt == "int8" else _FP8_RATIOS))
    batch = int(_choose(draw, pins, "batch", tuple(range(1, max(1, b.max_batch) + 1))))
    layout_q = _choose(draw, pins, "layout_q", ("BSND", "TND"))
    layout_k = _choose(draw, pins, "layout_k", ("PA_BBND",) if fmt == "int8" else ("PA_BBND", layout_q))
    if layout_k != "PA_BBND" and (fmt == "int8" or layout_k != layout_q):
        layout_k = "PA_BBND" if fmt == "int8" else layout_q  # op_host: int8 is paged; outside PA, layout_k = layout_q
    mask_mode = int(_choose(draw, pins, "mask_mode", (3, 0)))
    block_size = int(_choose(draw, pins, "block_size", (16, 32)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lo = max(2 if pins.get("starved") else 1, int(pins.get("min_q", 1)))
    s1 = draw(st.integers(lo, max(lo, b.max_q_tokens)))
    act_q = rng.integers(0 if layout_q == "BSND" else 1, s1 + 1, batch)
    if pins.get("full_q"):
        act_q[:] = s1
    comp = rng.integers(0, max(1, b.max_kv_tokens) + 1, batch)  # compressed tokens per batch
    res = rng.integers(0, cmp, batch)
    if pins.get("residual") == "max":
        res[:] = cmp - 1
    if pins.get("starved"):
        comp[0], res[0] = 0, rng.integers(0, cmp)  # fewer original tokens than one compressed token
        if batch > 1:  # a causal row before the first complete compressed token
            act_q[1] = max(int(act_q[1]), 2)
            comp[1], res[1] = 1, int(act_q[1]) - 2
    need_res = cmp != 1 and mask_mode != 0
    if not need_res:
        res[:] = 0
    cast = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "hifloat8": np.uint8}[fmt]

    def codes(shape):
        if fmt == "int8":
            return rng.integers(-64, 65, shape).astype(np.int8)
        if fmt == "hifloat8":
            return _hif8_codes(rng, shape)
        return rng.uniform(-4, 4, shape).astype(np.float32).astype(cast)

    sdt = np.float16 if fmt == "int8" else np.float32
    bt = seqused_k = cu_k = None
    if layout_k == "PA_BBND":
        per = max(1, int(-(-comp.max() // block_size)))
        nb = batch * per + 1
        bt = rng.permutation(nb)[:batch * per].reshape(batch, per).astype(np.int32)
        kshape = (nb, block_size, 1, 128)
        seqused_k = comp.astype(np.int32)
    elif layout_k == "BSND":
        kshape = (batch, int(comp.max()) + draw(st.integers(0, 1)), 1, 128)
        seqused_k = comp.astype(np.int32)
    else:
        kshape = (int(comp.sum()) + draw(st.integers(0, 1)), 1, 128)
        cu_k = np.concatenate([[0], np.cumsum(comp)]).astype(np.int32)
    key = codes(kshape)
    if pins.get("constant_keys"):
        key[:] = key.reshape(-1, 128)[:1].reshape((1,) * (key.ndim - 1) + (128,))
    rows = (batch, s1) if layout_q == "BSND" else (int(act_q.sum()) + draw(st.integers(0, 1)),)
    query = codes(rows + (HEADS, 128))
    weights = rng.uniform(-1, 1, rows + (HEADS,)).astype(sdt)
    if fmt == "hifloat8":
        qs = rng.uniform(0.01, 0.1, (1,)).astype(sdt)
        ks = rng.uniform(0.01, 0.1, (1,)).astype(sdt)
    else:
        qs = rng.uniform(0.01, 0.1, rows + (HEADS,)).astype(sdt)
        ks = rng.uniform(0.01, 0.1, kshape[:-1]).astype(sdt)
        if pins.get("constant_keys"):
            ks[:] = ks.reshape(-1)[0]
    cu_q = seqused_q = None
    if layout_q == "TND":
        cu_q = np.concatenate([[0], np.cumsum(act_q)]).astype(np.int32)
    elif not ((act_q == s1).all() and draw(st.booleans())):
        seqused_q = act_q.astype(np.int32)
    meta = np.zeros(1024, np.int32) if draw(st.booleans()) else None
    topk = int(_choose(draw, pins, "topk", tuple(range(1, min(2048, max(1, b.max_sparse)) + 1))))
    return dict(query=query, key=key, weights=weights, query_dequant_scale=qs, key_dequant_scale=ks, topk=topk,
                quant_mode={"int8": 2, "float8_e4m3fn": 1, "hifloat8": 4}[fmt], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                seqused_q=seqused_q, seqused_k=seqused_k, cmp_residual_k=res.astype(np.int32) if need_res else None,
                block_table=bt, output_idx_offset=None, metadata=meta, max_seqlen_q=-1, layout_q=layout_q,
                layout_k=layout_k, mask_mode=mask_mode, cmp_ratio=cmp, return_value=0, tie_break="lower_index",
                precision="faithful")
