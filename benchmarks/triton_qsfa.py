"""Triton QSFA attention (qsfa.kernels) on a CUDA GPU against the device's own measured peak.

Measured in one process:

* the device's bf16 matmul peak (``torch.matmul`` of two 8192 x 8192 bf16 matrices; 16384 for the
  full run) and its device-to-device copy bandwidth (a 1 GiB ``copy_``, read + write bytes);
* QSFA decode: B=64, Q_S=1, Q_N=128, sparse_size 2048, rope 64, PA_BSND block 64, KV 4096 per batch;
* QSFA prefill: TND query (2 batches x 1024 tokens), Q_N=128, sparse_size 2048, PA_BSND block 64,
  KV 8192 per batch;

* split-KV: a small decode batch (B=4, Q_N=128, sparse_size 2048), whose unsplit grid leaves most of the
  device idle, with the split path (``split_kv``) off, automatic, and at fixed chunk sizes: ratio = split
  time / unsplit time, same process;

each over a few kernel tilings (``KernelConfig``), reporting achieved TFLOP/s (2 * Q_N * (576 + 512)
flops per selected token and row) and GB/s (unique bytes: query + gathered packed rows + output), as
fractions of the measured peaks, and checking a subset of the output against the reference backend
(docs/numerics/comparison.md#float-criterion criterion). Goal on an H200: decode >= 40% of the measured bf16 matmul peak.

    python benchmarks/triton_qsfa.py [--quick]
    python -m benchmarks --only triton_qsfa [--quick]

Without a CUDA device (or with TRITON_INTERPRET=1) it prints why and exits 0; ``run()`` then returns one
row with ``skipped`` set.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

GOAL_FRACTION_OF_MATMUL_PEAK = 0.40

#: tilings tried for each shape (block_h, block_n, block_dv, num_warps, num_stages, two_pass). Registers per
#: thread on sm_90 from an ahead-of-time compile (no GPU; tests/test_triton_compile.py does the same):
#: 64/32/256/8/2 254 regs, no spill (the default); 32/32/512/8/2 225, no spill (no Q.K recompute, but
#: M=32 rules out wgmma); 64/32/512/8/1 spills 168 bytes; 64/16/512/8/2 spills 136 bytes.
CONFIGS = [
    (64, 32, 256, 8, 2, False),
    (32, 32, 512, 8, 2, False),
    (64, 32, 512, 8, 1, False),
    (64, 16, 512, 8, 2, False),
    (64, 16, 256, 8, 3, False),
    (64, 64, 128, 8, 2, False),
    (64, 32, 256, 8, 2, True),
]
QUICK_CONFIGS = [(64, 32, 256, 8, 2, False), (64, 32, 256, 8, 2, True)]


def _why_not() -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: this benchmark times compiled kernels on a GPU"
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed (pip install qsfa[triton])"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def _time(fn, *, warmup=3, reps=10) -> tuple[float, float]:
    """Median and (max - min) seconds of ``fn()`` over ``reps`` runs, CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts), max(ts) - min(ts)


