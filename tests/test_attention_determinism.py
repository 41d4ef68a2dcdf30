"""The faithful attention and indexer oracles give the same bytes whatever summation order the machine's GEMM uses
(golden tensors must be byte-identical on every machine, issue 7).

The oracles do their float64 GEMMs through ``np.matmul`` (``qsfa.reference.attention._dot_f32``, also used by the
indexers) and certify every result against the any-order error bound, so any float64 GEMM must give the same
output bytes. Each variant injects another GEMM in process and runs the same decode-sized cases (Q_N 64, sparse
2048, bf16 and fp16; QSFA, SFA with sinks, the lightning indexer and its quantised form):

* ``reversed`` / ``permuted`` / ``blocked``: float64 sums over K in reversed order, in a random permutation of K,
  and in blocks of 7 whose partial sums are added last-to-first (three orders no BLAS kernel shares);
* ``torch``: torch's CPU GEMM (MKL / oneDNN), another library's kernels and blocking.

The outputs (attention out, softmax_max, softmax_sum, indices, indexer values) must equal the unpatched ones with
``==``, and each injected GEMM must actually have been called (an oracle that stopped using ``np.matmul`` fails
here instead of passing vacuously). No variant touches the BLAS configuration of the process (``OPENBLAS_*`` stays
as the machine set it: some machines need ``OPENBLAS_CORETYPE`` to run at all). A last variant runs the cases in a
child interpreter with ``NPY_DISABLE_CPU_FEATURES=X86_V3`` added to the unchanged environment (NumPy's pre-AVX2
loops: another float32 ``np.exp``).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
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


@functools.lru_cache(maxsize=1)
def cases():
    """name -> (function, kwargs): decode-sized, seeded (the same arrays in every interpreter).

    Drawn once per process (every variant runs the same cases) and read-only, so that no run can alter the next."""
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
    for _, kw in out.values():
        for v in kw.values():
            if isinstance(v, np.ndarray):
                v.flags.writeable = False
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
    return res


def _main(path):  # pragma: no cover - runs in the child interpreter
    np.savez(path, **{k.replace("/", "__"): v for k, v in run_all().items()})


def _features():
    from numpy._core._multiarray_umath import __cpu_features__

    return {k for k, v in __cpu_features__.items() if v}


@pytest.fixture(scope="module")
def here():
    return run_all()


# ---------------------------------------------------------------------------------------------------------------
# injected float64 GEMMs: a @ b over the last two axes, each summing over K in its own order


def _gemm(fn):
    """``np.matmul(a, b[, out=])`` computed by ``fn(a, b)`` for float64 matrices (anything else: NumPy's own)."""

    def matmul(a, b, *args, out=None, **kwargs):
        assert not args and not kwargs, "the injected GEMM supports matmul(a, b, out=None) only"
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != np.float64 or b.dtype != np.float64 or a.ndim < 2 or b.ndim < 2:
            return _REAL_MATMUL(a, b, out=out)
        r = fn(a, b)
        if out is None:
            return r
        out[...] = r
        return out

    return matmul


def _k_major(a, b):
    """``a`` transposed and ``b`` as contiguous copies (the oracles pass transposed views), so that each step of
    :func:`_sum_products` reads two contiguous rows: the same products in the same order, about 3x less CPU."""
    return np.ascontiguousarray(np.swapaxes(a, -1, -2)), np.ascontiguousarray(b)


def _sum_products(a_k, b_k, ks):
    """Adds the products ``a[..., m, k] * b[..., k, n]`` one k at a time, in the order of ``ks`` (operands from
    :func:`_k_major`)."""
    shape = np.broadcast_shapes(a_k.shape[:-2], b_k.shape[:-2]) + (a_k.shape[-1], b_k.shape[-1])
    acc = np.zeros(shape, np.float64)
    for k in ks:
        acc += a_k[..., k, :, None] * b_k[..., None, k, :]
    return acc


def _ordered(order):
    """Adds the K products ``a[..., m, k] * b[..., k, n]`` one k at a time in ``order(K)``."""
    return lambda a, b: _sum_products(*_k_major(a, b), order(a.shape[-1]))


def _blocked(a, b):
    """Blocks of 7 along K, each block summed in order, the block sums added from the last block to the first."""
    k = a.shape[-1]
    if k == 0:
        return _REAL_MATMUL(a, b)
    a_k, b_k = _k_major(a, b)
    acc = None
    for s in reversed(range(0, k, 7)):  # each block's sum as it is made: one block in memory, not K / 7
        p = _sum_products(a_k, b_k, range(s, min(s + 7, k)))
        acc = np.zeros_like(p) if acc is None else acc
        acc += p
    return acc


def _torch(a, b):
    import torch

    return torch.matmul(torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b))).numpy()


