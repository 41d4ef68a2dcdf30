"""The one dispatch path (qsfa._dispatch.run) end to end, with a test-local toy operator and toy backends.

The toy operator ``toy_axpy(x, y, *, alpha)`` updates ``y`` in place (``y += alpha * x``) and returns a new
array ``z = 2 * x``. Two toy backends compute it - one in NumPy, one in torch on the CPU - and record what
they were handed. Everything is registered in a fixture and removed afterwards; nothing here ships.

Expected values are small integers (exact in bfloat16), computed by hand from the inputs, so a wrong
copy-back or a lost write shows up as a byte difference, never as a rounding question.
"""

from __future__ import annotations

import numpy as np
import pytest

import qsfa
from qsfa import _dispatch
from qsfa._arrays import dtype_name, is_torch, numpy_dtype, to_numpy, to_torch
from qsfa._checks import dtype_in, set_param
from qsfa._contract import Constraint, Contract, copy_args
from qsfa._dispatch import Backend, define_operator, operators, register_backend, register_impl, run
from qsfa._errors import (
    BackendUnavailable,
    InvalidArgument,
    InvalidDtype,
    NotImplementedByBackend,
    UnknownBackend,
    UnsupportedByBackend,
)

torch = pytest.importorskip("torch")

TOY_OP = "toy_axpy"
TOY_OP_2 = "toy_unimplemented"

# ----------------------------------------------------------------------------------------------- the toy


class Recorder:
    def __init__(self):
        self.calls = []
        self.checks = 0


REC = Recorder()


def _counted(check):
    def wrapped(a):
        REC.checks += 1
        return check(a)

    return wrapped


def _shape_check(a):
    return None if tuple(a.y.shape) == tuple(a.x.shape) else tuple(a.y.shape)


def _alpha_check(a):
    return None if np.isfinite(a.alpha) else a.alpha


def _toy_example(rng):
    x = rng.integers(-8, 8, size=(3, 4)).astype(np.float32)
    y = rng.integers(-8, 8, size=(3, 4)).astype(np.float32)
    return {"x": x, "y": y, "alpha": 2.0}


def _toy_contract():
    return Contract(
        op=TOY_OP,
        constraints=[
            dtype_in(TOY_OP, "x", ("float32", "bfloat16")),
            Constraint(id=f"{TOY_OP}.y_dtype", param="y", kind="dtype", reason="must have the dtype of x",
                       check=lambda a: None if dtype_name(a.y) == dtype_name(a.x) else dtype_name(a.y),
                       dtype=True, violate=lambda d: {**copy_args(d), "y": d["y"].astype(np.float64)}),
            Constraint(id=f"{TOY_OP}.y_shape", param="y", kind="shape", reason="must equal the shape of x",
                       check=_counted(_shape_check),
                       violate=lambda d: {**copy_args(d), "y": np.zeros((1, 1), d["y"].dtype)}),
            Constraint(id=f"{TOY_OP}.alpha_finite", param="alpha", kind="value", reason="must be finite",
                       check=_alpha_check, violate=set_param("alpha", float("inf"))),
            Constraint(id=f"{TOY_OP}.alpha_a2", param="alpha", kind="value", reason="must be < 100 on A2",
                       check=lambda a: None if a.alpha < 100 else a.alpha, chips=frozenset({"A2"}),
                       violate=set_param("alpha", 100.0)),
        ],
        example=_toy_example,
        inplace=("y",),
    )


def _np_axpy(x, y, alpha):
    f = (y.astype(np.float32) + np.float32(alpha) * x.astype(np.float32)).astype(y.dtype)
    y[...] = f
    return y, (x.astype(np.float32) * 2).astype(x.dtype)


def _reference_impl(x, y, alpha):
    REC.calls.append(("reference", type(x), type(y)))
    return _np_axpy(x, y, alpha)


def _numpy_impl(x, y, alpha):
    REC.calls.append(("toy_np", type(x), type(y)))
    assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
    return _np_axpy(x, y, alpha)


def _torch_impl(x, y, alpha):
    REC.calls.append(("toy_torch", type(x), type(y)))
    assert is_torch(x) and is_torch(y) and x.device.type == "cpu"
    y.copy_((y.float() + alpha * x.float()).to(y.dtype))
    return y, (x.float() * 2).to(x.dtype)


class ToyNumpy(Backend):
    name = "toy_np"
    array_kind = "numpy"
    description = "test-local NumPy backend"


