"""Comparing a backend's (or kernel's) results with the oracle: docs/numerics/comparison.md#float-criterion.

* Byte outputs (format codes, packed rows, caches) are compared byte for byte. The report names the
  first differing positions and, when the format is known, their decoded values. Never a tolerance.
* Float outputs (attention, LSE) use the project's criterion (docs/numerics/comparison.md#float-criterion):
  non-finite masks must match; an element passes when ``|a - r| <= atol + rtol * |r|`` (the
  ``torch.testing.assert_close`` form, as vLLM-Ascend applies its tolerances - not FlashMLA's looser
  "abs_err < atol or rel_err < rtol"); and the whole tensor needs FlashMLA's
  ``cos_diff = 1 - 2*sum(a*r) / sum(a^2 + r^2)`` (float64) ``<= cos_tol``. Per-dtype atol/rtol are the
  vLLM-Ascend ones (bf16 6e-2 / 7.8125e-3, fp16 2.5e-5 / 5e-3). ``rel_err = |a - r| / (|r| + 1e-6)`` is reported.
* Ascend (msprobe) statistics are reported beside the verdict: the share of elements whose relative error
  exceeds 0.1% ("dual thousandths") and 1% ("dual hundredths"), and the ULP distance histogram.

The cos_diff thresholds and the fp32 atol/rtol are qsfa's choice (no public source names one; docs/numerics/comparison.md#float-criterion): 1e-5 for 16-bit
outputs and 1e-7 for fp32 (FlashMLA's test uses 1e-5 for bf16 decode and 1e-7 for its sparse kernels).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import ml_dtypes
import numpy as np

from ._arrays import dtype_name, is_ml_dtype, is_torch, to_numpy
from ._errors import InvalidArgument, Raw
from ._public import checked, nonnegative_int, one_of_values
from .reference.formats import FORMAT_NAMES

#: ``fmt=`` of compare_bytes / compare: a qsfa.formats name (a bad one passed silently while the bytes matched and
#: raised from formats.decode only once an element differed)
_FMT_RULE = (one_of_values(FORMAT_NAMES), f"must be None or a qsfa.formats name, one of {list(FORMAT_NAMES)}")

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "CompareResult",
    "compare_bytes",
    "compare_float",
    "compare",
    "assert_bytes_equal",
    "assert_close",
    "cos_diff",
    "ulp_distance",
    "standard_line",
    "add_standards",
    "compare_topk",
    "TOPK_RTOL",
]


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    cos_tol: float


#: Per output dtype. bf16/fp16 atol/rtol from vLLM-Ascend's QSFA test; cos_tol and fp32 are qsfa's.
TOLERANCES = {
    "bfloat16": Tolerance(atol=6e-2, rtol=7.8125e-3, cos_tol=1e-5),
    "float16": Tolerance(atol=2.5e-5, rtol=5e-3, cos_tol=1e-5),
    "float32": Tolerance(atol=1e-5, rtol=1e-5, cos_tol=1e-7),
}


#: dtypes whose float criterion compare_float knows (float64 uses float32's tolerances)
_CRITERION_DTYPES = ("bfloat16", "float16", "float32", "float64")


@dataclass
class CompareResult:
    name: str
    kind: str  # "bytes" or "float"
    passed: bool
    shape: tuple
    dtype: str
    n: int
    n_fail: int
    message: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    cos_diff: float | None = None
    share_rel_gt_1e3: float | None = None  # "dual thousandths" statistic
    share_rel_gt_1e2: float | None = None  # "dual hundredths" statistic
    max_ulp: int | None = None
    ulp_histogram: dict = field(default_factory=dict)
    tolerance: dict | None = None
    worst: list = field(default_factory=list)
    standards: dict = field(default_factory=dict)  # name -> {"passed": bool, figures} (qsfa.standards)
    topk: dict | None = None  # compare_topk: row counts (exact set equality apart from the tie-tolerant verdict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    def __str__(self):
        verdict = "PASS" if self.passed else "FAIL"
        head = f"{verdict} {self.name or '<tensor>'} [{self.kind}] shape={self.shape} dtype={self.dtype}"
        msg = self.message.removeprefix(f"{verdict}: ")  # the head line already gives the verdict
        lines = [head, f"  {msg}"] if msg else [head]
        for w in self.worst:
            lines.append("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in w.items()))
        for sname, s in self.standards.items():
            lines.append(f"  standard {sname}: " + standard_line(s))
        return "\n".join(lines)


def standard_line(s: dict) -> str:
    """One line for a standard's verdict and its scalar figures (nested sub-standards by their own verdict)."""
    head = "n/a" if s.get("skipped") or s.get("missing") else ("PASS" if s.get("passed") else "FAIL")
    parts = []
    for k, v in s.items():
        if k in ("passed", "source", "skipped"):
            continue
        if isinstance(v, dict):
            parts.append(f"{k}={'PASS' if v.get('passed') else 'FAIL'}")
        elif not isinstance(v, (list, tuple)):
            parts.append(f"{k}={_fmt(v)}")
    return head + (" (" + ", ".join(parts) + ")" if parts else "")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.9g}"
    return str(v)


