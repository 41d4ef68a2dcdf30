"""CPU per conformance task on a Dask worker against the same property in a plain process.

Each of the ci profile's properties runs as the conformance task it is with ``--workers``
(``qsfa.distributed.conformance.run_task``), timed inside the process that runs it: CPU of the whole process
(``resource.getrusage(RUSAGE_SELF)``: the task's thread and whatever else the process does meanwhile) and of
the task's own thread (``time.thread_time``). Variants, each a fresh process with one BLAS thread
(``OPENBLAS_NUM_THREADS=1 QSFA_NUM_THREADS=1``, as a worker has):

* ``plain``: the tasks one after another in a plain Python process (the baseline);
* ``worker``: the tasks one at a time on a one-worker local cluster as qsfa starts it
  (``qsfa.distributed.connect(workers=1)``);
* ``worker-profiler``: the same with Dask's statistical profiler on in the worker
  (``DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=True``, Dask's default, off in qsfa's local cluster).

Printed per variant: the sums over the tasks (each task's least over ``--rounds`` passes: the first pass of a
plain process also pays its lazy imports, which a worker forked from qsfa's fork server has done before) and
the median over tasks of each task's CPU divided by its CPU in the plain process. See docs/scaling.md, "Measured here".

    python -m benchmarks.distributed_tasks [--rounds 3] [--properties 'formats.*']
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "QSFA_NUM_THREADS": "1"}
VARIANTS = {
    "plain": {},
    "worker": {},
    "worker-profiler": {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "True"},
}


def timed_task(task, *args) -> dict:
    """Run one conformance task; its CPU (process and thread), wall time and minor page faults."""
    from qsfa.distributed.conformance import run_task

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0, w0 = time.thread_time(), time.perf_counter()
    run_task(task, *args)
    t1, w1 = time.thread_time(), time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"name": task.name, "thread": t1 - t0, "wall": w1 - w0, "minflt": r1.ru_minflt - r0.ru_minflt,
            "proc": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)}


def _child(variant: str, rounds: int, pattern: str, out: str) -> None:
    from qsfa import strategies as qst
    from qsfa._profiles import PROFILES
    from qsfa.conformance.properties import catalogue
    from qsfa.distributed.conformance import plan

    props = [p for p in catalogue() if fnmatch.fnmatch(p.name, pattern)]
    tasks = plan(props, seed=None, max_examples=PROFILES["ci"]["max_examples"])
    args = ("reference", "ci", None, qst.bounds("ci"), None, None)
    rows = []
    if variant == "plain":
        for r in range(rounds):
            rows += [dict(timed_task(t, *args), round=r) for t in tasks]
    else:
        from qsfa.distributed import connect

        with connect(workers=1, preload=("qsfa.conformance.properties", "hypothesis")) as client:
            for r in range(rounds):
                rows += [dict(client.submit(timed_task, t, *args, pure=False).result(), round=r) for t in tasks]
    with open(out, "w") as f:
        json.dump(rows, f)


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distributed_tasks", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="passes over the tasks per variant")
    p.add_argument("--properties", default="*", help="fnmatch pattern over property names")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a.child[0], a.rounds, a.properties, a.child[1])
        return 0
    load = os.getloadavg()[0]
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v, extra in VARIANTS.items():
            out = os.path.join(tmp, v + ".json")
            env = dict(os.environ, **ONE_THREAD, **extra,
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            subprocess.run([sys.executable, "-m", "benchmarks.distributed_tasks", "--rounds", str(a.rounds),
                            "--properties", a.properties, "--child", v, out], env=env, cwd=ROOT, check=True)
            with open(out) as f:
                got[v] = json.load(f)

    def per_task(v, key):
        by = {}
        for o in got[v]:
            by.setdefault(o["name"], []).append(o[key])
        return {n: min(x) for n, x in by.items()}

    base = per_task("plain", "proc")
    print(f"{len(base)} tasks x {a.rounds} rounds; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after")
    for v in VARIANTS:
        line = [f"{v:16s}"]
        for key in ("proc", "thread"):
            x = per_task(v, key)
            ratio = _median([x[n] / base[n] for n in base if base[n] > 0])
            line.append(f"{key} {sum(x.values()):6.2f} s (median per-task ratio {ratio:.2f}x)")
        line.append(f"wall {sum(per_task(v, 'wall').values()):6.2f} s")
        line.append(f"minor faults {sum(per_task(v, 'minflt').values()):.0f}")
        print(", ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
