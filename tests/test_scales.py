"""Scale rules of docs/numerics/quantisers.md#scale-rules.

Expected values are computed independently: fp32 results of one +, * or / of two float32 values are
obtained as the float64 result rounded once to float32 (correctly rounded: 53 >= 2*24 + 2), powers of
two through math.frexp, bf16 through ml_dtypes (RNE on finite values), and the worked numbers of docs/numerics/quantisers.md#zero-groups.
"""

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qsfa.reference import formats as F
from qsfa.reference import scales as S

f32 = np.float32
F32MAX = float(np.finfo(np.float32).max)
F32MIN = float(np.finfo(np.float32).smallest_subnormal)


def fl(v):
    """Round a float64 (the exact result of one float32 operation) once to float32."""
    return np.asarray(v, np.float64).astype(np.float32)


def bits(v):
    return np.asarray(v, np.float32).view(np.uint32)


def test_constants():
    assert int(bits(S.RECIP_448)) == 0x3B124925
    assert int(bits(S.RECIP_6)) == 0x3E2AAAAB
    assert S.FP8_AMAX_FLOOR == f32(1e-4)


def test_all_zero_fp8_group_spec_example():
    """docs/numerics/quantisers.md#zero-groups: 1e-4 floor gives s = 2.2321e-7; with round_scale 2^-22 (E8M0 0x69, BF16 0x3480); without it
    E8M0 0x68, BF16 0x3470."""
    s = S.fp8_group_scale(np.zeros(3, np.float32))
    expect = fl(np.float64(f32(1e-4)) * np.float64(np.array(0x3B124925, np.uint32).view(np.float32)))
    np.testing.assert_array_equal(bits(s), bits(expect))
    assert f"{float(s[0]):.4e}" == "2.2321e-07"
    r = S.round_scale_pow2(s)
    assert (r == 2.0**-22).all()
    assert S.e8m0_byte(r).tolist() == [0x69] * 3 and S.e8m0_byte(s).tolist() == [0x68] * 3
    assert F.encode(r, "bfloat16").tolist() == [0x3480] * 3
    assert F.encode(s, "bfloat16").tolist() == [0x3470] * 3


@given(st.lists(st.floats(0, F32MAX, width=32), min_size=1, max_size=32))
def test_fp8_group_scale_is_floor_then_fp32_multiply(amax):
    a = np.array(amax, np.float32)
    floor = np.maximum(a.astype(np.float64), np.float64(f32(1e-4)))
    expect = fl(floor * np.float64(S.RECIP_448))
    np.testing.assert_array_equal(bits(S.fp8_group_scale(a)), bits(expect))


def test_fp8_group_scale_multiplies_not_divides():
    # find amax where the reciprocal multiply and the divide differ in the last bit: the rule is the multiply
    a = np.linspace(1.0, 2.0, 4097, dtype=np.float32)
    div = fl(a.astype(np.float64) / 448.0)
    mul = fl(a.astype(np.float64) * np.float64(S.RECIP_448))
    differ = bits(div) != bits(mul)
    assert differ.any()
    np.testing.assert_array_equal(bits(S.fp8_group_scale(a[differ])), bits(mul[differ]))


def pow2_ceil(v):
    m, e = math.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    return v if m == 0.5 else math.ldexp(1.0, e)


@given(st.lists(st.floats(min_value=F32MIN, max_value=2.0**127, width=32), min_size=1, max_size=32))
def test_round_scale_is_power_of_two_ceiling(s):
    a = np.array(s, np.float32)
    got = S.round_scale_pow2(a)
    expect = [max(pow2_ceil(float(v)), 2.0**-126) if v < 2.0**-126 else pow2_ceil(float(v)) for v in a]
    np.testing.assert_array_equal(got, np.array(expect, np.float32))
    # the e8m0 byte of the rounded scale = F.encode with rounding="ceil"; of the raw scale = "floor"
    np.testing.assert_array_equal(S.e8m0_byte(got), F.encode(a, "float8_e8m0", rounding="ceil"))
    np.testing.assert_array_equal(S.e8m0_byte(a), F.encode(a, "float8_e8m0", rounding="floor"))


