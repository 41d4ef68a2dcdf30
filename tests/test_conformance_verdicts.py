"""Verdicts of a conformance run (docs/conformance.md#verdicts): a backend that raises is an ERROR - its own
status, exit status 3, counted apart in the reports, the mutation campaign and pytest - never a FAIL; a property
the chip cannot run is N/A before anything is drawn (qsfa.strategies.chips), listed in every report.

The toy backends are registered here and unregistered after each test.
"""

import json
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from qsfa._dispatch import Backend, register_backend, register_impl, unregister_backend
from qsfa.cli import main
from qsfa.conformance import get, replay_case, run_conformance, run_property, write_report
from qsfa.reference import formats as F

pytest_plugins = ["pytester"]

ENC = "formats.encode"
QSFA = "kv_quant_sparse_flash_attention"


def _toy(name, impls):
    class Toy(Backend):
        pass

    Toy.name, Toy.array_kind, Toy.description = name, "numpy", "test backend"
    register_backend(Toy())
    for op, fn in impls.items():
        register_impl(name, op, fn)
    return name


def _raising_encode(x, fmt, saturate=False, rounding=None):
    if fmt == "hifloat8":
        raise RuntimeError("kernel launch failed")
    return F.encode(x, fmt, saturate=bool(saturate), rounding=rounding)


def _wrong_encode(x, fmt, saturate=False, rounding=None):
    codes = F.encode(x, fmt, saturate=bool(saturate), rounding=rounding)
    return codes ^ np.uint8(1) if fmt == "int8" else codes


@pytest.fixture
def raiser():
    name = _toy("toy_raiser", {ENC: _raising_encode, "formats.decode": lambda codes, fmt: F.decode(codes, fmt)})
    yield name
    unregister_backend(name)


@pytest.fixture
def wrong():
    name = _toy("toy_wrong", {ENC: _wrong_encode})
    yield name
    unregister_backend(name)


def test_a_backend_that_raises_is_an_error_not_a_failure(raiser, tmp_path):
    r = run_property(get(f"{ENC}.vs_reference"), raiser, cases_dir=str(tmp_path), max_examples=3)
    assert r.status == "error", (r.status, r.message)
    assert "raised RuntimeError in formats.encode: kernel launch failed" in r.message
    # the calls that raised are errors, not failed examples (the table showed every example as failed)
    assert r.errors >= 1 and r.failed == 0 and r.examples == r.passed + r.errors
    assert r.falsifying_example["fmt"] == "hifloat8" and r.case_file  # shrunk and saved like a failure
    holds, msg = replay_case(r.case_file)
    assert holds is None and "ERROR" in msg
    assert replay_case(r.case_file, "reference")[0] is True
    assert main(["conformance", "--replay", r.case_file]) == 3
    assert main(["conformance", "--backend", "reference", "--replay", r.case_file]) == 0


def test_error_exit_status_and_reports(raiser, wrong, tmp_path, capsys):
    out = [str(tmp_path / f"r.{e}") for e in ("json", "md", "xml")]
    args = ["--ops", ENC, "--properties", "vs_reference", "--cases-dir", str(tmp_path / "c"), "-q", "--max-examples", "3"]
    assert main(["conformance", "--backend", raiser, *args, "--report", *out]) == 3
    table = capsys.readouterr().out
    assert "ERROR" in table
    head = next(ln for ln in table.splitlines() if ln.startswith("operator"))
    row = next(ln for ln in table.splitlines() if ln.rstrip().endswith("ERROR"))
    cols = dict(zip(head.split(), row.split()))  # one row: it names its operator
    assert head.split()[5:7] == ["failed", "errors"] and cols["failed"] == "0" and int(cols["errors"]) >= 1, table
    data = json.loads(open(out[0]).read())
    assert data["summary"]["error"] == 1 and data["summary"]["failed"] == 0 and data["ok"] is False
    assert "## Failures" in open(out[1]).read() and "(ERROR)" in open(out[1]).read()
    suite = ET.parse(out[2]).getroot().find("testsuite")
    assert suite.get("errors") == "1" and suite.get("failures") == "0"
    assert suite.find("testcase").find("error") is not None and suite.find("testcase").find("failure") is None
    # a failure outranks an error: exit 1 (a found bug) whatever else ended in an ERROR
    assert main(["conformance", "--backend", wrong, *args]) == 1
    report = run_conformance(raiser, props=[get(f"{ENC}.vs_reference"), get("formats.decode.vs_reference")],
                             cases_dir=str(tmp_path / "c2"), max_examples=5)
    assert [r.status for r in report.results] == ["error", "passed"] and report.exit_status == 3


def test_campaign_counts_a_raising_mutant_apart(tmp_path):
    from qsfa.conformance.campaign import CampaignReport, run_mutant
    from qsfa.conformance.mutants import Mutant

    def make(ref):
        def impl(**kw):
            if kw["fmt"] == "hifloat8":
                raise RuntimeError("aclnn error 561000")
            return ref(**kw)

        return impl

    r = run_mutant(Mutant("test.raises", "formats.encode", "raises on HiFloat8", make), cases_dir=str(tmp_path),
                   max_examples=3)
    assert r.status == "raised" and r.killed_by is None and "RuntimeError" in r.message
    rep = CampaignReport("ci", None, None, "now", results=[r])
    assert rep.summary["raised"] == 1 and rep.summary["killed"] == 0


def test_pytest_reports_an_error_not_a_failure(pytester, raiser):
    pytester.makepyfile(f"""
        from qsfa.conformance import get, run_property
        from qsfa.conformance.pytest_plugin import check_result

        def test_raises():
            check_result(run_property(get("{ENC}.vs_reference"), "{raiser}", max_examples=5))

        def test_passes():
            check_result(run_property(get("formats.decode.vs_reference"), "{raiser}", max_examples=5))
    """)
    res = pytester.runpytest_inprocess("-p", "qsfa.conformance.pytest_plugin", "-q", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=1, errors=1)


def test_not_applicable_on_the_chip_is_listed_before_drawing(tmp_path):
    props = [get(f"{QSFA}.lse_matches_logsumexp"), get("kv_compress_epilog.vs_reference")]
    for chip, na in (("950", [True, False]), ("A2", [False, True])):
        report = run_conformance("reference", props=props, chip=chip, max_examples=2, cases_dir=str(tmp_path))
        assert [r.not_applicable for r in report.results] == na
        for r in report.results:
            if r.not_applicable:
                assert r.status == "skipped" and r.examples == 0 and r.edge_examples == 0
                assert r.message.startswith(f"not applicable on {chip}: ")
            else:
                assert r.status == "passed", r.message
        assert report.summary["not_applicable"] == 1 and report.exit_status == 0
        paths = [write_report(report, str(tmp_path / f"{chip}.{e}")) for e in ("json", "md", "xml")]
        assert json.loads(open(paths[0]).read())["summary"]["not_applicable"] == 1
        assert f"not applicable on {chip}" in open(paths[1]).read()
        skipped = [c.find("skipped") for c in ET.parse(paths[2]).getroot().iter("testcase")]
        assert [s is not None and s.get("message").startswith(f"not applicable on {chip}") for s in skipped] == na
