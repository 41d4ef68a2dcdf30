"""Golden case sets: the case file, generate -> verify -> compare, byte-identical output, bad input.

Expected values come from outside qsfa where they can: en-dtypes for HiFloat8 decodes, ml_dtypes for
FP8 E4M3FN codes, NumPy for raw little-endian reads, and small hand-written computations for the toy
operator. The CLI runs in-process through ``qsfa.cli.main``; one test runs the installed console script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from qsfa import _dispatch
from qsfa._contract import Contract
from qsfa.cli import main
from qsfa.golden import Case, GoldenInputError, case_sets, get_set, load_manifest, register_set
from qsfa.golden import catalogue, generators, meta
from qsfa.golden.generators import register_generator
from qsfa.golden.meta import ArrayMeta, register_describer

BF16 = np.dtype(ml_dtypes.bfloat16)


def cli(capsys, *argv):
    rc = main(["golden", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def entry(man, case, role, name):
    c = next(c for c in man["cases"] if c["name"] == case)
    return next(e for e in c["arrays"] if e["role"] == role and e["name"] == name)


def fromfile(folder, e):
    """Read a bin file with nothing but NumPy and the manifest entry."""
    return np.fromfile(os.path.join(folder, e["file"]), dtype=e["storage"]).reshape(e["shape"])


# --------------------------------------------------------------------------------------------------
# a toy operator (registered for the test, removed afterwards) with a float output that has
# unspecified elements and a packed uint8 cache with byte fields


TOY = "golden_toy.pack"


def _toy_reference(x, cache, slots, scale):
    y = (x.astype(np.float32) * np.float32(scale)).astype(BF16)
    rows = np.concatenate([y.view(np.uint8), y.astype(np.float32).sum(-1, dtype=np.float32)[:, None].view(np.uint8)], -1)
    keep = slots >= 0
    cache[slots[keep], :20] = rows[keep]
    return y, cache


def _toy_gen(params, rng):
    r = params["rows"]
    return {
        "x": (rng.standard_normal((r, 8), dtype=np.float32)).astype(BF16),
        "cache": generators.sentinel_filled((params["num_slots"], 24), np.uint8),
        "slots": generators.slot_mapping(rng, r, params["num_slots"], skip=1),
    }


def _toy_describe(params, args, outputs):
    y_mask = np.ones(outputs["y"].shape, bool)
    y_mask[0] = False  # row 0 is "unspecified"
    seg = [[0, 16, "bfloat16", "values"], [16, 20, "float32", "row sum"], [20, 24, "uint8", "not written"]]
    return {("output", "y"): ArrayMeta(layout="bf16 [rows, 8]", compare="float", mask=y_mask),
            ("output", "cache"): ArrayMeta(layout="uint8 rows", segments=seg),
            ("input", "cache"): ArrayMeta(layout="uint8 rows", segments=seg)}


@pytest.fixture
def toy():
    contract = Contract(op=TOY, example=lambda rng: _toy_gen({"rows": 3, "num_slots": 5}, rng) | {"scale": 2.0},
                        inplace=("cache",))
    _dispatch.define_operator(TOY, contract, outputs=("y", "cache"), reference=_toy_reference)
    register_generator("golden_toy", _toy_gen, replace=True)
    register_describer(TOY, _toy_describe)
    register_set("golden-toy", "toy operator", lambda: [
        Case("toy-a", TOY, {"rows": 4, "num_slots": 6, "scale": 0.5}, seed=1, generator="golden_toy"),
        Case("toy-b", TOY, {"rows": 3, "num_slots": 3, "scale": 3.0}, seed=2, generator="golden_toy"),
        Case("toy-c", TOY, {"rows": 2, "num_slots": 9, "scale": -1.0}, seed=3, generator="golden_toy"),
    ], replace=True)
    yield TOY
    _dispatch._OPERATORS.pop(TOY, None)
    generators._GENERATORS.pop("golden_toy", None)
    meta._DESCRIBERS.pop(TOY, None)
    catalogue.unregister_set("golden-toy")


# --------------------------------------------------------------------------------------------------
# the case file


def test_case_file_round_trip_with_explicit_inputs(tmp_path, toy):
    rng = np.random.default_rng(5)
    inputs = _toy_gen({"rows": 3, "num_slots": 4}, rng)
    case = Case("cx", TOY, {"scale": np.float32(0.25), "rows": 3}, seed=0, generator=None, inputs_given=inputs)
    path = case.save(tmp_path / "sub" / "cx.json")
    d = json.loads(Path(path).read_text())
    assert d["format"] == "qsfa-case/1" and d["op"] == TOY and d["params"] == {"scale": 0.25, "rows": 3}
    assert set(d["inputs"]) == {"x", "cache", "slots"}
    assert d["inputs"]["x"] == {"file": "cx.x.npy", "dtype": "bfloat16", "shape": [3, 8],
                                "sha256": d["inputs"]["x"]["sha256"]}
    # the input files are plain .npy in the storage dtype: bf16 as its uint16 bit patterns
    raw = np.load(tmp_path / "sub" / "cx.x.npy")
    assert raw.dtype == np.dtype("<u2") and np.array_equal(raw, inputs["x"].view(np.uint16))

    back = Case.load(path)
    got = back.inputs()
    for k, v in inputs.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes()
    out = back.run()
    # independent expectation: rows of y = x * 0.25 (exact in bf16), cache rows at the slots
    y = (inputs["x"].astype(np.float32) * 0.25).astype(BF16)
    assert out["y"].tobytes() == y.tobytes()
    cache = inputs["cache"].copy()
    for r, s in enumerate(inputs["slots"]):
        if s >= 0:
            cache[s, :16] = y[r].view(np.uint8)
            cache[s, 16:20] = np.float32(y[r].astype(np.float32).sum(dtype=np.float32)).reshape(1).view(np.uint8)
    assert out["cache"].tobytes() == cache.tobytes()
    # running did not touch the case's own inputs (the cache is in place)
    assert back.inputs()["cache"].tobytes() == inputs["cache"].tobytes()


def test_case_from_args_replays_the_call(tmp_path):
    """Case.from_args: a concrete call (arrays, scalars, None) saved and replayed gives the same bytes."""
    import qsfa

    rng = np.random.default_rng(3)
    k_nope = (rng.standard_normal((3, 512), dtype=np.float32) * 2).astype(BF16)
    cache = generators.sentinel_filled((1, 16, 1, 528), np.uint8)
    args = dict(k_nope=k_nope, k_rope=None, slot_mapping=np.array([4, -1, 0]), kv_cache=cache, key_dtype="int8")
    case = Case.from_args("c8-rope0", "c8_cache_write", args, description="rope 0 call")
    assert case.params == {"k_rope": None, "key_dtype": "int8"} and set(case.inputs()) == {"k_nope", "slot_mapping", "kv_cache"}
    loaded = Case.load(case.save(tmp_path / "c8-rope0.json"))
    want = qsfa.c8_cache_write(k_nope, None, np.array([4, -1, 0]), cache.copy(), key_dtype="int8")
    assert loaded.run()["kv_cache"].tobytes() == want.tobytes()
    assert (want.reshape(16, 528)[[1, 2, 3] + list(range(5, 16))] == generators.SENTINEL).all()


def test_case_file_keeps_0d_and_empty_inputs(tmp_path):
    """A 0-d array stays 0-d and an array with a 0 in its shape is saved at all (np.ascontiguousarray made the
    first 1-d, so the file disagreed with the case's shape; a memoryview of the second cannot be cast to bytes)."""
    inputs = {"s": np.array(1.5, np.float32), "b": np.zeros((), BF16), "e": np.zeros((0, 3), np.uint8),
              "t": np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::2]}
    path = Case("c0", "formats.encode", {}, inputs_given=inputs).save(tmp_path / "c0.json")
    assert np.load(tmp_path / "c0.s.npy").shape == () and np.load(tmp_path / "c0.e.npy").shape == (0, 3)
    got = Case.load(path).inputs()
    for k, v in inputs.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes(), k


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(format="qsfa-case/2"), "for format, actual: 'qsfa-case/2', reason: must be 'qsfa-case/1'"),
    (lambda d: d.update(extra=1), "unknown field(s) ['extra']"),
    (lambda d: d.pop("op"), "missing ['op']"),
    (lambda d: d.update(seed=-1), "for seed, actual: -1, reason: must be an integer from 0 to 2**63 - 1"),
    (lambda d: d.update(name="a b"), "case name 'a b' must match"),
    (lambda d: d["inputs"]["x"].update(shape=[4, 8]), "Invalid shape for .npy header, actual: [3, 8], reason: expected [4, 8]."),
    (lambda d: d["inputs"]["x"].update(sha256="0" * 64), "does not match its sha256"),
    (lambda d: d["inputs"]["x"].update(file="nope.npy"), "input file not found"),
    (lambda d: d["inputs"]["x"].update(shape=[3, "x"]), "Invalid case field for inputs.x.shape[1], actual: 'x'"),
])
def test_case_file_errors(tmp_path, toy, edit, message):
    inputs = _toy_gen({"rows": 3, "num_slots": 4}, np.random.default_rng(0))
    path = Case("cx", TOY, {"scale": 1.0}, inputs_given=inputs).save(tmp_path / "cx.json")
    d = json.loads(Path(path).read_text())
    edit(d)
    Path(path).write_text(json.dumps(d))
    with pytest.raises(GoldenInputError) as ei:
        Case.load(path).inputs()
    assert message in str(ei.value)