def _host(x) -> np.ndarray:
    return to_numpy(x) if is_torch(x) else np.asarray(x)


def _as_bytes(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape + (a.dtype.itemsize,)) if a.dtype.itemsize > 1 else a.view(np.uint8)


@checked("actual:values golden:values name:str fmt:str? max_report:int", max_report=(nonnegative_int, "must be >= 0"),
         fmt=_FMT_RULE)
def compare_bytes(actual, golden, *, name: str = "", fmt: str | None = None, max_report: int = 10) -> CompareResult:
    """Byte-for-byte comparison; ``fmt`` (a qsfa.formats name) adds decoded values to the report."""
    a, g = _host(actual), _host(golden)
    dt = dtype_name(g)
    if a.shape != g.shape or a.dtype.itemsize != g.dtype.itemsize:
        return CompareResult(name, "bytes", False, tuple(g.shape), dt, int(g.size), int(g.size),
                             message=f"FAIL: shape/itemsize mismatch: actual {a.shape} {dtype_name(a)}, "
                                     f"golden {g.shape} {dt}")
    ab, gb = _as_bytes(a), _as_bytes(g)
    diff = ab != gb
    if diff.ndim > g.ndim:
        diff = diff.any(axis=-1)
    n_fail = int(diff.sum())
    res = CompareResult(name, "bytes", n_fail == 0, tuple(g.shape), dt, int(g.size), n_fail)
    if n_fail:
        idx = np.argwhere(diff)[:max_report]
        decoded = None
        if fmt is not None:
            from .reference import formats as F

            decoded = lambda c: float(F.decode(np.asarray([c]).astype(np.uint8), fmt)[0])  # noqa: E731
        for ix in idx:
            t = tuple(int(i) for i in ix)
            gv, av = g[t], a[t]
            w = {"index": list(t), "golden": _scalar(gv), "actual": _scalar(av)}
            if decoded is not None and g.dtype.itemsize == 1:
                w["golden_decoded"] = decoded(gv.view(np.uint8) if hasattr(gv, "view") else gv)
                w["actual_decoded"] = decoded(av.view(np.uint8) if hasattr(av, "view") else av)
            res.worst.append(w)
        first = res.worst[0]["index"]
        res.message = f"FAIL: {n_fail} of {g.size} elements differ; first at index {first}"
    else:
        res.message = f"PASS: all {g.size} elements identical"
    return res


def _scalar(v):
    v = np.asarray(v)
    if v.dtype.kind in "iu":
        return int(v)
    if v.dtype.itemsize == 1 and is_ml_dtype(v.dtype):
        return int(v.view(np.uint8))
    with np.errstate(invalid="ignore"):  # a signalling NaN (0x7f800001 ...) is quieted by the cast: it reads nan
        return float(v.astype(np.float64))


@checked("actual:values golden:values", golden=(lambda v, a: tuple(np.shape(v)) == tuple(np.shape(a["actual"])),
                                                 "must have the actual's shape"))
