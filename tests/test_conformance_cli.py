"""The conformance command line around a run: corrupt case files given to --replay are bad usage (exit 2,
one line), not a reproduced failure (exit 1); the console and reports tell what a reader needs to act; case
files are written only inside --cases-dir, never through a symbolic link planted there."""

import json
import os

import numpy as np
import pytest

from qsfa._dispatch import Backend, register_backend, register_impl, unregister_backend
from qsfa.cli import main
from qsfa.conformance import get, replay_case, run_property
from qsfa.conformance.runner import CASE_SAVE_ERROR
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


# --- case files are written inside --cases-dir only (never through a symbolic link) -------------------------

_STEM = "toy_wrong_encode.formats.encode.vs_reference"


def _fail_into(backend, cases_dir):
    return run_property(get("formats.encode.vs_reference"), backend, max_examples=5, cases_dir=str(cases_dir))


@pytest.mark.parametrize("planted", [".json", ".x.npy", ".conformance.json"])
def test_a_symlink_in_place_of_a_case_file_is_refused_not_written_through(wrong, tmp_path, planted):
    cases, victim = tmp_path / "cases", tmp_path / "victim"
    cases.mkdir()
    victim.write_text("VICTIM\n")
    (cases / (_STEM + planted)).symlink_to(victim)
    r = _fail_into(wrong, cases)
    assert r.status == "failed" and r.case_file is None
    assert f"{CASE_SAVE_ERROR} GoldenInputError: refusing to write" in r.message, r.message
    assert "symbolic link" in r.message and _STEM + planted in r.message
    assert victim.read_text() == "VICTIM\n"
    # refused before the first file was written: only the planted link is there
    assert sorted(p.name for p in cases.iterdir()) == [_STEM + planted]


def test_a_dangling_symlink_in_place_of_the_case_file_creates_nothing_outside(wrong, tmp_path):
    cases, target = tmp_path / "cases", tmp_path / "outside" / "made.json"
    cases.mkdir()
    (tmp_path / "outside").mkdir()
    (cases / (_STEM + ".json")).symlink_to(target)
    r = _fail_into(wrong, cases)
    assert r.case_file is None and "refusing to write" in r.message
    assert not os.path.lexists(target) and os.listdir(tmp_path / "outside") == []


def test_an_older_case_file_is_replaced_not_rewritten_in_place(wrong, tmp_path):
    """A hard link to a file outside (or a file another process holds open) keeps its bytes: the new case
    is a new file renamed over the old name."""
    cases, outside = tmp_path / "cases", tmp_path / "outside.npy"
    cases.mkdir()
    outside.write_bytes(b"OUTSIDE")
    os.link(outside, cases / (_STEM + ".x.npy"))
    (cases / (_STEM + ".json")).write_text("old")
    r = _fail_into(wrong, cases)
    assert r.case_file == str(cases / (_STEM + ".json")), r.message
    assert outside.read_bytes() == b"OUTSIDE"
    assert json.loads((cases / (_STEM + ".json")).read_text())["format"] == "qsfa-case/1"
    assert np.load(cases / (_STEM + ".x.npy")).size >= 1
    assert not [p for p in os.listdir(cases) if p.endswith(".partial")]  # no temporary file left behind
    holds, msg = replay_case(r.case_file)
    assert not holds and "differs from the reference" in msg


def test_cli_run_with_planted_symlinks_leaves_the_targets_alone(wrong, tmp_path, capsys):
    cases, victim = tmp_path / "c", tmp_path / "victim"
    cases.mkdir()
    victim.write_text("VICTIM\n")
    for suffix in (".json", ".x.npy"):
        (cases / (_STEM + suffix)).symlink_to(victim)
    assert main(["conformance", "--backend", wrong, "--properties", "formats.encode.vs_reference",
                 "--max-examples", "5", "--cases-dir", str(cases), "-q"]) == 1
    assert victim.read_text() == "VICTIM\n"
    assert sorted(p.name for p in cases.iterdir()) == [_STEM + ".json", _STEM + ".x.npy"]
    assert all(os.path.islink(cases / (_STEM + s)) for s in (".json", ".x.npy"))


