"""Acceptance standards of the Ascend kernel teams, beside qsfa's strict verdict: docs/numerics/comparison.md#standards.

qsfa's own criterion (:mod:`qsfa.compare`, docs/numerics/comparison.md#float-criterion) judges every element.
The teams that consume qsfa's goldens are accepted or refused by other rules; each is here as data (its
thresholds per dtype and its public source) plus one function, so a report can show every rule's verdict and
figures beside qsfa's own:

==================  ============================================================================================
``ops-transformer``  ops-transformer's pytest comparator: ``np.isclose`` per element, PASS when at most 0.5% of
                     the elements fail and their largest relative error is below 10.
``atk-single``       ATK single benchmark: MERE < T and MARE < 10 T against a high-precision golden.
``atk-dual``         ATK dual benchmark: MARE / MERE / RMSE of the actual against the high-precision golden,
                     divided by a third-party benchmark's, within the level's ratios (L0 / L1 / L2).
``msprobe``          msprobe's api_accuracy_checker: absolute threshold, benchmark ratios, ULP and the legacy
                     "dual thousandths / hundredths" rule; one of them gives the verdict (``method=``).
``torch-npu``        torch_npu's ``assertRtolEqual``.
``quant-codes``      quantised outputs: 8-bit codes within +-1 step always pass, larger steps in at most a stated
                     share of the elements; E8M0 scale bytes judged separately (TransformerEngine's rule).
==================  ============================================================================================

Every function takes ``(actual, golden, *, dtype, exact=None, benchmark=None, **params)`` and returns a dict
with ``passed`` (bool) and the rule's own figures. ``golden`` is qsfa's faithful golden, ``exact`` the
high-precision one (``precision="exact"``), ``benchmark`` the third-party computation the dual standards
divide by. A rule that needs a reference it was not given says so (``passed`` False, ``missing`` named).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ._arrays import dtype_name, is_torch, to_numpy
from ._errors import InvalidArgument

__all__ = ["Standard", "STANDARDS", "STANDARD_NAMES", "resolve", "judge", "ops_transformer", "atk_single",
           "atk_dual", "msprobe", "torch_npu", "quant_codes"]

_CODE_FORMATS = ("float8_e4m3fn", "float8_e5m2", "hifloat8", "int8", "float8_e8m0")


@dataclass(frozen=True)
class Standard:
    name: str
    summary: str
    source: str
    thresholds: dict
    references: tuple  # which of golden / exact / benchmark the rule reads
    function: Callable = field(repr=False, compare=False)
    doc: str = "docs/numerics/comparison.md#standards"


def _host(x):
    return None if x is None else (to_numpy(x) if is_torch(x) else np.asarray(x))


def _values(x, dtype: str) -> np.ndarray:
    """float64 values; 1-byte codes of an 8-bit format are decoded (their float32 values, exact)."""
    a = _host(x)
    if a.dtype.itemsize == 1 and a.dtype.kind in "uiV" and dtype in _CODE_FORMATS:
        from .reference import formats as F

        return F.decode(a.view(np.uint8) if dtype != "int8" else a.view(np.int8), dtype).astype(np.float64)
    with np.errstate(invalid="ignore"):
        return a.astype(np.float64)


def _same_shape(a, g, name):
    if a.shape != g.shape:
        return {"passed": False, "error": f"shape mismatch: actual {a.shape}, {name} {g.shape}"}
    return None


# ----------------------------------------------------------------------------------------------------------------
# ops-transformer

OPS_TRANSFORMER = {
    "bfloat16": {"rtol": 7.8125e-3, "atol": 1e-4},
    "default": {"rtol": 5e-3, "atol": 2.5e-5},  # every other dtype (float16, float32, codes)
    "fail_ratio_limit": 0.005,
    "max_relative_error_limit": 10.0,
    "relative_floor": (1.0 / (1 << 14)) / 0.005,
    "relative_epsilon": 2e-9,
}


def ops_transformer(actual, golden, *, dtype, exact=None, benchmark=None) -> dict:
    """np.isclose(actual, golden, rtol, atol, equal_nan=True) in float32; PASS when the share of failing elements
    is <= 0.5% and the largest relative error among them, |a - g| / (max(|a|, |g|, 1/16384/0.005) + 2e-9), is < 10.
    1-byte outputs of an 8-bit float format (``dtype``) are compared by their decoded values with the default
    tolerances - what result_compare_method.py does in effect: its FP8 branch compares a torch dtype with a string,
    which never matches (docs/numerics/comparison.md#standards); other 1-byte outputs by their uint8 values."""
    t = OPS_TRANSFORMER
    tol = t["bfloat16"] if dtype == "bfloat16" else t["default"]
    a_in, g_in = _host(actual), _host(golden)
    bad = _same_shape(a_in, g_in, "golden")
    if bad:
        return bad
    if a_in.dtype.itemsize == 1 and dtype in ("float8_e4m3fn", "float8_e5m2", "hifloat8"):
        a, g = _values(a_in, dtype).astype(np.float32), _values(g_in, dtype).astype(np.float32)
    elif a_in.dtype.itemsize == 1:
        a, g = a_in.view(np.uint8).astype(np.float32), g_in.view(np.uint8).astype(np.float32)
    else:
        with np.errstate(invalid="ignore", over="ignore"):  # float64 beyond float32's range: inf, judged as such
            a, g = a_in.astype(np.float32).reshape(-1), g_in.astype(np.float32).reshape(-1)
    a, g = a.reshape(-1), g.reshape(-1)
    n = int(g.size)
    if n == 0:
        return {"passed": True, "rtol": tol["rtol"], "atol": tol["atol"], "mismatches": 0, "fail_ratio": 0.0,
                "max_relative_error": 0.0}
    with np.errstate(invalid="ignore", over="ignore"):
        mismatch = ~np.isclose(a, g, rtol=tol["rtol"], atol=tol["atol"], equal_nan=True)
        idx = np.flatnonzero(mismatch)
        max_rel = 0.0
        if idx.size:
            den = np.maximum(np.maximum(np.abs(a[idx]), np.abs(g[idx])), np.float32(t["relative_floor"]))
            max_rel = float(np.max(np.abs(g[idx] - a[idx]) / (den + np.float32(t["relative_epsilon"]))))
    fail_ratio = idx.size / n
    passed = fail_ratio <= t["fail_ratio_limit"] and max_rel < t["max_relative_error_limit"]
    return {"passed": bool(passed), "rtol": tol["rtol"], "atol": tol["atol"], "mismatches": int(idx.size),
            "fail_ratio": fail_ratio, "fail_ratio_limit": t["fail_ratio_limit"], "max_relative_error": max_rel,
            "max_relative_error_limit": t["max_relative_error_limit"], "precision_percent": 100.0 * (n - idx.size) / n}


# ----------------------------------------------------------------------------------------------------------------
# ATK single and dual benchmark

ATK_THRESHOLD = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -13, "hifloat32": 2.0 ** -11,
                 "float8_e4m3fn": 2.0 ** -3, "float8_e5m2": 2.0 ** -2}
