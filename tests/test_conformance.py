"""The conformance runner: deliberately wrong toy backends are caught (operator, property, minimal example,
a case file that reproduces the failure), reports parse as JSON / JUnit XML, the CLI's exit codes and
usage errors, determinism for a seed, sharding.

The toy backends are registered here and unregistered after each test.
"""

import json
import os
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from qsfa import strategies as qst
from qsfa._dispatch import Backend, operator, operators, register_backend, register_impl, unregister_backend
from qsfa.cli import main
from qsfa.conformance import (
    KINDS,
    catalogue,
    get,
    load_example,
    replay_case,
    run_conformance,
    run_property,
    select,
    write_report,
)
from qsfa.conformance.runner import parse_shard, shard
from qsfa.golden import Case
from qsfa.reference import formats as F

TINY = qst.Bounds(max_batch=2, max_q_tokens=3, max_kv_tokens=16, max_sparse=6, max_heads=2, max_block_size=16)
QSFA = "kv_quant_sparse_flash_attention"


def _toy(name, impls):
    class Toy(Backend):
        pass

    Toy.name = name
    Toy.array_kind = "numpy"
    Toy.description = "deliberately wrong test backend"
    register_backend(Toy())
    for op, fn in impls.items():
        register_impl(name, op, fn)
    return name


def _hif8_half_even(x, fmt, saturate=False, rounding=None):
    """formats.encode with the wrong HiFloat8 tie rule: exact midpoints go to the even code (the reference
    rounds ties away from zero, docs/numerics/formats.md#hifloat8)."""
    codes = F.encode(x, fmt, saturate=bool(saturate), rounding=rounding)
    if fmt != "hifloat8":
        return codes
    xf = np.asarray(x).astype(np.float64)
    tie = np.isin(np.abs(xf), F.midpoints("hifloat8")) & ((codes & 1) == 1)
    rep = F.representable_values("hifloat8")
    lower = rep[np.maximum(np.searchsorted(rep, np.abs(xf)) - 1, 0)]
    down = F.encode(np.where(tie, np.copysign(lower, xf), 0).astype(np.float32), "hifloat8")
    return np.where(tie, down, codes).astype(np.uint8)


@pytest.fixture
def toy_hif8():
    yield _toy("toy_hif8_even", {"formats.encode": _hif8_half_even})
    unregister_backend("toy_hif8_even")


@pytest.fixture
def toy_causal():
    ref = operator(QSFA).impls["reference"]

    def no_causal(**a):
        a["sparse_mode"] = 0  # drops the causal threshold
        return ref(**a)

    yield _toy("toy_no_causal", {QSFA: no_causal})
    unregister_backend("toy_no_causal")


@pytest.fixture
def toy_scatter():
    def wraps_minus1(cache, rows, slot_mapping):
        # the classic bug: slot -1 indexes the last row instead of being skipped
        flat = cache.reshape((-1,) + cache.shape[2:])
        flat[np.asarray(slot_mapping)] = rows
        return cache

    yield _toy("toy_scatter_wraps", {"scatter_by_slot": wraps_minus1})
    unregister_backend("toy_scatter_wraps")


# ---------------------------------------------------------------------------------------------------


def test_catalogue_is_complete_and_documented():
    props = catalogue()
    names = [p.name for p in props]
    assert len(names) == len(set(names))
    for p in props:
        assert p.kind in KINDS and len(p.doc) > 40 and p.name.startswith(p.op + ".")
        assert all(op in operators() for op in p.ops)
    for op in operators():
        assert f"{op}.vs_reference" in names and f"{op}.invalid_rejected" in names
    for name in (f"{QSFA}.rope0_matches_zero_rope64", f"{QSFA}.minus1_padding_inert", f"{QSFA}.page_permutation",
                 f"{QSFA}.uniform_scores", f"{QSFA}.lse_matches_logsumexp", "sparse_flash_attention.page_permutation",
                 "c8_cache_write.skip_slots_untouched", "kv_rmsnorm_rope_cache.skip_slots_untouched",
                 "formats.decode.encode_roundtrip", "kv_compress_epilog.token_permutation",
                 "lightning_indexer.topk_exact_scores", f"{QSFA}.split_merge"):
        assert name in names, name
    assert {p.name for p in select(ops=[QSFA])} >= {f"{QSFA}.vs_reference", f"{QSFA}.page_permutation"}
    assert all(p.name.endswith(".page_permutation") for p in select(properties=["*.page_permutation"]))
    assert {p.kind for p in select(properties=["vs_reference"])} == {"vs_reference"}


