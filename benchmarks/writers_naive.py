"""The cache writers and dynamic_block_quant against naive vectorised NumPy versions of the same rules (issue 15).

The baselines below are what a NumPy user writes in a few lines each - whole-array float32 passes, no care for
temporaries - for the benchmarked configurations (1 x 128 tiles, int8 or FP8 E4M3FN, finite inputs, the "divide"
scale order ``x / (amax / TYPE_MAX)``). Each one must
produce the same bytes as qsfa before any time is reported (so a fast-but-wrong writer cannot produce a figure).
qsfa is called through its public operators (contract validation included: finiteness, slot range and duplicates),
the baselines validate nothing. Goal: every ratio <= 1.0. BLAS is not involved; threads are pinned to one anyway.

    python -m benchmarks.writers_naive [--quick]
"""

from __future__ import annotations

import argparse
import os

import ml_dtypes
import numpy as np

import qsfa
from qsfa._values import as_dtype

from ._harness import row
from .decode_floor import measure

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_MAX = {"int8": np.float32(127), "float8_e4m3fn": np.float32(448)}


def naive_block_quant(x, dst_type="int8"):
    """dynamic_block_quant of ``x [M, N]`` (N a multiple of 128), 1 x 128 blocks, finite x, RINT."""
    m, n = x.shape
    xf = x.astype(np.float32).reshape(m, n // 128, 128)
    amax = np.abs(xf).max(axis=-1, keepdims=True)
    scale = amax / _MAX[dst_type]
    with np.errstate(invalid="ignore", divide="ignore"):
        y = xf / scale
    y[np.isnan(y)] = 0  # all-zero blocks: 0 / 0
    if dst_type == "int8":
        q = np.clip(np.rint(y), -127, 127).astype(np.int8)
    else:
        q = np.clip(y, -448, 448).astype(FP8)
    return q.reshape(m, n), scale.reshape(m, n // 128)


def naive_c8_write(k_nope, k_rope, slots, cache, key_dtype="int8"):
    """c8_cache_write: quantise the NoPE per 128-tile, pack [codes | RoPE bytes | fp32 scales], scatter by slot."""
    q, s = naive_block_quant(k_nope, key_dtype)
    parts = [q.view(np.uint8)] + ([k_rope.view(np.uint8)] if k_rope is not None else []) + [s.view(np.uint8)]
    rows = np.concatenate(parts, axis=1)
    ok = slots >= 0
    cache.reshape(-1, rows.shape[1])[slots[ok]] = rows[ok]
    return cache


def naive_c8_rmsnorm_rope(kv, gamma, cos, sin, slots, cache, eps=1e-6, key_dtype="int8"):
    """c8_rmsnorm_rope_cache: fp32 RMSNorm (sum of squares in float64, rounded once), interleave RoPE, both
    rounded to kv's dtype, then :func:`naive_c8_write`."""
    x = kv[:, :512].astype(np.float32)
    ss = (x * x).astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32)
    rms = np.sqrt(ss * np.float32(1 / 512) + np.float32(eps))
    nope = (gamma.astype(np.float32) * (x / rms)).astype(kv.dtype)
    rope = None
    if kv.shape[1] > 512:
        r = kv[:, 512:].astype(np.float32)
        a = np.concatenate([r[:, 0::2], r[:, 1::2]], axis=-1) * cos.astype(np.float32)
        b = np.concatenate([-r[:, 1::2], r[:, 0::2]], axis=-1) * sin.astype(np.float32)
        rope = (a + b).astype(kv.dtype)
    return naive_c8_write(nope, rope, slots, cache, key_dtype)


def _inputs(t, seed=0):
    rng = np.random.default_rng(seed)
    kv = as_dtype(rng.standard_normal((t, 576)) * 3, BF16)
    kv[3, :128] = 0  # one all-zero tile
    gamma = as_dtype(1 + 0.1 * rng.standard_normal(512), BF16)
    ang = rng.uniform(0, 6.3, (t, 64))
    nblk = t // 128 + 2
    slots = rng.permutation(nblk * 128)[:t].astype(np.int64)
    slots[::17] = -1
    return kv, gamma, as_dtype(np.cos(ang), BF16), as_dtype(np.sin(ang), BF16), slots, nblk


def run(quick: bool = False, rounds: int | None = None) -> list[dict]:
    from threadpoolctl import threadpool_limits

    t = 256 if quick else 8192
    rounds = rounds or (2 if quick else 11)
    kv, gamma, cos, sin, slots, nblk = _inputs(t)
    rows = []
    with threadpool_limits(limits=1):
        for fmt in ("int8", "float8_e4m3fn"):
            x = kv[:, :512]
            q, s = qsfa.dynamic_block_quant(x, dst_type=fmt, scale_order="divide")
            nq, ns = naive_block_quant(x, fmt)
            if q.tobytes() != nq.tobytes() or s.tobytes() != ns.tobytes():
                raise AssertionError(f"dynamic_block_quant ({fmt}) and the naive version disagree: not reported")
            caches = [np.full((nblk, 128, 1, 656), 17, np.uint8) for _ in range(4)]
            qsfa.c8_cache_write(x, kv[:, 512:], slots, caches[0], key_dtype=fmt, scale_order="divide")
            naive_c8_write(x, kv[:, 512:], slots, caches[1], fmt)
            qsfa.c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, caches[2], key_dtype=fmt, scale_order="divide")
            naive_c8_rmsnorm_rope(kv, gamma, cos, sin, slots, caches[3], key_dtype=fmt)
            if caches[0].tobytes() != caches[1].tobytes() or caches[2].tobytes() != caches[3].tobytes():
                raise AssertionError(f"a C8 writer ({fmt}) and its naive version disagree: not reported")
            fns = {
                "dbq": lambda: qsfa.dynamic_block_quant(x, dst_type=fmt, scale_order="divide"),
                "dbq naive": lambda: naive_block_quant(x, fmt),
                "c8": lambda: qsfa.c8_cache_write(x, kv[:, 512:], slots, caches[0], key_dtype=fmt,
                                                  scale_order="divide"),
                "c8 naive": lambda: naive_c8_write(x, kv[:, 512:], slots, caches[1], fmt),
                "c8r": lambda: qsfa.c8_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, caches[2], key_dtype=fmt,
                                                          scale_order="divide"),
                "c8r naive": lambda: naive_c8_rmsnorm_rope(kv, gamma, cos, sin, slots, caches[3], key_dtype=fmt),
            }
            load0 = os.getloadavg()[0]
            tm = measure(fns, rounds)
            note = f"T={t} bf16, {fmt}; {rounds} interleaved rounds; load {load0:.2f}->{os.getloadavg()[0]:.2f}"
            for key, name in (("dbq", "dynamic_block_quant [T, 512] 1x128"), ("c8", "c8_cache_write rope 64"),
                              ("c8r", "c8_rmsnorm_rope_cache rope 64")):
                rows.append(row("writers_naive", f"{name} {fmt}", tm[key], baseline_name="naive vectorised NumPy",
                                baseline=tm[key + " naive"], goal="ratio <= 1.0", notes=note))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int)
    a = p.parse_args(argv)
    for r in run(quick=a.quick, rounds=a.rounds):
        print(f"{r['case']:48s} qsfa {r['ours_s'] * 1e3:8.2f} ms  naive {r['baseline_s'] * 1e3:8.2f} ms  "
              f"ratio {r['ratio']:.2f}  ({r['notes']})")


if __name__ == "__main__":
    main()