class ToyTorch(Backend):
    name = "toy_torch"
    array_kind = "torch"
    description = "test-local torch CPU backend"

    def device(self):
        return "cpu"


class ToyUnusable(Backend):
    name = "toy_unusable"

    def availability(self):
        return False, "toy reason: the toy accelerator is switched off"


class ToyLimited(Backend):
    """Computes like toy_np but its kernel only takes alpha == 2 and runs with the A2 chip's limits."""

    name = "toy_limited"
    array_kind = "numpy"

    def chip(self):
        return "A2"

    def limits(self, op):
        return [Constraint(id="toy_limited.alpha_two", param="alpha", kind="value",
                           reason="the toy kernel is compiled for alpha == 2 only",
                           check=lambda a: None if a.alpha == 2.0 else a.alpha)]


class ToyBrokenModule(Backend):
    name = "toy_broken"
    module = "qsfa_this_module_does_not_exist"


class ToyWrongArity(Backend):
    name = "toy_wrong_arity"

    def missing(self, op):
        return "the toy vendor library has no such kernel" if op == TOY_OP_2 else ""


@pytest.fixture
def toy():
    REC.calls.clear()
    REC.checks = 0
    define_operator(TOY_OP, _toy_contract(), outputs=("y", "z"), reference=_reference_impl)
    define_operator(TOY_OP_2, Contract(op=TOY_OP_2, example=lambda rng: {}), outputs=("out",),
                    reference=lambda: np.zeros(1))
    for be in (ToyNumpy(), ToyTorch(), ToyUnusable(), ToyLimited(), ToyBrokenModule(), ToyWrongArity()):
        register_backend(be)
    register_impl("toy_np", TOY_OP, _numpy_impl)
    register_impl("toy_torch", TOY_OP, _torch_impl)
    register_impl("toy_unusable", TOY_OP, _numpy_impl)
    register_impl("toy_limited", TOY_OP, _numpy_impl)
    register_impl("toy_wrong_arity", TOY_OP, lambda x, y, alpha: (y,))
    yield REC
    for name in ("toy_np", "toy_torch", "toy_unusable", "toy_limited", "toy_broken", "toy_wrong_arity"):
        _dispatch.unregister_backend(name)
    _dispatch._OPERATORS.pop(TOY_OP, None)
    _dispatch._OPERATORS.pop(TOY_OP_2, None)


# ------------------------------------------------------------------------------------------ inputs


def _inputs(caller, dtype, layout, seed=0):
    """x, the caller's in-place buffer y, the buffer y lives in, and y's initial values.

    "strided": y is every other column of a wider buffer filled with the sentinel 17 (NumPy: also with the
    rows reversed, a negative stride; torch has no negative strides).
    """
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    x = rng.integers(-8, 8, size=(3, 4)).astype(np.float32).astype(dt)
    y0 = rng.integers(-8, 8, size=(3, 4)).astype(np.float32).astype(dt)
    if layout == "contiguous":
        base = y0.copy()
        y = base
    else:
        base = np.full((3, 9), 17, dtype=dt)
        y = base[::-1, 1::2][:, :4] if caller == "numpy" else base[:, 1::2][:, :4]
        y[...] = y0
        assert not y.flags.c_contiguous
    if caller == "torch":
        base_t = to_torch(base).clone()
        y_t = base_t if layout == "contiguous" else base_t[:, 1::2][:, :4]
        assert layout == "contiguous" or not y_t.is_contiguous()
        return to_torch(x).clone(), y_t, base_t, y0
    return x, y, base, y0


def _bits(a):
    a = to_numpy(a) if is_torch(a) else a
    return np.ascontiguousarray(a).view(np.uint8)


