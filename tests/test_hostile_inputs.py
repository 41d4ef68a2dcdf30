"""Hostile inputs to every public operator are refused by name before anything is written (issue 12).

The cases come from :mod:`hostile_cases`, generated from each contract's example and declared parameter types
(None, wrong type, wrong dtype, wrong rank, NaN / Inf, empty, read-only, stride-0, aliased, huge declared size,
torch sparse / ``expand()``-ed tensors, masked / matrix / structured arrays, huge floats, unsigned NumPy integers,
requires_grad buffers; output buffers such as attention_out= with a valid buffer built for each case), so a new
parameter is covered without new code here. Every call runs in
process on the reference backend; every array argument's memory is compared byte for byte before and after.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostile_cases as hc  # noqa: E402

_TABLE = hc.operator_table()
_CASES = hc.all_cases(with_torch=importlib.util.find_spec("torch") is not None)

#: kinds that break one parameter's relation to another (a shape, a size, a partner given together); the rule that
#: fires may name the partner
RELATIONAL = ("empty", "rank_plus_4", "huge", "numpy_uint8", "none_optional")


@pytest.mark.parametrize("case", _CASES, ids=[c.id for c in _CASES])
def test_hostile_input(case):
    cls, detail = hc.run_case(case, _TABLE)
    assert cls not in ("silent", "foreign"), f"{case.id} ({case.expect}): {cls}: {detail}"
    if case.expect == "must_reject":
        allowed = ("clear", "related") if case.kind in RELATIONAL else ("clear",)
        assert cls in allowed, f"{case.id}: must be refused naming {case.param!r}; got {cls}: {detail}"
    elif case.expect == "must_accept":
        assert cls == "accepted", f"{case.id}: a valid call was refused: {detail}"
    else:
        allowed = ("clear", "related", "accepted") if case.kind in RELATIONAL else ("clear", "accepted")
        assert cls in allowed, f"{case.id}: {cls}: {detail}"


def test_every_operator_and_parameter_is_attacked():
    """Every operator and every parameter of its example has cases; every array parameter a None / wrong-type /
    huge-size case (a parameter that yields none would make this module vacuous for it)."""
    seen = {(c.op, c.param) for c in _CASES}
    for op, (example, inplace, types) in _TABLE.items():
        args = example(__import__("numpy").random.default_rng(0))
        for p in args:
            assert (op, p) in seen, f"{op}.{p} has no hostile case"
        for p in inplace:
            kinds = {c.kind for c in _CASES if c.op == op and c.param == p}
            assert {"readonly", "dtype_bool", "huge_view"} <= kinds, f"{op}.{p}: {sorted(kinds)}"
    from qsfa._dispatch import operators

    for op, o in operators().items():  # output buffers (attention_out=): attacked as in-place buffers, and accepted
        for p in (b for b in o.contract.out_buffers if b in o.outputs):
            kinds = {c.kind for c in _CASES if c.op == op and c.param == p}
            assert {"readonly", "stride0", "aliased", "dtype_bool", "huge_view", "valid"} <= kinds, \
                f"{op}.{p}: {sorted(kinds)}"


def test_tensor_buffer_rules_read_the_tensor_itself():
    """Device tensors reach validation as host copies, which lose an expand()-ed layout and aliasing: the
    dispatch layer reads both from the tensor's strides and storage (checked here on CPU tensors)."""
    torch = pytest.importorskip("torch")
    from qsfa._buffers import tensor_layout_overlaps, tensors_may_share

    base = torch.zeros(4, 8, dtype=torch.int8)
    assert not any(tensor_layout_overlaps(t) for t in (base, base[:, ::2], base.t()))
    assert tensor_layout_overlaps(base[:1].expand(4, 8))
    assert tensor_layout_overlaps(torch.zeros(16, dtype=torch.int8).as_strided((4, 4), (2, 1)))
    assert tensors_may_share(base[1:3], base[2:])
    assert not tensors_may_share(base[:2], base[2:])
    assert not tensors_may_share(base, torch.zeros(4, 8, dtype=torch.int8))
