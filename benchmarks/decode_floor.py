"""Faithful QSFA decode against the matmul floor and a torch fp32 "user version", side by side (issue 15).

Case: benchmarks/attention.py's decode - B = 4, Q_N = 128, 2048 distinct selected of 8192 tokens per sequence,
int8 PA cache (block 128, rope 64), bf16 query. Every implementation runs in this process on the same inputs,
with BLAS (and torch's intra-op pool) pinned to one thread through threadpoolctl; the BLAS library, version and
kernel threadpoolctl reports are printed. Implementations are measured in interleaved rounds (one run of each per
round) so a change of machine load hits all of them alike; medians are reported.

* ``qsfa faithful``: the public ``qsfa.kv_quant_sparse_flash_attention`` (validation included), byte-exact;
* ``torch user``: what a user writes in torch - gather the selected packed rows, dequantise K to bf16, fp32
  ``bmm`` for the scores, fp32 softmax, P rounded to bf16, fp32 ``bmm`` with V (checked against qsfa with the
  attention tolerances of docs/numerics/comparison.md before any time is reported);
* ``fp32 floor``: the two batched fp32 GEMMs alone (``[4, 128, 576] @ [4, 576, 2048]``,
  ``[4, 128, 2048] @ [4, 2048, 512]``) on preallocated operands, NumPy's BLAS;
* ``float64 floor``: the same two GEMMs in float64 (what the byte-exact oracle needs: its fp32 accumulations are
  correctly rounded values of exact float64 sums).

Goals: qsfa faithful <= 2.5x the fp32 floor and <= 1.2x the torch user version.

    python -m benchmarks.decode_floor [--quick] [--rounds N] [--clock wall|cpu]

``--clock cpu`` times each run by the CPU time of the calling thread (``time.thread_time``; BLAS and torch run
in it, pinned to one thread) instead of the wall clock: on a machine whose cores other jobs share, the wall clock
counts the time the process waited for a core, the CPU clock does not (cache and memory contention still count).
"""

from __future__ import annotations

import argparse
import os
import time

import ml_dtypes
import numpy as np

import qsfa

from ._harness import Timing, row

BF16 = np.dtype(ml_dtypes.bfloat16)


def blas_info() -> str:
    from threadpoolctl import threadpool_info

    libs = [f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture', '?')}, {i.get('num_threads')} "
            f"threads, {os.path.basename(i.get('filepath', ''))})" for i in threadpool_info()]
    return "; ".join(libs) or "no BLAS / OpenMP library found by threadpoolctl"


def torch_user(args):
    """The torch fp32 version a user writes (see the module docstring); returns a callable and its output fn."""
    import torch

    cache = torch.from_numpy(args["key"].reshape(-1, 656).view(np.uint8))
    b, _, heads, d = args["query"].shape
    q = torch.from_numpy(args["query"].reshape(b, heads, d).view(np.uint16).astype(np.int32) << 16).view(
        torch.float32).to(torch.bfloat16)
    idx = torch.from_numpy(args["sparse_indices"].reshape(b, -1).astype(np.int64))
    table = torch.from_numpy(args["block_table"].astype(np.int64))
    scale = float(args["scale_value"])

    def run():
        phys = torch.gather(table, 1, idx // 128) * 128 + idx % 128  # [b, W]
        rows = cache[phys.reshape(-1)]  # [b*W, 656] uint8
        codes = rows[:, :512].view(torch.int8).float().reshape(-1, 4, 128)
        scales = rows[:, 640:656].contiguous().view(torch.float32).reshape(-1, 4, 1)
        k_nope = (codes * scales).reshape(-1, 512).to(torch.bfloat16)
        k_rope = rows[:, 512:640].contiguous().view(torch.bfloat16)
        k = torch.cat([k_nope, k_rope], dim=-1).reshape(b, -1, 576)
        s = torch.bmm(q.float(), k.float().transpose(1, 2)) * scale
        m = s.amax(dim=-1, keepdim=True)
        e = torch.exp(s - m)
        l = e.sum(dim=-1, keepdim=True)
        o = torch.bmm(e.to(torch.bfloat16).float(), k[..., :512].float()) / l
        return o.to(torch.bfloat16)

    def as_numpy(o):
        return (o.view(torch.int16).numpy().astype(np.uint16)).view(BF16).reshape(b, 1, heads, 512)

    return run, as_numpy


def floor(batch, heads, width, dtype):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, heads, 576)).astype(dtype)
    k = rng.standard_normal((batch, width, 576)).astype(dtype)
    p = rng.standard_normal((batch, heads, width)).astype(dtype)
    s_out = np.empty((batch, heads, width), dtype)
    o_out = np.empty((batch, heads, 512), dtype)

    def run():
        np.matmul(q, k.transpose(0, 2, 1), out=s_out)
        np.matmul(p, k[:, :, :512], out=o_out)

    return run