def test_cases_dir_folders_are_created_and_a_dangling_link_above_it_is_refused(wrong, tmp_path):
    from qsfa.golden.guard import make_dirs
    from qsfa.golden.io import GoldenInputError

    deep = tmp_path / "a" / "b" / "cases"
    r = _fail_into(wrong, deep)
    assert r.case_file == str(deep / (_STEM + ".json")) and os.path.isfile(r.case_file)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(GoldenInputError, match="is not a folder"):
        make_dirs(tmp_path / "gone" / "cases")
    assert not os.path.lexists(tmp_path / "nowhere")


def test_cases_from_dask_tasks_are_written_the_same_way(wrong, tmp_path):
    """--workers / --seed-shards: the client writes the tasks' case files with the same guard, and a refused
    file is reported in the failure's message as in a serial run (not a traceback)."""
    from qsfa.distributed.conformance import run_sharded

    cases, victim = tmp_path / "cases", tmp_path / "victim"
    cases.mkdir()
    victim.write_text("VICTIM\n")
    (cases / (_STEM + ".x.npy")).symlink_to(victim)
    rep, _ = run_sharded([get("formats.encode.vs_reference")], wrong, max_examples=4, seed=3, seed_shards=2,
                         cases_dir=str(cases))
    (r,) = rep.results
    assert r.status == "failed" and r.case_file is None
    assert CASE_SAVE_ERROR in r.message and "refusing to write" in r.message
    assert victim.read_text() == "VICTIM\n"
    assert sorted(p.name for p in cases.iterdir()) == [_STEM + ".x.npy"]
    (cases / (_STEM + ".x.npy")).unlink()
    rep, _ = run_sharded([get("formats.encode.vs_reference")], wrong, max_examples=4, seed=3, seed_shards=2,
                         cases_dir=str(cases))
    assert rep.results[0].case_file == os.path.join(str(cases), _STEM + ".json")
    assert sorted(p.name for p in cases.iterdir()) == sorted(_STEM + s for s in (".json", ".x.npy",
                                                                                 ".conformance.json"))


# --- --replay checks the case file first: a malformed one is bad usage (2), a kernel failure stays 1 ---------

def _tampered(src, dst, case=None, side=None):
    """A copy of the saved case ``src`` (a folder) in ``dst`` with ``case(dict)`` / ``side(dict)`` applied."""
    import shutil

    shutil.copytree(src, dst)
    cp, sp = dst / (_STEM + ".json"), dst / (_STEM + ".conformance.json")
    for path, edit in ((cp, case), (sp, side)):
        d = json.loads(path.read_text())
        if edit is not None:
            edit(d)
        path.write_text(json.dumps(d))
    return cp


