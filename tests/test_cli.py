"""The `qsfa` command line on a core install (numpy + ml_dtypes only, as README line 2 installs it).

The README main job runs `qsfa golden generate/verify` in a venv without hypothesis or torch; a subcommand
whose optional dependency is missing must not break the others, and must say what to install.
"""

import subprocess
import sys
import textwrap

# Runs in a fresh interpreter where importing hypothesis or torch fails, as on a core install.
_BLOCKED = textwrap.dedent(
    """
    import importlib.abc, importlib.util, sys

    MISSING = ("hypothesis", "torch", "triton")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in MISSING:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    _find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in MISSING else _find_spec(name, *a)
    sys.meta_path.insert(0, Block())
    from qsfa.cli import main
    """
)


def _run(body: str):
    return subprocess.run([sys.executable, "-c", _BLOCKED + textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=300)


def test_core_install_runs_golden_and_explains_missing_conformance_dependency(tmp_path):
    r = _run(f"""
        rc_list = main(["golden", "list"])
        rc_gen = main(["golden", "generate", "--set", "smoke", "--out", r"{tmp_path / 'g'}", "-q"])
        rc_ver = main(["golden", "verify", r"{tmp_path / 'g'}", "--recompute"])
        rc_conf = main(["conformance", "--backend", "reference"])
        rc_be = main(["backends"])
        print("RC", rc_list, rc_gen, rc_ver, rc_conf, rc_be)
        print("TORCH", "torch" in sys.modules, "HYPOTHESIS", "hypothesis" in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert "RC 0 0 0 2 0" in r.stdout
    assert "TORCH False HYPOTHESIS False" in r.stdout
    assert "'qsfa conformance' needs the hypothesis package" in r.stderr
    assert "pip install 'qsfa[conformance]'" in r.stderr
    assert "Traceback" not in r.stderr


def test_conformance_help_is_listed_when_available(capsys):
    from qsfa.cli import main

    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    assert "golden" in out and "conformance" in out and "backends" in out
    assert "The qsfa command line." in out and "``" not in out  # the docstring's reST markup stays out of --help


def test_a_failing_backend_module_is_one_sentence(tmp_path, monkeypatch, capsys):
    from qsfa.cli import main

    (tmp_path / "qsfa_test_raiser.py").write_text("raise ValueError('its own message ends in a period.')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["backends", "--backend-module", "qsfa_test_raiser"]) == 2
    err = capsys.readouterr().err
    assert err == ("qsfa backends: error: Invalid value for --backend-module, actual: 'qsfa_test_raiser', reason: "
                   "importing it failed: ValueError: its own message ends in a period.\n"), err


def _run_into_closed_pipe(*argv):
    """Run ``python -m qsfa.cli argv`` with stdout a pipe whose reader has already gone (``| head``)."""
    import os

    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "qsfa.cli", *argv], stdout=w, stderr=subprocess.PIPE,
                           text=True, timeout=300)
    finally:
        os.close(w)
    return p


def test_a_closed_stdout_ends_quietly_without_a_traceback():
    for argv in (["golden", "list", "smoke"], ["backends"]):
        p = _run_into_closed_pipe(*argv)
        assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, (argv, p.stderr)
        assert p.stderr == "", (argv, p.stderr)
        assert p.returncode == 141, (argv, p.returncode)
