"""Triton kernel: merge_attention_lse, docs/numerics/attention.md#merge_attention_lse.

One program per (row, block of BLOCK_D output columns); a row is one (query token, head) of the stacked
partial results ``attention_out [P, R, D]``, ``softmax_max / softmax_sum [P, R]``. In float64, as the
reference (qsfa/reference/lse.py) and in its operation order:

    m   = max over present shards (l_p > 0) of m_p, or 0 when no shard is present
    w_p = l_p * exp(m_p - m) for a present shard, else 0
    l   = ((0 + w_0) + w_1) + ...                   (NumPy's axis-0 reduction: this sequential sum from +0)
    out = ((0 + w_0 o_0) + w_1 o_1 + ...) / l       (0 when no shard is present)

and rounded once from float64 to the inputs' dtypes: bfloat16 RINT and float16 ROUND (half away) through a
round-to-odd float32 intermediate (exact: 24 bits >= 16-bit mantissa + 2, as qsfa.reference.formats does),
float32 by the native RNE conversion, float64 as is; softmax_max / softmax_sum in their own dtype (float32 RNE).
Every operation but ``exp`` is IEEE-exact, so the bytes equal the reference's wherever both compute the same
float64 ``exp``: always in the interpreter (both call NumPy's), and on a GPU except where libdevice's ``exp``
(within 1 ulp) and the host's differ and the float64 result lies within that ulp of a rounding boundary of the
output dtype (the reference's own cross-machine caveat).

Inputs are widened exactly: bf16 through its bit pattern (the interpreter's bf16 conversion mangles
subnormals, kernels/_common.py), fp16 / fp32 natively.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import bf16_to_f32, f32_to_bf16_rne, f32_to_f16_round

__all__ = ["merge_lse_kernel", "launch_merge_attention_lse", "KIND_BF16", "KIND_F16", "KIND_F32", "KIND_F64"]

#: element kinds of the OUT_KIND constexpr
KIND_BF16, KIND_F16, KIND_F32, KIND_F64 = 0, 1, 2, 3


@triton.jit
def _widen64(x, KIND: tl.constexpr):
    """Exact widening of a bf16 / fp16 / fp32 / fp64 tensor to float64."""
    if KIND == 0:
        return bf16_to_f32(x).to(tl.float64)
    elif KIND == 3:
        return x
    else:
        return x.to(tl.float32).to(tl.float64)


@triton.jit
def f64_to_f32_odd(x):
    """float64 -> float32 rounded to odd (the magnitude truncated, its last bit set when inexact); finite x.
    A later round-to-nearest of the result to <= 22 bits equals the round-to-nearest of x itself."""
    r = x.to(tl.float32)  # RNE (cvt.rn.f32.f64 on a GPU, NumPy's cast in the interpreter)
    rb = r.to(tl.int32, bitcast=True)
    r64 = r.to(tl.float64)
    exact = r64 == x
    over = tl.abs(r64) > tl.abs(x)  # rounded away from zero: step the magnitude back by one ulp
    tb = tl.where(over, rb - 1, rb)
    tb = tl.where(exact, rb, tb | 1)
    return tb.to(tl.float32, bitcast=True)


@triton.jit
def _narrow64(x, KIND: tl.constexpr):
    """float64 -> the output kind with the reference's rounding (bf16 RINT, fp16 ROUND, fp32 RNE)."""
    if KIND == 0:
        return f32_to_bf16_rne(f64_to_f32_odd(x))
    elif KIND == 1:
        return f32_to_f16_round(f64_to_f32_odd(x))
    elif KIND == 2:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def merge_lse_kernel(o_ptr, m_ptr, l_ptr, res_ptr, res_m_ptr, res_l_ptr, P, R, D,
                     OUT_KIND: tl.constexpr, STAT_F64: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    # the max over present shards
    m = tl.load(m_ptr + r).to(tl.float64)
    l0 = tl.load(l_ptr + r).to(tl.float64)
    m = tl.where(l0 > 0.0, m, float("-inf"))
    for p in range(1, P):
        mp = tl.load(m_ptr + p * R + r).to(tl.float64)
        lp = tl.load(l_ptr + p * R + r).to(tl.float64)
        m = tl.where(lp > 0.0, tl.maximum(m, mp), m)
    anyp = m != float("-inf")
    m = tl.where(anyp, m, 0.0)

    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    # sums start from +0, as NumPy's add.reduce does (so an all -0 column merges to +0, as in the reference)
    l = tl.zeros((), tl.float64)
    acc = tl.zeros([BLOCK_D], tl.float64)
    for p in range(0, P):
        mp = tl.load(m_ptr + p * R + r).to(tl.float64)
        lp = tl.load(l_ptr + p * R + r).to(tl.float64)
        w = tl.where(lp > 0.0, lp * tl.exp(tl.where(lp > 0.0, mp - m, 0.0)), 0.0)  # mp - m: the same bits
        l = l + w
        acc = acc + w * _widen64(tl.load(o_ptr + (p * R + r) * D + cols, mask=cm, other=0.0), OUT_KIND)
    safe = tl.where(anyp, l, 1.0)
    out = acc / safe  # float64 division is IEEE (div.rn.f64 on a GPU)
    out = tl.where(anyp, out, 0.0)
    tl.store(res_ptr + r * D + cols, _narrow64(out, OUT_KIND), mask=cm)
    if pid_d == 0:
        if STAT_F64:
            tl.store(res_m_ptr + r, m)
            tl.store(res_l_ptr + r, l)
        else:
            tl.store(res_m_ptr + r, m.to(tl.float32))
            tl.store(res_l_ptr + r, l.to(tl.float32))


def launch_merge_attention_lse(attention_out, softmax_max, softmax_sum, *, layout_query="BSND", block_d=None):
    """Merge P partial results (torch tensors on one device, validated by the operator contract).

    attention_out ``[P, B, S, N, D]`` (BSND) / ``[P, T, N, D]`` (TND), bfloat16 / float16 / float32 / float64;
    softmax_max, softmax_sum ``[P, B, 1, S, N]`` / ``[P, 1, T, N]``, float32 or float64 (one dtype).
    Returns ``(attention_out [B, S, N, D] / [T, N, D], softmax_max, softmax_sum)`` in the input dtypes.
    """
    import torch

    kinds = {torch.bfloat16: KIND_BF16, torch.float16: KIND_F16, torch.float32: KIND_F32, torch.float64: KIND_F64}
    if attention_out.dtype not in kinds:
        raise ValueError(f"attention_out dtype must be bfloat16, float16, float32 or float64, got {attention_out.dtype}")
    if softmax_max.dtype not in (torch.float32, torch.float64) or softmax_sum.dtype != softmax_max.dtype:
        raise ValueError("softmax_max and softmax_sum must be both float32 or both float64")
    if layout_query not in ("BSND", "TND"):
        raise ValueError(f"layout_query must be 'BSND' or 'TND', got {layout_query!r}")
    P = int(attention_out.shape[0])
    D = int(attention_out.shape[-1])
    out_shape = tuple(attention_out.shape[1:])
    stat_shape = tuple(softmax_max.shape[1:])
    R = 1
    for n in out_shape[:-1]:
        R *= int(n)
    dev = attention_out.device
    o = attention_out.reshape(P, R, D).contiguous()
    m = softmax_max.reshape(P, R).contiguous()
    s = softmax_sum.reshape(P, R).contiguous()
    res = torch.empty((R, D), dtype=attention_out.dtype, device=dev)
    res_m = torch.empty((R,), dtype=softmax_max.dtype, device=dev)
    res_l = torch.empty((R,), dtype=softmax_max.dtype, device=dev)
    if block_d is None:
        block_d = min(512, triton.next_power_of_2(max(D, 1)))
    if R > 0 and P > 0:
        merge_lse_kernel[(R, max(1, triton.cdiv(D, block_d)))](
            o, m, s, res, res_m, res_l, P, R, D, OUT_KIND=kinds[attention_out.dtype],
            STAT_F64=softmax_max.dtype == torch.float64, BLOCK_D=block_d, num_warps=4,
            enable_fp_fusion=False)  # keep w * o and the add as two roundings, as NumPy does
    return res.reshape(out_shape), res_m.reshape(stat_shape), res_l.reshape(stat_shape)
