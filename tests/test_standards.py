"""qsfa.standards: every acceptance standard on hand-built outputs on both sides of each threshold
(docs/numerics/comparison.md#standards). Expected verdicts come from the thresholds, never from the code."""

import json
import math

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa import standards as S
from qsfa.compare import compare

BF16 = ml_dtypes.bfloat16


def _ones(n, dt=np.float32):
    return np.ones(n, dt)


# ---------------------------------------------------------------------------------------------------------- ops-transformer

@pytest.mark.parametrize("k, passed", [(5, True), (6, False)])  # 0.5% of 1000 fail: at the limit it passes
def test_ops_transformer_fail_ratio_limit(k, passed):
    g = _ones(1000, np.float16)
    a = g.copy()
    a[:k] = np.float16(1.01)
    r = S.ops_transformer(a, g, dtype="float16")
    assert r["mismatches"] == k and r["fail_ratio"] == k / 1000
    assert r["passed"] is passed


def test_ops_transformer_max_relative_error_fails_only_through_non_finite():
    g = _ones(1000, np.float16)
    a = g.copy()
    a[0] = np.float16(-60000.0)  # finite: |a - g| / max(|a|, |g|) <= 2, far below 10
    r = S.ops_transformer(a, g, dtype="float16")
    assert r["passed"] and r["max_relative_error"] <= 2
    a[0] = np.inf  # inf / inf: nan, which is not < 10
    r = S.ops_transformer(a, g, dtype="float16")
    assert r["fail_ratio"] == 0.001 and not r["passed"] and math.isnan(r["max_relative_error"])


@pytest.mark.parametrize("ulps, mismatches", [(1, 0), (2, 1)])
def test_ops_transformer_bf16_tolerances(ulps, mismatches):
    g = _ones(4, BF16)  # one bf16 ulp at 1.0 is 2^-7 = rtol: inside; two ulps outside
    a = g.copy()
    a[0] = BF16(1 + ulps * 2.0 ** -7)
    assert S.ops_transformer(a, g, dtype="bfloat16")["mismatches"] == mismatches
    # the fp16 tolerances (rtol 5e-3) would refuse even one bf16 ulp
    assert S.ops_transformer(a.astype(np.float32), g.astype(np.float32), dtype="float16")["mismatches"] == 1


def test_ops_transformer_fp8_codes_compared_by_value():
    g = np.full(8, 0x38, np.uint8)  # E4M3 1.0
    a = g.copy()
    a[0] = 0x39  # 1.125: beyond 2.5e-5 + 5e-3 * 1
    a[1] = 0x80  # -0 against 1.0
    r = S.ops_transformer(a, g, dtype="float8_e4m3fn")
    assert r["mismatches"] == 2 and not r["passed"]
    r = S.ops_transformer(np.full(8, 0x80, np.uint8), np.zeros(8, np.uint8), dtype="float8_e4m3fn")
    assert r["mismatches"] == 0  # -0 == +0 by value (as uint8 codes, 128 against 0 would differ)


# ---------------------------------------------------------------------------------------------------------- ATK

@pytest.mark.parametrize("factor, passed", [(0.99, True), (1.01, False)])
def test_atk_single_mere(factor, passed):
    t = 2.0 ** -10
    g = np.ones(100)
    a = g + factor * t * (1 + 1e-7)  # relative error factor * T exactly (denominator |g| + 1e-7)
    r = S.atk_single(a, np.zeros(100), dtype="float16", exact=g)
    assert r["reference"] == "exact" and math.isclose(r["mere"], factor * t, rel_tol=1e-9)
    assert r["passed"] is passed


@pytest.mark.parametrize("factor, passed", [(0.99, True), (1.01, False)])
def test_atk_single_mare(factor, passed):
    t = 2.0 ** -7
    g = np.ones(100)
    a = g.copy()
    a[7] += factor * 10 * t * (1 + 1e-7)  # MERE = factor * T / 10, well inside; MARE decides
    r = S.atk_single(a, g, dtype="bfloat16")
    assert r["mere"] < t and r["passed"] is passed