def test_round_scale_edges():
    assert S.round_scale_pow2(np.float32([0.0, 1.0, 1.5, 2.0**127 * 1.5, 2.0**-149])).tolist() == \
        [0.0, 1.0, 2.0, np.inf, 2.0**-126]


@given(st.lists(st.floats(min_value=2.0**-126, max_value=F32MAX, width=32), min_size=1, max_size=32))
def test_e8m0_byte_is_floor_exponent(s):
    a = np.array(s, np.float32)
    expect = [math.frexp(float(v))[1] - 1 + 127 for v in a]
    assert S.e8m0_byte(a).tolist() == expect


def reference_int8_dynamic(x, group, order):
    """Independent int8 dynamic quant: float64 ops rounded once to fp32 after each fp32 operation."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    q = np.zeros(x.shape, np.int8)
    scales = []
    for start in range(0, n, group):  # a handful of groups
        blk = x[..., start:start + group].astype(np.float64)
        amax = np.abs(blk).max(axis=-1, keepdims=True)
        s = fl(amax / 127.0).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            if order == "divide":
                y = fl(blk / s).astype(np.float64)
            else:
                y = fl(blk * fl(127.0 / amax).astype(np.float64)).astype(np.float64)
        y = np.where(amax == 0, 0.0, y)
        q[..., start:start + group] = np.clip(np.rint(y), -127, 127).astype(np.int8)
        scales.append(s[..., 0].astype(np.float32))
    return q, np.stack(scales, axis=-1)


@pytest.mark.parametrize("order", S.INT8_DYNAMIC_ORDERS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_int8_dynamic_quant_matches_independent_model(order, dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((5, 300)) * rng.uniform(0.01, 50, (5, 1))).astype(dtype)
    x[2, 128:256] = 0  # an all-zero group: s = 0, q = 0 (OPEN, documented)
    q, s = S.int8_dynamic_quant(x, group=128, order=order)
    eq, es = reference_int8_dynamic(x.astype(np.float32), 128, order)
    assert q.dtype == np.int8 and q.shape == x.shape and s.dtype == np.float32 and s.shape == (5, 3)
    np.testing.assert_array_equal(bits(s), bits(es))
    np.testing.assert_array_equal(q, eq)
    assert s[2, 1] == 0 and (q[2, 128:256] == 0).all()
    # the partial last group (44 elements) has its own amax
    np.testing.assert_array_equal(s[:, 2], fl(np.abs(x[:, 256:].astype(np.float64)).max(-1) / 127.0))


def test_int8_orders_differ_near_ties_and_each_is_followed():
    """x / s and x * (127 / amax) round differently next to the .5 ties: build such x on purpose (the row's
    first element fixes amax) and check each order against the independent model."""
    rng = np.random.default_rng(7)
    amax = rng.uniform(0.5, 100, (256, 1)).astype(np.float32)
    s = fl(amax.astype(np.float64) / 127.0)
    k = rng.integers(-126, 126, (256, 127)) + 0.5
    near = fl(k * s.astype(np.float64))
    near = np.where(rng.integers(0, 2, near.shape) == 1, np.nextafter(near, np.float32(np.inf)), near)
    x = np.concatenate([amax, near], axis=1)
    qd, _ = S.int8_dynamic_quant(x, order="divide")
    qm, _ = S.int8_dynamic_quant(x, order="multiply")
    np.testing.assert_array_equal(qd, reference_int8_dynamic(x, 128, "divide")[0])
    np.testing.assert_array_equal(qm, reference_int8_dynamic(x, 128, "multiply")[0])
    diff = qd != qm
    assert diff.sum() > 100, "the two orders must differ next to ties"
    assert (np.abs(qd.astype(int) - qm.astype(int)) <= 1).all()
    with pytest.raises(ValueError, match="order"):
        S.int8_dynamic_quant(x, order="sideways")


def test_int8_spec_shape_example():
    x = np.array([[127.0, -63.5, 0.4, 0.5, -0.5, 1.5]], np.float32)
    q, s = S.int8_dynamic_quant(x, group=128)
    assert s.tolist() == [[1.0]]
    assert q.tolist() == [[127, -64, 0, 0, 0, 2]]  # RINT: -63.5 -> -64, 0.5 -> 0, 1.5 -> 2


def test_dynamic_block_scale():
    a = np.float32([448.0, 0.0, 896.0, 1e-3])
    np.testing.assert_array_equal(S.dynamic_block_scale(a, "float8_e4m3fn"), fl(a.astype(np.float64) / 448.0))
    np.testing.assert_array_equal(S.dynamic_block_scale(a, 127.0), fl(a.astype(np.float64) / 127.0))
    # min_scale bounds s from above by 1/min_scale
    got = S.dynamic_block_scale(a, "float8_e4m3fn", min_scale=1.0)
    np.testing.assert_array_equal(got, np.minimum(fl(a.astype(np.float64) / 448.0), 1.0))
    got = S.dynamic_block_scale(np.float32([32768.0 * 8]), "hifloat8", min_scale=3.0)
    assert got.tolist() == [float(fl(1.0 / 3.0))]
    assert S.TYPE_MAX == {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "hifloat8": 32768.0}


@given(st.lists(st.floats(0, F32MAX, width=32), min_size=1, max_size=32))
def test_fp4_group_scale(amax):
    a = np.array(amax, np.float32)
    scale_bits, inv = S.fp4_group_scale(a)
    exp_scale = fl(a.astype(np.float64) * np.float64(S.RECIP_6)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(scale_bits, exp_scale.view(np.uint16))
    with np.errstate(divide="ignore", over="ignore"):
        exp_inv = np.where(a == 0, 0.0, fl(6.0 / a.astype(np.float64))).astype(np.float32).astype(ml_dtypes.bfloat16)
    assert inv.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(inv.view(np.uint16), exp_inv.view(np.uint16))


def test_fp4_all_zero_group():
    scale_bits, inv = S.fp4_group_scale(np.zeros(2, np.float32))
    assert scale_bits.tolist() == [0, 0] and inv.astype(np.float32).tolist() == [0.0, 0.0]
    s, i = S.fp4_group_scale(np.float32([6.0]))
    assert s.tolist() == [0x3F80] and i.astype(np.float32).tolist() == [1.0]


def test_flashmla_v32_scale():
    a = np.float32([0.0, 448.0, 448.0 * 2.0**-10, 448.0 * 1.5, 1e-9])
    got = S.flashmla_v32_scale(a)
    # 0 and 1e-9 hit the 1e-4 floor: 1e-4 = 1.6384 * 2^-14 -> 2^-13
    assert got.tolist() == [2.0**-13, 1.0, 2.0**-10, 2.0, 2.0**-13]
    v = np.array([0x3A800001, 0x3A800002], np.uint32).view(np.float32) * f32(448)  # just above 2^-10 * 448
    exact = S.flashmla_v32_scale(v)
    assert (exact >= v / f32(448)).all()
    via_log2 = S.flashmla_v32_scale(v, ceil_mode="log2")
    assert set(np.log2(via_log2.astype(np.float64)).tolist()) <= {-10.0, -9.0}
    with pytest.raises(ValueError, match="ceil_mode"):
        S.flashmla_v32_scale(v, ceil_mode="x")


def test_ocp_mx_scale_exponent():
    a = np.float32([6.0, 448.0, 1.0, 0.0, np.inf, 2.0**-140, 2.0**127 * 1.9, 7.99])
    assert S.ocp_mx_scale_exponent(a[:1], "float4_e2m1").tolist() == [0]
    assert S.ocp_mx_scale_exponent(a, "float8_e4m3fn").tolist() == [-6, 0, -8, -127, 128, -127, 119, -6]
    assert S.ocp_mx_scale_exponent(np.float32([2.0**-130]), 0).tolist() == [-127]
    assert S.ocp_mx_scale_exponent(np.float32([2.0**-125 * 1.5]), 0).tolist() == [-125]


def test_group_amax_partial():
    x = np.arange(10, dtype=np.float32) - 9
    assert S.group_amax(x, 4).tolist() == [9, 5, 1]
