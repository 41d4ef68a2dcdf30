"""dynamic_block_quant (docs/numerics/quantisers.md#dynamic_block_quant): hand-worked codes, edge blocks, dtype codes, errors, and random cases
against a slow per-block loop that encodes with ml_dtypes / en_dtypes (independent of qsfa.reference.formats)."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import qsfa
from qsfa.ops.quant import BLOCK_LIMITS

F32 = np.float32
TYPE_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "hifloat8": 32768.0}


def _codes(y):
    return np.asarray(y).view(np.uint8)


def test_int8_hand_worked_ties_and_zero_row():
    x = np.array([[127.0, -63.5, 0.5, 1.0, 2.5], [0, 0, 0, 0, 0]], np.float16)
    y, s = qsfa.dynamic_block_quant(x)
    assert y.dtype == np.int8 and s.dtype == np.float32 and s.shape == (2, 1)
    assert s[0, 0] == 1.0 and s[1, 0] == 0.0
    # RINT: -63.5 -> -64, 0.5 -> 0, 2.5 -> 2 (half to even); an all-zero block gives codes 0
    assert y.tolist() == [[127, -64, 0, 1, 2], [0, 0, 0, 0, 0]]


def test_fp8_e4m3fn_hand_worked_codes():
    x = np.array([[448.0, -1.0, 0.0625, 3.0]], ml_dtypes.bfloat16)
    y, s = qsfa.dynamic_block_quant(x, dst_type="float8_e4m3fn")
    assert y.dtype == ml_dtypes.float8_e4m3fn and s.tolist() == [[1.0]]
    # 448 = 0x7E (max finite), -1 = 0xB8, 2^-4 = 0x18, 3 = 0x44
    assert _codes(y).tolist() == [[0x7E, 0xB8, 0x18, 0x44]]


def test_hifloat8_dst_type_max_scales_to_15():
    en = pytest.importorskip("en_dtypes")
    x = np.array([[30.0, 15.0, -7.5, 0.0]], np.float16)
    y, s = qsfa.dynamic_block_quant(x, dst_type="hifloat8", round_mode="round", dst_type_max=15.0)
    assert y.dtype == np.uint8 and s.tolist() == [[2.0]]  # amax 30 / dst_type_max 15
    expect = np.array([15.0, 7.5, -3.75, 0.0], np.float32).astype(en.hifloat8).view(np.uint8)
    assert y[0].tolist() == expect.tolist()
    y0, s0 = qsfa.dynamic_block_quant(x, dst_type="hifloat8", round_mode="round")
    assert s0.tolist() == [[np.float32(30.0) / np.float32(32768.0)]]


def test_min_scale_bounds_the_scale_and_codes_saturate():
    x = np.array([[508.0, 2.0, -400.0]], np.float32)  # amax/127 = 4
    y, s = qsfa.dynamic_block_quant(x, min_scale=0.5)  # 1/min_scale = 2 < 4
    assert s.tolist() == [[2.0]]
    assert y.tolist() == [[127, 1, -127]]


def test_inf_nan_follow_the_cann_golden():
    x = np.array([[np.inf, np.nan, 1.0, -np.inf, -0.5]], np.float32)
    y, s = qsfa.dynamic_block_quant(x)
    assert s[0, 0] == F32(1.0) / F32(127.0)
    assert y.tolist() == [[127, 0, 127, -127, -64]]


def test_partial_edge_blocks_shapes():
    x = np.ones((2, 5, 200), np.float16)
    y, s = qsfa.dynamic_block_quant(x, row_block_size=128, col_block_size=64)
    assert y.shape == x.shape and s.shape == (2, 1, 4)
    y, s = qsfa.dynamic_block_quant(x[0], row_block_size=2, col_block_size=128)
    assert s.shape == (3, 2)


@pytest.mark.parametrize("code,name", [(1, "int8"), (23, "float8_e5m2"), (291, "float8_e5m2"),
                                       (24, "float8_e4m3fn"), (292, "float8_e4m3fn"), (290, "hifloat8")])
def test_torch_npu_dst_type_codes(code, name):
    x = np.linspace(-3, 3, 256, dtype=np.float32).reshape(2, 128).astype(np.float16)
    rm = "round" if name == "hifloat8" else "rint"
    y1, s1 = qsfa.dynamic_block_quant(x, dst_type=code, round_mode=rm)
    y2, s2 = qsfa.dynamic_block_quant(x, dst_type=name, round_mode=rm)
    assert y1.dtype == y2.dtype and y1.tobytes() == y2.tobytes() and s1.tobytes() == s2.tobytes()


def test_torch_dtype_and_tensor_in_tensor_out():
    torch = pytest.importorskip("torch")
    x = torch.linspace(-2, 2, 256, dtype=torch.bfloat16).reshape(2, 128)
    y, s = qsfa.dynamic_block_quant(x, dst_type=torch.float8_e4m3fn)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    yn, sn = qsfa.dynamic_block_quant(x.float().numpy().astype(ml_dtypes.bfloat16), dst_type="float8_e4m3fn")
    assert y.view(torch.uint8).numpy().tobytes() == np.asarray(yn).view(np.uint8).tobytes()


@pytest.mark.parametrize("kw,cid", [
    (dict(dst_type="hifloat8"), "dynamic_block_quant.round_mode_value"),  # hifloat8 needs round_mode="round"
    (dict(round_mode="round"), "dynamic_block_quant.round_mode_value"),
    (dict(dst_type_max=15.0), "dynamic_block_quant.dst_type_max_hifloat8"),
    (dict(dst_type=2), "dynamic_block_quant.dst_type_value"),  # aclnn's INT8 code is not torch_npu's
    (dict(col_block_size=0), "dynamic_block_quant.col_block_size_value"),
    (dict(min_scale=-1.0), "dynamic_block_quant.min_scale_value"),
    (dict(scale_order="multiply", min_scale=1.0), "dynamic_block_quant.scale_order_min_scale"),
])
def test_errors(kw, cid):
    with pytest.raises(qsfa.InvalidArgument) as ei:
        qsfa.dynamic_block_quant(np.ones((2, 8), np.float16), **kw)
    assert ei.value.constraint_id == cid


def test_chip_limits_as_data():
    assert BLOCK_LIMITS["A2"]["dst_types"] == ("int8",) and BLOCK_LIMITS["A3"]["row_block_sizes"] == (1,)
    assert 128 in BLOCK_LIMITS["A2"]["col_block_sizes"]
    assert set(BLOCK_LIMITS["950"]["dst_types"]) == {"int8", "float8_e4m3fn", "float8_e5m2", "hifloat8"}
    from qsfa.ops.quant import CONTRACT

    args = dict(x=np.ones((2, 8), np.float16), min_scale=0.0, round_mode="rint", dst_type="float8_e4m3fn",
                row_block_size=1, col_block_size=128, dst_type_max=0.0, scale_order="divide")
    CONTRACT.validate(args, chip="950")
    with pytest.raises(qsfa.InvalidArgument):
        CONTRACT.validate(args, chip="A3")


# ------------------------------------------------------------------ independent slow implementation


def _encode_independent(y: np.ndarray, fmt: str) -> np.ndarray:
    """Codes of clamped fp32 values via ml_dtypes / en_dtypes / numpy (not qsfa.reference.formats)."""
    if fmt == "int8":
        return np.clip(np.rint(y), -127, 127).astype(np.int8).view(np.uint8)
    if fmt == "hifloat8":
        en = pytest.importorskip("en_dtypes")
        codes = y.astype(en.hifloat8).view(np.uint8).copy()
        codes[codes == 0x80] = 0  # en_dtypes keeps -0 as 0x80 (NaN); HiFloat8 has a single zero
        return codes
    dt = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}[fmt]
    return y.astype(dt).view(np.uint8)


def _slow_block_quant(x, fmt, rb, cb, order="divide"):
    x3 = x.astype(np.float32).reshape((-1,) + x.shape[-2:])
    b, m, n = x3.shape
    mb, nb = -(-m // rb), -(-n // cb)
    scale = np.zeros((b, mb, nb), np.float32)
    codes = np.zeros(x3.shape, np.uint8)
    tm = F32(TYPE_MAX[fmt])
    for i in range(b):
        for bi in range(mb):
            for bj in range(nb):
                blk = x3[i, bi * rb:(bi + 1) * rb, bj * cb:(bj + 1) * cb]
                amax = F32(np.max(np.abs(blk)))
                s = F32(amax / tm)
                scale[i, bi, bj] = F32(amax * F32(F32(1) / tm)) if order == "reciprocal" else s
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    if order == "divide":
                        y = blk / s
                    elif order == "multiply":
                        y = blk * F32(tm / amax)
                    else:  # reciprocal, reciprocal_multiply: fp32(1 / amax) rounded, then times TYPE_MAX
                        y = blk * F32(F32(F32(1) / amax) * tm) if amax else np.zeros_like(blk)
                y = np.nan_to_num(y.astype(np.float32), nan=0.0)
                y = np.clip(y, -tm, tm).astype(np.float32)
                codes[i, bi * rb:(bi + 1) * rb, bj * cb:(bj + 1) * cb] = _encode_independent(y, fmt)
    return codes.reshape(x.shape), scale.reshape(x.shape[:-2] + (mb, nb))


@st.composite
def _quant_case(draw):
    fmt = draw(st.sampled_from(["int8", "float8_e4m3fn", "float8_e5m2", "hifloat8"]))
    rank = draw(st.sampled_from([2, 3]))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(rank - 1)) + (draw(st.integers(1, 300)),)
    rb = draw(st.sampled_from([1, 2, 4]))
    cb = draw(st.sampled_from([1, 16, 64, 128]))
    dtype = draw(st.sampled_from([np.float16, ml_dtypes.bfloat16, np.float32]))
    mag = draw(st.sampled_from([1e-3, 1.0, 300.0]))
    zero_rows = draw(st.booleans())
    order = draw(st.sampled_from(["divide", "multiply", "reciprocal", "reciprocal_multiply"]))
    return fmt, shape, rb, cb, dtype, mag, zero_rows, order, draw(st.integers(0, 2**32 - 1))


@given(_quant_case())
def test_random_blocks_match_slow_loop_and_error_bound(case):
    fmt, shape, rb, cb, dtype, mag, zero_rows, order, seed = case
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * mag).astype(dtype)
    if zero_rows:
        x[..., : shape[-2] // 2, :] = 0
    rm = "round" if fmt == "hifloat8" else "rint"
    y, s = qsfa.dynamic_block_quant(x, dst_type=fmt, round_mode=rm, row_block_size=rb, col_block_size=cb,
                                    scale_order=order)
    codes, scale = _slow_block_quant(x, fmt, rb, cb, order)
    assert s.tobytes() == scale.tobytes()
    assert np.asarray(y).view(np.uint8).tobytes() == codes.tobytes()
    if fmt == "int8" and order == "divide":
        # dequant error: at most half a quantisation step (+ the fp32 rounding of x / s)
        se = np.repeat(np.repeat(scale.reshape((-1,) + scale.shape[-2:]), rb, -2), cb, -1)
        se = se[:, : shape[-2], : shape[-1]].reshape(shape)
        err = np.abs(y.astype(np.float64) * se - x.astype(np.float64))
        assert np.all(err <= se * (0.5 + 2.0**-16))  # half a step, + fp32 rounding of x / s


@pytest.mark.parametrize("dst, order, rb, shape", [
    ("int8", "divide", 1, (1, 700, 512)),
    ("int8", "reciprocal", 2, (3, 300, 512)),
    ("float8_e4m3fn", "multiply", 1, (2, 333, 512)),
    ("float8_e5m2", "reciprocal_multiply", 4, (1, 1100, 256)),
    ("hifloat8", "divide", 1, (1, 260, 1024)),
])
@pytest.mark.parametrize("special", [None, "first", "last"])
def test_chunked_tiled_path_equals_the_general_path(monkeypatch, dst, order, rb, shape, special):
    """The tiled path quantises ``_CHUNK_ELEMS`` float32 elements at a time (whole row groups per chunk): several
    chunks and a partial last one give the bytes of the general whole-array path; an inf / nan in the first or
    the last chunk sends the whole call to the general path (nothing of the chunks done so far is kept)."""
    from qsfa.reference import quant as Q

    rng = np.random.default_rng(sum(shape) + rb)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-6, 6, shape[:-1] + (1,)))
    x[0, 0, :128] = 0  # an all-zero block in the first chunk
    x[-1, -1, -128:] = -0.0
    x = x.astype(ml_dtypes.bfloat16)
    if special:
        x[(0, 1, 5) if special == "first" else (-1, -2, 7)] = np.inf if dst != "hifloat8" else np.nan
    assert x.size > 2 * Q._CHUNK_ELEMS  # several chunks
    kw = dict(dst_type=dst, scale_order=order, row_block_size=rb, round_mode="round" if dst == "hifloat8" else "rint")
    got = Q.dynamic_block_quant(x, **kw)
    monkeypatch.setattr(Q, "_quant_tiled", lambda *a, **k: (None, None))
    want = Q.dynamic_block_quant(x, **kw)
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape and got[1].shape == want[1].shape
    assert _codes(got[0]).tobytes() == _codes(want[0]).tobytes()
    assert got[1].tobytes() == want[1].tobytes()
