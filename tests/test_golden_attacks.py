"""The golden CLI against hostile input (issue 12, section 4): every attack of
``tests/golden_attack_cases.py`` - symbolic links out of the folder (files and folders), ``..`` and
absolute names in manifests and case files, absolute input paths, .npz/.npy bombs, deeply nested JSON,
wrong JSON types for the manifest fields, int64-overflowing shapes - must end in the refusal: exit status
2 with one line on stderr naming the file and the field (verify: exit 1 and a FAIL line), no traceback,
and nothing changed outside the command's folder - nor inside it, since each refusal comes before any
write (or, for a generate run that fails while computing, nothing of the set already in --out lost and no
staging folder left). The bombs must be refused without inflating: peak traced memory stays far below their size.

The CLI runs in process (``qsfa.cli.main``); ``python tests/golden_attack_cases.py --root CHECKOUT`` runs
the same attacks as subprocesses against any checkout and counts the outcomes (the issue's campaign).
"""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc

import numpy as np
import pytest

from golden_attack_cases import ATTACKS, CASE, GIB, TEMPLATE_ARGS, Scene, damage, refusal_ok, snapshot
from qsfa.cli import main
from qsfa.golden import Case, GoldenInputError, load_manifest

#: a refused bomb may use this much traced memory (its arrays declare 1 - 2 GiB each)
BOMB_MEMORY = 64 << 20


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    out = tmp_path_factory.mktemp("attack-template") / "g"
    assert main(["golden", *TEMPLATE_ARGS, "--out", str(out)]) == 0
    return out


def run(capsys, argv, memory=False):
    capsys.readouterr()
    if memory:
        tracemalloc.start()
        try:
            rc = main(["golden", *argv])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    else:
        rc, peak = main(["golden", *argv]), None
    out, err = capsys.readouterr()
    return rc, out, err, peak


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_is_refused_and_changes_nothing(attack, template, tmp_path, capsys):
    scene = Scene(tmp_path / "scene", template)
    argv, expect = attack.build(scene)
    outside, work = snapshot(scene.outside), snapshot(scene.work)
    rc, out, err, peak = run(capsys, argv, memory=attack.memory)
    assert refusal_ok(attack, rc, out, err, expect), (attack.note, rc, out, err, expect)
    assert snapshot(scene.outside) == outside, "a file outside the command's folder changed"
    if attack.touches_out:  # refused while computing: nothing lost, nothing left (the folders' mtimes moved)
        assert damage(work, snapshot(scene.work)) == [], "the failed command lost or left data in its folder"
    else:
        assert snapshot(scene.work) == work, "the refused command changed its own folder"
    if attack.memory:
        assert peak < BOMB_MEMORY, f"{peak >> 20} MiB traced while refusing {attack.name}"


def test_the_campaign_covers_every_attack_kind_of_the_issue():
    groups = {a.group for a in ATTACKS}
    assert {"symlink", "traversal", "absolute", "bomb", "deep-json", "json-type", "overflow", "data-loss"} <= groups
    assert len({a.name for a in ATTACKS}) == len(ATTACKS)


# --------------------------------------------------------------------------------------------------
# what the refusals must not break: the legitimate neighbours of each attack


def test_regenerate_keeps_unlisted_files_and_replaces_listed_ones(template, tmp_path, capsys):
    g = tmp_path / "g"
    shutil.copytree(template, g)
    (g / "notes.txt").write_text("mine")
    (g / CASE / "README").write_text("mine too")
    rc, out, err, _ = run(capsys, ["generate", "--set", "smoke", "--only", CASE, "--out", str(g), "-q"])
    assert rc == 0, err
    assert (g / "notes.txt").read_text() == "mine" and (g / CASE / "README").read_text() == "mine too"
    assert (g / CASE / "out.y.bin").read_bytes() == (template / CASE / "out.y.bin").read_bytes()
    assert (g / "manifest.json").read_bytes() == (template / "manifest.json").read_bytes()


