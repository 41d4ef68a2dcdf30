"""``qsfa golden compare DIR --actual FILE_OR_DIR``: a kernel's outputs against a golden directory.

Each selected output is compared with :mod:`qsfa.compare` (docs/numerics/comparison.md#float-criterion):

* ``compare: "bytes"`` outputs (codes, scales, caches, indices) bit for bit; each differing element is
  named by index, byte offset in the file, the packed-row field it falls in and its decoded golden and
  actual values;
* ``compare: "float"`` outputs (attention, LSE) with the per-dtype ``|a - g| <= atol + rtol * |g|`` + cos_diff
  criterion (docs/numerics/comparison.md#float-criterion) and the
  msprobe statistics (dual thousandths, ULP histogram).

Outputs with a mask file are compared only where the mask is 1 (elements the operator leaves unspecified,
e.g. the LSE of padding query rows).

Where the actual outputs are looked for (``<case>`` and ``<name>`` from the manifest):

* ``--actual DIR``: ``DIR/<case>/out.<name>.bin`` (raw, same storage dtype and size as the golden file),
  ``DIR/<case>/out.<name>.npy`` or member ``out.<name>`` of ``DIR/<case>/arrays.npz`` - a copy of the
  golden directory with the outputs overwritten works as is; with a single selected case also
  ``DIR/out.<name>.bin|.npy`` and ``DIR/<name>.bin|.npy``;
* ``--actual FILE.npz``: member ``<case>/out.<name>``, or ``out.<name>`` / ``<name>`` for a single case;
* ``--actual FILE.bin|FILE.npy``: exactly one selected output (narrow with ``--case`` / ``--output``).
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from .. import compare as qcompare
from . import io as gio
from .guard import check_npz_member, describe_path, read_npy
from .io import GoldenInputError
from .manifest import golden_path, load_manifest, load_storage

__all__ = ["compare_dir", "CompareReport", "OutputResult", "format_report", "write_histogram"]


@dataclass
class OutputResult:
    case: str
    output: str
    criterion: str
    result: qcompare.CompareResult
    actual_path: str
    masked: int = 0  # elements not compared (unspecified)
    log10_err: np.ndarray | None = field(default=None, repr=False)  # |actual - golden| > 0, for plots
    nonfinite_actual: int = 0  # float outputs: NaN / Inf elements among those compared
    nonfinite_golden: int = 0

    def to_dict(self) -> dict:
        d = {"case": self.case, "output": self.output, "criterion": self.criterion,
             "actual": self.actual_path, "unspecified_elements": self.masked}
        if self.criterion == "float":
            d.update(nonfinite_actual=self.nonfinite_actual, nonfinite_golden=self.nonfinite_golden)
        d.update(self.result.to_dict())
        return d


@dataclass
class CompareReport:
    golden: str
    actual: str
    results: list = field(default_factory=list)
    standards: list = field(default_factory=list)  # the requested acceptance standards (qsfa.standards)
    verdict_by: str | None = None  # a standard that gives the verdict instead of qsfa's strict one

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.result.passed for r in self.results)

    def passed_by(self, name: str) -> bool:
        """The verdict of one standard: every output it judges passes it; an output it has no rule for (skipped)
        keeps qsfa's own verdict."""
        def one(r):
            s = r.result.standards.get(name)
            return r.result.passed if s is None or s.get("skipped") else bool(s.get("passed"))
        return bool(self.results) and all(one(r) for r in self.results)

    def judged(self, name: str) -> int:
        """How many outputs standard ``name`` judged (not n/a: no rule for the dtype - skipped, or refused with an
        error when named explicitly - or references it lacks)."""
        return sum(1 for r in self.results if (s := r.result.standards.get(name)) is not None
                   and not s.get("skipped") and not s.get("missing") and not s.get("error"))

    def standard_verdict(self, name: str) -> str:
        """PASS / FAIL of one standard over the outputs it judged; n/a when it judged none."""
        if not self.judged(name):
            return "n/a"
        return "PASS" if self.passed_by(name) else "FAIL"

    @property
    def final_passed(self) -> bool:
        """The verdict that sets the exit status: qsfa's strict one, or ``verdict_by``'s."""
        return self.passed_by(self.verdict_by) if self.verdict_by else self.passed

    def to_dict(self) -> dict:
        extra = {}
        if self.standards:
            extra["standards"] = {n: self.standard_verdict(n) for n in self.standards}
        if self.verdict_by:
            extra["verdict_by"] = self.verdict_by
            extra["final_verdict"] = "PASS" if self.final_passed else "FAIL"
        return _json_safe({
            **extra,
            "golden": self.golden,
            "actual": self.actual,
            "verdict": "PASS" if self.passed else "FAIL",
            "outputs": len(self.results),
            "failed": sum(not r.result.passed for r in self.results),
            "results": [r.to_dict() for r in self.results],
        })