def measure_peaks(quick: bool) -> dict:
    """The device's bf16 matmul TFLOP/s and device-to-device copy GB/s, measured here."""
    import torch

    n = 8192 if quick else 16384
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t_mm, _ = _time(lambda: torch.matmul(a, b), reps=5 if quick else 10)
    del a, b
    nbytes = (256 if quick else 1024) * 2**20
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_cp, _ = _time(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return {"matmul_tflops": 2 * n**3 / t_mm / 1e12, "matmul_n": n,
            "copy_gbps": 2 * nbytes / t_cp / 1e9, "copy_bytes": nbytes}


def make_case(*, batch, q_per_batch, q_n, sparse, kv_len, block_size=64, layout_query="BSND", seed=0,
              device="cuda"):
    """A valid QSFA argument set (torch tensors on ``device``), every index entry selecting a valid token."""
    import torch

    from qsfa.reference.packing import packed_head_dim

    dev = device
    g = torch.Generator(device=dev).manual_seed(seed)
    w = packed_head_dim(rope_head_dim=64)  # 656
    per = -(-kv_len // block_size)
    n_blocks = batch * per
    codes = torch.randint(-127, 128, (n_blocks, block_size, 1, 512), device=dev, dtype=torch.int8, generator=g)
    rope = torch.randn((n_blocks, block_size, 1, 64), device=dev, generator=g).to(torch.bfloat16)
    scales = torch.rand((n_blocks, block_size, 1, 4), device=dev, generator=g) * 0.02 + 0.001
    key = torch.cat([codes.view(torch.uint8), rope.view(torch.uint8), scales.view(torch.uint8)], dim=-1)
    assert key.shape[-1] == w
    block_table = torch.randperm(n_blocks, device=dev, generator=g).to(torch.int32).reshape(batch, per)
    rows = batch * q_per_batch
    # distinct indices below the smallest causal threshold of the batch's rows (all selected tokens valid)
    lowest_thr = kv_len - q_per_batch + 1
    idx = torch.rand((rows, lowest_thr), device=dev, generator=g).argsort(dim=1)[:, :sparse].to(torch.int32)
    q = torch.randn((rows, q_n, 576), device=dev, generator=g).to(torch.bfloat16)
    if layout_query == "BSND":
        query = q.reshape(batch, q_per_batch, q_n, 576)
        sparse_indices = idx.reshape(batch, q_per_batch, 1, sparse)
        lq = torch.full((batch,), q_per_batch, dtype=torch.int32, device=dev)
    else:
        query = q
        sparse_indices = idx.reshape(rows, 1, sparse)
        lq = torch.arange(1, batch + 1, dtype=torch.int32, device=dev) * q_per_batch
    return dict(query=query, key=key, value=key, sparse_indices=sparse_indices, scale_value=576 ** -0.5,
                block_table=block_table, actual_seq_lengths_query=lq,
                actual_seq_lengths_kv=torch.full((batch,), kv_len, dtype=torch.int32, device=dev),
                layout_query=layout_query, layout_kv="PA_BSND", sparse_mode=3, rope_head_dim=64,
                return_softmax_lse=False)


def _work(args) -> tuple[float, float, int]:
    """(flops, unique bytes, selected tokens) of one call, from the reference's own token selection."""
    from qsfa.reference.attn_layout import kv_map, query_rows, row_limits, selected_tokens

    q = args["query"]
    lead = tuple(q.shape[:2]) if args["layout_query"] == "BSND" else tuple(q.shape[:1])
    rows = query_rows(args["layout_query"], lead, args["actual_seq_lengths_query"].cpu().numpy())
    kvm = kv_map("PA_BSND", tuple(args["key"].shape), args["actual_seq_lengths_kv"].cpu().numpy(), rows.n_batch,
                 args["block_table"].cpu().numpy())
    thr, limit = row_limits(rows, kvm.act_kv, 3)
    idx = args["sparse_indices"].reshape(rows.batch.size, -1).cpu().numpy()
    _, valid = selected_tokens(idx, thr, limit, 1)
    n_sel = int(valid.sum())
    q_n = q.shape[-2]
    flops = 2.0 * q_n * (576 + 512) * n_sel
    nbytes = q.numel() * 2 + n_sel * args["key"].shape[-1] + rows.batch.size * q_n * 512 * 2 + idx.nbytes
    return flops, float(nbytes), n_sel


def _check_subset(args, out, n_batch: int = 2) -> str:
    """The first ``n_batch`` batches of the Triton output against the reference backend (docs/numerics/comparison.md#float-criterion)."""
    import numpy as np

    import qsfa
    from qsfa._arrays import to_numpy
    from qsfa.compare import compare_float

    sub = dict(args)
    if args["layout_query"] == "BSND":
        sub["query"] = args["query"][:n_batch]
        sub["sparse_indices"] = args["sparse_indices"][:n_batch]
        sub["actual_seq_lengths_query"] = args["actual_seq_lengths_query"][:n_batch]
        got = out[:n_batch]
    else:
        end = int(args["actual_seq_lengths_query"][n_batch - 1])
        sub["query"] = args["query"][:end]
        sub["sparse_indices"] = args["sparse_indices"][:end]
        sub["actual_seq_lengths_query"] = args["actual_seq_lengths_query"][:n_batch]
        got = out[:end]
    sub["block_table"] = args["block_table"][:n_batch]
    sub["actual_seq_lengths_kv"] = args["actual_seq_lengths_kv"][:n_batch]
    host = {k: (to_numpy(v) if hasattr(v, "device") else v) for k, v in sub.items()}
    want = qsfa.kv_quant_sparse_flash_attention(**host, backend="reference")[0]
    res = compare_float(to_numpy(got), np.asarray(want), dtype="bfloat16", name="attention_out")
    return f"{res.message} (vs reference on {n_batch} batches)"


def _bench_shape(name, args, peaks, configs, quick) -> list[dict]:
    from qsfa.kernels.qsfa_attention import KernelConfig, launch_qsfa_attention

    flops, nbytes, n_sel = _work(args)
    kw = {k: v for k, v in args.items() if k not in ("query", "key", "value", "sparse_indices", "scale_value")}
    rows = []
    best = None
    for cfg_t in configs:
        cfg = KernelConfig(*cfg_t[:5], two_pass=cfg_t[5])
        call = lambda: launch_qsfa_attention(args["query"], args["key"], args["sparse_indices"],  # noqa: E731
                                             args["scale_value"], config=cfg, **kw)
        try:
            med, spread = _time(call, warmup=2 if quick else 3, reps=3 if quick else 10)
        except Exception as e:  # a tiling that does not compile (shared memory, registers) on this device
            rows.append({"case": f"{name} {cfg}", "ours_s": None, "skipped": f"{type(e).__name__}: {e}"[:300]})
            continue
        tflops = flops / med / 1e12
        gbps = nbytes / med / 1e9
        r = {"case": f"{name} {cfg}", "ours_s": med, "spread_s": spread,
             "baseline_name": "same flops at the measured bf16 matmul peak",
             "baseline_s": flops / (peaks["matmul_tflops"] * 1e12), "tflops": tflops, "gbps": gbps,
             "fraction_of_matmul_peak": tflops / peaks["matmul_tflops"],
             "fraction_of_copy_bandwidth": gbps / peaks["copy_gbps"], "selected_tokens": n_sel,
             "flops": flops, "bytes": nbytes}
        r["ratio"] = r["ours_s"] / r["baseline_s"]
        r["notes"] = (f"{tflops:.1f} TFLOP/s = {100 * r['fraction_of_matmul_peak']:.1f}% of matmul peak; "
                      f"{gbps:.0f} GB/s = {100 * r['fraction_of_copy_bandwidth']:.1f}% of copy bandwidth")
        rows.append(r)
        if best is None or med < best[0]:
            best = (med, cfg, r)
    if best is not None:
        out = launch_qsfa_attention(args["query"], args["key"], args["sparse_indices"], args["scale_value"],
                                    config=best[1], **kw)[0]
        best[2]["check"] = _check_subset(args, out)
        best[2]["best"] = True
        best[2]["notes"] += "; BEST; " + best[2]["check"]
        if name.startswith("decode"):
            ok = best[2]["fraction_of_matmul_peak"] >= GOAL_FRACTION_OF_MATMUL_PEAK
            best[2]["notes"] += f"; goal >= {100 * GOAL_FRACTION_OF_MATMUL_PEAK:.0f}%: {'met' if ok else 'NOT met'}"
    return rows


#: split-KV settings timed against the unsplit kernel (``split_kv`` of launch_qsfa_attention)
SPLITS = ["auto", 128, 256, 512]


def _bench_split(name, args, peaks, quick) -> list[dict]:
    """The split-KV path (kernels/qsfa_split.py) at the default tiling against the unsplit kernel, same process:
    ratio = split time / unsplit time (< 1: the split helps), and the split output checked like the rest."""
    from qsfa.kernels.qsfa_attention import launch_qsfa_attention

    flops, nbytes, n_sel = _work(args)
    kw = {k: v for k, v in args.items() if k not in ("query", "key", "value", "sparse_indices", "scale_value")}

    def call(split):
        return launch_qsfa_attention(args["query"], args["key"], args["sparse_indices"], args["scale_value"],
                                     split_kv=split, **kw)

    reps = dict(warmup=2 if quick else 3, reps=3 if quick else 10)
    base, base_spread = _time(lambda: call("off"), **reps)
    rows = [{"case": f"{name} unsplit", "ours_s": base, "spread_s": base_spread,
             "tflops": flops / base / 1e12, "notes": f"{flops / base / 1e12:.1f} TFLOP/s (the split rows' baseline)"}]
    for split in SPLITS[:2] if quick else SPLITS:
        med, spread = _time(lambda: call(split), **reps)
        r = {"case": f"{name} split_kv={split}", "ours_s": med, "spread_s": spread, "baseline_name": "unsplit",
             "baseline_s": base, "ratio": med / base, "tflops": flops / med / 1e12,
             "fraction_of_matmul_peak": flops / med / 1e12 / peaks["matmul_tflops"], "selected_tokens": n_sel}
        r["check"] = _check_subset(args, call(split)[0])
        r["notes"] = (f"{r['tflops']:.1f} TFLOP/s; {med / base:.2f}x the unsplit time; {r['check']}")
        rows.append(r)
    return rows


def run(quick: bool = False) -> list[dict]:
    """Benchmark rows (see the module docstring); one ``skipped`` row when no CUDA device is usable."""
    why = _why_not()
    if why is not None:
        return [{"case": "triton QSFA decode / prefill", "ours_s": None, "skipped": why}]
    import torch

    peaks = measure_peaks(quick)
    dev = torch.cuda.get_device_name(0)
    rows = [{"case": f"peak on {dev}", "ours_s": None,
             "notes": f"bf16 matmul {peaks['matmul_tflops']:.1f} TFLOP/s (n={peaks['matmul_n']}); "
                      f"d2d copy {peaks['copy_gbps']:.0f} GB/s", **peaks}]
    configs = QUICK_CONFIGS if quick else CONFIGS
    decode = make_case(batch=8 if quick else 64, q_per_batch=1, q_n=128, sparse=2048, kv_len=4096)
    rows += _bench_shape("decode B=%d Q_N=128 sparse 2048" % (8 if quick else 64), decode, peaks, configs, quick)
    del decode
    torch.cuda.empty_cache()
    small = make_case(batch=2 if quick else 4, q_per_batch=1, q_n=128, sparse=2048, kv_len=4096, seed=2)
    rows += _bench_split("decode B=%d Q_N=128 sparse 2048" % (2 if quick else 4), small, peaks, quick)
    del small
    prefill = make_case(batch=2, q_per_batch=128 if quick else 1024, q_n=128, sparse=2048, kv_len=8192,
                        layout_query="TND", seed=1)
    rows += _bench_shape("prefill TND 2x%d Q_N=128 sparse 2048" % (128 if quick else 1024), prefill, peaks,
                         configs, quick)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes, two tilings")
    a = p.parse_args(argv)
    why = _why_not()
    if why is not None:
        print(f"triton_qsfa: skipped - {why}. Run it on a machine with a CUDA GPU (no GPU was used to write it).")
        return 0
    for r in run(quick=a.quick):
        t = f"{1e3 * r['ours_s']:.3f} ms" if r.get("ours_s") else "-"
        print(f"{r['case']}: {t}  {r.get('notes', r.get('skipped', ''))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
