"""RMSNorm and interleave RoPE in float32, with the kernels' operation order (docs/numerics/cache-writers.md#rmsnorm-and-rope).

Both follow the Ascend kernels of KvRmsNormRopeCache (cannmirror/ops-transformer posembedding/kv_rms_norm_rope_cache/op_kernel,
``RmsNormWithQuant`` / ``RopeBasicComputeVF``): every step is one float32 operation, nothing is fused.

RMSNorm over the last axis (length n)::

    ss   = sum(x * x)                 squares in fp32; the sum is taken exactly (float64) and rounded
                                      once to fp32 - a kernel sums in its own tree order, so the last
                                      bit of ``ss`` can differ there (the only non-reproducible step)
    ms   = ss * fp32(1 / n)           the kernel multiplies by the tiling's fp32 reciprocal
    rms  = sqrt(ms + fp32(eps))       fp32 add, fp32 sqrt (correctly rounded)
    y    = gamma * (x / rms)          fp32 divide, then fp32 multiply

Interleave RoPE (``x1 = x[..., 0::2]``, ``x2 = x[..., 1::2]``, output in half-split order)::

    out = cat(x1, x2) * cos + cat(-x2, x1) * sin     two fp32 products, one fp32 add (no FMA)

Rounding to the model dtype (bf16 / fp16, round half to even) is left to the caller: the writers say
where it happens.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["rms_norm_f32", "interleave_rope_f32", "round_to_dtype", "MODEL_DTYPES"]

MODEL_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


#: rows per block of :func:`rms_norm_f32` (its float32 / float64 temporaries stay in cache)
_ROW_BLOCK = 256


def rms_norm_f32(x: np.ndarray, gamma: np.ndarray, epsilon: float, *, halves_first: bool = False) -> np.ndarray:
    """RMSNorm of the last axis of ``x`` in float32 (see the module docstring); returns float32.

    ``halves_first``: the squares of the two halves of the row are first added element by element in fp32
    (``sq[:n/2] + sq[n/2:]``, the 950 register kernels' ``Add`` before their ``Reduce``), and ``ss`` is the
    correctly rounded sum of those n/2 fp32 values. Computed in blocks of rows (every row's arithmetic, including
    its float64 sum, is independent of the blocking), so the temporaries stay in cache."""
    x = np.asarray(x)
    g = np.asarray(gamma).astype(np.float32)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = np.empty(x2.shape, np.float32)
    inv_n, eps = np.float32(1.0 / n), np.float32(epsilon)
    for a in range(0, x2.shape[0], _ROW_BLOCK):
        xf = out[a:a + _ROW_BLOCK]
        np.copyto(xf, x2[a:a + _ROW_BLOCK], casting="unsafe")  # exact widening of the 16-bit (or fp32) x
        sq = xf * xf  # fp32 products
        if halves_first:
            sq = sq[:, :n // 2] + sq[:, n // 2:]  # fp32 adds (exact float64 sum of these below)
        ss = sq.astype(np.float64).sum(axis=-1, keepdims=True).astype(np.float32)
        rms = np.sqrt(ss * inv_n + eps)  # fp32 multiply, add, sqrt
        np.divide(xf, rms, out=xf)
        np.multiply(g, xf, out=xf)
    return out.reshape(x.shape)


def interleave_rope_f32(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleave RoPE of the last axis of ``x`` in float32; ``cos``/``sin`` broadcast against ``x``.

    Returns float32 in half-split order: ``out[..., :d/2]`` rotates the even elements, ``out[..., d/2:]``
    the odd ones.
    """
    xf = np.asarray(x).astype(np.float32, copy=False)
    c = np.asarray(cos).astype(np.float32, copy=False)
    s = np.asarray(sin).astype(np.float32, copy=False)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    part1 = np.concatenate([x1, x2], axis=-1)
    part2 = np.concatenate([-x2, x1], axis=-1)
    if np.broadcast_shapes(part1.shape, c.shape, s.shape) != part1.shape:  # tables larger than x
        return (part1 * c) + (part2 * s)
    np.multiply(part1, c, out=part1)  # fp32 products, then one fp32 add
    np.multiply(part2, s, out=part2)
    return np.add(part1, part2, out=part1)


def round_to_dtype(x: np.ndarray, dtype) -> np.ndarray:
    """Round float32 ``x`` to a 16-bit model dtype (name or dtype) with round-half-to-even."""
    dt = MODEL_DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    return np.asarray(x, dtype=np.float32).astype(dt)