_MALFORMED = [
    # (what is changed, in the case / in the sidecar, the file the error names, what else it says)
    ("unknown param", lambda c: c["params"].update(evil=1), None, ".json",
     "Invalid case field for params.evil, actual: 1, reason: formats.encode has no parameter 'evil'"),
    ("chip as a param", lambda c: c["params"].update(chip="A2"), None, ".json",
     "Invalid case field for params.chip, actual: 'A2', reason: the chip a conformance case models is the sidecar's"),
    ("nested-list fmt", lambda c: c["params"].update(fmt=[["int8"]]), None, ".json",
     "Invalid case field for params.fmt, actual: [['int8']] (list), reason: the reference rejects it "
     "(formats.encode.fmt_type): must be a string."),
    ("unknown fmt", lambda c: c["params"].update(fmt="nope"), None, ".json",
     "Invalid case field for params.fmt, actual: 'nope', reason: the reference rejects it (formats.encode.fmt_value)"),
    ("missing param", lambda c: c["params"].pop("fmt"), None, ".json", "formats.encode needs fmt"),
    ("op of another property", lambda c: c.update(op="formats.decode"), None, ".json",
     "Invalid case field for op, actual: 'formats.decode', reason: the sidecar's property "
     "formats.encode.vs_reference calls formats.encode."),
    ("oversized case seed", lambda c: c.update(seed=2 ** 64), None, ".json",
     f"Invalid case field for seed, actual: {2 ** 64}, reason: must be an integer from 0 to 2**63 - 1."),
    ("unknown chip", None, lambda s: s.update(chip="Z9"), ".conformance.json",
     "Invalid sidecar field for chip, actual: 'Z9', reason: must be null or one of A2, A3, 950."),
    ("negative check_seed", None, lambda s: s.update(check_seed=-5), ".conformance.json",
     "Invalid sidecar field for check_seed, actual: -5, reason: must be an integer from 0 to 4294967295."),
    ("negative seed", None, lambda s: s.update(seed=-1), ".conformance.json", "for seed, actual: -1"),
    ("float seed", None, lambda s: s.update(seed=1.5), ".conformance.json", "for seed, actual: 1.5"),
    ("unknown property", None, lambda s: s.update(property="formats.encode.nope"), ".conformance.json",
     "for property, actual: 'formats.encode.nope', reason: no such property"),
    ("other kind", None, lambda s: s.update(kind="metamorphic"), ".conformance.json", "for kind"),
    ("constraint of a vs_reference case", None, lambda s: s.update(constraint="formats.encode.fmt_value"),
     ".conformance.json", "is not an invalid-argument property"),
    ("a param given twice", None, lambda s: s.update(params_not_in_case={"fmt": "int8"}), ".conformance.json",
     "for params_not_in_case.fmt, actual: 'int8', reason: 'fmt' is given twice"),
    ("an unrestorable param", lambda c: c["params"].pop("saturate"),
     lambda s: s.update(params_not_in_case={"saturate": {"repr": "<object>"}}), ".conformance.json",
     "for params_not_in_case.saturate, actual: {'repr': '<object>'}, reason: the run could only save"),
    ("an unknown restored param", None, lambda s: s.update(params_not_in_case={"evil": {"float": "inf"}}),
     ".conformance.json", "for params_not_in_case.evil, actual: inf, reason: formats.encode has no parameter"),
    ("a sidecar that is a list", None, lambda s: (s.clear(), s.update(property=["x"])), ".conformance.json",
     "for property"),
]


def test_replay_refuses_a_malformed_case_file_with_one_line_naming_field_value_and_reason(wrong, tmp_path, capsys):
    r = _fail_into(wrong, tmp_path / "saved")
    assert r.case_file, r.message
    # the file as saved still replays as the kernel failure it is: exit 1
    assert main(["conformance", "--replay", r.case_file]) == 1
    assert "fails on 'toy_wrong_encode': backend 'toy_wrong_encode' differs" in capsys.readouterr().out
    for k, (what, case, side, file, needle) in enumerate(_MALFORMED):
        cp = _tampered(tmp_path / "saved", tmp_path / f"t{k}", case, side)
        err = _one_line_usage_error(capsys, ["conformance", "--replay", str(cp)], needle)
        assert err.startswith(f"qsfa conformance: error: {tmp_path / f't{k}' / (_STEM + file)}: "), (what, err)
        assert not err.rstrip().endswith(".."), (what, err)
        assert err.count("reason:") == 1, (what, err)


def test_replay_checks_an_invalid_argument_case_against_its_constraint(wrong, tmp_path, capsys):
    """An invalid-argument case must break the sidecar's constraint first on the reference: otherwise it is no
    example of it (the property would fail on every backend)."""
    from qsfa.conformance import load_example

    r = _fail_into(wrong, tmp_path / "saved")
    inv = "formats.encode.invalid_rejected"

    def as_invalid(cid, kind="metamorphic"):
        return lambda s: s.update(property=inv, kind=kind, constraint=cid)

    ok = _tampered(tmp_path / "saved", tmp_path / "ok", lambda c: c["params"].update(fmt="nope"),
                   as_invalid("formats.encode.fmt_value"))
    prop, ex, _ = load_example(str(ok))
    assert prop.name == inv and ex.constraint.id == "formats.encode.fmt_value"
    assert main(["conformance", "--replay", str(ok), "--backend", "reference"]) == 0
    assert f"{inv} holds on 'reference'" in capsys.readouterr().out
    for k, (case, side, needle) in enumerate([
            (None, as_invalid("formats.encode.fmt_value"), "the reference accepts the case's arguments"),
            (lambda c: c["params"].update(fmt="nope"), as_invalid("formats.encode.fmt_type"),
             "the reference rejects the case's arguments with formats.encode.fmt_value first"),
            (lambda c: c["params"].update(fmt="nope"), as_invalid("formats.encode.no_such_rule"),
             "must be the id of one of formats.encode's constraints"),
            (lambda c: c["params"].update(fmt="nope"), as_invalid(None), "for constraint, actual: None")]):
        cp = _tampered(tmp_path / "saved", tmp_path / f"t{k}", case, side)
        _one_line_usage_error(capsys, ["conformance", "--replay", str(cp)], "Invalid sidecar field for constraint",
                              needle)


