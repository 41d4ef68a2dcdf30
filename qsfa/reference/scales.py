"""Reference scale rules (docs/numerics/quantisers.md#scale-rules): per-group (tile) scales, fp32 arithmetic exactly as stated.

amax = max |x| over a group, computed in fp32 (fp16 / bf16 inputs widen exactly). Every function takes
amax (or a scale) as an array (any shape; converted to float32) and returns float32 / raw codes of the
same shape. The arithmetic order of each rule is part of its definition (a divide and a multiply by a
rounded reciprocal differ in the last bit), so each docstring states it.

==========================  =========================================================================
rule                        docs/numerics/quantisers.md#scale-rules
==========================  =========================================================================
int8 dynamic                ``s = amax / 127``; ``q = clamp(RINT(x / s), -127, 127)``; s is the dequant
                            scale (x ~ q*s). The order x/s vs x*(127/amax) is OPEN (``order``).
dynamic block quant         ``s = min(amax / TYPE_MAX, 1 / min_scale)`` (min_scale 0 = no bound)
fp8 group (KvCompressEpilog) ``amax' = max(amax, 1e-4)``; ``s = amax' * fp32(1/448)`` (0x3B124925)
round_scale                 ceil s to a power of two: ``e = (b >> 23) + ((b & 0x7FFFFF) != 0); s = e << 23``
e8m0 store                  ``byte = (bits(s) >> 23) & 0xFF`` (the floor exponent of s)
fp4 group (mode 2)          stored ``BF16_RINT(amax * fp32(1/6))``; multiplier ``BF16_RINT(6 / amax)``
FlashMLA V32                ``s = 2^ceil(log2(max(amax / 448, 1e-4)))`` (interop only)
OCP MX                      ``e = floor(log2(amax)) - emax_elem`` (interop only)
==========================  =========================================================================
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

from .formats import encode

__all__ = [
    "RECIP_448",
    "RECIP_6",
    "FP8_AMAX_FLOOR",
    "TYPE_MAX",
    "MX_ELEM_EMAX",
    "INT8_DYNAMIC_ORDERS",
    "group_amax",
    "int8_dynamic_scale",
    "int8_dynamic_quant",
    "dynamic_block_scale",
    "fp8_group_scale",
    "round_scale_pow2",
    "e8m0_byte",
    "Fp4GroupScale",
    "fp4_group_scale",
    "flashmla_v32_scale",
    "ocp_mx_scale_exponent",
]

_F32 = np.float32
_U32 = np.uint32

#: fp32(1/448) = 0x3B124925, the rounded reciprocal KvCompressEpilog multiplies by.
RECIP_448 = np.array(0x3B124925, _U32).view(_F32)[()]
#: fp32(1/6) = 0x3E2AAAAB (fp4 group scale, KvCompressEpilog mode 2).
RECIP_6 = _F32(1.0 / 6.0)
#: The amax floor of the fp8 group rule and of FlashMLA (fp32(1e-4)).
FP8_AMAX_FLOOR = _F32(1e-4)

#: TYPE_MAX of the dynamic block quant rule per destination format (docs/numerics/quantisers.md#dynamic-block-scale). E5M2 uses its
#: largest finite value (57344), as npu_dynamic_block_quant's 950 variant does for dst_type_max = 0.
TYPE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "hifloat8": 32768.0}

#: emax of the element formats of the OCP MX spec (largest binade exponent of the element format).
MX_ELEM_EMAX = {"float8_e4m3fn": 8, "float8_e5m2": 15, "float4_e2m1": 2, "int8": 0}

#: Orders of the int8 dynamic quant (docs/numerics/open-facts.md#scale_order, OPEN): "divide" = x / s (aclnn doc, default);
#: "multiply" = x * fp32(127 / amax) (the op-plugin test golden).
INT8_DYNAMIC_ORDERS = ("divide", "multiply")


def _f32(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype == np.float32 else a.astype(np.float32)


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(_f32(a)).view(_U32)


def group_amax(x, group: int) -> np.ndarray:
    """max |x| over consecutive groups of ``group`` elements along the last axis, in fp32.

    x: ``[..., N]`` float32 / float16 / bfloat16 (widened exactly). The last group may be partial
    (amax over the elements that exist). Returns float32 ``[..., ceil(N / group)]``.
    """
    xf = _f32(x)
    n = xf.shape[-1]
    g = -(-n // group)
    pad = g * group - n
    a = np.abs(xf)
    if pad:
        a = np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), np.float32)], axis=-1)
    return a.reshape(a.shape[:-1] + (g, group)).max(axis=-1)


def int8_dynamic_scale(amax) -> np.ndarray:
    """int8 dynamic scale ``s = amax / 127`` (fp32 divide); s is the dequant scale (x ~ q*s).

    An all-zero group gives s = 0 (with q = 0 in :func:`int8_dynamic_quant`; **OPEN** on hardware).
    """
    return _f32(amax) / _F32(127.0)


def int8_dynamic_quant(x, *, group: int = 128, order: str = "divide"):
    """int8 dynamic quant of ``x`` in groups of ``group`` along the last axis (docs/numerics/quantisers.md#int8-dynamic, "int8 dynamic").

    x:     ``[..., N]`` float32 / float16 / bfloat16 (widened exactly to fp32). The last group may be
           partial.
    group: group (tile / col block) size; 128 for the QSFA C8 cache and npu_dynamic_block_quant.
    order: **OPEN** (docs/numerics/open-facts.md#scale_order): "divide" (default, aclnn doc) computes ``RINT(x / s)`` with
           ``s = amax / 127``; "multiply" computes ``RINT(x * fp32(127 / amax))`` (the op-plugin test
           golden, Ascend/op-plugin test/test_custom_ops/test_npu_dynamic_block_quant.py). They differ
           by one code at rare ties.

    q = clamp(RINT(.), -127, 127). An all-zero group gives s = 0 and q = 0 (**OPEN** on hardware).
    Returns ``(q int8 [..., N], s float32 [..., ceil(N / group)])``.
    """
    if order not in INT8_DYNAMIC_ORDERS:
        raise ValueError(f"Invalid value for order, actual: {order!r}, reason: must be one of {INT8_DYNAMIC_ORDERS}.")
    xf = _f32(x)
    n = xf.shape[-1]
    amax = group_amax(xf, group)
    s = int8_dynamic_scale(amax)
    g = amax.shape[-1]
    pad = g * group - n
    if pad:
        xf = np.concatenate([xf, np.zeros(xf.shape[:-1] + (pad,), np.float32)], axis=-1)
    xg = xf.reshape(xf.shape[:-1] + (g, group))
    zero = (amax == 0)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        if order == "divide":
            y = xg / s[..., None]
        else:
            y = xg * (_F32(127.0) / amax)[..., None]
    y = np.where(zero, _F32(0), y)
    q = np.clip(np.rint(y), -127, 127).astype(np.int8)
    q = q.reshape(q.shape[:-2] + (g * group,))[..., :n]
    return q, s


def dynamic_block_scale(amax, type_max, min_scale: float = 0.0) -> np.ndarray:
    """Dynamic block quant scale ``s = min(amax / TYPE_MAX, 1 / min_scale)`` in fp32
    (``npu_dynamic_block_quant``; min_scale 0 = no bound). q = cast(x / s) is the caller's step.

    type_max: a number, or a destination format name looked up in :data:`TYPE_MAX` (INT8 127,
    FP8 E4M3FN 448, E5M2 57344, HiF8 32768). Both divides are fp32.
    """
    tm = TYPE_MAX[type_max] if isinstance(type_max, str) else type_max
    s = _f32(amax) / _F32(tm)
    if min_scale:
        s = np.minimum(s, _F32(1.0) / _F32(min_scale))
    return s


def fp8_group_scale(amax) -> np.ndarray:
    """fp8 group scale of KvCompressEpilog (modes 0/1): ``amax' = max(amax, 1e-4)``;
    ``s = amax' * fp32(1/448)`` - an fp32 multiply by the rounded reciprocal 0x3B124925, not a divide.

    An all-zero group gives s = 1e-4 * fp32(1/448) = 2.2321e-7 (bits 0x346FACAD).
    """
    return np.maximum(_f32(amax), FP8_AMAX_FLOOR) * RECIP_448


def round_scale_pow2(s) -> np.ndarray:
    """round_scale: ceil ``s`` to a power of two by bit manipulation,
    ``b = bits(s); e = (b >> 23) + ((b & 0x7FFFFF) != 0); s = e << 23`` (float32).

    For positive s (normal or subnormal); s = 0 stays 0; an fp32 subnormal becomes 2^-126; a value
    above 2^127 becomes +Inf.
    """
    b = _bits(s)
    e = (b >> _U32(23)) + ((b & _U32(0x7FFFFF)) != 0).astype(_U32)
    return (e << _U32(23)).view(_F32)


def e8m0_byte(s) -> np.ndarray:
    """e8m0 store: ``byte = (bits(s) >> 23) & 0xFF``, the floor exponent of s (KvCompressEpilog mode 1),
    as uint8. Equals ``formats.encode(s, "float8_e8m0", rounding="floor")`` for s >= 0."""
    return ((_bits(s) >> _U32(23)) & _U32(0xFF)).astype(np.uint8)


class Fp4GroupScale(NamedTuple):
    """Result of :func:`fp4_group_scale`."""

    scale_bits: np.ndarray  #: uint16 bf16 bits of the stored scale BF16_RINT(amax * fp32(1/6))
    inv: np.ndarray  #: ml_dtypes.bfloat16 multiplier BF16_RINT(6 / amax) (0 where amax = 0)


def fp4_group_scale(amax) -> Fp4GroupScale:
    """fp4 group scale of KvCompressEpilog mode 2.

    stored scale = ``BF16_RINT(amax * fp32(1/6))`` (fp32 multiply, then round to bf16 half-even),
    returned as uint16 bf16 bits; multiplier ``inv = BF16_RINT(6 / amax)`` (fp32 divide, then bf16),
    returned as ml_dtypes.bfloat16, with inv = 0 for amax = 0 (then every code is 0 and the stored
    scale is 0x0000). The caller quantises ``clamp(bf16(x) * inv, +-6)`` multiplied in bf16.
    """
    a = _f32(amax)
    scale_bits = encode(a * RECIP_6, "bfloat16")
    with np.errstate(divide="ignore", over="ignore"):  # amax below ~1.8e-38: 6/amax is +Inf (kernel rule)
        inv32 = np.where(a == 0, _F32(0), _F32(6.0) / a).astype(np.float32)
    inv = encode(inv32, "bfloat16").view(ml_dtypes.bfloat16)
    return Fp4GroupScale(scale_bits, inv)


def flashmla_v32_scale(amax, *, ceil_mode: str = "bits") -> np.ndarray:
    """FlashMLA V32 tile scale ``s = 2^ceil(log2(max(amax / 448, 1e-4)))`` (interop only).

    amax / 448 is an fp32 divide, the 1e-4 floor applies after it. ceil_mode: "bits" (default) takes
    the exact power-of-two ceiling (:func:`round_scale_pow2`); "log2" evaluates ``ceil(log2(v))`` in
    float32 as FlashMLA's tests/quant.py does with torch, which can return 2^k for v a few ulps above
    2^k (float32 log2 rounds to the integer k).
    """
    v = np.maximum(_f32(amax) / _F32(448.0), FP8_AMAX_FLOOR)
    if ceil_mode == "bits":
        return round_scale_pow2(v)
    if ceil_mode == "log2":
        return np.exp2(np.ceil(np.log2(v))).astype(np.float32)
    raise ValueError(f"Invalid value for ceil_mode, actual: {ceil_mode!r}, reason: must be one of ('bits', 'log2').")


def ocp_mx_scale_exponent(amax, elem_emax) -> np.ndarray:
    """OCP MX shared scale exponent ``e = floor(log2(amax)) - emax_elem`` (interop only), int32.

    elem_emax: an int, or an element format name from :data:`MX_ELEM_EMAX` (E4M3 8, E5M2 15, E2M1 2,
    int8 0). floor(log2) is exact (frexp; fp32 subnormals included). The result is clamped to the
    E8M0 range [-127, 127] (the E8M0 byte is e + 127); amax = 0 gives -127 (qsfa's choice: the spec
    leaves a zero block's scale free); a non-finite amax gives 128 (byte 255 = NaN).
    """
    emax = MX_ELEM_EMAX[elem_emax] if isinstance(elem_emax, str) else int(elem_emax)
    a = _f32(amax)
    _, ex = np.frexp(a)
    e = ex.astype(np.int32) - 1 - emax
    e = np.clip(e, -127, 127)
    e = np.where(a == 0, np.int32(-127), e)
    e = np.where(np.isfinite(a), e, np.int32(128))
    return e.astype(np.int32)
