"""Sparse flash attention oracles: QSFA (packed quantised KV) and SFA (float KV). docs/numerics/attention.md#kv_quant_sparse_flash_attention.

Both compute, for every query row and query head,

    out = softmax(scale_value * q . K_sel^T) @ V_sel

over the tokens ``K_sel`` that the row's ``sparse_indices`` select (token-selection rules in
:mod:`qsfa.reference.attn_layout`), plus the softmax statistics ``softmax_max`` (row max of the scaled
scores) and ``softmax_sum`` (``sum exp(s - max)``, unnormalised).

Precision modes
---------------
``precision="faithful"`` (default) rounds where the Ascend kernel rounds. Every fp32 accumulation (the dot
products ``q . k`` and ``P @ V``, the softmax sum) and every fp32 ``exp`` / ``log`` is modelled as the correctly
rounded fp32 value of the exact result (``RN32``: round to nearest, ties to even; an exact zero sum is +0) - a kernel
that accumulates in fp32 in any order lands within a few fp32 ulps of it, well inside docs/numerics/comparison.md#float-criterion - so the
result is a function of the inputs alone: the same bytes on every machine, whatever BLAS kernel, thread split or
NumPy SIMD variant computes the float64 intermediates (tests/test_attention_determinism.py; how, below).

1. QSFA: ``K_nope = decode(code) * tile_scale`` (one fp32 multiply), rounded to the query dtype with
   ``k_rounding`` (A2/A3: bf16 RINT, fp16 ROUND = half away from zero; 950: RINT for both). The RoPE part is taken as stored. The
   query dtype value V is the same rounded NoPE (MLA-absorb). SFA: K and V are already in the query dtype.
2. ``s = RN32(q . k) * fp32(scale_value)`` (an fp32 multiply): the kernel's cube unit accumulates exact 16x16-bit
   products in fp32 in its own order. Tokens that are not selected get ``-2e38`` (not ``-inf``), as in the
   kernel; their probability underflows to exactly 0.
3. ``m = max(s)``; ``e = RN32(exp(s - m))`` with ``s - m`` an fp32 subtraction; ``l = RN32(sum e)``.
4. Probabilities are rounded to the query dtype with ``p_rounding`` (every chip: ROUND) before ``P @ V``
   (``RN32`` of the exact sum). Where exactly is
   **OPEN** and is the parameter ``probability_rounding``:

   * ``"unnormalised"`` (default): ``P = round(e)``, ``o = RN32(P @ V) / l`` (fp32 divide). This is what the kernels do
     (vllm-ascend csrc/attention/kv_quant_sparse_flash_attention/op_kernel/arch35/
     kv_quant_sparse_flash_attention_service_vector_mla.h: the softmax stage casts ``exp(s - max)`` to
     the query dtype for the second matmul and the final stage divides by the fp32 sum; the rope0 test
     module there names "the known normalized-probability versus unnormalized-exp rounding difference").
     With it, uniform attention gives exactly the mean of the selected V.
   * ``"normalised"``: ``P = round(e / l)`` (fp32 divide), ``o = RN32(P @ V)`` - the vLLM-Ascend test golden
     (tests/e2e/nightly/single_node/ops/singlecard_ops/test_kv_quant_sparse_flash_attention.py:
     ``torch.softmax`` in fp32, then ``probs.to(bfloat16)`` before the PV matmul).

   The kernel's online softmax rescales per 128-token tile with a running max; that tiling is not
   modelled (it is tiling-dependent), so a correct kernel matches within tolerance, not bit for bit.
5. ``out = round(o)`` to the query dtype with ``out_rounding`` (A2/A3: bf16 RINT, fp16 ROUND; 950: ROUND).

The three modes are parameters; without them the oracle uses the A2/A3 kernels' (:data:`DEFAULT_ROUNDING`). The
public operators pass the modes of the chip a call models (``chip=``; qsfa.chips, docs/numerics/chips.md).

SFA sinks (fp32 steps): ``lse = m + RN32(ln l)``, ``out /= 1 + RN32(exp(sink - lse))`` and, when the LSE includes
the sink, ``l += RN32(exp(sink - m))``.

How the values are made exact. Products of two 16-bit floats (or one-byte codes) are exact in float64, so each dot
product is a sum of exact terms, which BLAS sums in float64 in some order. The oracle bounds, per row of q (or P)
and per token (or column of V), the 2-norm (P @ V: the row's 1-norm and the column's largest entry) and the
exponent ``lq`` of the lowest set bit of the values (from the 16-bit exponent fields and, for QSFA, the tile
scales): where ``norm_i * norm_j <= 2^(lq_i + lq_j + 53)`` no partial sum in any order can round, the float64 sum
is exact and one cast gives RN32 (bf16 data: nearly every pair). The other pairs, the softmax sum, exp and log are
certified: if both ends of ``approx -+ bound`` (float64 summation in any order errs by at most
``4 n 2^-53 sum |terms|``; glibc's and NumPy's float64 exp / log by under 1 ulp, bounded by 2^-48 relative) round
to the same fp32 bits, those are RN32 of the exact value. The rest - an exact fp32 tie, a value within the bound of
a rounding boundary, a handful of the 2^31 fp32 exp arguments - are evaluated exactly: an error-free TwoSum tree,
then ``math.fsum``; exp / log in 60-digit :mod:`decimal`. Assumed: IEEE float64 and a BLAS whose dot products are
sums of the products (every BLAS in use; no Strassen-like schemes).

A row that selects no token (causal threshold <= 0, first index -1, every index past the threshold,
or a BSND padding row past ``actQ``) gets ``out = 0`` and ``softmax_max = softmax_sum = 0`` (the
kernel zeroes such rows; vllm-ascend ZeroInvalidAttnOut / ZeroInvalidLse).

``precision="exact"``: float64 end to end with no intermediate rounding - K dequantised exactly
(``decode(code) * scale`` is exact in float64), ``scale_value`` as the given Python float, exact
softmax, no probability or output rounding. The attention output and the LSE outputs are float64 (their last
bits follow the machine's float64 BLAS and exp; they are a reference for tolerances, not golden bytes).

``precision="benchmark"``: a stated third-party computation for the dual-benchmark acceptance standards
(docs/numerics/comparison.md#standards): the faithful path's query-dtype Q / K / V, fp32 GEMM scores, fp32
softmax, P rounded to the query dtype (RINT) before an fp32 ``P @ V`` GEMM (FlashMLA's GPU order), the output
rounded RINT to the query dtype, LSE outputs fp32 (:func:`_benchmark_chunk`).

rope_head_dim = 0 (QSFA): the kernel "skips reading the RoPE input and zero-fills the internal RoPE
region" (seed 000); the reference does the same (an internal 576-wide K with zero RoPE), so a 528-byte
cache gives bit-identical results to the same data zero-padded to 656 bytes.

Memory: the work is done in chunks of query rows; ``chunk_size`` bounds both the number of
``query row x head`` pairs (``chunk_size / 2``: score matrices) and the gathered KV tokens per chunk
(``8 * chunk_size``), both held in float64, so peak working memory is independent of the number of query
tokens (K: ``chunk_size * 8 * 4.6 KB``, 75 MB at the default 2048 for 576-wide K; measured prefill peak with 128
heads about 120 MiB besides the outputs, benchmarks/attention.py); results do not depend on ``chunk_size``
(every row is reduced over its full index width).
Per chunk the selected packed rows are gathered once and dequantised (decode), or - when the chunk's rows
share most cache rows (prefill) - each distinct cache row is dequantised once and the float rows gathered;
unselected positions are zeroed, so nothing a row did not select is ever read into a result. The largest float64
arrays live in per-thread buffers reused across calls (:mod:`qsfa.reference._workspace`); chunks run on
``qsfa.set_num_threads(n)`` threads (:mod:`qsfa.reference.parallel`), each with its own working set; ``attention_out``
(a caller's C-contiguous buffer, e.g. an ``np.memmap``) receives the output chunk by chunk.
"""

from __future__ import annotations

import contextlib
import contextvars
import decimal
import math