def test_case_params_must_be_json(toy):
    with pytest.raises(GoldenInputError, match="arrays belong in inputs"):
        Case("c", TOY, {"scale": np.zeros(2)}, generator="golden_toy")
    with pytest.raises(GoldenInputError, match="must be finite"):
        Case("c", TOY, {"scale": float("nan")}, generator="golden_toy")
    with pytest.raises(GoldenInputError, match="needs a generator or explicit inputs"):
        Case("c", TOY, {"scale": 1.0})


# --------------------------------------------------------------------------------------------------
# generate -> verify -> compare


def test_generate_verify_compare_self(smoke, capsys, tmp_path):
    man = load_manifest(smoke)
    assert man["format"] == "qsfa-golden/1" and man["set"] == "smoke" and man["byte_order"] == "little"
    assert len(man["cases"]) >= 4
    rc, out, err = cli(capsys, "verify", smoke, "--recompute", "-q")
    assert rc == 0 and out.startswith("OK ") and "recomputed" in out, (out, err)
    rc, out, err = cli(capsys, "compare", smoke, "--actual", smoke, "--json", tmp_path / "r.json")
    assert rc == 0 and "verdict: PASS" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    n_out = sum(e["role"] == "output" for c in man["cases"] for e in c["arrays"])
    assert rep["verdict"] == "PASS" and rep["outputs"] == n_out and rep["failed"] == 0


