"""Faithful DeepSeek-V4 shared-KV decode against the float64 two-GEMM floor on the same selected tokens (issue 24).

Cases (production decode shapes): B = 4 sequences of one query token each, 64 and 128 query heads, head dim 512,
bf16, a 64K-token context (``ori_kv`` BSND). CSA: a 128-token sliding window (``ori_win_left`` 127) plus the top-1024
of the ``cmp_ratio`` 4 compressed cache (16K tokens; distinct random indices below the causal bound); HCA: the same
window plus every token of the ``cmp_ratio`` 128 compressed cache (512 tokens). Sinks on, A2/A3 numerics (S2 tile
512, P ROUND, output bf16 RINT).

* ``faithful``: :func:`qsfa.reference.sharedkv.sharedkv_attention` (``precision="faithful"``, the byte-exact
  golden; the public front door adds its argument checks, a full scan of the 64K-token caches, reported apart);
* ``float64 floor``: the two float64 GEMMs per sequence on the same selected tokens, preallocated:
  ``[N, 512] @ [512, W]`` and ``[N, W] @ [W, 512]`` with W = 128 + 1024 (CSA) or 128 + 512 (HCA) - what the oracle
  cannot avoid (its fp32 results are correctly rounded values of exact float64 sums).

Everything runs in this process with BLAS pinned to one thread (threadpoolctl), in interleaved rounds (one run of
each per round), medians reported. Goal: faithful at most 2x the floor.

    python -m benchmarks.sharedkv_decode [--quick] [--rounds N] [--clock wall|cpu]

``--quick``: 16 heads, a 4K context (CI keeps the script from rotting; no figure asserted).
"""

from __future__ import annotations

import argparse
import os
import time

import ml_dtypes
import numpy as np

from qsfa.reference.sharedkv import sharedkv_attention

from ._harness import at_least, row
from .decode_floor import blas_info, measure

BF16 = np.dtype(ml_dtypes.bfloat16)
D = 512
WINDOW = 128


def _bf16(rng, shape, scale=1.0):
    """Normal bf16 values, generated in float32 slices (a 64K context is 256 MiB of bf16)."""
    out = np.empty(shape, BF16)
    flat = out.reshape(-1, shape[-1])
    for a in range(0, flat.shape[0], 1 << 16):
        flat[a:a + (1 << 16)] = (rng.standard_normal((min(1 << 16, flat.shape[0] - a), shape[-1]), np.float32)
                                 * np.float32(scale)).astype(BF16)
    return out


def decode_case(scenario: str, *, heads: int, batch: int = 4, context: int = 65536, topk: int = 1024, seed: int = 0):
    """Arguments of :func:`sharedkv_attention` for one decode step (``scenario`` "CSA" or "HCA") and the selected
    token count per sequence."""
    rng = np.random.default_rng(seed)
    ratio = 4 if scenario == "CSA" else 128
    s3 = context // ratio
    q = _bf16(rng, (batch, 1, heads, D), 0.5)
    ori = _bf16(rng, (batch, context, 1, D))
    cmp = _bf16(rng, (batch, s3, 1, D))
    args = dict(q=q, ori_kv=ori, cmp_kv=cmp, cmp_sparse_indices=None, cmp_residual_kv=np.zeros(batch, np.int32),
                sinks=rng.uniform(-1, 1, heads).astype(np.float32), softmax_scale=D ** -0.5, cmp_ratio=ratio,
                ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=WINDOW - 1, ori_win_right=0, layout_q="BSND",
                layout_kv="BSND", precision="faithful", s2_tile=512, p_rounding="round", out_rounding="rint")
    n_cmp = s3
    if scenario == "CSA":
        n_cmp = min(topk, s3)
        idx = np.stack([rng.permutation(s3)[:n_cmp] for _ in range(batch)]).astype(np.int32)
        args["cmp_sparse_indices"] = idx.reshape(batch, 1, 1, n_cmp)
    return args, min(WINDOW, context) + n_cmp


def floor(batch, heads, width):
    """The two float64 GEMMs per sequence on preallocated operands."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((batch, heads, D))
    k = rng.standard_normal((batch, width, D))
    p = rng.standard_normal((batch, heads, width))
    s_out = np.empty((batch, heads, width))
    o_out = np.empty((batch, heads, D))

    def run():
        np.matmul(q, k.transpose(0, 2, 1), out=s_out)
        np.matmul(p, k, out=o_out)

    return run


def run(quick: bool = False, rounds: int | None = None, clock: str = "wall") -> list[dict]:
    from threadpoolctl import threadpool_limits

    rounds = rounds or (2 if quick else 7)
    heads_list = (16,) if quick else (64, 128)
    context = 4096 if quick else 65536
    rows = []
    with threadpool_limits(limits=1):
        info = blas_info()
        for scenario in ("CSA", "HCA"):
            for heads in heads_list:
                args, width = decode_case(scenario, heads=heads, context=context)
                fns = {"faithful": lambda a=args: sharedkv_attention(**a),
                       "float64 floor": floor(args["q"].shape[0], heads, width)}
                load0 = os.getloadavg()[0]
                t = measure(fns, rounds, time.thread_time if clock == "cpu" else time.perf_counter)
                note = (f"B=4 N={heads} {scenario} window {WINDOW} + {width - WINDOW} compressed "
                        f"(cmp_ratio {args['cmp_ratio']}, context {context}); 1 thread; {info}; "
                        f"load {load0:.2f}->{os.getloadavg()[0]:.2f}; {rounds} interleaved rounds, {clock} clock")
                rows.append(row("sharedkv_decode", f"{scenario} N={heads} faithful vs float64 floor", t["faithful"],
                                baseline_name="2 float64 GEMMs per sequence", baseline=t["float64 floor"],
                                goal="ratio <= 2", notes=note))
                del args, fns
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=at_least(1), help="interleaved rounds (default 7, --quick 2)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: CPU time of this thread (time.thread_time)")
    a = p.parse_args(argv)
    rows = run(quick=a.quick, rounds=a.rounds, clock=a.clock)
    print(rows[0]["notes"].split("; ", 1)[1])
    for r in rows:
        print(f"{r['case']:36s} ours {r['ours_s'] * 1e3:8.2f} ms  {r['baseline_name']}: "
              f"{r['baseline_s'] * 1e3:8.2f} ms  ratio {r['ratio']:.2f}  (goal {r['goal']})")


if __name__ == "__main__":
    main()
