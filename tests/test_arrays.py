"""qsfa._arrays: NumPy <-> torch conversion is a bit-preserving reinterpretation, never a numeric cast.

Every bit pattern of the 8- and 16-bit types is pushed through both directions and compared as raw
integers; CPU conversions share memory (writes through one side land in the other).
"""

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qsfa._arrays import CallerKind, caller_kind, dtype_name, is_torch, numpy_dtype, to_numpy, to_torch  # noqa: E402
from qsfa._errors import InvalidArgument  # noqa: E402

# (our dtype name, NumPy dtype, torch dtype, unsigned integer dtype of the same width for the raw bits)
_EXHAUSTIVE = [
    ("bfloat16", ml_dtypes.bfloat16, torch.bfloat16, np.uint16),
    ("float16", np.float16, torch.float16, np.uint16),
    ("float8_e4m3fn", ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn, np.uint8),
    ("float8_e5m2", ml_dtypes.float8_e5m2, torch.float8_e5m2, np.uint8),
    ("uint8", np.uint8, torch.uint8, np.uint8),  # HiFloat8 travels as uint8 bytes
    ("int8", np.int8, torch.int8, np.uint8),
    ("int16", np.int16, torch.int16, np.uint16),
    ("uint16", np.uint16, torch.uint16, np.uint16),
]


def _all_patterns(bits_dtype):
    n = np.iinfo(bits_dtype).max + 1
    return np.arange(n, dtype=np.int64).astype(bits_dtype)


def _torch_bits(t):
    """Raw bits of a CPU tensor as a NumPy unsigned array, read without going through qsfa._arrays."""
    width = t.element_size()
    as_int = t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])
    return as_int.numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])


@pytest.mark.parametrize("name,np_dt,torch_dt,bits_dt", _EXHAUSTIVE, ids=[e[0] for e in _EXHAUSTIVE])
def test_every_bit_pattern_survives_both_directions(name, np_dt, torch_dt, bits_dt):
    bits = _all_patterns(bits_dt)
    a = bits.view(np_dt)
    t = to_torch(a)
    assert t.dtype == torch_dt
    assert t.shape == a.shape
    np.testing.assert_array_equal(_torch_bits(t), bits)  # includes every NaN payload and -0
    back = to_numpy(t)
    assert back.dtype == np.dtype(np_dt)
    np.testing.assert_array_equal(back.view(bits_dt), bits)
    assert dtype_name(a) == name and dtype_name(t) == name and dtype_name(torch_dt) == name
    assert numpy_dtype(name) == np.dtype(np_dt)


