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