def test_regenerate_with_fewer_cases_removes_only_listed_files(template, tmp_path, capsys):
    g = tmp_path / "g"
    rc = main(["golden", "generate", "--set", "smoke", "--only", CASE, "--only", "decode-hifloat8",
               "--out", str(g), "-q"])
    assert rc == 0
    (g / "decode-hifloat8" / "extra.bin").write_bytes(b"x")
    rc, out, err, _ = run(capsys, ["generate", "--set", "smoke", "--only", CASE, "--out", str(g), "-q"])
    assert rc == 0, err
    # the dropped case's files are gone; its folder stays because it holds a file qsfa did not make
    assert sorted(os.listdir(g / "decode-hifloat8")) == ["extra.bin"]
    assert [c["name"] for c in load_manifest(g)["cases"]] == [CASE]


def test_out_given_as_a_symlink_to_a_folder_is_that_folder(template, tmp_path, capsys):
    """The user's own --out may be a link; the links *inside* it are what is never followed."""
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    rc, out, err, _ = run(capsys, ["generate", "--set", "smoke", "--only", CASE, "--out", str(tmp_path / "link"), "-q"])
    assert rc == 0, err
    assert (real / "manifest.json").read_bytes() == (template / "manifest.json").read_bytes()


def test_case_inputs_inside_the_folder_and_the_outside_flag(template, tmp_path, capsys):
    cases = tmp_path / "cases"
    (cases / "sub").mkdir(parents=True)
    shutil.copyfile(template / CASE / "in.x.bin", cases / "sub" / "x.bin")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copyfile(template / CASE / "in.x.bin", outside / "x.bin")
    c = json.loads((template / CASE / "case.json").read_text())
    c["inputs"]["x"]["file"] = "sub/x.bin"  # a subfolder of the case's folder: fine
    (cases / "c.json").write_text(json.dumps(c))
    rc, out, err, _ = run(capsys, ["generate", "--case", str(cases / "c.json"), "--out", str(tmp_path / "o1"), "-q"])
    assert rc == 0, err
    assert (tmp_path / "o1" / CASE / "in.x.bin").read_bytes() == (template / CASE / "in.x.bin").read_bytes()
    c["inputs"]["x"]["file"] = str(outside / "x.bin")
    (cases / "c.json").write_text(json.dumps(c))
    rc, out, err, _ = run(capsys, ["generate", "--case", str(cases / "c.json"), "--out", str(tmp_path / "o2"), "-q"])
    assert rc == 2 and "--allow-outside-inputs" in err and not (tmp_path / "o2").exists()
    rc, out, err, _ = run(capsys, ["generate", "--case", str(cases / "c.json"), "--out", str(tmp_path / "o2"), "-q",
                                   "--allow-outside-inputs"])
    assert rc == 0, err
    assert (tmp_path / "o2" / CASE / "in.x.bin").read_bytes() == (outside / "x.bin").read_bytes()
    with pytest.raises(GoldenInputError, match="inputs.x.file"):
        Case.load(cases / "c.json")
    assert Case.load(cases / "c.json", allow_outside_inputs=True).inputs()["x"].shape == (16, 384)


def test_compressed_npz_of_the_right_shape_is_still_read(template, tmp_path, capsys):
    """The header checks refuse bombs, not ordinary deflated .npz files (numpy.savez_compressed)."""
    y = np.fromfile(template / CASE / "out.y.bin", dtype=np.int8).reshape(16, 384)
    scale = np.fromfile(template / CASE / "out.scale.bin", dtype="<f4").reshape(16, 3)
    p = tmp_path / "actual.npz"
    np.savez_compressed(p, **{"out.y": y, "out.scale": scale})
    rc, out, err, _ = run(capsys, ["compare", str(template), "--actual", str(p)])
    assert rc == 0 and "verdict: PASS (2 of 2 outputs pass)" in out, out + err
    # a big-endian .npy of the right values is those values (not their byte-swapped patterns)
    q = tmp_path / "y.npy"
    np.save(q, scale.astype(">f4"))
    rc, out, err, _ = run(capsys, ["compare", str(template), "--actual", str(q), "--output", "scale"])
    assert rc == 0 and "PASS" in out, out + err


