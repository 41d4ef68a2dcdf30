"""How the reference QSFA's cost grows with sparse_size, query tokens and context length.

Three sweeps through the public ``qsfa.kv_quant_sparse_flash_attention`` (validation included), rope 64,
Q_N = 128, int8 packed PA cache (block 128), sparse_mode 3, bf16 query:

* ``sparse_size``     - decode rows (B = 4, Q_S = 1) with 256 .. 2048 indices per row;
* ``query_tokens``    - TND prefill with 2048 indices per token, 256 .. 32768 query tokens (the full
                        run includes the 32K-token prefill; peak memory is measured with tracemalloc and
                        reported with and without the output array, 4 GiB of bf16 at 32K tokens);
* ``context_length``  - decode with 2048 indices over a KV cache of 4K .. 128K tokens (the cost should
                        not grow: only the selected rows are read).

Each row carries ``axis``/``work`` for the log-log plot of ``python -m benchmarks`` and, as the ratio
baseline, the smallest point of its sweep scaled linearly (ratio 1.0 = exactly linear growth).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import qsfa
from qsfa._values import as_dtype
from ._harness import Timing, peak_memory, row, timeit


Q_N = 128
BLOCK = 128
SPARSE = 2048


def _cache(rng, n_tokens):
    """A packed int8 QSFA cache [blocks, BLOCK, 1, 656] with random codes, bf16 RoPE and sane scales."""
    nblk = -(-n_tokens // BLOCK)
    rows = np.empty((nblk * BLOCK, 656), np.uint8)
    rows[:, :512] = rng.integers(-127, 128, size=(rows.shape[0], 512), dtype=np.int8).view(np.uint8)
    rows[:, 512:640] = as_dtype(rng.standard_normal((rows.shape[0], 64)) * 0.5, ml_dtypes.bfloat16).view(np.uint8)
    rows[:, 640:656] = rng.uniform(0.005, 0.02, size=(rows.shape[0], 4)).astype("<f4").view(np.uint8)
    return rows.reshape(nblk, BLOCK, 1, 656), nblk


def _decode_case(rng, batch, kv_len, sparse):
    cache, nblk = _cache(rng, batch * kv_len)
    table = rng.permutation(nblk)[: batch * (-(-kv_len // BLOCK))].reshape(batch, -1).astype(np.int32)
    q = as_dtype(rng.standard_normal((batch, 1, Q_N, 576)) * 0.5, ml_dtypes.bfloat16)
    idx = np.sort(rng.permuted(np.tile(np.arange(kv_len, dtype=np.int32), (batch, 1)), axis=1)[:, :sparse], axis=1)
    return dict(query=q, key=cache, value=cache, sparse_indices=idx.reshape(batch, 1, 1, sparse),
                scale_value=576 ** -0.5, block_table=table,
                actual_seq_lengths_query=np.ones(batch, np.int32),
                actual_seq_lengths_kv=np.full(batch, kv_len, np.int32),
                layout_query="BSND", layout_kv="PA_BSND")


def _prefill_case(rng, q_tokens, sparse):
    """Built in float32 chunks: a 32K-token query is 4.5 GiB in bf16, and float64 temporaries of it would
    not fit in a 24 GiB machine."""
    kv_len = q_tokens + sparse  # every causal row has at least `sparse` visible tokens
    cache, nblk = _cache(rng, kv_len)
    table = np.arange(nblk, dtype=np.int32)[None, :]
    q = np.empty((q_tokens, Q_N, 576), ml_dtypes.bfloat16)
    idx = np.empty((q_tokens, 1, sparse), np.int32)
    step = 1024
    for a in range(0, q_tokens, step):
        b = min(a + step, q_tokens)
        q[a:b] = rng.standard_normal((b - a, Q_N, 576), dtype=np.float32) * np.float32(0.5)
        thr = kv_len - q_tokens + np.arange(a, b) + 1  # causal threshold of each row
        idx[a:b, 0] = (rng.random((b - a, sparse), dtype=np.float32) * thr[:, None]).astype(np.int32)
    thr_all = (kv_len - q_tokens + np.arange(q_tokens, dtype=np.int32) + 1)[:, None, None]
    np.minimum(idx, thr_all - 1, out=idx)  # float32 rounding could reach the threshold itself
    return dict(query=q, key=cache, value=cache, sparse_indices=idx,
                scale_value=576 ** -0.5, block_table=table,
                actual_seq_lengths_query=np.array([q_tokens], np.int32),
                actual_seq_lengths_kv=np.array([kv_len], np.int32),
                layout_query="TND", layout_kv="PA_BSND")


def _call(args):
    return qsfa.kv_quant_sparse_flash_attention(**args)


def _sweep(axis, points, make, repeat):
    """Time each point; the first run is traced (peak memory) and timed at once, so a multi-minute
    point runs once. Faster points get ``repeat`` more timed runs and report their median."""
    import time

    rows, first = [], None
    for w in points:
        args = make(w)
        t0 = time.perf_counter()
        _, peak = peak_memory(lambda: _call(args))
        traced = time.perf_counter() - t0
        if traced < 5.0 and repeat > 1:
            t = timeit(lambda: _call(args), warmup=0, repeat=repeat, max_seconds=30)
        else:
            t = Timing(traced, traced, traced, 0.0, 1)
        if first is None:
            first = (w, t)
        linear = Timing(first[1].median_s * w / first[0], 0, 0, 0, 0)
        out_bytes = int(np.prod(args["query"].shape[:-1])) * 512 * 2  # attention_out, bf16
        rows.append(row("scaling", f"{axis}={w}", t, baseline_name="linear from first point", baseline=linear,
                        axis=axis, work=w, peak_mib=peak / 2**20, output_mib=out_bytes / 2**20,
                        notes=f"working set {(peak - out_bytes) / 2**20:.0f} MiB + output {out_bytes / 2**20:.0f} MiB"))
        print(f"   {axis}={w}: {t.median_s:.3f} s, peak {peak / 2**20:.0f} MiB "
              f"(output {out_bytes / 2**20:.0f} MiB)", flush=True)
    return rows


def run(quick: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    rep = 1 if quick else 3
    out = []
    sp = [64, 128] if quick else [256, 512, 1024, 2048]
    out += _sweep("sparse_size", sp, lambda s: _decode_case(rng, 4, 4096 if not quick else 512, s), rep)
    qt = [16, 32] if quick else [256, 1024, 4096, 16384, 32768]
    out += _sweep("query_tokens", qt, lambda n: _prefill_case(rng, n, SPARSE if not quick else 64),
                  1 if not quick else rep)
    ctx = [1024, 2048] if quick else [4096, 16384, 65536, 131072]
    out += _sweep("context_length", ctx, lambda n: _decode_case(rng, 4, n, SPARSE if not quick else 64), rep)
    return out


if __name__ == "__main__":
    import argparse
    import sys

    from .__main__ import main

    # its own options, checked (a --help or a misspelt option used to start the full run and overwrite
    # benchmarks/results.json); the run and its files go through python -m benchmarks
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small run (for CI)")
    p.add_argument("--out", help="folder for results.json / results.md (default: the benchmarks folder)")
    a = p.parse_args()
    sys.exit(main(["--only", "scaling"] + (["--quick"] if a.quick else []) + (["--out", a.out] if a.out else [])))
