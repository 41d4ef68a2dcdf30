"""Byte check of the optimised oracles against hashes stored from the implementation before the speed work.

``benchmarks/bytecheck_hashes.json`` holds the SHA-256 of every output of the cases below as computed by commit
69d1248 (before issue 15's speed work; cases whose meaning a later issue changed on purpose are re-pinned from the
commit named in the file, which equals 69d1248 on every other case). The speed work may change how the values are computed, never which bytes
come out: ``python -m benchmarks.bytecheck`` recomputes every case and compares (exit status 1 on a mismatch);
``--write`` regenerates the file (only ever from a commit whose outputs are the accepted ones).

Cases: the decode case of benchmarks/attention.py (B=4, Q_N=128, 2048 of 8K tokens, int8 PA), a TND prefill
(256 query tokens), and smaller variants covering fp16 queries, FP8 / HiFloat8 codes, a 528-byte cache
(rope_head_dim 0), normalised probabilities, a wide dynamic range (certified and exactly summed fp32 values),
SFA with sinks, the three cache writers of benchmarks/cache_writers.py, and (``sharedkv-*``, pinned from 52fc9fe)
DeepSeek-V4 shared-KV attention through its four front doors.

    python -m benchmarks.bytecheck [--write] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import ml_dtypes
import numpy as np

import qsfa
from qsfa._values import as_dtype

from .attention import decode_case, prefill_case

BF16 = np.dtype(ml_dtypes.bfloat16)
HASHES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bytecheck_hashes.json")


def _variant(args, *, qdt=None, fmt=None, wide=False, rope0=False, seed=0):
    """A copy of a QSFA case with another query dtype, NoPE code format, value range or packed width."""
    rng = np.random.default_rng(seed)
    a = dict(args)
    q = a["query"].astype(np.float32)
    if wide:  # values spread over 2^-9 .. 2^4: many float64 sums are inexact, certification / exact paths run
        q = q * np.exp(rng.uniform(-6, 3, q.shape)).astype(np.float32)
    a["query"] = q.astype(qdt or a["query"].dtype)
    cache = a["key"].view(np.uint8).copy()
    if fmt == "float8_e4m3fn":
        cache[..., :512] = as_dtype(rng.standard_normal(cache[..., :512].shape) * 60, ml_dtypes.float8_e4m3fn).view(
            np.uint8)
    elif fmt == "hifloat8":
        codes = rng.integers(0, 256, cache[..., :512].shape, dtype=np.uint8)
        codes[(codes == 0x80) | (codes == 0x6F) | (codes == 0xEF)] = 0  # keep clear of NaN / inf encodings
        cache[..., :512] = codes
    if qdt is not None and np.dtype(qdt) != BF16:
        cache[..., 512:640] = as_dtype(rng.standard_normal(cache.shape[:-1] + (64,)) * 0.5, qdt).view(np.uint8)
    if rope0:
        cache = np.concatenate([cache[..., :512], cache[..., 640:656]], axis=-1)
        a["query"] = a["query"][..., :512]
        a["rope_head_dim"] = 0
    if fmt is not None:
        a["key_dtype"] = fmt
    view = ml_dtypes.float8_e4m3fn if fmt == "float8_e4m3fn" else (np.uint8 if fmt == "hifloat8" else np.int8)
    a["key"] = a["value"] = cache.view(view)
    return a


def _padded(args, huge=False):
    """Rows with unselected entries: -1 padding, indices past the KV length, and (huge) rows whose selected scores
    overflow to -inf, so the masked tokens' -2e38 is the row max."""
    a = dict(args)
    idx = a["sparse_indices"].copy()
    w = idx.shape[-1]
    idx[0, ..., w // 3:] = -1
    idx[1, ..., : w // 2] = int(a["actual_seq_lengths_kv"][1]) + np.arange(w // 2)  # past the KV: unselected
    a["sparse_indices"] = idx
    if huge:  # non-negative codes and positive scales: q . k overflows to -inf for every selected token
        q = a["query"].astype(np.float32)
        q[0, 0, :4, :512] = -3e38
        a["query"] = q.astype(a["query"].dtype)
        cache = a["key"].view(np.int8).copy()
        cache[..., :512] = np.abs(cache[..., :512])
        a["key"] = a["value"] = cache
    return a


def _sfa_case(seed=3, batch=2, heads=16, kv=2048, sparse=512):
    rng = np.random.default_rng(seed)
    k = as_dtype(rng.standard_normal((batch, kv, 1, 512)) * 0.5, BF16)
    kr = as_dtype(rng.standard_normal((batch, kv, 1, 64)) * 0.5, BF16)
    q = as_dtype(rng.standard_normal((batch, 1, heads, 512)) * np.exp(rng.uniform(-3, 2, (batch, 1, heads, 512))), BF16)
    qr = as_dtype(rng.standard_normal((batch, 1, heads, 64)) * 0.5, BF16)
    idx = np.stack([rng.permutation(kv)[:sparse] for _ in range(batch)]).astype(np.int32).reshape(batch, 1, 1, sparse)
    return dict(query=q, key=k, value=None, sparse_indices=idx, scale_value=576 ** -0.5, query_rope=qr, key_rope=kr,
                sinks=rng.standard_normal(heads).astype(np.float32), actual_seq_lengths_kv=np.full(batch, kv, np.int32),
                return_softmax_lse=True, layout_query="BSND", layout_kv="BSND")


def cases():
    """name -> zero-argument callable returning a tuple of arrays (deterministic inputs)."""
    qs = qsfa.kv_quant_sparse_flash_attention
    dec = decode_case(np.random.default_rng(0))
    small = decode_case(np.random.default_rng(1), batch=2, kv_len=4096, sparse=2048, heads=16)
    pre = prefill_case(np.random.default_rng(2), q_tokens=256, sparse=512, heads=32)
    lse = dict(return_softmax_lse=True)
    out = {
        "qsfa-decode": lambda: qs(**dec, **lse),
        "qsfa-prefill-tnd": lambda: qs(**pre, **lse),
        "qsfa-fp16-fp8-normalised": lambda: qs(**_variant(small, qdt=np.float16, fmt="float8_e4m3fn"), **lse,
                                               probability_rounding="normalised"),
        "qsfa-hifloat8": lambda: qs(**_variant(small, fmt="hifloat8", seed=4), **lse),
        "qsfa-wide-bf16": lambda: qs(**_variant(small, wide=True, seed=5), **lse),
        "qsfa-wide-fp16": lambda: qs(**_variant(small, qdt=np.float16, wide=True, seed=6), **lse),
        "qsfa-rope0": lambda: qs(**_variant(small, rope0=True, seed=7), **lse),
        "qsfa-prefill-wide": lambda: qs(**_variant(pre, wide=True, seed=8), **lse),
        "sfa-sinks": lambda: qsfa.sparse_flash_attention(**_sfa_case()),
        "qsfa-padded": lambda: qs(**_padded(small), **lse),
        "qsfa-prefill-causal": lambda: qs(**prefill_case(np.random.default_rng(9), q_tokens=96, sparse=256, heads=16,
                                                         cached=192), **lse),
        "qsfa-masked-max": lambda: qs(**_padded(small, huge=True), **lse),
    }
    out.update(writer_cases())
    out.update(sharedkv_cases())
    return out


def sharedkv_cases():
    """DeepSeek-V4 shared-KV attention through its four front doors (issue 24's speed work; pinned from 52fc9fe,
    before it): SWA / CSA / HCA, BSND / TND / PA, bf16 / fp16, the A3 (S2 tile 512) and 950 (tile 128) numerics,
    rows that select fewer tokens than others, and a wide value range (certified and exactly summed fp32 values)."""
    from qsfa.ops.sharedkv import kqs_case, mq_case, sas_case, sfm_case

    def wide(a, seed):
        rng = np.random.default_rng(seed)
        q = a["q"].astype(np.float32)
        a["q"] = (q * np.exp(rng.uniform(-8, 4, q.shape)).astype(np.float32)).astype(a["q"].dtype)
        return a

    v4 = {
        "sfm-csa-a3": (qsfa.sparse_flash_mla, lambda: sfm_case(scenario="CSA", batch=2, s1=3, s2=1300, n1=16,
                                                                k=1024, seed=30), "A3"),
        "sfm-csa-950-tnd-fp16": (qsfa.sparse_flash_mla, lambda: sfm_case(
            scenario="CSA", layout_q="TND", layout_kv="TND", qdtype="float16", batch=2, s1=4, s2=900, n1=8,
            k=512, seed=31), "950"),
        "sfm-hca-a3-pa": (qsfa.sparse_flash_mla, lambda: sfm_case(scenario="HCA", layout_kv="PA_BBND", batch=2,
                                                                   s1=2, s2=5000, n1=16, block_size=64, seed=32), "A3"),
        "sfm-swa-950-wide": (qsfa.sparse_flash_mla, lambda: wide(sfm_case(scenario="SWA", batch=2, s1=5, s2=700,
                                                                          n1=8, seed=33), 34), "950"),
        "sfm-csa-a3-wide": (qsfa.sparse_flash_mla, lambda: wide(sfm_case(scenario="CSA", batch=1, s1=6, s2=2600,
                                                                         n1=8, k=512, seed=35), 36), "A3"),
        "sas-csa": (qsfa.sparse_attn_sharedkv, lambda: sas_case(scenario="CSA", batch=1, s1=2, s2=2100, k=512,
                                                                 block_size=128, seed=37), "A3"),
        "mq-hca-950": (qsfa.mixed_quant_sparse_flash_mla, lambda: mq_case(scenario="HCA", batch=1, s1=2, s2=2048,
                                                                           n1=64, block_size=64, seed=38), "950"),
        "kqs-csa-950": (qsfa.kv_quant_sparse_attn_sharedkv, lambda: kqs_case(scenario="CSA", batch=1, s1=2, s2=1024,
                                                                              n1=64, k=512, block_size=64, seed=39),
                        "950"),
    }
    return {f"sharedkv-{name}": (lambda fn=fn, mk=mk, chip=chip: fn(
        **{**mk(), "return_softmax_lse": fn is qsfa.sparse_flash_mla}, chip=chip))
            for name, (fn, mk, chip) in v4.items()}


def _writer_inputs(seed, t=1024, dtype=BF16, specials=True):
    rng = np.random.default_rng(seed)
    x = as_dtype(rng.standard_normal((t, 576)) * np.exp(rng.uniform(-4, 4, (t, 1))), dtype)
    x[5, :128] = 0  # an all-zero tile
    if specials:
        x[7, 3], x[9, 130], x[11, 300] = np.inf, -np.inf, np.nan  # specials: excluded from amax, saturated / zeroed
    slots = rng.permutation(t + 256)[:t].astype(np.int64)
    slots[::13] = -1
    return rng, x, slots


def writer_cases():
    """The C8 writers (finite inputs, zero tiles) and dynamic_block_quant (with +-inf and nan)."""
    out = {}
    for fmt in ("int8", "float8_e4m3fn"):
        for order in ("divide", "multiply", "reciprocal"):
            def c8(fmt=fmt, order=order):
                _, x, slots = _writer_inputs(10, specials=False)
                cache = np.full(((1024 + 256) // 128, 128, 1, 656), 17, np.uint8)
                return (qsfa.c8_cache_write(x[:, :512], x[:, 512:], slots, cache, key_dtype=fmt, scale_order=order),)
            out[f"c8_cache_write-{fmt}-{order}"] = c8
    for rope in (64, 0):
        for dt in (BF16, np.dtype(np.float16)):
            def c8r(rope=rope, dt=dt):
                rng, x, slots = _writer_inputs(11, dtype=dt, specials=False)
                gamma = as_dtype(1 + 0.1 * rng.standard_normal(512), dt)
                ang = rng.uniform(0, 6.3, (x.shape[0], 64))
                cos, sin = as_dtype(np.cos(ang), dt), as_dtype(np.sin(ang), dt)
                cache = np.full(((1024 + 256) // 128, 128, 1, 528 + 2 * rope), 17, np.uint8)
                return (qsfa.c8_rmsnorm_rope_cache(x[:, :512 + rope], gamma, cos if rope else None,
                                                   sin if rope else None, slots, cache, rope_head_dim=rope),)
            out[f"c8_rmsnorm_rope_cache-rope{rope}-{np.dtype(dt).name}"] = c8r
    hif8 = dict(dst_type="hifloat8", round_mode="round")
    dbq = [dict(), dict(dst_type="float8_e4m3fn"), dict(dst_type="float8_e5m2"), hif8, dict(hif8, dst_type_max=224.0),
           dict(row_block_size=2, col_block_size=64), dict(row_block_size=3, col_block_size=100, min_scale=0.5),
           dict(scale_order="multiply"), dict(dst_type="float8_e4m3fn", min_scale=1e-3)]
    for i, kw in enumerate(dbq):
        for shape in ((1024, 576), (4, 255, 576)):
            def q(kw=kw, shape=shape, i=i):
                _, x, _ = _writer_inputs(20 + i)
                x = x.reshape(-1)[:int(np.prod(shape))].reshape(shape)
                if kw.get("dst_type") in ("float8_e5m2", "hifloat8") or kw.get("scale_order") == "multiply":
                    x = np.nan_to_num(x.astype(np.float32), posinf=1.0, neginf=-1.0, nan=0.0).astype(x.dtype)
                return qsfa.dynamic_block_quant(x, **kw)
            out[f"dynamic_block_quant-{i}-{len(shape)}d"] = q
        for shape in ((1024, 512), (4, 256, 512)):  # blocks that tile x exactly (the fast path), finite and not
            for finite in (True, False):
                def qt(kw=kw, shape=shape, i=i, finite=finite):
                    _, x, _ = _writer_inputs(40 + i, specials=not finite)
                    x = x[:, :512].reshape(shape)
                    if not finite and (kw.get("dst_type") in ("float8_e5m2", "hifloat8")
                                       or kw.get("scale_order") == "multiply"):
                        return ()
                    x.reshape(-1, 512)[17, 128:256] = -0.0  # a negative-zero block
                    return qsfa.dynamic_block_quant(x, **kw)
                out[f"dynamic_block_quant-{i}-tiled-{len(shape)}d-{'finite' if finite else 'specials'}"] = qt
    return out


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.view(np.uint8).reshape(-1).tobytes())
    return h.hexdigest()


def check(names=None) -> dict:
    """name -> (expected, actual) for every case (names: a subset)."""
    with open(HASHES) as f:
        want = json.load(f)["hashes"]
    res = {}
    for name, fn in cases().items():
        if names and name not in names:
            continue
        res[name] = (want.get(name), digest(fn()))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="store this checkout's hashes (pre-change commit only)")
    p.add_argument("--made-from", default="?", help="with --write: the commit the hashes come from")
    p.add_argument("--only", nargs="+")
    a = p.parse_args(argv)
    if a.write:
        hashes = {name: digest(fn()) for name, fn in cases().items()}
        with open(HASHES, "w") as f:
            json.dump({"made_from": a.made_from, "hashes": hashes}, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {len(hashes)} hashes to {HASHES}")
        return 0
    bad = 0
    for name, (want, got) in check(a.only).items():
        ok = want == got
        bad += not ok
        print(f"{'ok  ' if ok else 'DIFF'} {name}" + ("" if ok else f" (stored {want}, now {got})"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