def _json_safe(o):
    if isinstance(o, dict):
        return {str(k): _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    if isinstance(o, (np.bool_,)):
        return bool(o)
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, (float, np.floating)):
        f = float(o)
        return f if math.isfinite(f) else repr(f)  # "nan", "inf", "-inf"
    return o


# --------------------------------------------------------------------------------------------------
# finding the actual outputs


def _golden_what(entry: dict) -> str:
    return f"the golden {entry['case']}/out.{entry['name']}, {entry['dtype']} stored as {entry['storage']}"


def _read_npy(path: str, entry: dict) -> np.ndarray:
    # judged from its header (shape, element size, size cap) before the data is read
    a = read_npy(path, shape=entry["shape"], itemsize=np.dtype(entry["storage"]).itemsize,
                 what=_golden_what(entry))
    return _coerce(a, entry, path)


def _coerce(a: np.ndarray, entry: dict, where: str) -> np.ndarray:
    """An actual array as the golden's storage dtype, checking shape and element size."""
    st = np.dtype(entry["storage"])
    ldt = gio.logical_dtype(entry["dtype"])
    if a.dtype.byteorder == ">":  # a big-endian .npy: its values, in the little-endian storage order
        a = a.astype(a.dtype.newbyteorder("<"))
    if tuple(a.shape) != tuple(entry["shape"]):
        raise GoldenInputError(f"{where}: shape {list(a.shape)} does not match the golden {entry['shape']} "
                               f"({entry['case']}/out.{entry['name']})")
    if a.dtype == st or a.dtype == ldt:
        return gio.to_storage(a)[1] if a.dtype == ldt else a
    if a.dtype.itemsize == st.itemsize and a.dtype.kind in ("V", "u", "i") and st.kind in ("u", "i"):
        return np.ascontiguousarray(a).view(st)  # bit patterns (e.g. bfloat16 saved without ml_dtypes)
    raise GoldenInputError(f"{where}: dtype {a.dtype} does not match the golden {entry['dtype']} "
                           f"(stored as {st.str}) of {entry['case']}/out.{entry['name']}")


def _from_npz(path: str, keys: list[str], entry: dict) -> np.ndarray | None:
    members = gio.npz_members(path)
    for k in keys:
        if k in members:
            raw = gio.read_npz_member(path, k, shape=entry["shape"], itemsize=np.dtype(entry["storage"]).itemsize,
                                      what=_golden_what(entry))
            return _coerce(raw, entry, f"{path}:{k}")
    return None


def _found(path: str) -> bool:
    """Whether an actual output is at ``path``: a regular file (a link to one counts); anything else there -
    a folder, a device, a FIFO, a link to one or a dangling link - is refused, saying what it is."""
    if not os.path.lexists(path):
        return False
    if not os.path.isfile(path):
        raise GoldenInputError(f"{path} is {describe_path(path)}, not a regular file: refusing to read it as an "
                               "actual output")
    return True


class _NoActual(GoldenInputError):
    """No file or member holds this output in the actual dump."""


#: ``where`` of an output the call does not produce (the 950's LSE, ``return_value=False`` values): its golden has no
#: elements, so an actual dump without it is complete
NOT_PRODUCED = "(not produced: the golden output has no elements)"