ATK_LEVELS = {"L0": {"mare": 10.0, "mere": 2.0, "rmse": 2.0},
              "L1": {"mare": 5.0, "mere": 1.5, "rmse": 1.5},
              "L2": {"mare": 2.0, "mere": 1.2, "rmse": 1.2}}
#: OPEN (the ATK pages do not say how a zero benchmark error is divided by): the benchmark's figure is floored at
#: msprobe's minimum error of the dtype (docs/numerics/open-facts.md#atk-dual-floor)
ATK_DUAL_FLOOR = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -14, "default": 2.0 ** -14}
_ATK_EPS = 1e-7


def _atk_errors(a: np.ndarray, g: np.ndarray) -> dict:
    """MARE / MERE (|a - g| / (|g| + 1e-7)) and RMSE over the elements; a position where the two differ in
    finiteness (or NaN against a number) counts as an infinite error; equal non-finite positions are skipped."""
    fin = np.isfinite(a) & np.isfinite(g)
    same = ~fin & ((a == g) | (np.isnan(a) & np.isnan(g)))
    broken = int((~fin & ~same).sum())
    d = np.abs(a[fin] - g[fin])
    rel = d / (np.abs(g[fin]) + _ATK_EPS)
    if broken:
        return {"mare": math.inf, "mere": math.inf, "rmse": math.inf, "nonfinite_mismatches": broken}
    return {"mare": float(rel.max()) if rel.size else 0.0, "mere": float(rel.mean()) if rel.size else 0.0,
            "rmse": float(np.sqrt(np.mean(d * d))) if d.size else 0.0, "nonfinite_mismatches": 0}


def atk_single(actual, golden, *, dtype, exact=None, benchmark=None) -> dict:
    """MERE < T and MARE < 10 T against the high-precision golden (``exact``; ``golden`` when none is given)."""
    if dtype not in ATK_THRESHOLD:
        raise InvalidArgument("value", "dtype", dtype, f"atk-single has thresholds for {sorted(ATK_THRESHOLD)}")
    ref_name = "exact" if exact is not None else "golden"
    a, g = _values(actual, dtype), _values(exact if exact is not None else golden, dtype)
    bad = _same_shape(a, g, ref_name)
    if bad:
        return bad
    t = ATK_THRESHOLD[dtype]
    e = _atk_errors(a, g)
    passed = e["mere"] < t and e["mare"] < 10 * t
    return {"passed": bool(passed), "reference": ref_name, "threshold": t, "mere": e["mere"], "mere_limit": t,
            "mare": e["mare"], "mare_limit": 10 * t, "nonfinite_mismatches": e["nonfinite_mismatches"]}


