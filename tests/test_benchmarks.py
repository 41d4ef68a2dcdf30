"""`python -m benchmarks --quick` runs every benchmark once on small sizes and writes its outputs.

Nothing about time is asserted (tests never judge wall-clock figures); this only keeps the benchmark
scripts from rotting, and checks that each one produced rows with a same-process baseline.
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quick_benchmarks_run_and_write_their_outputs(tmp_path, capsys):
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.__main__ import BENCHMARKS, main
    finally:
        sys.path.remove(str(ROOT))
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["quick"] is True and data["failures"] == []
    by_name = {}
    for r in data["rows"]:
        by_name.setdefault(r["benchmark"], []).append(r)
    assert set(by_name) == set(BENCHMARKS)
    for name, rows in by_name.items():
        if all("skipped" in r for r in rows):  # e.g. the GPU benchmark on a machine without CUDA
            continue
        assert any("ratio" in r and r["baseline_s"] > 0 for r in rows), name
    md = (tmp_path / "results.md").read_text()
    assert "| benchmark | case |" in md