def _load_actual(actual: str, entry: dict, single_case: bool, single_output: bool) -> tuple[np.ndarray, str]:
    try:
        return _find_actual(actual, entry, single_case, single_output)
    except _NoActual:
        if math.prod(entry["shape"]) == 0:
            return np.zeros(entry["shape"], np.dtype(entry["storage"])), NOT_PRODUCED
        raise


def _find_actual(actual: str, entry: dict, single_case: bool, single_output: bool) -> tuple[np.ndarray, str]:
    case, name = entry["case"], entry["name"]
    st = np.dtype(entry["storage"])
    if os.path.isdir(actual):
        looked = []
        cands = [os.path.join(actual, case, f"out.{name}")]
        if single_case:
            cands += [os.path.join(actual, f"out.{name}"), os.path.join(actual, name)]
        for base in cands:
            if _found(base + ".bin"):
                return gio.read_bin(base + ".bin", st, entry["shape"]), base + ".bin"
            if _found(base + ".npy"):
                return _read_npy(base + ".npy", entry), base + ".npy"
            looked += [base + ".bin", base + ".npy"]
        npz = os.path.join(actual, case, "arrays.npz")
        if _found(npz):
            a = _from_npz(npz, [f"out.{name}"], entry)
            if a is not None:
                return a, f"{npz}:out.{name}"
        looked.append(f"{npz}:out.{name}")
        raise _NoActual(f"no actual output for {case}/out.{name}; looked for {', '.join(looked)}")
    if not os.path.lexists(actual):
        raise GoldenInputError(f"--actual {actual}: no such file or directory")
    if not os.path.isfile(actual):
        raise GoldenInputError(f"--actual {actual} is {describe_path(actual)}, not a regular file or a directory")
    if actual.endswith(".npz"):
        keys = [f"{case}/out.{name}"] + ([f"out.{name}", name] if single_case else [])
        a = _from_npz(actual, keys, entry)
        if a is None:
            raise _NoActual(f"{actual} has none of the members {keys}")
        return a, actual
    if not single_output:
        raise GoldenInputError(f"--actual {actual} is one file but several outputs are selected; "
                               "choose one with --case and --output, or pass a directory or .npz")
    if actual.endswith(".npy"):
        return _read_npy(actual, entry), actual
    return gio.read_bin(actual, st, entry["shape"]), actual


# --------------------------------------------------------------------------------------------------
# byte-level detail


def _decode_kind(kind: str, raw: bytes):
    """Decoded value(s) of one element of a packed-row field."""
    if kind in ("bfloat16", "float16", "float32"):
        st = np.frombuffer(raw, dtype=gio.storage_dtype(kind))
        return float(gio.from_storage(st, kind).astype(np.float64)[0])
    if kind == "uint8":
        return int(raw[0])
    from ..reference import formats as F

    if kind in ("float4_e2m1x2", "float4_e2m1x2_hi"):
        b = raw[0]
        pair = [b & 0xF, b >> 4] if kind == "float4_e2m1x2" else [b >> 4, b & 0xF]
        return [float(v) for v in F.decode(np.array(pair, np.uint8), "float4_e2m1")]
    return float(F.decode(np.array([raw[0]], np.uint8), kind)[0])


_KIND_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def _add_byte_detail(res: qcompare.CompareResult, actual_st: np.ndarray, golden_st: np.ndarray, entry: dict):
    """Add the file byte offset (and, for packed rows, the field and its decoded values) to each
    reported element."""
    g8 = np.ascontiguousarray(golden_st).view(np.uint8).reshape(-1)
    a8 = np.ascontiguousarray(actual_st).view(np.uint8).reshape(-1)
    item = golden_st.dtype.itemsize
    shape = tuple(entry["shape"])
    segs = entry.get("segments") if item == 1 else None
    row = shape[-1] if shape else 1
    for w in res.worst:
        flat = int(np.ravel_multi_index(tuple(w["index"]), shape)) if shape else 0
        off = flat * item
        diff = np.nonzero(g8[off:off + item] != a8[off:off + item])[0]
        w["byte_offset"] = off + (int(diff[0]) if diff.size else 0)
        if not segs:
            continue
        col = flat % row
        base = flat - col
        for start, end, kind, label in segs:
            if start <= col < end:
                size = _KIND_SIZE.get(kind, 1)
                k = (col - start) // size
                lo = base + start + k * size
                w["field"] = f"{label} [{k}]"
                w["golden_decoded"] = _decode_kind(kind, g8[lo:lo + size].tobytes())
                w["actual_decoded"] = _decode_kind(kind, a8[lo:lo + size].tobytes())
                break


