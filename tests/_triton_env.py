"""The one preamble of the Triton test modules, and the scope of ``TRITON_INTERPRET`` in a pytest process.

Triton 3.9 reads ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``) when ``@triton.jit`` *decorates* a
function: with it set to 1 the function becomes an ``InterpretedFunction`` that runs on the CPU, otherwise a
``JITFunction`` compiled for a device. That happens when a module is imported - ``triton.language``'s own
``@jit`` helpers (``tl.max``, ``tl.sum``, ...) at ``import triton`` and the kernels of ``qsfa.kernels`` at their
import - and never again, so without a CUDA device the variable must be set before triton is first imported
and stays what it was then for the rest of the process. qsfa also reads it at run time:
``qsfa.triton_backend`` refuses to run kernels imported in the other mode, and the backend's availability, the
conformance runner's worker environment and its replay commands follow the variable.

So the variable is set in one place, here: :func:`prepare`, called at the top of every module whose tests run
the kernels, before that module imports triton or ``qsfa.kernels``. It sets ``TRITON_INTERPRET=1`` only where
the kernels cannot run on a device (no CUDA) and the user has not set the variable, and records which modules
asked for it. ``tests/conftest.py`` then removes the variable (for the duration of one test, through
``monkeypatch``) from every test in any other module, so a test that reads it - a replay command, a backend's
availability - sees the environment the user started pytest with, whatever the collection order. A variable
the user set themselves is never touched.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

VAR = "TRITON_INTERPRET"

#: True once :func:`prepare` set ``TRITON_INTERPRET=1`` itself (the user had not set it)
SET_HERE = False
#: the test modules (``__name__``) that called :func:`prepare`: their tests run with the variable set
USERS: set[str] = set()


def require_triton() -> None:
    """Skip the calling module (at import) when torch or triton is not installed."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
        pytest.skip("torch and triton are needed (pip install qsfa[triton])", allow_module_level=True)


def prepare(module_name: str) -> tuple[str, bool]:
    """Call at the top of a Triton test module, before it imports triton or ``qsfa.kernels``: skips the module
    when torch / triton are missing or the interpreter can no longer be switched on, sets ``TRITON_INTERPRET=1``
    when there is no CUDA device and the user has not set it, and returns ``(device, interpreted)``: the torch
    device the module's tensors go to (``"cpu"`` in the interpreter) and whether the kernels are interpreted."""
    global SET_HERE
    require_triton()
    import torch

    USERS.add(module_name)
    if not torch.cuda.is_available():
        value = os.environ.get(VAR)
        if value is not None and value != "1":
            pytest.skip(f"{VAR}={value} and no CUDA device: these tests need a device or {VAR}=1",
                        allow_module_level=True)
        if value is None:
            if "triton" in sys.modules:
                pytest.skip(f"triton was imported before {VAR}=1 could be set; rerun with {VAR}=1",
                            allow_module_level=True)
            os.environ[VAR] = "1"
            SET_HERE = True
    interpreted = os.environ.get(VAR) == "1"
    return ("cpu" if interpreted else "cuda"), interpreted


def scope(request) -> None:
    """For tests/conftest.py's autouse fixture: outside the modules that called :func:`prepare`, run the test
    without the ``TRITON_INTERPRET`` that :func:`prepare` set (restored after the test)."""
    if SET_HERE and request.module is not None and request.module.__name__ not in USERS:
        request.getfixturevalue("monkeypatch").delenv(VAR, raising=False)