def atk_dual(actual, golden, *, dtype, exact=None, benchmark=None, level: str = "L0", floor: float | None = None) -> dict:
    """The actual's MARE / MERE / RMSE against ``exact`` divided by the benchmark's (floored, OPEN) within the
    level's ratios. Needs ``exact`` (precision="exact") and ``benchmark`` (precision="benchmark")."""
    if level not in ATK_LEVELS:
        raise InvalidArgument("value", "level", level, f"must be one of {sorted(ATK_LEVELS)}")
    missing = [n for n, v in (("exact", exact), ("benchmark", benchmark)) if v is None]
    if missing:
        return {"passed": False, "missing": missing, "level": level,
                "error": "atk-dual needs the high-precision golden (exact) and the benchmark"}
    g = _values(exact, dtype)
    a, b = _values(actual, dtype), _values(benchmark, dtype)
    bad = _same_shape(a, g, "exact") or _same_shape(b, g, "exact")
    if bad:
        return bad
    fl = ATK_DUAL_FLOOR.get(dtype, ATK_DUAL_FLOOR["default"]) if floor is None else float(floor)
    ea, eb = _atk_errors(a, g), _atk_errors(b, g)
    lim = ATK_LEVELS[level]
    out = {"level": level, "floor": fl}
    ok = True
    for m in ("mare", "mere", "rmse"):
        # a non-finite error of the actual fails; one of the benchmark only (it broke, the actual did not) passes
        ratio = math.inf if not math.isfinite(ea[m]) else (ea[m] / max(eb[m], fl) if math.isfinite(eb[m]) else 0.0)
        out.update({f"{m}_actual": ea[m], f"{m}_benchmark": eb[m], f"{m}_ratio": ratio, f"{m}_ratio_limit": lim[m]})
        ok = ok and ratio <= lim[m]
    out["passed"] = bool(ok)
    return out


# ----------------------------------------------------------------------------------------------------------------
# msprobe (api_accuracy_checker)

MSPROBE = {
    "rtol": {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -20, "default": 2.0 ** -20},
    "small_value": {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -10, "float32": 2.0 ** -20, "default": 2.0 ** -20},
    "threshold_small_value_atol": {"float16": 2.0 ** -16, "bfloat16": 1e-16, "float32": 2.0 ** -30,
                                   "default": 2.0 ** -30},
    "benchmark_small_value_atol": {"float16": 1e-16, "bfloat16": 1e-16, "float32": 2.0 ** -30, "default": 2.0 ** -30},
    # eps of the relative error's denominator |bench| + eps: msprobe takes it from its CPU bench array, which is
    # float32 (fp16 / fp32 outputs; bf16 ones use the fixed 2^-8)
    "eps": {"bfloat16": 2.0 ** -8, "default": 2.0 ** -23},
    "minimum_err": {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -14, "default": 2.0 ** -14},
    "benchmark_levels": {"L0": {"max_rel_err": 10.0, "mean_rel_err": 2.0, "rmse": 2.0, "small_value": 2.0},
                         "L1": {"max_rel_err": 5.0, "mean_rel_err": 1.5, "rmse": 1.5, "small_value": 2.0},
                         "L2": {"max_rel_err": 2.0, "mean_rel_err": 1.2, "rmse": 1.2, "small_value": 2.0}},
    "ulp": {"float16": (-14, 10), "bfloat16": (-126, 7), "float32": (-126, 23)},  # (min exponent, mantissa bits)
    "ulp_fp32_mean_limit": 64, "ulp_fp32_threshold": 32, "ulp_fp32_share_limit": 0.05,
    "ulp_16_threshold": 1, "ulp_16_share_limit": 0.001,
    "thousandth": {"cosine_limit": 0.99, "max_abs_pass": 0.001, "hundredth": 0.01, "thousandth": 0.001,
                   "ten_thousandth": 0.0001},
}
MSPROBE_METHODS = ("auto", "absolute_threshold", "benchmark", "ulp", "thousandth")


def _msp(key, dtype):
    d = MSPROBE[key]
    return d.get(dtype, d["default"])


def _msp_masks(bench, dev, dtype, small_atol_key):
    fin = np.isfinite(dev) & np.isfinite(bench)
    abs_bench = np.abs(bench)
    abs_eps = abs_bench + _msp("eps", dtype)
    with np.errstate(invalid="ignore", over="ignore"):
        abs_err = np.abs(dev - bench)
    small = (abs_bench <= _msp("small_value", dtype)) & fin
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(small | ~fin, -1.0, abs_err / abs_eps)
    return fin, abs_eps, abs_err, small, rel, _msp(small_atol_key, dtype)