def test_atk_single_thresholds_and_refusal():
    assert S.ATK_THRESHOLD == {"float16": 2 ** -10, "bfloat16": 2 ** -7, "float32": 2 ** -13, "hifloat32": 2 ** -11,
                               "float8_e4m3fn": 2 ** -3, "float8_e5m2": 2 ** -2}
    with pytest.raises(qsfa.InvalidArgument, match="Invalid value for dtype"):
        S.atk_single(np.ones(2), np.ones(2), dtype="float64")


@pytest.mark.parametrize("level, err, passed", [("L0", 1.99e-3, True), ("L0", 2.01e-3, False),
                                                 ("L2", 1.19e-3, True), ("L2", 1.21e-3, False)])
def test_atk_dual_levels(level, err, passed):
    g = np.ones(1000)
    b = g + 1e-3  # the benchmark's MARE = MERE = RMSE (up to the 1e-7 of the denominator) = 1e-3
    a = g + err
    r = S.atk_dual(a, g, dtype="float32", exact=g, benchmark=b, level=level)
    assert math.isclose(r["rmse_ratio"], err / 1e-3, rel_tol=1e-6)
    assert r["passed"] is passed


def test_atk_dual_mare_ratio_and_missing_references():
    g = np.ones(1000)
    b = g + 1e-3
    a = g.copy()
    a[0] += 9.9e-3  # MARE ratio 9.9 (L0 limit 10), MERE / RMSE small
    assert S.atk_dual(a, g, dtype="float32", exact=g, benchmark=b)["passed"]
    a[0] += 0.2e-3  # 10.1
    assert not S.atk_dual(a, g, dtype="float32", exact=g, benchmark=b)["passed"]
    r = S.atk_dual(a, g, dtype="float32", exact=g)
    assert not r["passed"] and r["missing"] == ["benchmark"]


def test_atk_dual_zero_benchmark_error_floored():
    g = np.ones(100)
    a = g + 2.0 ** -14 * 1.5  # the benchmark is exact: its errors floor at 2^-14 (fp32), RMSE ratio 1.5 <= 2
    r = S.atk_dual(a, g, dtype="float32", exact=g, benchmark=g.copy())
    assert r["floor"] == 2.0 ** -14 and math.isclose(r["rmse_ratio"], 1.5) and r["passed"]
    assert not S.atk_dual(g + 2.0 ** -14 * 2.5, g, dtype="float32", exact=g, benchmark=g.copy())["passed"]


# ---------------------------------------------------------------------------------------------------------- msprobe

def test_msprobe_absolute_threshold_normal_values():
    rtol = 2.0 ** -10
    g = np.ones(10)
    ok = g + 0.99 * rtol  # relative error below rtol (denominator |g| + 2^-23, the float32 bench's eps)
    bad = g.copy()
    bad[3] += 1.01 * rtol
    assert S.msprobe(ok, g, dtype="float16")["absolute_threshold"]["passed"]
    r = S.msprobe(bad, g, dtype="float16")
    assert r["method"] == "absolute_threshold" and not r["passed"] and r["absolute_threshold"]["rel_err_ratio"] == 0.1


def test_msprobe_absolute_threshold_small_values():
    g = np.full(4, 2.0 ** -11)  # below the fp16 small value 2^-10: judged by absolute error 2^-16
    assert S.msprobe(g + 2.0 ** -16, g, dtype="float16")["absolute_threshold"]["passed"]
    r = S.msprobe(g + 2.0 ** -15, g, dtype="float16")["absolute_threshold"]
    assert not r["passed"] and r["abs_err_ratio"] == 1.0


@pytest.mark.parametrize("k, passed", [(1, True), (2, False)])  # share of > 1 ULP below 0.1% of 2000
def test_msprobe_ulp_fp16(k, passed):
    g = np.ones(2000)
    a = g.copy()
    a[:k] += 2 * 2.0 ** -10  # two fp16 ulps at 1.0
    r = S.msprobe(a, g, dtype="float16", method="ulp")
    assert r["ulp"]["max_ulp_error"] == 2 and r["passed"] is passed


