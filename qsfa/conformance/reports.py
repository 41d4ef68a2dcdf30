"""Reports of a conformance run: a console table, JSON, Markdown and JUnit XML.

* JSON (``"format": "qsfa-conformance/1"``): :meth:`ConformanceReport.to_dict` - run settings, versions,
  summary counts and one record per property (status, examples, seconds, failure message, minimal
  falsifying example summary, case file, hypothesis reproduce line).
* Markdown: a summary line, a per-operator / per-property table and one section per failure.
* JUnit XML: one ``<testsuite>`` (the backend) with one ``<testcase classname="<operator>" name="<property>">``
  per property; ``<failure>`` / ``<error>`` / ``<skipped>`` as usual, so CI systems display the run.

:func:`write_report` picks the format from the file extension (``.json``, ``.md``, ``.xml``).
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

from .runner import CASE_SAVE_ERROR, ConformanceReport, PropertyResult

__all__ = ["format_table", "format_progress", "to_json", "to_markdown", "to_junit", "write_report",
           "REPORT_FORMATS"]

REPORT_FORMATS = {".json": "json", ".md": "markdown", ".markdown": "markdown", ".xml": "junit"}


def _status_word(r: PropertyResult) -> str:
    if r.status == "skipped" and getattr(r, "not_applicable", False):
        return "N/A"
    return {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "error": "ERROR"}[r.status]


def format_progress(k: int, total: int, r: PropertyResult, replay=None) -> str:
    """One progress line: ``[ 3/57] PASS  kv_quant_sparse_flash_attention.page_permutation  25 ex  1.23s``."""
    w = len(str(total))
    line = f"[{k:{w}d}/{total}] {_status_word(r):5s} {r.property}  {r.examples} ex  {r.seconds:.2f}s"
    if r.status in ("failed", "error"):
        lines = r.message.splitlines()
        save_err = [s for s in lines if s.startswith("(" + CASE_SAVE_ERROR)]  # appended by the runner
        lines = [s for s in lines if s not in save_err]
        line += "\n" + "\n".join("        " + s for s in lines[:6])
        if r.case_file:
            line += f"\n        case file: {r.case_file}"
            if replay is not None:  # ConformanceReport.replay_command of the run
                line += f"\n        replay: {replay(r.case_file)}"
        for s in save_err:  # never cut off with a long failure message
            line += "\n        WARNING: " + (s[1:-1] if s.endswith(")") else s[1:])
    elif r.status == "skipped" and r.message:
        line += f"  ({r.message})"
    return line


def _rows(report: ConformanceReport):
    for r in report.results:
        fam = r.property[len(r.op) + 1:] if r.property.startswith(r.op + ".") else r.property
        yield r.op, fam, r


def format_table(report: ConformanceReport) -> str:
    """The per-operator, per-property table printed at the end of a run."""
    head = ("operator", "property", "kind", "examples", "passed", "failed", "errors", "seconds", "status")
    rows = [(op, fam, r.kind, str(r.examples), str(r.passed), str(r.failed), str(getattr(r, "errors", 0)),
             f"{r.seconds:.2f}", _status_word(r)) for op, fam, r in _rows(report)]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    right = {3, 4, 5, 6, 7}

    def fmt(row):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))

    lines = [fmt(head), fmt(tuple("-" * w for w in widths))]
    prev = None
    for row in rows:
        shown = list(row)
        if row[0] == prev:
            shown[0] = ""
        prev = row[0]
        lines.append(fmt(shown))
    lines += standards_lines(report)
    s = report.summary
    lines.append("")
    chips = sorted({r.chip for r in report.results if getattr(r, "chip", None)})
    lines.append(f"backend {report.backend!r}, profile {report.profile}"
                 + (f", chip {'/'.join(chips)}" if chips else "")
                 + (f", seed {report.seed}" if report.seed is not None else "")
                 + (f", shard {report.shard}" if report.shard else "")
                 + f": {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped{_na(s, chips)}, "
                 f"{s['error']} errors; "
                 f"{s['examples']} examples in {report.seconds:.1f}s")
    return "\n".join(lines)


def standards_lines(report: ConformanceReport) -> list:
    """--standard: each property's tally per acceptance standard, beside its own status."""
    judged = [r for r in report.results if getattr(r, "standards", None)]
    if not judged:
        return []
    out = ["", "standards (beside qsfa's verdict; docs/numerics/comparison.md#standards):"]
    for r in judged:
        for name, t in r.standards.items():
            verdict = "PASS" if not t["failed"] else "FAIL"
            line = (f"  {r.property} {name}: {verdict} ({t['failed']} of {t['judged']} judged outputs fail; "
                    f"qsfa's criterion: {t.get('strict_failed', 0)})")
            if t.get("first_failure"):
                ff = t["first_failure"]
                line += "; first: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in ff.items() if k != "source")
            out.append(line)
    return out


def _na(s: dict, chips) -> str:
    """`` (2 not applicable on 950)`` when the chip ruled properties out before drawing (qsfa.strategies.chips)."""
    n = s.get("not_applicable", 0)
    return f" ({n} not applicable on {'/'.join(chips) or 'this chip'})" if n else ""