def test_flipped_output_byte_is_named(smoke, capsys, tmp_path):
    man = load_manifest(smoke)
    case = "encode-float8_e4m3fn-sat"
    x = fromfile(smoke, entry(man, case, "input", "x")).view(np.float32)
    k = int(np.flatnonzero(x == 1.0)[0])
    actual = tmp_path / "actual"
    shutil.copytree(smoke, actual)
    codes_file = actual / case / "out.codes.bin"
    b = bytearray(codes_file.read_bytes())
    assert b[k] == 0x38  # 1.0 in E4M3FN
    b[k] ^= 0x01
    codes_file.write_bytes(bytes(b))

    rc, out, err = cli(capsys, "compare", smoke, "--actual", actual, "--json", tmp_path / "r.json")
    assert rc == 1 and "verdict: FAIL" in out
    golden_v = float(np.uint8(0x38).reshape(1).view(ml_dtypes.float8_e4m3fn)[0])
    actual_v = float(np.uint8(0x39).reshape(1).view(ml_dtypes.float8_e4m3fn)[0])
    assert (golden_v, actual_v) == (1.0, 1.125)
    assert f"index [{k}], byte {k}, golden 56 (= 1), actual 57 (= 1.125)" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    bad = [r for r in rep["results"] if r["passed"] is False]
    assert [(r["case"], r["output"]) for r in bad] == [(case, "codes")]
    w = bad[0]["worst"][0]
    assert (w["index"], w["byte_offset"], w["golden_decoded"], w["actual_decoded"]) == ([k], k, golden_v, actual_v)
    assert bad[0]["n_fail"] == 1


