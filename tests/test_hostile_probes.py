"""The hostile probes of issue 27 that the generated cases (tests/hostile_cases.py) do not reach: the routing front
door ``qsfa.attention``, the public helpers of ``qsfa.formats`` / ``qsfa.layouts`` / ``qsfa.compare`` /
``qsfa.resolve_chip``, errors about a pair of parameters, the generic array / number rules on values the generator
does not build, and torch tensors with ``requires_grad``. Each is refused by a qsfa error naming the parameter
(never a NumPy / Python exception), or accepted where the call is valid."""

from __future__ import annotations

import numpy as np
import pytest

import qsfa
from qsfa import formats, layouts
from qsfa._dispatch import operators

ERRORS = (qsfa.InvalidArgument, qsfa.InvalidDtype)


def _example(op):
    return operators()[op].contract.example(np.random.default_rng(0))


def _refused(fn, param):
    with pytest.raises(ERRORS) as ei:
        fn()
    assert ei.value.param == param, str(ei.value)
    assert str(ei.value).startswith(f"Invalid {ei.value.kind} for {param}, actual: "), str(ei.value)
    return str(ei.value)


# ------------------------------------------------------------------------------------------- qsfa.attention


@pytest.mark.parametrize("key", ["int8", np.int8(3), [[1, 2]]], ids=["str", "numpy_scalar", "list"])
def test_attention_refuses_a_key_that_is_not_an_array(key):
    q = _example("kv_quant_sparse_flash_attention")
    _refused(lambda: qsfa.attention(q["query"], key, sparse_indices=q["sparse_indices"], scale_value=0.1), "key")


def test_attention_refuses_a_query_that_is_not_an_array():
    q = _example("kv_quant_sparse_flash_attention")
    _refused(lambda: qsfa.attention(q["query"].tolist(), q["key"], sparse_indices=q["sparse_indices"],
                                    scale_value=0.1), "query")


def _qsfa_split():
    q = _example("kv_quant_sparse_flash_attention")
    return q, q["query"][..., :512], q["query"][..., 512:]


@pytest.mark.parametrize("bad,kind", [
    (lambda rope: rope[0], "dim"),  # another rank
    (lambda rope: [[1.0]], "type"),  # a list
    (lambda rope: np.concatenate([rope, rope]), "shape"),  # other leading dimensions
    (lambda rope: rope.astype(np.float32), "dtype"),  # would be promoted by the concatenation
])
def test_attention_checks_query_rope_against_query_before_concatenating(bad, kind):
    q, nope, rope = _qsfa_split()
    msg = _refused(lambda: qsfa.attention(nope, q["key"], sparse_indices=q["sparse_indices"], scale_value=0.1,
                                          query_rope=bad(rope)), "query_rope")
    assert msg.startswith(f"Invalid {kind} for query_rope"), msg


def test_attention_query_rope_of_another_kind_than_query():
    torch = pytest.importorskip("torch")
    q, nope, rope = _qsfa_split()
    msg = _refused(lambda: qsfa.attention(nope, q["key"], sparse_indices=q["sparse_indices"], scale_value=0.1,
                                          query_rope=torch.zeros(rope.shape)), "query_rope")
    assert "a torch tensor" in msg and "a NumPy array" in msg


def test_attention_split_query_rope_equals_the_joined_query():
    q, nope, rope = _qsfa_split()
    joined = qsfa.attention(q["query"], q["key"], sparse_indices=q["sparse_indices"], scale_value=0.1)[0]
    split = qsfa.attention(nope, q["key"], sparse_indices=q["sparse_indices"], scale_value=0.1, query_rope=rope)[0]
    assert joined.tobytes() == split.tobytes()


# ------------------------------------------------------------------------------------- writers: pairs, zero rows


def test_zero_row_k_nope_is_reported_with_both_row_counts():
    a = _example("c8_cache_write")
    msg = _refused(lambda: qsfa.c8_cache_write(**{**a, "k_nope": a["k_nope"][:0]}), "k_rope")
    assert "k_nope has T = 0 rows" in msg


def test_scatter_dtype_mismatch_names_both_dtypes():
    a = _example("scatter_by_slot")
    msg = _refused(lambda: qsfa.scatter_by_slot(**{**a, "cache": a["cache"].astype(np.float32)}), "rows")
    assert "uint8 (cache: float32)" in msg


def test_kv_compress_epilog_with_zero_tokens_writes_nothing():
    a = _example("kv_compress_epilog")
    before = a["cache"].tobytes()
    out = qsfa.kv_compress_epilog(**{**a, "x": a["x"][:0], "slot_mapping": a["slot_mapping"][:0]})
    assert out is a["cache"] and a["cache"].tobytes() == before