def measure(fns: dict, rounds: int, clock=time.perf_counter) -> dict:
    """Interleaved rounds: one timed run of every function per round (after one warm-up each)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = clock()
            f()
            times[k].append(clock() - t0)
    out = {}
    for k, ts in times.items():
        a = np.asarray(ts)
        q1, q3 = np.percentile(a, [25, 75])
        out[k] = Timing(float(np.median(a)), float(a.min()), float(a.max()), float(q3 - q1), len(ts))
    return out


def run(quick: bool = False, rounds: int | None = None, clock: str = "wall") -> list[dict]:
    from threadpoolctl import threadpool_limits

    from .attention import decode_case

    size = dict(batch=2, kv_len=1024, sparse=256, heads=16) if quick else dict(batch=4, kv_len=8192)
    args = decode_case(np.random.default_rng(0), **size)
    b, heads, width = args["query"].shape[0], args["query"].shape[-2], args["sparse_indices"].shape[-1]
    rounds = rounds or (2 if quick else 9)
    fns = {"qsfa faithful": lambda: qsfa.kv_quant_sparse_flash_attention(**args)}
    have_torch = True
    try:
        import torch
    except ImportError:
        have_torch = False
    with threadpool_limits(limits=1):
        if have_torch:
            torch_threads = torch.get_num_threads()
            torch.set_num_threads(1)
            t_run, t_np = torch_user(args)
            ours = qsfa.kv_quant_sparse_flash_attention(**args)[0]
            res = qsfa.compare.compare_float(t_np(t_run()).astype(np.float32), ours.astype(np.float32),
                                             dtype="bfloat16", name="torch user vs qsfa")
            if not res.passed:
                raise AssertionError(f"the torch user version disagrees with qsfa:\n{res}")
            fns["torch user"] = t_run
        fns["fp32 floor"] = floor(b, heads, width, np.float32)
        fns["float64 floor"] = floor(b, heads, width, np.float64)
        load0 = os.getloadavg()[0]
        try:
            t = measure(fns, rounds, time.thread_time if clock == "cpu" else time.perf_counter)
        finally:
            if have_torch:
                torch.set_num_threads(torch_threads)
        info = blas_info()
    note = (f"B={b} Q_N={heads} sparse={width}; 1 thread; {info}; load {load0:.2f}->{os.getloadavg()[0]:.2f}; "
            f"{rounds} interleaved rounds, {clock} clock")
    ours = t["qsfa faithful"]
    rows = [row("decode_floor", "faithful decode vs fp32 GEMM floor", ours, baseline_name="2 fp32 GEMMs",
                baseline=t["fp32 floor"], goal="ratio <= 2.5", notes=note),
            row("decode_floor", "faithful decode vs float64 GEMM floor", ours, baseline_name="2 float64 GEMMs",
                baseline=t["float64 floor"], notes=note)]
    if have_torch:
        rows.append(row("decode_floor", "faithful decode vs torch user version", ours,
                        baseline_name="torch fp32 (gather, bf16 K, bmm, softmax, bf16 P)", baseline=t["torch user"],
                        goal="ratio <= 1.2", notes=note))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: CPU time of this thread (time.thread_time)")
    a = p.parse_args(argv)
    rows = run(quick=a.quick, rounds=a.rounds, clock=a.clock)
    print(rows[0]["notes"])
    for r in rows:
        print(f"{r['case']:42s} ours {r['ours_s'] * 1e3:8.2f} ms  {r['baseline_name']}: "
              f"{r['baseline_s'] * 1e3:8.2f} ms  ratio {r['ratio']:.2f}  (goal {r.get('goal', '-')})")


if __name__ == "__main__":
    main()