import ml_dtypes
import numpy as np

from ._decode_blocks import qsfa_keys, softmax_rows
from ._workspace import scratch
from .attn_layout import flat_rows, kv_map, query_rows, row_limits, selected_tokens
from .parallel import get_num_threads, run_chunks, workset_bytes_per_thread

__all__ = [
    "kv_quant_sparse_flash_attention",
    "sparse_flash_attention",
    "attention",
    "attention_error_budget",
    "round_to_query_dtype",
    "decode_nope",
    "NOPE_DIM",
    "TILE",
    "MASK_VALUE",
]

NOPE_DIM = 512
TILE = 128
ROPE_DIM = 64
MASK_VALUE = np.float32(-2e38)
_QDT = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
#: rounding of fp32 values to the query dtype at the K and output rounding points of the A2/A3 kernels
QUERY_ROUNDING = {"bfloat16": "rint", "float16": "round"}
#: the modes the oracle uses when none is passed: the A2/A3 kernels' (docs/numerics/chips.md#attention;
#: qsfa.chips.ATTENTION_ROUNDING holds every chip's, the front doors pass the chip's modes)
DEFAULT_ROUNDING = {"k": dict(QUERY_ROUNDING), "p": {"bfloat16": "round", "float16": "round"},
                    "out": dict(QUERY_ROUNDING)}
ROUNDINGS = ("rint", "round")
PROBABILITY_ROUNDINGS = ("unnormalised", "normalised")
#: significand bits of the query dtypes; their smallest subnormal
_PRECISION = {"bfloat16": 8, "float16": 11}
_TINY = {"bfloat16": 2.0 ** -133, "float16": 2.0 ** -24}
PRECISIONS = ("faithful", "exact", "benchmark")


def _qdt_name(a: np.ndarray) -> str:
    dt = np.dtype(a.dtype)
    if dt == _QDT["bfloat16"]:
        return "bfloat16"
    if dt == _QDT["float16"]:
        return "float16"
    raise TypeError(f"query dtype must be float16 or bfloat16, got {dt}")


def round_to_query_dtype(x: np.ndarray, qdtype: str, mode: str | None = None) -> np.ndarray:
    """fp32 ``x`` rounded to ``qdtype`` with ``mode`` ("rint": half to even, "round": half away from zero;
    None: :data:`QUERY_ROUNDING`, bf16 RINT and fp16 ROUND), returned as float32.

    RINT is NumPy's / ml_dtypes' cast; ROUND is :func:`_fp16_round_away` / :func:`_bf16_round_away`. All four
    are checked against ``formats.round_to`` in tests/test_attention_precision.py and tests/test_chips.py.
    """
    return round_q16(x, qdtype, mode).astype(np.float32)


def round_q16(x: np.ndarray, qdtype: str, mode: str | None = None) -> np.ndarray:
    """fp32 ``x`` rounded to ``qdtype`` with ``mode`` (see :func:`round_to_query_dtype`), as a ``qdtype`` array."""
    mode = mode or QUERY_ROUNDING[qdtype]
    assert mode in ROUNDINGS, mode
    if mode == "rint":
        with np.errstate(over="ignore"):
            return np.asarray(x, np.float32).astype(_QDT[qdtype])
    return _bf16_round_away(x) if qdtype == "bfloat16" else _fp16_round_away(x)


def _bf16_round_away(x: np.ndarray) -> np.ndarray:
    """fp32 -> bfloat16 with ties away from zero (ROUND): bf16 is the top half of the fp32 bits, so adding half
    a bf16 ulp (0x8000) to the sign-magnitude bits and truncating rounds the magnitude half up (overflow gives
    +-inf); NaNs keep NumPy's cast."""
    x = np.ascontiguousarray(x, np.float32)
    y = ((x.view(np.uint32) + np.uint32(0x8000)) >> np.uint32(16)).astype(np.uint16).view(_QDT["bfloat16"])
    nan = np.isnan(x)
    if nan.any():
        y[nan] = x[nan].astype(_QDT["bfloat16"])
    return y


def _fp16_round_away(x: np.ndarray) -> np.ndarray:
    """fp32 -> float16 with ties away from zero (ROUND): NumPy's RNE cast, then the ties it sent towards
    zero moved one step away. Equal to ``formats.round_to(x, "float16", rounding="round")`` on every fp16
    midpoint and random inputs (tests/test_attention_precision.py), at the speed of the cast."""
    x = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float16)
        y32 = y.astype(np.float32)
        ax, ay = np.abs(x), np.abs(y32)
        tie = (ay < ax) & ((ax - ay) * 2 == np.spacing(np.abs(y)).astype(np.float32))
    if tie.any():
        y[tie] = np.nextafter(y[tie], np.copysign(np.float16(np.inf), y[tie]))
    return y


def _to_query_dtype(x: np.ndarray, qdtype: str) -> np.ndarray:
    """fp32 values already representable in ``qdtype`` -> an array of that dtype (exact cast)."""
    return x.astype(_QDT[qdtype])


_LUT_CACHE: dict = {}


def decode_nope(codes: np.ndarray, fmt: str, dtype=np.float32) -> np.ndarray:
    """Decode one-byte NoPE codes (uint8 view) of format ``fmt`` to ``dtype`` (exact in fp32).

    int8 and FP8 E4M3FN use a direct cast (exact); HiFloat8 uses a 256-entry table built from
    ``formats.decode``. All three agree with ``formats.decode`` on every code (tested)."""
    if fmt == "int8":
        return codes.view(np.int8).astype(dtype)
    if fmt == "float8_e4m3fn":
        return codes.view(ml_dtypes.float8_e4m3fn).astype(dtype)
    lut = _LUT_CACHE.get((fmt, np.dtype(dtype)))
    if lut is None:
        from . import formats

        lut = np.asarray(formats.decode(np.arange(256, dtype=np.uint8), fmt), dtype=np.float32).astype(dtype)
        _LUT_CACHE[(fmt, np.dtype(dtype))] = lut
    return lut[codes]


def decode_nope_into(out: np.ndarray, codes: np.ndarray, fmt: str) -> None:
    """``out[...] = decode_nope(codes, fmt)`` without a temporary for int8 / FP8 (``codes`` any uint8 view)."""
    if fmt == "int8":
        np.copyto(out, codes.view(np.int8), casting="unsafe")
    elif fmt == "float8_e4m3fn":
        np.copyto(out, codes.view(ml_dtypes.float8_e4m3fn), casting="unsafe")
    else:
        out[...] = decode_nope(codes, fmt, out.dtype)


def round_to_query_dtype_inplace(x: np.ndarray, qdtype: str, mode: str | None = None) -> None:
    """``x[...] = round_to_query_dtype(x, qdtype, mode)`` (fp32 ``x``, any strides)."""
    x[...] = round_q16(x, qdtype, mode)


# ----------------------------------------------------------------------------------------------------
# fp32 results as correctly rounded values: the same bits whatever order, BLAS kernel or SIMD variant computed
# the float64 approximation


_U64 = 2.0 ** -53  # float64 unit roundoff
#: relative margin around NumPy's float64 exp / log (glibc and NumPy's AVX512F kernels stay below 1 ulp = 2^-52)
_TRANSCENDENTAL_MARGIN = 2.0 ** -48


def sum_error_bound(n_terms: int, abs_total):
    """Bound of ``|float64 sum - exact sum|`` for ``n_terms`` exact float64 terms summed in any order, with or
    without FMA (any BLAS kernel, any thread split), given ``abs_total >= sum |term|``: ``4 n 2^-53 abs_total``,
    twice the classical ``gamma_{n-1} abs_total`` (the factor 2 covers the rounding of ``abs_total`` itself and of
    ``approx -+ bound`` in :func:`certified_f32`)."""
    return (4.0 * max(int(n_terms), 1) * _U64) * abs_total


