"""qsfa.chain: chains of registered operators as data, their golden tensors and the link-by-link comparison."""

import json
import os

import numpy as np
import pytest

from qsfa.chain import ChainError, chain_from_dict, compare_chain_dirs, run_chain, write_chain_golden
from qsfa.cli import main

CHAIN = {
    "name": "encode-decode-scatter",
    "inputs": ["x", "cache", "slots"],
    "links": [
        {"name": "enc", "op": "formats.encode", "args": {"x": "$input.x", "fmt": "float8_e4m3fn"}},
        {"name": "dec", "op": "formats.decode", "args": {"codes": "$enc.codes", "fmt": "float8_e4m3fn"}},
        {"name": "put", "op": "scatter_by_slot",
         "args": {"cache": "$input.cache", "rows": "$dec.values", "slot_mapping": "$input.slots"}},
    ],
}


def _inputs():
    rng = np.random.default_rng(0)
    return {"x": (rng.standard_normal((4, 8)) * 3).astype(np.float32), "cache": np.zeros((2, 4, 8), np.float32),
            "slots": np.array([5, -1, 0, 2], np.int64)}


def test_run_keeps_every_intermediate_and_the_inputs():
    inp = _inputs()
    t = run_chain(chain_from_dict(CHAIN), inp)
    assert sorted(t) == ["dec.values", "enc.codes", "input.cache", "input.slots", "input.x", "put.cache"]
    assert not t["input.cache"].any()  # the in-place cache was copied before the link wrote it
    np.testing.assert_array_equal(t["put.cache"][1, 1], t["dec.values"][0])  # slot 5 = block 1, row 1
    assert chain_from_dict(CHAIN).edges() == [["input.x", "enc", "x"], ["enc.codes", "dec", "codes"],
                                              ["input.cache", "put", "cache"], ["dec.values", "put", "rows"],
                                              ["input.slots", "put", "slot_mapping"]]


def _golden(tmp_path):
    g = str(tmp_path / "golden")
    write_chain_golden(chain_from_dict(CHAIN), _inputs(), g)
    return g


def _actual(tmp_path, g, change):
    a = tmp_path / "actual"
    a.mkdir()
    for fn in os.listdir(g):
        if fn.endswith(".npy"):
            arr = np.load(os.path.join(g, fn))
            np.save(a / fn, change(fn[:-4], arr))
    return str(a)


def test_identical_tensors_pass_and_the_manifest_records_the_edges(tmp_path):
    g = _golden(tmp_path)
    man = json.load(open(os.path.join(g, "manifest.json")))
    assert man["edges"][1] == ["enc.codes", "dec", "codes"] and man["tensors"]["enc.codes"]["dtype"] == "uint8"
    rep = compare_chain_dirs(g, _actual(tmp_path, g, lambda n, a: a))
    assert rep.passed and rep.first_failure is None


def test_a_kernel_bug_is_told_apart_from_its_propagation(tmp_path, mirror_backend):
    g = _golden(tmp_path)

    def buggy_encode(name, a):  # the device's encode got one code wrong; every later link saw it
        a = a.copy()
        if name == "enc.codes":
            a[0, 0] ^= 1
        if name == "dec.values":
            a[0, 0] = np.float32(np.nextafter(a[0, 0], 100)) if a[0, 0] == 0 else a[0, 0] * np.float32(1.125)
        if name == "put.cache":
            a[1, 1, 0] = a[1, 1, 0] * np.float32(1.125) if a[1, 1, 0] else np.float32(1)
        return a

    act = _actual(tmp_path, g, buggy_encode)
    rep = compare_chain_dirs(g, act)  # no backend under test to re-run on: the inherited failures are undecided
    enc, dec, put = rep.links
    assert not enc.passed and enc.inputs_matched and "own error" in enc.verdict
    assert not dec.passed and not dec.inputs_matched and dec.rerun_passed is None and "undecided" in dec.verdict
    assert rep.first_failure.link == "enc"
    rep = compare_chain_dirs(g, act, rerun_backend=mirror_backend("chain-test-right-device"))
    enc, dec, put = rep.links
    assert not dec.passed and not dec.inputs_matched and dec.rerun_passed and "propagated" in dec.verdict


