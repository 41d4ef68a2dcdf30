"""Timing and memory helpers shared by the benchmark scripts.

Every figure a benchmark reports is a ratio against a baseline measured in the same process on the same
inputs, so the numbers survive a change of machine. Times are medians over repeated runs after warm-up;
the spread (min, max, interquartile range) is reported beside them.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import threading
import time
import tracemalloc
from contextlib import contextmanager
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


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes (0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:  # pragma: no cover
        return False


@dataclass
class RssPeak:
    """What :func:`peak_rss` saw (bytes): ``RssAnon`` before the block and its largest sample, the kernel's peak RSS
    (``VmHWM``, file pages of memmaps included) after it, and whether VmHWM could be reset before the block."""
    base_anon: int = 0
    peak_anon: int = 0
    hwm: int = 0
    hwm_reset: bool = False


@contextmanager
def peak_rss(interval: float = 0.05):
    """Peak resident memory of the process while the block runs (Linux ``/proc/self/status``; zeros elsewhere).

    A thread samples the anonymous resident memory (``RssAnon``: what the code allocates; file pages of memmaps are
    the page cache's) every ``interval`` seconds, and once more as the block ends; ``VmHWM`` is reset before the
    block and read after it. Yields an :class:`RssPeak` filled in when the block ends. (Not to be confused with
    :func:`peak_memory`, tracemalloc's count of Python / NumPy allocations.)"""
    got = RssPeak(base_anon=_status("RssAnon"))
    got.peak_anon = got.base_anon
    done = threading.Event()

    def sample():
        while not done.wait(interval):
            got.peak_anon = max(got.peak_anon, _status("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    got.hwm_reset = _reset_peak_rss()
    sampler.start()
    try:
        yield got
    finally:
        done.set()
        sampler.join()
        got.peak_anon = max(got.peak_anon, _status("RssAnon"))
        got.hwm = _status("VmHWM")


def at_least(lo: int):
    """An argparse type: an integer >= lo (a size or count the benchmark cannot run with, or 0, which some of them
    took for "not given" and silently replaced by the default, is refused by name before anything is built)."""
    def parse(text: str) -> int:
        v = int(text)
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        return v

    return parse


def row(benchmark: str, case: str, ours: Timing, *, baseline_name: str | None = None,
        baseline: Timing | None = None, higher_is_better: bool = False, **extra) -> dict:
    """One result row. ``ratio`` = ours / baseline (time): below 1 means faster than the baseline. A row whose
    figures are not seconds says so with ``unit=`` ("MiB": the prefill benchmarks' peak memory against a budget);
    results.md prints them in that unit."""
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
