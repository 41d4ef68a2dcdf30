"""The float criterion decided for attention outputs (docs/numerics/comparison.md#float-criterion): an element
passes when |actual - golden| <= atol + rtol * |golden| (torch.testing.assert_close's form), plus cos_diff."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qsfa.compare import TOLERANCES, Tolerance, compare_float

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_elementwise_bound_is_atol_plus_rtol_times_golden():
    # bf16: atol 6e-2, rtol 2^-7 -> at |golden| = 1 the bound is 0.0678125. 1.0625 (error 0.0625) passes - it fails
    # both halves of FlashMLA's "abs < atol or rel < rtol" - and 1.0703125 (error 0.0703) fails.
    g = np.ones(4, BF16)
    cos_free = Tolerance(atol=6e-2, rtol=7.8125e-3, cos_tol=1.0)
    ok = np.array([1, 1.0625, 1, 1], BF16)
    bad = np.array([1, 1.0703125, 1, 1], BF16)
    assert compare_float(ok, g, dtype="bfloat16", tol=cos_free).passed
    r = compare_float(bad, g, dtype="bfloat16", tol=cos_free)
    assert not r.passed and r.n_fail == 1 and r.worst[0]["index"] == [1]


def test_fp16_bound_at_zero_golden_is_atol():
    g = np.zeros(3, np.float16)
    tol = Tolerance(**{**TOLERANCES["float16"].__dict__, "cos_tol": 1.0})
    assert compare_float(np.array([0, 2.4e-5, 0], np.float16), g, dtype="float16", tol=tol).passed
    assert not compare_float(np.array([0, 3e-5, 0], np.float16), g, dtype="float16", tol=tol).passed


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_matches_torch_assert_close(dtype):
    """Element verdicts equal torch.testing.assert_close with the same atol / rtol (cos_diff set aside)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    t = TOLERANCES[dtype]
    g = rng.standard_normal(4000).astype(np.float32) * np.float32(4)
    width = np.repeat(np.array([0.2, 1.05] * 5, np.float32), 400)  # slices well inside / just around the bound
    a = g + rng.uniform(-1, 1, 4000).astype(np.float32) * width * (np.float32(t.atol) + np.float32(t.rtol) * np.abs(g))
    a64, g64 = a.astype(np.float64), g.astype(np.float64)
    tol = Tolerance(t.atol, t.rtol, cos_tol=1.0)
    seen = set()
    for i in range(0, 4000, 400):  # ten slices: the narrow ones pass, the wide ones fail
        sa, sg = a64[i:i + 400], g64[i:i + 400]
        mine = compare_float(sa, sg, dtype="float64", tol=tol).passed
        try:
            torch.testing.assert_close(torch.from_numpy(sa), torch.from_numpy(sg), atol=t.atol, rtol=t.rtol)
            theirs = True
        except AssertionError:
            theirs = False
        assert mine == theirs, i
        seen.add(mine)
    assert seen == {True, False}


def test_a_non_finite_mismatch_reports_its_error_as_nan_or_inf_and_ranks_worst():
    import math

    from qsfa.compare import compare_float
    from qsfa.golden.compare import CompareReport, OutputResult, format_report

    g = np.zeros(5, np.float32)
    a = g.copy()
    a[0] = 0.5  # a large finite failure, listed after the non-finite ones
    a[3] = np.nan
    a[4] = np.inf
    res = compare_float(a, g, dtype="float32")
    assert not res.passed
    idx = [w["index"] for w in res.worst]
    assert idx[:3] == [[3], [4], [0]], idx
    w_nan, w_inf, w_fin = res.worst[:3]
    assert math.isnan(w_nan["abs_err"]) and math.isnan(w_nan["rel_err"])
    assert w_inf["abs_err"] == math.inf and w_inf["rel_err"] == math.inf
    assert w_fin["abs_err"] == 0.5
    text = format_report(CompareReport("g", "a", [OutputResult("c", "out", "float", res, "a.bin", 0)]))
    assert "abs_err nan rel_err nan" in text and "abs_err 0 rel_err 0" not in text, text


def test_signalling_nans_compare_without_a_cast_warning():
    import warnings

    from qsfa.compare import compare_bytes, compare_float

    g = np.zeros(2, np.float32)
    a = np.array([0x7F800001, 0], np.uint32).view(np.float32)  # a signalling NaN, then an equal element
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rf = compare_float(a, g, dtype="float32")
        rb = compare_bytes(a, g)
    assert not rf.passed and not rb.passed
    assert np.isnan(rf.worst[0]["actual"]) and np.isnan(rb.worst[0]["actual"])


def test_a_float_of_another_dtype_fails_unless_a_criterion_is_named():
    """An fp16 actual against a bf16 golden is not judged by bf16 tolerances silently (hostile review M6)."""
    from qsfa import compare as C

    g = np.linspace(-2, 2, 64).astype(ml_dtypes.bfloat16)
    a16 = g.astype(np.float32).astype(np.float16)
    for res in (compare_float(a16, g), C.compare(a16, g)):
        assert not res.passed and "dtype mismatch: actual float16, golden bfloat16" in res.message
    assert compare_float(g.copy(), g).passed and C.compare(g.copy(), g).passed
    # naming the criterion compares values of any float dtype under it (what the benchmarks do in float32)
    assert compare_float(a16, g, dtype="bfloat16").passed
    assert compare_float(g.astype(np.float32), g, dtype="bfloat16").passed


@pytest.mark.parametrize("bad", ["foo", "int8", "bf16"])
def test_an_unknown_criterion_dtype_is_refused(bad):
    from qsfa._errors import InvalidArgument

    g = np.zeros(4, np.float32)
    with pytest.raises(InvalidArgument) as e:
        compare_float(g, g, dtype=bad)
    assert e.value.param == "dtype"


def test_message_puts_what_the_verdict_rests_on_before_the_diagnostics():
    """A PASS beside a large max_rel (values near 0) reads as a PASS: the verdict's grounds (elements outside the
    tolerance, cos_diff against its limit) come first, max_rel and the 0.1% share after 'diagnostics, not judged'
    (issue 27)."""
    g = np.array([1.0, 2.0, 3.0, 0.0], np.float32)
    a = np.array([1.0, 2.0, 3.0, 1e-5], np.float32)  # relative error 10 where the golden is 0, within atol
    res = compare_float(a, g)
    assert res.passed and res.max_rel > 1
    verdict, diagnostics = res.message.split(" | diagnostics, not judged: ")
    assert verdict.startswith("PASS: 0 of 4 elements outside atol=") and "cos_diff=" in verdict and "<=" in verdict
    assert "max_rel" not in verdict and diagnostics.startswith("max_abs=") and "max_rel=" in diagnostics


def test_extreme_finite_values_warn_nothing_and_cos_diff_stays_defined():
    """Opposite values near float64's max: |a - g| and a^2 overflow to inf; no RuntimeWarning leaks, and cos_diff
    is computed on scaled values (the vectors are opposite in their dominant element: cos_diff ~ 2, not NaN)."""
    import warnings

    from qsfa.compare import compare, cos_diff

    m = np.finfo(np.float64).max
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = compare(np.array([m, 1.0]), np.array([-m, 1.0]), standard="all")
        assert not r.passed and r.max_abs == float("inf")
        assert cos_diff(np.array([m, 1.0]), np.array([-m, 1.0])) == 2.0
        assert cos_diff(np.array([1e200, 1e200]), np.array([1e200, 1e200])) == 0.0
        compare(np.array([np.inf, 1.0]), np.array([m, 1.0]), standard="all")