# --------------------------------------------------------------------------------------------------


def _select(man: dict, cases, outputs) -> list[tuple[dict, dict, dict | None]]:
    sel = []
    for c in man["cases"]:
        if cases and not any(fnmatch.fnmatchcase(c["name"], p) for p in cases):
            continue
        masks = {e["name"]: e for e in c["arrays"] if e["role"] == "mask"}
        for e in c["arrays"]:
            if e["role"] != "output":
                continue
            if outputs and not any(fnmatch.fnmatchcase(e["name"], p) for p in outputs):
                continue
            sel.append((c, dict(e, case=c["name"]), masks.get(e["name"])))
    return sel


def compare_dir(golden: str, actual: str, *, cases=None, outputs=None, max_report: int = 10,
                keep_errors: bool = False, standards=None, verdict_by: str | None = None) -> CompareReport:
    """Compare the outputs found at ``actual`` with the golden directory (see the module docstring).

    ``keep_errors`` keeps log10|actual - golden| of the differing elements (for :func:`write_histogram`).
    ``standards``: acceptance standards (names, or "all"; docs/numerics/comparison.md#standards) judged beside
    qsfa's verdict, with the golden output as their reference (a golden directory holds no ``exact`` or
    ``benchmark`` outputs: atk-dual reports them missing); ``verdict_by``: the standard whose verdict
    :attr:`CompareReport.final_passed` gives.
    """
    from .. import standards as S
    from .verify import empty_set_error

    names = S.resolve(standards)
    if verdict_by is not None:
        S.resolve(verdict_by)
        need = S.needed_references(verdict_by)
        if need:
            raise GoldenInputError(f"Invalid value for --verdict-by, actual: {verdict_by!r}, reason: it needs "
                                   f"{' and '.join(need)} outputs, which a golden directory does not hold, so it "
                                   "would judge no output.")
        if verdict_by not in names:
            names.append(verdict_by)

    man = load_manifest(golden)
    if not man["cases"]:
        raise empty_set_error(golden, man, "compare against")
    sel = _select(man, cases, outputs)
    if not sel:
        what = f" matching --case {cases}" if cases else ""
        what += f" / --output {outputs}" if outputs else ""
        raise GoldenInputError(f"{golden} has no outputs{what}")
    for c in {id(c): c for c, _, _ in sel}.values():  # every selected case's files, inputs included
        _check_listed_files(golden, c)
    single_case = len({c["name"] for c, _, _ in sel}) == 1
    report = CompareReport(golden, actual, standards=names, verdict_by=verdict_by)
    for c, e, m in sel:
        g_st = _golden_storage(golden, e)
        a_st, where = _load_actual(actual, e, single_case, len(sel) == 1)
        n_masked = 0
        if m is not None:
            mask = _golden_storage(golden, m).astype(bool)
            n_masked = int((~mask).sum())
            a_st = np.where(mask, a_st, g_st)
        g = gio.from_storage(g_st, e["dtype"])
        a = gio.from_storage(np.ascontiguousarray(a_st), e["dtype"])
        label = f"{c['name']}/{e['name']}"
        if e.get("compare") == "float":
            res = qcompare.compare_float(a, g, dtype=e["dtype"], name=label, max_report=max_report)
        else:
            res = qcompare.compare_bytes(a, g, name=label, fmt=e.get("format"), max_report=max_report)
            if not res.passed and res.worst:
                _add_byte_detail(res, a_st, g_st, e)
        if where == NOT_PRODUCED:
            res.message = "PASS: not produced by the call (the golden output has no elements) and absent from --actual"
        if names:
            sdt = e["dtype"] if e.get("compare") == "float" else (e.get("format") or e["dtype"])
            qcompare.add_standards(res, a, g, names if standards != "all" else "all", dtype=sdt)
        out = OutputResult(c["name"], e["name"], e.get("compare", "bytes"), res, where, n_masked)
        if e.get("compare") == "float":
            sel_mask = mask if m is not None else np.ones(g.shape, bool)
            with np.errstate(invalid="ignore"):
                out.nonfinite_actual = int((~np.isfinite(a.astype(np.float64)) & sel_mask).sum())
                out.nonfinite_golden = int((~np.isfinite(g.astype(np.float64)) & sel_mask).sum())
        if keep_errors:
            with np.errstate(invalid="ignore", over="ignore"):
                err = np.abs(a.astype(np.float64) - g.astype(np.float64)).reshape(-1)
            err = err[np.isfinite(err) & (err > 0)]
            out.log10_err = np.log10(err)
        report.results.append(out)
    if verdict_by is not None and not report.judged(verdict_by):
        raise GoldenInputError(f"Invalid value for --verdict-by, actual: {verdict_by!r}, reason: it has no rule for "
                               f"any of the {len(report.results)} selected outputs (dtypes "
                               f"{sorted({e['dtype'] for _, e, _ in sel})}), so it judged none.")
    return report


