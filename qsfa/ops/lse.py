"""Front door of ``merge_attention_lse``: the context-parallel merge of partial attention results by their
log-sum-exp (docs/numerics/attention.md#merge_attention_lse).

Contract, case builder (:func:`merge_case`) and front door; the computation is :mod:`qsfa.reference.lse`,
the tests tests/test_lse_merge.py.
"""

from __future__ import annotations

import numpy as np

from .._arrays import dtype_name, is_torch
from .._checks import dtype_in, is_array
from .._contract import Contract, params
from .._dispatch import define_operator, run
from .._errors import InvalidArgument, Raw
from ..reference import lse as _ref_lse
from ._attention_rules import _BF16, choice_rule, edit, finite_rule, LAYOUTS_Q, Names, rule

__all__ = [
    "merge_attention_lse",
    "merge_case",
    "MERGE_CONTRACT",
]


# ==================================================================================================
# merge_attention_lse

MERGE = "merge_attention_lse"
MERGE_SOURCE = "docs/numerics/attention.md#merge_attention_lse (context-parallel merge of partial results)"


def merge_case(*, layout_query="BSND", parts=2, seed=0):
    rng = np.random.default_rng(seed)
    if layout_query == "BSND":
        out = rng.uniform(-1, 1, (parts, 1, 2, 2, 8)).astype(_BF16)
        stat_shape = (parts, 1, 1, 2, 2)
    else:
        out = rng.uniform(-1, 1, (parts, 3, 2, 8)).astype(_BF16)
        stat_shape = (parts, 1, 3, 2)
    m = rng.uniform(-2, 2, stat_shape).astype(np.float32)
    s = rng.uniform(1, 5, stat_shape).astype(np.float32)
    return dict(attention_out=out, softmax_max=m, softmax_sum=s, layout_query=layout_query)


_N_MERGE = Names(MERGE, merge_case, source=MERGE_SOURCE)


def _merge_rules():
    n = _N_MERGE
    r = [is_array(MERGE, p, source=MERGE_SOURCE) for p in ("attention_out", "softmax_max", "softmax_sum")]
    r.append(dtype_in(MERGE, "attention_out", ("float16", "bfloat16", "float32", "float64"), source=MERGE_SOURCE))
    r.append(dtype_in(MERGE, "softmax_max", ("float32", "float64"), source=MERGE_SOURCE))
    r.append(rule(n, "softmax_sum_dtype", "softmax_sum", "dtype", "must have softmax_max's dtype",
                  lambda a: None if a.softmax_sum.dtype == a.softmax_max.dtype else dtype_name(a.softmax_sum),
                  edit(n, lambda a: a.update(softmax_sum=a["softmax_sum"].astype(np.float64))), dtype=True))
    r.append(choice_rule(n, "layout_query", LAYOUTS_Q, bad="BNSD"))
    r.append(rule(n, "attention_out_ndim", "attention_out", "dim",
                  "must be [P, B, S, N, D] (BSND) or [P, T, N, D] (TND): partial results stacked on axis 0",
                  lambda a: None if a.attention_out.ndim == (5 if a.layout_query == "BSND" else 4)
                  else a.attention_out.ndim, edit(n, lambda a: a.update(attention_out=a["attention_out"][None]))))

    def stat_shape(a):
        o = a.attention_out.shape
        want = (o[0], o[1], 1, o[2], o[3]) if a.layout_query == "BSND" else (o[0], 1, o[1], o[2])
        return None if a.softmax_max.shape == want else tuple(a.softmax_max.shape)

    r.append(rule(n, "softmax_max_shape", "softmax_max", "shape",
                  "must be [P, B, 1, S, N] (BSND) or [P, 1, T, N] (TND) matching attention_out", stat_shape,
                  edit(n, lambda a: a.update(softmax_max=a["softmax_max"][:1]))))
    r.append(rule(n, "softmax_sum_shape", "softmax_sum", "shape", "must have softmax_max's shape",
                  lambda a: None if a.softmax_sum.shape == a.softmax_max.shape else tuple(a.softmax_sum.shape),
                  edit(n, lambda a: a.update(softmax_sum=a["softmax_sum"][:1]))))
    r.append(rule(n, "parts", "attention_out", "shape", "at least one partial result is needed (P >= 1)",
                  lambda a: None if a.attention_out.shape[0] >= 1 else tuple(a.attention_out.shape),
                  edit(n, lambda a: a.update(attention_out=a["attention_out"][:0], softmax_max=a["softmax_max"][:0],
                                             softmax_sum=a["softmax_sum"][:0]))))
    r.append(rule(n, "softmax_sum_values", "softmax_sum", "value", "must be finite and >= 0 (0 marks an empty shard)",
                  lambda a: None if (np.isfinite(a.softmax_sum) & (a.softmax_sum >= 0)).all() else "negative or non-finite",
                  edit(n, lambda a: a.update(softmax_sum=-a["softmax_sum"]))))
    r.append(rule(n, "softmax_max_values", "softmax_max", "value", "must be finite",
                  lambda a: None if np.isfinite(a.softmax_max).all() else "non-finite",
                  edit(n, lambda a: a.update(softmax_max=a["softmax_max"] * np.float32(np.inf)))))
    r.append(finite_rule(n, "attention_out"))
    return r


