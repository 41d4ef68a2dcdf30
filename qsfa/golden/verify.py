"""``qsfa golden verify DIR [--recompute]``: is a golden directory intact, and does it still hold?

1. every file listed in the manifest exists and has its recorded size and sha256;
2. every array reads back with the manifest's shape and storage dtype and has its recorded sha256;
3. with ``recompute``: the outputs are computed again from the stored inputs on the reference backend
   and must be byte-identical to the stored ones (the report names the first differing elements).

Problems of 1 and 2 (and an operator this build lacks, so it cannot recompute) are *errors*: the directory
is unusable as it is (exit status 2). Problems of 3 are *failures*: the golden does not hold with this qsfa
(exit status 1). See :attr:`VerifyReport.exit_status`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .. import compare as qcompare
from . import io as gio
from .case import available_ops
from .guard import describe_path
from .io import GoldenInputError
from .manifest import MANIFEST, Progress, case_from_entry, golden_path, load_manifest, load_storage

__all__ = ["verify", "VerifyReport"]


@dataclass
class VerifyReport:
    folder: str
    cases: int = 0
    files: int = 0
    recomputed: int = 0
    problems: list = field(default_factory=list)  # one line each, naming the file or output (errors and failures)
    error_at: set = field(default_factory=set)  # indices into problems of the errors

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def errors(self) -> list:
        """The problems that make the directory unusable: files missing, unreadable or changed."""
        return [p for i, p in enumerate(self.problems) if i in self.error_at]

    @property
    def failures(self) -> list:
        """The other problems: recomputed outputs that differ from the stored ones."""
        return [p for i, p in enumerate(self.problems) if i not in self.error_at]

    def lines(self) -> list:
        """``ERROR <problem>`` / ``FAIL <problem>``, in the order found."""
        return [f"{'ERROR' if i in self.error_at else 'FAIL'} {p}" for i, p in enumerate(self.problems)]

    @property
    def exit_status(self) -> int:
        """0 OK, 1 a recomputed output differs (FAIL), 2 a file is missing, unreadable or changed (ERROR)."""
        return 2 if self.error_at else 1 if self.problems else 0

    def error(self, text: str):
        self.error_at.add(len(self.problems))
        self.problems.append(text)

    def fail(self, text: str):
        self.problems.append(text)


def _check_files(folder: str, c: dict, report: VerifyReport) -> set:
    """The case's listed files: present, regular, of their size and sha256. Returns those that are not."""
    bad = set()
    for rel, info in c["files"].items():
        report.files += 1
        path = golden_path(folder, rel)
        if not os.path.lexists(path):
            problem = "missing"
        elif not os.path.isfile(path):
            problem = f"{describe_path(path)}, not a regular file"
        elif (size := os.path.getsize(path)) != info.get("bytes"):
            problem = f"{size} bytes, the manifest says {info.get('bytes')}"
        elif (digest := gio.sha256_file(path)) != info.get("sha256"):
            problem = (f"sha256 {digest[:16]}... differs from the manifest's {str(info.get('sha256'))[:16]}... "
                       "(the file was changed)")
        else:
            continue
        report.error(f"{rel}: {problem}")
        bad.add(rel)
    return bad


def _check_arrays(folder: str, c: dict, report: VerifyReport, bad_files=()) -> dict:
    stored = {}
    for e in c["arrays"]:
        if e["file"] in bad_files:  # already reported, once for the file
            continue
        where = e["file"] + (f":{e['key']}" if e.get("key") else "")
        try:
            st = load_storage(folder, e)
        except GoldenInputError as err:
            report.error(f"{where}: {err}")
            continue
        if gio.array_sha256(st) != e["sha256"]:
            report.error(f"{where}: array bytes differ from the manifest's sha256")
            continue
        stored[(e["role"], e["name"])] = gio.from_storage(st, e["dtype"])
    return stored