def test_replay_reports_a_backend_that_raises_as_an_error_not_as_bad_usage(wrong, tmp_path, capsys):
    """A raise is an ERROR (exit 3, docs/conformance.md#verdicts): neither a failure (1) nor bad usage (2)."""
    r = _fail_into(wrong, tmp_path)

    def broken(x, fmt, saturate=False, rounding=None):
        raise TypeError("the kernel's own bug")

    register_impl(wrong, "formats.encode", broken)
    assert main(["conformance", "--replay", r.case_file]) == 3
    out = capsys.readouterr()
    assert ("ERROR on 'toy_wrong_encode': backend 'toy_wrong_encode' raised TypeError in formats.encode: the "
            "kernel's own bug") in out.out and out.err == ""


def test_an_invalid_example_with_a_0d_array_is_saved_as_it_was_drawn(tmp_path):
    """formats.unpack_fp4.packed_ndim: a 0-d ``packed`` is the violation; saved 1-d it would be no example of it."""
    from qsfa.conformance import Example, load_example, save_case
    from qsfa.conformance.properties import operator

    prop = get("formats.unpack_fp4.invalid_rejected")
    c = operator(prop.op).contract.constraint("formats.unpack_fp4.packed_ndim")
    ex = Example({"packed": np.array(7, np.uint8), "nibble_order": "low_first"}, 0, c)
    path = save_case(prop, "reference", ex, "msg", str(tmp_path))
    prop2, ex2, _ = load_example(path)
    assert ex2.args["packed"].shape == () and ex2.constraint.id == c.id
    assert replay_case(path) == (True, "formats.unpack_fp4.invalid_rejected holds on 'reference'")


# --- QSFA_HYPOTHESIS_PROFILE naming no profile is bad usage ----------------------------------------------------

def test_a_bad_profile_variable_is_one_line_of_bad_usage(monkeypatch, tmp_path, capsys):
    from qsfa.conformance import campaign

    monkeypatch.setenv("QSFA_HYPOTHESIS_PROFILE", "bogus")
    monkeypatch.chdir(tmp_path)
    for argv in (["conformance", "--ops", "formats.encode"], ["conformance", "--ops", "formats.encode", "--workers",
                                                                "2"]):
        _one_line_usage_error(capsys, argv, "Invalid value for QSFA_HYPOTHESIS_PROFILE, actual: 'bogus', reason: "
                              "must be one of ci, dev, nightly")
    assert os.listdir(tmp_path) == []  # refused before anything was written
    assert campaign.main(["--mutants", "pack_fp4.*", "-q"]) == 2
    assert "QSFA_HYPOTHESIS_PROFILE, actual: 'bogus'" in capsys.readouterr().err
    # an explicit --profile does not read the variable
    assert main(["conformance", "--properties", "formats.encode.vs_reference", "--profile", "ci", "--max-examples",
                 "2", "-q"]) == 0


def test_pytest_stops_with_a_usage_error_on_a_bad_profile_variable():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q", "tests/test_cli.py"],
                       cwd=root, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "QSFA_HYPOTHESIS_PROFILE": "bogus"})
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    assert r.stderr.strip() == ("ERROR: Invalid value for QSFA_HYPOTHESIS_PROFILE, actual: 'bogus', reason: must be "
                                "one of ci, dev, nightly (or unset: ci)."), r.stderr


# --- a run writes nothing outside its output folder -------------------------------------------------------------

