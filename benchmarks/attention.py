"""Reference QSFA speed and memory: decode and prefill vs a per-row golden and vs the matmul-only floor.

Cases (int8 packed PA cache, block 128, rope 64, Q_N = 128, bf16 query, sparse_mode 3, scale 576^-0.5):

* decode:  B = 4, Q_S = 1 (BSND), sparse_size 2048 distinct indices per row over a KV of 8192 tokens per
           sequence (the op-plugin SFA doc example's B / Q_N / S2); once more over 65536 tokens per sequence
           against the golden only (its whole-cache dequantisation grows with the context, ours does not);
* prefill: TND, 4096 query tokens of one sequence, sparse_size 2048, over a KV of 2048 cached + 4096 new
           tokens (a chunked prefill: every row sees >= 2048 tokens, so all 2048 indices are valid).

Baselines, measured in the same process on the same inputs:

(a) ``per-row golden``: the style of vLLM-Ascend's test golden, in NumPy - dequantise the whole cache
    (K NoPE to bf16, once; vLLM's golden does it for K and V separately), then for every query row a
    Python loop over its index entries, a gather, ``q @ K^T``, fp32 softmax, bf16 P, ``P @ V``. For the
    prefill it is timed on the first 64 rows and scaled linearly to 4096 (a full run would take minutes;
    the row says so). Its output is compared with ours (docs/numerics/comparison.md#float-criterion tolerances) before any time is reported.
(b) ``matmul floor``: the two batched matmuls alone (``[c, 128, 576] @ [c, 576, 2048]`` and
    ``[c, 128, 2048] @ [c, 2048, 512]``) on preallocated operands, over the same rows in the same chunks, in fp32
    (what an fp32-accumulating implementation needs) and in float64 (what ours runs: its fp32 accumulations are
    the correctly rounded values of float64 sums, the same bytes on every machine - see
    qsfa.reference.attention). float64 matmuls take about twice the fp32 time, and ours also needs a float64
    exp (about half an fp32 floor on its own), so the fp32 ratio cannot reach 1.

Ours is the public ``qsfa.kv_quant_sparse_flash_attention`` (contract validation included). Goals:
decode >= 20x faster than (a); within 3x of the fp32 floor (b); prefill peak memory (tracemalloc) < 2 GiB
and independent of the number of query tokens (reported for 1024 and 4096 tokens, with and without the
output array itself, which necessarily grows with the tokens). Machine load is recorded per row.

    python -m benchmarks.attention [--quick]
    python -m benchmarks --only attention [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

import ml_dtypes
import numpy as np

import qsfa
from qsfa._values import as_dtype
from qsfa.reference.attention import _rows_per_chunk
from ._harness import Timing, fmt_s, peak_memory, row, timeit

BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCK = 128
SCALE = 576 ** -0.5


def _load():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return None


def _cache(rng, n_tokens):
    nblk = -(-n_tokens // BLOCK)
    rows = np.empty((nblk * BLOCK, 656), np.uint8)
    rows[:, :512] = rng.integers(-127, 128, size=(rows.shape[0], 512), dtype=np.int8).view(np.uint8)
    rows[:, 512:640] = as_dtype(rng.standard_normal((rows.shape[0], 64)) * 0.5, BF16).view(np.uint8)
    rows[:, 640:656] = rng.uniform(0.005, 0.02, size=(rows.shape[0], 4)).astype("<f4").view(np.uint8)
    return rows.reshape(nblk, BLOCK, 1, 656).view(np.int8), nblk


def decode_case(rng, batch=4, kv_len=8192, sparse=2048, heads=128):
    cache, nblk = _cache(rng, batch * kv_len)
    per = -(-kv_len // BLOCK)
    table = rng.permutation(nblk)[: batch * per].reshape(batch, per).astype(np.int32)
    q = as_dtype(rng.standard_normal((batch, 1, heads, 576)) * 0.5, BF16)
    idx = np.stack([rng.permutation(kv_len)[:sparse] for _ in range(batch)]).astype(np.int32)
    return dict(query=q, key=cache, value=cache, sparse_indices=idx.reshape(batch, 1, 1, sparse), scale_value=SCALE,
                block_table=table, actual_seq_lengths_query=np.ones(batch, np.int32),
                actual_seq_lengths_kv=np.full(batch, kv_len, np.int32), layout_query="BSND", layout_kv="PA_BSND")


def prefill_case(rng, q_tokens=4096, sparse=2048, heads=128, cached=None):
    """cached: tokens before the query (default sparse: every row sees >= sparse tokens); fewer leave the first
    rows' surplus indices past their causal threshold (unselected)."""
    kv_len = (sparse if cached is None else cached) + q_tokens
    cache, nblk = _cache(rng, kv_len)
    table = np.arange(nblk, dtype=np.int32)[None, :]
    q = as_dtype(rng.standard_normal((q_tokens, heads, 576)) * 0.5, BF16)
    thr = kv_len - q_tokens + np.arange(q_tokens) + 1
    # distinct tokens below each row's causal threshold: sparse draws from [0, thr) without repeats
    idx = np.empty((q_tokens, sparse), np.int32)
    for lo in range(0, q_tokens, 256):  # chunks of rows: argpartition of random keys = random subsets
        t = thr[lo:lo + 256]
        keys = rng.random((t.size, kv_len))
        keys[np.arange(kv_len)[None, :] >= t[:, None]] = 2.0
        idx[lo:lo + 256] = np.argpartition(keys, sparse - 1, axis=1)[:, :sparse]
    return dict(query=q, key=cache, value=cache, sparse_indices=idx.reshape(q_tokens, 1, sparse), scale_value=SCALE,
                block_table=table, actual_seq_lengths_query=np.array([q_tokens], np.int32),
                actual_seq_lengths_kv=np.array([kv_len], np.int32), layout_query="TND", layout_kv="PA_BSND")


