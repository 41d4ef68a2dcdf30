"""``--workers 2`` against a serial run, end to end: ``qsfa golden generate --set seed-rope0``, the full ``ci``
conformance run (``qsfa conformance --backend reference``) and one long prefill case (``--case``: 128 query
tokens x 32 heads x 1024 selected tokens, split into row tasks of 16 rows with ``--chunk-rows 16``).

Each figure is the wall time of the whole command (a fresh process: imports, cluster start-up, writing the
files and reports), so the fixed cost of a local cluster counts. The variants of a round run one after another
in an order that rotates from round to round, so that a change in machine load hits all of them; the medians,
the ratio and the load average (``os.getloadavg``) before and after are reported. The written golden sets are
compared byte for byte after each round.

CPU time (``resource.getrusage(RUSAGE_CHILDREN)`` around each command: the process and every process it
started) gives the ceiling: ``cores`` = CPU seconds / wall seconds. A serial run that already keeps more than
one core busy (NumPy's BLAS threads, the attention oracle's row threads) leaves two workers less to gain.
``--single-core`` adds a serial variant held to one core (``OPENBLAS_NUM_THREADS=1 QSFA_NUM_THREADS=1``,
i.e. the work as one worker does it): half of its wall time is what two perfectly balanced workers with no
start-up at all would take. ``--spawn`` adds ``--workers`` with Dask's default start method (every worker a
fresh interpreter that imports distributed, NumPy and qsfa itself) instead of qsfa's fork server;
``--dask-defaults`` adds ``--workers`` as Dask sets a local cluster up by default (spawned workers and
``MALLOC_TRIM_THRESHOLD_=65536``: qsfa's local cluster before 2026-12-01).

    python -m benchmarks.distributed [--rounds 5] [--only "golden seed-rope0" ...] [--workers 2]
                                     [--single-core] [--spawn] [--dask-defaults]
"""

from __future__ import annotations

import argparse
import filecmp
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from ._harness import Timing, row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name -> (command after ``qsfa``, quick command); OUT is replaced by a fresh output path
COMMANDS = {
    "golden seed-rope0": (["golden", "generate", "--set", "seed-rope0", "--out", "OUT", "-q"],
                          ["golden", "generate", "--set", "smoke", "--out", "OUT", "-q"]),
    "conformance ci": (["conformance", "--backend", "reference", "-q", "--report", "OUT.json", "--cases-dir",
                        "OUT.cases"],
                       ["conformance", "--backend", "reference", "-q", "--properties", "formats.decode.*",
                        "--report", "OUT.json", "--cases-dir", "OUT.cases"]),
    "golden prefill case": (["golden", "generate", "--case", "CASE", "--out", "OUT", "-q"], None),
}

#: the long case of "golden prefill case": written to CASE before the runs
PREFILL = dict(q_lens=[128], kv_lens=[2048], heads=32, layout_query="TND", layout_kv="PA_BSND", block_size=128,
               width=1024, rope_head_dim=64, dtype="bfloat16", data="realistic", scale_value=576 ** -0.5,
               sparse_mode=3, return_softmax_lse=True)


def _prefill_case(folder: str) -> str:
    from qsfa.golden import Case

    case = Case(name="prefill-128x32x1024", op="kv_quant_sparse_flash_attention", generator="qsfa_attention",
                seed=7, params=PREFILL, description="benchmarks/distributed.py: one long prefill case")
    return case.save(os.path.join(folder, "prefill.json"))


#: variant -> (extra environment, whether it adds --workers)
VARIANTS = {
    "serial": ({}, False),
    "parallel": ({}, True),
    "serial-1core": ({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                      "QSFA_NUM_THREADS": "1"}, False),
    "parallel-spawn": ({"DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD": "spawn"}, True),
    # the local cluster as Dask sets it up by default (qsfa's before 2026-12-01): spawned workers, malloc trimming
    "parallel-dask-defaults": ({"DASK_DISTRIBUTED__WORKER__MULTIPROCESSING_METHOD": "spawn",
                                "MALLOC_TRIM_THRESHOLD_": "65536"}, True),
}


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _become_subreaper() -> bool:
    """Adopt the orphans of the commands (Linux ``PR_SET_CHILD_SUBREAPER``): a local cluster's fork server outlives
    its command by a moment, and only a process that waits for it counts its CPU (and its workers')."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


_SUBREAPER: list = []  # [bool] once decided


def _reap(timeout: float = 60.0):
    """Wait for every adopted descendant (when this process is their subreaper), at most ``timeout`` seconds."""
    if not _SUBREAPER:
        _SUBREAPER.append(sys.platform.startswith("linux") and _become_subreaper())
    deadline = time.monotonic() + timeout
    while _SUBREAPER[0] and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def _run(cmd, out, env_extra=None) -> tuple[float, float]:
    """``(wall seconds, CPU seconds)`` of ``qsfa cmd``, CPU over the command and every process it started."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    args = [a.replace("OUT", out) for a in cmd]
    _reap()
    c0 = _cpu_children()
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "qsfa.cli", *args], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    _reap()
    cpu = _cpu_children() - c0
    if r.returncode != 0:
        raise RuntimeError(f"qsfa {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return dt, cpu


def _same_tree(a, b) -> bool:
    if not os.path.isdir(a):
        return True  # conformance: reports carry times; verdicts are compared by tests/test_distributed.py
    files = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, fs in os.walk(a) for f in fs)
    files_b = sorted(os.path.relpath(os.path.join(d, f), b) for d, _, fs in os.walk(b) for f in fs)
    return files == files_b and not filecmp.cmpfiles(a, b, files, shallow=False)[1]


