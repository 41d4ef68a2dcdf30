"""qsfa.formats: the public front doors (dispatch + contracts), FP4 packing, errors and torch callers."""

import ml_dtypes
import numpy as np
import pytest

import qsfa
from qsfa import formats
from qsfa._errors import UnknownBackend
from qsfa.reference import formats as ref


def _raises(exc, param, *fragments):
    class _Ctx:
        def __enter__(self):
            self.cm = pytest.raises(exc)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *a):
            handled = self.cm.__exit__(*a)
            e = self.info.value
            assert e.param == param, (e.param, str(e))
            msg = str(e)
            assert msg.startswith("Invalid ") and f" for {param}, actual: " in msg
            for f in fragments:
                assert f in msg, (f, msg)
            return handled

    return _Ctx()


X = np.array([0.5, -1.25, 3.0], np.float32)


def test_public_encode_decode_equal_reference():
    for fmt in formats.FORMAT_NAMES:
        for r in formats.rounding_modes(fmt):
            x = np.abs(X) if fmt == "float8_e8m0" else X
            c = formats.encode(x, fmt, rounding=r)
            np.testing.assert_array_equal(c, ref.encode(x, fmt, rounding=r))
            np.testing.assert_array_equal(formats.decode(c, fmt), ref.decode(c, fmt))
            np.testing.assert_array_equal(formats.round_to(x, fmt, rounding=r), ref.round_to(x, fmt, rounding=r))
    assert formats.encode(X, "hifloat8", backend="reference").tolist() == [0x18, 0x8A, 0x14]  # 0.5, -1.25, 3


def test_errors_name_parameter_and_value():
    with _raises(ValueError, "fmt", "'fp8'", "float8_e4m3fn", "hifloat8", "bfloat16"):
        formats.encode(X, "fp8")
    with _raises(ValueError, "fmt", "'e4m3'"):
        formats.decode(np.zeros(2, np.uint8), "e4m3")
    with _raises(ValueError, "rounding", "'nearest'"):
        formats.encode(X, "float8_e4m3fn", rounding="nearest")
    with _raises(ValueError, "rounding", "rint", "hifloat8"):
        formats.encode(X, "hifloat8", rounding="rint")
    with _raises(ValueError, "rounding", "floor"):
        formats.encode(X, "int8", rounding="floor")
    with _raises(TypeError, "x", "int32"):
        formats.encode(np.array([1, 2], np.int32), "int8")
    with _raises(TypeError, "x", "list"):
        formats.encode([1.0, 2.0], "int8")
    with _raises(TypeError, "codes", "float32"):
        formats.decode(np.zeros(2, np.float32), "float8_e4m3fn")
    with _raises(TypeError, "codes", "uint8"):
        formats.decode(np.zeros(2, np.uint8), "bfloat16")  # 16-bit formats take uint16 patterns
    with _raises(ValueError, "codes", "16"):
        formats.decode(np.array([3, 16], np.uint8), "float4_e2m1")
    with _raises(ValueError, "x", "inf"):
        formats.encode(np.array([1.0, np.inf], np.float32), "float4_e2m1")
    with _raises(ValueError, "x", "nan"):
        formats.encode(np.array([np.nan], np.float32), "int8", saturate=True)
    with _raises(ValueError, "x", "200.0"):
        formats.encode(np.array([1.0, 200.0], np.float32), "int8")
    with _raises(ValueError, "x", "7.0"):
        formats.encode(np.array([7.0], np.float32), "float4_e2m1")
    with _raises(ValueError, "x", "-2.0"):
        formats.encode(np.array([1.0, -2.0], np.float32), "float8_e8m0")
    with _raises(TypeError, "saturate", "'yes'"):  # every wrong type is an InvalidDtype (TypeError)
        formats.encode(X, "int8", saturate="yes")
    with _raises(ValueError, "codes", "(2, 3)"):
        formats.pack_fp4(np.zeros((2, 3), np.uint8))
    with _raises(ValueError, "codes", "17"):
        formats.pack_fp4(np.array([1, 17], np.uint8))
    with _raises(TypeError, "codes", "int32"):
        formats.pack_fp4(np.zeros(4, np.int32))
    with _raises(ValueError, "nibble_order", "'middle'"):
        formats.unpack_fp4(np.zeros(4, np.uint8), nibble_order="middle")
    with _raises(TypeError, "packed", "uint16"):
        formats.unpack_fp4(np.zeros(4, np.uint16))
    with pytest.raises(UnknownBackend):
        formats.encode(X, "int8", backend="nope")


def test_saturation_makes_int8_and_e2m1_total():
    x = np.array([-1e30, -7.0, 6.9, 7.0, np.inf], np.float32)
    assert formats.encode(x, "float4_e2m1", saturate=True).tolist() == [0xF, 0xF, 0x7, 0x7, 0x7]
    assert formats.encode(x, "int8", saturate=True).view(np.int8).tolist() == [-128, -7, 7, 7, 127]


