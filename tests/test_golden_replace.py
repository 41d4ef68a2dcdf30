"""Regenerating into a folder that holds a golden set: the new set is written into a staging folder inside
``--out`` and swapped in only when every case is written. A failed case, an interrupt (mid-run or during the
swap), a run whose cases are all skipped and a case file naming no operator of this build leave the previous
set byte for byte as it was, with no staging folder left behind; a case file may read its inputs from the
folder it regenerates.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qsfa.golden import Case, GoldenInputError, generate, get_set, load_manifest
from qsfa.golden import generators
from qsfa.golden.manifest import REPLACED_PREFIX, STAGING_PREFIX
from _golden_cli import cli

ROOT = Path(__file__).resolve().parents[1]


def tree(root: Path) -> dict:
    """Every file (bytes) and folder below ``root``, links not followed."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for n in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, n), root) + "/"] = None
        for n in filenames:
            p = os.path.join(dirpath, n)
            snap[os.path.relpath(p, root)] = ("link", os.readlink(p)) if os.path.islink(p) else Path(p).read_bytes()
    return snap


def leftovers(root: Path) -> list:
    return [n for n in os.listdir(root) if n.startswith((STAGING_PREFIX, REPLACED_PREFIX))]


@pytest.fixture
def old(smoke, tmp_path):
    """A copy of the smoke set with a file of the user's beside it; ``(folder, its tree before)``."""
    g = tmp_path / "g"
    shutil.copytree(smoke, g)
    (g / "notes.txt").write_text("mine")
    return g, tree(g)


def assert_unchanged(g: Path, before: dict):
    assert not leftovers(g), leftovers(g)
    after = tree(g)
    assert sorted(after) == sorted(before)
    changed = [k for k in before if after[k] != before[k]]
    assert not changed, changed


# --------------------------------------------------------------------------------------------------
# the review's scenarios


def test_a_case_file_reading_its_inputs_from_out_regenerates_it(old, smoke, capsys):
    g, _ = old
    rc, out, err = cli(capsys, "generate", "--case", g / "decode-hifloat8" / "case.json", "--out", g, "-q")
    assert rc == 0, err
    assert out.startswith("wrote 1 case, 3 files and manifest.json to ")
    man = load_manifest(g)
    assert [c["name"] for c in man["cases"]] == ["decode-hifloat8"] and man["set"] is None
    for rel in man["cases"][0]["files"]:
        assert (g / rel).read_bytes() == (smoke / rel).read_bytes(), rel
    # the other cases of the previous set are gone (with the warning saying so); the user's file stays
    assert sorted(os.listdir(g)) == ["decode-hifloat8", "manifest.json", "notes.txt"]
    n_old = len(load_manifest(smoke)["cases"])
    assert f"warning: {g} held {n_old - 1} cases of set smoke that this run does not write" in err
    assert err.count("\n") == 1
    rc, out, err = cli(capsys, "verify", g, "--recompute", "-q")
    assert rc == 0, out + err


def test_a_failing_case_leaves_the_previous_set(old, smoke, tmp_path, capsys):
    g, before = old
    # a case file whose input file has gone: the error comes while the new set is computed
    d = tmp_path / "cases"
    d.mkdir()
    shutil.copyfile(smoke / "decode-hifloat8" / "case.json", d / "case.json")
    rc, out, err = cli(capsys, "generate", "--case", d / "case.json", "--out", g, "-q")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "error: case decode-hifloat8: input file not found: " in err
    assert "case decode-hifloat8: case decode-hifloat8" not in err  # named once
    assert_unchanged(g, before)
    # a set whose last case the operator rejects, through the Python API
    bad = Case(name="dbq-row-block-0", op="dynamic_block_quant", generator="dynamic_block_quant",
               params={"M": 4, "N": 128, "row_block_size": 0}, seed=3)
    with pytest.raises(GoldenInputError, match="case dbq-row-block-0: "):
        generate(get_set("smoke").cases()[:4] + [bad], str(g), progress=False)
    assert_unchanged(g, before)


