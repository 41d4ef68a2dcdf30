"""pytest options for running the conformance catalogue against any backend.

    pytest tests/test_conformance_reference.py --qsfa-backend yours --qsfa-backend-module yourpkg.kernels

(the repository's ``tests/conftest.py`` loads this plugin; elsewhere add ``-p qsfa.conformance.pytest_plugin``).

* ``--qsfa-backend NAME``: the backend the catalogue tests check (default ``reference``); the fixture
  ``qsfa_backend`` returns it. A name from the ``qsfa.backends`` entry-point group needs nothing else.
* ``--qsfa-backend-module MODULE`` (repeatable): imported first, so the backend it registers can be named.
* ``QSFA_HYPOTHESIS_PROFILE`` (the profile of the catalogue tests, :mod:`qsfa._profiles`): a value that names
  no profile stops pytest with a usage error (one line, exit status 4) before anything is collected.
* :func:`check_result` turns a property's result into the test's outcome: a skip, a failure, or - when the
  backend raised instead of returning (an ERROR verdict, docs/conformance.md#verdicts) - a
  :class:`ConformanceError`, which this plugin reports as an *error* ("E", counted apart from failures in the
  summary line), never as a failure.
"""

from __future__ import annotations

import importlib

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "qsfa_backend", "check_result", "ConformanceError",
           "pytest_runtest_makereport", "pytest_report_teststatus"]


class ConformanceError(Exception):
    """A conformance property ended in an ERROR (the backend raised, or the run broke): no verdict."""


def pytest_addoption(parser):
    g = parser.getgroup("qsfa", "qsfa conformance")
    g.addoption("--qsfa-backend", default="reference", metavar="NAME",
                help="backend the qsfa conformance catalogue tests check (default: reference)")
    g.addoption("--qsfa-backend-module", action="append", default=[], metavar="MODULE",
                help="import MODULE first (it registers a third-party qsfa backend); repeatable")


def pytest_configure(config):
    from .._profiles import ProfileError, active_profile

    try:
        active_profile()
    except ProfileError as e:
        raise pytest.UsageError(str(e)) from None


@pytest.fixture(scope="session")
def qsfa_backend(request) -> str:
    """The backend named by ``--qsfa-backend`` (usable here, its ``--qsfa-backend-module`` imported)."""
    from .._dispatch import get_backend

    for m in request.config.getoption("--qsfa-backend-module"):
        importlib.import_module(m)
    name = request.config.getoption("--qsfa-backend")
    get_backend(name)  # unknown / unusable: the error says why
    return name


def check_result(r, *, skip: bool = True) -> None:
    """The outcome of a catalogue test from its :class:`~qsfa.conformance.runner.PropertyResult`: ``pytest.skip``
    for a skipped property (``skip=False``: a skip fails the test), :class:`ConformanceError` for an ERROR, an
    AssertionError for anything but a pass with examples."""
    if r.status == "skipped" and skip:
        pytest.skip(r.message)
    if r.status == "error":
        raise ConformanceError(f"{r.property} ERROR on {r.backend!r}"
                               + (f" (chip {r.chip})" if getattr(r, "chip", None) else "") + f": {r.message}")
    assert r.status == "passed", (
        f"{r.property}" + (f" on {r.chip}" if getattr(r, "chip", None) else "") + f" ({r.status}): {r.message}\n"
        f"minimal falsifying example: {r.falsifying_example}\n{r.reproduce or ''}")
    assert r.examples > 0, f"{r.property}: no example ran"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call" and call.excinfo is not None and call.excinfo.errisinstance(ConformanceError):
        outcome.get_result().qsfa_error = True


def pytest_report_teststatus(report, config):
    if getattr(report, "qsfa_error", False):
        return "error", "E", "ERROR"
    return None
