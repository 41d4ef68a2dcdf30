"""Conformance runs: properties over :mod:`qsfa.strategies`, run by hypothesis against any backend.

* :mod:`qsfa.conformance.properties` - the catalogue (:class:`Property`: name, operators, kind, doc,
  strategy, check); :func:`catalogue`, :func:`select`, :func:`get`.
* :mod:`qsfa.conformance.runner` - :func:`run_property`, :func:`run_conformance`, falsifying examples saved
  as ``qsfa-case/1`` files (:func:`save_case`) and replayed (:func:`replay_case`).
* :mod:`qsfa.conformance.reports` - console table, JSON, Markdown, JUnit XML.
* :mod:`qsfa.conformance.cli` - ``qsfa conformance``.
* :mod:`qsfa.conformance.mutants` / :mod:`qsfa.conformance.campaign` - mutant backends (the reference with one
  realistic kernel bug each) and the campaign that measures which ones the catalogue kills
  (``python -m qsfa.conformance.campaign``).
* :mod:`qsfa.conformance.pytest_plugin` - ``pytest --qsfa-backend NAME``.

See ``docs/conformance.md``. Needs hypothesis (``pip install qsfa[test]``).
"""

from .properties import KINDS, Example, Property, PropertyFailure, catalogue, get, select
from .reports import format_table, to_json, to_junit, to_markdown, write_report
from .runner import (
    DEFAULT_CASES_DIR,
    ConformanceReport,
    PropertyResult,
    load_example,
    replay_case,
    run_conformance,
    run_property,
    save_case,
)

__all__ = [
    "KINDS",
    "Example",
    "Property",
    "PropertyFailure",
    "catalogue",
    "get",
    "select",
    "run_property",
    "run_conformance",
    "PropertyResult",
    "ConformanceReport",
    "save_case",
    "load_example",
    "replay_case",
    "DEFAULT_CASES_DIR",
    "format_table",
    "to_json",
    "to_junit",
    "to_markdown",
    "write_report",
]
