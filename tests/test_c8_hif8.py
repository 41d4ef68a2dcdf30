"""C8 writer with HiFloat8 NoPE (key_dtype="hifloat8", an OPEN fact: docs/numerics/open-facts.md#hifloat8-c8-nope).

The scale rule is npu_dynamic_block_quant's with dst_type=hifloat8: s = amax / TYPE_MAX (TYPE_MAX =
dst_type_max, 0 meaning 32768), codes HiF8(ROUND, SAT)(x / s). Expected bytes are worked out by hand.
"""

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa import layouts

BF16 = ml_dtypes.bfloat16


def _write(dst_type_max, **kw):
    k_nope = np.zeros((1, 512), np.float32)
    k_nope[0, :3] = [1.0, -2.0, 3.0]
    k_rope = np.zeros((1, 64), np.float32)
    k_rope[0, 0] = 1.0
    cache = np.full((1, 2, 1, 656), 17, np.uint8)
    qsfa.c8_cache_write(k_nope.astype(BF16), k_rope.astype(BF16), np.array([1]), cache, key_dtype="hifloat8",
                        dst_type_max=dst_type_max, **kw)
    return cache


def test_default_type_max_32768():
    # s = 3 / 32768 = 1.5 * 2^-14 (exact): fp32 0x38C00000. 1 / s = 10922.67: binade 2^13 keeps 1 mantissa bit
    # (8192, 12288), above the midpoint 10240 -> 12288 = D4 prefix 11, S 0, eee 101 (13 - 8), m 1 = 0x6B;
    # -2 / s = -21845.3 -> -24576 (binade 2^14, midpoint 20480): 0x6D | sign = 0xED; 3 / s = 32768 = 0x6E
    cache = _write(0.0)
    row = cache[0, 1, 0]
    assert row[:3].tolist() == [0x6B, 0xED, 0x6E] and not row[3:512].any()
    assert row[512:514].tolist() == [0x80, 0x3F]  # RoPE bf16 1.0
    assert row[640:644].tolist() == [0x00, 0x00, 0xC0, 0x38]
    # tiles 1..3 are zero: scale 0.0, codes 0 (as npu_dynamic_block_quant's zero block)
    assert not row[644:656].any()
    assert (cache[0, 0] == 17).all()


def test_type_max_15():
    # s = fp32(3 / 15) = 0x3E4CCCCD (0.200000003); 1 / s = 4.99999988 -> binade 4 keeps 3 bits (4, 4.5, 5, ...)
    # -> 5 = D2 prefix 01, S 0, e bit 0, mmm 010 = 0x22; -2 / s = -9.9999997 -> -10 = 1.25 * 8: 0x2A | sign = 0xAA;
    # 3 / s = 14.9999996 -> 15 = 1.875 * 8: 0x2F
    row = _write(15.0)[0, 1, 0]
    assert row[:3].tolist() == [0x22, 0xAA, 0x2F]
    assert row[640:644].tolist() == [0xCD, 0xCC, 0x4C, 0x3E]


def test_rows_dequantise_to_the_input_within_hifloat8_precision():
    rng = np.random.default_rng(1)
    k_nope = (rng.standard_normal((6, 512)) * 3).astype(BF16)
    cache = np.zeros((2, 4, 1, 528), np.uint8)
    for tmax in (0.0, 15.0, 224.0):
        qsfa.c8_cache_write(k_nope, None, np.arange(6), cache, key_dtype="hifloat8", dst_type_max=tmax)
        rows = cache.reshape(8, 528)[:6]
        nope, _ = layouts.dequant_rows(rows, nope_format="hifloat8", rope_head_dim=0)
        x = k_nope.astype(np.float64)
        # HiFloat8 keeps at least one mantissa bit (relative error <= 1/4); its denormal powers of two are
        # rounded at the linear midpoint (relative error <= 1/3)
        assert np.all(np.abs(nope - x) <= np.abs(x) / 3), tmax


def test_rmsnorm_writer_takes_it_too_and_a2a3_refuse_it():
    from qsfa._dispatch import operators

    c = operators()["c8_rmsnorm_rope_cache"].contract
    a = c.example(np.random.default_rng(0))
    a.update(key_dtype="hifloat8", dst_type_max=56.0)
    assert c.first_violation(a) is None
    assert c.first_violation(a, chip="A3")[0].id == "c8_rmsnorm_rope_cache.a2a3_key_dtype"


@pytest.mark.parametrize("kw,match", [
    (dict(key_dtype="int8", dst_type_max=15.0), r"Invalid value for dst_type_max, actual: 15.0"),
    (dict(key_dtype="hifloat8", dst_type_max=-1.0), r"Invalid value for dst_type_max, actual: -1.0"),
])
def test_dst_type_max_errors(kw, match):
    cache = np.full((1, 2, 1, 528), 17, np.uint8)
    with pytest.raises(qsfa.InvalidArgument, match=match):
        qsfa.c8_cache_write(np.ones((1, 512), BF16), None, np.array([0]), cache, **kw)
    assert (cache == 17).all()