def _timing(ts) -> Timing:
    a = np.asarray(ts)
    q1, q3 = np.percentile(a, [25, 75])
    return Timing(float(np.median(a)), float(a.min()), float(a.max()), float(q3 - q1), len(ts))


def measure(name: str, rounds: int, workers: int, quick: bool, *, single_core: bool = False,
            spawn: bool = False, dask_defaults: bool = False) -> dict:
    cmd = COMMANDS[name][1 if quick else 0]
    names = (["serial", "parallel"] + (["serial-1core"] if single_core else []) + (["parallel-spawn"] if spawn else [])
             + (["parallel-dask-defaults"] if dask_defaults else []))
    wall: dict = {v: [] for v in names}
    cpu: dict = {v: [] for v in names}
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="qsfa-bench-dist-")
    split = ["--chunk-rows", "16"] if "--case" in cmd else []
    try:
        if "--case" in cmd:
            cmd = [a.replace("CASE", _prefill_case(tmp)) for a in cmd]
        for k in range(rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            if k % 2:
                order = order[::-1]
            outs = {}
            for which in order:
                out = os.path.join(tmp, f"{which}{k}")
                outs[which] = out
                env_extra, parallel = VARIANTS[which]
                extra = ["--workers", str(workers)] + split if parallel else []
                dt, c = _run(cmd + extra, out, env_extra)
                wall[which].append(dt)
                cpu[which].append(c)
            for which in names[1:]:
                if not _same_tree(outs["serial"], outs[which]):
                    raise RuntimeError(f"{name}: the {which} set differs from the serial one")
            for out in outs.values():
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    t = {v: _timing(wall[v]) for v in names}
    s, p = t["serial"], t["parallel"]
    med_cpu = {v: float(np.median(cpu[v])) for v in names}
    cores = {v: float(np.median(np.asarray(cpu[v]) / np.asarray(wall[v]))) for v in names}
    label = name if not quick else f"{name.split()[0]} quick: qsfa {' '.join(cmd[:4])}"
    notes = (f"--workers {workers}, {rounds} rotating rounds; load average {load_before[0]:.1f} before, "
             f"{load_after[0]:.1f} after, on {os.cpu_count()} CPUs; "
             + "; ".join(f"{v} {[round(x, 2) for x in wall[v]]} s wall, CPU {med_cpu[v]:.2f} s "
                         f"({cores[v]:.2f} cores)" for v in names))
    r = row("distributed", label, p, baseline_name="serial", baseline=s, notes=notes)
    r["load_before"], r["load_after"] = list(load_before), list(load_after)
    r["variants"] = {v: dict(t[v].to_dict(), cpu_s=med_cpu[v], cores=cores[v], wall=wall[v], cpu=cpu[v])
                     for v in names}
    if single_core:
        # two perfectly balanced workers, no start-up: half the work as one core does it
        r["ceiling_speedup"] = s.median_s / (t["serial-1core"].median_s / 2)
    return r


def run(quick: bool = False) -> list[dict]:
    names = ["golden seed-rope0"] if quick else list(COMMANDS)  # quick: the smoke set
    return [measure(n, 1 if quick else 5, 2, quick) for n in names]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--only", nargs="+", choices=sorted(COMMANDS), help="only these measurements")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--single-core", action="store_true",
                   help="also a serial run held to one core (the ceiling: half its time)")
    p.add_argument("--spawn", action="store_true", help="also --workers with Dask's spawn start method")
    p.add_argument("--dask-defaults", action="store_true",
                   help="also --workers as Dask sets a local cluster up by default (spawn, "
                        "MALLOC_TRIM_THRESHOLD_=65536)")
    args = p.parse_args(argv)
    names = [n for n in COMMANDS if args.only is None or n in args.only]
    for n in names:
        r = measure(n, args.rounds, args.workers, args.quick, single_core=args.single_core, spawn=args.spawn,
                    dask_defaults=args.dask_defaults)
        v = r["variants"]
        extra = "".join(f", {k} {v[k]['median_s']:.2f} s" for k in v if k not in ("serial", "parallel"))
        ceiling = f", ceiling {r['ceiling_speedup']:.2f}x" if "ceiling_speedup" in r else ""
        print(f"{r['case']}: serial {r['baseline_s']:.2f} s ({v['serial']['cores']:.2f} cores), --workers "
              f"{args.workers} {r['ours_s']:.2f} s (median of {args.rounds}), speed-up {r['speedup']:.2f}x"
              f"{ceiling}{extra}; {r['notes']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