def cos_diff(actual, golden) -> float:
    """``1 - 2*sum(a*r) / sum(a^2 + r^2)`` in float64 over finite elements (0 for two all-zero tensors)."""
    a = _host(actual).astype(np.float64)
    r = _host(golden).astype(np.float64)
    fin = np.isfinite(a) & np.isfinite(r)
    a, r = a[fin], r[fin]
    with np.errstate(over="ignore"):
        den = float((a * a + r * r).sum())
    if not np.isfinite(den):  # squares beyond float64 (|x| > ~1e154): the same ratio on values scaled to <= 1
        s = max(float(np.abs(a).max()), float(np.abs(r).max()))
        a, r = a / s, r / s
        den = float((a * a + r * r).sum())
    if den == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((a * r).sum()) / den


_ULP_INT = {"bfloat16": np.int16, "float16": np.int16, "float32": np.int32, "float64": np.int64}


@checked("actual:values golden:values dtype:str", dtype=(one_of_values(_ULP_INT), f"must be one of {list(_ULP_INT)}"))
def ulp_distance(actual, golden, dtype: str) -> np.ndarray:
    """Distance in units in the last place of ``dtype`` (both sides rounded to it first, RNE)."""
    np_dt = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
             "float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}[dtype]
    it = _ULP_INT[dtype]

    def ordered(x):
        b = np.ascontiguousarray(_host(x).astype(np_dt)).view(it).astype(np.int64)
        sign_bit = np.int64(1) << (np.dtype(it).itemsize * 8 - 1)
        # map sign-magnitude to a monotone integer line (-0 and +0 coincide)
        return np.where(b < 0, -(b + sign_bit), b)

    return np.abs(ordered(actual) - ordered(golden))


