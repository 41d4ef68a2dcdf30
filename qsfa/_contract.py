"""Operator contracts: every documented constraint of an operator as one list of data.

A :class:`Contract` is the single place where an operator's argument rules live. Validation walks the
list in order and raises the first violation, *before* any backend runs and before any in-place buffer
is touched. Each :class:`Constraint` also knows how to break a valid argument set so that exactly that
constraint fires (``violate``); the test suite and ``qsfa.strategies`` iterate over the list, so a
constraint without a test cannot hide.

Checks see an :class:`Args` namespace of NumPy arrays and plain Python values (the dispatch layer
converts torch tensors first). A check returns ``None`` when the arguments satisfy it, otherwise the
offending ("actual") value that goes into the message (return the string ``"None"`` to report a
missing argument). Checks run in list order, so a later check may
assume the earlier ones passed (ranks before shapes, shapes before values).

Because ``None`` means "satisfied", a hand-written check such as ``None if v in allowed else v`` would
pass a parameter whose *value* is ``None``. Two generic rules close that hole at the root, so no
hand-written check can pass by returning the offending value:

* every parameter has a declared :class:`Param` type (``Contract(params=params("x:array k:int? ..."))``);
  the contract prepends one generic type constraint per parameter (``<op>.<param>_type``, or
  ``<op>.<param>_is_array`` for arrays) that runs before every hand-written rule, so ``None`` reaches a
  hand-written check only for a parameter declared optional (``?``);
* :meth:`Contract.first_violation` treats a ``None`` result for a parameter whose value is ``None`` and
  that is not declared optional as a violation (actual ``None``), whatever the check returned.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ._errors import InvalidArgument, InvalidDtype, Raw

__all__ = ["Args", "Constraint", "Contract", "CHIPS", "Param", "PARAM_TYPES", "params", "copy_args", "one_of"]

#: Chip families whose limits differ. ``None`` (no chip) = the union the reference accepts.
CHIPS = ("A2", "A3", "950")


_ABSENT = object()


class Args(dict):
    """A dict with attribute access, handed to constraint checks."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


@dataclass(frozen=True)
class Constraint:
    """One documented rule of an operator.

    id:      stable identifier, ``"<op>.<short_name>"``; reported in errors and test ids.
    param:   the parameter the message names.
    kind:    the word after "Invalid" ("shape", "dtype", "value", "dim", "length", ...).
    reason:  why the value is rejected, in words a user acts on.
    check:   ``check(args) -> None | actual``; ``None`` means satisfied.
    dtype:   raise :class:`~qsfa.InvalidDtype` (a ``TypeError``) instead of ``ValueError``.
    chips:   ``None`` for a rule of the operator itself; otherwise the chip families the rule is a
             hardware limit of (checked only when a backend validates for that chip).
    violate: ``violate(valid_args_dict) -> dict`` returning a copy that breaks exactly this rule;
             used by tests and invalid-argument strategies.
    source:  where the rule comes from (docs/numerics page#anchor, seed, torch_npu meta check).
    drawn:   whether invalid-argument strategies (``qsfa.strategies.invalid_args``) may draw it; False for the
             generic buffer rules whose violation does not survive copying the arguments (read-only, stride-0,
             aliased and huge broadcast views: tests/test_contracts.py and tests/test_hostile_inputs.py cover them).
    """

    id: str
    param: str
    kind: str
    reason: str
    check: Callable[[Args], Any]
    dtype: bool = False
    chips: frozenset | None = None
    violate: Callable[[dict], dict] | None = None
    source: str = ""
    drawn: bool = True

    def applies_to(self, chip: str | None) -> bool:
        return self.chips is None or (chip is not None and chip in self.chips)

    def error(self, actual):
        cls = InvalidDtype if self.dtype else InvalidArgument
        return cls(self.kind, self.param, actual, self.reason, constraint_id=self.id)


#: Declared parameter types: "array" (NumPy array / torch tensor of a numeric dtype; not a masked array),
#: "int" (Python or NumPy integer of any width whose value is in int64 range, not bool), "float" (real
#: number: int or float, not bool, that float64 holds), "float32" (a "float" the kernel takes as a float32
#: attribute: its magnitude must not round to inf in float32), "bool", "str", "any" (no type rule, only
#: "not None" unless optional).
PARAM_TYPES = ("array", "int", "float", "float32", "bool", "str", "any")

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
#: the largest magnitude that still rounds to a finite float32 (float32 max + half an ulp, exclusive)
_FLOAT32_LIMIT = float(np.finfo(np.float32).max) * (1 + 2.0 ** -25)