def test_msprobe_ulp_fp32_mean_or_share():
    g = np.ones(100)
    a = g.copy()
    a[:4] += 100 * 2.0 ** -23  # 4% above 32 ULP: share < 5% passes although the mean is only 4
    assert S.msprobe(a, g, dtype="float32", method="ulp")["passed"]
    a[:6] = 1 + 100 * 2.0 ** -23  # 6% above 32 ULP, mean 6 < 64: the mean rule passes it
    assert S.msprobe(a, g, dtype="float32", method="ulp")["passed"]
    a[:6] = 1 + 2000 * 2.0 ** -23  # mean 120, 6% share: both fail
    assert not S.msprobe(a, g, dtype="float32", method="ulp")["passed"]


@pytest.mark.parametrize("k, status", [(0, "PASS"), (9, "WARNING"), (10, "ERROR")])
def test_msprobe_dual_hundredths(k, status):
    g = np.ones(1000)
    a = g + 0.0005  # every element 0.05% off, max |err| >= 0.001 only where k elements are 2% off
    a[:k] = 1.02
    if k == 0:
        a[0] = 1.0009  # max |err| just below 0.001: PASS without the ratio checks
    r = S.msprobe(a, g, dtype="bfloat16", method="thousandth")
    assert r["thousandth"]["status"] == status and r["passed"] is (status != "ERROR")


def test_msprobe_benchmark_ratios():
    g = np.ones(1000)
    b = g + 1e-3
    r = S.msprobe(g + 1.9e-3, g, dtype="float32", exact=g, benchmark=b)
    assert r["method"] == "benchmark" and r["passed"] and math.isclose(r["benchmark"]["rmse_ratio"], 1.9, rel_tol=1e-3)
    assert not S.msprobe(g + 2.1e-3, g, dtype="float32", exact=g, benchmark=b)["passed"]
    with pytest.raises(qsfa.InvalidArgument, match="Invalid value for method"):
        S.msprobe(g, g, dtype="float32", method="nope")


def test_msprobe_fp8_tapered_ulp():
    g = np.full(2000, 1.0)
    a = g.copy()
    a[0] = 1.25  # |x| in [1, 2): exponent 0, mantissa width 3 -> 2 ulps
    r = S.msprobe(a, g, dtype="hifloat8", method="ulp")
    assert r["ulp"]["max_ulp_error"] == 2 and r["passed"]  # 1 of 2000 < 0.1%
    a[1] = 1.25
    assert not S.msprobe(a, g, dtype="hifloat8", method="ulp")["passed"]


# ---------------------------------------------------------------------------------------------------------- torch_npu

@pytest.mark.parametrize("k, passed", [(1, True), (2, False)])  # fp32: prec 1e-4, 1e-4 * 10000 = 1 element allowed
def test_torch_npu_fp32(k, passed):
    g = np.ones(10000, np.float32)
    a = g.copy()
    a[:k] = 1.001
    r = S.torch_npu(a, g, dtype="float32")
    assert r["abs_failures"] == k and r["rel_failures"] == k and r["passed"] is passed


def test_torch_npu_needs_both_abs_and_rel_failures_and_nan_positions():
    g = np.full(1000, 1e-5, np.float16)  # tiny values: 1e-5 off is a huge relative error but within prec 1e-3
    a = (g.astype(np.float32) * 3).astype(np.float16)
    r = S.torch_npu(a, g, dtype="float16")
    assert r["rel_failures"] == 1000 and r["abs_failures"] == 0 and r["passed"]
    a[0] = np.nan
    assert not S.torch_npu(a, g, dtype="float16")["passed"]


def test_torch_npu_bf16_allclose():
    g = _ones(4, BF16)
    a = g.copy()
    assert S.torch_npu(a, g, dtype="bfloat16")["passed"]
    a[0] = BF16(1 + 2.0 ** -7)  # 7.8e-3 > 1e-3 + 1e-3
    assert not S.torch_npu(a, g, dtype="bfloat16")["passed"]