def test_wrong_hifloat8_rounding_is_caught_with_a_replayable_case(toy_hif8, tmp_path):
    r = run_property(get("formats.encode.vs_reference"), toy_hif8, cases_dir=str(tmp_path))
    assert r.status == "failed", r.message
    assert r.op == "formats.encode" and r.property == "formats.encode.vs_reference"
    assert r.falsifying_example["fmt"] == "hifloat8"
    assert r.falsifying_example["x"]["shape"][-1] <= 16  # shrunk
    assert "codes" in r.message and r.examples == r.passed + r.failed and r.failed >= 1

    case = Case.load(r.case_file)
    assert case.op == "formats.encode" and case.has_explicit_inputs and case.params["fmt"] == "hifloat8"
    got, want = case.run(toy_hif8)["codes"], case.run("reference")["codes"]
    diff = np.flatnonzero(got != want)
    assert diff.size, "the saved case does not reproduce the failure"
    # independently: each differing input is an exact HiFloat8 midpoint, and the reference (ties away
    # from zero) lands on the larger magnitude
    x = case.inputs()["x"].astype(np.float64).reshape(-1)[diff]
    assert np.isin(np.abs(x), F.midpoints("hifloat8")).all()
    ref_v = F.decode(want.reshape(-1)[diff], "hifloat8").astype(np.float64)
    toy_v = F.decode(got.reshape(-1)[diff], "hifloat8").astype(np.float64)
    assert (np.abs(ref_v) > np.abs(x)).all() and (np.abs(toy_v) < np.abs(x)).all()

    assert replay_case(r.case_file)[0] is False
    assert replay_case(r.case_file, "reference")[0] is True
    assert main(["conformance", "--replay", r.case_file]) == 1
    assert main(["conformance", "--replay", r.case_file, "--backend", "reference"]) == 0
    side = json.loads(open(r.case_file[:-5] + ".conformance.json").read())
    assert side["property"] == "formats.encode.vs_reference" and side["backend"] == toy_hif8


def test_dropped_causal_threshold_is_caught(toy_causal, tmp_path):
    small = qst.with_bounds(TINY, max_kv_tokens=12, max_batch=1)
    r = run_property(get(f"{QSFA}.vs_reference"), toy_causal, bounds=small,
                     pins={"key_dtype": "int8", "n_heads": 1, "precision": "faithful", "sparse_mode": 3,
                           "stray_entries": 1.0}, cases_dir=str(tmp_path))
    assert r.status == "failed", r.message
    assert r.op == QSFA and "attention_out" in r.message
    assert r.falsifying_example["sparse_mode"] == 3
    case = Case.load(r.case_file)
    from qsfa.compare import compare_float

    got, want = case.run(toy_causal), case.run("reference")
    assert not compare_float(got["attention_out"], want["attention_out"]).passed
    prop, ex, _ = load_example(r.case_file)
    assert prop.name == f"{QSFA}.vs_reference" and ex.args["sparse_mode"] == 3


def test_metamorphic_property_catches_a_backend_alone(toy_scatter, tmp_path):
    """No second backend needed: skip_slots_untouched on the toy alone finds the -1 wrap-around."""
    r = run_property(get("scatter_by_slot.skip_slots_untouched"), toy_scatter, cases_dir=str(tmp_path))
    assert r.status == "failed" and r.op == "scatter_by_slot", r.message
    assert replay_case(r.case_file)[0] is False and replay_case(r.case_file, "reference")[0] is True


def test_reports_parse_as_json_markdown_and_junit(toy_hif8, tmp_path):
    props = [get("formats.encode.vs_reference"), get("formats.encode.invalid_rejected"),
             get("formats.pack_fp4.vs_reference")]
    report = run_conformance(toy_hif8, props=props, cases_dir=str(tmp_path / "cases"))
    assert not report.ok
    paths = [write_report(report, str(tmp_path / f"out.{ext}")) for ext in ("json", "md", "xml")]
    data = json.loads(open(paths[0]).read())
    assert data["format"] == "qsfa-conformance/1" and data["backend"] == toy_hif8 and data["ok"] is False
    assert data["summary"] == {"properties": 3, "passed": 1, "failed": 1, "skipped": 1, "error": 0,
                               "not_applicable": 0, "examples": sum(r["examples"] for r in data["results"])}
    failed = [r for r in data["results"] if r["status"] == "failed"]
    assert failed[0]["property"] == "formats.encode.vs_reference" and os.path.exists(failed[0]["case_file"])

    root = ET.parse(paths[2]).getroot()
    suite = root.find("testsuite")
    assert suite.get("tests") == "3" and suite.get("failures") == "1" and suite.get("skipped") == "1"
    cases = {(c.get("classname"), c.get("name")): c for c in suite.findall("testcase")}
    assert cases[("formats.encode", "vs_reference")].find("failure") is not None
    assert "case file" in cases[("formats.encode", "vs_reference")].find("failure").text
    assert cases[("formats.pack_fp4", "vs_reference")].find("skipped") is not None
    assert cases[("formats.encode", "invalid_rejected")].find("failure") is None

    md = open(paths[1]).read()
    assert "| operator | property |" in md and "## Failures" in md and "formats.encode.vs_reference" in md
    with pytest.raises(ValueError, match="extension"):
        write_report(report, str(tmp_path / "out.txt"))