def test_a_failing_run_into_a_new_folder_leaves_no_folder(smoke, tmp_path, capsys):
    d = tmp_path / "cases"
    d.mkdir()
    shutil.copyfile(smoke / "decode-hifloat8" / "case.json", d / "case.json")
    rc, out, err = cli(capsys, "generate", "--case", d / "case.json", "--out", tmp_path / "new" / "deeper", "-q")
    assert rc == 2 and "input file not found" in err
    assert not (tmp_path / "new").exists()  # neither --out nor the parent the run created


def test_an_interrupt_mid_run_leaves_the_previous_set(old, monkeypatch, capsys):
    g, before = old
    cases = get_set("smoke").cases()
    victim = cases[-1].generator  # the last case: the others are written (into staging) by then
    n = sum(c.generator == victim for c in cases)
    real, calls = generators.get_generator(victim), []

    def interrupted(params, rng):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(params, rng)

    monkeypatch.setitem(generators._GENERATORS, victim, interrupted)
    rc, out, err = cli(capsys, "generate", "--set", "smoke", "--out", g, "-q")
    assert len(calls) == n and rc == 130 and "interrupted" in err
    assert_unchanged(g, before)


@pytest.mark.parametrize("when", ["park-first", "park-last", "place-first", "place-last", "manifest"])
def test_an_error_or_interrupt_during_the_swap_moves_everything_back(old, monkeypatch, when, capsys):
    g, before = old
    n_files = sum(len(c["files"]) for c in load_manifest(g)["cases"])
    fail_at = {"park-first": 0, "park-last": n_files - 1, "place-first": n_files, "place-last": 2 * n_files - 1}
    real_rename, real_replace = os.rename, os.replace
    count = {"rename": 0}

    def rename(src, dst, *a, **k):
        i = count["rename"]
        count["rename"] += 1
        if i == fail_at.get(when):
            raise KeyboardInterrupt if i % 2 else OSError(5, "simulated I/O error", str(dst))
        return real_rename(src, dst, *a, **k)

    def replace(src, dst, *a, **k):
        if when == "manifest":
            raise KeyboardInterrupt
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    rc, out, err = cli(capsys, "generate", "--set", "smoke", "--out", g, "-q")
    monkeypatch.undo()
    assert rc in (2, 130), (rc, err)
    assert_unchanged(g, before)