def _msp_absolute_threshold(bench, dev, dtype):
    fin, abs_eps, abs_err, small, rel, atol = _msp_masks(bench, dev, dtype, "threshold_small_value_atol")
    rtol = _msp("rtol", dtype)
    bad = ~fin
    if bad.any():
        big = float(np.finfo(np.float32).max) if dtype != "bfloat16" else 3.3895313892515355e38
        if dtype == "float16":
            big = float(np.finfo(np.float16).max)
        with np.errstate(invalid="ignore", over="ignore"):
            re_c = np.abs(np.clip(dev, -big, big) - np.clip(bench, -big, big)) / abs_eps
        ok = (re_c <= rtol) | (np.isnan(dev) & np.isnan(bench))
        inf_nan = float((~ok & bad).sum() / bad.sum())
    else:
        inf_nan = 0.0
    normal = fin & ~small
    rel_ratio = float(((rel > rtol) & normal).sum() / normal.sum()) if normal.any() else 0.0
    abs_ratio = float(((abs_err > atol) & small).sum() / small.sum()) if small.any() else 0.0
    return {"passed": inf_nan == 0 and rel_ratio == 0 and abs_ratio == 0, "rtol": rtol,
            "small_value": _msp("small_value", dtype), "small_value_atol": atol, "inf_nan_error_ratio": inf_nan,
            "rel_err_ratio": rel_ratio, "abs_err_ratio": abs_ratio}


def _msp_metrics(bench, dev, dtype):
    fin, abs_eps, abs_err, small, rel, atol = _msp_masks(bench, dev, dtype, "benchmark_small_value_atol")
    inf_nan = ~fin
    sv = float(((abs_err > atol) & small).sum() / small.sum()) if small.any() else 0.0
    skip = inf_nan | small  # msprobe's get_rmse is given this union as its mask and rescales by its count
    masked = np.where(skip, 0.0, abs_err)
    mse = float(np.mean(masked * masked)) * (abs_err.size / (abs_err.size - float(skip.sum()) + 1e-4) + 1e-4)
    pos = rel[rel >= 0]
    return {"small_value_err_ratio": sv, "rmse": math.sqrt(mse), "max_rel_err": float(pos.max()) if pos.size else 0.0,
            "mean_rel_err": float(pos.mean()) if pos.size else 0.0}


def _msp_benchmark(exact, dev, bench, dtype, level):
    if level not in MSPROBE["benchmark_levels"]:
        raise InvalidArgument("value", "level", level, f"must be one of {sorted(MSPROBE['benchmark_levels'])}")
    md, mb = _msp_metrics(exact, dev, dtype), _msp_metrics(exact, bench, dtype)
    floor = _msp("minimum_err", dtype)
    lim = MSPROBE["benchmark_levels"][level]
    out, ok = {"level": level}, True
    for key, limkey in (("small_value_err_ratio", "small_value"), ("rmse", "rmse"), ("max_rel_err", "max_rel_err"),
                        ("mean_rel_err", "mean_rel_err")):
        r = abs(md[key]) / max(abs(mb[key]), floor)
        out.update({f"{key}_actual": md[key], f"{key}_benchmark": mb[key], f"{key}_ratio": r,
                    f"{key}_ratio_limit": lim[limkey]})
        ok = ok and not r > lim[limkey]
    out["passed"] = bool(ok)
    return out


def _ulp_err_fp8(bench, dev):
    ex = np.log2(np.abs(bench) + 2.0 ** -1000)
    ex = np.maximum(ex, -22)
    e = np.floor(ex)
    ea = np.abs(e)
    wm = np.zeros_like(bench)
    wm[ea <= 15] = 1
    wm[ea <= 7] = 2
    wm[ea <= 3] = 3
    err = (dev - bench) * 2.0 ** (-e + wm)
    eh = np.log2(np.abs(dev) + 2.0 ** -1000)
    err0 = eh * np.where(dev >= 0, 1, -1) - ex * np.where(bench >= 0, 1, -1)
    return np.abs(np.where(wm == 0, err0, err))


def _ulp_err(bench, dev, dtype):
    if dtype in ("float8_e4m3fn", "float8_e5m2", "hifloat8"):
        return _ulp_err_fp8(bench, dev)
    min_eb, mant = MSPROBE["ulp"][dtype]
    ab = np.abs(bench)
    with np.errstate(divide="ignore"):
        eb = np.maximum(np.where(ab == 0, 0.0, np.floor(np.log2(np.where(ab == 0, 1.0, ab)))), min_eb)
    err = (dev - bench) * np.exp2(-eb + mant)
    if dtype != "float32":
        err = err.astype(np.float32).astype(np.float64)
    return np.abs(err)