def test_edited_file_fails_verify_naming_it(smoke, capsys, tmp_path):
    g = tmp_path / "g"
    shutil.copytree(smoke, g)
    man = load_manifest(g)
    e = entry(man, "dbq-int8-1x128-bf16", "input", "x")
    p = g / e["file"]
    b = bytearray(p.read_bytes())
    b[3] ^= 0x40
    p.write_bytes(bytes(b))
    rc, out, err = cli(capsys, "verify", g, "-q")
    assert rc == 2 and err.count("\n") == 1  # a changed file: the directory is unusable, not a FAIL verdict
    assert f"ERROR {e['file']}: sha256" in out and e["file"] in err and "FAIL" not in out
    # a deleted file is named too
    os.remove(g / entry(man, "decode-hifloat8", "output", "values")["file"])
    rc, out, err = cli(capsys, "verify", g, "-q")
    assert rc == 2 and "ERROR decode-hifloat8/out.values.bin: missing" in out
    assert "2 file problems" in err and "first: decode-hifloat8/out.values.bin: missing" in err  # manifest order


def test_recompute_catches_a_wrong_output_with_consistent_checksums(smoke, capsys, tmp_path):
    g = tmp_path / "g"
    shutil.copytree(smoke, g)
    man_path = g / "manifest.json"
    man = json.loads(man_path.read_text())
    e = entry(man, "dbq-int8-1x128-bf16", "output", "y")
    p = g / e["file"]
    b = bytearray(p.read_bytes())
    b[10] = (b[10] + 1) % 256
    p.write_bytes(bytes(b))
    import hashlib

    digest = hashlib.sha256(bytes(b)).hexdigest()
    e["sha256"] = digest
    c = next(c for c in man["cases"] if c["name"] == "dbq-int8-1x128-bf16")
    c["files"][e["file"]]["sha256"] = digest
    man_path.write_text(json.dumps(man))
    rc, out, err = cli(capsys, "verify", g, "-q")
    assert rc == 0  # the checksums agree with the edited file ...
    rc, out, err = cli(capsys, "verify", g, "--recompute", "-q")
    assert rc == 1  # ... but the reference does not
    assert f"FAIL {e['file']}: recomputed output differs: " in out and "1 of" in out and "first at index [0, 10]" in out


@pytest.mark.parametrize("fmt", ["bin", "npz"])
def test_same_set_twice_is_byte_identical(tmp_path, capsys, fmt):
    a, b = tmp_path / "a", tmp_path / "nested" / "b"
    assert cli(capsys, "generate", "--set", "smoke", "--out", a, "--format", fmt, "-q")[0] == 0
    assert cli(capsys, "generate", "--set", "smoke", "--out", b, "--format", fmt, "-q")[0] == 0
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    ma = load_manifest(a)
    sums = {rel: info["sha256"] for c in ma["cases"] for rel, info in c["files"].items()}
    assert sums
    files_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    files_b = sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b == sorted(list(sums) + ["manifest.json"])
    for rel in sums:
        assert (a / rel).read_bytes() == (b / rel).read_bytes()
    # regenerating into the same directory replaces it with the same bytes
    assert cli(capsys, "generate", "--set", "smoke", "--out", a, "--format", fmt, "-q")[0] == 0
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()


def test_bin_files_read_back_with_fromfile_and_the_manifest(smoke):
    import en_dtypes

    man = load_manifest(smoke)
    for c in man["cases"]:
        for e in c["arrays"]:
            a = fromfile(smoke, e)
            assert a.dtype == np.dtype(e["storage"]) and list(a.shape) == e["shape"]
    # HiFloat8 decode: codes 0..255 in, en-dtypes' values out
    codes = fromfile(smoke, entry(man, "decode-hifloat8", "input", "codes"))
    assert np.array_equal(codes, np.arange(256, dtype=np.uint8))
    vals = fromfile(smoke, entry(man, "decode-hifloat8", "output", "values"))
    want = np.arange(256, dtype=np.uint8).view(en_dtypes.hifloat8).astype(np.float32)
    assert np.array_equal(vals, want, equal_nan=True)
    # E4M3FN saturating encode: ml_dtypes' RNE cast of the input clamped to +-448
    x = fromfile(smoke, entry(man, "encode-float8_e4m3fn-sat", "input", "x"))
    codes = fromfile(smoke, entry(man, "encode-float8_e4m3fn-sat", "output", "codes"))
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(codes, want)
    # int8 1x128 block quant of a bf16 input: the manifest's storage form is uint16 bit patterns
    e = entry(man, "dbq-int8-1x128-bf16", "input", "x")
    assert (e["dtype"], e["storage"]) == ("bfloat16", "<u2")
    xf = fromfile(smoke, e).view(BF16).astype(np.float32)
    y = fromfile(smoke, entry(man, "dbq-int8-1x128-bf16", "output", "y"))
    s = fromfile(smoke, entry(man, "dbq-int8-1x128-bf16", "output", "scale"))
    blocks = xf.reshape(xf.shape[0], -1, 128)
    # every chip runs it, so the case models A2 (the manifest says so): the A2/A3 kernel's order, a reciprocal
    # multiplier fp32(fp32(1/amax) * 127) and the scale amax * fp32(1/127) (docs/numerics/chips.md)
    assert next(c for c in man["cases"] if c["name"] == "dbq-int8-1x128-bf16")["chip"] == "A2"
    amax = np.abs(blocks).max(-1)
    s_want = (amax * (np.float32(1) / np.float32(127))).astype(np.float32)
    assert s.tobytes() == s_want.tobytes()
    mult = ((np.float32(1) / amax).astype(np.float32) * np.float32(127)).astype(np.float32)
    q_want = np.clip(np.rint(blocks * mult[..., None]), -127, 127).astype(np.int8).reshape(xf.shape)
    assert y.tobytes() == q_want.tobytes()


