"""What a QSFA conformance example costs, against bare reference calls on the same arguments (issue 15).

Runs every ``kv_quant_sparse_flash_attention`` property of the catalogue on the reference backend in the ``ci``
profile, with the reference oracle wrapped so every call is timed. Per property: seconds per example (the whole
``run_property`` - edge phase, hypothesis, drawing, validation, the calls, the check - divided by the examples
run), reference calls per example, seconds per reference call (a "bare reference call": the oracle alone, on the
arguments the example drew; the mean over the run's calls) and two ratios:

* ``ratio`` = seconds per example / seconds per reference call: the issue's figure (goal <= 2). A property that
  needs two calls by design (vs_reference compares the backend with the reference, which on the reference
  backend is the reference twice; the metamorphic pairs call the operator on two argument sets) cannot go below
  its calls per example (2, or 2.4 for minus1_padding_inert), so for them the goal cannot be met as stated;
* ``vs calls`` = seconds per example / (calls per example x seconds per call): the cost against the calls the
  property must make (1.0 would be no overhead at all); ``overhead`` is the rest in ms per example.

BLAS runs on one thread (threadpoolctl; the oracle's thread pool follows that limit), so the figures do not
depend on how many cores a loaded machine leaves free; each property runs ``--repeat`` times, medians reported.
``--clock cpu`` times the main thread's CPU time instead of wall time (at one thread everything runs on it):
steadier on a shared machine.

The derandomised ``ci`` profile draws one fixed set of examples per property, and which examples those are
changes with any change of what a strategy draws (another choice sequence): the mean call of a property moved
by 30% when the attention strategies folded their flags, with the same distribution of shapes. ``--seeds N``
pools N seeded runs per property instead (``run_conformance(seed=0..N-1)``, the ci profile's settings
otherwise: 25 random examples plus the same edge examples each), so two versions of a strategy can be compared
on the same distribution rather than on two particular draws.

    python -m benchmarks.conformance_cost [--quick] [--repeat N] [--clock wall|cpu] [--seeds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ._harness import Timing, row

OP = "kv_quant_sparse_flash_attention"


def _timing(xs: list) -> Timing:
    import numpy as np

    a = np.asarray(xs, np.float64)
    q1, q3 = np.percentile(a, [25, 75])
    return Timing(float(np.median(a)), float(a.min()), float(a.max()), float(q3 - q1), len(xs))


def run(quick: bool = False, repeat: int | None = None, clock: str = "wall", seeds: int | None = None) -> list[dict]:
    from threadpoolctl import threadpool_limits

    import qsfa.reference.attention as ref
    from qsfa.conformance import run_conformance
    from qsfa.conformance.properties import select

    now = {"wall": time.perf_counter, "cpu": time.thread_time}[clock]
    orig = ref.kv_quant_sparse_flash_attention
    calls: list[float] = []

    def timed(*a, **k):
        t0 = now()
        try:
            return orig(*a, **k)
        finally:
            calls.append(now() - t0)

    repeat = max(1, repeat or (1 if quick else 3))
    props = [p for p in select(ops=[OP]) if p.ops == (OP,) or list(p.ops) == [OP]]
    rows = []
    load0 = os.getloadavg()[0]
    ref.kv_quant_sparse_flash_attention = timed
    try:
        with threadpool_limits(limits=1):
            run_conformance("reference", props=props[:1], profile="ci", max_examples=1, cases_dir=None)  # warm-up
            for p in props:
                per_ex, per_call, n_calls, n_exs = [], [], [], []
                for _ in range(repeat):
                    calls.clear()
                    total, n_ex = 0.0, 0
                    for seed in (range(seeds) if seeds else [None]):  # None: the derandomised ci examples
                        t0 = now()
                        rep = run_conformance("reference", props=[p], profile="ci", seed=seed,
                                              max_examples=2 if quick else None, cases_dir=None)
                        total += now() - t0
                        (res,) = rep.results
                        if res.status != "passed":
                            raise RuntimeError(f"{p.name}: {res.status}: {res.message}")
                        n_ex += res.examples
                    n_ex = max(n_ex, 1)
                    per_ex.append(total / n_ex)
                    n_exs.append(n_ex)
                    n_calls.append(len(calls))
                    if calls:
                        per_call.append(sum(calls) / len(calls))
                ex_t = _timing(per_ex)
                n_ex = n_exs[0]
                if not per_call:  # invalid_rejected: every example is rejected before the oracle runs
                    rows.append(row("conformance_cost", p.name, ex_t,
                                    notes=f"{n_ex} examples, no reference call (rejected arguments); load {load0:.2f}"))
                    continue
                call_t = _timing(per_call)
                cpe = statistics.median(n_calls) / n_ex
                vs_calls = ex_t.median_s / (cpe * call_t.median_s)
                overhead = ex_t.median_s - cpe * call_t.median_s
                rows.append(row("conformance_cost", p.name, ex_t,
                                baseline_name="one bare reference call (same drawn arguments)", baseline=call_t,
                                calls_per_example=cpe, ratio_vs_calls=vs_calls, overhead_s=overhead,
                                goal="ratio <= 2",
                                notes=f"{n_ex} examples, {cpe:.1f} reference calls each (ratio >= {cpe:.1f} by "
                                      f"design), {vs_calls:.2f}x the calls it makes, overhead "
                                      f"{overhead * 1e3:.2f} ms/example; 1 thread, {clock} clock; median of {repeat}; "
                                      + (f"{seeds} seeded runs pooled; " if seeds else "")
                                      + f"load {load0:.2f}->{os.getloadavg()[0]:.2f}"))
    finally:
        ref.kv_quant_sparse_flash_attention = orig
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=None, help="runs of each property (median; default 3, quick 1)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: perf_counter; cpu: the main thread's CPU time (everything runs on it at 1 thread), "
                        "steadier on a loaded machine")
    p.add_argument("--seeds", type=int, default=None,
                   help="pool this many seeded runs per property (seeds 0..N-1) instead of the derandomised ci examples")
    a = p.parse_args(argv)
    for r in run(quick=a.quick, repeat=a.repeat, clock=a.clock, seeds=a.seeds):
        base = (f"per call {r['baseline_s'] * 1e3:7.2f} ms  ratio {r['ratio']:.2f}  vs calls {r['ratio_vs_calls']:.2f}"
                if "ratio" in r else "")
        print(f"{r['case']:58s} per example {r['ours_s'] * 1e3:8.2f} ms  {base}  ({r['notes']})")


if __name__ == "__main__":
    main()