def _msp_ulp(exact, dev, bench, dtype):
    if dtype not in MSPROBE["ulp"] and dtype not in ("float8_e4m3fn", "float8_e5m2", "hifloat8"):
        return {"passed": False, "error": f"msprobe's ULP standard has no rule for {dtype}"}
    fin = np.isfinite(exact) & np.isfinite(dev)
    if not fin.all():
        return {"passed": False, "error": "non-finite values (the ULP standard reports ERROR on inf / nan)"}
    u = _ulp_err(exact.reshape(-1), dev.reshape(-1), dtype)
    n = max(u.size, 1)
    thr = MSPROBE["ulp_fp32_threshold"] if dtype == "float32" else MSPROBE["ulp_16_threshold"]
    share = float((u > thr).sum() / n)
    out = {"max_ulp_error": float(u.max()) if u.size else 0.0, "mean_ulp_error": float(u.mean()) if u.size else 0.0,
           "ulp_threshold": thr, "ulp_error_proportion": share}
    ratio = None
    if bench is not None:
        ub = _ulp_err(exact.reshape(-1), bench.reshape(-1), dtype)
        sb = float((ub > thr).sum() / n)
        ratio = share / max(sb, _msp("minimum_err", dtype))
        out["ulp_error_proportion_ratio"] = ratio
    if dtype == "float32":
        ok = out["mean_ulp_error"] < MSPROBE["ulp_fp32_mean_limit"] or share < MSPROBE["ulp_fp32_share_limit"]
        out.update(mean_ulp_limit=MSPROBE["ulp_fp32_mean_limit"], proportion_limit=MSPROBE["ulp_fp32_share_limit"])
    else:
        ok = share < MSPROBE["ulp_16_share_limit"]
        out["proportion_limit"] = MSPROBE["ulp_16_share_limit"]
    if not ok and ratio is not None and dtype in MSPROBE["ulp"]:
        ok = ratio < 1
    out["passed"] = bool(ok)
    return out


def _msp_thousandth(exact, dev, dtype):
    """The float path of msprobe's compare.py (_compare_float_tensor): cosine < 0.99 ERROR; max |err| < 0.001 PASS;
    fp16 / bf16: share of relative errors < 1% must exceed 99% ("dual hundredths", else ERROR), and of < 0.1%
    99.9% ("dual thousandths", else WARNING); fp32: thousandths else ERROR, ten-thousandths else WARNING."""
    t = MSPROBE["thousandth"]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        abs_err = np.abs(dev - exact)
        rel = np.abs(abs_err / (np.abs(exact) + _msp("eps", dtype)))
        num = float(np.sum(dev * exact))
        den = float(np.sqrt(np.sum(dev * dev)) * np.sqrt(np.sum(exact * exact)))
    cos = num / den if den > 0 else (1.0 if not dev.any() and not exact.any() else math.nan)
    out = {"cosine": cos, "max_abs_err": float(abs_err.max()) if abs_err.size else 0.0}

    def share_below(th):
        return float((rel < th).sum() / rel.size) if rel.size else 1.0

    if not (cos >= t["cosine_limit"]) and not math.isnan(cos):
        status = "ERROR"
    elif out["max_abs_err"] < t["max_abs_pass"]:
        status = "PASS"
    elif dtype in ("float16", "bfloat16"):
        out["rel_err_hundredth"] = share_below(t["hundredth"])
        out["rel_err_thousandth"] = share_below(t["thousandth"])
        if not out["rel_err_hundredth"] > 1 - t["hundredth"]:
            status = "ERROR"
        else:
            status = "PASS" if out["rel_err_thousandth"] > 1 - t["thousandth"] else "WARNING"
    else:
        out["rel_err_thousandth"] = share_below(t["thousandth"])
        out["rel_err_ten_thousandth"] = share_below(t["ten_thousandth"])
        if not out["rel_err_thousandth"] > 1 - t["thousandth"]:
            status = "ERROR"
        else:
            status = "PASS" if out["rel_err_ten_thousandth"] > 1 - t["ten_thousandth"] else "WARNING"
    out["status"] = status
    out["passed"] = status != "ERROR"
    return out