@pytest.mark.parametrize("value", [5e-324, 0.5])
def test_hifloat8_dst_type_max_below_one_is_refused(value):
    a = _example("c8_cache_write")
    before = a["kv_cache"].tobytes()
    _refused(lambda: qsfa.c8_cache_write(**{**a, "key_dtype": "hifloat8", "dst_type_max": value}), "dst_type_max")
    assert a["kv_cache"].tobytes() == before


def test_hifloat8_dst_type_max_one_is_accepted_and_scales_are_finite():
    a = _example("c8_cache_write")
    qsfa.c8_cache_write(**{**a, "key_dtype": "hifloat8", "dst_type_max": 1.0})
    written = a["kv_cache"].reshape(-1, 656)[[0, 5, 11, 3]]
    scales = np.ascontiguousarray(written[:, 640:656]).view("<f4")
    assert np.isfinite(scales).all()


# --------------------------------------------------------------------------- generic array and number rules


def test_masked_array_without_a_mask_set_is_refused_too():
    """One rule, whatever the mask: a masked array is refused by name (docs/architecture.md)."""
    a = _example("dynamic_block_quant")
    msg = _refused(lambda: qsfa.dynamic_block_quant(**{**a, "x": np.ma.masked_array(a["x"])}), "x")
    assert "masked array" in msg


def test_matrix_in_place_buffer_is_written_through_its_base_view():
    """An ndarray subclass is read as the base ndarray it views: the write lands in the caller's np.matrix."""
    import warnings

    cache = np.arange(96, dtype=np.uint8).reshape(3, 32)  # [block_num, block_size]: one byte per slot
    rows = np.array([200, 201, 202], np.uint8)
    slots = np.array([5, -1, 70], np.int64)
    want = cache.copy().reshape(-1)
    want[[5, 70]] = [200, 202]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        m = np.asmatrix(cache.copy())
    out = qsfa.scatter_by_slot(m, rows, slots)
    assert out is m and np.asarray(m).reshape(-1).tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16])
def test_numpy_integers_of_any_width_are_their_value(dtype):
    a = _example("c8_rmsnorm_rope_cache")
    ref = a["kv_cache"].copy()
    qsfa.c8_rmsnorm_rope_cache(**{**a, "kv_cache": ref})
    got = a["kv_cache"].copy()
    qsfa.c8_rmsnorm_rope_cache(**{**a, "kv_cache": got, "rope_head_dim": dtype(64)})
    assert got.tobytes() == ref.tobytes()


@pytest.mark.parametrize("value,param,op", [
    (1 << 1024, "scale_value", "kv_quant_sparse_flash_attention"),
    (1e300, "scale_value", "sparse_flash_attention"),
    (-(1 << 1024), "epsilon", "c8_rmsnorm_rope_cache"),
    (1e39, "x_scale", "kv_compress_epilog"),
    (1 << 1024, "min_scale", "dynamic_block_quant"),
])
def test_floats_beyond_float64_or_float32_are_refused_by_name(value, param, op):
    from qsfa.chips import front_door

    a = _example(op)
    msg = _refused(lambda: front_door(op)(**{**a, param: value}), param)
    assert "float" in msg


def test_requires_grad_output_buffer_is_refused_and_input_is_read():
    torch = pytest.importorskip("torch")
    from qsfa._arrays import to_torch

    a = _example("merge_attention_lse")
    t = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in a.items()}
    ref = qsfa.merge_attention_lse(**t)
    t2 = dict(t, attention_out=t["attention_out"].clone().requires_grad_(True))
    got = qsfa.merge_attention_lse(**t2)  # read (detached): the same result
    assert torch.equal(got[0], ref[0]) if isinstance(got, tuple) else torch.equal(got, ref)
    q = _example("kv_quant_sparse_flash_attention")
    from qsfa.ops._out_buffers import expected_out

    shape, dt = expected_out(q, lambda _: 512)
    tq = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in q.items()}
    buf = torch.zeros(shape, dtype=torch.bfloat16 if dt.name == "bfloat16" else torch.float16, requires_grad=True)
    _refused(lambda: qsfa.kv_quant_sparse_flash_attention(**{**tq, "attention_out": buf}), "attention_out")
    assert not buf.detach().any()


# ----------------------------------------------------------------------------------------- public helpers


