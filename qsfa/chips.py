"""Per-chip numerics: which chip a call models, and that chip's rounding and saturation points.

Every public operator takes ``chip=None | "A2" | "A3" | "950"`` (keyword). The chip decides two things:

* **constraints** - the contract's ``chips=`` rules of that chip are checked (``Constraint.chips``);
* **numerics** - every rounding / saturation point the chip's kernel has, handed to the reference (and
  the Triton kernels) as plain parameters (``k_rounding``, ``p_rounding``, ``out_rounding``,
  ``hifloat8_overflow``, ...). The table, with the kernel source of every cell, is
  ``docs/numerics/chips.md``; :data:`ATTENTION_ROUNDING` and :data:`KRR_HIFLOAT8_OVERFLOW` are that table
  as data.

Which chip a call models (:func:`resolve_chip`, the same rule the dispatch layer applies):

1. an explicit ``chip=`` (validated against that chip's limits);
2. else the npu backend's device chip (an explicit chip that differs from it is an error);
3. else **"950" when the call breaks a limit of Atlas A2/A3 that the 950 does not have** (a rule with
   ``chips={"A2", "A3"}``: e.g. an FP8 or HiFloat8 KV, Q_N = 48), else **"A3" when it breaks a limit of Atlas A2
   that A3 does not have** (an A3-only operator: ``sparse_attn_sharedkv``), **otherwise "A2"** (also when every chip
   rejects the call and only the reference, which accepts the union, runs it). A2 and A3 build the same
   kernel sources (the non-``arch35`` ``op_kernel`` files), so "A2" stands for both; their numerics are
   identical.

``qsfa.resolve_chip(op, **args)`` tells a caller which chip a call with those arguments models (the golden
manifests record it per case as ``"chip"``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Mapping

from ._contract import CHIPS, Args
from ._errors import InvalidArgument, Raw

__all__ = [
    "CHIPS",
    "ROUNDINGS",
    "ATTENTION_ROUNDING",
    "KRR_HIFLOAT8_OVERFLOW",
    "attention_rounding",
    "DYNAMIC_BLOCK_QUANT_ORDER",
    "C8_SCALE_ORDER",
    "check_chip",
    "resolve_chip",
    "chip_violation",
    "SHAREDKV_NUMERICS",
    "QS_NUMERICS",
]

#: rounding modes of an fp32 -> 16-bit cast: "rint" = round half to even (AscendC CAST_RINT), "round" = round
#: half away from zero (AscendC CAST_ROUND)
ROUNDINGS = ("rint", "round")

_A2A3 = {
    "k": {"bfloat16": "rint", "float16": "round"},
    "p": {"bfloat16": "round", "float16": "round"},
    "out": {"bfloat16": "rint", "float16": "round"},
}
_950 = {
    "k": {"bfloat16": "rint", "float16": "rint"},
    "p": {"bfloat16": "round", "float16": "round"},
    "out": {"bfloat16": "round", "float16": "round"},
}
#: Attention (QSFA and SFA): chip -> rounding point -> query dtype -> mode. Points: "k" = the dequantised K
#: NoPE (QSFA only) cast to the query dtype, "p" = the probabilities exp(s - max) cast to the query dtype
#: before P @ V, "out" = the attention output cast to the query dtype. Sources: docs/numerics/chips.md.
ATTENTION_ROUNDING = {"A2": _A2A3, "A3": _A2A3, "950": _950}

#: KvRmsNormRopeCache HiFloat8 cache: what a value beyond HiFloat8's range becomes. The 950 kernel casts with
#: ``SatMode::NO_SAT`` (-> +-Inf); A2/A3 have no HiFloat8 cache (rule a2a3_int8_only), qsfa's default there is
#: the saturating cast. Sources: docs/numerics/chips.md#kvrmsnormropecache.
KRR_HIFLOAT8_OVERFLOW = {"A2": "saturate", "A3": "saturate", "950": "inf"}

#: dynamic_block_quant: the chip kernel's order of the scale arithmetic (qsfa.reference.quant.SCALE_ORDERS): A2/A3
#: multiply by fp32(fp32(1/amax) * TYPE_MAX) and output amax * fp32(1/TYPE_MAX); the 950 divides. Sources:
#: docs/numerics/chips.md#dynamic_block_quant.
DYNAMIC_BLOCK_QUANT_ORDER = {"A2": "reciprocal", "A3": "reciprocal", "950": "divide"}

#: c8_cache_write / c8_rmsnorm_rope_cache: vllm-ascend's C8 writer quantises the NoPE with the chip's
#: npu_dynamic_block_quant, so the writers take its order. Sources: docs/numerics/chips.md#c8-cache-writers.
C8_SCALE_ORDER = DYNAMIC_BLOCK_QUANT_ORDER

#: DeepSeek-V4 shared-KV attention (sparse_flash_mla, sparse_attn_sharedkv): chip -> "s2_tile" (tokens per online-
#: softmax step), "p" / "out" (query dtype -> mode of the P and output casts). Sources: docs/numerics/chips.md
#: #deepseek-v4-shared-kv-attention (A2/A3: attention/sparse_flash_mla/op_kernel/arch22/
#: sparse_flash_mla_scfa_block_vector.h; 950: .../arch35/sparse_flash_mla_csa_block_vector.h).
SHAREDKV_NUMERICS = {
    "A2": {"s2_tile": 512, "p": {"bfloat16": "round", "float16": "round"},
           "out": {"bfloat16": "rint", "float16": "round"}},
    "950": {"s2_tile": 128, "p": {"bfloat16": "round", "float16": "round"},
            "out": {"bfloat16": "round", "float16": "round"}},
}
SHAREDKV_NUMERICS["A3"] = SHAREDKV_NUMERICS["A2"]

#: quant_sparse_flash_mla (Ascend 950 only; docs/numerics/chips.md#deepseek-v4-shared-kv-attention): the S2 tile,
#: the x16 scale before P's HiFloat8 cast (CAST_ROUND, ties away) and the bf16 output cast (CAST_ROUND)
QS_NUMERICS = {"s2_tile": 128, "p_scale": 16.0, "out_rounding": "round"}



def _numerics_hook(*needs: str):
    """The ``Operator.numerics`` hooks below are called by the dispatch layer with a valid chip and arguments that
    passed the contract; called directly, a bad chip or an argument mapping that lacks what the hook reads is the
    project's error (issue 27: the helpers of qsfa.chips go through the operators' rules), never a KeyError."""
    def deco(fn):
        @functools.wraps(fn)
        def hook(chip, args):
            if not isinstance(chip, str) or chip not in CHIPS:
                raise InvalidArgument("value", "chip", chip, "must be 'A2', 'A3' or '950' (a numerics hook models one chip)")
            if not isinstance(args, Mapping) or any(k not in args for k in needs):
                raise InvalidArgument("value", "args", Raw(type(args).__name__), "must be a mapping of the operator's "
                                      f"arguments holding {list(needs)}")
            try:
                return fn(chip, args)
            except KeyError as e:  # a dtype the chip's table has no entry for
                raise InvalidArgument("value", "args", Raw(f"{e.args[0]!r}"), "no numerics of this chip for that "
                                      "value: the arguments are not a valid call of the operator") from None
        return hook
    return deco


@_numerics_hook("q")
def sharedkv_numerics(chip: str, args: Mapping) -> dict:
    """``Operator.numerics`` of the V4 shared-KV attention: S2 tile and the P / output rounding modes."""
    from ._arrays import dtype_name

    t = SHAREDKV_NUMERICS[chip]
    q = dtype_name(args["q"])
    return {"s2_tile": t["s2_tile"], "p_rounding": t["p"][q], "out_rounding": t["out"][q]}


#: the chip whose numerics the bare reference functions use when no mode is passed
DEFAULT_CHIP = "A2"


def check_chip(chip) -> str | None:
    """``chip`` itself when it is None or one of :data:`CHIPS`; otherwise the project's error."""
    if chip is None or (isinstance(chip, str) and chip in CHIPS):
        return chip
    from ._errors import InvalidArgument

    raise InvalidArgument("value", "chip", chip, "chip must be None, 'A2', 'A3' or '950'")