def msprobe(actual, golden, *, dtype, exact=None, benchmark=None, method: str = "auto", level: str = "L0") -> dict:
    """msprobe's standards against the high-precision golden (``exact``, else ``golden``): every one that can be
    computed is reported; ``method`` picks the verdict ("auto": benchmark when a benchmark is given - the standard
    msprobe applies to attention - else absolute_threshold)."""
    if method not in MSPROBE_METHODS:
        raise InvalidArgument("value", "method", method, f"must be one of {list(MSPROBE_METHODS)}")
    ref = _values(exact if exact is not None else golden, dtype)
    dev = _values(actual, dtype)
    bad = _same_shape(dev, ref, "exact" if exact is not None else "golden")
    if bad:
        return bad
    bench = None if benchmark is None else _values(benchmark, dtype)
    parts = {"absolute_threshold": _msp_absolute_threshold(ref, dev, dtype),
             "ulp": _msp_ulp(ref, dev, bench, dtype)}
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        parts["thousandth"] = _msp_thousandth(ref, dev, dtype)
    if bench is not None:
        parts["benchmark"] = _msp_benchmark(ref, dev, bench, dtype, level)
    chosen = method if method != "auto" else ("benchmark" if bench is not None else "absolute_threshold")
    if chosen not in parts:
        return {"passed": False, "method": chosen, "error": f"{chosen} needs a benchmark" if chosen == "benchmark"
                else f"{chosen} has no rule for {dtype}", **parts}
    return {"passed": bool(parts[chosen]["passed"]), "method": chosen,
            "reference": "exact" if exact is not None else "golden", **parts}


# ----------------------------------------------------------------------------------------------------------------
# torch_npu assertRtolEqual

TORCH_NPU = {"float16": {"prec": 1e-3, "minimum": 6e-8}, "bfloat16": {"prec": 1e-3, "allclose": True},
             "default": {"prec": 1e-4, "minimum": 10e-10}}


def torch_npu(actual, golden, *, dtype, exact=None, benchmark=None) -> dict:
    """assertRtolEqual(golden, actual): NaN positions must match; it fails only where more than prec * N elements
    exceed prec in absolute error and more than prec * N exceed it in relative error (|d| / (max(|x|, |y|) +
    minimum)). bf16 tensors take torch.allclose(rtol=atol=1e-3) instead (every element)."""
    t = TORCH_NPU.get(dtype, TORCH_NPU["default"])
    x, y = _values(golden, dtype), _values(actual, dtype)
    bad = _same_shape(y, x, "golden")
    if bad:
        return bad
    prec = t["prec"]
    if t.get("allclose"):
        with np.errstate(invalid="ignore"):
            fails = ~np.isclose(x, y, rtol=prec, atol=prec)  # torch.allclose(x, y): |x - y| <= atol + rtol * |y|
        return {"passed": not bool(fails.any()), "prec": prec, "rule": "allclose", "mismatches": int(fails.sum())}
    nan_x = np.isnan(x)
    if not np.array_equal(nan_x, np.isnan(y)):
        return {"passed": False, "prec": prec, "error": "NaN positions differ"}
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(nan_x, 0.0, y - x)
        r = np.abs(d)
        den = np.maximum(np.abs(x), np.abs(y))
        atol_ok = r <= prec
        rtol_ok = r / (den + t["minimum"]) <= prec
    n = x.size
    n_abs, n_rel = int((~atol_ok).sum()), int((~rtol_ok).sum())
    failed = (not rtol_ok.all() and not atol_ok.all()) and n_rel > n * prec and n_abs > n * prec
    return {"passed": not failed, "prec": prec, "minimum": t["minimum"], "abs_failures": n_abs,
            "rel_failures": n_rel, "allowed_failures": n * prec}


# ----------------------------------------------------------------------------------------------------------------
# quantised codes and scales

#: OPEN (the public tests state their own shares): by default no element may be more than one step off
QUANT_CODES = {"max_step": 1, "share": 0.0, "scale_atol": 0, "scale_abs_limit": 0, "scale_rel_limit": 0.0}