# ------------------------------------------------------------------------------------ the dispatch path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("backend", ["reference", "toy_np", "toy_torch"])
@pytest.mark.parametrize("caller", ["numpy", "torch"])
def test_inplace_and_outputs_in_callers_kind(toy, caller, backend, layout, dtype):
    x, y, base, y0 = _inputs(caller, dtype, layout)
    base_before = _bits(base).copy()
    y_view_mask = np.zeros(to_numpy(base).shape if is_torch(base) else base.shape, bool)
    # positions of the in-place view inside its base (to check that nothing else was touched)
    if layout == "contiguous":
        y_view_mask[...] = True
    elif caller == "numpy":
        y_view_mask[::-1, 1::2][:, :4] = True
    else:
        y_view_mask[:, 1::2][:, :4] = True

    y_out, z = run(TOY_OP, {"x": x, "y": y, "alpha": 2.0}, backend=backend)

    # which array kind the backend computed in
    assert len(toy.calls) == 1
    be, tx, ty = toy.calls[0]
    assert be == backend
    if backend == "toy_torch":
        assert tx is torch.Tensor and ty is torch.Tensor
    else:
        assert tx is np.ndarray and ty is np.ndarray

    # the in-place output is the caller's own buffer, updated; everything around it untouched
    assert y_out is y
    x_np = to_numpy(x).astype(np.float32)
    expected_y = (y0.astype(np.float32) + 2 * x_np).astype(numpy_dtype(dtype))
    assert _bits(y).tobytes() == _bits(expected_y).tobytes()
    after = _bits(base)
    width = np.dtype(numpy_dtype(dtype)).itemsize
    outside = np.repeat(~y_view_mask, width, axis=-1)
    assert np.array_equal(after[outside], base_before[outside])

    # the new output comes back in the caller's kind
    expected_z = (x_np * 2).astype(numpy_dtype(dtype))
    if caller == "numpy":
        assert isinstance(z, np.ndarray)
    else:
        assert is_torch(z) and z.device.type == "cpu"
    assert dtype_name(z) == dtype
    assert _bits(z).tobytes() == _bits(expected_z).tobytes()


def test_validation_runs_once_before_the_backend(toy):
    args = _toy_example(np.random.default_rng(0))
    run(TOY_OP, args, backend="toy_np")
    assert toy.checks == 1 and len(toy.calls) == 1


@pytest.mark.parametrize("backend", ["reference", "toy_np", "toy_torch"])
@pytest.mark.parametrize("caller", ["numpy", "torch"])
def test_invalid_input_never_reaches_the_backend_and_writes_nothing(toy, caller, backend):
    contract = operators()[TOY_OP].contract
    for c in contract.constraints:
        if c.chips is not None:
            continue
        if caller == "torch" and c.id.rsplit(".", 1)[1].endswith(("_writable", "_overlap", "_aliasing", "_size")):
            continue  # to_torch copies the violating view into a fresh tensor (torch cases: test_hostile_buffers)
        bad = c.violate(_toy_example(np.random.default_rng(0)))
        if caller == "torch":
            bad = {k: (to_torch(v) if isinstance(v, np.ndarray) else v) for k, v in bad.items()}
        y_before = _bits(bad["y"]).tobytes()
        with pytest.raises((InvalidArgument, InvalidDtype)) as ei:
            run(TOY_OP, bad, backend=backend)
        assert ei.value.constraint_id == c.id
        assert str(ei.value).startswith(f"Invalid {c.kind} for {c.param}, actual: ")
        assert _bits(bad["y"]).tobytes() == y_before
    assert toy.calls == []


def test_chip_rules_apply_only_on_a_backend_for_that_chip(toy):
    args = _toy_example(np.random.default_rng(0))
    args["alpha"] = 150.0
    run(TOY_OP, copy_args(args), backend="toy_np")  # no chip: the A2 rule does not apply
    assert len(toy.calls) == 1
    with pytest.raises(InvalidArgument) as ei:
        run(TOY_OP, copy_args(args), backend="toy_limited")
    assert ei.value.constraint_id == f"{TOY_OP}.alpha_a2"
    assert len(toy.calls) == 1


def test_backend_limits_raise_unsupported_before_any_write(toy):
    args = _toy_example(np.random.default_rng(0))
    args["alpha"] = 3.0
    y_before = args["y"].tobytes()
    with pytest.raises(UnsupportedByBackend) as ei:
        run(TOY_OP, args, backend="toy_limited")
    msg = str(ei.value)
    assert msg.startswith("backend 'toy_limited' does not support this call: Invalid value for alpha, actual: 3.0")
    assert "compiled for alpha == 2 only" in msg
    assert ei.value.constraint_id == "toy_limited.alpha_two" and ei.value.backend == "toy_limited"
    assert args["y"].tobytes() == y_before and toy.calls == []
    args["alpha"] = 2.0
    run(TOY_OP, args, backend="toy_limited")
    assert len(toy.calls) == 1


def test_tensors_on_different_devices_are_rejected(toy):
    x = torch.zeros((3, 4))
    y = torch.zeros((3, 4), device="meta")
    with pytest.raises(InvalidArgument) as ei:
        run(TOY_OP, {"x": x, "y": y, "alpha": 2.0}, backend="toy_torch")
    assert "x on cpu" in str(ei.value) and "y on meta" in str(ei.value)
    assert toy.calls == []


