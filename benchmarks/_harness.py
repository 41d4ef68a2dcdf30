"""Timing and memory helpers shared by the benchmark scripts.

Every figure a benchmark reports is a ratio against a baseline measured in the same process on the same
inputs, so the numbers survive a change of machine. Times are medians over repeated runs after warm-up;
the spread (min, max, interquartile range) is reported beside them.
"""

from __future__ import annotations

import gc
import os
import platform
import time
import tracemalloc
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Timing:
    median_s: float
    min_s: float
    max_s: float
    iqr_s: float
    runs: int

    def to_dict(self):
        return asdict(self)


def timeit(fn, *, warmup: int = 1, repeat: int = 5, max_seconds: float | None = None) -> Timing:
    """Median wall time of ``fn()`` over ``repeat`` runs after ``warmup`` runs.

    ``max_seconds`` caps the total measuring time: once exceeded, no further repeats are started (at
    least one timed run always happens).
    """
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    for _ in range(max(repeat, 1)):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    a = np.asarray(times)
    q1, q3 = np.percentile(a, [25, 75])
    return Timing(float(np.median(a)), float(a.min()), float(a.max()), float(q3 - q1), len(times))


def peak_memory(fn) -> tuple[object, int]:
    """Run ``fn()`` under tracemalloc; return (result, peak bytes allocated through Python/NumPy)."""
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, int(peak)


def row(benchmark: str, case: str, ours: Timing, *, baseline_name: str | None = None,
        baseline: Timing | None = None, higher_is_better: bool = False, **extra) -> dict:
    """One result row. ``ratio`` = ours / baseline (time): below 1 means faster than the baseline."""
    r = {"benchmark": benchmark, "case": case, "ours_s": ours.median_s, "ours": ours.to_dict()}
    if baseline is not None:
        r["baseline_name"] = baseline_name
        r["baseline_s"] = baseline.median_s
        r["baseline"] = baseline.to_dict()
        r["ratio"] = ours.median_s / baseline.median_s if baseline.median_s > 0 else float("inf")
        r["speedup"] = baseline.median_s / ours.median_s if ours.median_s > 0 else float("inf")
    r.update(extra)
    return r


def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        la = os.getloadavg()
        info["loadavg_at_start"] = [round(x, 2) for x in la]
    except OSError:
        pass
    return info


def fmt_s(s: float) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"