def test_cli_exit_status_and_usage_errors(toy_hif8, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["conformance", "--backend", toy_hif8, "--ops", "formats.encode", "--properties", "vs_reference",
                 "--cases-dir", str(tmp_path), "--report", str(out)]) == 1
    text = capsys.readouterr().out
    assert "FAIL" in text and "formats.encode" in text and "vs_reference" in text
    assert json.loads(out.read_text())["summary"]["failed"] == 1
    assert main(["conformance", "--ops", "formats.pack_fp4", "-q", "--max-examples", "5",
                 "--cases-dir", str(tmp_path)]) == 0
    assert "3 passed, 0 failed" in capsys.readouterr().out
    assert main(["conformance", "--list", "--ops", QSFA]) == 0
    assert f"{QSFA}.page_permutation" in capsys.readouterr().out
    for bad in (["--shard", "3/3"], ["--shard", "x"], ["--ops", "nope"], ["--report", "x.txt"],
                ["--max-examples", "0"], ["--properties", "no_such_property"], ["--bound", "max_heads=x"],
                ["--bound", "nope=3"], ["--backend", "no_such_backend"], ["--replay", str(tmp_path / "none.json")]):
        assert main(["conformance", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith("qsfa conformance: error: ") and err.count("\n") == 1, err


def test_runs_are_deterministic(toy_hif8, tmp_path):
    prop = get("formats.encode.vs_reference")
    runs = [run_property(prop, toy_hif8, seed=7, max_examples=100, cases_dir=str(tmp_path / str(i))) for i in range(2)]
    assert runs[0].status == "failed"
    assert runs[0].falsifying_example == runs[1].falsifying_example
    assert (runs[0].examples, runs[0].passed) == (runs[1].examples, runs[1].passed)
    xs = [Case.load(r.case_file).inputs()["x"] for r in runs]
    assert xs[0].tobytes() == xs[1].tobytes()
    # the ci profile without a seed is derandomised: the same examples again
    a, b = (run_property(get("formats.pack_fp4.unpack_roundtrip"), "reference", profile="ci") for _ in range(2))
    assert a.status == b.status == "passed" and a.examples == b.examples


def test_shards_partition_the_selection():
    props = catalogue()
    for n in (1, 2, 5):
        parts = [shard(props, i, n) for i in range(n)]
        names = [p.name for part in parts for p in part]
        assert sorted(names) == sorted(p.name for p in props) and len(names) == len(set(names))
    assert parse_shard("2/8") == (2, 8) and parse_shard("0/1") == (0, 1)
    for bad in ("3/3", "4/3", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
    report = run_conformance("reference", props=select(ops=["formats.unpack_fp4"]), shard_spec="1/2", cases_dir=None)
    assert report.shard == "1/2" and len(report.results) == 1


def test_case_with_parameters_json_cannot_hold(tmp_path):
    """An invalid-argument example with x_scale = inf: the case file cannot hold inf, the sidecar does."""
    from qsfa.conformance.properties import Example
    from qsfa.conformance.runner import save_case

    contract = operator("kv_compress_epilog").contract
    c = contract.constraint("kv_compress_epilog.x_scale_value")
    args = c.violate(contract.example(np.random.default_rng(0)))
    prop = get("kv_compress_epilog.invalid_rejected")
    path = save_case(prop, "reference", Example(args, 0, c), "test", str(tmp_path))
    prop2, ex, side = load_example(path)
    assert side["params_not_in_case"] == {"x_scale": {"float": "inf"}} and ex.args["x_scale"] == float("inf")
    assert ex.constraint.id == c.id
    assert replay_case(path) == (True, "kv_compress_epilog.invalid_rejected holds on 'reference'")


def test_a_backend_that_writes_into_its_inputs_is_caught(tmp_path):
    def clobbers_x(x, fmt, saturate=False, rounding=None):
        codes = F.encode(x, fmt, saturate=bool(saturate), rounding=rounding)
        x[...] = 0  # scratch use of an input buffer
        return codes

    name = _toy("toy_clobber", {"formats.encode": clobbers_x})
    try:
        r = run_property(get("formats.encode.vs_reference"), name, cases_dir=str(tmp_path))
    finally:
        unregister_backend(name)
    assert r.status == "failed" and "wrote into input(s) ['x']" in r.message
