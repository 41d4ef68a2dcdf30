"""Bulk array contents of the strategies in :mod:`qsfa.strategies` (typical values; the boundary values are
:mod:`qsfa._edges`): NumPy only, driven by a generator the strategy seeds from a drawn integer."""

from __future__ import annotations

import functools
import math

import numpy as np

from ._arrays import is_ml_dtype


def as_dtype(x, dtype) -> np.ndarray:
    """Random float64 values ``x`` as ``dtype``, the same bytes with every ml_dtypes version: ml_dtypes 0.7 casts
    float64 to its types (bfloat16, the FP8s) with one rounding, older versions rounded to float32 first (two
    roundings), so a direct cast gives other inputs, and other hashes and examples, depending on the installed
    version. float64 goes to float32 first for ml_dtypes' types; NumPy's own float16 cast (always one rounding)
    is left as it is."""
    x = np.asarray(x)
    dt = np.dtype(dtype)
    if x.dtype == np.float64 and is_ml_dtype(dt):
        x = x.astype(np.float32)
    return x.astype(dt)


def _format_values(rng, fmt: str, n: int, *, specials: bool) -> np.ndarray:
    """float64 values that stress ``fmt``'s rounding: representable values, midpoints (ties), their float32
    neighbours, random values over the whole range (sub-normal to beyond max), zeros and (optionally)
    +-inf / nan."""
    from .reference import formats as F

    rep = F.representable_values(fmt)
    mid = F.midpoints(fmt)
    kind = rng.integers(0, 6, n)
    out = np.empty(n, np.float64)
    out[kind == 0] = rng.choice(rep, int((kind == 0).sum()))
    out[kind == 1] = rng.choice(mid, int((kind == 1).sum()))
    m2 = rng.choice(mid, int((kind == 2).sum())).astype(np.float32)
    out[kind == 2] = np.nextafter(m2, np.where(rng.random(m2.size) < 0.5, np.inf, -np.inf).astype(np.float32))
    top = math.log2(F.max_finite(fmt)) + 1.5
    low = math.log2(float(rep[rep > 0].min())) - 2
    e = rng.uniform(low, top, int((kind == 3).sum()))
    out[kind == 3] = np.exp2(e) * np.where(rng.random(e.size) < 0.5, -1, 1)
    out[kind == 4] = rng.standard_normal(int((kind == 4).sum())) * 4
    out[kind == 5] = 0.0
    if fmt == "float8_e8m0":
        out = np.abs(out)
    if specials:
        sp = rng.random(n) < 0.05
        out[sp] = rng.choice(np.array([np.inf, -np.inf, np.nan]), int(sp.sum()))
        if fmt == "float8_e8m0":
            out[sp & (out < 0)] = np.inf
    return out

def _group_values(rng, shape, *, zero_fraction=0.1, dtype=np.float32) -> np.ndarray:
    """Normal values whose magnitude varies over several decades along the last axis groups of 16, with
    some all-zero stretches (exercises per-tile amax and all-zero tiles)."""
    x = rng.standard_normal(shape)
    n = shape[-1]
    g = -(-n // 16)
    mag = 10.0 ** rng.uniform(-3, 2, shape[:-1] + (g,))
    mag[rng.random(mag.shape) < zero_fraction] = 0.0
    x = x * np.repeat(mag, 16, axis=-1)[..., :n]
    return x.astype(dtype)

@functools.lru_cache(maxsize=None)
def _nope_code_table(fmt: str, max_abs: float) -> np.ndarray:
    """Finite codes of ``fmt`` whose value is at most ``max_abs`` in magnitude (uint8, read-only: cached)."""
    from .reference import formats as F

    v = F.decode(np.arange(256, dtype=np.uint8), fmt).astype(np.float64)
    ok = np.isfinite(v) & (np.abs(v) <= max_abs)
    out = np.nonzero(ok)[0].astype(np.uint8)
    out.setflags(write=False)
    return out

def _nope_codes(rng, shape, fmt: str) -> tuple[np.ndarray, float]:
    """uint8 NoPE codes of ``fmt``, uniform over its finite codes of magnitude at most 16 (int8: over -127..127),
    and the tile-scale magnitude that keeps dequantised K around +-4.

    Drawn from full-range random bytes / 16-bit words, which NumPy draws without a rejection loop (issue 15:
    the codes are the largest array of a QSFA example): int8 takes the bytes as they are and draws again the
    few that are -128; a format with k codes maps a 16-bit word u to ``(u * k) >> 16`` and draws again the few
    words whose low half ``(u * k) & 0xFFFF`` is below ``65536 % k`` (Lemire's method: exactly uniform)."""
    n = int(np.prod(shape))
    if fmt == "int8":
        c = rng.integers(0, 256, n, dtype=np.uint8)
        bad = np.flatnonzero(c == 0x80)
        while bad.size:
            c[bad] = rng.integers(0, 256, bad.size, dtype=np.uint8)
            bad = bad[c[bad] == 0x80]
        return c.reshape(shape), 4.0 / 127
    table = _nope_code_table(fmt, 16.0)
    k = table.size
    m = rng.integers(0, 1 << 16, n, dtype=np.uint16).astype(np.uint32) * np.uint32(k)
    bad = np.flatnonzero((m & np.uint32(0xFFFF)) < np.uint32((1 << 16) % k))
    while bad.size:
        m[bad] = rng.integers(0, 1 << 16, bad.size, dtype=np.uint16).astype(np.uint32) * np.uint32(k)
        bad = bad[(m[bad] & np.uint32(0xFFFF)) < np.uint32((1 << 16) % k)]
    return table.take((m >> np.uint32(16)).astype(np.uint8)).reshape(shape), 0.25


def _exact_codes(rng, shape, fmt: str) -> np.ndarray:
    """uint8 codes of ``fmt`` whose values are integers in [-4, 4]."""
    if fmt == "int8":
        return rng.integers(-4, 5, shape).astype(np.int8).view(np.uint8)
    from .reference import formats as F

    v = F.decode(np.arange(256, dtype=np.uint8), fmt).astype(np.float64)
    ok = np.isfinite(v) & (np.abs(v) <= 4) & (np.round(v) == v)
    return rng.choice(np.nonzero(ok)[0].astype(np.uint8), shape)