def test_torch_npu_fails_identical_specials_as_the_original_does():
    # assertRtolEqual: an identical +inf gives inf - inf = NaN, which is neither <= prec absolute nor relative, so
    # it counts against both limits; bf16 goes through torch.allclose, whose equal_nan is False. qsfa's own verdict
    # passes identical specials (docs/numerics/comparison.md#standards).
    inf16 = np.array([1, np.inf, 2, 3], np.float16)
    nan_bf = np.array([1, np.nan, 2, 3], np.float32).astype(BF16)
    inf_bf = np.array([1, np.inf, 2, 3], np.float32).astype(BF16)
    nan16 = np.array([1, np.nan, 2, 3], np.float16)
    assert not S.torch_npu(inf16, inf16.copy(), dtype="float16")["passed"]
    assert not S.torch_npu(nan_bf, nan_bf.copy(), dtype="bfloat16")["passed"]
    assert S.torch_npu(inf_bf, inf_bf.copy(), dtype="bfloat16")["passed"]  # allclose: equal infinities are close
    assert S.torch_npu(nan16, nan16.copy(), dtype="float16")["passed"]  # NaN positions match, their diff is zeroed
    for a in (inf16, nan_bf):
        assert compare(a, a.copy()).passed


# ---------------------------------------------------------------------------------------------------------- quant-codes

def test_quant_codes_steps():
    g = np.full(100, 0x38, np.uint8)  # E4M3 1.0
    a = g.copy()
    a[0] = 0x39  # next value
    assert S.quant_codes(a, g, dtype="float8_e4m3fn")["passed"]
    a[0] = 0x3A  # two steps
    assert not S.quant_codes(a, g, dtype="float8_e4m3fn")["passed"]
    assert S.quant_codes(a, g, dtype="float8_e4m3fn", share=0.01)["passed"]  # 1 of 100
    a[1] = 0x36
    assert not S.quant_codes(a, g, dtype="float8_e4m3fn", share=0.01)["passed"]


def test_quant_codes_sign_crossing_and_nan():
    g = np.array([0x00, 0x01, 0x7F], np.uint8)
    a = np.array([0x80, 0x81, 0x7F], np.uint8)  # -0 equals +0; -min_subnormal is two values from +min_subnormal
    r = S.quant_codes(a, g, dtype="float8_e4m3fn")
    assert r["max_steps"] == 2 and r["beyond_max_step"] == 1 and r["nan_mismatches"] == 0
    a[2] = 0x7E  # NaN against 448
    assert S.quant_codes(a, g, dtype="float8_e4m3fn", share=1.0)["nan_mismatches"] == 1


def test_quant_codes_hifloat8_ranks_by_value():
    from qsfa.reference import formats as F

    vals = np.array([1.0, 1.125, 1.25], np.float32)
    c = F.encode(vals, "hifloat8")
    r = S.quant_codes(c[[1, 2]], c[[0, 0]], dtype="hifloat8")
    assert r["max_steps"] == 2 and r["beyond_max_step"] == 1


def test_quant_codes_e8m0_scales():
    g = np.full(1000, 0x7F, np.uint8)
    a = g.copy()
    a[0] = 0x80
    assert not S.quant_codes(a, g, dtype="float8_e8m0")["passed"]  # default: bytes exact
    assert S.quant_codes(a, g, dtype="float8_e8m0", scale_atol=1)["passed"]
    assert S.quant_codes(a, g, dtype="float8_e8m0", scale_abs_limit=1, scale_rel_limit=1e-3)["passed"]
    a[1] = 0x7E
    r = S.quant_codes(a, g, dtype="float8_e8m0", scale_abs_limit=1, scale_rel_limit=1e-3)
    assert r["mismatches"] == 2 and r["allowed_mismatches"] == 1 and not r["passed"]


# ---------------------------------------------------------------------------------------------------------- compare()

def test_compare_strict_fails_ops_transformer_passes():
    g = np.linspace(-1, 1, 1000).astype(np.float16)
    a = g.copy()
    a[:3] += np.float16(0.01)
    r = compare(a, g, standard=["ops-transformer", "torch-npu"])
    assert not r.passed and r.standards["ops-transformer"]["passed"] and not r.standards["torch-npu"]["passed"]
    assert "standard ops-transformer: PASS" in str(r)
    json.dumps(r.to_dict())


def test_compare_strict_passes_ops_transformer_fails():
    # bf16: qsfa's atol 6e-2 admits absolute errors on small values that ops-transformer's 1e-4 refuses; 1% of
    # the elements is twice its 0.5% allowance, and the tensor's cos_diff stays far below qsfa's 1e-5
    g = np.ones(1000, BF16)
    g[:10] = BF16(0.001)
    a = g.copy()
    a[:10] = BF16(0.01)
    r = compare(a, g, standard="ops-transformer")
    assert r.passed and r.cos_diff < 1e-6
    assert not r.standards["ops-transformer"]["passed"] and r.standards["ops-transformer"]["fail_ratio"] == 0.01