def certified_f32(approx, bound, exact, *, relative=False, out=None):
    """fp32 round-to-nearest-even ``RN32(x)`` of real values ``x`` known through float64 ``approx``.

    ``|approx - x| <= bound`` (an array broadcastable to approx, or with ``relative=True`` a float: the bound is
    ``bound * |approx|`` for ``approx >= 0``); a non-zero bound must be at least ``2^-52 |approx|`` and ``bound = 0``
    means approx is x. Where ``fp32(approx - bound)`` and ``fp32(approx + bound)`` have the same bits, rounding is
    monotonic so RN32(x) is those bits, whatever the approximation was. Elsewhere (x closer than ``bound`` to an
    fp32 rounding boundary or to zero: a fraction of about ``bound / ulp32`` of the elements)
    ``exact(flat_indices) -> float32`` supplies the values. Returns a new float32 array of approx's shape, or
    ``out`` (a C-contiguous float32 array of that shape; its work array is then a kept scratch buffer too).
    """
    lo = np.empty(approx.shape, np.float32) if out is None else out
    hi = np.empty(approx.shape, np.float32) if out is None else scratch("certified_f32_hi", approx.shape, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if relative:
            np.multiply(approx, 1.0 - bound, out=lo, casting="same_kind")
            np.multiply(approx, 1.0 + bound, out=hi, casting="same_kind")
        else:
            np.subtract(approx, bound, out=lo, casting="same_kind")
            np.add(approx, bound, out=hi, casting="same_kind")
    bad = lo.view(np.int32) != hi.view(np.int32)
    if bad.any():
        idx = np.flatnonzero(bad)
        lo.reshape(-1)[idx] = exact(idx)
    return lo


def exact_sum_f32(terms: np.ndarray) -> np.ndarray:
    """RN32 of the exact sum of each row of ``terms`` (float64 ``[M, n]``, every term an exact value, e.g. a
    product of two 16-bit floats); a sum that is exactly zero gives +0 (an accumulator that starts at +0).

    An error-free pairwise tree (TwoSum at every node) turns each row into ``s + sum(errors)`` exactly; their
    float64 sum is certified with its ~``n^2 2^-106 sum|terms|`` error bound. Rows still undecided (an exact
    fp32 tie, or cancellation below that bound) are summed exactly by ``math.fsum``.
    """
    t = np.asarray(terms, np.float64)
    m = t.shape[0]
    if m == 0:
        return np.zeros(0, np.float32)
    s, errs = t, []
    while s.shape[1] > 1:
        if s.shape[1] % 2:
            s = np.concatenate([s, np.zeros((m, 1))], axis=1)
        a, b = s[:, 0::2], s[:, 1::2]
        x = a + b
        z = x - a
        errs.append((a - (x - z)) + (b - z))  # TwoSum: a + b == x + err exactly
        s = x
    e = np.concatenate(errs, axis=1) if errs else np.zeros((m, 1))
    approx = s[:, 0] + e.sum(axis=1)
    bound = sum_error_bound(e.shape[1] + 2, np.abs(e).sum(axis=1) + np.abs(approx))
    bound[np.abs(e).max(axis=1) == 0] = 0.0  # no rounding anywhere: s[:, 0] is the exact sum, approx == s
    return certified_f32(approx, bound, lambda idx: np.array([_fsum_f32(t[i]) for i in idx], np.float32))


def _fsum_f32(row: np.ndarray) -> np.float32:
    """RN32 of the exact sum of one row (math.fsum is RN64 of it; only an fp32 midpoint can round twice wrongly,
    the sign of the exact remainder decides it)."""
    terms = row.tolist()
    s = math.fsum(terms)
    if s == 0:
        return np.float32(0.0)
    with np.errstate(over="ignore"):
        f = np.float32(s)
    if not np.isfinite(f) or float(f) == s:
        return f
    other = np.nextafter(f, np.float32(np.inf) if s > float(f) else np.float32(-np.inf))
    if (float(f) + float(other)) / 2 != s:
        return f
    rest = math.fsum(terms + [-s])
    if rest == 0:
        return f  # a true tie: the cast rounded it to even
    return max(f, other) if rest > 0 else min(f, other)


def _nearest_f32(d: decimal.Decimal) -> np.float32:
    """RN32 of a (non-tie) decimal value, by exact comparison with the fp32 neighbours of its float rounding."""
    top = decimal.Decimal(float(np.finfo(np.float32).max)) + decimal.Decimal(2.0 ** 103)
    if abs(d) >= top:
        return np.float32(np.copysign(np.inf, float(d)))
    c = np.float32(float(d))
    cands = [c, np.nextafter(c, np.float32(-np.inf)), np.nextafter(c, np.float32(np.inf))]
    return min((x for x in cands if np.isfinite(x)), key=lambda x: abs(decimal.Decimal(float(x)) - d))


def _decimal_f32(x: np.ndarray, fn: str) -> np.ndarray:
    """RN32 of exp / ln of the fp32 values ``x`` (few of them) from 60-digit :mod:`decimal` arithmetic."""
    xs, inv = np.unique(np.asarray(x, np.float32), return_inverse=True)
    res = np.empty(xs.size, np.float32)
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        for i, v in enumerate(xs.tolist()):
            res[i] = _nearest_f32(getattr(decimal.Decimal(v), fn)())
    return res[inv.reshape(-1)]


def exp_f32(x: np.ndarray, out64: np.ndarray | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """RN32(e^x) of float32 ``x``: float64 exp rounded once, certified with a 2^-48 relative margin (NumPy's
    float32 exp has CPU-dependent SIMD variants; its float64 exp differs by up to an ulp between them); the rare
    arguments whose e^x lies closer than that to an fp32 rounding boundary go through :mod:`decimal`.
    ``out64``: optional float64 scratch of x's shape; ``out``: optional float32 result array (see
    :func:`certified_f32`)."""
    y = np.exp(x, out=out64, dtype=np.float64)
    return certified_f32(y, _TRANSCENDENTAL_MARGIN, lambda idx: _decimal_f32(x.reshape(-1)[idx], "exp"),
                         relative=True, out=out)


def log_f32(x: np.ndarray) -> np.ndarray:
    """RN32(ln x) of positive float32 ``x`` (same method as :func:`exp_f32`)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log(x, dtype=np.float64)
    return certified_f32(y, _TRANSCENDENTAL_MARGIN * np.abs(y),
                         lambda idx: _decimal_f32(x.reshape(-1)[idx], "ln"))


# Exactness of float64 dot products. Facts about each row a_m of a (and column b_n of b): ``norm`` bounds the
# 2-norm (or, where a caller says so, a Hoelder pair: the 1-norm of a_m and the largest |entry| of b_n) and every
# non-zero entry is a multiple of ``2^lq``. Then every product a_mk b_kn is a multiple of 2^(lq_m + lq_n), every
# partial sum is bounded by norm_m * norm_n, and if that bound is at most 2^(lq_m + lq_n + 53) no partial sum of
# any order ever rounds: the float64 result is the exact sum.

_NO_LQ = 4096  # "no non-zero entry": never limits exactness
_LQ_LUTS: dict = {}


def _exact_lq(values: np.ndarray) -> np.ndarray:
    """Exponent of the lowest set bit of each finite non-zero float64 value (``_NO_LQ`` for 0 / non-finite)."""
    v = np.asarray(values, np.float64)
    ok = np.isfinite(v) & (v != 0)
    m, e = np.frexp(np.where(ok, np.abs(v), 1.0))
    big = (m * 2.0 ** 53).astype(np.int64)  # the 53-bit significand as an integer (exact)
    low = np.frexp((big & -big).astype(np.float64))[1] - 1  # trailing zeros of the significand
    return np.where(ok, e - 53 + low, _NO_LQ).astype(np.int16)


def lq_table(dtype_name: str) -> np.ndarray:
    """int16 table over the bit patterns of a 16-bit float (65536) or a one-byte code format (256): the exponent of
    the lowest set bit of the value (``_NO_LQ`` for zero)."""
    lut = _LQ_LUTS.get(dtype_name)
    if lut is None:
        if dtype_name in _QDT:
            with np.errstate(invalid="ignore"):
                vals = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(_QDT[dtype_name]).astype(np.float64)
        else:
            vals = decode_nope(np.arange(256, dtype=np.uint8), dtype_name, np.float64)
        lut = _LQ_LUTS[dtype_name] = _exact_lq(vals)
    return lut


def _code_range(fmt: str):
    """(largest |decoded code|, None for int8 else a float64 table |decoded code| with inf for zero / non-finite)
    of a one-byte NoPE format: the value range the dequantised K's error analysis uses."""
    if fmt == "int8":
        return 128.0, None
    vals = np.abs(decode_nope(np.arange(256, dtype=np.uint8), fmt, np.float64))
    fin = np.isfinite(vals)
    return float(vals[fin].max()), np.where(fin & (vals > 0), vals, np.inf)


#: 16-bit floats: (bits of the exponent field's lowest bit, exponent of a significand's last bit at field 0)
_FIELD16 = {"bfloat16": (7, -134), "float16": (10, -25)}


def min_lq(bits: np.ndarray, dtype_name: str) -> np.ndarray:
    """Per row (last axis) of a uint16 view of 16-bit floats (or a uint8 array of one-byte codes): a lower bound
    of the lowest set bit's exponent over the row's non-zero values (``_NO_LQ`` for an all-zero row). 16-bit: the
    smallest magnitude's exponent less the significand bits (3 passes over the 2-byte data, no table)."""
    if dtype_name not in _FIELD16:
        return lq_table(dtype_name)[bits].min(axis=-1)
    shift, low = _FIELD16[dtype_name]
    mag = bits & np.uint16(0x7FFF)
    mag -= np.uint16(1)  # zero wraps to 0xFFFF: never the minimum of a row with a non-zero value
    mn = mag.min(axis=-1).astype(np.int32)
    return np.where(mn == 0xFFFF, _NO_LQ, ((mn + 1) >> shift) + low)


def row_facts(x64: np.ndarray, bits: np.ndarray, dtype_name: str):
    """(2-norm bound, lq) of every row (last axis) of ``x64`` (float64), whose values are the 16-bit floats or
    one-byte codes ``bits`` (a uint16 / uint8 view of the same values) of ``dtype_name``."""
    norm = np.sqrt(np.einsum("...d,...d->...", x64, x64)) * (1 + 2.0 ** -40)
    return norm, min_lq(bits, dtype_name)


def qsfa_row_facts(codes, scales, fmt: str, qdtype: str, rope_bits=None, rope64=None, rope_facts=None):
    """Facts (see :func:`_dot_f32`) of faithful dequantised QSFA rows, from the tile scales and the RoPE bits:
    ``(k_norm [n], k_lq [n], v_max [n, 4], v_lq [n, 4])`` - a 2-norm bound and lq of each K row (NoPE + RoPE), and
    per NoPE tile the largest |entry| and lq of V.

    codes uint8 ``[n, 512]`` of ``fmt``, scales fp32 ``[n, 4]``; rope_bits uint16 ``[n, 64]`` and rope64 (its values,
    float32 or float64: squares are summed in float64) or None; or rope_facts, those two already reduced per row
    (``(sum of squares [n] float64, min_lq(rope_bits) [n])``). A NoPE entry is ``round_q(fp32(c * s))`` with ``|c| <= c_max``, so
    ``|v| <= c_max s (1 + 2^-7) + tiny_q`` (the absolute term covers subnormal results), and a non-zero one has
    ``|c| >= c_min`` (the tile's smallest non-zero |code|; 1 for int8), so it is a multiple of ``2^(e - p)`` for the
    exponent e of ``c_min s (1 - 2^-7)`` and p the significand bits of the query dtype (a normal v is at least that
    bound; a subnormal v's quantum, tiny_q, is coarser still).
    """
    n = codes.shape[0]
    c_max, abs_codes = _code_range(fmt)
    s_abs = np.abs(np.asarray(scales, np.float64))
    vmax = (c_max * (1 + 2.0 ** -7)) * s_abs + _TINY[qdtype]  # [n, 4]
    c_min = 1.0 if abs_codes is None else abs_codes[codes].reshape(n, -1, TILE).min(axis=-1)
    with np.errstate(invalid="ignore"):  # inf * 0: a tile without non-zero codes and a zero scale
        low = c_min * s_abs * (1 - 2.0 ** -7)
    ok = np.isfinite(low) & (low > 0)
    vlq = np.where(ok, np.frexp(np.where(ok, low, 1.0))[1] - _PRECISION[qdtype], _NO_LQ)
    k_sq = TILE * np.einsum("nt,nt->n", vmax, vmax)
    k_lq = np.minimum.reduce([vlq[:, t] for t in range(vlq.shape[1])])  # (a short axis: column by column)
    if rope64 is not None:
        rope_facts = np.einsum("nd,nd->n", rope64, rope64, dtype=np.float64), min_lq(rope_bits, qdtype)
    if rope_facts is not None:
        k_sq += rope_facts[0]
        k_lq = np.minimum(k_lq, rope_facts[1])
    return np.sqrt(k_sq) * (1 + 2.0 ** -40), k_lq, vmax, vlq


def exact_room(facts):
    """Per row of ``a`` in :func:`_dot_f32`, from its facts ``(norm, lq)``: the largest span ``log2(norm) - lq`` a
    column of ``b`` may have for their dot product to be exact in float64 (+inf for a row of zeros)."""
    norm, lq = facts
    with np.errstate(divide="ignore"):
        return lq + 53 - np.log2(norm) - 2.0 ** -20


def _dot_f32(a: np.ndarray, b: np.ndarray, a_facts, b_facts, out=None) -> np.ndarray:
    """RN32 of the exact batched dot products ``a @ b`` (float64 ``[c, M, K] @ [c, K, N]`` holding 16-bit floats or
    one-byte codes, so every product is exact), the same bits whatever BLAS kernel computed the float64 matmul.

    a_facts = (norm, lq) ``[c, M]`` per row of a, b_facts = (norm, lq) ``[c, N]`` per column of b (see above).
    Pairs proven exact are rounded once from the matmul; the others (rows or columns with a wide exponent span)
    are certified with the error bound ``4 K 2^-53 norm_m norm_n`` and, where undecided, summed exactly.
    ``out``: an optional float32 array of the result's shape to write (default: a new one).
    """
    approx = np.matmul(a, b, out=scratch("dot_approx", a.shape[:-1] + b.shape[-1:], np.float64))
    out = np.empty(approx.shape, np.float32) if out is None else out
    np.add(approx, 0.0, out=approx)  # an exact zero sum is +0 (a float64 pass: faster than a casting add)
    with np.errstate(over="ignore"):  # a sum beyond fp32's range rounds to +-inf, as the kernel's accumulator
        np.copyto(out, approx, casting="same_kind")  # one rounding
    an, (bn, bq) = a_facts[0], b_facts
    room = exact_room(a_facts)  # [c, M]: a column n is exact with row m if its span fits
    with np.errstate(divide="ignore"):
        span = np.log2(bn) - bq  # [c, N]
    cand_c, cand_n = np.nonzero(span > room.min(axis=1)[:, None])  # columns some row cannot pair exactly with
    if cand_c.size == 0:
        return out
    # the pairs (m, n) with span_n > room_m: per candidate column, a prefix of the rows in increasing room order
    order = np.argsort(room, axis=1, kind="stable")
    room_sorted = np.take_along_axis(room, order, axis=1)
    sp = span[cand_c, cand_n]
    cnt = np.empty(cand_c.size, np.int64)
    seg = np.searchsorted(cand_c, np.arange(room.shape[0] + 1))  # cand_c is sorted (np.nonzero)
    for c in range(room.shape[0]):
        cnt[seg[c]:seg[c + 1]] = np.searchsorted(room_sorted[c], sp[seg[c]:seg[c + 1]], side="left")
    pi = np.repeat(np.arange(cand_c.size), cnt)
    ci, ni = cand_c[pi], cand_n[pi]
    mi = order[ci, np.arange(pi.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)]
    bound = sum_error_bound(a.shape[-1], an[ci, mi] * bn[ci, ni])
    out[ci, mi, ni] = certified_f32(approx[ci, mi, ni], bound,
                                    lambda j: exact_sum_f32(a[ci[j], mi[j], :] * b[ci[j], :, ni[j]]))
    return out


# ----------------------------------------------------------------------------------------------------
# the shared core

_ROW_RANGE = contextvars.ContextVar("qsfa_attention_row_range", default=None)


@contextlib.contextmanager
def only_rows(start: int, stop: int):
    """Within the block the attention oracles compute only the query rows ``start <= r < stop``; the other rows
    of every output array they allocate are zero, and the other rows of a caller's output buffer
    (``attention_out=``, ``softmax_max_out=``, ``softmax_sum_out=``) keep their bytes - so row ranges, run one after
    another or in separate processes, fill one shared buffer (e.g. an ``np.memmap``). Rows are numbered in
    flattened order (``b * Q_S + s`` for BSND, the token for TND): row ``r`` of every output is
    ``output.reshape(rows, -1)[r]``. A row's bytes do not depend on which other rows are computed with it, so a
    call split into row ranges (``qsfa.distributed``) assembles to the same bytes."""
    token = _ROW_RANGE.set((int(start), int(stop)))
    try:
        yield
    finally:
        _ROW_RANGE.reset(token)


def rows_in_range(rows: np.ndarray) -> np.ndarray:
    """The row numbers of ``rows`` (sorted) that the :func:`only_rows` range in force keeps (all without one)."""
    row_range = _ROW_RANGE.get()
    if row_range is None:
        return rows
    return rows[(rows >= row_range[0]) & (rows < row_range[1])]


def zero_idle_rows(buffers, n_rows: int, active: np.ndarray, block: int = 4096) -> None:
    """Zero, in each caller's output buffer of ``buffers`` (views ``[n_rows, ...]``), the rows of the
    :func:`only_rows` range (every row without one) that no chunk computes (``active``: the rows computed), a
    block of rows at a time. Rows outside the range are not the call's: their bytes stay."""
    if not buffers:
        return
    row_range = _ROW_RANGE.get()
    idle = np.zeros(n_rows, bool)
    lo, hi = (0, n_rows) if row_range is None else (max(row_range[0], 0), min(row_range[1], n_rows))
    idle[lo:max(hi, lo)] = True
    idle[active] = False
    for a in range(0, n_rows, block):
        sel = np.flatnonzero(idle[a:a + block]) + a
        if sel.size:
            for b in buffers:
                b[sel] = 0


def row_workset_bytes(n_heads: int, width: int, dv: int = NOPE_DIM, kv_rows: int = 2) -> int:
    """The modelled working set of one query row in a chunk (either precision), in bytes: per selected token
    ``kv_rows`` float64 rows ``dv + 64`` wide (QSFA 2: the dequantised and the gathered K may both be alive; SFA
    4: K, V and the temporaries of their facts) and up to 1 KiB of packed / 16-bit source rows and indices; per
    token and head 32 bytes (the float64 scores and probabilities, their fp32 copies and the exp / certification
    temporaries); per head the float64 query row and the output in fp32 and float64. Measured chunk peaks stay
    below it (tests/test_workset.py)."""
    dqk = int(dv) + ROPE_DIM
    w, n = max(int(width), 1), max(int(n_heads), 1)
    return w * (int(kv_rows) * 8 * dqk + 1024) + 32 * n * w + n * (8 * dqk + 16 * int(dv))


def _rows_per_chunk(chunk_size: int, n_heads: int, width: int, exact: bool = False, *, budget: int | None = None,
                    dv: int = NOPE_DIM, kv_rows: int = 2) -> int:
    """Query rows per chunk: at most ``chunk_size / 2`` row x head pairs and ``8 * chunk_size`` gathered tokens
    (both modes hold K, V and the scores in float64) and, given a ``budget`` in bytes (one thread's share of
    the working set, qsfa.reference.parallel), at most as many rows as :func:`row_workset_bytes` fits in it;
    never fewer than one. ``exact`` is accepted for compatibility; it no longer changes the answer."""
    rows = min(int(chunk_size) // max(2 * n_heads, 1), (8 * int(chunk_size)) // max(width, 1))
    if budget is not None:
        rows = min(rows, int(budget) // row_workset_bytes(n_heads, width, dv, kv_rows))
    return max(1, rows)


def _faithful_chunk(q, q_facts, k, k_facts, v, v_facts, valid, scale, qdtype, probability_rounding, sink,
                    lse_includes_sink, p_rounding=None):
    """The kernel's fp32 pipeline on one chunk; every fp32 accumulation is the correctly rounded fp32 value of the
    exact result (see the module docstring).

    q [c, N, Dqk], k [c, W, Dqk], v [c, W, dv]: float64 arrays holding query-dtype values (unselected tokens
    zero); valid [c, W]. q_facts (2-norm bound, lq) [c, N] per query row, k_facts [c, W] per token, v_facts =
    (max |entry|, lq) [c, dv] per column of V (see :func:`_dot_f32`). Returns o [c, N, dv] fp32 (before the output
    rounding), m, l [c, N] fp32.
    """
    w = k.shape[1]
    s = _dot_f32(q, k.transpose(0, 2, 1), q_facts, k_facts,  # RN32(q . k)  [c, N, W]
                 out=scratch("faithful_s", q.shape[:2] + (w,), np.float32))
    p = scratch("faithful_e64", s.shape, np.float64)  # P rounded to the query dtype, float64 for the exact products
    p_mode = p_rounding or DEFAULT_ROUNDING["p"][qdtype]
    m, l, e_min = softmax_rows(s, valid, scale, qdtype=qdtype, probability_rounding=probability_rounding,
                               p_mode=p_mode, p_out=p)  # in blocks of rows (qsfa.reference._decode_blocks)
    s = None
    # facts of P's rows (Hoelder: 1-norm): every non-zero P_j >= e_min (1 - 2^-7) [/ l], sum P <= (1 + 2^-6) sum e
    slack = w * _TINY[qdtype]
    if probability_rounding == "normalised":
        p_low, p_sum = e_min / l * (1 - 2.0 ** -6), np.full(l.shape, 1 + 2.0 ** -5 + slack)
    else:
        p_low, p_sum = e_min * (1 - 2.0 ** -6), l * (1 + 2.0 ** -6) + slack
    p_lq = np.where(np.isfinite(p_low) & (p_low > 0), np.frexp(p_low)[1] - _PRECISION[qdtype], _NO_LQ)
    o = _dot_f32(p, v, (p_sum, p_lq), v_facts)  # RN32(P @ V)
    if probability_rounding != "normalised":
        o /= l[..., None]  # fp32 divide
    if sink is not None:  # fp32 steps, exp / log correctly rounded
        with np.errstate(over="ignore"):
            lse = m + log_f32(l)
            o /= (np.float32(1) + exp_f32(sink[None, :] - lse))[..., None]
            if lse_includes_sink:
                l = l + exp_f32(sink[None, :] - m)
    return o, m, l


def _exact_chunk(q, k, v, valid, scale, sink, lse_includes_sink):
    """float64 attention with no intermediate rounding (``precision="exact"``)."""
    s = np.matmul(q, k.transpose(0, 2, 1))
    s *= scale
    np.copyto(s, np.float64(MASK_VALUE), where=~valid[:, None, :])
    m = s.max(axis=-1)
    s -= m[..., None]
    np.exp(s, out=s)
    l = s.sum(axis=-1)
    o = np.matmul(s, v) / l[..., None]
    if sink is not None:
        with np.errstate(over="ignore"):
            lse = m + np.log(l)
            o /= (1 + np.exp(sink[None, :] - lse))[..., None]
            if lse_includes_sink:
                l = l + np.exp(sink[None, :] - m)
    return o, m, l


def _benchmark_chunk(q, k, v, valid, scale, qdtype, sink, lse_includes_sink):
    """A third-party (GPU-like) computation of the same attention (``precision="benchmark"``): the query-dtype
    Q / K / V of the faithful path (K dequantised and rounded at the K point), scores ``Q @ K^T`` as one fp32
    GEMM times the fp32 scale, fp32 softmax (numpy's float32 exp, ``l`` summed in fp32), P rounded to the query
    dtype (RINT) as a GPU kernel feeds its P @ V tensor-core GEMM (FlashMLA's order), ``P @ V`` an fp32 GEMM
    divided by ``l``; the output rounded to the query dtype (RINT) by the caller. Its last bits follow the fp32
    BLAS: a benchmark for the dual-benchmark standards (docs/numerics/comparison.md#standards), not golden bytes."""
    q32, k32, v32 = q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)
    s = np.matmul(q32, k32.transpose(0, 2, 1))
    s *= np.float32(scale)
    np.copyto(s, MASK_VALUE, where=~valid[:, None, :])
    m = s.max(axis=-1)
    s -= m[..., None]
    np.exp(s, out=s)
    l = s.sum(axis=-1, dtype=np.float32)
    p = s.astype(_QDT[qdtype]).astype(np.float32)
    o = np.matmul(p, v32) / l[..., None]
    if sink is not None:
        sk = sink.astype(np.float32)
        with np.errstate(over="ignore"):
            lse = m + np.log(l)
            o /= (np.float32(1) + np.exp(sk[None, :] - lse))[..., None]
            if lse_includes_sink:
                l = l + np.exp(sk[None, :] - m)
    return o, m, l


def _core(*, rows, kvm, indices, sparse_block_size, sparse_mode, n_heads, dv, load_q, load_kv,
          scale_value, qdtype, precision, probability_rounding, chunk_size, sinks=None,
          lse_includes_sink=False, p_rounding=None, out_rounding=None, out_buffer=None, lse=True,
          lse_buffers=(None, None), kv_rows=2):
    """Attention over selected tokens for every query row.

    out_buffer: an optional C-contiguous array of the output's size and dtype (``attention_out=``, e.g. an
    ``np.memmap``): the rows are written into it chunk by chunk, so the output never exists in memory as a whole.
    lse: whether softmax_max / softmax_sum are wanted (if not, no per-row array of them is allocated: empty
    arrays are returned); lse_buffers: optional C-contiguous buffers of their size and dtype (``softmax_max_out=``,
    ``softmax_sum_out=``), written chunk by chunk like out_buffer. kv_rows: float64 K / V rows per selected token
    that load_kv keeps alive (:func:`row_workset_bytes`; the chunks are sized from it and the working-set budget).

    load_q(row_ids) -> (q [c, N, Dqk] float64, facts (2-norm bound, lq) [c, N] or None in exact mode).
    load_kv(storage [c, W] int64, valid [c, W]) -> (K [c, W, Dqk], V [c, W, dv], k_facts [c, W], v_facts
    (max |entry|, lq) [c, W, G] per token and group of dv / G columns; facts None in exact mode), K / V float64
    (faithful: query-dtype values; exact: the exact dequantised values); invalid tokens zero.
    Returns out [R, N, dv] (query dtype, or float64 exact), softmax_max, softmax_sum [R, N]
    (float32, or float64 exact).
    """
    exact = precision == "exact"
    fdt = np.float64 if exact else np.float32
    n_rows = rows.batch.size
    thr, limit = row_limits(rows, kvm.act_kv, sparse_mode)
    idx = np.asarray(indices).reshape(n_rows, -1)
    width = idx.shape[1] * int(sparse_block_size)
    if out_buffer is None:
        out = np.zeros((n_rows, n_heads, dv), np.float64 if exact else _QDT[qdtype])
    else:
        out = out_buffer.reshape(n_rows, n_heads, dv)  # a view (C-contiguous, checked by the contract)
        assert np.shares_memory(out, out_buffer[..., :1]) and out.dtype == (np.float64 if exact else _QDT[qdtype])
    lse_arrays = []
    for buf in lse_buffers if lse else ():
        if buf is None:
            lse_arrays.append(np.zeros((n_rows, n_heads), fdt))
        else:  # a view of the caller's buffer (C-contiguous, checked by the contract)
            v = buf.reshape(n_rows, n_heads)
            assert np.shares_memory(v, buf.reshape(-1)[:1]) and v.dtype == fdt
            lse_arrays.append(v)
    mx, sm = lse_arrays if lse else (np.zeros((0,), fdt), np.zeros((0,), fdt))
    active = rows_in_range(np.nonzero(limit > 0)[0])
    n_threads = get_num_threads()
    step = _rows_per_chunk(chunk_size, n_heads, width, budget=workset_bytes_per_thread(n_threads), dv=dv,
                           kv_rows=kv_rows)
    sink = None if sinks is None else np.asarray(sinks, np.float32).astype(fdt)

    def compute(r, tok, valid):
        storage = kvm.storage_rows(rows.batch[r][:, None], tok)
        k, v, k_facts, v_facts = load_kv(storage, valid)
        q, q_facts = load_q(r)
        if exact:
            return _exact_chunk(q, k, v, valid, np.float64(scale_value), sink, lse_includes_sink)
        if precision == "benchmark":
            return _benchmark_chunk(q, k, v, valid, scale_value, qdtype, sink, lse_includes_sink)
        g = dv // v_facts[0].shape[-1]  # per column of V: the largest entry and the smallest quantum over the tokens
        vmax, vlq = (np.ascontiguousarray(f.transpose(0, 2, 1)) for f in v_facts)  # (reduced along a contiguous axis)
        v_cols = (np.repeat(vmax.max(axis=-1), g, axis=-1), np.repeat(vlq.min(axis=-1), g, axis=-1))
        return _faithful_chunk(q, q_facts, k, k_facts, v, v_cols, valid, np.float32(scale_value), qdtype,
                               probability_rounding, sink, lse_includes_sink, p_rounding)

    def chunk(start):  # one chunk of rows; chunks are independent (run_chunks may run them on a thread pool)
        r = active[start:start + step]
        tok, valid = selected_tokens(idx[r], thr[r], limit[r], sparse_block_size)
        o = None
        n_valid = valid.sum(axis=1)
        w = max(int(n_valid.max(initial=0)), 1)
        if not exact and w < valid.shape[1]:
            # Only the selected tokens (stable order): an unselected token's score is MASK_VALUE, so where a row's
            # max m is above it, its e = RN32(exp(MASK_VALUE - m)) is exactly 0 and adds nothing to l or P @ V -
            # the bytes are those of the full width (every fp32 result is RN32 of an exact value). A row whose max
            # is not above the mask value (a selected score <= -2e38, or inf / nan) is recomputed at full width.
            order = np.argsort(~valid, axis=1, kind="stable")[:, :w]
            o, m, l = compute(r, np.take_along_axis(tok, order, 1), np.take_along_axis(valid, order, 1))
            if not (m[n_valid > 0] > MASK_VALUE).all():
                o = None
        if o is None:
            o, m, l = compute(r, tok, valid)
        empty = ~valid.any(axis=1)  # rows without a selected token
        o[empty] = 0
        m[empty] = 0
        l[empty] = 0
        out[r] = o if exact else round_q16(o, qdtype, "rint" if precision == "benchmark" else
                                           (out_rounding or DEFAULT_ROUNDING["out"][qdtype]))
        if lse:
            mx[r] = m
            sm[r] = l

    # rows of the range no chunk writes (no selected token) are zero in the caller's buffers
    zero_idle_rows([b for b, given in ((out, out_buffer), (mx, lse_buffers[0]), (sm, lse_buffers[1]))
                    if given is not None and (lse or b is out)], n_rows, active)
    run_chunks(chunk, range(0, active.size, step), n_threads)
    return out, mx, sm


def _shape_outputs(out, mx, sm, layout_query, query_shape, return_softmax_lse, exact, attention_out=None,
                   softmax_max_out=None, softmax_sum_out=None):
    n_heads = query_shape[-2]
    if layout_query == "BSND":
        b, s = query_shape[:2]
        out = out.reshape(b, s, n_heads, out.shape[-1])
        lse_shape = (b, 1, s, n_heads)
    else:
        out = out.reshape(query_shape[0], n_heads, out.shape[-1])
        lse_shape = (1, query_shape[0], n_heads)
    if attention_out is not None:
        out = attention_out  # the caller's buffer (written in place through a view), as given
    if not return_softmax_lse:
        e = np.zeros((0,), np.float64 if exact else np.float32)
        return out, e, e.copy()
    return (out, mx.reshape(lse_shape) if softmax_max_out is None else softmax_max_out,
            sm.reshape(lse_shape) if softmax_sum_out is None else softmax_sum_out)


def _rows_and_kv(query, key, layout_query, layout_kv, actual_seq_lengths_query, actual_seq_lengths_kv,
                 block_table):
    lead = query.shape[:2] if layout_query == "BSND" else query.shape[:1]
    rows = query_rows(layout_query, lead, actual_seq_lengths_query)
    kvm = kv_map(layout_kv, key.shape, actual_seq_lengths_kv, rows.n_batch, block_table)
    return rows, kvm


def _check_common(precision, probability_rounding):
    assert precision in PRECISIONS, precision
    assert probability_rounding in PROBABILITY_ROUNDINGS, probability_rounding


# ----------------------------------------------------------------------------------------------------
# QSFA


def kv_quant_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, key_quant_mode=2,
                                    value_quant_mode=2, key_dequant_scale=None, value_dequant_scale=None,
                                    block_table=None, actual_seq_lengths_query=None,
                                    actual_seq_lengths_kv=None, sparse_block_size=1, layout_query="BSND",
                                    layout_kv="BSND", sparse_mode=3, pre_tokens=2**63 - 1,
                                    next_tokens=2**63 - 1, attention_mode=2, quant_scale_repo_mode=1,
                                    tile_size=128, rope_head_dim=64, return_softmax_lse=False,
                                    key_dtype="int8", precision="faithful",
                                    probability_rounding="unnormalised", chunk_size=2048, k_rounding=None,
                                    p_rounding=None, out_rounding=None, attention_out=None,
                                    softmax_max_out=None, softmax_sum_out=None):
    """QSFA over a packed quantised KV cache (the oracle of ``qsfa.kv_quant_sparse_flash_attention``).

    query:  float16/bfloat16 ``[B, Q_S, Q_N, 512 + rope]`` (BSND) or ``[Q_T, Q_N, 512 + rope]`` (TND).
    key:    packed rows, one-byte elements (int8/uint8/float8_e4m3fn array) ``[..., 1, 528 | 656]``;
            NoPE codes of ``key_dtype`` ("int8", "float8_e4m3fn", "hifloat8") at bytes [0, 512), RoPE in
            the query dtype at [512, 640) when rope_head_dim = 64, 4 fp32 tile scales last.
    value:  not read (V = dequantised K NoPE, MLA-absorb).
    k_rounding, p_rounding, out_rounding: "rint" | "round" at the three rounding points (dequantised K, P, the
            output); None = :data:`DEFAULT_ROUNDING` (the A2/A3 kernels'). The front door passes the chip's
            modes (qsfa.chips, docs/numerics/chips.md#attention).
    Returns ``(attention_out [..., Q_N, 512], softmax_max, softmax_sum)``; see the module docstring for
    the precision rules, shapes of the LSE outputs and ``probability_rounding`` (OPEN).
    Arguments are assumed valid (``qsfa.kv_quant_sparse_flash_attention`` validates them).
    """
    _check_common(precision, probability_rounding)
    k_mode = k_rounding or DEFAULT_ROUNDING["k"][_qdt_name(query)]
    exact = precision == "exact"
    qdt = _qdt_name(query)
    rope = int(rope_head_dim)
    kvd = key.shape[-1]
    key2d = flat_rows(key.view(np.uint8))  # (a view, or a gatherer for a view of a bigger cache)
    fmt = key_dtype
    n_heads = query.shape[-2]
    dqk = NOPE_DIM + ROPE_DIM
    q2d = query.reshape(-1, n_heads, query.shape[-1])

    def load_q(r):
        q = scratch("qsfa_q", (r.size, n_heads, dqk), np.float64)
        qr = q2d[r]
        q[..., :query.shape[-1]] = qr
        q[..., query.shape[-1]:] = 0
        return q, (None if exact else row_facts(q, qr.view(np.uint16), qdt))

    def dequant(packed):  # -> (K [n, 576] float64, facts or None): qsfa.reference._decode_blocks
        return qsfa_keys(packed, fmt=fmt, qdt=qdt, k_mode=k_mode, rope=rope, exact=exact)

    def load_kv(storage, valid):
        c, w = storage.shape
        flat = storage.reshape(-1)
        bad = ~valid.reshape(-1)
        srt = np.sort(flat)
        if 2 * (1 + np.count_nonzero(srt[1:] != srt[:-1])) <= flat.size:  # rows shared by the chunk (prefill):
            uniq, inv = np.unique(flat, return_inverse=True)  # dequantise each distinct row once, then gather
            k, facts = dequant(key2d[uniq])
            inv = inv.reshape(-1)
            k = np.take(k, inv, axis=0, mode="clip",  # mode="raise" would buffer out (a copy)
                        out=scratch("qsfa_k_gathered", (inv.size, dqk), np.float64))
            k[bad] = 0  # unselected tokens: K = V = 0 (whatever the cache holds there)
            if facts is not None:
                facts = [f[inv] for f in facts]
                for f, empty in zip(facts, (0.0, _NO_LQ, 0.0, _NO_LQ)):
                    f[bad] = empty
        else:  # decode: gather the selected packed rows once, dequantise them
            packed = scratch("qsfa_packed", (flat.size, kvd), np.uint8)
            if isinstance(key2d, np.ndarray):
                np.take(key2d, flat, axis=0, mode="clip", out=packed)  # (rows in range; "raise" would buffer out)
            else:
                packed[...] = key2d[flat]
            packed[bad] = 0  # zero bytes -> K = V = 0 (no stray NaN from unselected rows), facts of zeros
            k, facts = dequant(packed)
        k = k.reshape(c, w, dqk)
        if facts is None:
            return k, k[..., :NOPE_DIM], None, None
        k_norm, k_lq, vmax, vlq = facts
        return (k, k[..., :NOPE_DIM], (k_norm.reshape(c, w), k_lq.reshape(c, w)),
                (vmax.reshape(c, w, -1), vlq.reshape(c, w, -1)))

    rows, kvm = _rows_and_kv(query, key, layout_query, layout_kv, actual_seq_lengths_query,
                             actual_seq_lengths_kv, block_table)
    out, mx, sm = _core(rows=rows, kvm=kvm, indices=sparse_indices, sparse_block_size=sparse_block_size,
                        sparse_mode=sparse_mode, n_heads=n_heads, dv=NOPE_DIM, load_q=load_q, load_kv=load_kv,
                        scale_value=scale_value, qdtype=qdt, precision=precision,
                        probability_rounding=probability_rounding, chunk_size=chunk_size, p_rounding=p_rounding,
                        out_rounding=out_rounding, out_buffer=attention_out, lse=bool(return_softmax_lse),
                        lse_buffers=(softmax_max_out, softmax_sum_out))
    return _shape_outputs(out, mx, sm, layout_query, query.shape, return_softmax_lse, exact, attention_out,
                          softmax_max_out, softmax_sum_out)


# ----------------------------------------------------------------------------------------------------
# SFA


def sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                           actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                           key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                           sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1, attention_mode=0,
                           return_softmax_lse=False, sinks=None, lse_includes_sink=False,
                           precision="faithful", probability_rounding="unnormalised", chunk_size=2048,
                           p_rounding=None, out_rounding=None, attention_out=None, softmax_max_out=None,
                           softmax_sum_out=None):
    """SFA over a float (fp16/bf16) KV (the oracle of ``qsfa.sparse_flash_attention``).

    query ``[..., Q_N, D]``, key ``[..., 1, D]``, value ``[..., 1, D]`` or ``None`` (then V = key),
    optional query_rope ``[..., Q_N, 64]`` / key_rope ``[..., 1, 64]`` (both or neither), all in one
    16-bit dtype. Scores use ``[query, query_rope] . [key, key_rope]``. sinks: fp32 ``[Q_N]``, one extra
    logit per head joining the softmax denominator without a value:
    ``out = out_without_sink / (1 + exp(sink - lse))``; the returned LSE excludes the sink unless
    ``lse_includes_sink`` (**OPEN**, default False as in FlashMLA/FlashInfer), in which case
    ``softmax_sum`` gains ``exp(sink - softmax_max)``. p_rounding / out_rounding: as
    :func:`kv_quant_sparse_flash_attention`. Other rules as the module docstring.
    """
    _check_common(precision, probability_rounding)
    exact = precision == "exact"
    qdt = _qdt_name(query)
    n_heads = query.shape[-2]
    d = query.shape[-1]
    has_rope = query_rope is not None
    dr = query_rope.shape[-1] if has_rope else 0
    q2d = query.reshape(-1, n_heads, d)
    qr2d = query_rope.reshape(-1, n_heads, dr) if has_rope else None
    k2d = flat_rows(key)
    kr2d = flat_rows(key_rope) if has_rope else None
    v2d = None if value is None else flat_rows(value)
    dv = key.shape[-1] if value is None else value.shape[-1]

    def load_q(r):
        q = np.empty((r.size, n_heads, d + dr), np.float64)
        qa = q2d[r]
        q[..., :d] = qa
        if has_rope:
            qb = qr2d[r]
            q[..., d:] = qb
        if exact:
            return q, None
        norm, lq = row_facts(q, qa.view(np.uint16), qdt)
        if has_rope:
            lq = np.minimum(lq, min_lq(qb.view(np.uint16), qdt))
        return q, (norm, lq)

    def load_kv(storage, valid):
        c, w = storage.shape
        flat = storage.reshape(-1)
        bad = ~valid.reshape(-1)
        k = np.empty((flat.size, d + dr), np.float64)
        kb = k2d[flat]
        k[:, :d] = kb
        if has_rope:
            krb = kr2d[flat]
            k[:, d:] = krb
        k[bad] = 0
        if v2d is None:  # V = key
            v, vb = k[:, :dv], kb
        else:
            vb = v2d[flat]
            v = vb.astype(np.float64)
            v[bad] = 0
        if exact:
            return k.reshape(c, w, d + dr), v.reshape(c, w, dv), None, None
        k_norm, k_lq = row_facts(k, kb.view(np.uint16), qdt)
        if has_rope:
            k_lq = np.minimum(k_lq, min_lq(krb.view(np.uint16), qdt))
        vmax = np.abs(v).max(axis=-1)
        v_lq = min_lq(vb.view(np.uint16), qdt)
        k_lq[bad] = _NO_LQ
        v_lq[bad] = _NO_LQ
        return (k.reshape(c, w, d + dr), v.reshape(c, w, dv), (k_norm.reshape(c, w), k_lq.reshape(c, w)),
                (vmax.reshape(c, w, 1), v_lq.reshape(c, w, 1)))

    rows, kvm = _rows_and_kv(query, key, layout_query, layout_kv, actual_seq_lengths_query,
                             actual_seq_lengths_kv, block_table)
    out, mx, sm = _core(rows=rows, kvm=kvm, indices=sparse_indices, sparse_block_size=sparse_block_size,
                        sparse_mode=sparse_mode, n_heads=n_heads, dv=dv, load_q=load_q, load_kv=load_kv,
                        scale_value=scale_value, qdtype=qdt, precision=precision,
                        probability_rounding=probability_rounding, chunk_size=chunk_size, sinks=sinks,
                        lse_includes_sink=lse_includes_sink, p_rounding=p_rounding, out_rounding=out_rounding,
                        out_buffer=attention_out, lse=bool(return_softmax_lse),
                        lse_buffers=(softmax_max_out, softmax_sum_out), kv_rows=4)
    return _shape_outputs(out, mx, sm, layout_query, query.shape, return_softmax_lse, exact, attention_out,
                          softmax_max_out, softmax_sum_out)


# ----------------------------------------------------------------------------------------------------
# front door and error budget

#: key dtypes that select QSFA in the front door (vllm_ascend/device/device_op.py routes int8 / fp8 caches
#: to the kv-quant kernel; HiFloat8 travels as uint8 in qsfa)
QUANT_KEY_DTYPES = ("int8", "uint8", "float8_e4m3fn", "float8_e5m2")


def is_quant_key(key) -> bool:
    from .._arrays import dtype_name

    return dtype_name(key) in QUANT_KEY_DTYPES


def attention(query, key, value=None, sparse_indices=None, scale_value=1.0, *, query_rope=None, key_rope=None,
              block_table=None, actual_seq_lengths_query=None, actual_seq_lengths_kv=None, sparse_block_size=1,
              layout_query="BSND", layout_kv="BSND", sparse_mode=3, return_softmax_lse=False, sinks=None,
              key_dtype=None, rope_head_dim=None, precision="faithful", probability_rounding="unnormalised",
              chunk_size=2048, k_rounding=None, p_rounding=None, out_rounding=None, attention_out=None,
              softmax_max_out=None, softmax_sum_out=None):
    """Route like vLLM-Ascend: a one-byte (packed quantised) key -> QSFA, a float key -> SFA.

    For QSFA, ``query`` is the NoPE part and ``query_rope`` (if given) is concatenated to it;
    ``rope_head_dim`` defaults to what the packed width says (656 -> 64, 528 -> 0); ``key_dtype``
    defaults to the key array's format ("float8_e4m3fn" for an FP8 array, else "int8"). For SFA,
    ``value=None`` means V = key. See the public ``qsfa.attention`` for the full parameter set.
    """
    common = dict(block_table=block_table, actual_seq_lengths_query=actual_seq_lengths_query,
                  actual_seq_lengths_kv=actual_seq_lengths_kv, sparse_block_size=sparse_block_size,
                  layout_query=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode,
                  return_softmax_lse=return_softmax_lse, precision=precision,
                  probability_rounding=probability_rounding, chunk_size=chunk_size, p_rounding=p_rounding,
                  out_rounding=out_rounding, attention_out=attention_out, softmax_max_out=softmax_max_out,
                  softmax_sum_out=softmax_sum_out)
    if is_quant_key(key):
        from .._arrays import dtype_name

        q = query if query_rope is None else np.concatenate([query, query_rope], axis=-1)
        if rope_head_dim is None:
            rope_head_dim = {656: 64, 528: 0}.get(int(key.shape[-1]), 64)
        if key_dtype is None:
            key_dtype = "float8_e4m3fn" if dtype_name(key) == "float8_e4m3fn" else "int8"
        return kv_quant_sparse_flash_attention(q, key, key if value is None else value, sparse_indices,
                                               scale_value, key_dtype=key_dtype, rope_head_dim=rope_head_dim,
                                               k_rounding=k_rounding, **common)
    return sparse_flash_attention(query, key, value, sparse_indices, scale_value, query_rope=query_rope,
                                  key_rope=key_rope, sinks=sinks, attention_mode=2, **common)


def attention_error_budget(*args, **kwargs):
    """Per output element ``faithful - exact`` (float64) of :func:`attention` for the same arguments.

    This is the error the kernel's rounding points cost on this input (``precision`` is ignored). A bound
    for it, derived in tests/test_attention_precision.py and checked there: with u the unit roundoff of
    the query dtype (2^-8 bf16, 2^-11 fp16), gamma_n = n 2^-24 / (1 - n 2^-24),
    ``delta = max_j scale * sum_d |q_d||k_d| * (u + gamma_D)`` over the row's selected tokens,
    ``A = exp(2 delta) (1 + u) (1 + gamma_{W+8}) - 1`` and ``W = sum_j p_j |v_j|`` (exact p, v):
    ``|faithful - exact| <= E + u (|exact| + E)`` with ``E = W ((1 + A)(1 + u)(1 + gamma_W) - 1)``.
    """
    kwargs = dict(kwargs)
    kwargs.pop("precision", None)
    kwargs["return_softmax_lse"] = False
    faithful = attention(*args, precision="faithful", **kwargs)[0]
    exact = attention(*args, precision="exact", **kwargs)[0]
    return faithful.astype(np.float64) - exact
