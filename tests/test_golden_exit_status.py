"""One exit-status rule for verify and compare (docs/golden.md#exit-status): 0 OK / PASS, 1 a verdict of FAIL
(values differ), 2 the tool's input is unusable - a missing, unreadable or changed file, a malformed or empty
manifest, a listed file whose size or shape disagrees with the disk - with one line on stderr. And the
messages of the cases around it: what a manifest.json or an actual output is when it is not a regular file,
non-finite counts of a float output, ``compare -q``, an unwritable ``--json`` refused before the work.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from _golden_cli import cli

ATT = "rope0-tnd-tnd-bfloat16-lse1-rope64"  # a float (bf16) attention output
MASKED = "rope0-bsnd-pa-float16-uniform-rope0"  # outputs with mask files
DBQ = "dbq-int8-1x128-bf16"


def refused(capsys, *argv, expect=()):
    """Exit 2, one line on stderr holding every ``expect``, no traceback; returns (stdout, stderr)."""
    rc, out, err = cli(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (argv, rc, out, err)
    for x in expect:
        assert x in err, (x, err)
    return out, err


@pytest.fixture
def g(smoke, tmp_path):
    d = tmp_path / "g"
    shutil.copytree(smoke, d)
    return d


def manifest(d):
    return json.loads((d / "manifest.json").read_text())


def write_manifest(d, man):
    (d / "manifest.json").write_text(json.dumps(man))
    return d / "manifest.json"


def case_index(man, name):
    return next(i for i, c in enumerate(man["cases"]) if c["name"] == name)


def array_index(man, case, role, name):
    c = man["cases"][case_index(man, case)]
    return next(j for j, e in enumerate(c["arrays"]) if e["role"] == role and e["name"] == name)


def flip(path, at=0):
    b = bytearray(path.read_bytes())
    b[at] ^= 1
    path.write_bytes(bytes(b))


# --------------------------------------------------------------------------------------------------
# the rule, for both commands


def test_intact_set_is_0_for_both(g, capsys):
    assert cli(capsys, "verify", g, "-q")[0] == 0
    assert cli(capsys, "compare", g, "--actual", g, "-q")[0] == 0


@pytest.mark.parametrize("what", ["flipped", "deleted"])
@pytest.mark.parametrize("role", ["input", "output"])
def test_a_changed_or_missing_file_is_2(g, capsys, what, role):
    rel = f"{DBQ}/in.x.bin" if role == "input" else f"{DBQ}/out.y.bin"
    if what == "flipped":
        flip(g / rel)
    else:
        os.remove(g / rel)
    out, err = refused(capsys, "verify", g, "-q", expect=(rel,))
    assert out.startswith(f"ERROR {rel}: ") and "FAIL" not in out
    # compare reads the golden outputs (sha256 checked) and checks the size of every file of the selected
    # cases; an input's bytes do not enter its verdict (verify checks them)
    if what == "flipped" and role == "input":
        assert cli(capsys, "compare", g, "--actual", g, "-q")[0] == 0
        return
    out, err = refused(capsys, "compare", g, "--actual", g, expect=(rel, "run qsfa golden verify"))
    assert "verdict" not in out


def test_values_that_differ_are_1_for_both(g, smoke, tmp_path, capsys):
    actual = tmp_path / "actual"
    shutil.copytree(smoke, actual)
    flip(actual / DBQ / "out.y.bin", 5)
    rc, out, err = cli(capsys, "compare", g, "--actual", actual)
    assert rc == 1 and "verdict: FAIL" in out
    # verify --recompute: an output the reference no longer gives, its checksums made consistent
    man = manifest(g)
    c = man["cases"][case_index(man, DBQ)]
    flip(g / DBQ / "out.y.bin", 5)
    digest = hashlib.sha256((g / DBQ / "out.y.bin").read_bytes()).hexdigest()
    c["files"][f"{DBQ}/out.y.bin"]["sha256"] = digest
    c["arrays"][array_index(man, DBQ, "output", "y")]["sha256"] = digest
    write_manifest(g, man)
    rc, out, err = cli(capsys, "verify", g, "--recompute", "-q")
    assert rc == 1 and out.startswith(f"FAIL {DBQ}/out.y.bin: recomputed output differs")
    assert err.startswith(f"verify {g}: FAIL: 1 failure in 11 cases, 82 files, 11 recomputed; first: {DBQ}/out.y.bin")
    assert err.count("\n") == 1


def test_an_empty_set_is_2_for_both(g, capsys):
    man = manifest(g)
    man["cases"] = []
    m = write_manifest(g, man)
    for argv in (("verify", g, "-q"), ("compare", g, "--actual", g)):
        refused(capsys, *argv, expect=(f"{m} lists no cases", "an empty golden set"))


def test_an_unknown_chip_is_a_malformed_manifest(g, capsys):
    man = manifest(g)
    i = case_index(man, DBQ)
    man["cases"][i]["chip"] = "Z"
    m = write_manifest(g, man)
    expect = (str(m), f"Invalid manifest field for cases[{i}].chip, actual: 'Z', reason: must be one of "
                      "['A2', 'A3', '950']")
    before = sorted(p.name for p in g.iterdir())
    for argv in (("verify", g, "-q"), ("compare", g, "--actual", g),
                 ("generate", "--set", "smoke", "--only", DBQ, "--out", g, "-q")):
        refused(capsys, *argv, expect=expect)
    assert sorted(p.name for p in g.iterdir()) == before
    man["cases"][i]["chip"] = "A2"
    man["cases"][i]["params"]["chip"] = "A9"
    write_manifest(g, man)
    refused(capsys, "verify", g, "-q", expect=(f"cases[{i}].params.chip, actual: 'A9'",))


def test_a_bogus_input_declaration_is_refused_by_compare(g, capsys):
    """The review: an input declared as 2**33 bytes passed compare (inputs were never looked at)."""
    man = manifest(g)
    i, j = case_index(man, DBQ), array_index(man, DBQ, "input", "x")
    e = man["cases"][i]["arrays"][j]
    e["shape"], e["nbytes"] = [1 << 16, 1 << 16], 1 << 33  # bf16: 2**33 bytes, nbytes consistent
    m = write_manifest(g, man)
    refused(capsys, "compare", g, "--actual", g, expect=(str(m), f"cases[{i}].arrays[{j}].shape", "8589934592 bytes",
                                                         "listed with 12288 bytes"))
    # consistent with the listed size, but not with the file on disk
    man["cases"][i]["files"][e["file"]]["bytes"] = 1 << 33
    write_manifest(g, man)
    refused(capsys, "compare", g, "--actual", g, expect=(f"golden file {e['file']} has 12288 bytes, the manifest "
                                                         f"says {1 << 33}",))


def test_an_npz_member_whose_header_disagrees_is_refused_by_compare(tmp_path, capsys):
    g = tmp_path / "npz"
    assert cli(capsys, "generate", "--set", "smoke", "--only", DBQ, "--format", "npz", "--out", g, "-q")[0] == 0
    man = manifest(g)
    j = array_index(man, DBQ, "input", "x")
    man["cases"][0]["arrays"][j]["shape"] = [384, 16]  # the same bytes, another shape
    write_manifest(g, man)
    refused(capsys, "compare", g, "--actual", g, expect=(f"{DBQ}/arrays.npz:in.x", "Invalid shape for .npy header",
                                                         "actual: [16, 384]", "expected [384, 16]"))


def test_a_changed_mask_is_refused_by_compare(g, capsys):
    flip(g / MASKED / "mask.softmax_max.bin")
    refused(capsys, "compare", g, "--actual", g, expect=(f"{MASKED}/mask.softmax_max.bin", "run qsfa golden verify"))


# --------------------------------------------------------------------------------------------------
# messages


def test_a_manifest_that_is_not_a_regular_file_says_what_it_is(g, capsys):
    m = g / "manifest.json"
    m.unlink()
    m.mkdir()
    for argv in (("verify", g, "-q"), ("compare", g, "--actual", g)):
        refused(capsys, *argv, expect=(f"{m} is a directory, not a regular file",))
    m.rmdir()
    os.symlink("/dev/zero", m)
    refused(capsys, "verify", g, expect=(f"{m} is a symbolic link to /dev/zero (a character device), not a regular "
                                         "file",))
    m.unlink()
    refused(capsys, "verify", g, expect=(f"{g} has no manifest.json",))
    refused(capsys, "verify", g / DBQ / "case.json", expect=("is a regular file, not a golden directory",))


def test_an_actual_output_that_is_not_a_regular_file_is_refused_saying_so(g, smoke, tmp_path, capsys):
    actual = tmp_path / "actual"
    shutil.copytree(smoke, actual)
    y = actual / DBQ / "out.y.bin"
    y.unlink()
    os.symlink("/dev/zero", y)
    refused(capsys, "compare", g, "--actual", actual, expect=(
        f"{y} is a symbolic link to /dev/zero (a character device), not a regular file: refusing to read it",))
    y.unlink()
    y.mkdir()
    refused(capsys, "compare", g, "--actual", actual, expect=(f"{y} is a directory, not a regular file",))
    refused(capsys, "compare", g, "--actual", "/dev/null", "--case", DBQ, "--output", "y",
            expect=("--actual /dev/null is a character device",))


def test_an_all_nan_actual_reports_its_non_finite_elements(g, smoke, tmp_path, capsys):
    actual = tmp_path / "actual"
    shutil.copytree(smoke, actual)
    out_file = actual / ATT / "out.attention_out.bin"
    n = out_file.stat().st_size // 2
    out_file.write_bytes(np.full(n, 0x7FC0, "<u2").tobytes())  # bf16 NaN
    rc, out, err = cli(capsys, "compare", g, "--actual", actual, "--case", ATT, "--output", "attention_out",
                       "--json", tmp_path / "v.json")
    assert rc == 1 and "verdict: FAIL" in out
    row = next(line for line in out.splitlines() if line.startswith(ATT))
    assert f"non-finite: actual {n}, golden 0 of {n}; finite pairs: " in row
    r = json.loads((tmp_path / "v.json").read_text())["results"][0]
    assert (r["nonfinite_actual"], r["nonfinite_golden"], r["passed"]) == (n, 0, False)


def test_compare_quiet_prints_only_the_verdict(g, smoke, tmp_path, capsys):
    rc, out, err = cli(capsys, "compare", g, "--actual", g, "-q")
    assert rc == 0 and out.count("\n") == 1 and out.startswith("verdict: PASS (") and err == ""
    actual = tmp_path / "actual"
    shutil.copytree(smoke, actual)
    flip(actual / DBQ / "out.y.bin")
    rc, out, err = cli(capsys, "compare", g, "--actual", actual, "--quiet")
    assert rc == 1 and out.count("\n") == 1 and out.startswith("verdict: FAIL (")


def test_an_unwritable_json_destination_is_refused_before_the_work(g, tmp_path, capsys):
    out, err = refused(capsys, "compare", g, "--actual", g, "--json", tmp_path / "missing" / "v.json",
                       expect=("Invalid value for --json", "its folder", "does not exist"))
    assert out == ""  # no verdict printed before the refusal
    (tmp_path / "adir").mkdir()
    out, err = refused(capsys, "compare", g, "--actual", g, "--json", tmp_path / "adir",
                       expect=("Invalid value for --json", "it is a directory"))
    assert out == ""
    out, err = refused(capsys, "compare", g, "--actual", g, "--histogram", tmp_path / "missing" / "h.png",
                       expect=("--histogram",))
    assert out == ""


def test_the_examples_set_makes_a_golden_of_an_atlas_a3_only_operator(tmp_path):
    """sparse_attn_sharedkv runs on Atlas A3 only: its call without a chip modelled A2 (qsfa.resolve_chip), which
    refuses it, so `qsfa golden generate --set examples` stopped with exit 2 at example-sparse_attn_sharedkv."""
    import qsfa
    from qsfa._dispatch import operator
    from qsfa.cli import main

    ex = operator("sparse_attn_sharedkv").contract.example(np.random.default_rng(0))
    assert qsfa.resolve_chip("sparse_attn_sharedkv", **ex) == "A3"
    assert qsfa.chips.chip_violation("sparse_attn_sharedkv", **{**ex, "chip": "A3"}) is None
    out = tmp_path / "g"
    assert main(["golden", "generate", "--set", "examples", "--only", "example-sparse_attn_sharedkv", "--out",
                 str(out), "-q"]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert [(c["name"], c["chip"]) for c in man["cases"]] == [("example-sparse_attn_sharedkv", "A3")]
