"""The faithful attention and indexer oracles give the same bytes whatever BLAS kernel, thread count or NumPy SIMD
dispatch the machine picks (golden tensors must be byte-identical on every machine, issue 7).

Each variant runs the same decode-sized cases (Q_N 64, sparse 2048, bf16 and fp16; QSFA, SFA with sinks, the
lightning indexer and its quantised form) in a fresh interpreter whose environment changes how NumPy computes:

* ``OPENBLAS_CORETYPE=Prescott``: OpenBLAS's SSE3 kernels instead of the one picked for this CPU (another
  summation order, no FMA; checked to change fp32 sgemm bits, else the variant is skipped as vacuous);
* ``OPENBLAS_NUM_THREADS=1`` and ``=2``: another split of the work;
* ``NPY_DISABLE_CPU_FEATURES=X86_V3``: NumPy's pre-AVX2 loops (changes float32 ``np.exp``).

and the output bytes (attention out, softmax_max, softmax_sum, indices, indexer values) must equal the in-process
ones with ``==``. Runs only on x86-64 NumPy builds linked to OpenBLAS for the BLAS variants (skipped otherwise,
with the reason); the SIMD variant needs the X86_V3 feature group.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import qsfa

BF16 = np.dtype(ml_dtypes.bfloat16)
HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 128


def _packed_cache(rng, n_tokens, qdt, fmt):
    rows = np.empty((n_tokens, 656), np.uint8)
    if fmt == "int8":
        rows[:, :512] = rng.integers(-127, 128, (n_tokens, 512), dtype=np.int8).view(np.uint8)
    else:
        rows[:, :512] = (rng.standard_normal((n_tokens, 512)) * 60).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    rows[:, 512:640] = (rng.standard_normal((n_tokens, 64)) * 0.5).astype(qdt).view(np.uint8)
    rows[:, 640:656] = rng.uniform(0.002, 0.02, (n_tokens, 4)).astype("<f4").view(np.uint8)
    return rows.reshape(n_tokens // BLOCK, BLOCK, 1, 656)


def cases():
    """name -> (function, kwargs): decode-sized, seeded (the same arrays in every interpreter)."""
    rng = np.random.default_rng(20240607)
    batch, heads, kv, sparse = 2, 64, 4096, 2048
    out = {}
    for qdt, fmt, rounding in ((BF16, "int8", "unnormalised"), (np.dtype(np.float16), "float8_e4m3fn", "normalised")):
        name = np.dtype(qdt).name
        cache = _packed_cache(rng, batch * kv, qdt, fmt)
        table = rng.permutation(batch * kv // BLOCK).reshape(batch, -1).astype(np.int32)
        # wide dynamic range: many fp32 accumulations are inexact whatever the order
        q = (rng.standard_normal((batch, 1, heads, 576)) * np.exp(rng.uniform(-3, 2, (batch, 1, heads, 576))))
        idx = np.stack([rng.permutation(kv)[:sparse] for _ in range(batch)]).astype(np.int32)
        key = cache.view(np.int8) if fmt == "int8" else cache.view(ml_dtypes.float8_e4m3fn)
        out[f"qsfa-{name}"] = (qsfa.kv_quant_sparse_flash_attention, dict(
            query=q.astype(qdt), key=key, value=key, sparse_indices=idx.reshape(batch, 1, 1, sparse),
            scale_value=576 ** -0.5, block_table=table, actual_seq_lengths_query=np.ones(batch, np.int32),
            actual_seq_lengths_kv=np.full(batch, kv, np.int32), layout_query="BSND", layout_kv="PA_BSND",
            key_dtype=fmt, return_softmax_lse=True, probability_rounding=rounding))
        k = (rng.standard_normal((batch, kv, 1, 512)) * np.exp(rng.uniform(-2, 1, (batch, kv, 1, 512)))).astype(qdt)
        out[f"sfa-sinks-{name}"] = (qsfa.sparse_flash_attention, dict(
            query=q[..., :512].astype(qdt), key=k, value=None, sparse_indices=idx.reshape(batch, 1, 1, sparse),
            scale_value=512 ** -0.5, query_rope=q[..., 512:].astype(qdt),
            key_rope=(rng.standard_normal((batch, kv, 1, 64))).astype(qdt),
            actual_seq_lengths_query=np.ones(batch, np.int32), actual_seq_lengths_kv=np.full(batch, kv, np.int32),
            sinks=rng.uniform(-2, 6, heads).astype(np.float32), lse_includes_sink=True, return_softmax_lse=True))
        iq = (rng.standard_normal((batch, 1, heads, 128)) * np.exp(rng.uniform(-2, 1, (batch, 1, heads, 128))))
        ik = (rng.standard_normal((batch, kv, 1, 128)) * np.exp(rng.uniform(-2, 1, (batch, kv, 1, 128))))
        # near-twin keys (pairs differing only where every query is tiny): their scores lie a few fp32 ulps
        # apart, so an fp32 accumulation order that rounds differently swaps them in the top-k
        ik[:, 1::2] = ik[:, 0::2]
        ik[:, 1::2, 0, 0] *= 1 + rng.uniform(-1, 1, (batch, kv // 2))
        iq[..., 0] = rng.standard_normal(iq.shape[:-1]) * 2.0 ** -16
        out[f"indexer-{name}"] = (qsfa.lightning_indexer, dict(
            query=iq.astype(qdt), key=ik.astype(qdt), weights=rng.uniform(-1, 1, (batch, 1, heads)).astype(qdt),
            actual_seq_lengths_key=np.full(batch, kv, np.int32), sparse_count=sparse, return_value=True))
    out["quant-indexer-int8"] = (qsfa.quant_lightning_indexer, dict(
        query=rng.integers(-127, 128, (batch, 1, heads, 128)).astype(np.int8),
        key=rng.integers(-127, 128, (batch, kv, 1, 128)).astype(np.int8),
        weights=rng.uniform(-1, 1, (batch, 1, heads)).astype(np.float16),
        query_dequant_scale=rng.uniform(0.001, 0.01, (batch, 1, heads)).astype(np.float16),
        key_dequant_scale=rng.uniform(0.001, 0.01, (batch, kv, 1)).astype(np.float16),
        query_quant_mode=0, key_quant_mode=0, actual_seq_lengths_key=np.full(batch, kv, np.int32),
        sparse_count=sparse))
    return out


def run_all() -> dict:
    """Every case's outputs (as NumPy arrays, uint8 views of the bytes), keyed '<case>/<i>'."""
    res = {}
    for name, (fn, kw) in cases().items():
        outs = fn(**kw)
        outs = outs if isinstance(outs, tuple) else (outs,)
        for i, a in enumerate(outs):
            a = np.ascontiguousarray(a)
            res[f"{name}/{i}"] = a.view(np.uint8).reshape(-1) if a.size else np.zeros(0, np.uint8)
    rng = np.random.default_rng(1)  # fingerprint of this interpreter's fp32 sgemm (is the variant effective?)
    a, b = rng.standard_normal((64, 577), dtype=np.float32), rng.standard_normal((577, 96), dtype=np.float32)
    res["sgemm-fingerprint"] = (a @ b).view(np.uint8).reshape(-1)
    return res


