"""The README stays true: its two commands, its quick start and its feature table."""

import importlib.util
import pathlib
import re

import pytest

from qsfa._dispatch import operators

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    lines = README.splitlines()
    assert lines[0] == "```bash" and lines[3] == "```"
    main_job, tests = lines[1], lines[2]
    assert "python3 -m venv .venv" in main_job and "qsfa golden generate" in main_job and "verify" in main_job
    assert "python3 -m venv .venv" in tests and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert "sed -n '3p' README.md" in ci  # .ci/run executes exactly README line 3


def _table():
    block = README.split("<!-- feature-table:start -->")[1].split("<!-- feature-table:end -->")[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`([^`]+)`", cells[0])
        for n in names:
            rows[n] = dict(zip(("reference", "npu", "triton"), (c == "yes" for c in cells[2:5])))
    return rows


def test_feature_table_lists_every_operator_and_nothing_else():
    assert set(_table()) == set(operators())


def test_feature_table_reference_and_npu_columns_match_the_registry():
    from qsfa.npu import mapping

    for name, cols in _table().items():
        assert cols["reference"] == ("reference" in operators()[name].impls), name
        assert cols["npu"] == (name in mapping.MAPPINGS), name


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_feature_table_triton_column_matches_the_registry():
    import qsfa.triton_backend  # noqa: F401  (registers the triton implementations)

    for name, cols in _table().items():
        assert cols["triton"] == ("triton" in operators()[name].impls), name


def test_quick_start_runs(capsys):
    code = README.split("## Quick start")[1].split("```python")[1].split("```")[0]
    exec(compile(code, "README quick start", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[  9  66 111]"  # HiF8 codes of 1.125, 24 and +Inf (docs/numerics/formats.md#hifloat8 worked examples)
    assert out[-1].startswith("{") and "'reference': True" in out[-1]
