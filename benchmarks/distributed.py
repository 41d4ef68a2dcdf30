"""``--workers 2`` against a serial run, end to end: ``qsfa golden generate --set seed-rope0``, the full ``ci``
conformance run (``qsfa conformance --backend reference``) and one long prefill case (``--case``: 128 query
tokens x 32 heads x 1024 selected tokens, split into row tasks of 16 rows with ``--chunk-rows 16``).

Each figure is the wall time of the whole command (a fresh process: imports, cluster start-up, writing the
files and reports), so the fixed cost of a local cluster counts. Serial and parallel runs alternate (serial
first in even rounds, parallel first in odd ones) so that a change in machine load hits both; the medians,
the ratio and the load average (``os.getloadavg``) before and after are reported. The written golden sets are
compared byte for byte after each pair.

    python -m benchmarks.distributed [--rounds 5] [--only "golden seed-rope0" ...] [--workers 2]
"""

from __future__ import annotations

import argparse
import filecmp
import os
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


def _run(cmd, out) -> float:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [a.replace("OUT", out) for a in cmd]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "qsfa.cli", *args], env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"qsfa {' '.join(args)} failed ({r.returncode}): {r.stderr[-2000:]}")
    return dt


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


def measure(name: str, rounds: int, workers: int, quick: bool) -> dict:
    cmd = COMMANDS[name][1 if quick else 0]
    serial, parallel = [], []
    load_before = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="qsfa-bench-dist-")
    split = ["--chunk-rows", "16"] if "--case" in cmd else []
    try:
        if "--case" in cmd:
            cmd = [a.replace("CASE", _prefill_case(tmp)) for a in cmd]
        for k in range(rounds):
            order = ("serial", "parallel") if k % 2 == 0 else ("parallel", "serial")
            outs = {}
            for which in order:
                out = os.path.join(tmp, f"{which}{k}")
                outs[which] = out
                extra = [] if which == "serial" else ["--workers", str(workers)] + split
                (serial if which == "serial" else parallel).append(_run(cmd + extra, out))
            if not _same_tree(outs["serial"], outs["parallel"]):
                raise RuntimeError(f"{name}: the --workers {workers} set differs from the serial one")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    s, p = _timing(serial), _timing(parallel)
    label = name if not quick else f"{name.split()[0]} quick: qsfa {' '.join(cmd[:4])}"
    r = row("distributed", label, p, baseline_name="serial", baseline=s,
            notes=f"--workers {workers}, {rounds} alternating rounds; load average {load_before[0]:.1f} before, "
                  f"{load_after[0]:.1f} after, on {os.cpu_count()} CPUs; serial {[round(x, 2) for x in serial]}, "
                  f"parallel {[round(x, 2) for x in parallel]}")
    r["load_before"], r["load_after"] = list(load_before), list(load_after)
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
    args = p.parse_args(argv)
    names = [n for n in COMMANDS if args.only is None or n in args.only]
    for n in names:
        r = measure(n, args.rounds, args.workers, args.quick)
        print(f"{r['case']}: serial {r['baseline_s']:.2f} s, --workers {args.workers} {r['ours_s']:.2f} s "
              f"(median of {args.rounds}), speed-up {r['speedup']:.2f}x; {r['notes']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
