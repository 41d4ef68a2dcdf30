"""The conformance command line around a run: corrupt case files given to --replay are bad usage (exit 2,
one line), not a reproduced failure (exit 1); the console and reports tell what a reader needs to act."""

import json

import numpy as np
import pytest

from qsfa._dispatch import Backend, register_backend, register_impl, unregister_backend
from qsfa.cli import main
from qsfa.conformance import get, run_property
from qsfa.reference import formats as F


def _one_line_usage_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("qsfa conformance: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


def test_replay_of_a_corrupt_case_file_is_bad_usage(tmp_path, capsys):
    no_fields = tmp_path / "bad.json"
    no_fields.write_text('{"format":"qsfa-case/1"}')
    _one_line_usage_error(capsys, ["conformance", "--replay", str(no_fields)], str(no_fields), "name")
    not_json = tmp_path / "notjson.json"
    not_json.write_text("hello")
    _one_line_usage_error(capsys, ["conformance", "--replay", str(not_json)], str(not_json), "JSON")
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros(3, np.float32))
    _one_line_usage_error(capsys, ["conformance", "--replay", str(npy)], str(npy))


class _Wrong(Backend):
    name = "toy_wrong_encode"
    array_kind = "numpy"
    description = "deliberately wrong test backend"


@pytest.fixture
def wrong():
    register_backend(_Wrong())
    register_impl(_Wrong.name, "formats.encode",
                  lambda x, fmt, saturate=False, rounding=None: F.encode(x, fmt, saturate=bool(saturate),
                                                                         rounding=rounding) ^ np.uint8(1))
    yield _Wrong.name
    unregister_backend(_Wrong.name)


def test_replay_with_a_broken_sidecar_is_bad_usage(wrong, tmp_path, capsys):
    r = run_property(get("formats.encode.vs_reference"), wrong, max_examples=5, cases_dir=str(tmp_path))
    assert r.status == "failed" and r.case_file
    side = tmp_path / (r.case_file.rsplit("/", 1)[1][:-5] + ".conformance.json")
    side.write_text(json.dumps({"format": "x"}))
    _one_line_usage_error(capsys, ["conformance", "--replay", r.case_file], "property")
    side.unlink()
    _one_line_usage_error(capsys, ["conformance", "--replay", r.case_file], "sidecar")


def test_console_warns_when_the_case_file_cannot_be_saved(wrong, capsys):
    assert main(["conformance", "--backend", wrong, "--properties", "formats.encode.vs_reference",
                 "--max-examples", "5", "--cases-dir", "/proc/qsfa-no-such/cases"]) == 1
    out = capsys.readouterr().out
    warn = [s for s in out.splitlines() if "WARNING" in s]
    assert warn and "could not save the case file" in warn[0] and "Error" in warn[0], out
    assert "case file: " not in out.replace("could not save the case file:", "")


def test_progress_line_keeps_the_save_warning_after_a_long_message():
    from qsfa.conformance.reports import format_progress
    from qsfa.conformance.runner import PropertyResult

    msg = "\n".join(f"line {i}" for i in range(20)) + "\n(could not save the case file: OSError: disk full)"
    text = format_progress(1, 1, PropertyResult("p.q", ["p"], "vs_reference", "b", "failed", message=msg))
    assert text.splitlines()[-1] == "        WARNING: could not save the case file: OSError: disk full"
    assert "line 5" in text and "line 6" not in text


def test_markdown_header_states_the_edge_examples_on_top_of_max_examples(tmp_path):
    from qsfa._edges import EDGES
    from qsfa.conformance import run_conformance
    from qsfa.conformance.reports import to_markdown

    rep = run_conformance("reference", properties=["formats.encode.vs_reference"], max_examples=3,
                          cases_dir=str(tmp_path))
    (r,) = rep.results
    assert r.status == "passed" and 1 <= r.edge_examples <= len(EDGES["formats.encode"])
    assert r.examples == 3 + r.edge_examples  # what the table shows: both, counted together
    header = to_markdown(rep).splitlines()[2]
    assert f"max_examples 3 per property (+ {r.edge_examples} edge examples" in header, header