def ours(args):
    return qsfa.kv_quant_sparse_flash_attention(**args)[0]


# --------------------------------------------------------------------------------------------------
# (a) per-row golden, vLLM-Ascend style


def per_row_golden(args, max_rows=None):
    """Whole-cache dequantisation, then a Python loop per query row (returns the rows it computed)."""
    cache = args["key"].reshape(-1, 656).view(np.uint8)
    scales = np.ascontiguousarray(cache[:, 640:656]).view("<f4")
    k_nope = (cache[:, :512].view(np.int8).astype(np.float32) * np.repeat(scales, 128, axis=-1))
    k_nope = k_nope.astype(BF16).astype(np.float32)
    k_rope = np.ascontiguousarray(cache[:, 512:640]).view(BF16).astype(np.float32)
    key = np.concatenate([k_nope, k_rope], axis=-1)
    layout = args["layout_query"]
    q = args["query"]
    q_rows = q.reshape(-1, q.shape[-2], q.shape[-1])
    idx_rows = args["sparse_indices"].reshape(q_rows.shape[0], -1)
    if layout == "BSND":
        batch_of = np.repeat(np.arange(q.shape[0]), q.shape[1])
        pos_of = np.tile(np.arange(q.shape[1]), q.shape[0])
        act_q = args["actual_seq_lengths_query"]
    else:
        ends = args["actual_seq_lengths_query"]
        batch_of = np.searchsorted(ends, np.arange(q_rows.shape[0]), side="right")
        starts = np.concatenate([[0], ends[:-1]])
        pos_of = np.arange(q_rows.shape[0]) - starts[batch_of]
        act_q = np.diff(np.concatenate([[0], ends]))
    act_kv = args["actual_seq_lengths_kv"]
    bt = args["block_table"]
    n = q_rows.shape[0] if max_rows is None else min(max_rows, q_rows.shape[0])
    out = np.zeros((n, q_rows.shape[1], 512), BF16)
    for r in range(n):
        b, i = int(batch_of[r]), int(pos_of[r])
        if i >= act_q[b]:
            continue
        threshold = int(act_kv[b] - act_q[b] + i + 1)
        tokens = []
        for t in idx_rows[r, :min(idx_rows.shape[1], threshold)].tolist():
            if t == -1:
                break
            if t < min(threshold, act_kv[b]):
                tokens.append(t)
        if not tokens:
            continue
        tok = np.asarray(tokens)
        phys = bt[b, tok // BLOCK] * BLOCK + tok % BLOCK
        ks = key[phys]
        s = (q_rows[r].astype(np.float32) @ ks.T) * np.float32(SCALE)
        m = s.max(axis=-1, keepdims=True)
        e = np.exp(s - m)
        l = e.sum(axis=-1, keepdims=True)
        o = (e.astype(BF16).astype(np.float32) @ ks[:, :512]) / l
        out[r] = o.astype(BF16)
    return out


# --------------------------------------------------------------------------------------------------
# (b) the two batched matmuls alone


def matmul_floor(n_rows, heads, width, chunk_rows, dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((chunk_rows, heads, 576)).astype(dtype)
    k = rng.standard_normal((chunk_rows, width, 576)).astype(dtype)
    p = rng.standard_normal((chunk_rows, heads, width)).astype(dtype)

    def run():
        for start in range(0, n_rows, chunk_rows):
            c = min(chunk_rows, n_rows - start)
            np.matmul(q[:c], k[:c].transpose(0, 2, 1))
            np.matmul(p[:c], k[:c, :, :512])

    return run


# --------------------------------------------------------------------------------------------------


def _check(ours_out, golden_rows, name):
    n = golden_rows.shape[0]
    res = qsfa.compare.compare_float(ours_out.reshape(-1, *ours_out.shape[-2:])[:n].astype(np.float32),
                                     golden_rows.astype(np.float32), dtype="bfloat16", name=name)
    if not res.passed:
        raise AssertionError(f"{name}: ours and the per-row golden disagree:\n{res}")
    return res


def _decode(quick, kv_len=8192, tag="decode"):
    rng = np.random.default_rng(0)
    args = decode_case(rng, **(dict(batch=2, kv_len=1024, sparse=256, heads=16) if quick else dict(kv_len=kv_len)))
    heads, width = args["query"].shape[-2], args["sparse_indices"].shape[-1]
    repeat, warm = (1, 1) if quick else (7, 1)
    load0 = _load()
    out = ours(args)
    res = _check(out, per_row_golden(args), "decode")
    t_ours = timeit(lambda: ours(args), warmup=warm, repeat=repeat)
    t_gold = timeit(lambda: per_row_golden(args), warmup=warm, repeat=max(1, repeat // 2))
    chunk = _rows_per_chunk(2048, heads, width)
    t_mm = timeit(matmul_floor(args["query"].shape[0], heads, width, chunk), warmup=warm, repeat=repeat)
    t_mm64 = timeit(matmul_floor(args["query"].shape[0], heads, width, chunk, np.float64), warmup=warm,
                    repeat=repeat)
    _, peak = peak_memory(lambda: ours(args))
    note = (f"B={args['query'].shape[0]} Q_N={heads} sparse={width} KV/seq={int(args['actual_seq_lengths_kv'][0])}; "
            f"max ulp vs golden {res.max_ulp}; load {load0}->{_load()}")
    return [
        row("attention", f"{tag} vs per-row golden", t_ours, baseline_name="per-row golden (vLLM style)",
            baseline=t_gold, peak_mib=peak / 2**20, notes=note, goal="speedup >= 20"),
        row("attention", f"{tag} vs matmul floor", t_ours, baseline_name="2 batched matmuls", baseline=t_mm,
            notes=note, goal="ratio <= 3"),
        row("attention", f"{tag} vs float64 matmul floor", t_ours, baseline_name="2 batched float64 matmuls",
            baseline=t_mm64, notes=note + f"; the float64 floor is {t_mm64.median_s / t_mm.median_s:.2f}x the fp32 one"),
    ]


def _prefill(quick):
    rng = np.random.default_rng(1)
    sizes = (64, 128) if quick else (1024, 4096)
    sparse, heads = (256, 16) if quick else (2048, 128)
    rows, peaks = [], {}
    for q_tokens in sizes:
        args = prefill_case(rng, q_tokens=q_tokens, sparse=sparse, heads=heads)
        load0 = _load()
        t0 = time.perf_counter()
        out, peak = peak_memory(lambda: ours(args))  # one run, timed and traced (tracemalloc costs ~nothing here)
        t_ours = Timing(time.perf_counter() - t0, 0, 0, 0, 1)
        peaks[q_tokens] = (peak, out.nbytes)
        if q_tokens != sizes[-1]:
            continue
        sub = 16 if quick else 64
        gold = per_row_golden(args, max_rows=sub)
        res = _check(out, gold, "prefill")
        t0 = time.perf_counter()
        per_row_golden(args, max_rows=sub)
        t_gold_sub = time.perf_counter() - t0
        t_gold = Timing(t_gold_sub * q_tokens / sub, 0, 0, 0, 1)
        chunk = _rows_per_chunk(2048, heads, sparse)
        t0 = time.perf_counter()
        matmul_floor(q_tokens, heads, sparse, chunk)()
        t_mm = Timing(time.perf_counter() - t0, 0, 0, 0, 1)
        t0 = time.perf_counter()
        matmul_floor(q_tokens, heads, sparse, chunk, np.float64)()
        t_mm64 = Timing(time.perf_counter() - t0, 0, 0, 0, 1)
        mem = "; ".join(f"{n} tokens: peak {p / 2**20:.0f} MiB ({(p - o) / 2**20:.0f} MiB without the "
                        f"{o / 2**20:.0f} MiB output)" for n, (p, o) in sorted(peaks.items()))
        note = (f"TND, {q_tokens} query tokens, Q_N={heads}, sparse={sparse}; golden timed on {sub} rows and "
                f"scaled x{q_tokens // sub}; max ulp vs golden {res.max_ulp}; load {load0}->{_load()}")
        rows.append(row("attention", "prefill vs per-row golden", t_ours, baseline_name=f"per-row golden ({sub} rows, "
                        "scaled)", baseline=t_gold, peak_mib=peaks[q_tokens][0] / 2**20, notes=note + "; " + mem,
                        goal="peak < 2 GiB, independent of tokens"))
        rows.append(row("attention", "prefill vs matmul floor", t_ours, baseline_name="2 batched matmuls",
                        baseline=t_mm, notes=note, goal="ratio <= 3"))
        rows.append(row("attention", "prefill vs float64 matmul floor", t_ours,
                        baseline_name="2 batched float64 matmuls", baseline=t_mm64,
                        notes=note + f"; the float64 floor is {t_mm64.median_s / t_mm.median_s:.2f}x the fp32 one"))
    return rows


def run(quick: bool = False) -> list[dict]:
    """Decode and prefill rows (see the module docstring). quick: small sizes, single runs (CI smoke).

    The full run adds a decode over 65536 tokens per sequence: ours does not depend on the context length,
    the golden's whole-cache dequantisation does (the speed-up over it grows with the context)."""
    rows = _decode(quick)
    if not quick:
        rows += _decode(quick, kv_len=65536, tag="decode 64K context")[:1]
    return rows + _prefill(quick)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    for r in run(quick=a.quick):
        extra = f"  speedup {r['speedup']:.1f}x" if "speedup" in r else ""
        print(f"{r['case']:30s} ours {fmt_s(r['ours_s']):>10s}  {r['baseline_name']}: {fmt_s(r['baseline_s']):>10s}"
              f"  ratio {r['ratio']:.3g}{extra}  {r.get('notes', '')}")


if __name__ == "__main__":
    main()