@pytest.mark.parametrize("call,param", [
    (lambda: formats.out_of_range(np.zeros(3, np.float32), "float8_e4m3fn", rounding="bogus"), "rounding"),
    (lambda: formats.out_of_range("x", "float8_e4m3fn"), "x"),
    (lambda: formats.group_amax(np.zeros((2, 8)), 0), "group"),
    (lambda: formats.group_amax(np.float32(1), 4), "x"),
    (lambda: formats.int8_dynamic_quant(np.zeros((2, 8)), group=0), "group"),
    (lambda: formats.int8_dynamic_quant(np.zeros((2, 8)), order="bogus"), "order"),
    (lambda: formats.dynamic_block_scale(np.ones(3), "x"), "type_max"),
    (lambda: formats.dynamic_block_scale(np.ones(3), 0), "type_max"),
    (lambda: formats.dynamic_block_scale(np.ones(3), 448.0, min_scale=-1.0), "min_scale"),
    (lambda: formats.flashmla_v32_scale(np.ones(3), ceil_mode="bogus"), "ceil_mode"),
    (lambda: formats.ocp_mx_scale_exponent(np.ones(3), "a"), "elem_emax"),
    (lambda: formats.e8m0_byte("a"), "s"),
    (lambda: formats.round_scale_pow2(np.ma.masked_array([1.0])), "s"),
    (lambda: formats.round_scale_pow2(np.float32("nan")), "s"),
    (lambda: formats.round_scale_pow2([1.0, -1.0]), "s"),
    (lambda: formats.e8m0_byte(np.array([-1.0], np.float32)), "s"),
    (lambda: formats.int8_dynamic_scale(np.zeros(2, [("a", "f4")])), "amax"),
    (lambda: layouts.flashmla_model1_block_bytes(-5), "block_size"),
    (lambda: layouts.flashmla_model1_block_bytes("a"), "block_size"),
    (lambda: layouts.flashmla_model1_block_bytes(1.5), "block_size"),
    (lambda: layouts.nz_columns("bogus"), "dtype"),
    (lambda: layouts.nz_columns(np.float32), "dtype"),
    (lambda: layouts.nd_to_nz(np.zeros((1, 16, 1, 32), np.float16), 0), "c"),
    (lambda: layouts.nd_to_nz(np.zeros((1, 16, 1, 32), np.float16), -16), "c"),
    (lambda: layouts.nd_to_nz(np.zeros((1, 16, 1, 32), np.float16), True), "c"),
    (lambda: qsfa.compare.compare("a", "b"), "actual"),
    (lambda: qsfa.compare.ulp_distance(np.zeros(3), np.zeros(3), "bogus"), "dtype"),
    (lambda: qsfa.compare.cos_diff(np.zeros(3), np.zeros(4)), "golden"),
    (lambda: qsfa.compare.compare_bytes(np.zeros(3), np.zeros(3), max_report=-1), "max_report"),
    (lambda: qsfa.compare.compare_bytes(np.zeros(3, np.uint8), np.zeros(3, np.uint8), fmt="fp8"), "fmt"),
    (lambda: qsfa.compare.compare(np.zeros(3, np.uint8), np.zeros(3, np.uint8), fmt="fp8"), "fmt"),
    (lambda: qsfa.chips.qsfa_numerics("A9", {}), "chip"),
    (lambda: qsfa.chips.sharedkv_numerics("A2", {}), "args"),
    (lambda: qsfa.chips.sharedkv_numerics("950", {"q": np.zeros(2, np.float32)}), "args"),
    (lambda: qsfa.chips.krr_numerics(None, {}), "chip"),
    (lambda: qsfa.chips.dbq_numerics("A2", None), "args"),
    (lambda: qsfa.resolve_chip("bogus_op"), "op"),
    (lambda: qsfa.resolve_chip("kv_quant_sparse_flash_attention", 1, 2), "arguments"),
])
def test_public_helpers_refuse_bad_arguments_by_name(call, param):
    _refused(call, param)


@pytest.mark.parametrize("call", [lambda: layouts.unpack_rows(np.zeros((), np.uint8)),
                                  lambda: layouts.dequant_rows(np.zeros((), np.uint8)),
                                  lambda: layouts.qsfa_to_flashmla_v32(np.zeros((), np.uint8)),
                                  lambda: layouts.flashmla_v32_to_qsfa(np.zeros((), np.uint8))])
def test_a_zero_dim_row_array_is_told_its_dimensions_not_its_dtype(call):
    """a 0-d uint8 array has the right dtype: it was refused as "Invalid dtype for rows, actual: ()" (unpack_rows,
    dequant_rows) or raised IndexError (the FlashMLA V32 conversions)."""
    assert _refused(call, "rows").startswith("Invalid dim for rows, actual: 0, reason: needs at least one dimension")


