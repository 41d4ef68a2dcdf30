"""``qsfa golden verify DIR [--recompute]``: is a golden directory intact, and does it still hold?

1. every file listed in the manifest exists and has its recorded size and sha256;
2. every array reads back with the manifest's shape and storage dtype and has its recorded sha256;
3. with ``recompute``: the outputs are computed again from the stored inputs on the reference backend
   and must be byte-identical to the stored ones (the report names the first differing elements).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


from .. import compare as qcompare
from . import io as gio
from .case import available_ops
from .io import GoldenInputError
from .manifest import Progress, case_from_entry, golden_path, load_manifest, load_storage

__all__ = ["verify", "VerifyReport"]


@dataclass
class VerifyReport:
    folder: str
    cases: int = 0
    files: int = 0
    recomputed: int = 0
    problems: list = field(default_factory=list)  # one line each, naming the file or output

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_files(folder: str, c: dict, report: VerifyReport) -> bool:
    ok = True
    for rel, info in c["files"].items():
        report.files += 1
        path = golden_path(folder, rel)
        if not os.path.isfile(path):
            report.problems.append(f"{rel}: missing")
            ok = False
            continue
        size = os.path.getsize(path)
        if size != info.get("bytes"):
            report.problems.append(f"{rel}: {size} bytes, the manifest says {info.get('bytes')}")
            ok = False
            continue
        digest = gio.sha256_file(path)
        if digest != info.get("sha256"):
            report.problems.append(f"{rel}: sha256 {digest[:16]}... differs from the manifest's "
                                   f"{str(info.get('sha256'))[:16]}... (the file was changed)")
            ok = False
    return ok


def _check_arrays(folder: str, c: dict, report: VerifyReport) -> dict:
    stored = {}
    for e in c["arrays"]:
        where = e["file"] + (f":{e['key']}" if e.get("key") else "")
        try:
            st = load_storage(folder, e)
        except GoldenInputError as err:
            report.problems.append(f"{where}: {err}")
            continue
        if gio.array_sha256(st) != e["sha256"]:
            report.problems.append(f"{where}: array bytes differ from the manifest's sha256")
            continue
        stored[(e["role"], e["name"])] = gio.from_storage(st, e["dtype"])
    return stored


def _recompute(folder: str, c: dict, stored: dict, report: VerifyReport):
    if c["op"] not in available_ops():
        report.problems.append(f"{c['name']}: operator {c['op']!r} is not in this build of qsfa; cannot recompute")
        return
    case = case_from_entry(folder, c)
    try:
        fresh = case.run("reference")
    except Exception as e:  # the reference rejecting stored inputs is a finding, not a crash
        report.problems.append(f"{c['name']}: recomputing {c['op']} failed: {type(e).__name__}: {e}")
        return
    report.recomputed += 1
    want = {e["name"]: e for e in c["arrays"] if e["role"] == "output"}
    for name in sorted(set(fresh) - set(want)):
        report.problems.append(f"{c['name']}: the reference now returns an output {name!r} the golden lacks")
    for name, e in sorted(want.items()):
        if name not in fresh:
            report.problems.append(f"{c['name']}/out.{name}: the reference no longer returns this output")
            continue
        if ("output", name) not in stored:
            continue  # already reported as unreadable
        new, old = fresh[name], stored[("output", name)]
        _, new_st = gio.to_storage(new)
        if list(new.shape) != e["shape"] or gio.array_sha256(new_st) != e["sha256"]:
            res = qcompare.compare_bytes(new, old, name=name, fmt=e.get("format"))
            msg = res.message.removeprefix("FAIL: ")  # the line below already says FAIL
            if e.get("compare") == "float" and list(new.shape) == e["shape"]:
                f = qcompare.compare_float(new, old, dtype=e["dtype"], name=name)
                within = "within" if f.passed else "outside"
                msg += (f"; max {f.max_ulp} ULP, {within} the docs/numerics/comparison.md#float-criterion tolerance (the reference's float outputs "
                        "are the same bytes on every machine: the golden was made by a qsfa whose numerics differ)")
            report.problems.append(f"{e['file']}{':' + e['key'] if e.get('key') else ''}: recomputed output "
                                   f"differs: {msg}")


def verify(folder: str, *, recompute: bool = False, progress: bool = True, stream=None) -> VerifyReport:
    """Check a golden directory (see the module docstring). Bad structure raises GoldenInputError;
    everything else is collected in the report."""
    man = load_manifest(folder)
    report = VerifyReport(folder)
    bar = Progress(len(man["cases"]), "verify", enabled=progress and len(man["cases"]) > 1, stream=stream)
    for c in man["cases"]:
        bar.step(c["name"])
        report.cases += 1
        _check_files(folder, c, report)
        stored = _check_arrays(folder, c, report)
        if recompute and len(stored) == len(c["arrays"]):
            _recompute(folder, c, stored, report)
    return report