def _main(path):  # pragma: no cover - runs in the child interpreter
    np.savez(path, **{k.replace("/", "__"): v for k, v in run_all().items()})


def _uses_openblas() -> bool:
    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"]
        return "openblas" in str(blas.get("name", "")).lower()
    except (AttributeError, KeyError, TypeError):
        return False


def _features():
    from numpy._core._multiarray_umath import __cpu_features__

    return {k for k, v in __cpu_features__.items() if v}


def _child(env_extra, tmp_path):
    path = os.path.join(tmp_path, "out.npz")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "NPY_DISABLE", "OMP_"))}
    env.update(env_extra)
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_attention_determinism as t; t._main({path!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(path) as z:
        return {k.replace("__", "/"): z[k] for k in z.files}


@pytest.fixture(scope="module")
def here():
    return run_all()


VARIANTS = {
    "openblas-prescott": {"OPENBLAS_CORETYPE": "Prescott"},
    "openblas-1-thread": {"OPENBLAS_NUM_THREADS": "1"},
    "openblas-2-threads": {"OPENBLAS_NUM_THREADS": "2"},
    "numpy-no-avx2": {"NPY_DISABLE_CPU_FEATURES": "X86_V3"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_outputs_are_byte_identical_across_blas_and_simd(variant, here, tmp_path):
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if variant.startswith("openblas") and not (_uses_openblas() and x86):
        pytest.skip("numpy's BLAS is not OpenBLAS on x86-64 (np.__config__): the OpenBLAS variants do not apply")
    if variant == "numpy-no-avx2" and not (x86 and "X86_V3" in _features()):
        pytest.skip("this CPU / NumPy build has no X86_V3 dispatch group to disable")
    there = _child(VARIANTS[variant], str(tmp_path))
    assert sorted(there) == sorted(here)
    if variant == "openblas-prescott" and np.array_equal(there["sgemm-fingerprint"], here["sgemm-fingerprint"]):
        pytest.skip("OPENBLAS_CORETYPE=Prescott did not change sgemm's bits on this build: the variant proves nothing")
    differ = [k for k in sorted(here) if k != "sgemm-fingerprint" and not np.array_equal(here[k], there[k])]
    assert not differ, (f"{variant}: outputs differ from the in-process run: {differ} "
                        f"(sha1 here / there: {[(hashlib.sha1(here[k]).hexdigest()[:8], hashlib.sha1(there[k]).hexdigest()[:8]) for k in differ]})")