def array_kind_problem(v) -> str | None:
    """Why ``v`` (an ``np.ndarray``) is not an array an operator takes, or None. One rule for every operator
    (docs/architecture.md, "Declared parameter types"): a masked array is refused whatever its mask (the
    operators would read the data under the mask; pass ``.filled(x)`` or ``.data``); other ndarray subclasses
    (``np.matrix``, ``np.memmap``) are read as the base ndarray they view; the dtype must be a number: bool,
    integer, float or one of ml_dtypes' formats - structured, void, object, string, datetime and complex
    dtypes are refused by name."""
    if isinstance(v, np.ma.MaskedArray):
        return "a masked array (np.ma.MaskedArray)"
    dt = v.dtype
    if dt.kind in "biuf" and dt.fields is None:
        return None
    if dt.kind == "V" and dt.fields is None and dt.type.__module__.split(".")[0] == "ml_dtypes":
        return None
    if dt.fields is not None:
        return f"array of structured dtype {dt}"
    return f"array of dtype {dt}" + (" (void)" if dt.kind == "V" else "")


def _real_problem(v, limit: float) -> bool:
    """Whether a real number (int / float, not bool) is beyond ``limit`` in magnitude (ints too large for a
    float64 included: float() of them would raise OverflowError)."""
    if isinstance(v, (int, np.integer)):
        return abs(int(v)) > limit
    f = float(v)
    return f == f and abs(f) != float("inf") and abs(f) > limit


@dataclass(frozen=True)
class Param:
    """The declared type of one parameter; ``optional`` parameters also accept ``None``."""

    name: str
    type: str
    optional: bool = False

    def __post_init__(self):
        if self.type not in PARAM_TYPES:
            raise RuntimeError(f"parameter {self.name!r}: unknown type {self.type!r}; known: {PARAM_TYPES}")

    @property
    def reason(self) -> str:
        r = {
            "array": "must be a NumPy array (not a masked one) or torch tensor of a numeric dtype",
            "int": "must be an integer (int, not bool) in int64 range",
            "float": "must be a real number (int or float, not bool) that float64 holds",
            "float32": "must be a real number (int or float, not bool) whose magnitude float32 holds (at most "
                       "3.4028235e38; the kernel takes it as a float32 attribute)",
            "bool": "must be a bool",
            "str": "must be a string",
            "any": "is required",
        }[self.type]
        return r + (" or None" if self.optional and self.type != "any" else "")

    def offending(self, v):
        """``None`` if ``v`` has the declared type, else the actual value to report. (A parameter absent from
        the arguments - a direct ``run`` call that leaves a defaulted one out - is not checked; the public
        functions pass every parameter.)"""
        if v is None:
            return None if self.optional else Raw("None")
        t = self.type
        if t == "any":
            return None
        if t == "array":
            if not isinstance(v, np.ndarray):
                return Raw(_describe(v))
            why = array_kind_problem(v)
            return None if why is None else Raw(why)
        if t == "bool":
            ok = isinstance(v, (bool, np.bool_))
        elif t == "int":
            ok = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) \
                and _INT64_MIN <= int(v) <= _INT64_MAX
        elif t in ("float", "float32"):
            ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
                and not _real_problem(v, _FLOAT32_LIMIT if t == "float32" else float(np.finfo(np.float64).max))
        else:  # str
            ok = isinstance(v, str)
        return None if ok else Raw(_describe(v))

    def wrong_value(self):
        """A value of the wrong type (``None`` for a required parameter), for ``violate``."""
        if not self.optional:
            return None
        return {"array": "not an array", "int": "1", "float": "1.0", "float32": "1.0", "bool": "yes",
                "str": 1}[self.type]


def _describe(v) -> str:
    r = repr(v)
    if len(r) > 40:
        r = r[:37] + "..."
    return f"{r} ({type(v).__name__})"


def params(spec: str) -> dict[str, Param]:
    """Declare parameter types compactly: ``params("x:array scale:float? mode:str")`` (``?`` = optional)."""
    out = {}
    for item in spec.split():
        name, _, t = item.partition(":")
        opt = t.endswith("?")
        out[name] = Param(name, t.rstrip("?"), opt)
    return out


def _type_constraint(op: str, p: Param) -> Constraint:
    def violate(args, _p=p):
        out = copy_args(args)
        out[_p.name] = _p.wrong_value()
        return out

    suffix = "is_array" if p.type == "array" else "type"
    return Constraint(id=f"{op}.{p.name}_{suffix}", param=p.name, kind="type", reason=p.reason,
                      check=lambda a, _p=p: _p.offending(a[_p.name]) if _p.name in a else None, dtype=True,
                      violate=violate,
                      source="qsfa contract: declared parameter type")