def test_npz_members_are_plain_npy(tmp_path, capsys):
    out = tmp_path / "g"
    assert cli(capsys, "generate", "--set", "smoke", "--out", out, "--format", "npz", "-q")[0] == 0
    man = load_manifest(out)
    e = entry(man, "dbq-int8-1x128-bf16", "input", "x")
    with np.load(out / e["file"], allow_pickle=False) as z:
        assert sorted(z.files)[0] == "in.x"
        raw = z[e["key"]]
    assert raw.dtype == np.dtype("<u2") and list(raw.shape) == e["shape"]
    assert cli(capsys, "verify", out, "--recompute", "-q")[0] == 0
    assert cli(capsys, "compare", out, "--actual", out)[0] == 0


def test_shards_partition_the_set(tmp_path, capsys):
    full = [c.name for c in get_set("smoke").cases()]
    got = []
    for i in range(3):
        rc, out, err = cli(capsys, "generate", "--set", "smoke", "--out", tmp_path / f"s{i}", "--shard", f"{i}/3", "-q")
        assert rc == 0
        man = load_manifest(tmp_path / f"s{i}")
        assert man["shard"] == {"index": i, "count": 3}
        got += [c["name"] for c in man["cases"]]
    skipped = {s["name"] for s in load_manifest(tmp_path / "s0")["skipped"]} | \
        {s["name"] for i in (1, 2) for s in load_manifest(tmp_path / f"s{i}")["skipped"]}
    assert sorted(got + sorted(skipped)) == sorted(full) and len(set(got)) == len(got)


# --------------------------------------------------------------------------------------------------
# the toy operator: float criterion, masks, packed-row fields, replayed case files


def test_float_outputs_masks_and_row_fields(toy, tmp_path, capsys):
    g = tmp_path / "g"
    rc, out, err = cli(capsys, "generate", "--set", "golden-toy", "--out", g, "-q")
    assert rc == 0, err
    man = load_manifest(g)
    ey = entry(man, "toy-a", "output", "y")
    assert ey["compare"] == "float" and ey["masked"]
    mask = fromfile(g, entry(man, "toy-a", "mask", "y"))
    assert mask[0].sum() == 0 and mask[1:].all()
    assert cli(capsys, "verify", g, "--recompute", "-q")[0] == 0
    assert cli(capsys, "compare", g, "--actual", g)[0] == 0

    act = tmp_path / "act"
    shutil.copytree(g, act)
    y = fromfile(g, ey).view(BF16).astype(np.float32)
    # row 0 is unspecified: garbage there still passes
    y_bad = y.copy()
    y_bad[0] = 1000.0
    y_bad.astype(BF16).tofile(act / ey["file"])
    rc, out, err = cli(capsys, "compare", g, "--actual", act, "--case", "toy-a", "--output", "y")
    assert rc == 0 and "8 unspecified elements not compared" in out
    # a specified element far off fails and is reported with its values
    y_bad[2, 3] = y[2, 3] + 1.0
    y_bad.astype(BF16).tofile(act / ey["file"])
    rc, out, err = cli(capsys, "compare", g, "--actual", act, "--case", "toy-a", "--output", "y")
    assert rc == 1 and "toy-a/y" in out and "index [2, 3]" in out

    # one byte of the row sum field (fp32 at bytes 16..20) of a written row
    ec = entry(man, "toy-b", "output", "cache")
    cache = fromfile(g, ec)
    slots = fromfile(g, entry(man, "toy-b", "input", "slots"))
    s = int(slots[slots >= 0][0])
    bad = cache.copy()
    bad[s, 18] ^= 0x01
    bad.tofile(act / ec["file"])
    rc, out, err = cli(capsys, "compare", g, "--actual", act, "--case", "toy-b", "--json", tmp_path / "r.json")
    assert rc == 1
    golden_sum = float(cache[s, 16:20].view(np.float32)[0])
    actual_sum = float(bad[s, 16:20].view(np.float32)[0])
    assert f"index [{s}, 18], byte {s * 24 + 18}, row sum [0], golden " in out
    w = next(r for r in json.loads((tmp_path / "r.json").read_text())["results"] if not r["passed"])["worst"][0]
    assert (w["golden_decoded"], w["actual_decoded"]) == (golden_sum, actual_sum)
    # the untouched tail of every row still holds the sentinel
    assert (cache[:, 20:] == generators.SENTINEL).all()


