"""Reading a saved falsifying example back (``qsfa conformance --replay``, :func:`~qsfa.conformance.load_example`).

A case file and its ``.conformance.json`` sidecar are checked before anything runs, so that a file that does not
describe a call of the property's operator is reported as bad input (GoldenInputError: ``qsfa conformance``
prints one line and exits 2) and never as a failure of the backend:

* the sidecar: a JSON object (read as :func:`qsfa.golden.guard.load_json` reads any file that may be hostile)
  with a known ``property``, its ``format``, a ``backend`` name, a ``chip`` that is null or a chip, a ``seed``
  that is null or a non-negative integer, a ``check_seed`` in [0, 2**32), the ``constraint`` (an id of the
  operator's contract for an invalid-argument property, null otherwise) and ``params_not_in_case`` (an object
  of restorable values); ``ops`` / ``kind``, where given, those of the property;
* the case: its ``op`` is the property's operator; every parameter, input and restored parameter is a parameter
  of the operator's public function (no name twice), and the required ones are all there;
* the operator's argument contract, as the reference applies it for the sidecar's chip: the arguments pass it
  (an invalid-argument example: its first violated rule is the sidecar's ``constraint``).

Errors name the file, the field, the value and the reason (``<file>: Invalid <kind> for <field>, actual: ...,
reason: ....``).
"""

from __future__ import annotations

import os

__all__ = ["load_example"]

#: the check seeds a property draws (``properties._examples``: ``st.integers(0, 2**32 - 1)``)
CHECK_SEED_LIMIT = 2 ** 32


def _sidecar_path(path: str) -> str:
    return path[:-5] + ".conformance.json" if path.endswith(".json") else path + ".conformance.json"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _read_sidecar(path: str, side_path: str) -> dict:
    from ..golden.guard import load_json
    from ..golden.io import GoldenInputError

    if not os.path.lexists(side_path):
        raise GoldenInputError(f"{side_path}: cannot read the conformance sidecar of {path} (no such file)")
    side = load_json(side_path)
    if not isinstance(side, dict):
        raise GoldenInputError(f"{side_path}: the conformance sidecar of {path} must be a JSON object, "
                               f"not {type(side).__name__}")
    return side


def _check_sidecar(side: dict, side_path: str):
    """The property of a sidecar whose fields are checked (see the module docstring)."""
    from ..chips import CHIPS
    from ..golden.guard import field_error
    from .properties import get
    from .runner import SIDE_FORMAT

    def bad(field, reason):
        return field_error(side_path, field, side.get(field), reason, kind="sidecar field")

    name = side.get("property")
    if not isinstance(name, str):
        raise bad("property", "must be the name of a conformance property (a string)")
    try:
        prop = get(name)
    except KeyError:
        raise bad("property", "no such property in this build of qsfa (qsfa conformance --list)") from None
    if side.get("format") != SIDE_FORMAT:
        raise bad("format", f"must be {SIDE_FORMAT!r}")
    if not isinstance(side.get("backend"), str) or not side["backend"]:
        raise bad("backend", "must be the name of the backend the case failed on (a non-empty string)")
    if side.get("chip") is not None and side["chip"] not in CHIPS:
        raise bad("chip", f"must be null or one of {', '.join(CHIPS)}")
    if side.get("seed") is not None and not (_is_int(side["seed"]) and side["seed"] >= 0):
        raise bad("seed", "must be null or a non-negative integer (the run's --seed)")
    if "check_seed" in side and not (_is_int(side["check_seed"]) and 0 <= side["check_seed"] < CHECK_SEED_LIMIT):
        raise bad("check_seed", f"must be an integer from 0 to {CHECK_SEED_LIMIT - 1}")
    if "ops" in side and side["ops"] != list(prop.ops):
        raise bad("ops", f"property {prop.name} calls {list(prop.ops)}")
    if "kind" in side and side["kind"] != prop.kind:
        raise bad("kind", f"property {prop.name} is of kind {prop.kind!r}")
    if not isinstance(side.get("params_not_in_case", {}), dict):
        raise bad("params_not_in_case", "must be a JSON object (parameter name -> value)")
    return prop


def _restore(v, side_path: str, name: str):
    """A parameter value of ``params_not_in_case`` (a non-finite float is saved as ``{"float": "inf"}``)."""
    from ..golden.guard import field_error

    def bad(reason):
        return field_error(side_path, f"params_not_in_case.{name}", v, reason, kind="sidecar field")

    if isinstance(v, dict) and set(v) == {"float"}:
        try:
            return float(v["float"])
        except (TypeError, ValueError):
            raise bad("the value of 'float' must be a float's repr ('inf', '-inf', 'nan', ...)") from None
    if isinstance(v, dict) and set(v) == {"repr"}:
        raise bad("the run could only save this value's repr: it cannot be restored")
    if isinstance(v, dict):
        raise bad("must be a JSON scalar, a list or {\"float\": ...}")
    return v


