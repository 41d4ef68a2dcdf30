"""float64 models with derived error bounds for metamorphic properties (kept out of properties.py).

:func:`uniform_scores_model` - the attention output when every score is 0 (a zero query).

Derivation (docs/numerics/attention.md, the faithful pipeline): with all selected scores 0 the row maximum is
0 and every ``exp(s - m)`` is exactly 1, so the row sum ``l`` is the number of selected token entries ``c``
(exact in fp32). The probabilities reach ``P @ V`` rounded to the query dtype: 1 (unnormalised), or
``p = q(fp32(1 / c))`` (normalised: bf16 RINT / fp16 ROUND of the fp32 reciprocal - *not* ``1 / c``, which
is why a plain "mean of V" expectation is off by up to 2^-9 relative in bf16). Hence, with ``T = sum_j w_j v_j``
over the selected V rows (exact in float64: a few hundred query-dtype values):

* unnormalised: ``X = T / c``; the kernel's fp32 sum of ``c`` terms in any order is within
  ``gamma_c * sum |w_j v_j|`` (``gamma_c = c u / (1 - c u)``, ``u = 2^-24``) and the fp32 divide adds ``u |X|``;
* normalised: ``X = p * T``, error ``gamma_c * p * sum |w_j v_j|``;
* exact precision: ``X = T / c`` in float64, error ``1e-12`` relative (float64 rounding only);

and the output rounding to the query dtype adds at most half an ulp of the query dtype at ``|X| + error``.
The bound is therefore ``err + ulp_q(|X| + err) / 2`` per element; a row that selects nothing must be 0.
"""

from __future__ import annotations

import numpy as np

from .._arrays import dtype_name
from ._support import gather_tokens, round_query_dtype

__all__ = ["uniform_scores_model", "half_ulp"]

_U = 2.0 ** -24
#: significant bits and the exponent of the smallest normal of the query dtypes
_Q = {"bfloat16": (8, -126), "float16": (11, -14)}


def half_ulp(y: np.ndarray, qdtype: str) -> np.ndarray:
    """Half an ulp of ``qdtype`` at magnitude ``y`` (float64; subnormal spacing below the normal range)."""
    bits, emin = _Q[qdtype]
    _, e = np.frexp(np.abs(y))  # y = f * 2^e, f in [0.5, 1): the binade of y starts at 2^(e - 1)
    e = np.maximum(e.astype(np.int64) - 1, emin)
    return np.ldexp(1.0, (e - bits).astype(np.int64))


def uniform_scores_model(args: dict, w, batch, act_kv, storage, v):
    """``(X [R, Dv], bound [R, Dv])``: the expected output rows of a zero-query call and the per-element bound
    on ``|out - X|`` (see the module docstring). ``w, batch, act_kv, storage``: :func:`~qsfa.conformance.
    _support.selection`; ``v``: the float64 V rows as the kernel reads them."""
    rows = batch.size
    cnt = w.sum(axis=1).astype(np.float64)
    tot = np.zeros((rows, v.shape[1]))
    mag = np.zeros((rows, v.shape[1]))
    for b in range(act_kv.size):  # batches: a handful
        rb = np.flatnonzero(batch == b)
        if rb.size:
            vb = gather_tokens(v, storage, b, w.shape[1], act_kv)
            tot[rb] = w[rb].astype(np.float64) @ vb
            mag[rb] = w[rb].astype(np.float64) @ np.abs(vb)
    c = np.maximum(cnt, 1)[:, None]
    if args.get("precision", "faithful") == "exact":
        x = tot / c
        return x, 1e-12 * mag / c + 1e-300
    qd = dtype_name(args["query"])
    gamma = c * _U / (1 - c * _U)
    if args.get("probability_rounding", "unnormalised") == "normalised":
        p = round_query_dtype((np.float32(1) / np.maximum(cnt, 1).astype(np.float32)), qd)[:, None]
        x = p * tot
        err = gamma * p * mag
    else:
        x = tot / c
        err = gamma * mag / c + _U * np.abs(x)
    bound = err + half_ulp(np.abs(x) + err, qd)
    empty = cnt == 0
    x[empty], bound[empty] = 0.0, 0.0
    return x, bound