def test_replay_a_saved_case_file(toy, tmp_path, capsys):
    """What the conformance runner does: save a counterexample with explicit inputs, replay it."""
    inputs = _toy_gen({"rows": 2, "num_slots": 3}, np.random.default_rng(11))
    path = Case("falsified-1", TOY, {"scale": 1.5}, inputs_given=inputs,
                description="hypothesis counterexample").save(tmp_path / "cases" / "falsified-1.json")
    g = tmp_path / "g"
    rc, out, err = cli(capsys, "generate", "--case", path, "--out", g, "-q")
    assert rc == 0
    man = load_manifest(g)
    assert [c["name"] for c in man["cases"]] == ["falsified-1"] and man["set"] is None
    x = fromfile(g, entry(man, "falsified-1", "input", "x")).view(BF16)
    assert x.tobytes() == inputs["x"].tobytes()
    # the golden's own case.json replays too, from the golden's input files
    g2 = tmp_path / "g2"
    assert cli(capsys, "generate", "--case", g / "falsified-1" / "case.json", "--out", g2, "-q")[0] == 0
    for c1, c2 in zip(load_manifest(g)["cases"], load_manifest(g2)["cases"]):
        assert c1["files"] == c2["files"]


def test_catalogue_cases_satisfy_their_contracts():
    """Every catalogued case whose operator exists builds inputs the operator's contract accepts."""
    from qsfa._contract import Args
    from qsfa.golden.case import available_ops, resolve_op

    ops = _dispatch.operators()
    n = 0
    for s in case_sets().values():
        for c in s.cases():
            if c.op not in available_ops():
                continue
            spec = resolve_op(c.op)
            inputs = c.inputs()
            args = dict(c.call_params(inputs, spec), **c.args(inputs, spec))
            hit = ops[c.op].contract.first_violation(Args(args))
            assert hit is None, f"{s.name}/{c.name}: {hit[0].id}: {hit[1]}"
            n += 1
    assert n >= 4


# --------------------------------------------------------------------------------------------------
# bad input: one line on stderr, exit status 2, no traceback