def test_a_links_own_error_with_matching_inputs(tmp_path):
    g = _golden(tmp_path)

    def bad_decode(name, a):
        a = a.copy()
        if name == "dec.values":
            a[2, 3] = a[2, 3] + np.float32(1)
        return a

    rep = compare_chain_dirs(g, _actual(tmp_path, g, bad_decode))
    assert [r.passed for r in rep.links] == [True, False, True]
    assert rep.first_failure.link == "dec" and rep.first_failure.inputs_matched
    assert "first failing link 'dec': FAIL (own error: its inputs matched)" in str(rep)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["links"][1].update(op="no_such_op"), r"Invalid value for link 'dec' op, actual: 'no_such_op'"),
    (lambda c: c["links"][0]["args"].update(x="$dec.values"), "a cycle or a forward reference"),
    (lambda c: c["links"][1]["args"].update(codes="$dec.values"), "a cycle or a forward reference"),
    (lambda c: c["links"][1]["args"].update(codes="$enc.nothing"), "neither a chain input nor an output"),
    (lambda c: c["links"][1]["args"].update(mystery=1), r"link 'dec' args, actual: \['mystery'\]"),
    (lambda c: c["links"][2].update(name="enc"), "repeats an earlier link's name"),
])
def test_bad_chains_name_the_link_and_the_field(edit, match):
    c = json.loads(json.dumps(CHAIN))
    edit(c)
    with pytest.raises(ChainError, match=match):
        chain_from_dict(c)


def test_an_edge_the_next_operator_refuses_names_the_link(tmp_path):
    c = json.loads(json.dumps(CHAIN))
    c["links"][2]["args"]["rows"] = "$enc.codes"  # uint8 rows into a float32 cache
    with pytest.raises(ChainError, match=r"link 'put' \(scatter_by_slot\).*refused"):
        write_chain_golden(chain_from_dict(c), _inputs(), str(tmp_path / "g"))
    assert not (tmp_path / "g").exists()  # nothing written


def test_cli_exit_status(tmp_path, capsys):
    g = _golden(tmp_path)
    ok = _actual(tmp_path, g, lambda n, a: a)
    assert main(["golden", "compare", g, "--actual", ok, "--chain", "-q"]) == 0
    os.remove(os.path.join(ok, "dec.values.npy"))  # an intermediate missing from the actual tensors
    assert main(["golden", "compare", g, "--actual", ok, "--chain"]) == 2
    err = capsys.readouterr().err
    assert "link 'dec' output 'values'" in err and "missing from the actual tensors" in err


V4_INDEXER = {
    "name": "v4-indexer-side",
    "inputs": ["k", "cache", "cache_scale", "slots", "q", "q_scale", "weights"],
    "links": [
        {"name": "k_cache", "op": "indexer_quant_cache",
         "args": {"cache": "$input.cache", "cache_scale": "$input.cache_scale", "x": "$input.k",
                  "slot_mapping": "$input.slots", "quant_mode": "fp8", "round_scale": True}},
        {"name": "select", "op": "quant_lightning_indexer",
         "args": {"query": "$input.q", "key": "$k_cache.cache", "weights": "$input.weights",
                  "query_dequant_scale": "$input.q_scale",
                  "key_dequant_scale": {"from": "$k_cache.cache_scale", "reshape": [2, 6, 1]},
                  "layout_query": "BSND", "layout_key": "BSND", "sparse_count": 4}},
    ],
}