@checked("actual:values golden:values dtype:str? name:str max_report:int", max_report=(nonnegative_int, "must be >= 0"))
def compare_float(actual, golden, *, dtype: str | None = None, tol: Tolerance | None = None,
                  name: str = "", max_report: int = 10) -> CompareResult:
    """The docs/numerics/comparison.md#float-criterion criterion for float outputs (see module docstring)."""
    a_in, g_in = _host(actual), _host(golden)
    if dtype is not None and dtype not in _CRITERION_DTYPES:
        raise InvalidArgument("value", "dtype", dtype, f"must be None (the golden's dtype) or one of "
                                                       f"{list(_CRITERION_DTYPES)}")
    dt = dtype or dtype_name(g_in)
    tol = tol or TOLERANCES.get(dt, TOLERANCES["float32"])
    res = CompareResult(name, "float", False, tuple(g_in.shape), dt, int(g_in.size), int(g_in.size),
                        tolerance=asdict(tol))
    if a_in.shape != g_in.shape:
        res.message = f"FAIL: shape mismatch: actual {a_in.shape}, golden {g_in.shape}"
        return res
    if dtype is None and dtype_name(a_in) != dtype_name(g_in):
        res.message = (f"FAIL: dtype mismatch: actual {dtype_name(a_in)}, golden {dtype_name(g_in)} (pass dtype= "
                       f"to judge values of other dtypes by one dtype's criterion)")
        return res
    with np.errstate(invalid="ignore"):  # signalling NaNs become quiet NaNs, which is what is compared
        a = a_in.astype(np.float64)
        g = g_in.astype(np.float64)
    fin_a, fin_g = np.isfinite(a), np.isfinite(g)
    mask_bad = (fin_a != fin_g) | (~fin_g & ~fin_a & ~((np.isnan(a) & np.isnan(g)) | (a == g)))
    both = fin_a & fin_g
    with np.errstate(over="ignore", invalid="ignore"):  # inf - inf where not both finite (masked out by `both`);
        abs_err = np.where(both, np.abs(a - g), 0.0)  # opposite signs near float64's max: an error of inf
        rel_err = np.where(both, abs_err / (np.abs(g) + 1e-6), 0.0)
    elem_fail = mask_bad | (both & ~(abs_err <= tol.atol + tol.rtol * np.abs(np.where(both, g, 0.0))))
    res.n_fail = int(elem_fail.sum())
    res.max_abs = float(abs_err.max()) if abs_err.size else 0.0
    res.max_rel = float(rel_err.max()) if rel_err.size else 0.0
    res.cos_diff = cos_diff(a, g)
    n = max(int(both.sum()), 1)
    res.share_rel_gt_1e3 = float((rel_err > 1e-3).sum()) / n
    res.share_rel_gt_1e2 = float((rel_err > 1e-2).sum()) / n
    if dt in _ULP_INT and both.any():
        u = ulp_distance(np.where(both, a, 0.0), np.where(both, g, 0.0), dt)
        res.max_ulp = int(u.max())
        vals, counts = np.unique(np.minimum(u, 64), return_counts=True)
        res.ulp_histogram = {(f"{int(v)}" if v < 64 else ">=64"): int(c) for v, c in zip(vals, counts)}
    res.passed = res.n_fail == 0 and res.cos_diff <= tol.cos_tol
    # worst elements: non-finite mismatches first, then the other failing ones, then the rest, each group by
    # abs error (descending); a non-finite mismatch reports its own error, nan or inf (|nan - 0| is nan, not 0)
    rank = np.where(mask_bad, 2, np.where(elem_fail, 1, 0)).reshape(-1)
    order = np.lexsort((-abs_err.reshape(-1), -rank))[:max_report]
    for flat in order:
        if rank[flat] == 0 and abs_err.reshape(-1)[flat] == 0:
            break
        t = tuple(int(i) for i in np.unravel_index(flat, g.shape))
        ae, re_ = float(abs_err[t]), float(rel_err[t])
        if mask_bad[t]:
            with np.errstate(invalid="ignore"):
                ae = float(abs(a[t] - g[t]))
                re_ = float(ae / (abs(g[t]) + 1e-6))
        res.worst.append({"index": list(t), "golden": float(g[t]), "actual": float(a[t]),
                          "abs_err": ae, "rel_err": re_, "fails": bool(elem_fail[t])})
    # the verdict first, on what it rests (every element within atol + rtol * |golden|, and cos_diff within its
    # limit); then the diagnostics, which the verdict does not judge: a relative error is large wherever the golden
    # is near 0, so max_rel and the share above 0.1% can be large in a PASS (issue 27)
    verdict = [f"{res.n_fail} of {res.n} elements outside atol={tol.atol:g} + rtol={tol.rtol:g} * |golden|",
               f"cos_diff={res.cos_diff:.3e} {'<=' if res.cos_diff <= tol.cos_tol else '>'} {tol.cos_tol:g}"]
    if int(mask_bad.sum()):
        verdict.insert(0, f"{int(mask_bad.sum())} non-finite mismatches")
    diagnostics = [f"max_abs={res.max_abs:.3e}", f"max_rel={res.max_rel:.3e}",
                   f"rel>0.1%: {100 * res.share_rel_gt_1e3:.3f}% of the elements"]
    res.message = (("PASS: " if res.passed else "FAIL: ") + "; ".join(verdict)
                   + " | diagnostics, not judged: " + ", ".join(diagnostics))
    return res