MERGE_CONTRACT = Contract(op=MERGE, constraints=_merge_rules(), example=lambda rng: merge_case(), params=params(
    "attention_out:array softmax_max:array softmax_sum:array layout_query:str"))


def _merge_reference(attention_out, softmax_max, softmax_sum, layout_query):
    return _ref_lse.merge_attention_lse(attention_out, softmax_max, softmax_sum, layout_query=layout_query)


define_operator(MERGE, MERGE_CONTRACT, outputs=("attention_out", "softmax_max", "softmax_sum"),
                reference=_merge_reference, doc="Merge partial attention results over disjoint token shards.")


def _stack(parts, name):
    """A sequence of P partial arrays (all NumPy or all torch, one shape) stacked on a new axis 0.

    Anything else is passed through unchanged, so the contract's generic type rule rejects it by name:
    like every operator, merge_attention_lse does not turn Python lists of numbers into arrays."""
    if not isinstance(parts, (list, tuple)) or not parts:
        return parts
    if all(is_torch(p) for p in parts):
        kind = "torch"
    elif all(isinstance(p, np.ndarray) for p in parts):
        kind = "numpy"
    else:
        return parts
    shapes = {tuple(p.shape) for p in parts}
    dtypes = {dtype_name(p) for p in parts}
    if len(shapes) > 1 or len(dtypes) > 1:
        raise InvalidArgument("shape", name, Raw(f"parts of shapes {sorted(shapes)}, dtypes {sorted(dtypes)}"),
                              "the partial results must all have one shape and dtype")
    if kind == "torch":
        import torch

        return torch.stack(list(parts))
    return np.stack(parts)


def merge_attention_lse(attention_out, softmax_max, softmax_sum, *, layout_query="BSND", chip=None,
                        backend="reference"):
    """Merge partial attention results computed over disjoint shards of each row's selected tokens.

    ``m = max m_p``, ``w_p = l_p exp(m_p - m)``, ``l = sum w_p``, ``out = sum w_p out_p / l`` in float64
    (docs/numerics/attention.md#merge_attention_lse); an empty shard (``m_p = l_p = 0``) carries no weight and does not take part in the max;
    a row with only empty shards gives ``out = 0, m = l = 0``. See :mod:`qsfa.reference.lse`.

    attention_out: the P partial outputs, a sequence of arrays / tensors or an array stacked on axis 0 (``[P, B, S, N, D]``
    BSND / ``[P, T, N, D]`` TND; float16 / bfloat16 / float32 / float64). softmax_max, softmax_sum: the
    matching statistics (``[P, B, 1, S, N]`` / ``[P, 1, T, N]``, float32 or float64), as returned by the
    attention operators with return_softmax_lse=True. Returns ``(attention_out, softmax_max,
    softmax_sum)`` of one unsplit call, in the input dtypes.
    """
    args = dict(attention_out=_stack(attention_out, "attention_out"), softmax_max=_stack(softmax_max, "softmax_max"),
                softmax_sum=_stack(softmax_sum, "softmax_sum"), layout_query=layout_query)
    return run(MERGE, args, backend, chip=chip)
