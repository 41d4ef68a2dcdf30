"""The hand-written tie values of qsfa.conformance.properties_ties, checked by arithmetic that does not go through
qsfa's reference (ml_dtypes / en_dtypes casts, float32 NumPy arithmetic, the fp32 bit patterns), and the
properties' chip handling: a cell of another chip is not drawn, an operator the chip lacks is not applicable."""

import ml_dtypes
import numpy as np
import pytest

from qsfa.conformance import properties_ties as T
from qsfa.conformance import run_property
from qsfa.conformance.properties import get
from qsfa.strategies import bounds

BF16 = ml_dtypes.bfloat16
F32 = np.float32


def _away(x, dt):
    """x rounded to dt with ties away from zero, from the neighbours among all of dt's finite values (ml_dtypes /
    NumPy decode every bit pattern; independent of qsfa)."""
    dt = np.dtype(dt)
    vals = np.arange(2 ** (8 * dt.itemsize), dtype=np.uint64).astype({1: np.uint8, 2: np.uint16}[dt.itemsize])
    with np.errstate(invalid="ignore"):
        vals = vals.view(dt).astype(np.float64)
    vals = np.unique(vals[np.isfinite(vals)])
    a, b = vals[vals <= x].max(), vals[vals >= x].min()
    if a == b or x - a != b - x:
        return float(a if x - a < b - x else b)
    return float(b if x > 0 else a)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_tie_values(fmt):
    dt = getattr(ml_dtypes, fmt)
    vals, scale, modes = T._KRR8[fmt]
    assert scale == 1.0
    for x, even, away in zip(vals, modes["rint"], modes["round"]):
        assert float(np.asarray(x).astype(dt)) == even  # ml_dtypes casts half to even
        assert _away(x, dt) == away
        assert float(np.asarray(x, F32).astype(BF16)) == x and float(np.float16(x)) == x  # exact in both kv dtypes
    # the dynamic_block_quant codes are those values' bytes
    e = f"rint:{fmt}"
    dst, mode, amax, dvals, codes = T._DBQ[e]
    assert float(np.asarray(amax).astype(dt)) == amax  # amax = TYPE_MAX: scale 1
    for x, c_even, c_away in zip(dvals, codes["rint"], codes["round"]):
        assert np.asarray(x).astype(dt).view(np.uint8) == c_even
        assert np.asarray(_away(x, dt)).astype(dt).view(np.uint8) == c_away


def test_int8_tie_values():
    vals, scale, modes = T._KRR8["int8"]
    ys = [F32(x) * F32(scale) for x in vals]
    assert ys == [2.5, 3.5]
    assert [float(np.rint(y)) for y in ys] == list(modes["rint"])
    assert [float(np.floor(y + 0.5)) for y in ys] == list(modes["round"])
    _, _, amax, dvals, codes = T._DBQ["rint:int8"]
    # A2/A3 multiply by fp32(fp32(1/127) * 127), which is exactly 1; the 950 divides by amax / 127 = 1
    assert F32(F32(1) / F32(amax)) * F32(127) == F32(1) and F32(amax) / F32(127) == F32(1)
    assert [int(np.rint(x)) for x in dvals] == list(codes["rint"])
    assert [int(np.floor(x + 0.5)) for x in dvals] == list(codes["round"])


def test_dynamic_block_quant_order_values():
    amax, x = F32(7.46875), F32(3.734375)
    assert x * 2 == amax and float(np.asarray(amax).astype(BF16)) == amax
    mult = F32(F32(F32(1) / amax) * F32(127))
    q_recip = F32(x * mult)
    assert q_recip < 63.5 and int(np.rint(q_recip)) == T._ORDER["reciprocal"][0]
    scale = F32(amax / F32(127))
    assert F32(x / scale) == 63.5 and int(np.rint(F32(x / scale))) == T._ORDER["divide"][0]
    assert scale.view(np.uint32) == T._ORDER["divide"][1]
    assert F32(amax * F32(F32(1) / F32(127))).view(np.uint32) == T._ORDER["reciprocal"][1]


def test_hifloat8_tie_values():
    en = pytest.importorskip("en_dtypes")
    h = en.hifloat8
    codes = np.array([0x08, 0x09, 0x6E, 0x88, 0x89], np.uint8).view(h).astype(np.float32)
    assert codes.tolist() == [1.0, 1.125, 32768.0, -1.0, -1.125]
    assert np.isposinf(np.array([0x6F], np.uint8).view(h).astype(np.float32)[0])
    assert (T._HIF8["round"][0], T._HIF8["rint"][0]) == (0x09, 0x08)  # 1.0625: the midpoint of 1.0 and 1.125
    assert (T._HIF8["round"][1], T._HIF8["rint"][1]) == (0x6F, 0x6E)  # 40960: past the range (NO_SAT: Inf)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_sixteen_bit_rope_tie(dtype):
    e = T._EPS16[dtype]
    dt = BF16 if dtype == "bfloat16" else np.float16
    x = F32(1) * F32(1) + F32(1) * F32(e)  # the RoPE lane: x1 * cos + x0 * sin in fp32
    assert float(np.asarray(x).astype(dt)) == 1.0 and _away(float(x), dt) == 1.0 + 2 * e
    assert float(np.asarray(F32(1) - F32(e)).astype(dt)) == 1 - e  # the other RoPE lane is exact
    # V2 RMSNorm of +-256: mean 2^16, plus epsilon 1e-5 rounds back to 2^16 in fp32
    assert F32(F32(65536) + F32(1e-5)) == F32(65536)


def test_mixed_quant_k_tie():
    code, scale, modes = T._MQ_K
    assert float(np.array([code], np.uint8).view(ml_dtypes.float8_e4m3fn)[0]) == 1.5
    assert float(np.asarray(scale).astype(BF16)) == scale
    prod = F32(1.5) * F32(scale)
    assert float(prod) * 128 == 196.5
    assert float(np.asarray(prod).astype(BF16)) == modes["rint"] and _away(float(prod), BF16) == modes["round"]


def test_cells_are_drawn_only_on_their_chips():
    b = bounds("ci")
    for op, chips in ((T.KRR, ("A2", "950")), (T.DBQ, ("A2", "950"))):
        prop = get(f"{op}.rounding_ties")
        for chip in chips:
            for cell in T.CELLS[op]:
                s = prop.strategy(b, chip, {"edge": cell.edge})
                drawn = not s.is_empty
                assert drawn == (chip in cell.chips), (op, chip, cell.edge)


@pytest.mark.parametrize("op,chip", [(T.SAS, "950"), (T.MQ, "A2"), (T.KQS, "A3")])
def test_an_operator_the_chip_lacks_is_not_applicable(op, chip):
    r = run_property(get(f"{op}.rounding_ties"), "reference", chip=chip, max_examples=2)
    assert r.status == "skipped" and r.not_applicable and r.examples == 0, r.message
    assert r.message.startswith(f"not applicable on {chip}: ") and "chip_supported" in r.message
