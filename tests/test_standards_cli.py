"""--standard / --verdict-by on ``qsfa golden compare`` and ``qsfa conformance``, and ``conformance --repeat``
(docs/numerics/comparison.md#standards): every requested standard is reported beside qsfa's verdict, which stays
the exit status unless --verdict-by names a standard."""

import json
import shutil

import ml_dtypes
import numpy as np
import pytest

from qsfa._dispatch import Backend, register_backend, register_impl, unregister_backend
from qsfa.cli import main
from qsfa.reference import formats as F

ATT = "rope0-tnd-tnd-bfloat16-lse1-rope64"  # a bf16 attention output of the smoke set


def _actual_with(smoke, tmp_path, edit):
    actual = tmp_path / "actual"
    shutil.copytree(smoke, actual)
    p = actual / ATT / "out.attention_out.bin"
    g = np.fromfile(p, np.uint16).view(ml_dtypes.bfloat16)
    a = edit(g.astype(np.float32)).astype(ml_dtypes.bfloat16)
    a.view(np.uint16).tofile(p)
    return actual


def _run(capsys, *argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().out


def test_golden_compare_strict_fails_ops_transformer_passes(smoke, tmp_path, capsys):
    def few_large(a):  # 10 of 5120 elements 0.1 off: beyond qsfa's atol 6e-2, within ops-transformer's 0.5%
        a[:10] += 0.1
        return a

    actual = _actual_with(smoke, tmp_path, few_large)
    base = ("golden", "compare", smoke, "--actual", actual, "--case", ATT, "--output", "attention_out")
    rc, out = _run(capsys, *base, "--standard", "ops-transformer", "--json", tmp_path / "c.json")
    assert rc == 1 and "verdict: FAIL" in out
    assert f"{ATT}/attention_out ops-transformer: PASS" in out and "  ops-transformer: PASS" in out
    d = json.loads((tmp_path / "c.json").read_text())
    assert d["verdict"] == "FAIL" and d["standards"] == {"ops-transformer": "PASS"}
    fig = d["results"][0]["standards"]["ops-transformer"]
    assert fig["mismatches"] == 10 and fig["passed"] is True and fig["fail_ratio_limit"] == 0.005
    rc, out = _run(capsys, *base, "--verdict-by", "ops-transformer", "-q")
    assert rc == 0 and out.strip() == "verdict: FAIL (0 of 1 outputs pass); by ops-transformer: PASS (the exit status)"


def test_golden_compare_strict_passes_ops_transformer_fails(smoke, tmp_path, capsys):
    def small_offsets(a):  # 1% of the elements, small ones, 0.005 off: inside atol 6e-2, outside 1e-4 + 2^-7 |g|
        idx = np.flatnonzero(np.abs(a) < 0.3)[:52]
        a[idx] += 0.005
        return a

    actual = _actual_with(smoke, tmp_path, small_offsets)
    base = ("golden", "compare", smoke, "--actual", actual, "--case", ATT, "--output", "attention_out")
    rc, out = _run(capsys, *base, "--standard", "ops-transformer", "--standard", "torch-npu")
    assert rc == 0 and "verdict: PASS" in out and "  ops-transformer: FAIL" in out and "  torch-npu: FAIL" in out
    rc, out = _run(capsys, *base, "--standard", "all", "--verdict-by", "ops-transformer")
    assert rc == 1 and "by ops-transformer: FAIL (the exit status)" in out
    assert "atk-dual: n/a (reason=needs exact and benchmark)" in out  # a golden directory holds neither


def test_unknown_standard_is_bad_usage(smoke, capsys):
    with pytest.raises(SystemExit) as e:
        main(["golden", "compare", str(smoke), "--actual", str(smoke), "--standard", "nope"])
    assert e.value.code == 2


class _OneStepUp(Backend):
    """E4M3 codes one representable value above the reference's (finite codes only); other formats exact."""
    name = "toy_e4m3_one_step"
    array_kind = "numpy"
    description = "test backend: E4M3 codes one step off"


class _Flaky(Backend):
    """Correct on odd calls, the last code bit flipped on even ones: not deterministic."""
    name = "toy_flaky_encode"
    array_kind = "numpy"
    description = "test backend: alternates between two results"


@pytest.fixture
def toys():
    register_backend(_OneStepUp())
    register_backend(_Flaky())

    def one_step(x, fmt, saturate=False, rounding=None):
        c = F.encode(x, fmt, saturate=bool(saturate), rounding=rounding)
        if fmt == "float8_e4m3fn":
            c = c.copy()
            up = (c & 0x7F) < 0x7E
            c[up] += 1
        return c

    calls = [0]

    def flaky(x, fmt, saturate=False, rounding=None):
        calls[0] += 1
        c = F.encode(x, fmt, saturate=bool(saturate), rounding=rounding)
        return c ^ np.uint8(calls[0] % 2 == 0)

    register_impl(_OneStepUp.name, "formats.encode", one_step)
    register_impl(_Flaky.name, "formats.encode", flaky)
    yield
    unregister_backend(_OneStepUp.name)
    unregister_backend(_Flaky.name)


def test_conformance_standard_reported_and_verdict_by(toys, tmp_path, capsys):
    base = ("conformance", "--backend", _OneStepUp.name, "--properties", "formats.encode.vs_reference",
            "--max-examples", "3", "--cases-dir", tmp_path / "cases", "-q", "--standard", "quant-codes")
    rc, out = _run(capsys, *base, "--verdict-by", "quant-codes", "--report", tmp_path / "r.json", tmp_path / "r.md")
    assert rc == 0  # E4M3 codes one step off: quant-codes passes them, and decides
    rep = json.loads((tmp_path / "r.json").read_text())
    t = rep["results"][0]["standards"]["quant-codes"]
    assert t["judged"] >= 1 and t["failed"] == 0 and t["strict_failed"] >= 1  # qsfa's bytes criterion refuses them
    line = next(s for s in out.splitlines() if "quant-codes" in s)
    assert line == (f"  formats.encode.vs_reference quant-codes: PASS (0 of {t['judged']} judged outputs fail; "
                    f"qsfa's criterion: {t['strict_failed']})")
    assert "## Standards" in (tmp_path / "r.md").read_text()


def test_conformance_verdict_by_fails_where_the_standard_fails(toys, tmp_path, capsys):
    # E4M3 codes one step off: ops-transformer compares them as uint8 codes (57 vs 56 is beyond 5e-3 relative)
    rc, out = _run(capsys, "conformance", "--backend", _OneStepUp.name, "--properties", "formats.encode.vs_reference",
                   "--max-examples", "1", "--cases-dir", tmp_path / "cases", "-q", "--verdict-by", "ops-transformer",
                   "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert rc == 1 and "FAIL by ops-transformer (strict: FAIL)" in r["message"]


def test_conformance_repeat_finds_a_backend_that_is_not_deterministic(toys, tmp_path, capsys):
    base = ("conformance", "--backend", _Flaky.name, "--properties", "formats.encode.vs_reference",
            "--max-examples", "3", "--cases-dir", tmp_path / "cases", "--report", tmp_path / "r.json", "-q")
    rc, _ = _run(capsys, *base, "--repeat", "3")
    msg = json.loads((tmp_path / "r.json").read_text())["results"][0]["message"]
    assert rc == 1 and "is not deterministic: run 2 of 3 differs from run 1 byte for byte" in msg
    rc, _ = _run(capsys, "conformance", "--properties", "formats.encode.vs_reference", "--max-examples", "3",
                 "--cases-dir", tmp_path / "cases", "--repeat", "3", "-q")
    assert rc == 0  # the reference is deterministic


def test_conformance_repeat_must_be_positive(capsys):
    assert main(["conformance", "--properties", "formats.encode.vs_reference", "--repeat", "0"]) == 2
    assert "Invalid value for --repeat, actual: 0" in capsys.readouterr().err


def test_verdict_by_a_standard_that_judges_nothing_is_bad_usage(smoke, tmp_path, capsys):
    """atk-dual needs exact and benchmark outputs: on a golden directory (or a conformance run) it judges no output,
    so identical data used to give "by atk-dual: FAIL", exit 1."""
    base = ("golden", "compare", smoke, "--actual", smoke, "--case", ATT, "--output", "attention_out")
    capsys.readouterr()
    rc = main([str(a) for a in (*base, "--verdict-by", "atk-dual")])
    out, err = capsys.readouterr()
    assert rc == 2 and "--verdict-by" in err and "needs exact and benchmark" in err and err.count("\n") == 1, err
    capsys.readouterr()
    rc = main([str(a) for a in (*base, "--verdict-by", "quant-codes")])  # no rule for bfloat16 outputs
    out, err = capsys.readouterr()
    assert rc == 2 and "no rule for any of the 1 selected outputs" in err, err
    capsys.readouterr()
    rc = main(["conformance", "--ops", "formats.encode", "--max-examples", "1", "--cases-dir", str(tmp_path / "c"),
               "-q", "--verdict-by", "atk-dual"])
    out, err = capsys.readouterr()
    assert rc == 2 and "needs exact and benchmark" in err and not (tmp_path / "c").exists(), err


def test_a_standard_na_on_every_output_is_na_overall(smoke, tmp_path, capsys):
    base = ("golden", "compare", smoke, "--actual", smoke, "--case", ATT, "--output", "attention_out")
    for std in ("all", "atk-dual"):
        rc, out = _run(capsys, *base, "--standard", std, "--json", tmp_path / f"{std}.json")
        assert rc == 0 and "  atk-dual: n/a" in out and "  atk-dual: PASS" not in out, out
        d = json.loads((tmp_path / f"{std}.json").read_text())
        assert d["standards"]["atk-dual"] == "n/a", d["standards"]
    assert d["standards"] == {"atk-dual": "n/a"}
    assert json.loads((tmp_path / "all.json").read_text())["standards"]["ops-transformer"] == "PASS"
