import pytest
from hypothesis import settings

import _triton_env
from qsfa._profiles import ProfileError, register_profiles

pytest_plugins = ["qsfa.conformance.pytest_plugin",  # --qsfa-backend / --qsfa-backend-module
                  "_clone_root"]  # the repository root is a folder, not a package, to pytest

try:
    settings.load_profile(register_profiles())
except ProfileError:  # a bad QSFA_HYPOTHESIS_PROFILE: the plugin's pytest_configure stops with a usage error
    pass

try:  # speed only: NumPy's BLAS at one thread in each pytest process (`_ONE_BLAS_THREAD`)
    from threadpoolctl import threadpool_limits
except ImportError:
    _ONE_BLAS_THREAD = None
else:
    # `pytest -n 2` runs a worker process per core, so BLAS threads of their own only compete with the other worker
    # (and whatever else runs): on a busy machine OpenBLAS's pool spins on the oracle's small float64 GEMMs at up to
    # 20x the CPU time of one thread. No result depends on it: the oracle's bytes do not depend on the thread count
    # (tests/test_parallel.py), and the tests of the thread knob set the BLAS limit they need themselves. Limited
    # once, at import, in this (the main) thread - the one tests run on; subprocesses start with their own default.
    _ONE_BLAS_THREAD = threadpool_limits(limits=1, user_api="blas")


@pytest.fixture(autouse=True)
def _triton_interpret_only_in_triton_modules(request):
    """TRITON_INTERPRET=1, which the Triton test modules set at import (tests/_triton_env.py), is removed
    for the tests of every other module, so no test depends on which modules were collected before it."""
    _triton_env.scope(request)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The README main job's golden directory (the smoke set, bin), generated once per module that asks for it; a
    test that changes files works on a copy."""
    from qsfa.cli import main

    out = tmp_path_factory.mktemp("golden") / "golden-out"
    assert main(["golden", "generate", "--set", "smoke", "--out", str(out), "-q"]) == 0
    return out


@pytest.fixture
def mirror_backend():
    """``make(name, patch=None)``: register a backend ``name`` that runs every operator's reference implementation,
    ``patch`` = ``{op: f(reference_impl) -> impl}`` replacing some (a device under test that is right, or has one
    planted bug); unregistered after the test. A correct device is not the reference: a chain re-run on it is a
    real check (the reference itself is refused as a re-run backend)."""
    from qsfa import _dispatch

    made = []

    def make(name, patch=None):
        class Mirror(_dispatch.Backend):
            pass

        Mirror.name = name
        _dispatch.register_backend(Mirror())
        made.append(name)
        for op_name, op in _dispatch.operators().items():
            ref = op.impls["reference"]
            _dispatch.register_impl(name, op_name, (patch or {}).get(op_name, lambda r: r)(ref))
        return name

    yield make
    for name in made:
        _dispatch.unregister_backend(name)
