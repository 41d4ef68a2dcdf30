"""Rounding helpers shared by the qsfa Triton kernels, exact on every Triton target.

Why these exist (measured with triton 3.9; see tests/test_triton_kernels.py::test_rounding_helpers_*):

* ``x.to(tl.bfloat16)`` from fp32 is RNE on a GPU (LLVM ``fptrunc``) but the CPU interpreter
  (``TRITON_INTERPRET=1``) *truncates* (its ``_convert_float`` drops the low 16 bits), so results differ by
  up to one bf16 ulp. :func:`f32_to_bf16_rne` rounds explicitly on the fp32 bit pattern (integer add of
  ``0x7FFF + lsb`` then shift), which is the same on every target. Finite inputs only (the kernels never
  feed it inf/nan); overflow past the largest bf16 correctly becomes inf.
* ``x.to(tl.float32)`` from bf16 is exact on a GPU, but the interpreter's converter mangles bf16
  *subnormals* (1e-39 comes back as 4.4e-39, 5e-41 as 0). :func:`bf16_to_f32` widens through the bit
  pattern (``bits << 16``), exact everywhere; :func:`to_f32` picks it for bf16 inputs.
* ``x.to(tl.float16)`` from fp32 is RNE everywhere (numpy ``astype`` in the interpreter, ``cvt.rn`` on a
  GPU). :func:`f32_to_f16_round` gives round-half-away-from-zero (docs/numerics/formats.md#rounding-modes) on top of it by
  detecting exact ties: ``d = x - rne(x)`` is exact, and ``x`` is a tie iff ``rne(x) + 2d`` is the other
  fp16 neighbour.
* RINT of an fp32 value of magnitude < 2**22 is ``(y + 1.5*2**23) - 1.5*2**23`` (the add rounds to an
  integer with ties to even because the sum's ulp is 1). It needs no libdevice (the interpreter has
  none) and no fast-math; Triton never reassociates float adds. :func:`rint_small`.
* ``tl.dot`` under the interpreter multiplies bf16 operands as their raw uint16 bit patterns (it calls
  ``np.matmul`` on the storage), so kernels upcast dot operands to fp32 when :func:`interpreting` is true.
  bf16*bf16 and fp16*fp16 products are exact in fp32, so this changes nothing but speed.
* fp32 division: ``/`` may lower to an approximate division on a GPU; the kernels use
  ``tl.math.div_rn`` (correctly rounded on a GPU, ``np.divide`` in the interpreter).
* fp32 -> FP8 E4M3FN: the interpreter's RTNE conversion adds the first dropped bit (round half *up*,
  no ties-to-even) and can lose the mantissa carry into the exponent, so the C8 writer encodes FP8 by
  bit arithmetic (kernels/c8_cache_writer.py ``_encode_e4m3fn``); decoding is bit arithmetic too.
* mul + add contraction: the interpreter rounds every operation (numpy), while the GPU backend fuses
  ``a * b + c`` into one fma unless told not to; both kernels launch with ``enable_fp_fusion=False``.
* ``tl.exp``: numpy's float32 exp in the interpreter, an ``ex2.approx``-based sequence on GPUs (a last-bit
  difference in P; no helper - the attention tolerance covers it).
* static ``if`` scoping, dtype rules of loop-carried values and shared-memory limits are only checked by
  the compiler, never by the interpreter: tests/test_triton_compile.py compiles for sm_90 without a GPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["interpreting", "bf16_to_f32", "to_f32", "f32_to_bf16_rne", "f32_to_bf16_round", "f32_to_f16_round",
           "f32_to_f16_rne",
           "round_to_dtype", "rint_small", "ROUND_RINT", "ROUND_AWAY"]

#: rounding-mode codes used as constexpr kernel arguments
ROUND_RINT = 0  # round half to even
ROUND_AWAY = 1  # round half away from zero (ROUND in docs/numerics/formats.md#rounding-modes)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def bf16_to_f32(x):
    """bf16 -> fp32, exact (subnormals included), via the bit pattern."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def to_f32(x, IS_BF16: tl.constexpr):
    """Exact widening of a bf16 (IS_BF16) or fp16 tensor to fp32."""
    if IS_BF16:
        return bf16_to_f32(x)
    else:
        return x.to(tl.float32)


@triton.jit
def f32_to_bf16_rne(x):
    """fp32 -> bf16, round half to even, via the fp32 bit pattern (finite inputs)."""
    b = x.to(tl.uint32, bitcast=True)
    b = b + (0x7FFF + ((b >> 16) & 1))
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def f32_to_bf16_round(x):
    """fp32 -> bf16, round half away from zero, via the fp32 bit pattern (finite inputs): adding half a bf16 ulp
    to the sign-magnitude bits rounds the magnitude half up."""
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x8000
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def f32_to_f16_rne(x):
    """fp32 -> fp16, round half to even (native conversion; RNE on every target)."""
    return x.to(tl.float16)


@triton.jit
def f32_to_f16_round(x):
    """fp32 -> fp16, round half away from zero (exact tie detection on top of the RNE conversion)."""
    r16 = x.to(tl.float16)
    r = r16.to(tl.float32)
    d = x - r
    other = r + 2.0 * d
    is_tie = (d != 0.0) & (other.to(tl.float16).to(tl.float32) == other)
    away = is_tie & (tl.abs(x) > tl.abs(r))
    return tl.where(away, other.to(tl.float16), r16)


@triton.jit
def round_to_dtype(x, IS_BF16: tl.constexpr, MODE: tl.constexpr):
    """fp32 -> the query dtype (bf16 when IS_BF16 else fp16) with rounding MODE (ROUND_RINT / ROUND_AWAY)."""
    if IS_BF16:
        if MODE == 1:
            return f32_to_bf16_round(x)
        else:
            return f32_to_bf16_rne(x)
    else:
        if MODE == 1:
            return f32_to_f16_round(x)
        else:
            return f32_to_f16_rne(x)


@triton.jit
def rint_small(y):
    """Round half to even for |y| < 2**22 (fp32), without libdevice. A result of zero is +0 (the sign of
    zero is lost; callers convert to integers)."""
    return (y + 12582912.0) - 12582912.0
