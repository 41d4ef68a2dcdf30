"""Encoding 16M float32 values: qsfa's reference encoders vs the compiled casts of en_dtypes / ml_dtypes.

Inputs: standard-normal float32 times a per-element power-of-two scale in [2^-10, 2^10] (so every
binade, the denormals and the overflow range of the 8-bit formats are hit). Both sides encode the same
array in the same process; the bytes are compared before a time is reported (where semantics agree:
E2M1 is encoded with saturate=True, which is what ml_dtypes' E2M1 cast does). Goal: ratio <= 3.

    python -m benchmarks.formats [--quick]
    python -m benchmarks --only formats [--quick]
"""

from __future__ import annotations

import argparse

import numpy as np

from qsfa.reference import formats as F
from ._harness import fmt_s, row, timeit

GOAL_RATIO = 3.0


def _cases():
    import en_dtypes
    import ml_dtypes

    # (format, kwargs for our encode, baseline name, baseline dtype)
    return [
        ("hifloat8", {}, "en_dtypes.hifloat8 astype", en_dtypes.hifloat8),
        ("float8_e4m3fn", {}, "ml_dtypes.float8_e4m3fn astype", ml_dtypes.float8_e4m3fn),
        ("float8_e5m2", {}, "ml_dtypes.float8_e5m2 astype", ml_dtypes.float8_e5m2),
        ("float4_e2m1", {"saturate": True}, "ml_dtypes.float4_e2m1fn astype", ml_dtypes.float4_e2m1fn),
    ]


def make_input(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n, dtype=np.float32)
    x *= np.exp2(rng.integers(-10, 11, n).astype(np.float32))
    return x


def run(quick: bool = False) -> list[dict]:
    """Time our encode against the compiled cast for HiFloat8, E4M3FN, E5M2 and E2M1.

    quick: 64K values, one warm-up and one timed run (checks the script works; the goal is not judged);
    otherwise 16M values, one warm-up and the median of 5 runs. Returns harness rows (ours_s,
    baseline_s, ratio = ours / baseline).
    """
    n = (1 << 16) if quick else (1 << 24)
    repeat, warmup = (1, 1) if quick else (5, 1)
    x = make_input(n)
    rows = []
    for fmt, kw, base_name, base_dt in _cases():
        ours_codes = F.encode(x, fmt, **kw)
        with np.errstate(over="ignore", invalid="ignore"):
            ref_codes = x.astype(base_dt).view(np.uint8)
        if not np.array_equal(ours_codes, ref_codes):
            bad = int(np.count_nonzero(ours_codes != ref_codes))
            raise AssertionError(f"{fmt}: {bad} codes differ from {base_name}; no timing reported")
        del ours_codes, ref_codes
        ours = timeit(lambda: F.encode(x, fmt, **kw), warmup=warmup, repeat=repeat)
        with np.errstate(over="ignore", invalid="ignore"):
            base = timeit(lambda: x.astype(base_dt), warmup=warmup, repeat=repeat)
        ratio = ours.median_s / base.median_s
        verdict = "quick run, not judged" if quick else ("met" if ratio <= GOAL_RATIO else "MISSED")
        rows.append(row("formats", f"encode {fmt} ({n:,} float32)", ours, baseline_name=base_name,
                        baseline=base, n=n, fmt=fmt, notes=f"goal <= {GOAL_RATIO:g}x: {verdict}"))
    return rows


def _print(rows):
    print(f"{'case':<42} {'ours':>10} {'baseline':>10} {'ratio':>7}  baseline")
    for r in rows:
        print(f"{r['case']:<42} {fmt_s(r['ours_s']):>10} {fmt_s(r['baseline_s']):>10} {r['ratio']:>7.2f}  "
              f"{r['baseline_name']}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64K values, one timed run")
    _print(run(quick=p.parse_args().quick))