def test_max_bytes_cap_is_configurable(template, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QSFA_GOLDEN_MAX_BYTES", "1000")  # the golden's 12288-byte input is now too big
    rc, out, err, _ = run(capsys, ["verify", str(template), "-q"])
    assert rc == 2 and "cases[0].arrays[0].shape" in err and "QSFA_GOLDEN_MAX_BYTES" in err, err
    monkeypatch.setenv("QSFA_GOLDEN_MAX_BYTES", "lots")
    rc, out, err, _ = run(capsys, ["verify", str(template), "-q"])
    assert rc == 2 and "QSFA_GOLDEN_MAX_BYTES" in err and err.count("\n") == 1, err


def test_json_strictness(template, tmp_path, capsys):
    g = tmp_path / "g"
    shutil.copytree(template, g)
    text = (g / "manifest.json").read_text()
    for bad, what in [(text.replace('"seed": ', '"seed": NaN, "x": ', 1), "NaN"),
                      (text.replace('"format": ', '"format": "x", "format": ', 1), "duplicate key 'format'"),
                      (text[:-10], "not valid JSON")]:
        (g / "manifest.json").write_text(bad)
        rc, out, err, _ = run(capsys, ["verify", str(g), "-q"])
        assert rc == 2 and what in err and err.count("\n") == 1 and str(g / "manifest.json") in err, err
    # 64 levels are accepted by the reader (then refused by the manifest check), 65 are not parsed
    (g / "manifest.json").write_text("[" * 64 + "]" * 64)
    rc, out, err, _ = run(capsys, ["verify", str(g), "-q"])
    assert rc == 2 and "(top level)" in err, err
    (g / "manifest.json").write_text('{"s": "[[[[' + "[" * 100 + '"}' + "[" * 65 + "]" * 65)
    rc, out, err, _ = run(capsys, ["verify", str(g), "-q"])
    assert rc == 2 and "nesting depth, actual: 65" in err, err  # brackets inside strings do not count


def test_one_line_even_when_a_path_holds_a_newline(template, tmp_path, capsys):
    g = tmp_path / "bad\nname"
    shutil.copytree(template, g)
    (g / "manifest.json").write_text("{")
    rc, out, err, _ = run(capsys, ["verify", str(g), "-q"])
    assert rc == 2 and err.count("\n") == 1 and "bad\\nname" in err, err


def test_bomb_builder_is_a_real_bomb(tmp_path):
    """The attack's .npz really inflates to what it declares (so refusing it from headers matters)."""
    import zipfile

    from golden_attack_cases import write_npz_bomb

    p = tmp_path / "b.npz"
    size = write_npz_bomb(p, {"a": ("|i1", (64 << 20,))}, crc=True)
    assert size < (1 << 20)
    with zipfile.ZipFile(p) as zf, zf.open("a.npy") as f:
        head = np.lib.format.read_magic(f), np.lib.format.read_array_header_1_0(f)
        assert head[1][0] == (64 << 20,)
        n = 0
        while chunk := f.read(1 << 22):
            assert not any(chunk)
            n += len(chunk)
    assert n == 64 << 20 and GIB == 1 << 30


# --------------------------------------------------------------------------------------------------
# every manifest field with a value of the wrong JSON type


def _fields(obj, path=()):
    """Every (path, value) of the manifest's checked fields (not the free-form params / call members)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path + (k,), v
            if k not in ("params", "call"):
                yield from _fields(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield path + (i,), v
            yield from _fields(v, path + (i,))


def _field_name(path) -> str:
    """The field as the error names it: cases[0].arrays[2].shape[1], cases[0].files['c/in.x.bin'].bytes."""
    out = ""
    for i, k in enumerate(path):
        if isinstance(k, int):
            out += f"[{k}]"
        elif i and path[i - 1] == "files":
            out += f"[{k!r}]"
        else:
            out += ("." if out else "") + k
    return out


_WRONG = (5, "5", True, [1], {"a": 1})


def _wrong_values(v):
    """Values of another JSON type than ``v`` (a null field takes a string: no string for it)."""
    same = (lambda w: type(w) is type(v)) if v is not None else (lambda w: isinstance(w, str))
    return [w for w in _WRONG if not same(w)]


def _put(man, path, value):
    obj = man
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def test_every_manifest_field_of_a_wrong_type_is_named(template, tmp_path, capsys):
    """verify: each field of the template's manifest, set to each value of another JSON type, is exit 2
    with one line naming manifest.json and that field; generate (one wrong value per field) also deletes
    and writes nothing."""
    g = tmp_path / "g"
    shutil.copytree(template, g)
    good = json.loads((g / "manifest.json").read_text())
    fields = list(_fields(good))
    assert len(fields) > 60
    assert {p[-1] for p, _ in fields} >= {"format", "file_format", "byte_order", "set", "shard", "index", "count",
                                         "skipped", "qsfa_version", "cases", "name", "op", "files", "arrays",
                                         "params", "seed", "generator", "description", "call", "sha256", "bytes",
                                         "role", "shape", "dtype", "storage", "file", "nbytes", "format",
                                         "layout", "compare", "masked"}
    misses, tried = [], 0
    for path, value in fields:
        for k, wrong in enumerate(_wrong_values(value)):
            man = json.loads(json.dumps(good))
            _put(man, path, wrong)
            (g / "manifest.json").write_text(json.dumps(man))
            before = snapshot(g)
            argv = ["verify", str(g), "-q"] if k else \
                ["generate", "--set", "smoke", "--only", CASE, "--out", str(g), "-q"]
            rc, out, err, _ = run(capsys, argv)
            tried += 1
            name = _field_name(path)
            if not (rc == 2 and err.count("\n") == 1 and str(g / "manifest.json") in err
                    and f"for {name}, actual: " in err) or snapshot(g) != before:
                misses.append((name, wrong, argv[0], rc, err.strip()))
    assert not misses, misses[:5]
    assert tried > 200


def test_every_case_file_field_of_a_wrong_type_is_named(template, tmp_path, capsys):
    """generate --case: each field of a case file (its inputs included), set to each value of another JSON
    type, is exit 2 with one line naming the case file and the field; no --out folder is left behind."""
    d = tmp_path / "cases"
    d.mkdir()
    shutil.copyfile(template / CASE / "in.x.bin", d / "in.x.bin")
    good = json.loads((template / CASE / "case.json").read_text())
    fields = list(_fields(good))
    assert {p[-1] for p, _ in fields} >= {"format", "name", "op", "params", "seed", "generator", "description",
                                         "inputs", "x", "file", "dtype", "shape", "sha256"}
    misses, tried = [], 0
    for path, value in fields:
        for wrong in _wrong_values(value):
            c = json.loads(json.dumps(good))
            _put(c, path, wrong)
            (d / "c.json").write_text(json.dumps(c))
            rc, out, err, _ = run(capsys, ["generate", "--case", str(d / "c.json"), "--out", str(tmp_path / "o"), "-q"])
            tried += 1
            name = _field_name(path)
            if not (rc == 2 and err.count("\n") == 1 and str(d / "c.json") in err and f"for {name}, actual: " in err) \
                    or (tmp_path / "o").exists():
                misses.append((name, wrong, rc, err.strip()))
    assert not misses, misses[:5]
    assert tried > 40


def test_files_computed_elsewhere_are_written_like_generate_writes_them(tmp_path):
    """write_case_files (what the Dask executor uses): new files in plain case folders, generate's file
    names only, every file and folder remembered for the clean-up of a failed run."""
    from qsfa.golden.manifest import _remove_partial, write_case_files

    out = tmp_path / "out"
    out.mkdir()
    made: list = []
    write_case_files(str(out), {"c1/in.x.bin": b"ab", "c1/case.json": b"{}"}, made)
    assert (out / "c1" / "in.x.bin").read_bytes() == b"ab" and len(made) == 3  # the folder and two files
    for files, what in [({"c1/in.x.bin": b"again"}, "refusing to overwrite"),
                        ({"../in.x.bin": b""}, "Invalid case folder for case name"),
                        ({"../x/in.x.bin": b""}, "not a file name generate writes"),
                        ({"c2/notes.txt": b""}, "not a file name generate writes"),
                        ({"c3/sub/in.x.bin": b""}, "not a file name generate writes")]:
        with pytest.raises(GoldenInputError, match=what):
            write_case_files(str(out), files, made)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", out / "c4")
    with pytest.raises(GoldenInputError, match="not a plain folder"):
        write_case_files(str(out), {"c4/in.x.bin": b""}, made)
    assert not os.listdir(tmp_path / "elsewhere") and (out / "c1" / "in.x.bin").read_bytes() == b"ab"
    _remove_partial(str(out), made, created=False)
    assert sorted(os.listdir(out)) == ["c4"]  # what it made is gone; the link it did not make stays


def test_python_m_qsfa_cli_reports_usage_errors_in_one_line(tmp_path):
    """``python -m qsfa.cli`` (the form the docs use without an install) exits 2 with one line, as the
    console script does (before: the subcommand's UsageError escaped the __main__ copy of the module)."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "qsfa.cli", "golden", "verify", str(tmp_path / "nope")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "golden directory not found" in r.stderr, r.stderr


@pytest.mark.parametrize("text,depth", [
    (b"", 0), (b"[]", 1), (b'{"a": [1, {"b": "[[["}]}', 3), (b"[" * 10 + b"]" * 10, 10),
    (b"[][][[]]", 2), (b'"\\"[[[" [', 1), (b'{"k\\\\": "{"}', 1),
])
@pytest.mark.parametrize("chunk", [1, 3, 1 << 22])
def test_nesting_depth_scan(text, depth, chunk):
    """The pre-parse depth scan ignores brackets inside strings (escaped quotes included) and carries the
    depth across its chunks."""
    from qsfa.golden.guard import _nesting_depth

    assert _nesting_depth(text, chunk=chunk) == depth


def test_damage_counts_lost_changed_and_left_files(tmp_path):
    """The data-loss accounting of the campaign: a removed, a changed file and a left-over folder are named;
    a folder whose mtime moved is not."""
    (tmp_path / "d").mkdir()
    for n in ("a", "b", "c"):
        (tmp_path / "d" / n).write_bytes(n.encode())
    before = snapshot(tmp_path)
    (tmp_path / "d" / "x").mkdir()
    (tmp_path / "d" / "x").rmdir()  # only the folder's mtime moves
    assert damage(before, snapshot(tmp_path)) == []
    (tmp_path / "d" / "a").unlink()
    (tmp_path / "d" / "b").write_bytes(b"B")
    (tmp_path / "d" / ".qsfa-staging-1").mkdir()
    assert damage(before, snapshot(tmp_path)) == ["left d/.qsfa-staging-1", "lost d/a", "lost d/b"]


def test_a_manifest_format_that_names_no_format_is_a_malformed_field(template, tmp_path, capsys):
    """An array's "format" (the qsfa.formats name its codes are decoded by) outside the formats: compare said PASS
    while the bytes matched and, once one differed, exit 2 from the decoder without naming the file or field."""
    g = tmp_path / "g"
    shutil.copytree(template, g)
    man = json.loads((g / "manifest.json").read_text())
    j = next(j for j, e in enumerate(man["cases"][0]["arrays"]) if e["role"] == "output")
    man["cases"][0]["arrays"][j]["format"] = "fp8"
    (g / "manifest.json").write_text(json.dumps(man))
    for argv in (["compare", str(g), "--actual", str(g), "-q"], ["verify", str(g), "-q"]):
        rc, out, err, _ = run(capsys, argv)
        assert rc == 2 and err.count("\n") == 1, (argv, rc, out, err)
        assert str(g / "manifest.json") in err and f"cases[0].arrays[{j}].format, actual: 'fp8'" in err, err