def test_bad_input_is_one_clean_line(smoke, tmp_path, capsys):
    def bad(*argv, expect):
        rc, out, err = cli(capsys, *argv)
        assert rc == 2, (argv, out, err)
        assert "Traceback" not in err and err.count("\n") == 1 and expect in err, err
        return err

    bad("generate", "--set", "nope", "--out", tmp_path / "x", expect="unknown case set 'nope'; known sets:")
    bad("generate", "--case", tmp_path / "missing.json", "--out", tmp_path / "x", expect="file not found")
    bad("generate", "--set", "smoke", "--out", tmp_path / "x", "--shard", "3/3", expect="need 0 <= i < n")
    bad("generate", "--set", "smoke", "--out", tmp_path / "x", "--only", "zz*", expect="no case of smoke matches")
    assert not (tmp_path / "x").exists()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "keep.txt").write_text("mine")
    bad("generate", "--set", "smoke", "--out", tmp_path / "foreign", expect="holds no manifest.json")
    assert (tmp_path / "foreign" / "keep.txt").read_text() == "mine"
    bad("verify", tmp_path / "nowhere", expect="golden directory not found")
    bad("verify", tmp_path / "foreign", expect="not a golden directory")
    bad("compare", smoke, "--actual", tmp_path / "nowhere", expect="no such file or directory")
    bad("compare", smoke, "--actual", smoke, "--case", "zzz*", expect="has no outputs matching")

    man = load_manifest(smoke)
    e = entry(man, "dbq-int8-1x128-bf16", "output", "y")
    short = tmp_path / "y.bin"
    short.write_bytes(b"\0" * (e["nbytes"] - 1))
    bad("compare", smoke, "--actual", short, "--case", "dbq-int8-1x128-bf16", "--output", "y",
        expect=f"has {e['nbytes'] - 1} bytes, expected {e['nbytes']}")
    bad("compare", smoke, "--actual", short, expect="several outputs are selected")
    wrong = tmp_path / "y.npy"
    np.save(wrong, np.zeros((2, 2), np.int8))
    bad("compare", smoke, "--actual", wrong, "--case", "dbq-int8-1x128-bf16", "--output", "y",
        expect="Invalid shape for .npy header, actual: [2, 2], reason: expected [16, 384] (the golden")
    np.save(wrong, np.zeros(e["shape"], np.float32))
    bad("compare", smoke, "--actual", wrong, "--case", "dbq-int8-1x128-bf16", "--output", "y",
        expect="Invalid dtype for .npy header, actual: float32 (<f4), reason: expected 1-byte elements (the golden "
               "dbq-int8-1x128-bf16/out.y, int8 stored as |i1)")
    # a tampered golden is refused by compare, which points at verify
    g = tmp_path / "g"
    shutil.copytree(smoke, g)
    p = g / e["file"]
    p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:])
    bad("compare", g, "--actual", smoke, expect="run qsfa golden verify")
    # a manifest whose shape no longer matches its file
    man2 = json.loads((smoke / "manifest.json").read_text())
    e2 = entry(man2, "dbq-int8-1x128-bf16", "output", "y")
    e2["shape"][0] += 1
    e2["nbytes"] += e2["shape"][1]  # consistent with the shape (an inconsistent manifest is bad input, exit 2)
    shutil.copytree(smoke, tmp_path / "g3")
    (tmp_path / "g3" / "manifest.json").write_text(json.dumps(man2))
    i = next(i for i, c in enumerate(man2["cases"]) if c["name"] == "dbq-int8-1x128-bf16")
    j = next(j for j, a in enumerate(man2["cases"][i]["arrays"]) if a is e2)
    for cmd in (("verify", tmp_path / "g3", "-q"), ("compare", tmp_path / "g3", "--actual", smoke)):
        bad(*cmd, expect=f"Invalid manifest field for cases[{i}].arrays[{j}].shape, actual: {e2['shape']}, "
                         f"reason: {e2['nbytes']} bytes of |i1, but its file dbq-int8-1x128-bf16/out.y.bin is "
                         f"listed with {e['nbytes']} bytes.")