@checked("actual:values golden:values name:str fmt:str? dtype:str?", fmt=_FMT_RULE)
def compare(actual, golden, *, name: str = "", fmt: str | None = None, tol: Tolerance | None = None,
            dtype: str | None = None, standard=None, exact=None, benchmark=None,
            standard_params: dict | None = None) -> CompareResult:
    """Bytes for integer/8-bit outputs, the float criterion for 16/32/64-bit floats.

    dtype: judge float values by this dtype's criterion (:func:`compare_float`); None: the golden's.
    standard: a name of :data:`qsfa.standards.STANDARDS`, a list of them or "all" (docs/numerics/comparison.md#standards):
    each one's verdict and figures land in ``result.standards[name]``, beside (never instead of) qsfa's verdict.
    "all" applies the standards that judge the output's dtype (the others are listed as skipped).
    exact / benchmark: the high-precision golden (``precision="exact"``) and the third-party benchmark
    (``precision="benchmark"``) the benchmark standards read. standard_params: {name: {param: value}}, names among
    the requested standards, parameters the standard's rule takes (:func:`qsfa.standards.check_standard_params`
    refuses others by name; ``floor`` a finite number > 0).
    """
    from . import standards as S

    S.resolve(standard)  # unknown names are refused before anything is compared
    S.check_standard_params(standard, standard_params)
    g = _host(golden)
    dt = dtype_name(g)
    if dt in _CRITERION_DTYPES or (dtype is not None and dtype in _CRITERION_DTYPES):
        res = compare_float(actual, golden, dtype=dtype, tol=tol, name=name)  # (dtype=None: the actual must have the golden's)
    else:
        res = compare_bytes(actual, golden, name=name, fmt=fmt)
    sdt = fmt if (fmt is not None and g.dtype.itemsize == 1) else (dtype or dt)
    add_standards(res, actual, golden, standard, dtype=sdt, exact=exact, benchmark=benchmark,
                  standard_params=standard_params)
    return res


def add_standards(res: CompareResult, actual, golden, standard, *, dtype: str, exact=None, benchmark=None,
                  standard_params: dict | None = None) -> CompareResult:
    """Judge ``actual`` by the requested standards (a name, a list or "all"; docs/numerics/comparison.md#standards)
    into ``res.standards``; "all" lists the standards without a rule for ``dtype`` as skipped."""
    from . import standards as S

    names = S.resolve(standard)
    everything = standard == "all" or (isinstance(standard, (list, tuple)) and "all" in standard)
    for n in names:
        if everything and not S.applicable(n, dtype):
            res.standards[n] = {"passed": True, "skipped": True, "reason": f"no rule for {dtype}"}
            continue
        try:
            r = S.judge(n, actual, golden, dtype=dtype, exact=exact, benchmark=benchmark,
                        **(standard_params or {}).get(n, {}))
        except InvalidArgument as e:  # e.g. a dtype the rule has no threshold for, named explicitly
            r = {"passed": False, "error": str(e)}
        if everything and r.get("missing"):  # "all": a rule without its references is not applicable here
            r = {"passed": True, "skipped": True, "reason": "needs " + " and ".join(r["missing"])}
        res.standards[n] = r
    return res


#: relative distance to the k-th score within which a differing index passes (the public indexer tests' thres)
TOPK_RTOL = 1e-4


def _integer_indices(v, a=None) -> bool:
    return _host(v).dtype.kind in "iu"


def _golden_indices_in_range(v, a) -> bool:
    """Every golden index is -1 (padding) or inside [0, S), S = scores.shape[-1]: the golden picked them."""
    g, s_len = _host(v), np.shape(_host(a["scores"]))
    if not s_len or g.dtype.kind not in "iu":
        return True  # a scalar score array is the shape report's to judge; float indices have their own rule
    valid = g[g != -1]
    return valid.size == 0 or (int(valid.min()) >= 0 and int(valid.max()) < s_len[-1])


@checked("actual:values golden:values scores:values rtol:float name:str max_report:int",
         actual=(_integer_indices, "top-k indices must be an integer array (float indices are not truncated)"),
         golden=(_integer_indices, "top-k indices must be an integer array (float indices are not truncated)"),
         scores=(lambda v, a: _host(v).dtype.kind != "b", "must be numeric scores, not bool"),
         rtol=(lambda v, a: np.isfinite(v) and v >= 0, "must be a finite number >= 0"),
         max_report=(nonnegative_int, "must be >= 0"))
