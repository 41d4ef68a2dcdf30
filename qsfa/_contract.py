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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ._errors import InvalidArgument, InvalidDtype

__all__ = ["Args", "Constraint", "Contract", "CHIPS", "copy_args", "one_of"]

#: Chip families whose limits differ. ``None`` (no chip) = the union the reference accepts.
CHIPS = ("A2", "A3", "950")


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

    def applies_to(self, chip: str | None) -> bool:
        return self.chips is None or (chip is not None and chip in self.chips)

    def error(self, actual):
        cls = InvalidDtype if self.dtype else InvalidArgument
        return cls(self.kind, self.param, actual, self.reason, constraint_id=self.id)


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
    """

    op: str
    constraints: list[Constraint] = field(default_factory=list)
    example: Callable[[np.random.Generator], dict] | None = None
    inplace: tuple[str, ...] = ()
    normalise: Callable[[Args], Mapping] | None = None

    def __post_init__(self):
        ids = [c.id for c in self.constraints]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise RuntimeError(f"contract {self.op!r} has duplicate constraint ids {sorted(dup)}")

    def first_violation(self, args: Mapping, chip: str | None = None):
        """Return ``(constraint, actual)`` for the first violated rule, or ``None``."""
        a = args if isinstance(args, Args) else Args(args)
        for c in self.constraints:
            if not c.applies_to(chip):
                continue
            actual = c.check(a)
            if actual is not None:
                return c, actual
        return None

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
