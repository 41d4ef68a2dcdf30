"""Run every benchmark: ``python -m benchmarks [--quick] [--only NAME ...] [--out DIR]``.

Each benchmark module exposes ``run(quick: bool) -> list[dict]`` (rows built with
``benchmarks._harness.row``: median times, spread, a baseline measured in the same process and the
ratio). This entry point runs them, prints one table, and writes ``results.json``, ``results.md`` and
(with matplotlib installed) ``results.png`` - the log-log scaling plot - into ``--out`` (default: this
folder).

``--quick`` runs each benchmark once on small sizes: it asserts nothing about time, only that every
benchmark runs and writes its outputs (CI runs it so the scripts cannot rot).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from ._harness import fmt_s, machine

#: module name -> what it measures
BENCHMARKS = {
    "formats": "encoding 16M floats vs ml_dtypes / en-dtypes compiled casts",
    "cache_writers": "cache writers vs a per-token loop",
    "writers_naive": "C8 writers and dynamic_block_quant vs naive vectorised NumPy versions (same bytes)",
    "attention": "reference attention vs a per-row golden and the matmul-only floor",
    "decode_floor": "faithful QSFA decode vs the fp32 / float64 GEMM floors and a torch fp32 user version (1 thread)",
    "cores": "TND prefill on 2 threads vs 1 (qsfa.set_num_threads), byte-identical",
    "long_prefill": "a long TND prefill streamed to an np.memmap (attention_out=): time and peak memory",
    "scaling": "how attention cost grows with sparse_size, query tokens and context length",
    "conformance": "conformance examples per second per operator",
    "conformance_cost": "a QSFA conformance example vs bare reference calls on the same drawn arguments",
    "triton_qsfa": "Triton QSFA on a GPU vs the device's measured peak (skipped without a GPU)",
    "distributed": "golden seed-rope0 and the ci conformance run: --workers 2 vs serial, end to end",
    "chain": "the v32-mla-c8 and V4 (v4-csa, v4-hca) layer-chain goldens link by link vs each link's float64 GEMM "
             "floor (64K context decode)",
    "sharedkv_decode": "faithful V4 shared-KV decode (CSA / HCA, 64K context) vs the float64 two-GEMM floor (1 thread)",
    "sharedkv_prefill": "a V4 shared-KV CSA prefill over a 128K context streamed to memmaps (attention_out=): peak memory",
}


def _table(rows) -> list[str]:
    lines = ["| benchmark | case | ours | baseline | ratio (ours/baseline) | notes |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        fmt = fmt_s if r.get("unit", "s") == "s" else (lambda v, u=r["unit"]: "-" if v is None else f"{v:.1f} {u}")
        base = f"{r.get('baseline_name', '-')}: {fmt(r['baseline_s'])}" if "baseline_s" in r else "-"
        ratio = f"{r['ratio']:.3g}" if "ratio" in r else "-"
        notes = r.get("notes", "")
        if "peak_mib" in r:
            notes = (notes + "; " if notes else "") + f"peak {r['peak_mib']:.0f} MiB"
        if "skipped" in r:
            notes = f"skipped: {r['skipped']}"
        ours = fmt(r["ours_s"]) if r.get("ours_s") is not None else "-"
        lines.append(f"| {r['benchmark']} | {r['case']} | {ours} | {base} | {ratio} | {notes} |")
    return lines


def _plot(rows, path) -> str | None:
    series = {}
    for r in rows:
        if r.get("benchmark") == "scaling" and "work" in r and r.get("ours_s"):
            series.setdefault(r["axis"], []).append((r["work"], r["ours_s"]))
    if not series:
        return "no scaling rows"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install qsfa[plot])"
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4), squeeze=False)
    for ax, (axis, pts) in zip(axes[0], sorted(series.items())):
        pts.sort()
        xs, ys = zip(*pts)
        ax.loglog(xs, ys, "o-", label="qsfa reference")
        # a slope-1 guide through the first point shows linear growth
        ax.loglog(xs, [ys[0] * x / xs[0] for x in xs], "--", color="gray", label="linear")
        ax.set_xlabel(axis)
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("qsfa reference attention: time vs work size (log-log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small run of each benchmark (for CI)")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    p.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)),
                   help="folder for results.json / results.md / results.png")
    args = p.parse_args(argv)

    names = args.only or list(BENCHMARKS)
    all_rows, failures = [], []
    t_start = time.perf_counter()
    for name in names:
        print(f"== {name}: {BENCHMARKS[name]}", flush=True)
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
            rows = mod.run(quick=args.quick)
        except Exception as e:  # report and continue: one broken benchmark must not hide the others
            failures.append(f"{name}: {type(e).__name__}: {e}")
            print(f"   FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        for r in rows:
            r.setdefault("benchmark", name)
        all_rows.extend(rows)
        for line in _table(rows)[2:]:
            print("   " + line)
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)

    os.makedirs(args.out, exist_ok=True)
    result = {"quick": args.quick, "machine": machine(), "rows": all_rows, "failures": failures,
              "total_seconds": time.perf_counter() - t_start}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=2, sort_keys=True, default=float)
    m = result["machine"]
    md = [f"Machine: {m.get('cpu_model', m['processor'])}, {m['cpus']} CPUs, Python {m['python']}, "
          f"NumPy {m['numpy']}; quick={args.quick}", ""] + _table(all_rows)
    if failures:
        md += ["", "Failed benchmarks:"] + [f"- {x}" for x in failures]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    why_no_plot = _plot(all_rows, os.path.join(args.out, "results.png"))
    print(f"wrote {args.out}/results.json, results.md" + ("" if why_no_plot else ", results.png"))
    if why_no_plot:
        print(f"no plot: {why_no_plot}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
