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
import inspect
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
    if interpreted:
        share_interpreter_patch()
    return ("cpu" if interpreted else "cuda"), interpreted


def share_interpreter_patch() -> bool:
    """Speed only: let the Triton interpreter patch ``triton.language`` once per launch instead of once per call.

    Triton 3.9's interpreter (``triton/runtime/interpreter.py``) patches the language modules seen by a kernel
    (``_patch_lang``: every builtin of ``tl``, ``tl.math``, ``tl.tensor``, ...) when a launch starts, restores them
    when it ends, and patches them *again* at every call of a nested ``@triton.jit`` function. The nested patch
    finds the builtins already replaced (they are no longer builtins, so nothing is wrapped twice), re-installs
    equivalent closures, is never restored, and is undone by the launch's own restore: it changes nothing but
    costs an ``inspect.getmembers`` scan of the language per call - a third or more of the CPU time of an
    attention launch, whose kernel calls helper functions hundreds of times.

    Here a nested call skips the patch when the running launch already patched every language module the
    helper sees, in the launch's own patch or in an earlier helper's; any other call (the first helper of the
    launch that sees a module the kernel does not, such as ``tl.zeros`` in ``triton.language.standard``, which
    sees ``tl.core``) goes to Triton's own code, as before. A helper's patch is never restored by Triton, so
    once it ran every later patch of the same modules in the launch changes nothing either. Nothing else changes: the kernels, their results and the launch's restore are Triton's.
    Returns True when installed (or already installed); False, leaving Triton untouched, when the interpreter
    does not have the shape this relies on (another Triton version).
    """
    from triton.runtime import interpreter as itp

    if getattr(getattr(itp, "_patch_lang", None), "_qsfa_shared", False):
        return True
    need = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction", "tl")
    if not all(hasattr(itp, n) for n in need) or not all(
            "_patch_lang" in f.__code__.co_names for f in (itp.GridExecutor.__call__, itp.InterpretedFunction.__call__)):
        return False
    real_patch, real_launch = itp._patch_lang, itp.GridExecutor.__call__
    # the language modules the running launch patched: [] outside a launch, [None] while it has not patched yet
    active: list = []

    def langs(fn) -> frozenset:  # the language modules _patch_lang(fn) patches, by identity
        return frozenset(map(id, fn.__globals__.values())) & {id(itp.tl), id(itp.tl.core)}

    def patch_lang(fn):
        if active and active[-1] is not None and langs(fn) <= active[-1]:
            return itp._LangPatchScope()  # an empty scope: an earlier patch of this launch holds these patches
        scope = real_patch(fn)
        if active:  # the launch's own patch, or a helper's that patched a module more (tl.core for tl.zeros)
            active[-1] = langs(fn) | (active[-1] or frozenset())
        return scope

    def launch(self, *args, **kwargs):
        active.append(None)
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            active.pop()

    patch_lang._qsfa_shared = True
    # both pairs, for tests/test_triton_kernels.py's identity check
    patch_lang._qsfa_pairs = {"triton": (real_patch, real_launch), "shared": (patch_lang, launch)}
    itp._patch_lang = patch_lang
    itp.GridExecutor.__call__ = launch
    return True


def scope(request) -> None:
    """For tests/conftest.py's autouse fixture: outside the modules that called :func:`prepare`, run the test
    without the ``TRITON_INTERPRET`` that :func:`prepare` set (restored after the test)."""
    if SET_HERE and request.module is not None and request.module.__name__ not in USERS:
        request.getfixturevalue("monkeypatch").delenv(VAR, raising=False)