def _check_call(prop, case, args: dict, origin: dict, side: dict, path: str, side_path: str) -> None:
    """The arguments name the operator's parameters and pass (or, invalid-argument properties, break first the
    sidecar's constraint of) its contract on the reference for the sidecar's chip."""
    from .._contract import Args
    from .._dispatch import operator
    from .._errors import InvalidArgument, InvalidDtype
    from ..golden.case import resolve_op
    from ..golden.guard import field_error

    def where(name):  # the file and field that hold argument ``name``
        return origin.get(name, (path, f"params.{name}"))

    if case.op != prop.op:
        raise field_error(path, "op", case.op, f"the sidecar's property {prop.name} calls {prop.op}", "case field")
    spec = resolve_op(prop.op)
    names = spec.params - {"chip"}  # the chip a conformance case models is the sidecar's, passed to every call
    for name in args:
        if name == "chip":
            file, field = where(name)
            raise field_error(file, field, args[name], "the chip a conformance case models is the sidecar's 'chip' "
                              "(every call of the property gets it), not a parameter of the case", "case field")
        if name not in names:
            file, field = where(name)
            raise field_error(file, field, args[name], f"{prop.op} has no parameter {name!r} (its parameters: "
                              f"{', '.join(sorted(names))})", "case field")
    missing = sorted(spec.required - set(args))
    if missing:
        raise field_error(path, "params", sorted(case.params), f"{prop.op} needs {', '.join(missing)} (a parameter "
                          "or an input)", "case field")
    contract, chip = operator(prop.op).contract, side.get("chip")
    invalid = prop.family == "invalid_rejected"
    cid = side.get("constraint")
    if not invalid:
        if cid is not None:
            raise field_error(side_path, "constraint", cid, f"{prop.name} is not an invalid-argument property "
                              "(must be null)", "sidecar field")
        try:
            contract.validate(Args(args), chip=chip)
        except (InvalidArgument, InvalidDtype) as e:
            file, field = where(e.param)
            raise field_error(file, field, e.actual, f"the reference rejects it{f' on {chip}' if chip else ''} "
                              f"({e.constraint_id}): {e.reason.rstrip('.')}", "case field") from None
        return
    if not isinstance(cid, str) or cid not in {c.id for c in contract.constraints}:
        raise field_error(side_path, "constraint", cid, f"must be the id of one of {prop.op}'s constraints (the "
                          "one the arguments break)", "sidecar field")
    hit = contract.first_violation(Args(args), chip)
    on = f" on {chip}" if chip else ""
    if hit is None:
        raise field_error(side_path, "constraint", cid, f"the reference accepts the case's arguments{on}, so they "
                          f"are no example of it (a case file holds C-contiguous arrays that share no memory: a rule "
                          "on strides, overlap or aliasing cannot be replayed from one)", "sidecar field")
    if hit[0].id != cid:
        raise field_error(side_path, "constraint", cid, f"the reference rejects the case's arguments{on} with "
                          f"{hit[0].id} first, so they are no example of it", "sidecar field")


def load_example(path: str):
    """``(property, Example, sidecar)`` of a saved falsifying example, checked (see the module docstring)."""
    from .._dispatch import operator
    from ..golden.case import Case
    from ..golden.guard import field_error
    from .properties import Example

    case = Case.load(path)
    side_path = _sidecar_path(path)
    side = _read_sidecar(path, side_path)
    prop = _check_sidecar(side, side_path)
    args, origin = {}, {}  # origin: argument -> (file, field) that holds it
    for file, prefix, items in ((path, "params", case.params), (path, "inputs", case.inputs()),
                                (side_path, "params_not_in_case", side.get("params_not_in_case", {}))):
        for k, v in items.items():
            if k in args:
                raise field_error(file, f"{prefix}.{k}", v, f"{k!r} is given twice (also as {origin[k][1]} of "
                                  f"{origin[k][0]})", "case field")
            args[k] = _restore(v, side_path, k) if file == side_path else v
            origin[k] = (file, f"{prefix}.{k}")
    _check_call(prop, case, args, origin, side, path, side_path)
    cid = side.get("constraint")
    c = operator(prop.op).contract.constraint(cid) if cid is not None else None
    return prop, Example(args, int(side.get("check_seed", 0)), c), side