def _code_rank(codes: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Each code's position on the format's value line (adjacent finite values differ by 1; -0 and +0 share one),
    and a mask of NaN codes."""
    from .reference import formats as F

    table = F.decode(np.arange(256, dtype=np.uint8) if fmt != "int8" else np.arange(-128, 128).astype(np.int8), fmt)
    table = table.astype(np.float64)
    nan = np.isnan(table)
    uniq = np.unique(table[~nan])
    rank = np.where(nan, -1, np.searchsorted(uniq, np.where(nan, 0, table)))
    idx = codes.view(np.uint8).astype(np.int64) if fmt != "int8" else codes.view(np.int8).astype(np.int64) + 128
    return rank[idx], nan[idx]


def quant_codes(actual, golden, *, dtype, exact=None, benchmark=None, max_step: int | None = None,
                share: float | None = None, scale_atol: int | None = None, scale_abs_limit: int | None = None,
                scale_rel_limit: float | None = None) -> dict:
    """8-bit codes (``dtype`` their format): an element more than ``max_step`` representable values away from the
    golden's fails; PASS when the failing share is <= ``share`` and NaN codes match. E8M0 scale bytes
    (``dtype="float8_e8m0"``) follow TransformerEngine's compare_e8m0_scaling_factors: a byte more than
    ``scale_atol`` away is a mismatch; PASS with at most min(scale_abs_limit, floor(N * scale_rel_limit))."""
    p = dict(QUANT_CODES)
    for k, v in (("max_step", max_step), ("share", share), ("scale_atol", scale_atol),
                 ("scale_abs_limit", scale_abs_limit), ("scale_rel_limit", scale_rel_limit)):
        if v is not None:
            p[k] = v
    if dtype not in _CODE_FORMATS:
        raise InvalidArgument("value", "dtype", dtype, f"quant-codes judges the codes of {list(_CODE_FORMATS)}")
    a, g = _host(actual), _host(golden)
    if a.dtype.itemsize != 1 or g.dtype.itemsize != 1:
        return {"passed": False, "error": f"quant-codes needs 1-byte codes, got {a.dtype} / {g.dtype}"}
    bad = _same_shape(a, g, "golden")
    if bad:
        return bad
    if dtype == "float8_e8m0":
        d = np.abs(a.view(np.uint8).astype(np.int64) - g.view(np.uint8).astype(np.int64))
        mism = int((d > p["scale_atol"]).sum())
        limit = min(p["scale_abs_limit"], math.floor(g.size * p["scale_rel_limit"]))
        return {"passed": mism <= limit, "rule": "e8m0 scales", "mismatches": mism, "allowed_mismatches": limit,
                "max_byte_difference": int(d.max()) if d.size else 0, "scale_atol": p["scale_atol"]}
    ra, na = _code_rank(np.ascontiguousarray(a), dtype)
    rg, ng = _code_rank(np.ascontiguousarray(g), dtype)
    steps = np.where(na | ng, 0, np.abs(ra - rg))
    nan_bad = int((na != ng).sum())
    over = int((steps > p["max_step"]).sum())
    n = max(g.size, 1)
    passed = nan_bad == 0 and over / n <= p["share"]
    return {"passed": bool(passed), "rule": "codes", "max_step": p["max_step"], "share_limit": p["share"],
            "max_steps": int(steps.max()) if steps.size else 0, "beyond_max_step": over,
            "beyond_share": over / n, "within_one_step": int(((steps > 0) & (steps <= 1)).sum()),
            "nan_mismatches": nan_bad}


# ----------------------------------------------------------------------------------------------------------------
# the registry

_OT = ("cannmirror/ops-transformer@3a280bc attention/mixed_quant_sparse_flash_mla/tests/assets/impl/compare.py; the same "
       "rule in recursion-ascend/ops-transformer@a093e95 attention/sparse_flash_attention/tests/pytest/"
       "result_compare_method.py check_result")
_ATK = ("ATK precision standard, gitcode.com/W4termy/cannbot ops/ops-precision-standard/reference/"
        "float_compute.md and quantization_community.md")
_MSP = ("Ascend/mstt debug/accuracy_tools/msprobe/pytorch/api_accuracy_checker/ (precision_standard/standard_config.py, "
        "ulp_compare.py, benchmark_compare.py, absolute_threshold.py; compare/algorithm.py, compare/compare.py), "
        "as released in mindstudio-probe 26.2.0")
_TN = "torch_npu 2.14.0 torch_npu/testing/testcase.py TestCase.assertRtolEqual"
_QC = ("msprobe compare/compare.py _compare_quantization_tensor (max |code difference| <= 1); TransformerEngine "
       "tests/cpp/test_common.cu compare_e8m0_scaling_factors")

STANDARDS = {
    "ops-transformer": Standard("ops-transformer", "np.isclose per element; <= 0.5% fail, max rel error < 10", _OT,
                                OPS_TRANSFORMER, ("golden",), ops_transformer),
    "atk-single": Standard("atk-single", "MERE < T, MARE < 10 T against the high-precision golden", _ATK,
                           ATK_THRESHOLD, ("exact",), atk_single),
    "atk-dual": Standard("atk-dual", "MARE / MERE / RMSE ratios to a third-party benchmark (L0 / L1 / L2)", _ATK,
                         {"levels": ATK_LEVELS, "floor": ATK_DUAL_FLOOR}, ("exact", "benchmark"), atk_dual),
    "msprobe": Standard("msprobe", "absolute threshold / benchmark ratios / ULP / dual thousandths", _MSP, MSPROBE,
                        ("exact", "benchmark"), msprobe),
    "torch-npu": Standard("torch-npu", "assertRtolEqual: fails when > prec*N elements miss prec both ways", _TN,
                          TORCH_NPU, ("golden",), torch_npu),
    "quant-codes": Standard("quant-codes", "codes within +-1 step; e8m0 scale bytes TransformerEngine's way", _QC,
                            QUANT_CODES, ("golden",), quant_codes),
}
STANDARD_NAMES = tuple(STANDARDS)


def resolve(names) -> list[str]:
    """A name, a list of names or "all" -> the list of standard names (unknown names refused)."""
    if names is None:
        return []
    if isinstance(names, str):
        names = [names]
    out = []
    for n in names:
        if n == "all":
            out.extend(x for x in STANDARD_NAMES if x not in out)
        elif n in STANDARDS:
            if n not in out:
                out.append(n)
        else:
            raise InvalidArgument("value", "standard", n, f"must be one of {list(STANDARD_NAMES)} or 'all'")
    return out


_FIXED_ARGS = ("actual", "golden", "dtype", "exact", "benchmark")


def standard_parameters(name: str) -> list[str]:
    """The parameters ``standard_params[name]`` may set (the rule function's keyword arguments)."""
    import inspect

    (name,) = resolve([name])
    return [p for p in inspect.signature(STANDARDS[name].function).parameters if p not in _FIXED_ARGS]


def check_standard_params(standard, standard_params) -> None:
    """Refuse, by name, ``standard_params`` that are not ``{requested standard: {parameter: value}}``: a key that is
    not a requested standard, a value that is not a dict, a parameter the standard does not have, a ``floor`` that
    is not a finite number > 0, a ``level`` / ``method`` the standard does not know."""
    from collections.abc import Mapping

    if standard_params is None:
        return
    names = resolve(standard)
    if not isinstance(standard_params, Mapping):
        raise InvalidArgument("type", "standard_params", type(standard_params).__name__,
                              "must be a dict {standard name: {parameter: value}}")
    for k, v in standard_params.items():
        if k not in names:
            raise InvalidArgument("value", "standard_params", k, f"its keys must be requested standards "
                                  f"(standard=...: {names})")
        if not isinstance(v, Mapping):
            raise InvalidArgument("type", f"standard_params[{k!r}]", type(v).__name__,
                                  "must be a dict {parameter: value}")
        allowed = standard_parameters(k)
        unknown = sorted(str(p) for p in v if p not in allowed)
        if unknown:
            raise InvalidArgument("value", f"standard_params[{k!r}]", unknown,
                                  f"{k} has no such parameter(s); its parameters: {allowed}")
        if v.get("floor") is not None:
            f = v["floor"]
            if isinstance(f, bool) or not isinstance(f, (int, float, np.integer, np.floating)) or not (
                    math.isfinite(float(f)) and float(f) > 0):
                raise InvalidArgument("value", f"standard_params[{k!r}]['floor']", f, "must be a finite number > 0")
        levels = {"atk-dual": ATK_LEVELS, "msprobe": MSPROBE["benchmark_levels"]}.get(k)
        if "level" in v and levels is not None and v["level"] not in levels:
            raise InvalidArgument("value", f"standard_params[{k!r}]['level']", v["level"],
                                  f"must be one of {sorted(levels)}")
        if k == "msprobe" and "method" in v and v["method"] not in MSPROBE_METHODS:
            raise InvalidArgument("value", "standard_params['msprobe']['method']", v["method"],
                                  f"must be one of {list(MSPROBE_METHODS)}")


def needed_references(name: str) -> list[str]:
    """The references (``exact`` / ``benchmark``) without which standard ``name`` judges nothing (atk-dual): asked
    of the rule itself on a one-element float32 pair. A golden directory and a conformance run hold neither, so
    such a standard cannot give their verdict (``--verdict-by``)."""
    (name,) = resolve([name])
    x = np.ones(1, np.float32)
    try:
        r = STANDARDS[name].function(x, x, dtype="float32")
    except InvalidArgument:  # a rule for other dtypes (quant-codes): it needs no reference
        return []
    return list(r.get("missing") or [])


def applicable(name: str, dtype: str) -> bool:
    """Whether a standard judges outputs of ``dtype`` ("all" skips the others)."""
    if name == "quant-codes":
        return dtype in _CODE_FORMATS
    if name == "atk-single":
        return dtype in ATK_THRESHOLD
    return dtype in ("float16", "bfloat16", "float32", "float64") or (
        name in ("ops-transformer", "msprobe") and dtype in ("float8_e4m3fn", "float8_e5m2", "hifloat8"))


def judge(name: str, actual, golden, *, dtype: str | None = None, exact=None, benchmark=None, **params) -> dict:
    """Apply one standard; ``dtype`` defaults to the golden's dtype name."""
    (name,) = resolve([name])
    dt = dtype or dtype_name(_host(golden))
    res = STANDARDS[name].function(actual, golden, dtype=dt, exact=exact, benchmark=benchmark, **params)
    res.setdefault("source", STANDARDS[name].source)
    return res
