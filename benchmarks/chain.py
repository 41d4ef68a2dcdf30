"""The layer-chain golden (qsfa.chain ``v32-mla-c8``) link by link against each link's float64 GEMM floor.

Case: a DeepSeek-V3.2 MLA decode step, B = 4 requests with a 64K-token context each (65535 cached + 1 new),
128 query heads, 64 indexer heads, top-2048, int8 C8 cache (A3), bf16. The inputs (the caches holding the
history) are made once by the chain's generator, untimed; then each link is timed alone on the tensors the
reference chain gives it (``qsfa.chain.run_link``: the copy of its in-place cache included), and the whole chain
end to end (``qsfa.chain.run_chain``).

Baselines, measured in this process on operands of the link's shapes:

* ``indexer``: the float64 GEMM of its scores, ``[B, N1, 128] @ [B, 128, S_kv]``;
* ``attention``: the two float64 GEMMs of sparse attention, ``[B, Q_N, 576] @ [B, 576, K]`` and
  ``[B, Q_N, K] @ [B, K, 512]``;
* ``cache`` / ``index_cache`` (writers, no GEMM): copying the bytes they write into a cache of the same size.

    python -m benchmarks.chain [--quick] [--kv N]
"""

from __future__ import annotations

import argparse

import numpy as np

from ._harness import row, timeit

NAME = "chain"


def _case(quick: bool, kv: int | None):
    kv = kv or (2048 if quick else 65536)
    heads, n1 = (16, 8) if quick else (128, 64)
    return {"q_lens": [1] * 4, "kv_lens": [kv] * 4, "key_dtype": "int8", "sparse_count": 256 if quick else 2048,
            "scale_value": 576 ** -0.5, "return_softmax_lse": True, "heads": heads, "n1": n1, "block_size": 128,
            "chip": "A3"}


def run(quick: bool = False, kv: int | None = None) -> list[dict]:
    from qsfa import chain as C
    from qsfa.golden.generators import get_generator

    p = _case(quick, kv)
    ch = C.get_chain("v32-mla-c8", p, ignore_unknown=True)
    x = get_generator("v32-mla-c8")(p, np.random.default_rng(0))
    tensors = C.run_chain(ch, x, chip="A3")
    b, kvn, k, heads, n1 = len(p["kv_lens"]), p["kv_lens"][0], p["sparse_count"], p["heads"], p["n1"]
    rng = np.random.default_rng(1)

    def g(*s):
        return rng.standard_normal(s)

    floors = {
        "indexer": (f"float64 GEMM [{b},{n1},128]@[{b},128,{kvn}]", (lambda a=g(b, n1, 128), c=g(b, 128, kvn): a @ c)),
        "attention": (f"float64 GEMMs [{b},{heads},576]@[{b},576,{k}], [{b},{heads},{k}]@[{b},{k},512]",
                      (lambda q=g(b, heads, 576), kk=g(b, 576, k), pp=g(b, heads, k), v=g(b, k, 512):
                       (q @ kk, pp @ v))),
    }
    for name, out in (("cache", "kv_cache"), ("index_cache", "cache")):
        src = tensors[f"{name}.{out}"]
        dst = np.empty_like(src)
        floors[name] = (f"copy of the {dst.nbytes / 2**20:.0f} MiB cache", (lambda d=dst, s=src: np.copyto(d, s)))
    repeat = 1 if quick else 3
    rows = []
    for lk in ch.links:
        ours = timeit(lambda lk=lk: C.run_link(lk, tensors, chip="A3"), warmup=0 if quick else 1, repeat=repeat)
        base_name, base = floors[lk.name]
        rows.append(row(NAME, f"v32 decode B={b} ctx={kvn} {lk.name} ({lk.op})", ours, baseline_name=base_name,
                        baseline=timeit(base, warmup=1, repeat=repeat)))
    whole = timeit(lambda: C.run_chain(ch, x, chip="A3"), warmup=0 if quick else 1, repeat=repeat)
    rows.append(row(NAME, f"v32 decode B={b} ctx={kvn} whole chain", whole,
                    notes="every link, with the copies of the in-place caches"))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kv", type=int, help="tokens per request after the step (default 65536; --quick 2048)")
    a = ap.parse_args(argv)
    for r in run(a.quick, a.kv):
        base = f"{r.get('baseline_name')}: {r['baseline_s']:.4f} s, ratio {r['ratio']:.2f}" if "ratio" in r else ""
        print(f"{r['case']:70s} {r['ours_s']:.4f} s  {base}")


if __name__ == "__main__":
    main()