def _recompute(folder: str, c: dict, stored: dict, report: VerifyReport):
    if c["op"] not in available_ops():
        report.error(f"{c['name']}: operator {c['op']!r} is not in this build of qsfa; cannot recompute")
        return
    case = case_from_entry(folder, c)
    try:
        fresh = case.run("reference")
    except Exception as e:  # the reference rejecting stored inputs is a finding, not a crash
        report.fail(f"{c['name']}: recomputing {c['op']} failed: {type(e).__name__}: {e}")
        return
    report.recomputed += 1
    want = {e["name"]: e for e in c["arrays"] if e["role"] == "output"}
    for name in sorted(set(fresh) - set(want)):
        report.fail(f"{c['name']}: the reference now returns an output {name!r} the golden lacks")
    for name, e in sorted(want.items()):
        if name not in fresh:
            report.fail(f"{c['name']}/out.{name}: the reference no longer returns this output")
            continue
        if ("output", name) not in stored:
            continue  # already reported as unreadable
        new, old = fresh[name], stored[("output", name)]
        m = stored.get(("mask", name))  # 1 = specified: bytes the layout leaves unspecified are not compared
        if m is not None and new.shape == old.shape == np.shape(m) and new.dtype.itemsize == 1:
            keep = np.asarray(m).astype(bool)
            nb, ob = new.view(np.uint8), np.asarray(old).view(np.uint8)
            if np.array_equal(nb[keep], ob[keep]):
                continue  # equal wherever specified (the stored bytes matched the manifest's sha256 when read)
        _, new_st = gio.to_storage(new)
        if list(new.shape) != e["shape"] or gio.array_sha256(new_st) != e["sha256"]:
            res = qcompare.compare_bytes(new, old, name=name, fmt=e.get("format"))
            msg = res.message.removeprefix("FAIL: ")  # the line below already says FAIL
            if e.get("compare") == "float" and list(new.shape) == e["shape"]:
                f = qcompare.compare_float(new, old, dtype=e["dtype"], name=name)
                within = "within" if f.passed else "outside"
                msg += (f"; max {f.max_ulp} ULP, {within} the docs/numerics/comparison.md#float-criterion tolerance (the reference's float outputs "
                        "are the same bytes on every machine: the golden was made by a qsfa whose numerics differ)")
            report.fail(f"{e['file']}{':' + e['key'] if e.get('key') else ''}: recomputed output "
                                   f"differs: {msg}")


def verify(folder: str, *, recompute: bool = False, progress: bool = True, stream=None) -> VerifyReport:
    """Check a golden directory (see the module docstring). Bad structure - a malformed manifest, one that lists
    no cases - raises GoldenInputError; everything else is collected in the report."""
    man = load_manifest(folder)
    if not man["cases"]:
        raise empty_set_error(folder, man, "verify")
    report = VerifyReport(folder)
    bar = Progress(len(man["cases"]), "verify", enabled=progress and len(man["cases"]) > 1, stream=stream)
    for c in man["cases"]:
        bar.step(c["name"])
        report.cases += 1
        bad = _check_files(folder, c, report)
        stored = _check_arrays(folder, c, report, bad)
        if recompute and len(stored) == len(c["arrays"]):
            _recompute(folder, c, stored, report)
    if not report.error_at:  # a layer chain set: its recorded chains must be the ones compare --chain accepts
        from .chain import chain_record_problems

        for p in chain_record_problems(folder, man):
            report.error(f"chains: {p}")
    return report


def empty_set_error(folder: str, man: dict, what: str) -> GoldenInputError:
    """A manifest that lists no cases is not a golden set to verify or compare against (generate never
    writes one)."""
    skipped = man.get("skipped") or []
    why = f" (it lists {len(skipped)} skipped, first {skipped[0]['name']}: {skipped[0]['reason']})" if skipped else ""
    return GoldenInputError(f"{os.path.join(folder, MANIFEST)} lists no cases{why}: an empty golden set, "
                            f"nothing to {what}")
