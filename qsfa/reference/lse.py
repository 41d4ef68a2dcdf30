"""Context-parallel merge of partial attention results through their softmax statistics (docs/numerics/attention.md#merge_attention_lse).

Shard ``p`` attended over a disjoint subset of a row's selected tokens and returned ``(out_p, m_p, l_p)``
with ``m_p`` the max of its scaled scores and ``l_p = sum exp(s - m_p)`` over its tokens. The unsplit
result is

    m = max_p m_p,   w_p = l_p * exp(m_p - m),   l = sum_p w_p,   out = sum_p w_p * out_p / l

An empty shard reports ``m_p = l_p = 0`` (the kernels' convention for a row with no token): it carries no
weight and is excluded from the max (otherwise its 0 would raise ``m`` above the real maxima of shards
whose scores are all negative and could underflow their weights). A row whose shards are all empty
merges to ``out = 0, m = l = 0``.

The merge is computed in float64 and returned in the dtypes of the inputs, rounded once from float64
(16-bit outputs with the query-dtype rule of :mod:`qsfa.reference.attention`: bf16 RINT, fp16 ROUND;
float32 statistics and outputs by NumPy's RNE cast). Its only operation that is not IEEE-exact is the float64
``exp`` (glibc, or NumPy's own AVX512F kernel, which differ by at most an ulp), so a result's bytes could
differ between machines only where the float64 value lies within an ulp of a rounding boundary (about 2^-29 of
fp32 results, less for 16-bit ones); the attention oracles themselves are exact in that respect.
"""

from __future__ import annotations

import numpy as np

__all__ = ["merge_attention_lse", "lse_view"]


def lse_view(stat: np.ndarray, layout_query: str) -> np.ndarray:
    """Statistics ``[P, B, 1, S, N]`` (BSND) / ``[P, 1, T, N]`` (TND) as ``[P, B, S, N]`` / ``[P, T, N]``,
    i.e. aligned with the attention output ``[P, ..., N, D]`` without its last axis."""
    if layout_query == "BSND":
        return stat[:, :, 0]
    return stat[:, 0]


def merge_attention_lse(attention_out, softmax_max, softmax_sum, *, layout_query="BSND"):
    """Merge ``P`` partial results (stacked on a new leading axis) into one.

    attention_out: ``[P, B, S, N, D]`` (BSND) or ``[P, T, N, D]`` (TND), float16 / bfloat16 / float32 /
    float64. softmax_max, softmax_sum: ``[P, B, 1, S, N]`` / ``[P, 1, T, N]`` float32 or float64.
    Returns ``(attention_out [B, S, N, D] / [T, N, D], softmax_max, softmax_sum)`` in the input dtypes.
    """
    from . import formats
    from .attention import _QDT, QUERY_ROUNDING

    out_p = np.asarray(attention_out).astype(np.float64)
    m_p = lse_view(np.asarray(softmax_max), layout_query).astype(np.float64)
    l_p = lse_view(np.asarray(softmax_sum), layout_query).astype(np.float64)
    present = l_p > 0
    m = np.where(present, m_p, -np.inf).max(axis=0)
    any_present = present.any(axis=0)
    m = np.where(any_present, m, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        w = np.where(present, l_p * np.exp(np.where(present, m_p, 0.0) - m[None]), 0.0)
    l = w.sum(axis=0)
    safe = np.where(any_present, l, 1.0)
    out = (w[..., None] * out_p).sum(axis=0) / safe[..., None]
    out[~any_present] = 0.0
    sdt = np.asarray(softmax_max).dtype
    m_out = m.astype(sdt)
    l_out = l.astype(sdt)
    if layout_query == "BSND":
        m_out, l_out = m_out[:, None], l_out[:, None]
    else:
        m_out, l_out = m_out[None], l_out[None]
    odt = np.asarray(attention_out).dtype
    if odt in (_QDT["bfloat16"], _QDT["float16"]):
        name = "bfloat16" if odt == _QDT["bfloat16"] else "float16"
        merged = formats.round_to(out, name, rounding=QUERY_ROUNDING[name])  # one rounding from float64
        return merged.astype(odt), m_out, l_out
    return out.astype(odt), m_out, l_out
