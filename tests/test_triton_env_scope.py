"""tests/_triton_env.py: the TRITON_INTERPRET=1 that the Triton test modules set at import reaches only their
own tests (tests/conftest.py's autouse fixture removes it elsewhere) and a variable the user set is kept."""

from __future__ import annotations

import os
import types

import pytest

import _triton_env


class _Request:
    def __init__(self, module_name, mp):
        self.module = types.SimpleNamespace(__name__=module_name)
        self._mp = mp

    def getfixturevalue(self, name):
        assert name == "monkeypatch"
        return self._mp


@pytest.mark.parametrize("set_here, module, kept", [
    (True, "test_triton_kernels", True),   # a module that called prepare(): runs interpreted
    (True, "test_other", False),           # any other module: the variable prepare() set is gone
    (False, "test_other", True),           # the user set it: never touched
])
def test_scope_removes_the_variable_only_outside_triton_modules(monkeypatch, set_here, module, kept):
    monkeypatch.setattr(_triton_env, "SET_HERE", set_here)
    monkeypatch.setattr(_triton_env, "USERS", {"test_triton_kernels"})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    inner = pytest.MonkeyPatch()
    _triton_env.scope(_Request(module, inner))
    assert (os.environ.get("TRITON_INTERPRET") == "1") is kept
    inner.undo()  # what pytest does after the test
    assert os.environ.get("TRITON_INTERPRET") == "1"


def test_this_module_runs_without_the_variable_the_triton_modules_set():
    # meaningful when a Triton test module was collected into the same process (then SET_HERE is True)
    if _triton_env.SET_HERE:
        assert "TRITON_INTERPRET" not in os.environ
    assert __name__ not in _triton_env.USERS