@pytest.mark.parametrize("np_dt,torch_dt,bits_dt", [
    (np.float32, torch.float32, np.uint32),
    (np.int32, torch.int32, np.uint32),
    (np.float64, torch.float64, np.uint64),
    (np.int64, torch.int64, np.uint64),
])
def test_wide_types_random_and_special_bit_patterns(np_dt, torch_dt, bits_dt):
    rng = np.random.default_rng(1)
    info = np.iinfo(bits_dt)
    special = np.array([0, 1, info.max, info.max // 2, info.max // 2 + 1], dtype=bits_dt)
    if np.dtype(np_dt).kind == "f":
        # quiet and signalling NaNs with payloads, infinities, negative zero, smallest subnormal
        f = np.finfo(np_dt)
        exp_all = ((1 << f.nexp) - 1) << f.nmant
        sign = 1 << (f.nexp + f.nmant)
        special = np.concatenate([special, np.array(
            [exp_all, exp_all | 1, exp_all | (1 << (f.nmant - 1)) | 5, sign, sign | exp_all | 3, 1], dtype=bits_dt)])
    bits = np.concatenate([special, rng.integers(0, info.max, 4096, dtype=bits_dt, endpoint=True)])
    a = bits.view(np_dt)
    t = to_torch(a)
    assert t.dtype == torch_dt
    np.testing.assert_array_equal(_torch_bits(t), bits)
    np.testing.assert_array_equal(to_numpy(t).view(bits_dt), bits)


def test_bool_round_trip():
    a = np.array([True, False, True])
    t = to_torch(a)
    assert t.dtype == torch.bool and t.tolist() == [True, False, True]
    assert to_numpy(t).tolist() == [True, False, True]


@pytest.mark.parametrize("np_dt", [np.float32, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.uint8, np.int8])
def test_numpy_to_torch_is_zero_copy_for_contiguous_arrays(np_dt):
    a = np.zeros((4, 6), dtype=np_dt)
    t = to_torch(a)
    assert t.data_ptr() == a.__array_interface__["data"][0]
    # a write through the tensor is visible in the array (same memory), bit for bit
    t.view(torch.uint8 if t.element_size() == 1 else torch.int16 if t.element_size() == 2 else torch.int32)[1, 2] = 7
    raw = a.view({1: np.uint8, 2: np.int16, 4: np.int32}[a.itemsize])
    assert raw[1, 2] == 7 and raw.sum() == 7


@pytest.mark.parametrize("torch_dt", [torch.float32, torch.bfloat16, torch.float8_e5m2, torch.uint8, torch.int64])
def test_cpu_tensor_to_numpy_is_zero_copy_even_when_strided(torch_dt):
    base = torch.zeros((5, 8), dtype=torch_dt)
    view = base[1:4, ::3]  # non-contiguous
    a = to_numpy(view)
    assert a.shape == (3, 3)
    assert a.__array_interface__["data"][0] == view.data_ptr()
    raw = a.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[a.itemsize])
    raw[2, 1] = 3  # element (3, 3) of base
    base_bits = _torch_bits(base).astype(np.int64)
    assert base_bits[3, 3] == 3 and base_bits.sum() == 3


def test_non_contiguous_and_negative_stride_arrays_convert_by_value():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    for view in (a[:, ::2], a[::-1], a.T):
        t = to_torch(view)
        assert t.is_contiguous()
        np.testing.assert_array_equal(t.numpy(), view)


def test_to_numpy_passes_numpy_through_and_wraps_lists():
    a = np.ones(3, np.float32)
    assert to_numpy(a) is a
    assert to_numpy([1, 2]).tolist() == [1, 2]


def test_meta_tensor_is_torch_but_has_no_host_values():
    t = torch.empty(3, device="meta")
    assert is_torch(t) and not is_torch(np.zeros(3)) and not is_torch([1])
    with pytest.raises((NotImplementedError, RuntimeError)):
        to_numpy(t)


def test_unknown_dtype_name_is_a_type_error_listing_the_known():
    with pytest.raises(TypeError, match="unknown dtype name 'hifloat9'.*bfloat16"):
        numpy_dtype("hifloat9")


def test_caller_kind_numpy_torch_and_mixed_devices():
    assert caller_kind([np.zeros(1), 3, None]).kind == "numpy"
    k = caller_kind([np.zeros(1), torch.zeros(1)], ["a", "b"])
    assert k.kind == "torch" and k.device == torch.device("cpu")
    with pytest.raises(InvalidArgument) as ei:
        caller_kind([torch.zeros(1), torch.zeros(1, device="meta")], ["query", "key"])
    msg = str(ei.value)
    assert msg.startswith("Invalid device for tensors, actual: ")
    assert "query on cpu" in msg and "key on meta" in msg and "same device" in msg


def test_caller_kind_wrap_returns_the_callers_kind():
    a = np.arange(4, dtype=np.float32)
    t = torch.arange(4, dtype=torch.float32)
    numpy_kind, torch_kind = CallerKind("numpy"), CallerKind("torch", torch.device("cpu"))
    assert numpy_kind.wrap(a) is a
    assert isinstance(numpy_kind.wrap(t), np.ndarray)
    assert torch_kind.wrap(t) is t
    assert is_torch(torch_kind.wrap(a)) and torch_kind.wrap(a).tolist() == [0, 1, 2, 3]
    assert numpy_kind.wrap(None) is None and torch_kind.wrap(None) is None
