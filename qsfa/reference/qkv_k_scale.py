"""``qkv_rms_norm_rope_cache_with_k_scale`` (Ascend 950), its RoPE scenario: RMSNorm + half-split RoPE of the Q and
K heads of a fused QKV row, a bf16 rotation GEMM, per-token-head FP8 E4M3FN quantisation, V scaled per head to
FP8, and the K / V / K-scale caches written by slot. Documented in
``docs/numerics/cache-writers.md#qkv_rms_norm_rope_cache_with_k_scale``.

Source: cannmirror/ops-transformer@c4f5cf7 ``posembedding/qkv_rms_norm_rope_cache_with_k_scale/`` - the kernel
``op_kernel/arch35/qkv_rms_norm_rope_cache_with_k_scale_vf.h`` fixes every rounding point of the vector side:

    x      = fp32(bf16 qkv)                                         exact
    ss     = RN32(sum_{d<64} RN32(x_d^2 + x_{d+64}^2))              Mul, Add of the halves, Reduce SUM
    rms    = sqrt(RN32(ss * fp32(1/128)) + fp32(eps))               Muls, Adds, Sqrt
    y      = RN32(RN32(x / rms) * gamma)                            Div, Mul
    lo, hi = RN32(RN32(y_lo c) - RN32(y_hi s)), RN32(RN32(y_hi c) + RN32(y_lo s))   c, s = cos_sin[pos, :64 / 64:]
    a      = bf16_RINT(lo, hi)                                      CAST_RINT, the cube's A operand (bf16, L1)
    r      = a @ rotation                                           cube: bf16 x bf16, fp32 out
    scale  = RN32(max_d |r_d| / 448),  code = fp8_RINT_SAT(RN32(r / scale))   Div, Div, CAST_RINT with SAT
    v      = fp8_RINT_SAT(RN32(fp32(bf16 v) * v_scale[head]))

The M-RoPE scenario (``mrope_position`` given; hicann/ops-transformer@6c2c05f ``op_kernel/arch35/..._vf.h``,
``tests/assets/..._kernel_golden.py``; recursion-ascend/ops-transformer@a093e95 ``op_kernel/arch35/..._cube.h``)
changes three things. Each token has three positions (T, H, W) and every RoPE lane ``l < 64`` takes its cos / sin
column ``l`` from one of them: H where ``l % 3 == 1 and l // 3 < h``, W where ``l % 3 == 2 and l // 3 < w``, T
otherwise (``mrope_section = [t, h, w]``; the kernel gathers from the three raw rows). Q is not quantised: the cube's
fp32 result leaves through the fixpipe as bf16 (``F322BF16``, to nearest even). K is quantised to INT8 per token and
head:

    scale  = RN32(max_d |r_d| / 127),  y = RN32(r / scale)          Div, Div
    code   = int8_RINT_SAT(fp16_RINT(y))                            CAST_F32_TO_FP16 (NO_SAT), CAST_FP16_TO_INT8 (SAT)

(two roundings: a ``y`` just below a half, such as 3.4995, becomes 3.5 in fp16 and then 4). V is scaled per head and
lane (``v_scale [Nv, 128]``).

The rotation GEMM's fp32 accumulation order inside the cube is not published: each output is modelled as the
correctly rounded sum of its 128 exact bf16 x bf16 products (docs/numerics/open-facts.md#qkv-rotation-sum), as
the indexers' cube sums are. The Reduce SUM of RMSNorm is modelled the same way. Positions: token ``i`` of batch
``b`` is at ``seq_lens[b] - (query_start_loc[b + 1] - query_start_loc[b]) + i`` (0 + i when seq_lens is the
smaller, the kernel's ``CopyCosSinTile``). An all-zero Q / K head gives ``scale = 0`` and ``0 / 0``:
``zero_head`` (docs/numerics/open-facts.md#qkv-zero-head) says what its codes are.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .attention import certified_f32, exact_sum_f32, sum_error_bound
from .k_scale_cache import scatter_pa_kv_cache_with_k_scale
from .rmsnorm_rope import interleave_rope_f32, rms_norm_f32

__all__ = ["qkv_rms_norm_rope_cache_with_k_scale", "positions", "rope_half_split_f32", "rotate_bf16",
           "quant_per_head_fp8", "ZERO_HEAD", "FP8_MAX", "INT8_MAX", "mrope_lane_axes", "mrope_cos_sin",
           "quant_per_head_int8"]

FP8_MAX = np.float32(448.0)
#: what an all-zero head's codes are (0 / 0 in the kernel): "zero" (qsfa's default) or "nan" (the E4M3FN NaN 0x7F)
ZERO_HEAD = ("zero", "nan")
D = 128
INT8_MAX = np.float32(127.0)


def mrope_lane_axes(mrope_section) -> np.ndarray:
    """Which position stream (0 = T, 1 = H, 2 = W) each of the 64 RoPE lanes reads (int64 [64])."""
    _, h, w = (int(v) for v in mrope_section)
    lane = np.arange(D // 2)
    axes = np.zeros(D // 2, np.int64)
    axes[(lane % 3 == 1) & (lane // 3 < h)] = 1
    axes[(lane % 3 == 2) & (lane // 3 < w)] = 2
    return axes


def mrope_cos_sin(cos_sin, mrope_position, mrope_section):
    """``(cos, sin)`` float32 ``[T, 64]`` of the M-RoPE scenario: lane ``l`` of token ``u`` reads row
    ``mrope_position[u, axis(l)]`` of ``cos_sin`` at columns ``l`` (cos) and ``64 + l`` (sin)."""
    table = np.asarray(cos_sin, np.float32)
    pos = np.asarray(mrope_position, np.int64).reshape(-1, 3)
    rows = pos[:, mrope_lane_axes(mrope_section)]  # [T, 64]
    lane = np.arange(D // 2)[None, :]
    return table[rows, lane], table[rows, D // 2 + lane]


def positions(query_start_loc, seq_lens, n_tokens: int) -> np.ndarray:
    """RoPE position of every token (int64 [T])."""
    qsl = np.asarray(query_start_loc, np.int64).reshape(-1)
    sl = np.asarray(seq_lens, np.int64).reshape(-1)
    t = np.arange(n_tokens, dtype=np.int64)
    b = np.clip(np.searchsorted(qsl, t, side="right") - 1, 0, max(sl.size - 1, 0))
    local = qsl[b + 1] - qsl[b]
    hist = np.where(sl[b] > local, sl[b] - local, 0)
    return hist + t - qsl[b]


def rope_half_split_f32(y: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split RoPE in fp32: ``[y_lo c - y_hi s, y_hi c + y_lo s]`` (two products and one add / subtract, no
    FMA). ``cos`` / ``sin`` ``[..., D/2]`` broadcast against ``y [..., D]``. Written through
    :func:`interleave_rope_f32` (the same three fp32 operations per element) on the halves interleaved."""
    h = y.shape[-1] // 2
    il = np.empty(y.shape, np.float32)
    il[..., 0::2], il[..., 1::2] = y[..., :h], y[..., h:]
    c2 = np.concatenate([cos, cos], axis=-1)
    s2 = np.concatenate([sin, sin], axis=-1)
    return interleave_rope_f32(il, c2, s2)


