"""A long DeepSeek-V4 shared-KV (CSA) prefill streamed through ``attention_out=`` memmaps: time and peak memory
(issue 24).

Case: one TND sequence of ``--context`` tokens (default 131072) whose last ``--tokens`` query tokens (default 2048;
``--tokens`` = ``--context`` is the whole 128K-token prefill) are computed: Q_N = 64 bf16 heads, a 128-token window
over ``ori_kv`` plus the top-1024 of the ``cmp_ratio`` 4 compressed cache (``context / 4`` tokens; distinct random
indices below each row's causal bound), sinks, A2/A3 numerics. The query, both caches, the indices and the output
are ``np.memmap`` files: nothing of size ``context`` or ``tokens`` is held in memory by the benchmark.
The public door :func:`qsfa.sparse_flash_mla` (``chip="A2"``: its contract, validation included, then the shared core
:func:`qsfa.reference.sharedkv.sharedkv_attention`) runs with ``attention_out=`` the output memmap: rows are
gathered, computed and written a chunk at a time, the compressed-token selection too. A thread samples the
process's anonymous resident memory (``RssAnon``: what the oracle allocates; the memmaps' pages are the page
cache's) and the kernel's peak RSS (``VmHWM``, reset before the call) is read after it. The last 32 rows are
(at most half) recomputed in memory (an in-memory call of the core with the A2 numerics, under ``only_rows``) and
compared byte for byte.

Baseline (the ratio): the 512 MiB working-set budget (MiB, not seconds). The oracle's peak does not grow with
the number of query tokens (chunks of rows), so a few thousand rows of the 128K context stand for the whole
prefill; ``--tokens 131072`` runs it (about 20 minutes on one quiet core here).

``--workers W`` (a local Dask cluster of W one-thread processes, :func:`qsfa.distributed._cluster.connect`) or
``--scheduler ADDR`` (a running cluster whose workers see ``--dir`` on a shared filesystem and run the same qsfa):
after the serial run, the same rows again as row tasks of ``--task-rows`` rows, each reading the input memmaps
from the folder and streaming its rows into one shared output memmap under
:func:`qsfa.reference.attention.only_rows` (the core with the A2 numerics; the serial run's door validated the
arguments once). Then both output files are compared byte for byte, chunk by chunk, and the split's wall time,
the speed-up and the largest peak ``RssAnon`` of a task are reported.

    python -m benchmarks.sharedkv_prefill [--quick] [--tokens N] [--context N] [--dir DIR]
                                          [--workers W | --scheduler ADDR] [--task-rows R]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import ml_dtypes
import numpy as np
from threadpoolctl import threadpool_limits

import qsfa
from qsfa.reference.attention import only_rows
from qsfa.reference.sharedkv import sharedkv_attention

from ._harness import Timing, at_least, peak_rss, row

BF16 = np.dtype(ml_dtypes.bfloat16)
D = 512
RATIO = 4
TOPK = 1024
#: the core's rounding parameters of Atlas A2 (qsfa.chips) that build() passes for the in-memory recomputation
_CORE_NUMERICS = ("s2_tile", "p_rounding", "out_rounding")


def _fill(mm, rng, scale):
    flat = mm.reshape(-1, mm.shape[-1])
    for a in range(0, flat.shape[0], 1 << 14):
        b = min(flat.shape[0], a + (1 << 14))
        flat[a:b] = (rng.standard_normal((b - a, mm.shape[-1]), np.float32) * np.float32(scale)).astype(BF16)


def build(folder, tokens, context, heads, seed=0):
    """Arguments (memmaps under ``folder``) for the last ``tokens`` query tokens of a ``context``-token sequence."""
    rng = np.random.default_rng(seed)
    s3 = context // RATIO
    mm = lambda name, dt, shape: np.lib.format.open_memmap(os.path.join(folder, name), mode="w+", dtype=dt,
                                                           shape=shape)
    q, ori, cmp = mm("q.npy", BF16, (tokens, heads, D)), mm("ori.npy", BF16, (context, 1, D)), \
        mm("cmp.npy", BF16, (s3, 1, D))
    _fill(q, rng, 0.5)
    _fill(ori, rng, 1.0)
    _fill(cmp, rng, 1.0)
    idx = mm("idx.npy", np.int32, (tokens, 1, TOPK))
    for a in range(0, tokens, 256):
        b = min(tokens, a + 256)
        bound = (context - tokens + np.arange(a, b) + 1) // RATIO  # the row's causal bound (cmp_mask_mode 3)
        keys = rng.random((b - a, s3))
        keys[np.arange(s3)[None, :] >= bound[:, None]] = 2.0
        part = np.argsort(keys, axis=1)[:, :TOPK].astype(np.int32)
        part[np.arange(TOPK)[None, :] >= bound[:, None]] = -1  # fewer than K below the bound: -1 ends the row
        idx[a:b, 0] = part
    for m in (q, ori, cmp, idx):
        m.flush()
    np.save(os.path.join(folder, "sinks.npy"), rng.uniform(-1, 1, heads).astype(np.float32))
    return load(folder)


def load(folder):
    """The arguments of :func:`build` from the files in ``folder`` (read-only memmaps): what a row task reads."""
    mm = lambda name: np.load(os.path.join(folder, name), mmap_mode="r")
    q, ori, cmp = (mm(n).view(BF16) for n in ("q.npy", "ori.npy", "cmp.npy"))  # (.npy stores bf16 as void |V2)
    idx = mm("idx.npy")
    tokens, context, s3 = q.shape[0], ori.shape[0], cmp.shape[0]
    return dict(q=q, ori_kv=ori, cmp_kv=cmp, cmp_sparse_indices=idx, cu_seqlens_q=np.array([0, tokens], np.int32),
                cu_seqlens_ori_kv=np.array([0, context], np.int32), cu_seqlens_cmp_kv=np.array([0, s3], np.int32),
                cmp_residual_kv=np.zeros(1, np.int32), sinks=np.load(os.path.join(folder, "sinks.npy")),
                softmax_scale=D ** -0.5, cmp_ratio=RATIO, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=127,
                ori_win_right=0, layout_q="TND", layout_kv="TND", precision="faithful", s2_tile=512,
                p_rounding="round", out_rounding="rint")


def row_task(folder: str, out_name: str, lo: int, hi: int) -> dict:
    """On a worker: rows ``[lo, hi)`` streamed into the shared output memmap ``out_name`` of ``folder``
    (:func:`qsfa.reference.attention.only_rows`: the other rows of the file are left alone)."""
    args = load(folder)
    out = np.load(os.path.join(folder, out_name), mmap_mode="r+").view(BF16)
    with peak_rss() as mem, threadpool_limits(limits=1), only_rows(lo, hi):
        t0 = time.perf_counter()
        sharedkv_attention(**args, attention_out=out)
        seconds = time.perf_counter() - t0
    out.flush()
    del out
    return {"lo": lo, "hi": hi, "seconds": seconds, "peak_mib": mem.peak_anon / 2**20,
            "call_mib": (mem.peak_anon - mem.base_anon) / 2**20}


def _same_files(a, b, block=1 << 26) -> bool:
    """Whether two files hold the same bytes (read ``block`` bytes at a time)."""
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(block), fb.read(block)
            if x != y:
                return False
            if not x:
                return True


def split_run(folder, tokens, heads, *, workers=None, scheduler=None, task_rows=4096) -> dict:
    """The row tasks of ``--workers`` / ``--scheduler`` into ``out_split.npy``; returns the figures."""
    from qsfa.distributed._cluster import Tasks, connect

    out = np.lib.format.open_memmap(os.path.join(folder, "out_split.npy"), mode="w+", dtype=BF16,
                                    shape=(tokens, heads, D))
    out[:] = np.ones((), BF16)  # garbage: every row must be written by its task
    out.flush()
    del out
    t0 = time.perf_counter()
    with connect(workers=workers, scheduler=scheduler, preload=(__name__,)) as client:
        tasks = Tasks(client, "row tasks", progress=False)
        try:
            for lo in range(0, tokens, task_rows):
                tasks.submit(row_task, folder, "out_split.npy", lo, min(tokens, lo + task_rows), label=f"rows-{lo}")
            results = [f.result() for _, f in tasks.completed()]
        finally:
            tasks.cancel()
            tasks.close()
        summary = tasks.summary()
    return {"seconds": time.perf_counter() - t0, "tasks": len(results), "summary": summary.line(),
            "task_peak_mib": max(r["peak_mib"] for r in results), "task_call_mib": max(r["call_mib"] for r in results),
            "task_seconds": sum(r["seconds"] for r in results)}


def run(quick: bool = False, tokens: int | None = None, context: int | None = None, heads: int = 64,
        folder: str | None = None, workers: int | None = None, scheduler: str | None = None,
        task_rows: int = 4096) -> list[dict]:
    context = context or (4096 if quick else 131072)
    tokens = min(tokens or (16 if quick else 2048), context)
    split = None
    with tempfile.TemporaryDirectory(dir=folder) as d:
        args = build(d, tokens, context, heads)
        out = np.lib.format.open_memmap(os.path.join(d, "out.npy"), mode="w+", dtype=BF16, shape=(tokens, heads, D))
        load0 = os.getloadavg()[0]
        door = {k: v for k, v in args.items() if k not in _CORE_NUMERICS}  # the door sets them for chip A2
        with peak_rss() as mem, threadpool_limits(limits=1):
            t0 = time.perf_counter()
            got, _ = qsfa.sparse_flash_mla(**door, chip="A2", attention_out=out)
            elapsed = time.perf_counter() - t0
        assert got is out
        out.flush()
        r = min(32, tokens // 2)
        with only_rows(tokens - r, tokens):  # the last rows computed again, in memory
            want, _ = sharedkv_attention(**args)
        if want[-r:].tobytes() != np.asarray(out[-r:]).tobytes():
            raise AssertionError("the streamed output differs from the in-memory one: not reported")
        out_bytes = out.nbytes
        del out, got, want, args
        if workers is not None or scheduler is not None:
            split = split_run(d, tokens, heads, workers=workers, scheduler=scheduler, task_rows=task_rows)
            if not _same_files(os.path.join(d, "out.npy"), os.path.join(d, "out_split.npy")):
                raise AssertionError("the row tasks' output differs from the serial run's: not reported")
    mib, hwm, base = mem.peak_anon / 2**20, mem.hwm, mem.base_anon / 2**20
    note = (f"{elapsed:.1f} s; TND, the last {tokens} of {context} tokens, Q_N={heads}, CSA window 128 + top-{TOPK} "
            f"of {context // RATIO} compressed; 1 thread (threadpoolctl); load {load0:.2f}->{os.getloadavg()[0]:.2f}; "
            f"peak RssAnon {mib:.0f} MiB ({mib - base:.0f} MiB above the {base:.0f} MiB before the call); peak RSS "
            f"incl. memmap pages {hwm / 2**20:.0f} MiB"
            f"{'' if mem.hwm_reset else ' (VmHWM not reset: includes input generation)'}; output "
            f"{out_bytes / 2**20:.0f} MiB "
            f"on disk; last {r} rows byte-identical to an in-memory call")
    rows = [row("sharedkv_prefill", f"V4 CSA prefill, {tokens} of {context} tokens to a memmap: peak MiB vs budget",
                Timing(mib, mib, mib, 0.0, 1), baseline_name="512 MiB working-set budget", unit="MiB",
                baseline=Timing(512.0, 512.0, 512.0, 0.0, 0), seconds=elapsed, peak_mib=mib, vmhwm_mib=hwm / 2**20,
                output_mib=out_bytes / 2**20, notes=note, goal="ratio < 1")]
    if split is not None:
        where = (f"{workers} local worker{'s' if workers != 1 else ''}" if workers is not None
                 else f"the cluster at {scheduler}")
        s = split["seconds"]
        rows.append(row("sharedkv_prefill", f"the same {tokens} rows as {split['tasks']} row tasks on {where}: wall s "
                        "vs the serial run", Timing(s, s, s, 0.0, 1), baseline_name="serial run (one process)",
                        baseline=Timing(elapsed, elapsed, elapsed, 0.0, 1), unit="s", goal="byte-identical",
                        notes=f"{s:.1f} s wall ({elapsed / s:.2f}x faster than the serial {elapsed:.1f} s); "
                              f"{split['task_seconds']:.1f} s in the tasks; {split['summary']}; largest peak RssAnon "
                              f"of a task {split['task_peak_mib']:.0f} MiB ({split['task_call_mib']:.0f} MiB for "
                              "its call); the output file byte-identical to the serial run's"))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=at_least(1), help="query rows (the last of the context; default 2048, --quick 16)")
    p.add_argument("--context", type=at_least(RATIO * TOPK),
                   help=f"tokens of the request (at least {RATIO * TOPK}: top-{TOPK} of the 1 / {RATIO} compressed "
                        "ones; default 131072, --quick 4096)")
    p.add_argument("--heads", type=at_least(1), default=64)
    p.add_argument("--dir", help="folder for the memmap files (default: the system temp folder)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--workers", type=at_least(1), help="then the rows again as row tasks on a local Dask cluster "
                                                       "of this many one-thread processes")
    g.add_argument("--scheduler", help="then the rows again as row tasks on the Dask cluster at this address "
                                       "(its workers must see --dir)")
    p.add_argument("--task-rows", type=at_least(1), default=4096, help="query rows per row task (default 4096)")
    a = p.parse_args(argv)
    for r in run(quick=a.quick, tokens=a.tokens, context=a.context, heads=a.heads, folder=a.dir,
                 workers=a.workers, scheduler=a.scheduler, task_rows=a.task_rows):
        print(f"{r['case']}: {r['notes']}", flush=True)


if __name__ == "__main__":
    main()