def to_json(report: ConformanceReport) -> str:
    return json.dumps(report.to_dict(), indent=2, sort_keys=False) + "\n"


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: ConformanceReport) -> str:
    s = report.summary
    edges = sum(getattr(r, "edge_examples", 0) for r in report.results)
    out = [f"# qsfa conformance: backend `{report.backend}`", ""]
    out.append(f"Profile `{report.profile}`" + (f", seed {report.seed}" if report.seed is not None else "")
               + (f", shard {report.shard}" if report.shard else "")
               + f", max_examples {report.max_examples} per property"
               + (f" (+ {edges} edge examples in all, run first: qsfa._edges)" if edges else "")
               + f"; started {report.started}, {report.seconds:.1f} s.")
    out.append("")
    chips = sorted({r.chip for r in report.results if getattr(r, "chip", None)})
    out.append(f"**{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped{_na(s, chips)}, "
               f"{s['error']} errors** "
               f"({s['properties']} properties, {s['examples']} examples).")
    out.append("")
    out.append("| operator | property | kind | examples | passed | failed | errors | seconds | status |")
    out.append("|---|---|---|---:|---:|---:|---:|---:|---|")
    for op, fam, r in _rows(report):
        out.append(f"| `{op}` | `{fam}` | {r.kind} | {r.examples} | {r.passed} | {r.failed} | {r.errors} | {r.seconds:.2f} | "
                   f"{_status_word(r)} |")
    bad = [r for r in report.results if r.status in ("failed", "error")]
    if bad:
        out += ["", "## Failures", ""]
        for r in bad:
            out.append(f"### `{r.property}` ({_status_word(r)})")
            out.append("")
            out.append(r.doc)
            out.append("")
            out.append("```")
            out.append(r.message)
            out.append("```")
            if r.falsifying_example:
                out.append("")
                out.append("Minimal falsifying example:")
                out.append("")
                out.append("```json")
                out.append(json.dumps(r.falsifying_example, indent=1, sort_keys=True))
                out.append("```")
            if r.case_file:
                out.append("")
                out.append(f"Case file: `{r.case_file}` (replay: `{report.replay_command(r.case_file)}`, "
                           f"reference outputs: `qsfa golden generate --case {r.case_file}`).")
            if r.reproduce:
                out.append("")
                out.append(f"Hypothesis: `{_md_escape(r.reproduce)}`")
            out.append("")
    std = standards_lines(report)
    if std:
        out += ["", "## Standards", "", "```"] + std[2:] + ["```"]
    skipped = [r for r in report.results if r.status == "skipped"]
    if skipped:
        out += ["", "## Skipped", ""]
        for r in skipped:
            out.append(f"- `{r.property}`: {_md_escape(r.message)}")
    return "\n".join(out).rstrip() + "\n"


def to_junit(report: ConformanceReport) -> str:
    s = report.summary
    suites = ET.Element("testsuites", name="qsfa-conformance", tests=str(s["properties"]),
                        failures=str(s["failed"]), errors=str(s["error"]), skipped=str(s["skipped"]),
                        time=f"{report.seconds:.3f}")
    suite = ET.SubElement(suites, "testsuite", name=f"qsfa-conformance.{report.backend}", tests=str(s["properties"]),
                          failures=str(s["failed"]), errors=str(s["error"]), skipped=str(s["skipped"]),
                          time=f"{report.seconds:.3f}", timestamp=report.started)
    props = ET.SubElement(suite, "properties")
    for k, v in (("backend", report.backend), ("profile", report.profile), ("seed", report.seed),
                 ("max_examples", report.max_examples), ("shard", report.shard)):
        ET.SubElement(props, "property", name=k, value="" if v is None else str(v))
    for op, fam, r in _rows(report):
        tc = ET.SubElement(suite, "testcase", classname=op, name=fam, time=f"{r.seconds:.3f}")
        ET.SubElement(tc, "properties")
        tprops = tc.find("properties")
        for k, v in (("kind", r.kind), ("examples", r.examples), ("passed", r.passed), ("failed", r.failed),
                     ("errors", r.errors), ("case_file", r.case_file)):
            if v is not None:
                ET.SubElement(tprops, "property", name=k, value=str(v))
        if r.status == "failed":
            el = ET.SubElement(tc, "failure", message=r.message.splitlines()[0][:500] if r.message else "failed",
                               type="PropertyFailure")
            body = [r.message]
            if r.falsifying_example:
                body.append("minimal falsifying example: " + json.dumps(r.falsifying_example, sort_keys=True))
            if r.case_file:
                body.append(f"case file: {r.case_file}")
                body.append(f"replay: {report.replay_command(r.case_file)}")
            if r.reproduce:
                body.append(r.reproduce)
            el.text = "\n".join(body)
        elif r.status == "error":
            el = ET.SubElement(tc, "error", message=r.message.splitlines()[0][:500] if r.message else "error")
            el.text = r.message
        elif r.status == "skipped":
            ET.SubElement(tc, "skipped", message=r.message[:500])
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def write_report(report: ConformanceReport, path: str) -> str:
    """Write ``report`` to ``path`` in the format its extension names (.json / .md / .xml)."""
    ext = os.path.splitext(path)[1].lower()
    kind = REPORT_FORMATS.get(ext)
    if kind is None:
        raise ValueError(f"Invalid value for --report, actual: {path!r}, reason: the extension must be one of "
                         f"{sorted(REPORT_FORMATS)}.")
    text = {"json": to_json, "markdown": to_markdown, "junit": to_junit}[kind](report)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