def rotate_bf16(a: np.ndarray, rotation: np.ndarray) -> np.ndarray:
    """``a [M, D]`` (bf16) @ ``rotation [D, D]`` (bf16): every output RN32 of the exact sum of its D products
    (float32 [M, D]); certified from a float64 product, exact sums where float64 cannot decide."""
    a64 = np.asarray(a).astype(np.float64)
    r64 = np.asarray(rotation).astype(np.float64)
    approx = a64 @ r64
    bound = sum_error_bound(a64.shape[1], np.abs(a64) @ np.abs(r64))
    n = r64.shape[1]

    def exact(i):
        return exact_sum_f32(a64[i // n, :] * r64[:, i % n].T)  # bf16 x bf16: exact in float64

    out = certified_f32(approx, bound, exact)
    return out + np.float32(0)  # -0 -> +0 (an accumulator starting at +0)


def quant_per_head_fp8(r: np.ndarray, zero_head: str = "zero"):
    """Per-row dynamic FP8 E4M3FN quantisation of ``r [..., D]`` (float32): ``(codes uint8 [..., D], scale float32
    [...])`` with ``scale = RN32(amax / 448)`` and ``code = fp8_RINT_SAT(RN32(r / scale))``."""
    amax = np.abs(r).max(axis=-1)
    scale = (amax / FP8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    y = np.clip(r / safe[..., None], -FP8_MAX, FP8_MAX)  # SAT: beyond +-448 (only NaN / inf reach it) -> +-448
    codes = y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    zero = scale == 0
    if zero.any():
        codes[zero] = 0x7F if zero_head == "nan" else 0x00
    return codes, scale


def quant_per_head_int8(r: np.ndarray):
    """Per-row dynamic INT8 quantisation of ``r [..., D]`` (float32), the M-RoPE scenario's K: ``(codes int8 [...,
    D], scale float32 [...])`` with ``scale = RN32(amax / 127)``, ``y = RN32(r / scale)``, ``code =
    int8_RINT_SAT(fp16_RINT(y))``. An all-zero row (0 / 0 in the kernel) gets codes 0: INT8 has no NaN code."""
    amax = np.abs(r).max(axis=-1)
    scale = (amax / INT8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    y = (r / safe[..., None]).astype(np.float32)
    h = y.astype(np.float16)  # CAST_RINT, NO_SAT (|y| <= 127 and a little)
    codes = np.clip(np.rint(h.astype(np.float32)), -128, 127).astype(np.int8)  # CAST_RINT with SAT
    codes[scale == 0] = 0
    return codes, scale


def qkv_rms_norm_rope_cache_with_k_scale(qkv, q_gamma, k_gamma, cos_sin, slot_mapping, k_cache, v_cache,
                                         k_scale_cache, query_start_loc, seq_lens, head_nums, *, rotation=None,
                                         v_scale=None, layout_qkv="TND", layout_q_out="NTD", epsilon=1e-6,
                                         mrope_position=None, mrope_section=None, q_quant_mode="PerTokenPerHead",
                                         q_out_dtype="float8_e4m3fn", k_quant_mode="PerTokenPerHead",
                                         zero_head="zero"):
    """The RoPE scenario, or the M-RoPE one when ``mrope_position`` is given (module docstring). ``qkv`` bf16
    ``[T, Nq+Nk+Nv, 128]`` (TND) or ``[N, T, 128]`` (NTD);
    writes ``k_cache`` / ``v_cache`` (float8_e4m3fn ``[BlockNum, Nk, BlockSize, 128]``) and ``k_scale_cache``
    (float32 ``[BlockNum, Nk, BlockSize, 1]``) in place; returns ``(q_out float8_e4m3fn, q_scale float32, k_cache,
    v_cache, k_scale_cache)`` with q_out ``[Nq, T, 128]`` / ``[T, Nq, 128]`` and q_scale ``[Nq, T]`` / ``[T, Nq]``
    by ``layout_q_out``. M-RoPE: q_out bfloat16 ``[T, Nq, 128]``, q_scale None, ``k_cache`` int8."""
    mrope = mrope_position is not None
    assert k_quant_mode == "PerTokenPerHead" and zero_head in ZERO_HEAD
    assert q_quant_mode == ("NoQuant" if mrope else "PerTokenPerHead")
    nq, nk, nv = (int(h) for h in head_nums)
    x = np.asarray(qkv)
    if layout_qkv == "NTD":
        x = x.transpose(1, 0, 2)
    t = x.shape[0]
    if mrope:
        cos, sin = mrope_cos_sin(cos_sin, mrope_position, mrope_section)
    else:
        cs = np.asarray(cos_sin, np.float32)[positions(query_start_loc, seq_lens, t)]  # [T, D]
        cos, sin = cs[:, :D // 2], cs[:, D // 2:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rots = []
    for lo, hi, gamma in ((0, nq, q_gamma), (nq, nq + nk, k_gamma)):
        y = rms_norm_f32(x[:, lo:hi], gamma, epsilon, halves_first=True)
        a = rope_half_split_f32(y, cos, sin).astype(ml_dtypes.bfloat16)  # CAST_RINT
        rots.append(rotate_bf16(a.reshape(-1, D), rotation).reshape(t, hi - lo, D))
    vs = np.asarray(v_scale, np.float32)
    v = x[:, nq + nk:].astype(np.float32) * (vs[None] if mrope else vs[None, :, None])
    v_codes = np.clip(v, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    if mrope:
        k_codes, k_scale = quant_per_head_int8(rots[1])
        scatter_pa_kv_cache_with_k_scale(k_codes, v_codes, k_cache, v_cache, slot_mapping, k_scale, k_scale_cache)
        return rots[0].astype(ml_dtypes.bfloat16), None, k_cache, v_cache, k_scale_cache  # F322BF16; TND only
    (q_codes, q_scale), (k_codes, k_scale) = (quant_per_head_fp8(r, zero_head) for r in rots)
    scatter_pa_kv_cache_with_k_scale(k_codes.view(ml_dtypes.float8_e4m3fn), v_codes, k_cache, v_cache, slot_mapping,
                                     k_scale, k_scale_cache)
    q_out = q_codes.view(ml_dtypes.float8_e4m3fn)
    if layout_q_out == "NTD":
        q_out, q_scale = np.ascontiguousarray(q_out.transpose(1, 0, 2)), np.ascontiguousarray(q_scale.T)
    return q_out, q_scale, k_cache, v_cache, k_scale_cache
