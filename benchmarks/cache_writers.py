"""Cache writers vs a straightforward per-token loop (written here, the obvious way).

Both sides write the same cache from the same inputs; the benchmark checks the bytes agree before it
reports a time, so a fast-but-wrong writer cannot produce a figure.

    python -m benchmarks --only cache_writers [--quick]
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import qsfa
from qsfa._values import as_dtype
from ._harness import row, timeit

_F32_1_OVER_448 = np.float32(1.0) / np.float32(448.0)


def _loop_c8(k_nope, k_rope, slots, cache):
    """One token at a time: tile amax, scale, quantise, assemble the row bytes, write it."""
    bs = cache.shape[1]
    for t in range(k_nope.shape[0]):
        s_t = int(slots[t])
        if s_t < 0:
            continue
        x = k_nope[t].astype(np.float32)
        codes = np.empty(512, np.int8)
        scales = np.empty(4, np.float32)
        for j in range(4):
            tile = x[128 * j:128 * (j + 1)]
            amax = np.float32(np.abs(tile).max())
            s = np.float32(amax / np.float32(127.0))
            scales[j] = s
            q = np.zeros(128, np.float32) if s == 0 else np.rint(tile / s)
            codes[128 * j:128 * (j + 1)] = np.clip(q, -127, 127).astype(np.int8)
        parts = [codes.view(np.uint8)]
        if k_rope is not None:
            parts.append(np.ascontiguousarray(k_rope[t]).view(np.uint8))
        parts.append(scales.astype("<f4").view(np.uint8))
        cache[s_t // bs, s_t % bs, 0, :] = np.concatenate(parts)
    return cache


def _loop_epilog_mode1(x, slots, cache):
    """KvCompressEpilog mode 1 (E8M0 scales, round_scale=True), token by token."""
    bs = cache.shape[1]
    d = x.shape[1]
    n = d - 64
    for t in range(x.shape[0]):
        s_t = int(slots[t])
        if s_t < 0:
            continue
        xf = x[t].astype(np.float32)
        nope = xf[:n]
        row_bytes = np.zeros(128 + n + n // 64, np.uint8)
        row_bytes[:128] = np.ascontiguousarray(x[t, n:]).view(np.uint8)
        for g in range(n // 64):
            grp = nope[64 * g:64 * (g + 1)]
            s = np.float32(max(np.float32(np.abs(grp).max()), np.float32(1e-4))) * _F32_1_OVER_448
            bits = np.array([s], np.float32).view(np.uint32)[0]
            e = (int(bits) >> 23) + (1 if int(bits) & 0x7FFFFF else 0)  # ceil to a power of two
            s = np.array([e << 23], np.uint32).view(np.float32)[0]
            y = np.clip(grp / s, -448, 448).astype(np.float32)
            row_bytes[128 + 64 * g:128 + 64 * (g + 1)] = y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            row_bytes[128 + n + g] = e & 0xFF
        cache[s_t // bs, s_t % bs, 0, :row_bytes.size] = row_bytes
    return cache


def _slots(rng, t, num_slots):
    s = rng.permutation(num_slots)[:t].astype(np.int64)
    s[::17] = -1
    return s


def run(quick: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    repeat = 1 if quick else 5
    warmup = 0 if quick else 1

    # --- C8 cache writer (quant + pack + scatter) --------------------------------------------------
    t_tokens = 256 if quick else 8192
    bs = 128
    nblk = t_tokens // bs + 2
    k_nope = as_dtype(rng.standard_normal((t_tokens, 512)) * 3, ml_dtypes.bfloat16)
    k_rope = as_dtype(rng.standard_normal((t_tokens, 64)), ml_dtypes.bfloat16)
    slots = _slots(rng, t_tokens, nblk * bs)
    c_ours = np.full((nblk, bs, 1, 656), 17, np.uint8)
    c_loop = c_ours.copy()
    qsfa.c8_cache_write(k_nope, k_rope, slots, c_ours, scale_order="divide")  # the loop's order
    _loop_c8(k_nope, k_rope, slots, c_loop)
    if not np.array_equal(c_ours, c_loop):
        raise AssertionError("c8_cache_write and the per-token loop disagree: benchmark not reported")
    ours = timeit(lambda: qsfa.c8_cache_write(k_nope, k_rope, slots, c_ours, scale_order="divide"), warmup=warmup,
                  repeat=repeat)
    base = timeit(lambda: _loop_c8(k_nope, k_rope, slots, c_loop), warmup=0, repeat=1 if quick else 3)
    rows.append(row("cache_writers", f"c8_cache_write T={t_tokens} rope 64", ours,
                    baseline_name="per-token loop", baseline=base,
                    notes=f"{t_tokens / ours.median_s / 1e6:.2f} M tokens/s"))

    # --- KvCompressEpilog mode 1 ---------------------------------------------------------------------
    d = 576
    x = as_dtype(rng.standard_normal((t_tokens, d)) * 2, ml_dtypes.bfloat16)
    col = 128 + 512 + 8
    e_ours = np.full((nblk, bs, 1, col), 17, np.uint8)
    e_loop = e_ours.copy()
    qsfa.kv_compress_epilog(e_ours, x, slots, quant_mode=1)
    _loop_epilog_mode1(x, slots, e_loop)
    if not np.array_equal(e_ours, e_loop):
        raise AssertionError("kv_compress_epilog mode 1 and the per-token loop disagree")
    ours = timeit(lambda: qsfa.kv_compress_epilog(e_ours, x, slots, quant_mode=1), warmup=warmup, repeat=repeat)
    base = timeit(lambda: _loop_epilog_mode1(x, slots, e_loop), warmup=0, repeat=1 if quick else 3)
    rows.append(row("cache_writers", f"kv_compress_epilog mode 1 T={t_tokens} d=576", ours,
                    baseline_name="per-token loop", baseline=base,
                    notes=f"{t_tokens / ours.median_s / 1e6:.2f} M tokens/s"))
    return rows


if __name__ == "__main__":
    import argparse
    import sys

    from .__main__ import main

    # its own options, checked (a --help or a misspelt option used to start the full run and overwrite
    # benchmarks/results.json); the run and its files go through python -m benchmarks
    p = argparse.ArgumentParser(prog="python -m benchmarks.cache_writers", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small run (for CI)")
    p.add_argument("--out", help="folder for results.json / results.md (default: the benchmarks folder)")
    a = p.parse_args()
    sys.exit(main(["--only", "cache_writers"] + (["--quick"] if a.quick else []) + (["--out", a.out] if a.out else [])))
