"""Every constraint of every operator contract is violated once and must fire - alone and before any write.

The contracts are data (qsfa/ops/*.py); this module iterates over them, so adding a constraint without
a way to break it (``violate``) or one that never fires fails here.
"""

import numpy as np
import pytest

from qsfa._buffers import distinct_bytes
from qsfa._contract import Args
from qsfa._dispatch import operators, run
from qsfa._errors import InvalidArgument, InvalidDtype


def _cases():
    for name, op in sorted(operators().items()):
        for c in op.contract.constraints:
            yield pytest.param(name, c.id, id=c.id)


def _snapshot(args, names):
    return {n: distinct_bytes(args[n]) for n in names if args.get(n) is not None}


@pytest.mark.parametrize("op_name", sorted(operators()))
def test_example_is_valid(op_name):
    op = operators()[op_name]
    assert op.contract.example is not None, f"{op_name} has no example argument set"
    args = op.contract.example(np.random.default_rng(0))
    assert op.contract.first_violation(Args(args)) is None
    for chip in ("A2", "A3", "950"):
        hit = op.contract.first_violation(Args(op.contract.example(np.random.default_rng(0))), chip)
        # an example may exceed one chip's limits, but never a rule of the operator itself
        assert hit is None or hit[0].chips is not None


@pytest.mark.parametrize("op_name,cid", list(_cases()))
def test_constraint_fires_alone_and_first(op_name, cid):
    op = operators()[op_name]
    c = op.contract.constraint(cid)
    assert c.violate is not None, f"constraint {cid} has no violate function"
    base = op.contract.example(np.random.default_rng(0))
    bad = c.violate(base)
    chip = None if c.chips is None else sorted(c.chips)[0]
    before = _snapshot(bad, op.contract.inplace)
    with pytest.raises((InvalidArgument, InvalidDtype)) as ei:
        if chip is None:
            run(op_name, bad, backend="reference")
        else:
            op.contract.validate(bad, chip=chip)
    err = ei.value
    assert err.constraint_id == cid, f"expected {cid} to fire, got {err.constraint_id}: {err}"
    msg = str(err)
    assert msg.startswith("Invalid ") and f" for {c.param}, actual: " in msg and "reason: " in msg
    assert isinstance(err, InvalidDtype) == c.dtype
    # nothing written
    assert _snapshot(bad, op.contract.inplace) == before


@pytest.mark.parametrize("op_name", sorted(operators()))
def test_every_parameter_has_a_declared_type(op_name):
    """The generic type rules (qsfa._contract.Param) cover a parameter only if it is declared: a new
    parameter without a declaration fails here, not silently at a user's call with None."""
    contract = operators()[op_name].contract
    example = contract.example(np.random.default_rng(0))
    assert set(example) <= set(contract.params), f"{op_name}: undeclared {sorted(set(example) - set(contract.params))}"
    for c in contract.constraints:
        assert c.param in contract.params or c.param == "tensors", f"{c.id} names undeclared {c.param!r}"


@pytest.mark.parametrize("op_name", sorted(operators()))
def test_declared_optional_matches_the_public_signature(op_name):
    """A public parameter whose default is None must be declared optional ('name:type?'), else the generic type
    rule rejects the default call."""
    import importlib
    import inspect

    import qsfa

    mod, _, name = op_name.rpartition(".")
    fn = getattr(importlib.import_module(f"qsfa.{mod}") if mod else qsfa, name)
    declared = operators()[op_name].contract.params
    for p in inspect.signature(fn).parameters.values():
        if p.name in declared and p.default is None:
            assert declared[p.name].optional, f"{op_name}.{p.name} defaults to None but is declared required"
        # the converse: a parameter with a real default declared optional lets None past every hand-written check
        # (quant_sparse_flash_mla's softmax_scale=None gave an all-zero output, cmp_ratio=None a TypeError);
        # dst_type_max's None is documented (= 0, HiFloat8's 32768) and checked by its own rule
        if p.name in declared and p.default not in (None, inspect.Parameter.empty) and p.name != "dst_type_max":
            assert not declared[p.name].optional, f"{op_name}.{p.name} defaults to {p.default!r} but accepts None"


def test_a_none_value_cannot_pass_a_hand_written_check():
    """The issue-12 root cause: a check returns None for 'passed', so 'None if v in allowed else v' passed a
    parameter whose value was None. A declared type rejects it first, and a hand-written type rule of a
    declared parameter is replaced by the generic one."""
    from qsfa._contract import Constraint, Contract, params

    allowed = Constraint(id="toy.mode_value", param="mode", kind="value", reason="must be 'a' or 'b'",
                         check=lambda a: None if a.mode in ("a", "b") else a.mode)
    own_type = Constraint(id="toy.flag_is_bool", param="flag", kind="type", reason="must be a bool",
                          check=lambda a: None if isinstance(a.flag, bool) else a.flag)
    bare = Contract(op="toy", constraints=[allowed])
    assert bare.first_violation({"mode": None}) is None  # the hole, without declarations
    c = Contract(op="toy", constraints=[allowed, own_type], params=params("mode:str flag:bool n:int? x:array"))
    assert [k.id for k in c.constraints][:4] == ["toy.mode_type", "toy.flag_type", "toy.n_type", "toy.x_is_array"]
    assert "toy.flag_is_bool" not in c.ids()
    ok = {"mode": "a", "flag": True, "n": None, "x": np.zeros(2)}
    assert c.first_violation(ok) is None
    for name, bad in (("mode", None), ("flag", None), ("flag", 1), ("n", 1.5), ("n", 1 << 64), ("x", [1.0]),
                      ("x", np.zeros(2, np.complex64))):
        with pytest.raises(InvalidDtype) as ei:
            c.validate({**ok, name: bad})
        assert ei.value.param == name and str(ei.value).startswith(f"Invalid type for {name}, actual: ")
    with pytest.raises(InvalidArgument, match="Invalid value for mode"):
        c.validate({**ok, "mode": "c"})