def _verify_hint(golden: str) -> str:
    return f"run qsfa golden verify {golden}"


def _check_listed_files(golden: str, c: dict) -> None:
    """A selected case's files as its manifest lists them: inside the golden directory, regular, of the listed
    size; each array's declared shape matching its file (a ``bin`` file's size is the shape's bytes, checked by
    the manifest's own consistency; an ``npz`` member's zip entry and .npy header are read, not its data)."""
    for rel, info in c["files"].items():
        path = golden_path(golden, rel)
        if not os.path.lexists(path):
            raise GoldenInputError(f"golden file {rel}, listed in the manifest, is missing; {_verify_hint(golden)}")
        if not os.path.isfile(path):
            raise GoldenInputError(f"golden file {rel} is {describe_path(path)}, not a regular file; "
                                   f"{_verify_hint(golden)}")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise GoldenInputError(f"golden file {rel} has {size} bytes, the manifest says {info['bytes']}; "
                                   f"{_verify_hint(golden)}")
    for e in c["arrays"]:
        if e.get("key") is None:
            continue
        st = np.dtype(e["storage"])
        _, dt = check_npz_member(golden_path(golden, e["file"]), e["key"], shape=e["shape"], itemsize=st.itemsize,
                                 what=f"the manifest's {e['role']} {e['name']}")
        if dt != st:
            raise GoldenInputError(f"{e['file']}:{e['key']} is {dt.str}, the manifest says {st.str}; "
                                   f"{_verify_hint(golden)}")


def _golden_storage(golden: str, e: dict) -> np.ndarray:
    """A golden output or mask, checked against its manifest sha256 (the verdict depends on its bytes)."""
    st = load_storage(golden, e)
    if gio.array_sha256(st) != e["sha256"]:
        raise GoldenInputError(f"golden file {e['file']}{':' + e['key'] if e.get('key') else ''} does not match "
                               f"its manifest sha256; {_verify_hint(golden)}")
    return st


def _fmt_value(v):
    if isinstance(v, float):
        return f"{v:.9g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt_value(x) for x in v) + "]"
    return str(v)