def test_histogram(smoke, tmp_path, capsys):
    import importlib.util

    rc, out, err = cli(capsys, "compare", smoke, "--actual", smoke, "--histogram", tmp_path / "h.png")
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 2 and "--histogram needs matplotlib" in err and "qsfa[plot]" in err
        assert not (tmp_path / "h.png").exists()
    else:
        assert rc == 0 and (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_list(capsys):
    rc, out, err = cli(capsys, "list")
    assert rc == 0
    for name, s in case_sets().items():
        assert any(line.split()[:3] == [name, str(len(s.cases())), "cases"] for line in out.splitlines()), name
    for required in ("smoke", "seed-decode", "seed-rope0", "formats", "kv-compress-epilog", "kv-rmsnorm-rope-cache"):
        assert required in case_sets()
    rc, out, err = cli(capsys, "list", "smoke")
    assert rc == 0 and all(c.name in out for c in get_set("smoke").cases())


def test_readme_main_job_through_the_console_script(tmp_path):
    """The README's first command, minus the install: generate smoke, then verify --recompute."""
    exe = Path(sys.executable).with_name("qsfa")
    if not exe.exists():
        pytest.skip("the qsfa console script is not installed next to this Python")
    env = dict(os.environ)
    r1 = subprocess.run([str(exe), "golden", "generate", "--set", "smoke", "--out", "golden-out"], cwd=tmp_path,
                        capture_output=True, text=True, env=env, timeout=120)
    assert r1.returncode == 0, r1.stderr
    r2 = subprocess.run([str(exe), "golden", "verify", "golden-out", "--recompute"], cwd=tmp_path,
                        capture_output=True, text=True, env=env, timeout=120)
    assert r2.returncode == 0 and r2.stdout.startswith("OK golden-out"), r2.stdout + r2.stderr
    r3 = subprocess.run([str(exe), "golden", "list", "nope"], cwd=tmp_path, capture_output=True, text=True,
                        env=env, timeout=60)
    assert r3.returncode == 2 and r3.stderr.count("\n") == 1 and "Traceback" not in r3.stderr


@pytest.mark.parametrize("file_format", ["bin", "npz"])
def test_every_ml_dtypes_output_is_stored_as_its_bits(tmp_path, file_format):
    """The stored bytes of an ml_dtypes array are its bits, read straight from the file here (not through
    qsfa.golden.io): ml_dtypes 0.7 gives float8_e5m2 NumPy kind "f", and a kind test had stored its *values*
    cast to uint8 (1.5 -> 1, NaN -> 0) while verify, which read them back the same way, said OK."""
    import zipfile

    from qsfa.golden import catalogue as C
    from qsfa.golden.manifest import generate

    cases = [c for c in C.dynamic_block_quant_cases() if c.name in ("dbq-e5m2-1x64", "dbq-e4m3-128x128")]
    assert len(cases) == 2
    out = tmp_path / "g"
    man = generate(cases, str(out), file_format=file_format, progress=False)
    for case, entry in zip(cases, man["cases"]):
        want = case.run("reference", case.inputs())
        checked = 0
        for o in entry["arrays"]:
            if o["role"] != "output":
                continue
            arr = np.asarray(want[o["name"]])
            if arr.dtype.itemsize != 1 or arr.dtype.kind in "iub":
                continue
            if file_format == "bin":
                raw = (out / o["file"]).read_bytes()
            else:
                with zipfile.ZipFile(out / o["file"]) as z:
                    raw = np.lib.format.read_array(z.open(o["key"] + ".npy")).tobytes()
            assert raw == np.ascontiguousarray(arr).view(np.uint8).tobytes(), (case.name, o["name"], o["dtype"])
            checked += 1
        assert checked == 1, case.name  # y, the FP8 codes


def test_a_call_no_chip_runs_makes_no_golden(tmp_path):
    """Without chip= the reference accepts the union of the chips' limits; a golden, though, is some chip's: Q_N = 48
    (950 only) with the LSE outputs (A2/A3 only) is refused by name instead of being labelled 950 (hostile review
    M5), and the output folder is not created."""
    from qsfa.golden.case import Case
    from qsfa.golden.io import GoldenInputError
    from qsfa.golden.manifest import generate
    from qsfa.ops.attention import qsfa_case

    args = qsfa_case(n_heads=48)
    args["return_softmax_lse"] = True
    with pytest.raises(GoldenInputError, match=r"no chip runs this call.*chip '950'.*return_softmax_lse"):
        generate([Case.from_args("q48-lse", "kv_quant_sparse_flash_attention", args)], str(tmp_path / "g"),
                 progress=False)
    assert not (tmp_path / "g").exists()
    args["return_softmax_lse"] = False  # the 950 runs it: a golden labelled 950
    man = generate([Case.from_args("q48", "kv_quant_sparse_flash_attention", args)], str(tmp_path / "g"),
                   progress=False)
    assert [c["chip"] for c in man["cases"]] == ["950"]


def test_every_row_split_attention_output_is_judged_by_the_float_criterion():
    """The attention operators (their outputs carry the kernel's accumulation order: never byte-exact on a device)
    describe every float output as ``compare="float"`` - the HiFloat8 door included."""
    from qsfa.distributed.golden import ROW_SPLIT_OPS
    from qsfa.golden.catalogue import example_case
    from qsfa.golden.meta import describe

    for op in ROW_SPLIT_OPS:
        case = example_case(op)
        inputs = case.inputs()
        outputs = case.run("reference", inputs)
        metas = describe(op, case.call_params(inputs), inputs, outputs)
        floats = [n for n, a in outputs.items() if np.asarray(a).size and np.asarray(a).dtype.kind == "f"
                  or str(np.asarray(a).dtype) == "bfloat16"]
        assert floats, op
        for n in floats:
            assert metas[("output", n)].compare == "float", (op, n)
