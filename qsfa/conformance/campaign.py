"""Mutation campaign: run the conformance catalogue against every mutant backend, report kills and time-to-kill.

    python -m qsfa.conformance.campaign                       # every mutant, profile ci
    python -m qsfa.conformance.campaign --mutants 'qsfa.*' --profile dev --seed 3 --report out.json out.md
    python -m qsfa.conformance.campaign --list

For each mutant of :mod:`qsfa.conformance.mutants` (registered like a third-party backend), the properties that
call its operator run in catalogue order until one fails: the mutant is *killed* by that property, and the
time-to-kill is the wall time from the first property of the mutant to that failure (hypothesis' search and
shrinking included). The falsifying example is saved as a case file and replayed on the mutant (it must still
fail there) and on the reference (it must hold): a kill counts as *replayable* only then. A mutant that no
property fails *survived*; one that raised in some property (an ERROR verdict, docs/conformance.md#verdicts)
instead is reported as *raised*, apart from kills: a crash is not a caught bug. A mutant marked ``control`` has no
bug (it only does what the docs allow, e.g. scratch in unspecified bytes): it must survive, and is counted apart.
A mutant with a ``chip`` runs as a device backend of that chip (every call models it).

The report is written after every mutant (a run stopped by ``--time-budget`` or a timeout keeps what it
measured). Exit status: 0 every mutant killed with a replayable case and every control passed, 1 otherwise, 2 bad
usage.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

from ..cli import seconds_arg

__all__ = ["MutantResult", "CampaignReport", "run_mutant", "run_campaign", "main"]


@dataclass
class MutantResult:
    mutant: str
    op: str
    doc: str
    status: str  # "killed", "survived", "raised" (no property failed, one ended in an ERROR: the mutant raised),
    #             "error" (the harness broke), "not_run" (time budget)
    seconds: float = 0.0  # wall time to the kill (or of the whole run of a survivor)
    cpu_seconds: float = 0.0  # process CPU time over the same span (the machine may be shared)
    killed_by: str | None = None
    message: str = ""
    case_file: str | None = None
    replayable: bool | None = None
    properties_run: list = field(default_factory=list)
    control: bool = False  # a must-pass control (Mutant.control): it must survive
    chip: str | None = None  # the chip the mutant runs on (Mutant.chip)


@dataclass
class CampaignReport:
    profile: str
    seed: int | None
    max_examples: int | None
    started: str
    seconds: float = 0.0
    results: list = field(default_factory=list)

    @property
    def summary(self) -> dict:
        controls = [r for r in self.results if getattr(r, "control", False)]
        bugs = [r for r in self.results if not getattr(r, "control", False)]
        n = len(bugs)
        killed = [r for r in bugs if r.status == "killed"]
        out = {"mutants": n, "killed": len(killed),
               "replayable": sum(1 for r in killed if r.replayable),
               "survived": sum(1 for r in bugs if r.status == "survived"),
               # must-pass controls (Mutant.control): passed = no property failed them; a kill is a false alarm
               "controls": len(controls), "controls_passed": sum(1 for r in controls if r.status == "survived"),
               "raised": sum(1 for r in self.results if r.status == "raised"),
               "error": sum(1 for r in self.results if r.status == "error"),
               "not_run": sum(1 for r in self.results if r.status == "not_run")}
        if killed:
            out["max_seconds_to_kill"] = round(max(r.seconds for r in killed), 2)
            out["max_cpu_seconds_to_kill"] = round(max(r.cpu_seconds for r in killed), 2)
        return out

    def to_dict(self) -> dict:
        return {"format": "qsfa-mutation-campaign/1", "profile": self.profile, "seed": self.seed,
                "max_examples": self.max_examples, "started": self.started, "seconds": round(self.seconds, 2),
                "summary": self.summary, "results": [asdict(r) for r in self.results]}


def run_mutant(m, *, profile: str | None = None, seed: int | None = None, max_examples: int | None = None,
               cases_dir: str | None = None, stop_at_first: bool = True) -> MutantResult:
    """Run the properties of ``m.op`` against mutant ``m`` (see the module docstring)."""
    from .mutants import register_mutant, unregister_mutant
    from .properties import select
    from .runner import replay_case, run_property

    res = MutantResult(m.name, m.op, m.doc, "survived", control=getattr(m, "control", False),
                       chip=getattr(m, "chip", None))
    backend = register_mutant(m)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        for p in select(ops=[m.op]):
            r = run_property(p, backend, profile=profile, max_examples=max_examples, seed=seed,
                             cases_dir=cases_dir)
            res.properties_run.append({"property": p.name, "status": r.status, "seconds": round(r.seconds, 3)})
            if r.status == "failed" and res.status != "killed":
                res.status, res.killed_by = "killed", p.name
                res.seconds, res.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
                res.message = r.message.splitlines()[0][:300] if r.message else ""
                res.case_file = r.case_file
                if r.case_file:
                    from ..golden.io import GoldenInputError

                    try:
                        still_fails = not replay_case(r.case_file, backend)[0]
                        holds_on_reference = replay_case(r.case_file, "reference")[0]
                        res.replayable = still_fails and holds_on_reference
                    except GoldenInputError as e:  # the saved case is no call of the property (--replay exits 2)
                        res.replayable = False
                        res.message += f" (case file not replayable: {e})"
                if stop_at_first:
                    break
            elif r.status == "error" and res.status in ("survived", "raised"):
                # an ERROR (the mutant raised, or the run broke) is no kill: counted apart, the next property runs
                res.status = "raised"
                res.message = r.message.splitlines()[0][:300] if r.message else ""
        if res.status in ("survived", "raised"):
            res.seconds, res.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    except Exception as e:  # noqa: BLE001 - one broken mutant must not end the campaign
        res.status, res.message = "error", f"{type(e).__name__}: {e}"
        res.seconds, res.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    finally:
        unregister_mutant(m)
    return res


def run_campaign(mutants=None, *, profile: str | None = None, seed: int | None = None,
                 max_examples: int | None = None, cases_dir: str | None = None, time_budget: float | None = None,
                 progress=None, on_result=None) -> CampaignReport:
    """Run every mutant (default: all of :func:`qsfa.conformance.mutants.mutants`). ``time_budget`` (seconds):
    mutants not started when it is spent are reported as "not_run". ``on_result(report)`` is called after
    each mutant (for incremental reports)."""
    from .._profiles import active_profile
    from .mutants import mutants as all_mutants

    ms = list(all_mutants() if mutants is None else mutants)
    report = CampaignReport(profile or active_profile(), seed, max_examples,
                            _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    t0 = time.perf_counter()
    for k, m in enumerate(ms, 1):
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            r = MutantResult(m.name, m.op, m.doc, "not_run", message="time budget spent",
                             control=getattr(m, "control", False), chip=getattr(m, "chip", None))
        else:
            r = run_mutant(m, profile=profile, seed=seed, max_examples=max_examples, cases_dir=cases_dir)
        report.results.append(r)
        report.seconds = time.perf_counter() - t0
        if progress is not None:
            progress(k, len(ms), r)
        if on_result is not None:
            on_result(report)
    return report


def to_markdown(report: CampaignReport) -> str:
    s = report.summary
    lines = [f"# Mutation campaign ({report.profile}, seed {report.seed})", "",
             f"{s['killed']} of {s['mutants']} mutants killed ({s['replayable']} with a replayable case), "
             f"{s['survived']} survived, {s['raised']} raised, {s['error']} errors, {s['not_run']} not run; "
             f"{s['controls_passed']} of {s['controls']} must-pass controls passed; {report.seconds:.1f} s.", "",
             "| mutant | operator | chip | status | seconds (cpu) | killed by | replayable |",
             "|---|---|---|---|---|---|---|"]
    for r in report.results:
        status = f"control: {'passed' if r.status == 'survived' else 'FALSE ALARM' if r.status == 'killed' else r.status}" \
            if getattr(r, "control", False) else r.status
        lines.append(f"| {r.mutant} | {r.op} | {getattr(r, 'chip', None) or ''} | {status} | {r.seconds:.1f} "
                     f"({r.cpu_seconds:.1f}) | {r.killed_by or ''} | "
                     f"{'' if r.replayable is None else ('yes' if r.replayable else 'NO')} |")
    return "\n".join(lines) + "\n"


def write(report: CampaignReport, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        if path.endswith(".md"):
            f.write(to_markdown(report))
        else:
            json.dump(report.to_dict(), f, indent=2)
            f.write("\n")
    os.replace(tmp, path)


def _line(k, n, r: MutantResult) -> str:
    what = f"by {r.killed_by}" if r.killed_by else r.message[:80]
    if getattr(r, "control", False):
        what = ("control passed" if r.status == "survived" else "CONTROL FAILED (a false alarm) " + what)
    rep = "" if r.replayable is None else (" replayable" if r.replayable else " NOT REPLAYABLE")
    return f"[{k}/{n}] {r.mutant:58s} {r.status:8s} {r.seconds:6.1f}s (cpu {r.cpu_seconds:5.1f}s) {what}{rep}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qsfa.conformance.campaign", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", nargs="+", metavar="PATTERN", help="mutant names / fnmatch patterns / operators")
    ap.add_argument("--profile", choices=("ci", "dev", "nightly"), help="hypothesis profile (default: ci)")
    ap.add_argument("--seed", type=int, help="random seed (default: the profile's; ci is derandomised)")
    ap.add_argument("--max-examples", type=int, help="examples per property (default: the profile's)")
    ap.add_argument("--cases-dir", default=os.path.join("conformance-out", "mutants"),
                    help="where the falsifying examples are saved")
    ap.add_argument("--report", nargs="+", default=[], metavar="FILE", help="reports: .json and/or .md")
    ap.add_argument("--time-budget", type=seconds_arg, metavar="SECONDS",
                    help="start no mutant after this many seconds")
    ap.add_argument("--without-edges", action="store_true",
                    help="turn the edge cases of qsfa._edges off (the catalogue's power without them)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    from .._profiles import ProfileError, active_profile
    from .mutants import mutants

    if a.profile is None:
        try:
            active_profile()
        except ProfileError as e:
            print(e, file=sys.stderr)
            return 2

    ms = mutants(a.mutants)
    if not ms:
        print(f"Invalid value for --mutants, actual: {a.mutants!r}, reason: no mutant matches.", file=sys.stderr)
        return 2
    if a.list:
        for m in ms:
            print(f"{m.name:60s} {m.op:34s} {m.doc}")
        return 0
    for f in a.report:
        if not f.endswith((".json", ".md")):
            print(f"Invalid value for --report, actual: {f!r}, reason: must end in .json or .md.", file=sys.stderr)
            return 2

    if a.without_edges:
        from .. import _edges

        _edges.ENABLED = False

    def on_result(rep):
        for f in a.report:
            write(rep, f)

    rep = run_campaign(ms, profile=a.profile, seed=a.seed, max_examples=a.max_examples, cases_dir=a.cases_dir,
                       time_budget=a.time_budget, progress=None if a.quiet else
                       (lambda k, n, r: print(_line(k, n, r), flush=True)), on_result=on_result)
    s = rep.summary
    print(f"\n{s['killed']} of {s['mutants']} mutants killed ({s['replayable']} replayable), {s['survived']} "
          f"survived, {s['raised']} raised, {s['error']} errors, {s['not_run']} not run; "
          f"{s['controls_passed']} of {s['controls']} must-pass controls passed; slowest kill "
          f"{s.get('max_seconds_to_kill', 0):.1f} s (cpu {s.get('max_cpu_seconds_to_kill', 0):.1f} s); "
          f"{rep.seconds:.1f} s in all")
    return 0 if s["replayable"] == s["mutants"] and s["controls_passed"] == s["controls"] else 1


if __name__ == "__main__":
    sys.exit(main())