@dataclass
class Contract:
    """The argument rules of one operator.

    op:          operator name as exposed (``"dynamic_block_quant"``).
    constraints: ordered rules; the first violated one is raised.
    example:     ``example(rng) -> dict``: a small valid argument set (NumPy), the base that
                 ``Constraint.violate`` functions break.
    inplace:     names of parameters the operator writes in place (caches); the dispatch layer and
                 the tests use it to prove that rejected calls write nothing.
    normalise:   optional ``normalise(args) -> args`` run after validation (fill defaults such as
                 ``actual_seq_lengths_*``); backends receive its result.
    params:      the declared type of every parameter (:func:`params`); one generic type constraint per
                 parameter is put in front of ``constraints`` (it replaces a hand-written one of the same
                 id and hand-written rules of kind "type" for that parameter), so hand-written checks see only values of the declared type (``None`` only where
                 the parameter is optional). Then the generic size and in-place buffer rules of
                 :mod:`qsfa._buffers` (writable, not bool, no self-overlap, no aliasing).
    """

    op: str
    constraints: list[Constraint] = field(default_factory=list)
    example: Callable[[np.random.Generator], dict] | None = None
    inplace: tuple[str, ...] = ()
    normalise: Callable[[Args], Mapping] | None = None
    params: Mapping[str, Param] = field(default_factory=dict)
    #: output buffers the caller may pass (``attention_out=``): written like in-place buffers, but with rules of
    #: their own (qsfa/ops/_out_buffers.py)
    out_buffers: tuple[str, ...] = ()

    def written(self) -> tuple[str, ...]:
        """Every parameter the operator may write: the in-place buffers and the output buffers."""
        return tuple(self.inplace) + tuple(self.out_buffers)

    def __post_init__(self):
        from ._buffers import array_rules, inplace_rules

        typed = [_type_constraint(self.op, p) for p in self.params.values() if p.type != "any" or not p.optional]
        typed += [c for p in self.params.values() if p.type == "array" for c in array_rules(self.op, p.name)]
        typed += [c for name in self.inplace for c in inplace_rules(self.op, name)]
        generated = {c.id for c in typed}
        declared = {p.name for p in self.params.values() if p.type != "any"}
        # Only a hand-written *type* rule is superseded by a generated one (same id, or any chip-independent type
        # rule of a declared parameter). Any other hand-written rule that shares a generated id would be dropped
        # silently - e.g. a "<param>_size" entry-count rule shadowed by the generic memory-size rule, which let a
        # too-long lengths tensor through - so that is refused when the contract is built.
        clash = sorted(c.id for c in self.constraints if c.id in generated and c.kind != "type")
        if clash:
            raise RuntimeError(f"contract {self.op!r}: hand-written constraint ids {clash} collide with generated "
                               "ones (qsfa/_buffers.py, qsfa/_contract.py) and would be dropped; rename them")
        self.constraints = typed + [c for c in self.constraints if c.id not in generated
                                    and not (c.kind == "type" and c.chips is None and c.param in declared)]
        ids = [c.id for c in self.constraints]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise RuntimeError(f"contract {self.op!r} has duplicate constraint ids {sorted(dup)}")

    def first_violation(self, args: Mapping, chip: str | None = None):
        """Return ``(constraint, actual)`` for the first violated rule, or ``None``."""
        a = args if isinstance(args, Args) else Args(args)
        for c, check, required in self._plan(chip):
            actual = check(a)
            if actual is None and required is not None and a.get(required, _ABSENT) is None:
                actual = Raw("None")  # a check cannot pass a required parameter by returning its None
            if actual is not None:
                return c, actual
        return None

    def _plan(self, chip: str | None) -> list:
        """``(constraint, check, required param or None)`` of the rules that apply to ``chip``, in order: built once
        per chip (and again if the list is replaced or resized), so a validation does not ask every rule whether it
        applies and whether its parameter is required (a fifth of validating a QSFA call; issue 15)."""
        key = (chip, id(self.constraints), len(self.constraints))
        plans = self.__dict__.setdefault("_plans", {})
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = [(c, c.check, c.param if self._required(c.param) else None)
                                 for c in self.constraints if c.applies_to(chip)]
        return plan

    def _required(self, name) -> bool:
        p = self.params.get(name)
        return p is not None and not p.optional

    def validate(self, args: Mapping, chip: str | None = None) -> Args:
        """Raise the first violation; return the (normalised) arguments otherwise."""
        a = args if isinstance(args, Args) else Args(args)
        hit = self.first_violation(a, chip)
        if hit is not None:
            c, actual = hit
            raise c.error(actual)
        if self.normalise is not None:
            a = Args(self.normalise(a))
        return a

    def constraint(self, cid: str) -> Constraint:
        for c in self.constraints:
            if c.id == cid:
                return c
        raise KeyError(cid)

    def ids(self, chip: str | None = None) -> list[str]:
        return [c.id for c in self.constraints if c.applies_to(chip)]


def copy_args(args: Mapping) -> dict:
    """Deep-copy an argument dict (arrays copied) so a ``violate`` function can edit freely."""
    out = {}
    for k, v in args.items():
        out[k] = v.copy() if isinstance(v, np.ndarray) else copy.deepcopy(v)
    return out


def one_of(values: Iterable) -> str:
    """Render an allowed-set for a reason string: ``one of {1, 2, 4}``."""
    vals = list(values)
    return "one of {" + ", ".join(repr(v) if isinstance(v, str) else str(v) for v in vals) + "}"
