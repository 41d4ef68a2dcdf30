"""The lengths tensors' entry-count rules fire (issue 25/26/27 follow-up).

Their ids once ended in ``_size`` like the generated memory-size rule of every array parameter
(qsfa/_buffers.py), so the contract dropped them: a too-long ``actual_seq_lengths_key`` passed and a too-short
``actual_seq_lengths_query`` crashed the reference with an IndexError. The Contract now refuses such collisions.
"""

import numpy as np
import pytest

from qsfa._contract import Constraint, Contract, params
from qsfa._dispatch import operators, run
from qsfa._errors import InvalidArgument

OPS = {"lightning_indexer": "actual_seq_lengths_key", "quant_lightning_indexer": "actual_seq_lengths_key",
       "sparse_flash_attention": "actual_seq_lengths_kv", "kv_quant_sparse_flash_attention": "actual_seq_lengths_kv"}


def _example(op):
    a = operators()[op].contract.example(np.random.default_rng(0))
    b, s = a["query"].shape[:2]
    a["actual_seq_lengths_query"] = np.full((b,), s, np.int32)
    a[OPS[op]] = np.full((b,), a["key"].shape[1], np.int32)
    return a


@pytest.mark.parametrize("op", sorted(OPS))
def test_explicit_lengths_are_valid(op):
    run(op, _example(op), backend="reference")


@pytest.mark.parametrize("op", sorted(OPS))
def test_too_long_kv_lengths_refused(op):
    a = _example(op)
    a[OPS[op]] = np.append(a[OPS[op]], a[OPS[op]][:1])
    with pytest.raises(InvalidArgument) as ei:
        run(op, a, backend="reference")
    assert ei.value.constraint_id == f"{op}.{OPS[op]}_entries"
    assert f"for {OPS[op]}, actual: " in str(ei.value)


@pytest.mark.parametrize("op", sorted(OPS))
def test_too_short_query_lengths_refused(op):
    a = _example(op)
    a["actual_seq_lengths_query"] = a["actual_seq_lengths_query"][:-1]
    with pytest.raises(InvalidArgument) as ei:
        run(op, a, backend="reference")
    assert ei.value.constraint_id == f"{op}.actual_seq_lengths_query_entries"


def test_contract_refuses_a_rule_shadowed_by_a_generated_one():
    rule = Constraint(id="toy.x_size", param="x", kind="shape", reason="must have 2 entries",
                      check=lambda a: None if a["x"].size == 2 else a["x"].size)
    with pytest.raises(RuntimeError, match=r"toy\.x_size"):
        Contract(op="toy", constraints=[rule], params=params("x:array"))


def test_contract_refuses_duplicate_hand_written_ids():
    rule = Constraint(id="toy.x_two", param="x", kind="shape", reason="must have 2 entries",
                      check=lambda a: None if a["x"].size == 2 else a["x"].size)
    with pytest.raises(RuntimeError, match="duplicate"):
        Contract(op="toy", constraints=[rule, rule], params=params("x:array"))
