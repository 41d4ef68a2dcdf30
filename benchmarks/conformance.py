"""Conformance throughput: examples per second per operator for the reference backend under the ``ci``
profile, and the wall time of the full ``ci`` conformance run (budget: 10 minutes on 2 cores).

What is timed: ``qsfa.conformance.run_conformance("reference", profile="ci")`` over the whole catalogue
(every vs_reference and metamorphic property, hypothesis' example generation, the checks, the float64
models) - exactly ``qsfa conformance --backend reference``. Per operator (the operator whose arguments a
property draws) the rows report the examples run, their seconds and examples / s.

Baseline, measured in the same process: one bare reference call of the operator on its contract's
example (``qsfa._dispatch.run(op, contract.example(rng), "reference")``, contract validation included).
``ratio`` = seconds per conformance example / seconds per bare call: the cost of drawing an example and
checking a property, in units of the operator's own cost on a small fixed input.

    python -m benchmarks.conformance [--quick]
    python -m benchmarks --only conformance [--quick]

``--quick`` runs two examples per property of three operators (:data:`QUICK_OPS`): it checks that the benchmark
runs, not the budget (tests/test_conformance_reference.py runs every property on the reference anyway).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import numpy as np

from ._harness import Timing, fmt_s, row, timeit

BUDGET_S = 600.0


def _load():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return None


def _bare_call(op: str) -> Timing:
    from qsfa._contract import copy_args
    from qsfa._dispatch import operator, run

    contract = operator(op).contract
    args = contract.example(np.random.default_rng(0))
    return timeit(lambda: run(op, copy_args(args), "reference"), warmup=1, repeat=7, max_seconds=2.0)


#: the operators of a ``--quick`` run: a format, a cache writer and the attention
QUICK_OPS = ("formats.encode", "dynamic_block_quant", "kv_quant_sparse_flash_attention")


def run(quick: bool = False) -> list[dict]:
    from qsfa.conformance import run_conformance

    load_before = _load()
    t0 = time.perf_counter()
    report = run_conformance("reference", profile="ci", max_examples=2 if quick else None, cases_dir=None,
                             ops=QUICK_OPS if quick else None)
    total = time.perf_counter() - t0
    per_op = defaultdict(lambda: [0, 0.0, 0])
    for r in report.results:
        if r.status != "passed":
            raise RuntimeError(f"{r.property} did not pass on the reference: {r.status}: {r.message}")
        acc = per_op[r.op]
        acc[0] += r.examples
        acc[1] += r.seconds
        acc[2] += 1
    rows = []
    for op, (n, secs, n_props) in per_op.items():
        per_example = secs / max(n, 1)
        ours = Timing(per_example, per_example, per_example, 0.0, n)
        rows.append(row("conformance", op, ours, baseline_name="bare reference call", baseline=_bare_call(op),
                        examples=n, properties=n_props, seconds=round(secs, 3),
                        examples_per_s=round(n / secs, 1) if secs else None,
                        notes=f"{n_props} properties, {n} examples, {n / secs:.0f} examples/s"))
    s = report.summary
    ours = Timing(total, total, total, 0.0, 1)
    budget = Timing(BUDGET_S, BUDGET_S, BUDGET_S, 0.0, 0)
    rows.append(row("conformance", "quick ci run (reference)" if quick else "full ci run (reference)", ours,
                    baseline_name="CI budget (10 min)",
                    baseline=budget, properties=s["properties"], examples=s["examples"], quick=quick,
                    load_before=load_before, load_after=_load(), cpu_count=os.cpu_count(),
                    notes=f"{s['properties']} properties, {s['examples']} examples in {total:.1f}s"
                          + (f" (quick: 2 examples per property of {', '.join(QUICK_OPS)})" if quick else "")))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two examples per property of three operators")
    args = p.parse_args(argv)
    rows = run(quick=args.quick)
    print(f"{'operator':36s} {'examples':>8s} {'seconds':>8s} {'ex/s':>8s} {'bare call':>10s} {'ratio':>8s}")
    for r in rows:
        if r is rows[-1]:
            continue
        print(f"{r['case']:36s} {r['examples']:8d} {r['seconds']:8.2f} {r['examples_per_s'] or 0:8.1f} "
              f"{fmt_s(r['baseline_s']):>10s} {r['ratio']:8.1f}")
    full = rows[-1]
    print(f"\n{full['case']}: {full['ours_s']:.1f}s for {full['properties']} properties / "
          f"{full['examples']} examples ({full['ratio'] * 100:.1f}% of the 10-minute budget; "
          f"{full['cpu_count']} CPUs, load {full['load_before']} -> {full['load_after']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
