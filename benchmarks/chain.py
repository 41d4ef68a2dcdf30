"""The layer-chain goldens (``v32-mla-c8``, V4 ``v4-csa`` / ``v4-hca``) link by link vs each link's float64 GEMM floor.

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

V4 layer chains (qsfa.chain_v4, the 950 FP8 path: vllm_compressor, kv_compress_epilog_vllm caches,
indexer_compress_epilog_v2, vllm_quant_lightning_indexer, kv_quant_sparse_attn_sharedkv): a decode step, B = 4
requests with a 64K-token context each, 64 query heads, ``v4-csa`` (cmp_ratio 4, the indexer's top-1024 plus the
128-token window) and ``v4-hca`` (cmp_ratio 128, every compressed token plus the window). Baselines per link:

* ``compressor`` (``vllm_compressor``, as vLLM-Ascend calls it): the float64 GEMM of its two projections,
  ``[B, 1024] @ [1024, 2 * coff * 512]`` (coff 2 on CSA, 1 on HCA; the chain's hidden size is 1024; the RMSNorm and
  RoPE of its rows add no GEMM); ``index_compressor`` (CSA, the C4Li call): ``[B, 1024] @ [1024, 512]``;
* ``indexer``: the float64 GEMM of its scores over the compressed keys, ``[B, 64, 128] @ [B, 128, S_kv / 4]``;
* ``attention``: the two float64 GEMMs over the tokens one row attends, ``[B, 64, 512] @ [B, 512, K]`` and
  ``[B, 64, K] @ [B, K, 512]``, K = 128 + 1024 (CSA) or 128 + S_kv / 128 (HCA);
* the cache writers: copying the bytes of the cache they write.

    python -m benchmarks.chain [--quick] [--kv N] [--only v32|v4]
"""

from __future__ import annotations

import argparse

import numpy as np

from ._harness import at_least, row, timeit

NAME = "chain"


def _case(quick: bool, kv: int | None):
    kv = kv or (2048 if quick else 65536)
    heads, n1 = (16, 8) if quick else (128, 64)
    return {"q_lens": [1] * 4, "kv_lens": [kv] * 4, "key_dtype": "int8", "sparse_count": 256 if quick else 2048,
            "scale_value": 576 ** -0.5, "return_softmax_lse": True, "heads": heads, "n1": n1, "block_size": 128,
            "chip": "A3"}


def run(quick: bool = False, kv: int | None = None, only: str | None = None) -> list[dict]:
    """The v32-mla-c8 rows, then the V4 rows (:func:`run_v4`); ``only``: "v32" or "v4"."""
    return (run_v32(quick, kv) if only != "v4" else []) + (run_v4(quick, kv) if only != "v32" else [])


def run_v32(quick: bool = False, kv: int | None = None) -> list[dict]:
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


def _copy_floor(tensors, key):
    src = tensors[key]
    dst = np.empty_like(src)
    return f"copy of the {dst.nbytes / 2**20:.1f} MiB cache", (lambda d=dst, s=src: np.copyto(d, s))


def run_v4(quick: bool = False, kv: int | None = None) -> list[dict]:
    """The V4 layer chains v4-csa (top-1024) and v4-hca, 950 FP8 path, decode, B = 4 (module docstring)."""
    from qsfa import chain as C
    from qsfa import chain_v4 as V
    from qsfa.golden.generators import get_generator

    kvn = kv or (512 if quick else 65536)
    b, heads, repeat = (2 if quick else 4), 64, (1 if quick else 3)  # --quick: only keeps the script from rotting
    rng = np.random.default_rng(1)

    def g(*s):
        return rng.standard_normal(s)

    rows = []
    for kind, topk in (("csa", 1024), ("hca", None)):
        p = {"q_lens": [1] * b, "kv_lens": [kvn] * b, "path": "fp8", "chip": "950", "block_size": 128}
        if topk:
            p["sparse_count"] = topk
        ch = C.get_chain(f"v4-{kind}", p, ignore_unknown=True)
        x = get_generator(f"v4-{kind}")(p, np.random.default_rng(0))
        tensors = C.run_chain(ch, x, chip="950")
        k = 128 + (topk if topk else kvn // 128)
        cd = 2 * V.CMP_SCENARIOS[kind][1] * 512  # wkv and wgate stacked
        icd = 2 * V.C4LI[1] * V.C4LI[2]
        floors = {
            "compressor": (f"float64 GEMM [{b},{V.HIDDEN}]@[{V.HIDDEN},{cd}]",
                           (lambda a=g(b, V.HIDDEN), w=g(V.HIDDEN, cd): a @ w)),
            "index_compressor": (f"float64 GEMM [{b},{V.HIDDEN}]@[{V.HIDDEN},{icd}]",  # the C4Li link (CSA)
                                 (lambda a=g(b, V.HIDDEN), w=g(V.HIDDEN, icd): a @ w)),
            "indexer": (f"float64 GEMM [{b},64,128]@[{b},128,{kvn // 4}]",
                        (lambda a=g(b, 64, 128), c=g(b, 128, kvn // 4): a @ c)),
            "attention": (f"float64 GEMMs [{b},{heads},512]@[{b},512,{k}], [{b},{heads},{k}]@[{b},{k},512]",
                          (lambda q=g(b, heads, 512), kk=g(b, 512, k), pp=g(b, heads, k), v=g(b, k, 512):
                           (q @ kk, pp @ v))),
        }
        for lk in ch.links:
            if lk.name not in floors:
                out = next(t for t in tensors if t.startswith(lk.name + "."))
                floors[lk.name] = _copy_floor(tensors, out)
        for lk in ch.links:
            ours = timeit(lambda lk=lk: C.run_link(lk, tensors, chip="950"), warmup=0 if quick else 1, repeat=repeat)
            base_name, base = floors[lk.name]
            rows.append(row(NAME, f"v4-{kind} 950 decode B={b} ctx={kvn} {lk.name} ({lk.op})", ours,
                            baseline_name=base_name, baseline=timeit(base, warmup=1, repeat=repeat)))
        whole = timeit(lambda: C.run_chain(ch, x, chip="950"), warmup=0 if quick else 1, repeat=repeat)
        rows.append(row(NAME, f"v4-{kind} 950 decode B={b} ctx={kvn} whole chain", whole,
                        notes="every link, with the copies of the in-place caches"))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kv", type=at_least(1),
                    help="tokens per request after the step (default 65536; --quick 2048, V4 512 with B = 2)")
    ap.add_argument("--only", choices=("v32", "v4"), help="only the V3.2 chain or only the V4 chains")
    a = ap.parse_args(argv)
    for r in run(a.quick, a.kv, a.only):
        base = f"{r.get('baseline_name')}: {r['baseline_s']:.4f} s, ratio {r['ratio']:.2f}" if "ratio" in r else ""
        print(f"{r['case']:70s} {r['ours_s']:.4f} s  {base}")


if __name__ == "__main__":
    main()
