"""float64 models with derived error bounds for metamorphic properties (kept out of properties.py).

:func:`uniform_scores_model` - the attention output when every score is 0 (a zero query).

Derivation (docs/numerics/attention.md, the faithful pipeline): with all selected scores 0 the row maximum is
0 and every ``exp(s - m)`` is exactly 1, so the row sum ``l`` is the number of selected token entries ``c``
(exact in fp32). The probabilities reach ``P @ V`` rounded to the query dtype: 1 (unnormalised), or
``p = q(fp32(1 / c))`` (normalised: the chip's P rounding of the fp32 reciprocal, docs/numerics/chips.md#attention
- *not* ``1 / c``, which is why a plain "mean of V" expectation is off by up to 2^-9 relative in bf16 and failed
the reference on small normalised bf16 cases with cos_diff 1.0-1.2e-5). QSFA's V is the dequantised NoPE with
the chip's K rounding. Hence, with ``T = sum_j w_j v_j``
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
from ._support import round_to

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


def attention_modes(op: str, args: dict) -> dict:
    """The rounding modes (``k_rounding``, ``p_rounding``, ``out_rounding``) of the chip a call of ``op`` models:
    the runner's chip, else the call's own (qsfa.chips: "950" for a call only the 950 accepts, else "A2")."""
    from .. import chips
    from .._dispatch import operator
    from ._support import current_chip

    chip = current_chip() or chips.chip_for_args(operator(op).contract, args)
    return chips.attention_rounding(chip, dtype_name(args["query"]))


def uniform_scores_model(op: str, args: dict, w, batch, act_kv, storage):
    """``(X [R, Dv], bound [R, Dv])``: the expected output rows of a zero-query call of ``op`` (QSFA or SFA) and
    the per-element bound on ``|out - X|`` (see the module docstring). ``w, batch, act_kv, storage``:
    :func:`~qsfa.conformance._support.selection`."""
    from ._support import packed_kv, selected_tokens, take_rows

    modes = attention_modes(op, args)
    exact = args.get("precision", "faithful") == "exact"
    # convert only the selected tokens' cache rows (per-row conversions: the same values; an unselected token has
    # weight 0): row i of ``v`` is flat cache row ``flat[i]``, the batches' selected tokens one after the other
    groups = selected_tokens(w, batch, act_kv, storage)
    flat = np.concatenate([g[3] for g in groups]).astype(np.int64) if groups else np.zeros(0, np.int64)
    if op == "kv_quant_sparse_flash_attention":  # V = the dequantised NoPE as K rounds it
        _, v = packed_kv(dict(args, key=take_rows(args["key"], flat)), faithful=not exact,
                         k_rounding=modes["k_rounding"], with_k=False)
    else:
        v = args.get("value")
        v = take_rows(args["key"] if v is None else v, flat).astype(np.float64)
    rows = batch.size
    cnt = w.sum(axis=1).astype(np.float64)
    tot = np.zeros((rows, v.shape[1]))
    mag = np.zeros((rows, v.shape[1]))
    start = 0
    for _, rb, tok, _ in groups:
        vb = v[start:start + tok.size]
        start += tok.size
        wb = w[rb][:, tok].astype(np.float64)
        tot[rb] = wb @ vb
        mag[rb] = wb @ np.abs(vb)
    c = np.maximum(cnt, 1)[:, None]
    if exact:
        x = tot / c
        return x, 1e-12 * mag / c + 1e-300
    qd = dtype_name(args["query"])
    gamma = c * _U / (1 - c * _U)
    if args.get("probability_rounding", "unnormalised") == "normalised":
        p = np.asarray(round_to(np.float32(1) / np.maximum(cnt, 1).astype(np.float32), qd,
                                rounding=modes["p_rounding"]), np.float64)[:, None]
        x = p * tot
        err = gamma * p * mag
    else:
        x = tot / c
        err = gamma * mag / c + _U * np.abs(x)
    bound = err + half_ulp(np.abs(x) + err, qd)
    empty = cnt == 0
    x[empty], bound[empty] = 0.0, 0.0
    return x, bound