def format_report(report: CompareReport, max_worst: int = 5) -> str:
    """The verdict table and the worst elements of every failing output."""
    rows = [("case", "output", "criterion", "verdict", "differ", "detail")]
    for r in report.results:
        res = r.result
        if r.criterion == "float":
            cos_tol = (res.tolerance or {}).get("cos_tol")
            limit = "" if cos_tol is None else f" ({'<=' if res.cos_diff <= cos_tol else '>'} {cos_tol:g})"
            # what the verdict rests on (the elements outside the tolerance are the "differ" column; cos_diff), then
            # the diagnostics it does not judge (a relative error is large wherever the golden is near 0)
            detail = (f"cos_diff={res.cos_diff:.2e}{limit} | diagnostics: max_abs={res.max_abs:.3g} "
                      f"max_rel={res.max_rel:.3g} rel>0.1%={100 * res.share_rel_gt_1e3:.3f}%"
                      + (f" max_ulp={res.max_ulp}" if res.max_ulp is not None else ""))
            if r.nonfinite_actual or r.nonfinite_golden:
                # the statistics are over the elements finite in both: say how many are not
                detail = (f"non-finite: actual {r.nonfinite_actual}, golden {r.nonfinite_golden} of {res.n}; "
                          f"finite pairs: {detail}")
        else:
            detail = res.message.removeprefix("PASS: ").removeprefix("FAIL: ")  # the verdict has its column
        if r.masked:
            detail += f" ({r.masked} unspecified elements not compared)"
        rows.append((r.case, r.output, r.criterion, "PASS" if res.passed else "FAIL",
                     f"{res.n_fail}/{res.n}", detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(5)) + "  " + row[5] for row in rows]
    failing = [r for r in report.results if not r.result.passed]
    for r in failing:
        res = r.result
        lines.append("")
        lines.append(f"{r.case}/{r.output} ({r.actual_path}): {res.message.removeprefix('FAIL: ')}")
        for w in res.worst[:max_worst]:
            parts = [f"index {w['index']}"]
            if "byte_offset" in w:
                parts.append(f"byte {w['byte_offset']}")
            if "field" in w:
                parts.append(w["field"])
            gv, av = _fmt_value(w.get("golden")), _fmt_value(w.get("actual"))
            if "golden_decoded" in w:
                gv += f" (= {_fmt_value(w['golden_decoded'])})"
                av += f" (= {_fmt_value(w['actual_decoded'])})"
            parts.append(f"golden {gv}")
            parts.append(f"actual {av}")
            if "abs_err" in w:
                parts.append(f"abs_err {w['abs_err']:.3g} rel_err {w['rel_err']:.3g}")
            lines.append("  " + ", ".join(parts))
    if report.standards:
        lines.append("")
        lines.append("standards (beside qsfa's verdict; docs/numerics/comparison.md#standards):")
        for r in report.results:
            for name, s in r.result.standards.items():
                lines.append(f"  {r.case}/{r.output} {name}: {qcompare.standard_line(s)}")
        for name in report.standards:
            lines.append(f"  {name}: {report.standard_verdict(name)}")
    n_fail = len(failing)
    lines.append("")
    by = (f"; by {report.verdict_by}: {'PASS' if report.final_passed else 'FAIL'} (the exit status)"
          if report.verdict_by else "")
    lines.append(f"verdict: {'PASS' if report.passed else 'FAIL'} ({len(report.results) - n_fail} of "
                 f"{len(report.results)} outputs pass){by}")
    return "\n".join(lines)


def write_json(report: CompareReport, path: str):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1, sort_keys=True, allow_nan=False)
        f.write("\n")


def matplotlib_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_histogram(report: CompareReport, path: str, max_panels: int = 24):
    """A PNG with one panel per output that differs (failing ones first, at most ``max_panels``): the
    histogram of log10|actual - golden| over its differing elements. Needs ``compare_dir(...,
    keep_errors=True)`` and matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    differ = [r for r in report.results if r.log10_err is not None and r.log10_err.size]
    differ.sort(key=lambda r: (r.result.passed, -float(r.log10_err.max())))
    shown = differ[:max_panels]
    n = max(len(shown), 1)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows + 0.6), squeeze=False)
    for ax, r in zip(axes.ravel(), shown):
        ax.hist(r.log10_err, bins=50)
        ax.set_xlabel("log10 |actual - golden|")
        ax.set_ylabel("elements")
        ax.set_title(f"{r.case}/{r.output} {'PASS' if r.result.passed else 'FAIL'} "
                     f"({r.log10_err.size} of {r.result.n} differ)", fontsize=8)
    for ax in axes.ravel()[len(shown):]:
        ax.axis("off")
    if not shown:
        axes[0, 0].text(0.5, 0.5, f"all {len(report.results)} outputs identical", ha="center", va="center")
    fig.suptitle(f"{len(differ)} of {len(report.results)} outputs differ from the golden"
                 + (f" (first {len(shown)} shown)" if len(shown) < len(differ) else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
