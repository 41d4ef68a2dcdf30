"""Hypothesis strategy of ``vllm_quant_lightning_indexer`` (docs/numerics/indexer.md#vllm_quant_lightning_indexer).

Edges (drawn first in the edge phase): ``cmp_ratio:4`` and ``cmp_ratio:128`` (the V4 CSA / HCA ratios),
``no_compressed_token`` (a batch whose original key length is below cmp_ratio, and a row of another batch that
the causal rule leaves without a compressed token), ``ties`` (every compressed token of a batch alike: all
scores of a row equal, the k-th included), ``fp8`` (the 950 path, whose bfloat16 sort key ties often).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from .. import _edges as _E
from ._common import _b, _choose, Bounds

__all__ = ["vllm_quant_lightning_indexer_args"]

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
