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