def test_compare_all_skips_rules_without_the_dtype_and_refuses_unknown_names():
    g = np.full(8, 0x38, np.uint8)
    r = compare(g.copy(), g, fmt="float8_e4m3fn", standard="all")
    assert r.passed and r.standards["quant-codes"]["passed"] and r.standards["torch-npu"].get("skipped")
    with pytest.raises(qsfa.InvalidArgument, match="Invalid value for standard"):
        compare(g, g, standard="nope")


# ---------------------------------------------------------------------------------------------------------- benchmark

@pytest.mark.parametrize("op", ["sparse_flash_attention", "kv_quant_sparse_flash_attention"])
def test_precision_benchmark_is_a_query_dtype_computation_near_the_exact_one(op):
    from qsfa._dispatch import operator

    args = dict(operator(op).contract.example(np.random.default_rng(5)))
    args["return_softmax_lse"] = True
    fn = getattr(qsfa, op)
    b_out, b_max, b_sum = fn(**{**args, "precision": "benchmark"})
    e_out = fn(**{**args, "precision": "exact"})[0]
    assert b_out.dtype == np.asarray(args["query"]).dtype and b_max.dtype == b_sum.dtype == np.float32
    e = e_out.astype(np.float64)
    if op == "sparse_flash_attention":  # V given in the query dtype: its largest entry bounds the output
        vmax = np.abs(args["value"].astype(np.float64)).max()
        # output rounding (2^-8 of |e| for bf16) plus P rounded to bf16 (2^-8 of the largest |V|), room for fp32
        assert np.all(np.abs(b_out.astype(np.float64) - e) <= 2.0 ** -8 * np.abs(e) + 2.0 ** -6 * vmax)
    # the dual benchmark of the faithful golden against it
    f_out = fn(**{**args, "precision": "faithful"})[0]
    r = compare(f_out, f_out, standard="atk-dual", exact=e_out, benchmark=b_out)
    assert r.standards["atk-dual"]["passed"]


def test_precision_benchmark_is_refused_by_the_device_backends():
    from qsfa.triton_backend import _precision_faithful

    c = _precision_faithful()
    assert c.check({"precision": "benchmark"}) == "benchmark" and c.check({"precision": "faithful"}) is None


@pytest.mark.parametrize("params,where", [
    ({"atk-single": {}}, "for standard_params, actual: 'atk-single'"),  # not a requested standard
    ({"nope": {}}, "for standard_params, actual: 'nope'"),
    ({"atk-dual": 1.0}, "for standard_params['atk-dual'], actual: 'float'"),
    ({"atk-dual": {"flor": 1e-3}}, "for standard_params['atk-dual'], actual: ['flor']"),
    ({"atk-dual": {"floor": float("nan")}}, "for standard_params['atk-dual']['floor']"),
    ({"atk-dual": {"floor": 0.0}}, "for standard_params['atk-dual']['floor']"),
    ({"atk-dual": {"floor": float("inf")}}, "for standard_params['atk-dual']['floor']"),
    ({"atk-dual": {"floor": True}}, "for standard_params['atk-dual']['floor']"),
    ({"atk-dual": {"level": "L9"}}, "for standard_params['atk-dual']['level']"),
    ([("atk-dual", {})], "for standard_params, actual: 'list'"),
])
def test_standard_params_are_checked_by_name(params, where):
    from qsfa import InvalidArgument
    from qsfa.compare import compare

    x = np.ones(8, np.float32)
    with pytest.raises(InvalidArgument) as ei:
        compare(x, x, standard="atk-dual", exact=x, benchmark=x, standard_params=params)
    assert where in str(ei.value), str(ei.value)


def test_standard_params_for_a_requested_standard_apply():
    from qsfa.compare import compare

    x = np.ones(8, np.float32)
    r = compare(x, x, standard=["atk-dual"], exact=x, benchmark=x, standard_params={"atk-dual": {"floor": 0.25}})
    assert r.standards["atk-dual"]["floor"] == 0.25
