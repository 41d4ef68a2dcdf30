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


def test_the_oracle_bytes_pinned_by_bytecheck_hold_here():
    """Every output of benchmarks/bytecheck.py (the decode and prefill cases, FP8 / HiFloat8 / fp16 variants, wide
    ranges, SFA with sinks, the C8 writers and dynamic_block_quant) hashes to the value pinned in
    benchmarks/bytecheck_hashes.json, on this machine's CPU, BLAS and ml_dtypes: the bytes must not depend on
    them (docs/golden.md). Computed on an AVX-512 Intel machine (OpenBLAS SkylakeX kernel); reproduced on an AVX2
    AMD EPYC (OpenBLAS Haswell kernel) with ml_dtypes 0.5.1 and 0.7.0."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.bytecheck import check
    finally:
        sys.path.remove(str(ROOT))
    res = check()
    assert len(res) == 76
    bad = sorted(name for name, (want, got) in res.items() if want != got)
    assert not bad, f"{len(bad)} of {len(res)} cases give other bytes here: {bad}"
