"""Sparse flash attention oracles: QSFA (packed quantised KV) and SFA (float KV). SPEC.md 3.6.

Both compute, for every query row and query head,

    out = softmax(scale_value * q . K_sel^T) @ V_sel

over the tokens ``K_sel`` that the row's ``sparse_indices`` select (token-selection rules in
:mod:`qsfa.reference.attn_layout`), plus the softmax statistics ``softmax_max`` (row max of the scaled
scores) and ``softmax_sum`` (``sum exp(s - max)``, unnormalised).

Precision modes
---------------
``precision="faithful"`` (default) rounds where the Ascend kernel rounds:

1. QSFA: ``K_nope = decode(code) * tile_scale`` (one fp32 multiply), rounded to the query dtype
   (bf16 RINT, fp16 ROUND = half away from zero; SPEC.md 3.6). The RoPE part is taken as stored. The
   query dtype value V is the same rounded NoPE (MLA-absorb). SFA: K and V are already in the query dtype.
2. ``s = fp32(q . k) * fp32(scale_value)``: fp32 accumulation (the kernel's cube unit accumulates
   exact 16x16-bit products in fp32; the order of accumulation is the BLAS one here, so the last bit of
   a score may differ from a kernel's). Tokens that are not selected get ``-2e38`` (not ``-inf``), as
   in the kernel; their probability underflows to exactly 0.
3. ``m = max(s)``, ``e = exp(s - m)``, ``l = sum(e)`` in fp32.
4. Probabilities are rounded to the query dtype before ``P @ V`` (fp32 accumulation). Where exactly is
   **OPEN** and is the parameter ``probability_rounding``:

   * ``"unnormalised"`` (default): ``P = round(e)``, ``o = (P @ V) / l``. This is what the kernels do
     (vllm-ascend csrc/attention/kv_quant_sparse_flash_attention/op_kernel/arch35/
     kv_quant_sparse_flash_attention_service_vector_mla.h: the softmax stage casts ``exp(s - max)`` to
     the query dtype for the second matmul and the final stage divides by the fp32 sum; the rope0 test
     module there names "the known normalized-probability versus unnormalized-exp rounding difference").
     With it, uniform attention gives exactly the mean of the selected V.
   * ``"normalised"``: ``P = round(e / l)``, ``o = P @ V`` - the vLLM-Ascend test golden
     (tests/e2e/nightly/single_node/ops/singlecard_ops/test_kv_quant_sparse_flash_attention.py:
     ``torch.softmax`` in fp32, then ``probs.to(bfloat16)`` before the PV matmul).

   The kernel's online softmax rescales per 128-token tile with a running max; that tiling is not
   modelled (it is tiling-dependent), so a correct kernel matches within tolerance, not bit for bit.
5. ``out = round(o)`` to the query dtype (same rule as 1).

A row that selects no token (causal threshold <= 0, first index -1, every index past the threshold,
or a BSND padding row past ``actQ``) gets ``out = 0`` and ``softmax_max = softmax_sum = 0`` (the
kernel zeroes such rows; vllm-ascend ZeroInvalidAttnOut / ZeroInvalidLse).

``precision="exact"``: float64 end to end with no intermediate rounding - K dequantised exactly
(``decode(code) * scale`` is exact in float64), ``scale_value`` as the given Python float, exact
softmax, no probability or output rounding. The attention output and the LSE outputs are float64.

rope_head_dim = 0 (QSFA): the kernel "skips reading the RoPE input and zero-fills the internal RoPE
region" (seed 000); the reference does the same (an internal 576-wide K with zero RoPE), so a 528-byte
cache gives bit-identical results to the same data zero-padded to 656 bytes.

Memory: the work is done in chunks of query rows; ``chunk_size`` bounds both the number of
``query row x head`` pairs (score matrices) and, via ``16 * chunk_size``, the gathered KV tokens per
chunk, so peak working memory is independent of the number of query tokens (about
``chunk_size * 16 * 10 KB``, ~330 MB at the default 2048 for 576-wide K and 128 heads, plus the
outputs); results do not depend on ``chunk_size`` (every row is reduced over its full index width).
Per chunk the selected packed rows are gathered once and dequantised (decode), or - when the chunk's rows
share most cache rows (prefill) - each distinct cache row is dequantised once and the float rows gathered;
unselected positions are zeroed, so nothing a row did not select is ever read into a result.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .attn_layout import kv_map, query_rows, row_limits, selected_tokens

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
#: rounding of fp32 values to the query dtype at the kernel's rounding points (SPEC.md 3.6)
QUERY_ROUNDING = {"bfloat16": "rint", "float16": "round"}
PROBABILITY_ROUNDINGS = ("unnormalised", "normalised")
PRECISIONS = ("faithful", "exact")


def _qdt_name(a: np.ndarray) -> str:
    dt = np.dtype(a.dtype)
    if dt == _QDT["bfloat16"]:
        return "bfloat16"
    if dt == _QDT["float16"]:
        return "float16"
    raise TypeError(f"query dtype must be float16 or bfloat16, got {dt}")


def round_to_query_dtype(x: np.ndarray, qdtype: str) -> np.ndarray:
    """fp32 ``x`` rounded to ``qdtype`` ("bfloat16": RINT, "float16": ROUND), returned as float32.

    bf16 uses ml_dtypes' cast (round half to even, identical to ``formats.round_to(x, "bfloat16")``), fp16
    :func:`_fp16_round_away`; both are checked against ``formats.round_to`` in
    tests/test_attention_precision.py.
    """
    if qdtype == "bfloat16":
        return x.astype(_QDT["bfloat16"]).astype(np.float32)
    return _fp16_round_away(x).astype(np.float32)


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


def _code_view(codes: np.ndarray, fmt: str) -> np.ndarray:
    """A uint8 code array viewed as the NumPy dtype whose values are the decoded codes (int8, FP8)."""
    return codes.view(np.int8 if fmt == "int8" else ml_dtypes.float8_e4m3fn)


def round_to_query_dtype_inplace(x: np.ndarray, qdtype: str) -> None:
    """``x[...] = round_to_query_dtype(x, qdtype)`` (fp32 ``x``, any strides)."""
    if qdtype == "bfloat16":
        x[...] = x.astype(_QDT["bfloat16"])
    else:
        x[...] = round_to_query_dtype(x, qdtype)


# ----------------------------------------------------------------------------------------------------
# the shared core


def _rows_per_chunk(chunk_size: int, n_heads: int, width: int, exact: bool = False) -> int:
    """Query rows per chunk: at most ``chunk_size`` row x head pairs and ``16 * chunk_size`` gathered
    tokens (halved in exact mode, whose arrays are float64)."""
    rows = max(1, min(int(chunk_size) // max(n_heads, 1), (16 * int(chunk_size)) // max(width, 1)))
    return max(1, rows // 2) if exact else rows


def _core(*, rows, kvm, indices, sparse_block_size, sparse_mode, n_heads, dv, load_q, load_kv,
          scale_value, qdtype, precision, probability_rounding, chunk_size, sinks=None,
          lse_includes_sink=False):
    """Attention over selected tokens for every query row.

    load_q(row_ids) -> q [c, N, Dqk] (float32 faithful / float64 exact).
    load_kv(storage [c, W] int64, valid [c, W]) -> (K [c, W, Dqk], V [c, W, dv]); invalid rows zero.
    Returns out [R, N, dv] (query dtype, or float64 exact), softmax_max, softmax_sum [R, N]
    (float32, or float64 exact).
    """
    exact = precision == "exact"
    fdt = np.float64 if exact else np.float32
    n_rows = rows.batch.size
    thr, limit = row_limits(rows, kvm.act_kv, sparse_mode)
    idx = np.asarray(indices).reshape(n_rows, -1)
    width = idx.shape[1] * int(sparse_block_size)
    out = np.zeros((n_rows, n_heads, dv), np.float64 if exact else _QDT[qdtype])
    mx = np.zeros((n_rows, n_heads), fdt)
    sm = np.zeros((n_rows, n_heads), fdt)
    active = np.nonzero(limit > 0)[0]
    step = _rows_per_chunk(chunk_size, n_heads, width, exact)
    scale = np.float64(scale_value) if exact else np.float32(scale_value)
    sink = None if sinks is None else np.asarray(sinks, np.float32).astype(fdt)
    for start in range(0, active.size, step):
        r = active[start:start + step]
        tok, valid = selected_tokens(idx[r], thr[r], limit[r], sparse_block_size)
        storage = kvm.storage_rows(rows.batch[r][:, None], tok)
        k, v = load_kv(storage, valid)
        q = load_q(r)
        s = np.matmul(q, k.transpose(0, 2, 1))  # [c, N, W]
        s *= scale
        np.copyto(s, fdt(MASK_VALUE), where=~valid[:, None, :])  # -2e38, not -inf (the kernel's value)
        m = s.max(axis=-1)  # [c, N]
        s -= m[..., None]
        np.exp(s, out=s)
        l = s.sum(axis=-1)
        empty = ~valid.any(axis=1)  # rows without a selected token
        if exact:
            o = np.matmul(s, v) / l[..., None]
        elif probability_rounding == "normalised":
            s /= l[..., None]
            round_to_query_dtype_inplace(s, qdtype)
            o = np.matmul(s, v)
        else:
            round_to_query_dtype_inplace(s, qdtype)
            o = np.matmul(s, v)
            o /= l[..., None]
        if sink is not None:
            with np.errstate(over="ignore"):
                lse = m + np.log(l)
                o /= (1 + np.exp(sink[None, :] - lse))[..., None]
                if lse_includes_sink:
                    l = l + np.exp(sink[None, :] - m)
        o[empty] = 0
        m[empty] = 0
        l[empty] = 0
        out[r] = o if exact else _to_query_dtype(round_to_query_dtype(o, qdtype), qdtype)
        mx[r] = m
        sm[r] = l
    return out, mx, sm


def _shape_outputs(out, mx, sm, layout_query, query_shape, return_softmax_lse, exact):
    n_heads = query_shape[-2]
    if layout_query == "BSND":
        b, s = query_shape[:2]
        out = out.reshape(b, s, n_heads, out.shape[-1])
        lse_shape = (b, 1, s, n_heads)
    else:
        out = out.reshape(query_shape[0], n_heads, out.shape[-1])
        lse_shape = (1, query_shape[0], n_heads)
    if not return_softmax_lse:
        e = np.zeros((0,), np.float64 if exact else np.float32)
        return out, e, e.copy()
    return out, mx.reshape(lse_shape), sm.reshape(lse_shape)


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
                                    probability_rounding="unnormalised", chunk_size=2048):
    """QSFA over a packed quantised KV cache (the oracle of ``qsfa.kv_quant_sparse_flash_attention``).

    query:  float16/bfloat16 ``[B, Q_S, Q_N, 512 + rope]`` (BSND) or ``[Q_T, Q_N, 512 + rope]`` (TND).
    key:    packed rows, one-byte elements (int8/uint8/float8_e4m3fn array) ``[..., 1, 528 | 656]``;
            NoPE codes of ``key_dtype`` ("int8", "float8_e4m3fn", "hifloat8") at bytes [0, 512), RoPE in
            the query dtype at [512, 640) when rope_head_dim = 64, 4 fp32 tile scales last.
    value:  not read (V = dequantised K NoPE, MLA-absorb).
    Returns ``(attention_out [..., Q_N, 512], softmax_max, softmax_sum)``; see the module docstring for
    the precision rules, shapes of the LSE outputs and ``probability_rounding`` (OPEN).
    Arguments are assumed valid (``qsfa.kv_quant_sparse_flash_attention`` validates them).
    """
    _check_common(precision, probability_rounding)
    exact = precision == "exact"
    fdt = np.float64 if exact else np.float32
    qdt = _qdt_name(query)
    rope = int(rope_head_dim)
    kvd = key.shape[-1]
    key2d = key.reshape(-1, kvd).view(np.uint8)
    scale_off = NOPE_DIM + 2 * rope
    fmt = key_dtype
    n_heads = query.shape[-2]
    dqk = NOPE_DIM + ROPE_DIM
    q2d = query.reshape(-1, n_heads, query.shape[-1])

    def load_q(r):
        q = np.zeros((r.size, n_heads, dqk), fdt)
        q[..., :query.shape[-1]] = q2d[r]
        return q

    def dequant(packed):
        """Packed rows [n, kvd] (uint8) -> K [n, 576] (fdt): NoPE decoded, scaled, rounded; RoPE as stored."""
        n = packed.shape[0]
        scales = np.ascontiguousarray(packed[:, scale_off:scale_off + 16]).view("<f4").astype(fdt)
        k = np.empty((n, dqk), fdt)
        kn = k[:, :NOPE_DIM]  # written in place: no temporaries of K's size
        kn3 = kn.reshape(n, NOPE_DIM // TILE, TILE)
        codes = packed[:, :NOPE_DIM]
        if fmt == "hifloat8":
            decode_nope_into(kn, codes, fmt)
            np.multiply(kn3, scales[:, :, None], out=kn3)
        else:  # int8 / FP8 decode exactly inside the multiply: one pass, one rounding (fp32; exact in float64)
            np.multiply(_code_view(codes, fmt).reshape(n, NOPE_DIM // TILE, TILE), scales[:, :, None], out=kn3)
        if not exact:
            round_to_query_dtype_inplace(kn, qdt)
        if rope:
            k[:, NOPE_DIM:] = packed[:, NOPE_DIM:scale_off].view(_QDT[qdt])
        else:
            k[:, NOPE_DIM:] = 0
        return k

    def load_kv(storage, valid):
        c, w = storage.shape
        flat = storage.reshape(-1)
        bad = ~valid.reshape(-1)
        uniq, inv = np.unique(flat, return_inverse=True)
        if 2 * uniq.size <= flat.size:  # rows shared by the chunk (prefill): dequantise each once, then gather
            k = dequant(key2d[uniq])[inv.reshape(-1)]
            k[bad] = 0  # unselected tokens: K = V = 0 (whatever the cache holds there)
        else:  # decode: gather the selected packed rows once, dequantise them
            packed = key2d[flat]
            packed[bad] = 0  # zero bytes -> K = V = 0 (no stray NaN from unselected rows)
            k = dequant(packed)
        k = k.reshape(c, w, dqk)
        return k, k[..., :NOPE_DIM]

    rows, kvm = _rows_and_kv(query, key, layout_query, layout_kv, actual_seq_lengths_query,
                             actual_seq_lengths_kv, block_table)
    out, mx, sm = _core(rows=rows, kvm=kvm, indices=sparse_indices, sparse_block_size=sparse_block_size,
                        sparse_mode=sparse_mode, n_heads=n_heads, dv=NOPE_DIM, load_q=load_q, load_kv=load_kv,
                        scale_value=scale_value, qdtype=qdt, precision=precision,
                        probability_rounding=probability_rounding, chunk_size=chunk_size)
    return _shape_outputs(out, mx, sm, layout_query, query.shape, return_softmax_lse, exact)


# ----------------------------------------------------------------------------------------------------
# SFA


def sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                           actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                           key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                           sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1, attention_mode=0,
                           return_softmax_lse=False, sinks=None, lse_includes_sink=False,
                           precision="faithful", probability_rounding="unnormalised", chunk_size=2048):
    """SFA over a float (fp16/bf16) KV (the oracle of ``qsfa.sparse_flash_attention``).

    query ``[..., Q_N, D]``, key ``[..., 1, D]``, value ``[..., 1, D]`` or ``None`` (then V = key),
    optional query_rope ``[..., Q_N, 64]`` / key_rope ``[..., 1, 64]`` (both or neither), all in one
    16-bit dtype. Scores use ``[query, query_rope] . [key, key_rope]``. sinks: fp32 ``[Q_N]``, one extra
    logit per head joining the softmax denominator without a value:
    ``out = out_without_sink / (1 + exp(sink - lse))``; the returned LSE excludes the sink unless
    ``lse_includes_sink`` (**OPEN**, default False as in FlashMLA/FlashInfer), in which case
    ``softmax_sum`` gains ``exp(sink - softmax_max)``. Other rules as the module docstring.
    """
    _check_common(precision, probability_rounding)
    exact = precision == "exact"
    fdt = np.float64 if exact else np.float32
    qdt = _qdt_name(query)
    n_heads = query.shape[-2]
    d = query.shape[-1]
    has_rope = query_rope is not None
    dr = query_rope.shape[-1] if has_rope else 0
    q2d = query.reshape(-1, n_heads, d)
    qr2d = query_rope.reshape(-1, n_heads, dr) if has_rope else None
    k2d = key.reshape(-1, key.shape[-1])
    kr2d = key_rope.reshape(-1, dr) if has_rope else None
    v2d = None if value is None else value.reshape(-1, value.shape[-1])
    dv = key.shape[-1] if value is None else value.shape[-1]

    def load_q(r):
        q = np.empty((r.size, n_heads, d + dr), fdt)
        q[..., :d] = q2d[r]
        if has_rope:
            q[..., d:] = qr2d[r]
        return q

    def load_kv(storage, valid):
        c, w = storage.shape
        flat = storage.reshape(-1)
        bad = ~valid.reshape(-1)
        k = np.empty((flat.size, d + dr), fdt)
        k[:, :d] = k2d[flat]
        if has_rope:
            k[:, d:] = kr2d[flat]
        k[bad] = 0
        k = k.reshape(c, w, d + dr)
        if v2d is None:
            return k, k[..., :dv]
        v = v2d[flat].astype(fdt)
        v[bad] = 0
        return k, v.reshape(c, w, dv)

    rows, kvm = _rows_and_kv(query, key, layout_query, layout_kv, actual_seq_lengths_query,
                             actual_seq_lengths_kv, block_table)
    out, mx, sm = _core(rows=rows, kvm=kvm, indices=sparse_indices, sparse_block_size=sparse_block_size,
                        sparse_mode=sparse_mode, n_heads=n_heads, dv=dv, load_q=load_q, load_kv=load_kv,
                        scale_value=scale_value, qdtype=qdt, precision=precision,
                        probability_rounding=probability_rounding, chunk_size=chunk_size, sinks=sinks,
                        lse_includes_sink=lse_includes_sink)
    return _shape_outputs(out, mx, sm, layout_query, query.shape, return_softmax_lse, exact)


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
              chunk_size=2048):
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
                  probability_rounding=probability_rounding, chunk_size=chunk_size)
    if is_quant_key(key):
        from .._arrays import dtype_name

        q = query if query_rope is None else np.concatenate([query, query_rope], axis=-1)
        if rope_head_dim is None:
            rope_head_dim = {656: 64, 528: 0}.get(int(key.shape[-1]), 64)
        if key_dtype is None:
            key_dtype = "float8_e4m3fn" if dtype_name(key) == "float8_e4m3fn" else "int8"
        return kv_quant_sparse_flash_attention(q, key, key if value is None else value, sparse_indices,
                                               scale_value, key_dtype=key_dtype, rope_head_dim=rope_head_dim,
                                               **common)
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
