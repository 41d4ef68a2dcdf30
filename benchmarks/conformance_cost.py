"""What a QSFA conformance example costs, against bare reference calls on the same arguments (issue 15).

Runs every ``kv_quant_sparse_flash_attention`` property of the catalogue on the reference backend in the ``ci``
profile, with the reference oracle wrapped so every call is timed. Per property: seconds per example, reference
calls per example, seconds per reference call (a "bare reference call": the oracle alone, on the arguments the
example drew), and ``ratio`` = seconds per example / seconds per reference call. A property that compares two
calls (vs_reference on the reference compares the reference with itself) cannot go below 2; the rest -
drawing the example, validation, conversions, the check - is the overhead (reported as a share).

    python -m benchmarks.conformance_cost [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

from ._harness import Timing, row

OP = "kv_quant_sparse_flash_attention"


def run(quick: bool = False) -> list[dict]:
    import qsfa.reference.attention as ref
    from qsfa.conformance import run_conformance
    from qsfa.conformance.properties import select

    orig = ref.kv_quant_sparse_flash_attention
    calls: list[float] = []

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            calls.append(time.perf_counter() - t0)

    props = [p for p in select(ops=[OP]) if p.ops == (OP,) or list(p.ops) == [OP]]
    rows = []
    load0 = os.getloadavg()[0]
    ref.kv_quant_sparse_flash_attention = timed
    try:
        for p in props:
            calls.clear()
            t0 = time.perf_counter()
            rep = run_conformance("reference", props=[p], profile="ci", max_examples=2 if quick else None,
                                  cases_dir=None)
            total = time.perf_counter() - t0
            (res,) = rep.results
            if res.status != "passed":
                raise RuntimeError(f"{p.name}: {res.status}: {res.message}")
            n_ex = max(res.examples, 1)
            n_calls = len(calls)
            if not n_calls:  # invalid_rejected: every example is rejected before the oracle runs
                rows.append(row("conformance_cost", p.name, Timing(total / n_ex, 0, 0, 0, n_ex),
                                notes=f"{n_ex} examples, no reference call (rejected arguments)"))
                continue
            per_call = sum(calls) / n_calls
            per_ex = total / n_ex
            overhead = max(total - sum(calls), 0.0) / total
            rows.append(row("conformance_cost", p.name, Timing(per_ex, 0, 0, 0, n_ex),
                            baseline_name="one bare reference call (same drawn arguments)",
                            baseline=Timing(per_call, 0, 0, 0, n_calls), calls_per_example=n_calls / n_ex,
                            notes=f"{n_ex} examples, {n_calls / n_ex:.1f} reference calls each, "
                                  f"{100 * overhead:.0f}% of the time outside the reference; load {load0:.2f}"))
    finally:
        ref.kv_quant_sparse_flash_attention = orig
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    for r in run(quick=a.quick):
        base = f"per call {r['baseline_s'] * 1e3:7.2f} ms  ratio {r['ratio']:.2f}" if "ratio" in r else ""
        print(f"{r['case']:58s} per example {r['ours_s'] * 1e3:8.2f} ms  {base}  ({r['notes']})")


if __name__ == "__main__":
    main()