def test_pack_unpack_fp4_nibble_orders():
    c = np.array([[1, 2, 3, 4], [0xF, 0x0, 0x8, 0x7]], np.uint8)
    assert formats.pack_fp4(c).tolist() == [[0x21, 0x43], [0x0F, 0x78]]  # element 2i in the low nibble
    assert formats.pack_fp4(c, nibble_order="high_first").tolist() == [[0x12, 0x34], [0xF0, 0x87]]
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (3, 5, 6)).astype(np.uint8)
    hi, lo = np.divmod(packed.astype(np.int64), 16)
    expect_low_first = np.stack([lo, hi], axis=-1).reshape(3, 5, 12)
    np.testing.assert_array_equal(formats.unpack_fp4(packed), expect_low_first)
    np.testing.assert_array_equal(formats.unpack_fp4(packed, nibble_order="high_first"),
                                  np.stack([hi, lo], axis=-1).reshape(3, 5, 12))
    for order in formats.NIBBLE_ORDERS:
        np.testing.assert_array_equal(formats.pack_fp4(formats.unpack_fp4(packed, nibble_order=order),
                                                       nibble_order=order), packed)
    # encode -> pack -> unpack -> decode
    x = np.array([0.5, -6.0, 1.5, 3.0], np.float32)
    back = formats.decode(formats.unpack_fp4(formats.pack_fp4(formats.encode(x, "float4_e2m1"))), "float4_e2m1")
    np.testing.assert_array_equal(back, x)


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    x = torch.tensor([1.0625, 22.0, -40960.0], dtype=torch.float32)
    c = formats.encode(x, "hifloat8")
    assert isinstance(c, torch.Tensor) and c.dtype == torch.uint8 and c.tolist() == [0x09, 0x42, 0xEF]
    xb = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    assert formats.encode(xb, "float8_e4m3fn").tolist() == [0x38, 0xC2]
    h = formats.encode(x, "bfloat16")
    assert h.dtype == torch.uint16
    v = formats.decode(h, "bfloat16")
    assert isinstance(v, torch.Tensor) and v.dtype == torch.float32 and v.tolist() == [1.0625, 22.0, -40960.0]
    f8 = torch.tensor([448.0, -0.5]).to(torch.float8_e4m3fn)
    assert formats.decode(f8, "float8_e4m3fn").tolist() == [448.0, -0.5]


def test_public_module_reexports_scales_and_facts():
    for name in ("fp8_group_scale", "round_scale_pow2", "e8m0_byte", "fp4_group_scale", "int8_dynamic_quant",
                 "dynamic_block_scale", "flashmla_v32_scale", "ocp_mx_scale_exponent", "max_finite", "all_codes",
                 "midpoints", "FloatFormat"):
        assert hasattr(formats, name) and name in formats.__all__, name
    assert qsfa.formats is formats
    e4 = formats.FLOAT_FORMATS["float8_e4m3fn"]
    assert (e4.max_code, e4.nan_code, e4.inf_code, e4.max_finite) == (0x7E, 0x7F, None, 448.0)
    e5 = formats.FLOAT_FORMATS["float8_e5m2"]
    assert (e5.max_code, e5.nan_code, e5.inf_code) == (0x7B, 0x7E, 0x7C)
    assert formats.default_rounding("hifloat8") == "round" and formats.default_rounding("float8_e8m0") == "floor"
    assert formats.code_dtype("float16") == np.uint16 and formats.code_dtype("float4_e2m1") == np.uint8


def test_reference_guards_too():
    """The bare reference never invents a code: no silent NaN or wrap for int8 / E2M1."""
    with pytest.raises(ValueError, match="int8"):
        ref.encode(np.array([300.0]), "int8")
    with pytest.raises(ValueError, match="float4_e2m1"):
        ref.encode(np.array([np.inf], np.float32), "float4_e2m1")
    with pytest.raises(TypeError):
        ref.encode(np.array([1], np.int64), "int8")
    with pytest.raises(TypeError):
        ref.decode(np.array([1.0]), "hifloat8")
    assert ref.decode(np.array([0x3F80], np.uint16).view(ml_dtypes.bfloat16), "bfloat16").tolist() == [1.0]


def test_a_numpy_scalar_is_taken_as_its_0d_array_and_a_list_stays_rejected():
    import qsfa
    from qsfa._errors import InvalidDtype

    for fmt, x in (("hifloat8", np.float32(1.0)), ("float8_e4m3fn", np.float16(-3.5)), ("int8", np.float32(7.0))):
        got = np.asarray(qsfa.formats.encode(x, fmt))
        want = np.asarray(qsfa.formats.encode(np.asarray(x), fmt))
        assert got.dtype == want.dtype and got.shape == want.shape == ()
        assert got.tobytes() == want.tobytes()
        back = np.asarray(qsfa.formats.decode(want[()], fmt))
        assert back.tobytes() == np.asarray(qsfa.formats.decode(want, fmt)).tobytes()
    with pytest.raises(InvalidDtype, match=r"for x, actual: \[1\.0\] \(list\)"):
        qsfa.formats.encode([1.0], "hifloat8")
    with pytest.raises(InvalidDtype, match="for x"):
        qsfa.formats.encode(1.0, "hifloat8")  # a Python float is not a NumPy value