def test_same_device_treats_an_unindexed_backend_device_as_that_type():
    same = _dispatch._same_device
    assert same(torch.device("cpu"), "cpu") and same(torch.device("meta"), "meta")
    assert same(torch.device("cuda:0"), "cuda") and same(torch.device("cuda:1"), "cuda")
    assert same(torch.device("cuda:0"), "cuda:0") and not same(torch.device("cuda:1"), "cuda:0")
    assert not same(torch.device("cpu"), "cuda") and not same(torch.device("meta"), "cpu")


def test_numpy_and_torch_arguments_mix(toy):
    """A torch tensor among NumPy arrays makes the caller a torch caller: results come back as tensors."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = torch.zeros((3, 4))
    y_out, z = run(TOY_OP, {"x": x, "y": y, "alpha": 2.0}, backend="toy_np")
    assert y_out is y and y.numpy().tolist() == (2 * x).tolist()
    assert is_torch(z) and z.numpy().tolist() == (2 * x).tolist()


def test_unknown_backend_lists_the_known_ones(toy):
    with pytest.raises(UnknownBackend) as ei:
        run(TOY_OP, _toy_example(np.random.default_rng(0)), backend="cuda")
    msg = str(ei.value)
    assert msg.startswith("unknown backend 'cuda'; known backends: ")
    for name in ("'npu'", "'reference'", "'triton'", "'toy_np'"):
        assert name in msg
    assert isinstance(ei.value, ValueError)
    with pytest.raises(UnknownBackend):
        run(TOY_OP, _toy_example(np.random.default_rng(0)), backend=None)


def test_unusable_backend_raises_its_reason(toy):
    with pytest.raises(BackendUnavailable) as ei:
        run(TOY_OP, _toy_example(np.random.default_rng(0)), backend="toy_unusable")
    assert str(ei.value) == ("backend 'toy_unusable' is not usable here: "
                             "toy reason: the toy accelerator is switched off")
    assert toy.calls == []


def test_backend_without_the_operator_says_so(toy):
    with pytest.raises(NotImplementedByBackend) as ei:
        run(TOY_OP_2, {}, backend="toy_np")
    assert str(ei.value).startswith("backend 'toy_np' does not implement toy_unimplemented")
    assert isinstance(ei.value, NotImplementedError)


def test_backend_says_why_it_lacks_an_operator(toy):
    with pytest.raises(NotImplementedByBackend) as ei:
        run(TOY_OP_2, {}, backend="toy_wrong_arity")
    assert str(ei.value) == ("backend 'toy_wrong_arity' does not implement toy_unimplemented: "
                             "the toy vendor library has no such kernel")
    with pytest.raises(NotImplementedByBackend) as ei:
        run(TOY_OP_2, {}, backend="toy_np")
    assert str(ei.value) == "backend 'toy_np' does not implement toy_unimplemented"


def test_backend_returning_the_wrong_number_of_outputs_is_an_error(toy):
    with pytest.raises(RuntimeError, match="returned 1 outputs for toy_axpy, expected 2"):
        run(TOY_OP, _toy_example(np.random.default_rng(0)), backend="toy_wrong_arity")


def test_unknown_operator_lists_the_known_ones(toy):
    with pytest.raises(KeyError, match="unknown operator 'toy_nope'.*toy_axpy"):
        run("toy_nope", {}, backend="reference")


def test_backends_lists_every_backend_with_usability_and_reason(toy):
    st = qsfa.backends()
    for name in ("reference", "npu", "triton", "toy_np", "toy_unusable", "toy_broken"):
        assert name in st
    for name, s in st.items():
        assert s.name == name and isinstance(s.usable, bool)
        if not s.usable:
            assert s.reason, f"{name} is unusable without a reason"
            assert s.operators == ()
            assert str(s) == f"{name}: unusable: {s.reason}"
        else:
            assert str(s) == f"{name}: usable"
    assert st["reference"].usable and TOY_OP in st["reference"].operators
    assert st["toy_np"].usable and st["toy_np"].operators == (TOY_OP,)
    assert not st["toy_unusable"].usable and "switched off" in st["toy_unusable"].reason
    assert not st["toy_broken"].usable
    assert st["toy_broken"].reason.startswith("loading qsfa_this_module_does_not_exist failed: ModuleNotFoundError")
    assert st["npu"].description and st["triton"].description


def test_registering_a_backend_twice_is_refused_unless_replaced(toy):
    with pytest.raises(ValueError, match="already registered"):
        register_backend(ToyNumpy())
    register_backend(ToyNumpy(), replace=True)
    with pytest.raises(ValueError, match="needs a name"):
        register_backend(Backend())


def test_unregister_removes_the_implementations(toy):
    _dispatch.unregister_backend("toy_np")
    assert "toy_np" not in operators()[TOY_OP].impls
    with pytest.raises(UnknownBackend):
        run(TOY_OP, _toy_example(np.random.default_rng(0)), backend="toy_np")


def test_defining_an_operator_twice_is_refused(toy):
    with pytest.raises(RuntimeError, match="defined twice"):
        define_operator(TOY_OP, _toy_contract(), outputs=("y", "z"), reference=_reference_impl)


# --------------------------------------------------------------- real operators: NumPy vs torch callers


def _real_ops():
    return sorted(n for n in operators() if not n.startswith("toy_"))


def _as_torch(v):
    return to_torch(v).clone() if isinstance(v, np.ndarray) else v


@pytest.mark.parametrize("op_name", _real_ops())
def test_reference_gives_identical_bytes_for_numpy_and_torch_callers(op_name):
    op = operators()[op_name]
    if op.contract.example is None:
        pytest.fail(f"{op_name} has no example argument set")
    np_args = op.contract.example(np.random.default_rng(0))
    t_args = {k: _as_torch(v) for k, v in copy_args(np_args).items()}
    res_np = run(op_name, np_args, backend="reference")
    res_t = run(op_name, t_args, backend="reference")
    res_np = res_np if isinstance(res_np, tuple) else (res_np,)
    res_t = res_t if isinstance(res_t, tuple) else (res_t,)
    assert len(res_np) == len(res_t) == len(op.outputs)
    for name, a, b in zip(op.outputs, res_np, res_t):
        if a is None:
            assert b is None, name
            continue
        assert isinstance(a, np.ndarray) and is_torch(b), name
        b_np = to_numpy(b)
        assert a.shape == b_np.shape and a.dtype == b_np.dtype, name
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b_np).tobytes(), name
        if name in op.contract.inplace:
            assert a is np_args[name] and b is t_args[name], name
    for name in op.contract.inplace:  # the in-place buffers hold the same bytes too
        if np_args.get(name) is not None:
            assert np.ascontiguousarray(np_args[name]).tobytes() == \
                np.ascontiguousarray(to_numpy(t_args[name])).tobytes(), name


def test_an_operator_prints_as_its_name_outputs_and_backends():
    import qsfa

    ops = qsfa.operators()
    enc = ops["formats.encode"]
    # other tests may register more backends for it: the list is whatever impls holds, sorted
    assert repr(enc) == f"Operator('formats.encode', outputs=('codes',), backends={sorted(enc.impls)!r})"
    assert "'reference'" in repr(enc)
    assert len(repr(ops)) < 200 * len(ops)  # the dataclass repr printed every contract (~300 KB)


def test_an_output_buffer_is_not_uploaded_to_a_device():
    """An output buffer (written, never read: ``attention_out=``) goes to a non-CPU device as an uninitialised tensor
    of its shape and dtype - its bytes are not copied there; an in-place buffer's are (the kernel reads them); on
    the CPU both are zero-copy views."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    import qsfa._dispatch as D

    seen = []
    real = D.to_torch

    def spy(a, device=None, like=None):
        seen.append((np.asarray(a).size, str(device)))
        return real(a, device=device, like=like)

    buf = np.full((3, 4, 8), 7, ml_dtypes.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, "to_torch", spy)
        t = D._device_array(buf, torch.device("meta"), output_only=True)
        assert tuple(t.shape) == buf.shape and t.dtype == torch.bfloat16 and t.device.type == "meta"
        assert all(size != buf.size for size, _ in seen)  # only a 0-element dtype template was converted
        seen.clear()
        t = D._device_array(buf, torch.device("meta"), output_only=False)
        assert seen == [(buf.size, "meta")] and t.device.type == "meta"
        seen.clear()
        t = D._device_array(buf, "cpu", output_only=True)
        assert seen == [(buf.size, "cpu")]
        assert t.data_ptr() == buf.ctypes.data  # a view of the caller's buffer
