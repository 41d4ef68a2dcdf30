"""pytest options for running the conformance catalogue against any backend.

    pytest tests/test_conformance_reference.py --qsfa-backend yours --qsfa-backend-module yourpkg.kernels

(the repository's ``tests/conftest.py`` loads this plugin; elsewhere add ``-p qsfa.conformance.pytest_plugin``).

* ``--qsfa-backend NAME``: the backend the catalogue tests check (default ``reference``); the fixture
  ``qsfa_backend`` returns it. A name from the ``qsfa.backends`` entry-point group needs nothing else.
* ``--qsfa-backend-module MODULE`` (repeatable): imported first, so the backend it registers can be named.
* ``QSFA_HYPOTHESIS_PROFILE`` (the profile of the catalogue tests, :mod:`qsfa._profiles`): a value that names
  no profile stops pytest with a usage error (one line, exit status 4) before anything is collected.
"""

from __future__ import annotations

import importlib

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "qsfa_backend"]


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