def _v4_inputs():
    import ml_dtypes

    rng = np.random.default_rng(3)
    q = rng.integers(0, 0x7F, (2, 2, 8, 128), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    q.view(np.uint8)[..., ::2] |= 0x80  # mixed signs
    return {"k": rng.standard_normal((12, 128)).astype(ml_dtypes.bfloat16),
            "cache": np.zeros((2, 6, 1, 128), ml_dtypes.float8_e4m3fn), "cache_scale": np.zeros((2, 6, 1, 1), np.float32),
            "slots": np.arange(12, dtype=np.int32), "q": q, "q_scale": np.full((2, 2, 8), 0.01, np.float32),
            "weights": rng.standard_normal((2, 2, 8)).astype(np.float16)}


def test_v4_indexer_side_chain_finds_the_cache_writer(tmp_path):
    g = str(tmp_path / "golden")
    t = write_chain_golden(chain_from_dict(V4_INDEXER), _v4_inputs(), g)
    assert t["select.sparse_indices"].shape == (2, 2, 1, 4) and (t["select.sparse_indices"] >= 0).all()

    def wrong_scale(name, a):  # the device wrote a doubled scale for slot 7: the indexer then ranked with it
        a = a.copy()
        if name == "k_cache.cache_scale":
            a[1, 1, 0, 0] *= 2
        return a

    rep = compare_chain_dirs(g, _actual(tmp_path, g, wrong_scale))
    k, sel = rep.links
    assert not k.passed and k.inputs_matched and rep.first_failure.link == "k_cache"
    assert sel.passed and not sel.inputs_matched  # the dump kept the golden indices; its key scales differed
    bad = json.loads(json.dumps(V4_INDEXER))
    bad["links"][1]["args"]["key_dequant_scale"]["reshape"] = [5, 5]
    with pytest.raises(ChainError, match=r"link 'select' args.key_dequant_scale.*cannot be reshaped"):
        run_chain(chain_from_dict(bad), _v4_inputs())


def test_cli_backend_reruns_a_failing_link_on_that_backend(tmp_path, capsys):
    """--backend: the link whose inputs already differed is re-run on that backend fed with the golden inputs; a
    backend whose decode is wrong fails that re-run too, so the failure is the link's own, not propagated."""
    from qsfa import _dispatch

    g = _golden(tmp_path)

    def bad_codes(name, a):  # encode wrong, and decode wrong after it
        a = a.copy()
        if name in ("enc.codes",):
            a[0, 0] ^= 1
        if name == "dec.values":
            a[0, 0] = a[0, 0] + np.float32(1)
        return a

    act = _actual(tmp_path, g, bad_codes)
    assert main(["golden", "compare", g, "--actual", act, "--chain"]) == 1
    out = capsys.readouterr().out  # no re-run on the reference (it reproduces the golden): undecided, not propagated
    assert "dec " in out and "FAIL (undecided: its inputs already differed" in out and "propagated" not in out, out

    class Buggy(_dispatch.Backend):
        name = "chain-test-buggy-dec"

    _dispatch.register_backend(Buggy())
    try:
        for name, op in _dispatch.operators().items():
            ref = op.impls["reference"]
            if name == "formats.decode":
                def bad(*args, _ref=ref, **kw):
                    return np.asarray(_ref(*args, **kw)) + np.float32(1)
                _dispatch.register_impl("chain-test-buggy-dec", name, bad)
            else:
                _dispatch.register_impl("chain-test-buggy-dec", name, ref)
        assert main(["golden", "compare", g, "--actual", act, "--chain", "--backend", "chain-test-buggy-dec"]) == 1
    finally:
        _dispatch.unregister_backend("chain-test-buggy-dec")
    out = capsys.readouterr().out
    assert "first failing link 'enc'" in out and "dec " in out and out.count("FAIL (own error)") == 1, out


def test_rerun_on_the_reference_is_refused(tmp_path, capsys):
    """Fed with the golden inputs the reference reproduces the golden: as a re-run backend it would call every
    inherited failure "propagated", a planted bug in the link included."""
    g = _golden(tmp_path)
    act = _actual(tmp_path, g, lambda n, a: a)
    with pytest.raises(ChainError, match="rerun_backend.*reproduces the golden"):
        compare_chain_dirs(g, act, rerun_backend="reference")
    with pytest.raises(ChainError, match="unknown backend"):
        compare_chain_dirs(g, act, rerun_backend="no-such-backend")
    assert main(["golden", "compare", g, "--actual", act, "--chain", "--backend", "reference"]) == 2
    err = capsys.readouterr().err
    assert "--backend reference" in err and err.count("\n") == 1, err


def _cli(capsys, *argv):
    capsys.readouterr()
    rc = main(["golden", "compare", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _edit_chain(g, change):
    path = os.path.join(g, "chain.json")
    with open(path) as f:
        d = json.load(f)
    change(d)
    with open(path, "w") as f:
        json.dump(d, f)


def _link(d, name):
    return next(ln for ln in d["links"] if ln["name"] == name)


@pytest.mark.parametrize("tamper,expect", [
    (lambda d: _link(d, "enc")["args"].update(chip="bogus"), "chip"),
    (lambda d: _link(d, "enc")["args"].update(saturate="yes"), "saturate"),
    (lambda d: _link(d, "dec")["args"].pop("fmt"), "required argument"),
    (lambda d: _link(d, "put")["args"].update(rows={"from": "$dec.values", "reshape": [-1]}), "rows"),
    (lambda d: _link(d, "put")["args"].update(rows={"from": "$dec.values", "reshape": [2 ** 70]}), "reshape"),
    (lambda d: d.update(inputs=[*d["inputs"], "gone"]) or _link(d, "put")["args"].update(slot_mapping="$input.gone"),
     "missing"),
])
def test_a_recorded_call_the_operator_refuses_is_bad_input_before_any_verdict(tmp_path, capsys, tamper, expect):
    """Identical tensors used to pass (exit 0) whatever chain.json said: its links were only checked when one failed
    and was re-run. Every link's recorded call is now checked against its operator's contract first."""
    g = _golden(tmp_path)
    act = _actual(tmp_path, g, lambda n, a: a)
    _edit_chain(g, tamper)
    rc, out, err = _cli(capsys, g, "--actual", act, "--chain")
    assert rc == 2 and expect in err and err.count("\n") == 1 and not out, (rc, out, err)


def test_a_deleted_golden_input_is_bad_input(tmp_path, capsys):
    g = _golden(tmp_path)
    act = _actual(tmp_path, g, lambda n, a: a)
    os.remove(os.path.join(g, "input.slots.npy"))
    rc, _, err = _cli(capsys, g, "--actual", act, "--chain")
    assert rc == 2 and "input.slots" in err and "missing" in err and err.count("\n") == 1, err


def test_broken_chain_folder_files_are_one_line_exit_2(tmp_path, capsys):
    g = _golden(tmp_path)
    act = _actual(tmp_path, g, lambda n, a: a)
    with open(os.path.join(g, "manifest.json"), "w") as f:
        f.write("[1]")
    rc, _, err = _cli(capsys, g, "--actual", act, "--chain")
    assert rc == 2 and "manifest" in err and err.count("\n") == 1, err
    (tmp_path / "2").mkdir()
    g = _golden(tmp_path / "2")
    with open(os.path.join(act, "dec.values.npy"), "wb") as f:
        f.write(b"not an npy file")
    rc, _, err = _cli(capsys, g, "--actual", act, "--chain")
    assert rc == 2 and "dec.values.npy" in err and err.count("\n") == 1, err


def test_a_dump_of_another_dtype_is_bad_input_not_a_verdict(tmp_path, capsys):
    g = _golden(tmp_path)
    act = _actual(tmp_path, g, lambda n, a: a.astype(np.float64) if n == "dec.values" else a)
    rc, out, err = _cli(capsys, g, "--actual", act, "--chain")
    assert rc == 2 and "Invalid dtype for tensor dec.values" in err and "float64" in err, (out, err)
    (tmp_path / "2").mkdir()
    act2 = _actual(tmp_path / "2", g, lambda n, a: a.view(np.int32) if n == "dec.values" else a)
    rc, out, err = _cli(capsys, g, "--actual", act2, "--chain")  # same width: still refused, not reinterpreted
    assert rc == 2 and "int32" in err, (out, err)


def test_a_dump_of_another_width_beside_a_copied_manifest_is_bad_input(tmp_path, capsys):
    """A harness that copies the golden folder and overwrites its tensors keeps manifest.json: its dtype must not
    reinterpret a dump of another width (float64 bytes viewed as float32 doubled the last dimension: a FAIL,
    exit 1, 'own error: its inputs matched')."""
    import shutil

    g = _golden(tmp_path)
    act = _actual(tmp_path, g, lambda n, a: a.astype(np.float64) if n == "dec.values" else a)
    shutil.copy(os.path.join(g, "manifest.json"), os.path.join(act, "manifest.json"))
    rc, out, err = _cli(capsys, g, "--actual", act, "--chain")
    assert rc == 2 and "Invalid dtype for tensor dec.values, actual: 'float64'" in err and "float32" in err, (out, err)


def test_a_backend_that_raises_in_the_rerun_is_an_error_exit_3(tmp_path, capsys, mirror_backend):
    g = _golden(tmp_path)

    def bad_codes(name, a):
        a = a.copy()
        if name == "enc.codes":
            a[0, 0] ^= 1
        if name == "dec.values":
            a[0, 0] = a[0, 0] + np.float32(1)
        return a

    def raising(_ref):
        def impl(*args, **kw):
            raise RuntimeError("device lost")
        return impl

    act = _actual(tmp_path, g, bad_codes)
    be = mirror_backend("chain-test-raising", {"formats.decode": raising})
    rc, out, err = _cli(capsys, g, "--actual", act, "--chain", "--backend", be)
    assert rc == 3 and "ERROR (the re-run raised: RuntimeError: device lost)" in out, (out, err)
    assert out.rstrip().splitlines()[-1].startswith("ERROR chain"), out


@pytest.mark.parametrize("bad,expect", [
    (None, "for inputs['x'], actual: None"),
    (np.ma.masked_array(np.zeros((4, 8), np.float32)), "for inputs['x'], actual: 'a masked array"),
])
def test_run_chain_refuses_bad_inputs_by_name(bad, expect):
    with pytest.raises(ChainError) as ei:
        run_chain(chain_from_dict(CHAIN), {**_inputs(), "x": bad})
    assert expect in str(ei.value), str(ei.value)
    with pytest.raises(ChainError, match="for inputs, actual: 'list'"):
        run_chain(chain_from_dict(CHAIN), [1, 2])


def test_load_chain_on_a_missing_file_or_a_directory_is_one_clear_error(tmp_path):
    from qsfa.chain import load_chain

    with pytest.raises(ChainError, match="no such file"):
        load_chain(str(tmp_path / "nope.json"))
    with pytest.raises(ChainError, match="is a directory"):
        load_chain(str(tmp_path))
    (tmp_path / "c.json").write_text(json.dumps(CHAIN))
    assert load_chain(str(tmp_path / "c.json")).name == CHAIN["name"]