def compare_topk(actual, golden, scores, *, rtol: float = TOPK_RTOL, name: str = "",
                 max_report: int = 10) -> CompareResult:
    """Top-k index sets, fair to ties (docs/numerics/comparison.md#top-k-criterion).

    actual, golden: integer indices ``[..., k]`` (-1 = padding); scores: the golden's score of every candidate
    ``[..., S]`` with the same leading dimensions. Per row, the sets of valid (non -1) indices are compared. A row
    is *exact* when they are equal; otherwise it passes as *tie-tolerant* when both have as many valid entries,
    the actual ones are distinct and inside ``[0, S)``, and every index in only one of the two sets has a score
    within ``rtol`` (relative) of the row's k-th score - the smallest golden score among the golden's indices (a
    k-th score of 0 requires equality). Order inside a row is not judged (compare_bytes does that). The verdict
    and the ``topk`` row counts keep exact set equality apart from the tie-tolerant passes.
    """
    a = _host(actual).astype(np.int64)
    g = _host(golden).astype(np.int64)
    sc = _host(scores).astype(np.float64)
    if not _golden_indices_in_range(g, {"scores": sc}):
        raise InvalidArgument("value", "golden", Raw(f"indices in [{int(g.min())}, {int(g.max())}]"),
                              f"the golden's indices must be -1 (padding) or inside [0, {sc.shape[-1]}) "
                              "(scores.shape[-1] candidates)")
    res = CompareResult(name, "topk", False, tuple(g.shape), dtype_name(_host(golden)), 0, 0,
                        tolerance={"rtol": float(rtol)})
    if a.shape != g.shape or g.ndim == 0 or sc.shape[:-1] != g.shape[:-1]:
        res.message = (f"FAIL: shape mismatch: actual {a.shape}, golden {g.shape}, scores {sc.shape} (scores need the "
                       f"indices' leading dimensions)")
        return res
    k, s_len = g.shape[-1], sc.shape[-1]
    a2, g2, sc2 = a.reshape(-1, k), g.reshape(-1, k), sc.reshape(-1, s_len)
    rows = a2.shape[0]
    exact = tie = 0
    fails = []
    for r in range(rows):  # rows whose sets differ are few; the equal ones are settled by one set comparison each
        gv, av = g2[r][g2[r] != -1], a2[r][a2[r] != -1]
        gs, as_ = set(gv.tolist()), set(av.tolist())
        if gs == as_ and av.size == gv.size:
            exact += 1
            continue
        why = None
        if av.size != gv.size:
            why = dict(reason=f"{av.size} valid indices, golden {gv.size}")
        elif len(as_) != av.size:
            why = dict(reason="repeated index")
        elif av.size and (av.min() < 0 or av.max() >= s_len):
            why = dict(reason=f"index outside [0, {s_len})")
        else:
            kth = float(sc2[r, gv].min()) if gv.size else 0.0
            for i in sorted(as_ ^ gs):
                v = float(sc2[r, i])
                dist = abs(v - kth)
                ok = np.isfinite(v) and np.isfinite(kth) and (dist == 0 or (kth != 0 and dist <= rtol * abs(kth)))
                if not ok:
                    why = dict(reason="score too far from the k-th", index=i, score=v, kth=kth,
                               rel=dist / abs(kth) if kth else float("inf"), only_in="actual" if i in as_ else "golden")
                    break
        if why is None:
            tie += 1
        else:
            fails.append((r, why))
    res.n, res.n_fail = rows, len(fails)
    res.passed = not fails
    res.topk = {"rows": rows, "exact_rows": exact, "tie_rows": tie, "failing_rows": len(fails), "rtol": float(rtol)}
    for r, why in fails[:max_report]:
        res.worst.append({"row": list(np.unravel_index(r, g.shape[:-1])) if g.ndim > 1 else [], **why})
    head = (f"{rows} rows: {exact} identical index sets, {tie} differ only in indices within rtol={rtol:g} of the "
            f"k-th score")
    res.message = ("PASS: " + head) if res.passed else f"FAIL: {len(fails)} rows fail; " + head
    return res


def assert_bytes_equal(actual, golden, *, name: str = "", fmt: str | None = None):
    res = compare_bytes(actual, golden, name=name, fmt=fmt)
    if not res.passed:
        raise AssertionError(str(res))


def assert_close(actual, golden, *, dtype: str | None = None, tol: Tolerance | None = None, name: str = ""):
    res = compare_float(actual, golden, dtype=dtype, tol=tol, name=name)
    if not res.passed:
        raise AssertionError(str(res))
    return res