def _bare_env(tmp_path):
    """The environment of a CLI subprocess whose temporary folder is ``tmp_path/tmp`` (empty) and that sets no
    hypothesis / Dask storage folder of its own."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HYPOTHESIS_STORAGE_DIRECTORY", "DASK_TEMPORARY_DIRECTORY")}
    return dict(env, TMPDIR=str(tmp_path / "tmp"))


def _cli(tmp_path, env, *argv):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "qsfa.cli", "conformance", *argv], cwd=str(tmp_path / "cwd"),
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_run_leaves_no_hypothesis_folder_in_the_current_directory(tmp_path):
    env = _bare_env(tmp_path)
    r = _cli(tmp_path, env, "--ops", "formats.encode", "--max-examples", "3", "-q")
    assert r.returncode == 0, r.stderr
    assert os.listdir(tmp_path / "cwd") == []  # no .hypothesis/ (its constants cache went to a temporary folder)
    assert os.listdir(tmp_path / "tmp") == []  # ... which the run removed
    # an explicit HYPOTHESIS_STORAGE_DIRECTORY is the user's: hypothesis writes there, qsfa leaves it
    mine = tmp_path / "mine"
    r = _cli(tmp_path, dict(env, HYPOTHESIS_STORAGE_DIRECTORY=str(mine)), "--ops", "formats.encode",
             "--max-examples", "3", "-q")
    assert r.returncode == 0, r.stderr
    assert os.path.isdir(mine / "constants") and os.listdir(tmp_path / "cwd") == []


def test_the_hypothesis_folder_of_a_command_is_restored_in_process(monkeypatch, tmp_path):
    from hypothesis import configuration

    from qsfa.conformance.cli import STORAGE_VAR, hypothesis_storage

    monkeypatch.delenv(STORAGE_VAR, raising=False)
    before = getattr(configuration, "__hypothesis_home_directory")
    with hypothesis_storage():
        inside = configuration.storage_directory(intent_to_write=False).home_directory
        assert str(inside) == os.environ[STORAGE_VAR] and os.path.isdir(inside)
    assert getattr(configuration, "__hypothesis_home_directory") == before and STORAGE_VAR not in os.environ
    assert not os.path.exists(inside)
    monkeypatch.setenv(STORAGE_VAR, str(tmp_path))
    with hypothesis_storage():
        assert os.environ[STORAGE_VAR] == str(tmp_path)
    assert os.environ[STORAGE_VAR] == str(tmp_path)


def test_replay_refuses_the_options_of_a_run_it_would_ignore(wrong, tmp_path, capsys):
    """--replay re-runs the case as recorded (its chip, its arguments, qsfa's criterion): a --chip, --profile,
    --report, ... beside it used to be dropped without a word (a user asking for the 950 got the recorded chip)."""
    r = run_property(get("formats.encode.vs_reference"), wrong, max_examples=5, cases_dir=str(tmp_path))
    assert r.status == "failed" and r.case_file
    for extra, needle in ((["--chip", "950"], "--chip 950"), (["--profile", "nightly"], "--profile nightly"),
                          (["--report", str(tmp_path / "r.json")], "--report "),
                          (["--standard", "all", "--repeat", "3"], "--standard all, --repeat 3"),
                          (["--workers", "2"], "--workers 2"), (["--list"], "--list")):
        err = _one_line_usage_error(capsys, ["conformance", "--replay", r.case_file] + extra,
                                    "Invalid option for --replay", needle)
        assert "--backend-module" in err, err
    assert not (tmp_path / "r.json").exists()
    assert main(["conformance", "--replay", r.case_file, "-q", "--backend", wrong]) == 1  # the options it takes


def test_a_negative_bound_is_told_its_range_not_the_syntax(capsys):
    """--bound max_kv_tokens=-3 is NAME=INTEGER; it used to be told "must be NAME=INTEGER with NAME one of ...", as if
    the name or the syntax were wrong, while =0 was told the range."""
    for value in ("-3", "0"):
        err = _one_line_usage_error(capsys, ["conformance", "--ops", "formats.pack_fp4", "--bound",
                                             f"max_kv_tokens={value}"], f"max_kv_tokens, actual: {value}", ">= 1")
        assert "NAME=INTEGER" not in err, err
    _one_line_usage_error(capsys, ["conformance", "--bound", "max_kv_tokens=3.5"], "NAME=INTEGER")
