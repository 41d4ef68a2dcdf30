"""What a user reads first: verdicts lead with PASS / FAIL, error messages render a missing argument as
None (not the string 'None'), and ``qsfa conformance --help`` offers only what ``--kind`` accepts."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa._errors import InvalidArgument, InvalidDtype, format_actual, invalid_message
from qsfa.compare import compare_bytes, compare_float


def test_compare_float_message_leads_with_the_verdict():
    g = np.linspace(-1, 1, 64, dtype=np.float32).astype(ml_dtypes.bfloat16)
    ok = compare_float(g, g)
    assert ok.passed and ok.message.startswith("PASS: ")
    bad = g.astype(np.float32).copy()
    bad[3] += 1.0
    res = compare_float(bad.astype(ml_dtypes.bfloat16), g)
    assert not res.passed and res.message.startswith("FAIL: ")
    assert compare_float(g[:3], g).message.startswith("FAIL: shape mismatch")


def test_compare_bytes_message_leads_with_the_verdict():
    a = np.arange(16, dtype=np.uint8)
    assert compare_bytes(a, a).message.startswith("PASS: ")
    b = a.copy()
    b[5] ^= 1
    assert compare_bytes(b, a).message == "FAIL: 1 of 16 elements differ; first at index [5]"
    assert compare_bytes(a[:4], a).message.startswith("FAIL: shape")


def test_a_missing_argument_reads_none_without_quotes():
    assert format_actual(None) == "None" and format_actual("None") == "None"
    assert format_actual("bogus") == "'bogus'"  # a real string argument keeps its quotes
    assert invalid_message("type", "x", "None", "must be an array") == \
        "Invalid type for x, actual: None, reason: must be an array."
    with pytest.raises((InvalidArgument, InvalidDtype)) as e:
        qsfa.dynamic_block_quant(None)
    assert "actual: None," in str(e.value) and "'None'" not in str(e.value)


def test_conformance_help_names_only_the_kinds_it_accepts():
    from qsfa.conformance import KINDS

    out = subprocess.run([sys.executable, "-m", "qsfa.cli", "conformance", "--help"], capture_output=True,
                         text=True, check=True).stdout
    flat = " ".join(out.split())
    assert "--kind {" + ",".join(KINDS) + "}" in flat
    assert "invalid inputs)" not in flat  # listed as a third kind before; it is a metamorphic property
    assert "*.invalid_rejected" in flat


def test_str_of_a_verdict_names_it_once():
    a = np.arange(4, dtype=np.uint8)
    b = a.copy()
    b[1] = 9
    text = str(compare_bytes(b, a, name="codes"))
    assert text.startswith("FAIL codes [bytes]") and text.count("FAIL") == 1


def _attention_args():
    from qsfa._dispatch import operator
    return operator("kv_quant_sparse_flash_attention").contract.example(np.random.default_rng(0))


def test_a_tensor_scalar_is_reported_as_the_tensor_the_caller_passed():
    torch = pytest.importorskip("torch")
    args = _attention_args()
    args["scale_value"] = torch.tensor(0.04)
    with pytest.raises((InvalidArgument, InvalidDtype)) as e:
        qsfa.kv_quant_sparse_flash_attention(**args)
    msg = str(e.value)
    assert "for scale_value, actual: tensor(0.0400) (Tensor)" in msg, msg
    assert "ndarray" not in msg and "array(" not in msg


def test_a_bad_chip_string_is_quoted_once():
    args = _attention_args()
    with pytest.raises(InvalidArgument) as e:
        qsfa.kv_quant_sparse_flash_attention(**args, chip="a2")
    assert "for chip, actual: 'a2', reason:" in str(e.value), str(e.value)