def test_public_helpers_still_take_numbers_lists_and_numpy_integers():
    assert formats.group_amax([[1.0, -3.0, 2.0]], np.uint8(2)).tolist() == [[3.0, 2.0]]
    assert layouts.flashmla_model1_block_bytes(np.uint16(64)) == 37440
    assert layouts.nz_columns(np.int8) == 32 and layouts.nz_columns("bfloat16") == 16
    assert layouts.nd_to_nz(np.zeros((1, 16, 1, 32), np.float16), np.int64(32)).shape == (1, 1, 16, 1, 32)
    assert formats.e8m0_byte(1.0).reshape(-1).tolist() == [127]
    assert formats.e8m0_byte([np.inf, np.nan, -0.0]).reshape(-1).tolist() == [0xFF, 0xFF, 0]
    assert formats.round_scale_pow2([np.inf, 3.0, 0.0]).reshape(-1).tolist() == [np.inf, 4.0, 0.0]
    assert qsfa.compare.cos_diff([1.0, 2.0], [1.0, 2.0]) == 0.0


# ------------------------------------------------------------------------------------------------ command line


def _cli(capsys, argv):
    from qsfa.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,option", [
    (["golden", "generate", "--set", "smoke", "--out", ""], "--out"),
    (["golden", "generate", "--set", "smoke", "--out", "   "], "--out"),
    (["conformance", "--time-budget", "nan"], "--time-budget"),
    (["conformance", "--time-budget", "-1"], "--time-budget"),
    (["conformance", "--time-budget", "inf"], "--time-budget"),
    (["conformance", "--replay", "{dir}"], "--replay"),
    (["golden", "generate", "--case", "{dir}", "--out", "{dir}/o"], "--case"),
])
def test_cli_refuses_empty_out_non_finite_budget_and_directories(argv, option, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _cli(capsys, [a.replace("{dir}", str(tmp_path)) for a in argv])
    assert rc == 2 and f"argument {option}: Invalid value, actual: " in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written (not into the current folder either)


def _dbq_case(tmp_path, **params):
    from qsfa.golden.catalogue import get_set

    case = next(c for c in get_set("smoke").cases() if c.op == "dynamic_block_quant")
    path = tmp_path / "c.json"
    case.save(str(path))
    import json

    d = json.loads(path.read_text())
    d["params"].update(params)
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("params,field", [
    (dict(M=-16), "M"), (dict(M=16.5), "M"), (dict(M=True), "M"), (dict(M=1 << 20, N=1 << 20), "M"),
])
def test_case_file_dimension_fields_are_refused_by_name(params, field, tmp_path, capsys):
    path = _dbq_case(tmp_path, **params)
    rc, out, err = _cli(capsys, ["golden", "generate", "--case", str(path), "--out", str(tmp_path / "o"), "-q"])
    assert rc == 2 and f"Invalid value for params.{field}, actual: " in err, err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()



# ----------------------------------------------------------------------------------------- a shadowing clone


@pytest.mark.parametrize("installed", [True, False])
def test_a_clone_named_qsfa_in_the_script_folder(installed, tmp_path):
    """A script run from the folder that holds a clone named ``qsfa`` finds the clone's root first. Its __init__.py
    goes on with the qsfa installed elsewhere (here: on PYTHONPATH), or, with none, says what happened - instead of
    the empty namespace package that gave "module 'qsfa' has no attribute 'c8_cache_write'"."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "qsfa").symlink_to(root, target_is_directory=True)
    (tmp_path / "script.py").write_text("import qsfa\nprint(qsfa.__file__, qsfa.c8_cache_write.__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if installed:
        env["PYTHONPATH"] = root
    cmd = [sys.executable] + ([] if installed else ["-S"]) + ["script.py"]  # -S: no site-packages, no install
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if installed:
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == [os.path.join(root, "qsfa", "__init__.py"), "c8_cache_write"]
    else:
        assert r.returncode == 1
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError: 'import qsfa' found ") and "root folder of a qsfa clone" in last, \
            r.stderr


@pytest.mark.parametrize("call,param", [
    (lambda: qsfa.chips.attention_rounding("A9", "bfloat16"), "chip"),
    (lambda: qsfa.chips.attention_rounding("A2", "bogus"), "qdtype"),
    (lambda: qsfa.chips.chip_violation("bogus"), "op"),
])
def test_chip_helpers_refuse_bad_arguments_by_name(call, param):
    _refused(call, param)
