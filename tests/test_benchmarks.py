"""`python -m benchmarks --quick` runs every benchmark once on small sizes and writes its outputs.

Nothing about time is asserted (tests never judge wall-clock figures); this only keeps the benchmark
scripts from rotting, and checks that each one produced rows with a same-process baseline.
"""

import json
import os
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _benchmarks(name: str = "__main__"):
    """The module ``benchmarks.<name>`` of this checkout (the runner by default)."""
    import importlib

    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module(f"benchmarks.{name}")
    finally:
        sys.path.remove(str(ROOT))


@pytest.mark.parametrize("name", sorted(_benchmarks().BENCHMARKS))
def test_quick_benchmark_runs_and_writes_its_outputs(name, tmp_path, capsys):
    """One test per benchmark (``--only NAME``), so no single test runs them all."""
    bm = _benchmarks()
    assert bm.main(["--quick", "--only", name, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["quick"] is True and data["failures"] == []
    rows = data["rows"]
    assert rows and {r["benchmark"] for r in rows} == {name}
    if not all("skipped" in r for r in rows):  # e.g. the GPU benchmark on a machine without CUDA
        assert any("ratio" in r and r["baseline_s"] > 0 for r in rows), name
    md = (tmp_path / "results.md").read_text()
    assert "| benchmark | case |" in md


def test_the_oracle_bytes_pinned_by_bytecheck_hold_here():
    """Every output of benchmarks/bytecheck.py (the decode and prefill cases, FP8 / HiFloat8 / fp16 variants, wide
    ranges, SFA with sinks, the C8 writers and dynamic_block_quant; the V4 cases: the next test) hashes to the value pinned in
    benchmarks/bytecheck_hashes.json, on this machine's CPU, BLAS and ml_dtypes: the bytes must not depend on
    them (docs/golden.md). Computed on an AVX-512 Intel machine (OpenBLAS SkylakeX kernel); reproduced on an AVX2
    AMD EPYC (OpenBLAS Haswell kernel) with ml_dtypes 0.5.1 and 0.7.0."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.bytecheck import cases, check
    finally:
        sys.path.remove(str(ROOT))
    res = check([n for n in cases() if not n.startswith("sharedkv-")])
    assert len(res) == 76
    bad = sorted(name for name, (want, got) in res.items() if want != got)
    assert not bad, f"{len(bad)} of {len(res)} cases give other bytes here: {bad}"


def test_the_v4_sharedkv_bytes_pinned_by_bytecheck_hold_here():
    """The DeepSeek-V4 shared-KV cases of benchmarks/bytecheck.py (the four front doors; SWA / CSA / HCA, A3 and 950
    numerics, wide ranges) hash to the values pinned from 52fc9fe, before issue 24's speed work on the core."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.bytecheck import check, sharedkv_cases
    finally:
        sys.path.remove(str(ROOT))
    res = check(list(sharedkv_cases()))
    assert len(res) == 8 and all(want for want, _ in res.values())
    bad = sorted(name for name, (want, got) in res.items() if want != got)
    assert not bad, f"{len(bad)} of {len(res)} cases give other bytes here: {bad}"


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--tokens", "-5"], ["--heads", "0"], ["--context", "100"]])
def test_sharedkv_prefill_refuses_sizes_it_cannot_run_by_name(argv, capsys):
    """Such sizes ended in an IndexError / ValueError / AssertionError traceback (or, --tokens 0, silently ran the
    default 16 rows); argparse now refuses them before anything is built (exit 2, the option named)."""
    with pytest.raises(SystemExit) as ei:
        _benchmarks("sharedkv_prefill").main(["--quick", *argv])
    assert ei.value.code == 2 and f"argument {argv[0]}: must be an integer >= " in capsys.readouterr().err


@pytest.mark.parametrize("name", ["cache_writers", "scaling"])
def test_a_benchmark_module_run_alone_checks_its_options(name, monkeypatch, capsys):
    """``python -m benchmarks.<name> --help`` prints the usage (argparse, so a misspelt option is refused too):
    it used to start the full run (``--quick`` was looked up in sys.argv, everything else ignored) and overwrite
    benchmarks/results.json. Run in-process as ``__main__`` with the benchmark runner replaced by one that fails."""
    import runpy

    import benchmarks.__main__ as runner

    def must_not_run(argv=None):
        pytest.fail(f"benchmarks.{name} {sys.argv[1:]} started the benchmark ({argv})")

    monkeypatch.setattr(runner, "main", must_not_run)
    for argv, code in ((["--help"], 0), (["--quik"], 2)):
        monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", *argv])
        monkeypatch.delitem(sys.modules, f"benchmarks.{name}", raising=False)  # run afresh, as python -m does
        with pytest.raises(SystemExit) as ei:
            runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=False)
        out, err = capsys.readouterr()
        assert ei.value.code == code, (argv, out, err)
        if code == 0:
            assert out.startswith(f"usage: python -m benchmarks.{name}"), out
            assert "--quick" in out and "--out" in out and "== " not in out, out  # nothing ran
        else:
            assert "unrecognized arguments: --quik" in err, err


@pytest.mark.parametrize("module, argv", [("chain", ["--kv", "0"]), ("chain", ["--kv", "-3"]),
                                          ("sharedkv_decode", ["--rounds", "0"]),
                                          ("sharedkv_decode", ["--rounds", "-1"])])
def test_benchmark_counts_of_zero_are_refused_by_name(module, argv, capsys):
    """``--kv 0`` / ``--rounds 0`` were taken for "not given" and silently ran the defaults (a 64K-token chain, 7
    rounds); argparse now refuses them before anything is built (exit 2, the option named)."""
    import importlib

    sys.path.insert(0, str(ROOT))
    try:
        mod = importlib.import_module(f"benchmarks.{module}")
    finally:
        sys.path.remove(str(ROOT))
    with pytest.raises(SystemExit) as ei:
        mod.main(["--quick", *argv])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and f"argument {argv[0]}: must be an integer >= 1, got {argv[1]}" in err


def test_peak_rss_sees_memory_the_block_holds():
    """benchmarks._harness.peak_rss (the RSS sampler of the two prefill benchmarks): 64 MiB touched inside the block
    and still held when it ends are in the peak (the last sample is taken as the block ends, not by the timer)."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks._harness import peak_rss
    finally:
        sys.path.remove(str(ROOT))
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc")
    with peak_rss() as mem:
        held = np.ones(64 << 17)  # 64 MiB of float64, every page touched
    assert mem.peak_anon - mem.base_anon >= 60 << 20 and mem.hwm >= mem.peak_anon  # VmHWM >= RSS >= RssAnon
    assert held[-1] == 1.0


def test_results_table_prints_a_memory_row_in_its_unit():
    """The prefill benchmarks' rows hold MiB (peak against the 512 MiB budget): results.md printed them as seconds
    ("435.20 s | 512 MiB working-set budget (MiB, not s): 512.00 s")."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.__main__ import _table
        from benchmarks._harness import Timing, row
    finally:
        sys.path.remove(str(ROOT))
    mib = row("p", "case", Timing(435.2, 435.2, 435.2, 0.0, 1), baseline_name="512 MiB working-set budget",
              baseline=Timing(512.0, 512.0, 512.0, 0.0, 0), unit="MiB")
    secs = row("t", "case", Timing(1.5, 1.5, 1.5, 0.0, 1), baseline_name="floor", baseline=Timing(0.5, 0.5, 0.5, 0.0, 1))
    lines = _table([mib, secs])
    assert "| p | case | 435.2 MiB | 512 MiB working-set budget: 512.0 MiB | 0.85 |" in lines[2], lines[2]
    assert "| t | case | 1.50 s | floor: 500.00 ms | 3 |" in lines[3], lines[3]


def test_sharedkv_prefill_row_tasks_fill_the_shared_output_with_the_serial_bytes(tmp_path):
    """The row tasks of ``--workers`` / ``--scheduler`` (run here in this process) each stream their rows into one
    shared output memmap, leaving the others' rows alone: together they give the bytes of one in-memory call; the
    file comparison that judges the split sees a single differing byte."""
    from qsfa.reference.sharedkv import sharedkv_attention

    m = _benchmarks("sharedkv_prefill")
    d = str(tmp_path)
    args = m.build(d, tokens=9, context=4096, heads=4)
    want, _ = sharedkv_attention(**{k: np.asarray(v) if isinstance(v, np.ndarray) else v for k, v in args.items()})
    out = np.lib.format.open_memmap(os.path.join(d, "split.npy"), mode="w+", dtype=want.dtype, shape=want.shape)
    out[:] = np.ones((), want.dtype)
    out.flush()
    del out
    for lo, hi in ((4, 9), (0, 4)):
        r = m.row_task(d, "split.npy", lo, hi)
        assert (r["lo"], r["hi"]) == (lo, hi) and r["seconds"] >= 0
    got = np.load(os.path.join(d, "split.npy")).view(want.dtype)
    assert got.tobytes() == want.tobytes()
    np.lib.format.open_memmap(os.path.join(d, "serial.npy"), mode="w+", dtype=want.dtype, shape=want.shape)[:] = want
    assert m._same_files(os.path.join(d, "serial.npy"), os.path.join(d, "split.npy"), block=4096)
    with open(os.path.join(d, "split.npy"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert not m._same_files(os.path.join(d, "serial.npy"), os.path.join(d, "split.npy"), block=4096)


def test_sharedkv_prefill_workers_run_on_a_local_cluster(tmp_path):
    """``--quick --workers 1``: the serial run, then the row tasks on a local Dask cluster, byte-identical."""
    pytest.importorskip("distributed")
    m = _benchmarks("sharedkv_prefill")
    rows = m.run(quick=True, folder=str(tmp_path), workers=1, task_rows=5)
    assert len(rows) == 2 and "4 row tasks on 1 local worker:" in rows[1]["case"]
    assert "byte-identical to the serial run's" in rows[1]["notes"] and "none re-run" in rows[1]["notes"]
    assert not os.listdir(tmp_path)  # the temporary folder (inputs and both outputs) is gone
