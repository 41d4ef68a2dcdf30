"""A third-party backend reaches every entry point: the public registration API, ``--backend-module`` on the CLI,
and the ``qsfa.backends`` entry-point group of an installed distribution (a fake ``*.dist-info`` on sys.path)."""

import textwrap

import numpy as np
import pytest

import qsfa
from qsfa.cli import main

pytest.importorskip("hypothesis")

#: a backend module as a user writes it (docs/your-kernel.md): NumPy kernels for two operators; the "buggy"
#: variant swaps the FP4 nibbles
MODULE = '''
import numpy as np
import qsfa


class {cls}(qsfa.Backend):
    name = "{name}"
    description = "a test kernel"


def pack_fp4(codes, nibble_order):
    first, second = codes[..., 0::2], codes[..., 1::2]
    lo, hi = (first, second) if (nibble_order == "low_first") != {buggy} else (second, first)
    return (lo | (hi << 4)).astype(np.uint8)


def register():
    qsfa.register_backend({cls}(), replace=True)
    qsfa.register_impl("{name}", "formats.pack_fp4", pack_fp4)


{call_register}
'''


def _write(tmp_path, mod, name, *, buggy=False, call_register=True):
    (tmp_path / f"{mod}.py").write_text(MODULE.format(cls="Toy", name=name, buggy=buggy,
                                                      call_register="register()" if call_register else ""))


@pytest.fixture
def clean(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []
    yield names
    for n in names:
        qsfa.unregister_backend(n)


def _conformance(*extra, tmp_path):
    return main(["conformance", "--properties", "formats.pack_fp4.vs_reference", "-q",
                 "--cases-dir", str(tmp_path / "cases"), *extra])


def test_backend_module_option(tmp_path, clean, capsys):
    _write(tmp_path, "qsfa_test_kernel_ok", "test-kernel-ok")
    _write(tmp_path, "qsfa_test_kernel_bad", "test-kernel-bad", buggy=True)
    clean += ["test-kernel-ok", "test-kernel-bad"]
    assert _conformance("--backend", "test-kernel-nope", tmp_path=tmp_path) == 2  # unknown without the module
    assert _conformance("--backend-module", "qsfa_test_kernel_ok", "--backend", "test-kernel-ok",
                        tmp_path=tmp_path) == 0
    assert _conformance("--backend-module", "qsfa_test_kernel_bad", "--backend", "test-kernel-bad",
                        tmp_path=tmp_path) == 1
    assert list((tmp_path / "cases").glob("test-kernel-bad.formats.pack_fp4.vs_reference.json"))
    assert _conformance("--backend-module", "no_such_module_xyz", "--backend", "x", tmp_path=tmp_path) == 2
    assert "Invalid value for --backend-module" in capsys.readouterr().err
    assert main(["backends", "--backend-module", "qsfa_test_kernel_ok"]) == 0
    assert "test-kernel-ok" in capsys.readouterr().out


def test_entry_point_group(tmp_path, clean, capsys):
    _write(tmp_path, "qsfa_test_kernel_ep", "test-kernel-ep", call_register=False)
    _write(tmp_path, "qsfa_test_kernel_broken", "test-kernel-broken", call_register=False)
    dist = tmp_path / "qsfa_test_kernel-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: qsfa-test-kernel\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent("""\
        [qsfa.backends]
        test-kernel-ep = qsfa_test_kernel_ep:register
        test-kernel-broken = qsfa_test_kernel_broken:no_such_function
        """))
    clean += ["test-kernel-ep"]
    st = qsfa.backends()
    assert st["test-kernel-ep"].usable and "formats.pack_fp4" in st["test-kernel-ep"].operators
    assert not st["test-kernel-broken"].usable and "no_such_function" in st["test-kernel-broken"].reason
    assert _conformance("--backend", "test-kernel-ep", tmp_path=tmp_path) == 0
    codes = np.arange(8, dtype=np.uint8)
    assert np.array_equal(qsfa.formats.pack_fp4(codes, backend="test-kernel-ep"), qsfa.formats.pack_fp4(codes))
    assert _conformance("--backend", "test-kernel-broken", tmp_path=tmp_path) == 2
    assert "test-kernel-broken" in capsys.readouterr().err


def test_pytest_runs_the_catalogue_on_a_named_backend(tmp_path):
    """``pytest --qsfa-backend NAME --qsfa-backend-module MODULE`` runs tests/test_conformance_reference.py on it."""
    import os
    import subprocess
    import sys

    _write(tmp_path, "qsfa_test_kernel_py", "test-kernel-py", buggy=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(root, "tests",
           "test_conformance_reference.py"), "-k", "pack_fp4", "--qsfa-backend", "test-kernel-py",
           "--qsfa-backend-module", "qsfa_test_kernel_py"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    # the swapped nibbles fail vs_reference, and the round trip (its unpack_fp4 helper on the reference)
    assert "2 failed, 1 passed" in out.stdout, out.stdout[-2000:]
    assert "pack_fp4.vs_reference" in out.stdout and "pack_fp4.unpack_roundtrip" in out.stdout


def test_your_kernel_doc_example_works(tmp_path, clean):
    """The backend module of docs/your-kernel.md, as written there, registers and passes its properties."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "docs", "your-kernel.md"), encoding="utf-8").read()
    code = re.search(r"```python\n(# yourpkg/qsfa_backend.py.*?)```", text, re.S).group(1)
    (tmp_path / "qsfa_doc_backend.py").write_text(code)
    clean.append("yours")
    assert _conformance("--backend-module", "qsfa_doc_backend", "--backend", "yours", tmp_path=tmp_path) == 0
    import qsfa.compare
    from qsfa.golden import Case

    case = Case.from_args("pack", "formats.pack_fp4", dict(codes=np.arange(16, dtype=np.uint8),
                                                           nibble_order="high_first"))
    got, want = case.run(backend="yours"), case.run(backend="reference")  # the golden comparison of the doc
    assert all(qsfa.compare.compare(got[n], want[n], name=n).passed for n in want)


def test_reports_print_a_replay_command_that_loads_the_backend_module(tmp_path, clean, capsys, monkeypatch):
    import json
    import re
    import shlex
    import sys

    # with TRITON_INTERPRET=1 (which tests/conftest.py already removes here unless the user set it) the replay
    # command (rightly) starts with it: this test is about the command itself, so it runs without that variable
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _write(tmp_path, "qsfa_test_kernel_rp", "test-kernel-rp", buggy=True)
    clean.append("test-kernel-rp")
    md, js = tmp_path / "out.md", tmp_path / "out.json"
    assert main(["conformance", "--properties", "formats.pack_fp4.vs_reference", "--cases-dir", str(tmp_path / "c"),
                 "--backend-module", "qsfa_test_kernel_rp", "--backend", "test-kernel-rp",
                 "--report", str(md), str(js)]) == 1
    console = capsys.readouterr().out
    cmd = re.search(r"replay: `([^`]+)`", md.read_text()).group(1)
    assert "--backend-module qsfa_test_kernel_rp" in cmd and f"replay: {cmd}" in console
    assert json.loads(js.read_text())["backend_modules"] == ["qsfa_test_kernel_rp"]
    argv = shlex.split(cmd)
    assert argv[:2] == ["qsfa", "conformance"]
    # as in a fresh process: the backend is not registered until the command imports its module
    qsfa.unregister_backend("test-kernel-rp")
    sys.modules.pop("qsfa_test_kernel_rp", None)
    assert main(argv[1:]) == 1  # still fails (not 2: unknown backend)
    assert "fails on 'test-kernel-rp'" in capsys.readouterr().out