def attention_rounding(chip: str | None, qdtype: str, *, dequant: bool = True) -> dict:
    """The attention rounding parameters (``k_rounding``, ``p_rounding``, ``out_rounding``) of ``chip`` for a
    query of dtype ``qdtype`` ("bfloat16" / "float16"); ``dequant=False`` (SFA: K is not dequantised) leaves
    ``k_rounding`` out. ``chip=None`` is :data:`DEFAULT_CHIP`."""
    table = ATTENTION_ROUNDING[check_chip(chip) or DEFAULT_CHIP]
    if qdtype not in ("bfloat16", "float16"):
        raise InvalidArgument("value", "qdtype", qdtype, "must be 'bfloat16' or 'float16' (the query dtype)")
    out = {f"{p}_rounding": table[p][qdtype] for p in (("k", "p", "out") if dequant else ("p", "out"))}
    return out


@_numerics_hook("query")
def qsfa_numerics(chip: str, args: Mapping) -> dict:
    """``Operator.numerics`` of kv_quant_sparse_flash_attention: the three attention rounding modes."""
    from ._arrays import dtype_name

    return attention_rounding(chip, dtype_name(args["query"]))


@_numerics_hook("query")
def sfa_numerics(chip: str, args: Mapping) -> dict:
    """``Operator.numerics`` of sparse_flash_attention (K is not dequantised: P and output modes)."""
    from ._arrays import dtype_name

    return attention_rounding(chip, dtype_name(args["query"]), dequant=False)