@pytest.fixture
def interactive_ctrl_c():
    """SIGINT as in an interactive terminal (Python's KeyboardInterrupt handler, unblocked) for the test. pytest
    started in the background (``cmd &`` in a script, nohup) inherits SIGINT ignored, and the command then rightly
    leaves Ctrl-C alone: a test that raises SIGINT in-process would see a run that was never interrupted."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    signal.signal(signal.SIGINT, handler)


def test_a_ctrl_c_during_the_swap_waits_for_it(old, tmp_path, monkeypatch, capsys, interactive_ctrl_c):
    """SIGINT while the files are being moved: the swap finishes (the new set is whole), then the command is
    interrupted - never a half-swapped folder."""
    g, _ = old
    fresh = tmp_path / "fresh"
    assert cli(capsys, "generate", "--set", "formats", "--only", "decode-*", "--out", fresh, "-q")[0] == 0
    real_rename, count = os.rename, []

    def rename(src, dst, *a, **k):
        count.append(1)
        if len(count) == 10:
            signal.raise_signal(signal.SIGINT)  # as a Ctrl-C: the handler runs at once, in this thread
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    rc, out, err = cli(capsys, "generate", "--set", "formats", "--only", "decode-*", "--out", g, "-q")
    monkeypatch.undo()
    assert len(count) > 10 and rc == 130 and "interrupted" in err
    assert {k: v for k, v in tree(g).items() if k != "notes.txt"} == tree(fresh) and not leftovers(g)


def test_all_cases_skipped_for_the_chip_leaves_the_previous_set(old, capsys):
    g, before = old
    rc, out, err = cli(capsys, "generate", "--set", "smoke", "--chip", "A2", "--only", "kvce*", "--out", g, "-q")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert ("nothing to generate: all 2 selected cases were skipped (2 beyond the chip's limits, first "
            "kvce-mode1-rs: chip A2: ") in err
    assert "missing from this build" not in err and f"{g} was left as it was" in err
    assert_unchanged(g, before)


def test_all_cases_skipped_for_a_missing_operator_says_so(old, capsys):
    g, before = old
    cases = [Case(name="no-such-op", op="not_in_this_build", generator="dynamic_block_quant")]
    with pytest.raises(GoldenInputError, match=r"all 1 selected case were skipped \(1 needing an operator "
                                               r"missing from this build, first no-such-op: operator "
                                               r"'not_in_this_build' is not in this build of qsfa\)"):
        generate(cases, str(g), progress=False)
    assert_unchanged(g, before)


def test_a_case_file_naming_no_operator_is_bad_input(old, tmp_path, capsys):
    g, before = old
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"format": "qsfa-case/1", "name": "x", "op": "os.system", "generator": "smoke"}))
    rc, out, err = cli(capsys, "generate", "--case", p, "--out", g, "-q")
    assert rc == 2 and err.count("\n") == 1
    assert f"{p}: Invalid case field for op, actual: 'os.system', reason: not an operator of this build" in err
    assert_unchanged(g, before)


def test_an_empty_shard_is_bad_input(old, capsys):
    g, before = old
    n = len(get_set("smoke").cases())
    rc, out, err = cli(capsys, "generate", "--set", "smoke", "--shard", f"{n}/{n + 1}", "--out", g, "-q")
    assert rc == 2 and err.count("\n") == 1 and f"no case of the {n} selected cases falls in this shard" in err
    assert_unchanged(g, before)


def test_replacing_another_set_warns_and_writes_what_a_fresh_run_writes(old, tmp_path, capsys):
    g, _ = old
    rc, out, err = cli(capsys, "generate", "--set", "formats", "--only", "decode-hif*", "--out", g, "-q")
    assert rc == 0, err
    n_old = len(get_set("smoke").cases())
    assert err.startswith(f"warning: {g} held {n_old - 1} cases of set smoke that this run does not write; they "
                          "were removed with the previous manifest: ") and err.count("\n") == 1
    fresh = tmp_path / "fresh"
    assert cli(capsys, "generate", "--set", "formats", "--only", "decode-hif*", "--out", fresh, "-q")[0] == 0
    got = {k: v for k, v in tree(g).items() if k != "notes.txt"}
    assert got == tree(fresh)
    # regenerating the same selection over itself: no warning, the same bytes, nothing left over
    rc, out, err = cli(capsys, "generate", "--set", "formats", "--only", "decode-hif*", "--out", g, "-q")
    assert rc == 0 and err == ""
    assert {k: v for k, v in tree(g).items() if k != "notes.txt"} == tree(fresh) and not leftovers(g)


def _default_sigint():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_of_a_real_run_leaves_the_previous_set(old, tmp_path):
    """SIGINT to the command line while a long case is being computed (into the staging folder)."""
    g, before = old
    params = dict(q_lens=[512], kv_lens=[2048], heads=64, layout_query="TND", layout_kv="PA_BSND", block_size=128,
                  width=2048, rope_head_dim=64, dtype="bfloat16", data="realistic", scale_value=576 ** -0.5,
                  sparse_mode=3, return_softmax_lse=True)
    case_file = Case(name="long-prefill", op="kv_quant_sparse_flash_attention", generator="qsfa_attention", seed=7,
                     params=params).save(str(tmp_path / "long.json"))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "qsfa.cli", "golden", "generate", "--case", case_file, "--out",
                          str(g), "-q"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline and not leftovers(g):
            time.sleep(0.05)
        assert p.poll() is None and leftovers(g), "the run did not start computing"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "interrupted" in err, err[-2000:]
    assert_unchanged(g, before)
