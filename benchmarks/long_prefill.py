"""A long TND prefill golden streamed to disk through ``attention_out=`` (np.memmap): time and peak memory (issue 15).

Case: one sequence of ``--tokens`` query tokens (default 32768) with Q_N = 128, sparse_size 2048 over 2048 cached
+ the new tokens, int8 PA cache, bf16 query. The query, the indices and the output live in ``np.memmap`` files
(written chunk by chunk, never whole in memory); with ``--lse`` the softmax statistics too (``return_softmax_lse``
into ``softmax_max_out=`` / ``softmax_sum_out=`` memmaps); the key cache (``(2048 + T) x 656`` bytes) is in
memory. ``--workset MIB`` sets the oracle's working-set budget (``qsfa.set_workset_mib``; default 256 MiB shared
by the threads). One call of ``qsfa.kv_quant_sparse_flash_attention(..., attention_out=memmap)`` is timed;
meanwhile a thread samples the
process's anonymous resident memory (``RssAnon``: what the oracle allocates; file pages of the memmaps are the
page cache's) and the kernel's peak RSS (``VmHWM``, reset before the call, file pages included) is read after it.
The last 64 rows are recomputed in memory as a sequence of their own and compared byte for byte.

Baseline (the ratio): the in-memory output array the call would otherwise allocate (``T x 128 x 512`` bf16). Goal:
a 128K-token prefill's working set under 512 MiB - the oracle's peak does not grow with T (chunks of rows), so the
32K figure stands for it.

    python -m benchmarks.long_prefill [--quick] [--tokens N] [--threads N] [--workset MIB] [--lse] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import ml_dtypes
import numpy as np

import qsfa
from qsfa._values import as_dtype
from qsfa.reference.attention import _rows_per_chunk
from qsfa.reference.parallel import workset_bytes_per_thread

from ._harness import Timing, peak_rss, row

BF16 = np.dtype(ml_dtypes.bfloat16)


def build(folder, tokens, heads=128, sparse=2048, cached=2048, seed=0, block=128):
    """Arguments with the query / indices as memmaps under ``folder`` (chunked generation)."""
    rng = np.random.default_rng(seed)
    kv_len = cached + tokens
    nblk = -(-kv_len // block)
    rows = np.empty((nblk * block, 656), np.uint8)
    rows[:, :512] = rng.integers(-127, 128, (rows.shape[0], 512), dtype=np.int8).view(np.uint8)
    rows[:, 512:640] = as_dtype(rng.standard_normal((rows.shape[0], 64)) * 0.5, BF16).view(np.uint8)
    rows[:, 640:] = rng.uniform(0.005, 0.02, (rows.shape[0], 4)).astype("<f4").view(np.uint8)
    q = np.memmap(os.path.join(folder, "query.bin"), dtype=BF16, mode="w+", shape=(tokens, heads, 576))
    idx = np.memmap(os.path.join(folder, "indices.bin"), dtype=np.int32, mode="w+", shape=(tokens, 1, sparse))
    step = 128
    for a in range(0, tokens, step):
        b = min(tokens, a + step)
        q[a:b] = as_dtype(rng.standard_normal((b - a, heads, 576)) * 0.5, BF16)
        thr = cached + np.arange(a, b) + 1
        keys = rng.random((b - a, kv_len))
        keys[np.arange(kv_len)[None, :] >= thr[:, None]] = 2.0
        idx[a:b, 0] = np.argpartition(keys, sparse - 1, axis=1)[:, :sparse]
    q.flush()
    idx.flush()
    return dict(query=q, key=rows.reshape(nblk, block, 1, 656).view(np.int8), value=None, sparse_indices=idx,
                scale_value=576 ** -0.5, block_table=np.arange(nblk, dtype=np.int32)[None],
                actual_seq_lengths_query=np.array([tokens], np.int32), actual_seq_lengths_kv=np.array([kv_len], np.int32),
                layout_query="TND", layout_kv="PA_BSND")


def run(quick: bool = False, tokens: int | None = None, threads: int | None = None, folder: str | None = None,
        heads: int | None = None, workset: int | None = None, lse: bool = False) -> list[dict]:
    tokens = tokens or (256 if quick else 32768)
    heads = heads or (16 if quick else 128)
    sparse = 256 if quick else 2048
    with tempfile.TemporaryDirectory(dir=folder) as d:
        args = build(d, tokens, heads=heads, sparse=sparse, cached=sparse)
        args["value"] = args["key"]
        out = np.memmap(os.path.join(d, "out.bin"), dtype=BF16, mode="w+", shape=(tokens, heads, 512))
        bufs = {}
        if lse:
            args["return_softmax_lse"] = True
            bufs = {k: np.memmap(os.path.join(d, f"{k}.bin"), dtype=np.float32, mode="w+", shape=(1, tokens, heads))
                    for k in ("softmax_max_out", "softmax_sum_out")}
        if threads:
            qsfa.set_num_threads(threads)
        if workset:
            qsfa.set_workset_mib(workset)
        load0 = os.getloadavg()[0]
        try:
            with peak_rss() as mem:
                t0 = time.perf_counter()
                got = qsfa.kv_quant_sparse_flash_attention(**args, attention_out=out, **bufs)
                elapsed = time.perf_counter() - t0
        finally:
            n_threads = qsfa.get_num_threads()
            budget = qsfa.get_workset_mib()
            rows = _rows_per_chunk(2048, heads, sparse, budget=workset_bytes_per_thread(n_threads))
            qsfa.set_num_threads(None)
            qsfa.set_workset_mib(None)
        assert got[0] is out
        out.flush()
        # the last 64 rows as a sequence of their own: the same thresholds, the same bytes
        r = min(64, tokens)
        sub = dict(args, query=np.asarray(args["query"][-r:]), sparse_indices=np.asarray(args["sparse_indices"][-r:]),
                   actual_seq_lengths_query=np.array([r], np.int32))
        want = qsfa.kv_quant_sparse_flash_attention(**sub)
        if want[0].tobytes() != np.asarray(out[-r:]).tobytes():
            raise AssertionError("the streamed output differs from the in-memory one: not reported")
        for w, k in zip(want[1:], ("softmax_max_out", "softmax_sum_out")):
            if k in bufs and w.tobytes() != np.asarray(bufs[k][:, -r:]).tobytes():
                raise AssertionError(f"the streamed {k} differs from the in-memory one: not reported")
        got = None
        bufs.clear()
        out_bytes = out.nbytes
        del out, got
    mib, hwm, base = mem.peak_anon / 2**20, mem.hwm, mem.base_anon / 2**20
    note = (f"{elapsed:.1f} s; TND {tokens} tokens, Q_N={heads}, sparse={sparse}; {n_threads} thread(s); "
            f"workset {budget} MiB ({rows} row(s) a chunk){'; LSE to memmaps' if lse else ''}; load "
            f"{load0:.2f}->{os.getloadavg()[0]:.2f}; peak RssAnon {mib:.0f} MiB ({mib - base:.0f}"
            f" MiB above the {base:.0f} MiB before the call); peak RSS incl. memmap pages "
            f"{hwm / 2**20:.0f} MiB{'' if mem.hwm_reset else ' (VmHWM not reset: includes input generation)'}; output "
            f"{out_bytes / 2**20:.0f} MiB on disk; last {r} rows byte-identical to an in-memory call")
    # figures in MiB (not seconds): ratio = peak anonymous memory / the 512 MiB budget
    return [row("long_prefill", f"prefill {tokens} tokens to a memmap: peak MiB vs budget",
                Timing(mib, mib, mib, 0.0, 1), baseline_name="512 MiB working-set budget", unit="MiB",
                baseline=Timing(512.0, 512.0, 512.0, 0.0, 0), seconds=elapsed, peak_mib=mib, vmhwm_mib=hwm / 2**20,
                output_mib=out_bytes / 2**20, workset_mib=budget, rows_per_chunk=rows, notes=note, goal="ratio < 1")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--threads", type=int)
    p.add_argument("--workset", type=int, help="working-set budget in MiB (qsfa.set_workset_mib; default 256)")
    p.add_argument("--lse", action="store_true", help="also stream softmax_max / softmax_sum to memmaps")
    p.add_argument("--dir", help="folder for the memmap files (default: the system temp folder)")
    a = p.parse_args(argv)
    for r in run(quick=a.quick, tokens=a.tokens, threads=a.threads, folder=a.dir, heads=a.heads, workset=a.workset,
                 lse=a.lse):
        print(f"{r['case']}: {r['notes']}", flush=True)


if __name__ == "__main__":
    main()