_REAL_MATMUL = np.matmul

GEMMS = {
    "reversed": _gemm(_ordered(lambda k: range(k - 1, -1, -1))),
    "permuted": _gemm(_ordered(lambda k: np.random.default_rng(k).permutation(k))),
    "blocked": _gemm(_blocked),
    "torch": _gemm(_torch),
}


@pytest.mark.parametrize("gemm", list(GEMMS))
def test_outputs_are_byte_identical_under_other_gemm_orders(gemm, here, monkeypatch):
    if gemm == "torch":
        pytest.importorskip("torch")
    calls = []

    def counted(a, b, *args, **kwargs):
        r = GEMMS[gemm](a, b, *args, **kwargs)
        if np.asarray(a).dtype == np.float64 and np.asarray(b).dtype == np.float64:
            calls.append(not np.array_equal(r, _REAL_MATMUL(a, b)))  # did this GEMM change any bit?
        return r

    monkeypatch.setattr(np, "matmul", counted)
    there = run_all()
    monkeypatch.undo()
    assert calls, ("the oracles no longer call np.matmul on float64 arrays: inject the GEMM where they compute their "
                   "float64 products")
    if gemm != "torch":  # (torch's kernel may happen to share this BLAS's order on a machine)
        assert any(calls), f"{gemm}: the injected GEMM gave np.matmul's exact bits on every call: the test is vacuous"
    assert sorted(there) == sorted(here)
    differ = [k for k in sorted(here) if not np.array_equal(here[k], there[k])]
    assert not differ, (f"{gemm}: outputs differ from the unpatched run: {differ} "
                        f"(sha1 here / there: {[(hashlib.sha1(here[k]).hexdigest()[:8], hashlib.sha1(there[k]).hexdigest()[:8]) for k in differ]})")


def test_injected_gemms_change_float64_bits():
    """The injected orders are really different: on wide-range data their float64 results differ from np.matmul's
    in the last bits (else the byte-identity test above would prove nothing)."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 16, 577)) * np.exp(rng.uniform(-8, 8, (3, 16, 577)))
    b = rng.standard_normal((3, 577, 24)) * np.exp(rng.uniform(-8, 8, (3, 577, 24)))
    ref = _REAL_MATMUL(a, b)
    for name, fn in GEMMS.items():
        if name == "torch" and importlib.util.find_spec("torch") is None:
            continue
        got = fn(a, b)
        np.testing.assert_allclose(got, ref, rtol=1e-9, atol=0)  # a float64 GEMM: the same up to rounding
        if name != "torch":  # torch may share the summation order with this NumPy's BLAS
            assert not np.array_equal(got, ref), f"{name}: the injected order gave np.matmul's exact bits"


def test_outputs_are_byte_identical_without_avx2_loops(here, tmp_path):
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if not (x86 and "X86_V3" in _features()):
        pytest.skip("this CPU / NumPy build has no X86_V3 dispatch group to disable")
    path = os.path.join(str(tmp_path), "out.npz")
    env = dict(os.environ)  # the machine's environment as it is (OPENBLAS_* included), one NumPy switch added
    prior = env.get("NPY_DISABLE_CPU_FEATURES", "")
    env["NPY_DISABLE_CPU_FEATURES"] = (prior + " X86_V3").strip()
    code = f"import sys; sys.path.insert(0, {HERE!r}); import test_attention_determinism as t; t._main({path!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(path) as z:
        there = {k.replace("__", "/"): z[k] for k in z.files}
    assert sorted(there) == sorted(here)
    differ = [k for k in sorted(here) if not np.array_equal(here[k], there[k])]
    assert not differ, f"NPY_DISABLE_CPU_FEATURES=X86_V3: outputs differ from the in-process run: {differ}"