@_numerics_hook()
def krr_numerics(chip: str, args: Mapping) -> dict:
    """``Operator.numerics`` of kv_rmsnorm_rope_cache: the HiFloat8 cache's overflow rule."""
    return {"hifloat8_overflow": KRR_HIFLOAT8_OVERFLOW[chip]}


@_numerics_hook()
def dbq_numerics(chip: str, args: Mapping) -> dict:
    """``Operator.numerics`` of dynamic_block_quant: the chip's scale order where the caller left it None."""
    return {} if args.get("scale_order") is not None else {"scale_order": DYNAMIC_BLOCK_QUANT_ORDER[chip]}


@_numerics_hook()
def c8_numerics(chip: str, args: Mapping) -> dict:
    """``Operator.numerics`` of the C8 writers: the chip's scale order where the caller left it None."""
    return {} if args.get("scale_order") is not None else {"scale_order": C8_SCALE_ORDER[chip]}


def chip_for_args(contract, args: Mapping) -> str:
    """Rule 3 of the module docstring for already valid ``args`` (NumPy views): "950" when a rule limited to
    A2/A3 (not the 950) rejects them, else "A2". Only the chip rules run (cheap)."""
    a = args if isinstance(args, Args) else Args(args)
    for c in contract.constraints:
        if c.chips is not None and "A2" in c.chips and "950" not in c.chips and c.check(a) is not None:
            return "950"
    for c in contract.constraints:  # an Atlas A3-only call (sparse_attn_sharedkv): A3 (A2 refused it, so goldens failed)
        if c.chips is not None and "A2" in c.chips and "A3" not in c.chips and c.check(a) is not None:
            return "A3"
    return "A2"


def front_door(op: str):
    """The public function of operator ``op``: ``qsfa.<op>``, or ``qsfa.<module>.<name>`` for "<module>.<name>"
    ("formats.encode", "layouts.flashmla_model1_quantize")."""
    if "." in op:
        mod, name = op.split(".", 1)
        return getattr(importlib.import_module(f"qsfa.{mod}"), name)
    return getattr(importlib.import_module("qsfa"), op)


def _bind(op: str, args, kwargs) -> dict:
    """Every argument of a call ``qsfa.<op>(*args, **kwargs)``, defaults filled in from its front door."""
    try:
        fn = front_door(op)
    except (ImportError, AttributeError):  # an operator registered without a qsfa front door: its arguments
        fn = None
    if fn is None:
        if args:
            raise TypeError(f"{op!r} has no front door: pass the arguments by name")
        return dict(kwargs)
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:  # a missing / unknown argument: named like every other bad argument
        raise InvalidArgument("value", "arguments", Raw(f"the arguments of qsfa.{op}"), str(e)) from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _known_operator(op):
    """The operator named ``op``; an unknown name (or not a string) is an InvalidArgument listing the known ones."""
    from ._dispatch import operator, operators

    if not isinstance(op, str) or op not in operators():
        raise InvalidArgument("value", "op", op, f"must be an operator name, one of {sorted(operators())}")
    return operator(op)


def chip_violation(op: str, /, *args: Any, **kwargs: Any):
    """The error (InvalidArgument / InvalidDtype) of the first chip-limited rule a call ``qsfa.<op>(...,
    chip=...)`` breaks for its chip, or None (also None without a chip)."""
    from ._arrays import is_torch, to_numpy
    from ._dispatch import operator

    _known_operator(op)
    call = _bind(op, args, kwargs)
    chip = check_chip(call.pop("chip", None))
    call.pop("backend", None)
    if chip is None:
        return None
    a = Args({n: (to_numpy(v) if is_torch(v) else v) for n, v in call.items()})
    for c in operator(op).contract.constraints:
        if c.chips is not None and c.applies_to(chip):
            actual = c.check(a)
            if actual is not None:
                return c.error(actual)
    return None


def resolve_chip(op: str, /, *args: Any, **kwargs: Any) -> str:
    """The chip whose constraints and numerics a call ``qsfa.<op>(*args, **kwargs)`` uses (see the module
    docstring for the rule). ``backend`` and ``chip`` may be among the arguments, as in the call itself.

    >>> qsfa.resolve_chip("kv_quant_sparse_flash_attention", query, key, value, idx, 0.04)  # int8 KV: "A2"
    """
    from ._arrays import is_torch, to_numpy
    from ._dispatch import get_backend, operator

    opr = _known_operator(op)
    call = _bind(op, args, kwargs)
    chip = check_chip(call.pop("chip", None))
    backend = call.pop("backend", "reference")
    be_chip = get_backend(backend, require_usable=False).chip() if backend != "reference" else None
    if chip is not None:
        return chip
    if be_chip is not None:
        return be_chip
    host = Args({n: (to_numpy(v) if is_torch(v) else v) for n, v in call.items()})
    opr.contract.validate(host)  # invalid arguments get the operator's own error, not a chip
    return chip_for_args(opr.contract, host)
