"""One dispatch path for every operator and every backend.

``run(op, args, backend)``:

1. resolves the backend by name (unknown name -> the list of known ones; unusable -> why) and the chip
   the call models (``chip=``, the npu device's chip, or the rule of :mod:`qsfa.chips`);
2. checks that the backend implements the operator;
3. detects the caller's array kind (NumPy, or torch on one device);
4. validates the arguments once against the operator's :class:`~qsfa._contract.Contract` (plus the
   backend's chip-specific rules and kernel limits) on host NumPy views - nothing has been written yet;
5. hands the normalised arguments to the backend in the array kind it computes in;
6. copies in-place buffers back where the backend computed on a copy, and returns results in the
   caller's kind (NumPy in, NumPy out; torch in, torch out on the caller's device).

Backends only compute. Adding one means registering a :class:`Backend` and its implementations.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ._arrays import caller_kind, is_torch, to_numpy, to_torch, torch_module
from ._contract import Args, Constraint, Contract
from ._errors import (
    BackendUnavailable,
    InvalidArgument,
    InvalidDtype,
    Raw,
    NotImplementedByBackend,
    UnknownBackend,
    UnsupportedByBackend,
)

__all__ = [
    "Operator",
    "Backend",
    "BackendStatus",
    "define_operator",
    "operator",
    "operators",
    "register_backend",
    "unregister_backend",
    "register_impl",
    "get_backend",
    "backends",
    "run",
    "check_call",
]


@dataclass
class Operator:
    """A public operator: its contract, the names of its outputs and its implementations."""

    name: str
    contract: Contract
    outputs: tuple[str, ...]
    impls: dict[str, Callable] = field(default_factory=dict)
    doc: str = ""
    #: ``numerics(chip, args) -> dict``: the chip's rounding / saturation parameters for the implementations
    #: (qsfa.chips); None when the operator's numerics do not depend on the chip
    numerics: Callable | None = None

    def __repr__(self):
        # the dataclass repr would print the whole contract (hundreds of KB for qsfa.operators())
        return f"Operator({self.name!r}, outputs={self.outputs!r}, backends={sorted(self.impls)!r})"


_OPERATORS: dict[str, Operator] = {}


def define_operator(name: str, contract: Contract, outputs: tuple[str, ...], reference: Callable,
                    doc: str = "", numerics: Callable | None = None) -> Operator:
    """Declare an operator with its reference implementation (called with the normalised args).

    ``numerics(chip, args) -> dict``: the rounding / saturation parameters of ``chip`` (qsfa.chips), added to
    the arguments of every backend whose ``models_numerics`` is true (reference, triton)."""
    if name in _OPERATORS:
        raise RuntimeError(f"operator {name!r} defined twice")
    op = Operator(name, contract, tuple(outputs), {"reference": reference}, doc, numerics)
    _OPERATORS[name] = op
    return op


def operator(name: str) -> Operator:
    op = _OPERATORS.get(name)
    if op is not None:  # registered already: skip re-importing the eleven operator modules (every dispatch)
        return op
    _load_all_operators()
    try:
        return _OPERATORS[name]
    except KeyError:
        raise KeyError(f"unknown operator {name!r}; known: {sorted(_OPERATORS)}") from None


def operators() -> dict[str, Operator]:
    _load_all_operators()
    return dict(_OPERATORS)


# Modules that define operators; importing them registers the operators.
_OPERATOR_MODULES = (
    "qsfa.formats",
    "qsfa.ops.quant",
    "qsfa.ops.scatter",
    "qsfa.ops.c8_cache",
    "qsfa.ops.kv_compress_epilog",
    "qsfa.ops.kv_rmsnorm_rope_cache",
    "qsfa.ops.attention",
    "qsfa.ops.indexer",
    "qsfa.ops.lse",
    "qsfa.ops.layouts",
    "qsfa.ops.kv_compress_epilog_vllm",
    "qsfa.ops.indexer_cache",
    "qsfa.ops.k_scale_cache",
    "qsfa.ops.indexer_v4",
    "qsfa.ops.sharedkv",
    "qsfa.ops.quant_lightning_indexer_v2",
    "qsfa.ops.qkv_k_scale",
    "qsfa.ops.compressor",
    "qsfa.ops.vllm_compressor",
)


def _load_all_operators():
    for m in _OPERATOR_MODULES:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:  # a group not written yet must not break the others
            if e.name != m:
                raise


@dataclass
class BackendStatus:
    name: str
    usable: bool
    reason: str
    description: str
    operators: tuple[str, ...]

    def __str__(self):
        state = "usable" if self.usable else f"unusable: {self.reason}"
        return f"{self.name}: {state}"


class Backend:
    """A place where operators run.

    Subclasses (or instances with the attributes set) provide:

    name:        registry key.
    array_kind:  "numpy" (implementations get NumPy arrays) or "torch" (tensors on ``device()``).
    module:      optional module imported before the first call; it registers implementations with
                 :func:`register_impl` (keeps heavy imports out of ``import qsfa``).
    availability() -> (usable, reason).
    chip() -> chip family ("A2", "A3", "950") whose hardware limits apply, or None.
    device() -> torch device for array_kind "torch".
    models_numerics: whether the implementations compute in software and need the chip's rounding
                 parameters (``Operator.numerics``); False for hardware that rounds by itself (npu).
    limits(op) -> list of :class:`Constraint` the backend's kernels add (checked after the contract;
                 a violation raises :class:`UnsupportedByBackend`).
    missing(op) -> why the backend has no implementation of ``op`` ("" if it has no reason to give);
                 appended to the :class:`NotImplementedByBackend` message.
    """

    name: str = ""
    array_kind: str = "numpy"
    module: str | None = None
    description: str = ""
    models_numerics: bool = True

    def availability(self) -> tuple[bool, str]:
        return True, ""

    def chip(self) -> str | None:
        return None

    def device(self):
        return "cpu"

    def limits(self, op: str) -> list[Constraint]:
        return []

    def missing(self, op: str) -> str:
        return ""

    def load(self):
        if self.module:
            importlib.import_module(self.module)


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    if not backend.name:
        raise ValueError("a backend needs a name")
    if backend.name in _BACKENDS and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered")
    _BACKENDS[backend.name] = backend
    return backend


def unregister_backend(name: str):
    _BACKENDS.pop(name, None)
    for op in _OPERATORS.values():
        op.impls.pop(name, None)


def register_impl(backend: str, op: str, fn: Callable | None = None):
    """Register ``fn`` as ``backend``'s implementation of ``op`` (usable as a decorator)."""

    def deco(f):
        operator(op).impls[backend] = f
        return f

    return deco(fn) if fn is not None else deco


def _known() -> str:
    return ", ".join(repr(n) for n in sorted(_BACKENDS))


#: entry-point group through which an installed package declares backends (``name = "pkg.mod"`` or
#: ``"pkg.mod:obj"``; obj a Backend, a Backend subclass, or a function that registers), loaded on first use
ENTRY_POINT_GROUP = "qsfa.backends"
_ENTRY_POINT_ERRORS: dict[str, str] = {}


def _load_entry_points(name: str | None = None) -> set:
    """Load the ``qsfa.backends`` entry points (only ``name``'s when given) not registered yet; returns the names
    of the entry points installed now."""
    from importlib.metadata import entry_points

    present = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if name is not None and ep.name != name:
            continue
        present.add(ep.name)
        if ep.name in _BACKENDS or ep.name in _ENTRY_POINT_ERRORS:
            continue
        try:
            obj = ep.load()
            if ep.name not in _BACKENDS:  # importing a module may have registered it already
                if isinstance(obj, type) and issubclass(obj, Backend):
                    obj = obj()
                if isinstance(obj, Backend):
                    register_backend(obj, replace=True)
                elif callable(obj):
                    obj()
            if ep.name not in _BACKENDS:
                raise LookupError(f"loading it registered no backend named {ep.name!r}")
        except Exception as e:  # noqa: BLE001 - a broken plugin must not break the others; report it by name
            _ENTRY_POINT_ERRORS[ep.name] = f"entry point {ep.value!r} failed: {type(e).__name__}: {e}"
    return present


def get_backend(name: str, *, require_usable: bool = True) -> Backend:
    _ensure_builtin_backends()
    if isinstance(name, str) and name not in _BACKENDS:
        if name in _load_entry_points(name) and name in _ENTRY_POINT_ERRORS:
            raise BackendUnavailable(f"backend {name!r} is not usable here: {_ENTRY_POINT_ERRORS[name]}")
    if not isinstance(name, str) or name not in _BACKENDS:
        raise UnknownBackend(f"unknown backend {name!r}; known backends: {_known()}")
    be = _BACKENDS[name]
    if require_usable:
        ok, why = be.availability()
        if not ok:
            raise BackendUnavailable(f"backend {name!r} is not usable here: {why}")
        be.load()
    return be


def backends() -> dict[str, BackendStatus]:
    """Every registered backend, whether it is usable here and, if not, why."""
    _ensure_builtin_backends()
    _load_all_operators()
    present = _load_entry_points()
    out = {}
    for name, why in sorted(_ENTRY_POINT_ERRORS.items()):
        if name not in _BACKENDS and name in present:
            out[name] = BackendStatus(name, False, why, "", ())
    for name, be in sorted(_BACKENDS.items()):
        ok, why = be.availability()
        if ok:
            try:
                be.load()
            except Exception as e:  # a backend whose module fails to import is not usable
                ok, why = False, f"loading {be.module} failed: {type(e).__name__}: {e}"
        ops = tuple(sorted(n for n, op in _OPERATORS.items() if name in op.impls)) if ok else ()
        out[name] = BackendStatus(name, ok, why, be.description, ops)
    return dict(sorted(out.items()))


_BUILTINS_DONE = False


def _ensure_builtin_backends():
    global _BUILTINS_DONE
    if _BUILTINS_DONE:
        return
    _BUILTINS_DONE = True
    from . import _builtin_backends  # noqa: F401  (registers reference, npu, triton)


def check_call(op_name: str, args: Mapping[str, Any], backend: str = "reference", chip: str | None = None) -> None:
    """Everything :func:`run` checks before it computes (backend, chip, the contract, the backend's limits), without
    computing or writing: a composite operator (``qsfa.c8_pipeline``) checks every step's writer with it before
    its first write."""
    _prepare(op_name, args, backend, chip)


def run(op_name: str, args: Mapping[str, Any], backend: str = "reference", chip: str | None = None):
    """Validate ``args`` once and run ``op_name`` on ``backend`` modelling ``chip``; see the module docstring
    and :mod:`qsfa.chips` (which chip a call models)."""
    op, be, impl, kind, host, normalised, chip = _prepare(op_name, args, backend, chip)
    return _run_checked(op, be, impl, kind, host, normalised, chip, args)


def _prepare(op_name: str, args: Mapping[str, Any], backend: str, chip: str | None):
    """Steps 1-4 of :func:`run`: ``(op, backend, impl, caller kind, host views, normalised args, chip)``."""
    from .chips import check_chip

    op = operator(op_name)
    chip = check_chip(chip)
    be = get_backend(backend)
    impl = op.impls.get(be.name)
    if impl is None:
        why = be.missing(op_name)
        raise NotImplementedByBackend(f"backend {be.name!r} does not implement {op_name}" + (f": {why}" if why else ""))

    names = list(args)
    kind = caller_kind([args[n] for n in names], names)

    # In-place tensors: layout and aliasing read from the tensors themselves (a device tensor's host copy
    # would hide an expand()-ed view or a view of another argument); CPU tensors are also checked exactly below.
    for n in op.contract.inplace:
        if is_torch(args.get(n)):
            _check_tensor_buffer(op, n, args)
    for n in op.contract.written():
        _check_no_grad(n, args.get(n))
    # Host NumPy views for validation (zero-copy for CPU tensors); NumPy numbers and ndarray subclasses as the
    # plain values they stand for.
    host = Args({n: (_host_view(n, v) if is_torch(v) else _plain_value(op, n, v)) for n, v in args.items()})
    be_chip = be.chip()
    if chip is not None and be_chip is not None and chip != be_chip:
        raise InvalidArgument("value", "chip", chip,
                              f"backend {be.name!r} runs on its device's chip {be_chip!r}; pass chip=None or "
                              f"chip={be_chip!r}")
    chip = chip or be_chip
    try:
        normalised = op.contract.validate(host, chip=chip)
    except (InvalidArgument, InvalidDtype) as e:
        raise _as_passed(e, args, host) from None
    for c in be.limits(op_name):
        actual = c.check(normalised)
        if actual is not None:
            raise UnsupportedByBackend(be.name, str(c.error(actual)), constraint_id=c.id)
    return op, be, impl, kind, host, normalised, chip


def _device_array(v: np.ndarray, dev, *, output_only: bool):
    """``v`` as a tensor on the backend's device ``dev``. An output buffer (``attention_out=`` and the like: written,
    never read) is not uploaded to a device other than the CPU: an uninitialised tensor of its shape and dtype
    takes the result, which is copied back into the caller's buffer after the call; on the CPU it is a zero-copy
    view like every other array."""
    if output_only and str(dev) != "cpu":
        template = to_torch(np.empty((0,), v.dtype))  # (the torch dtype of v's, bf16 / fp8 included)
        return torch_module().empty(v.shape, dtype=template.dtype, device=dev)
    return to_torch(v, device=dev)


def _run_checked(op, be, impl, kind, host, normalised, chip, args):
    """Steps 5-6 of :func:`run`: arguments in the backend's array kind (remembering in-place buffers that need
    copying back), the call, the copy-back and the outputs in the caller's kind."""
    from .chips import chip_for_args

    call_args: dict[str, Any] = {}
    copy_back: dict[str, tuple[Any, Any]] = {}
    for n, v in normalised.items():
        orig = args.get(n)
        inplace = n in op.contract.written() and orig is not None  # in-place and output buffers
        if be.array_kind == "numpy":
            call_args[n] = v
            if inplace and is_torch(orig) and orig.device.type != "cpu":
                copy_back[n] = (orig, v)
        else:  # torch backend
            dev = be.device()
            if is_torch(orig) and orig is not None and _same_device(orig.device, dev) and v is host.get(n):
                call_args[n] = orig
            elif isinstance(v, np.ndarray):
                call_args[n] = _device_array(v, dev, output_only=inplace and n not in op.contract.inplace)
                if inplace:
                    copy_back[n] = (orig, call_args[n])
            else:
                call_args[n] = v

    if op.numerics is not None and be.models_numerics:
        call_args.update(op.numerics(chip or chip_for_args(op.contract, host), normalised))
    try:
        result = impl(**call_args)
    except MemoryError as e:
        raise _out_of_memory(host) from e

    for n, (orig, computed) in copy_back.items():
        _copy_into(orig, computed)

    single = not isinstance(result, tuple)
    results = (result,) if single else result
    if len(results) != len(op.outputs):
        raise RuntimeError(
            f"backend {be.name!r} returned {len(results)} outputs for {op.name}, expected {len(op.outputs)}"
        )
    # a result that is the base-ndarray view of a caller's subclass (an attention_out= np.memmap) is that object
    viewed = {id(v): n for n, v in host.items() if isinstance(v, np.ndarray) and v is not args.get(n)
              and isinstance(args.get(n), np.ndarray)}
    out = []
    for name, r in zip(op.outputs, results):
        if name in op.contract.written() and args.get(name) is not None:
            out.append(args[name])  # the caller's own buffer, updated in place (or an output buffer it passed)
        elif id(r) in viewed:
            out.append(args[viewed[id(r)]])
        else:
            out.append(kind.wrap(r))
    return out[0] if single else tuple(out)


_FLOAT64_MAX = float(np.finfo(np.float64).max)


def _plain_value(op: Operator, name: str, v):
    """What validation and the backends see for a caller's value (docs/architecture.md, "Declared parameter
    types"), one rule for every operator:

    * a NumPy scalar (``np.float32(1.0)``) passed for an array parameter is the 0-d array it stands for; in-place
      buffers are not converted (a scalar cannot be written in place, so it stays rejected by the type rule);
    * an ndarray subclass (``np.matrix``, ``np.memmap``) is the base ndarray it views (the same memory, so an
      in-place write lands in the caller's object); a masked array is not converted (the type rule refuses it);
    * a NumPy integer / float / bool passed for an int / float / bool parameter is the Python number of the same
      value (``np.uint8(64)`` -> 64), so no rule computes in the caller's 8-bit type and overflows;
    * an integer (Python or NumPy) passed for a float / float32 parameter is the Python float of its value when
      float64 holds it (``1 << 70`` -> 1.1805916207174113e+21), so a rule's ``np.isfinite`` never meets an int
      beyond int64 (a TypeError from inside NumPy); one float64 does not hold stays an int for the type rule.

    Python numbers and lists stay as they are (lists are rejected by the type rule)."""
    p = op.contract.params.get(name)
    if p is None:
        return v
    if isinstance(v, np.ndarray):
        if type(v) is not np.ndarray and not isinstance(v, np.ma.MaskedArray):
            return np.asarray(v)
        return v
    t = p.type
    if t in ("float", "float32") and isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return float(v) if abs(int(v)) <= _FLOAT64_MAX else int(v)
    if not isinstance(v, np.generic):
        return v
    if t == "array":
        return v if name in op.contract.inplace else np.asarray(v)
    if t == "int" and isinstance(v, np.integer):
        return int(v)
    if t in ("float", "float32") and isinstance(v, np.floating):
        return float(v)
    if t == "bool" and isinstance(v, np.bool_):
        return bool(v)
    return v


def _check_no_grad(name: str, t):
    """A torch tensor the call writes (an in-place buffer or an output buffer) must not require grad: autograd
    cannot see a write made through its memory (torch itself refuses in-place writes to such a leaf)."""
    if is_torch(t) and t.requires_grad:
        raise InvalidArgument("value", name, Raw("a tensor with requires_grad=True"),
                              "a buffer the operator writes must not require grad (autograd would not see the "
                              "write); pass tensor.detach() to write its memory anyway")


def _as_passed(e, args: Mapping, host: Mapping):
    """``e`` reporting the caller's value: a type rule that rejected the NumPy view of a torch tensor
    (``scale_value=torch.tensor(0.04)``) describes the tensor the caller passed, not its host copy."""
    from ._contract import _describe
    from ._errors import Raw

    orig = args.get(e.param)
    if not is_torch(orig) or host.get(e.param) is orig or e.actual != _describe(host.get(e.param)):
        return e
    return type(e)(e.kind, e.param, Raw(_describe(orig)), e.reason, constraint_id=e.constraint_id)


def _host_view(name: str, t):
    """``to_numpy`` of a tensor argument; a layout or dtype NumPy cannot hold is an error naming it."""
    if str(t.layout) != "torch.strided":
        raise InvalidArgument("layout", name, str(t.layout).replace("torch.", ""),
                              "only dense (strided) tensors are supported; call .to_dense() first")
    try:
        return to_numpy(t)
    except (TypeError, RuntimeError) as e:
        raise InvalidDtype("dtype", name, str(t.dtype).replace("torch.", ""),
                           f"has no NumPy equivalent ({type(e).__name__}: {e})") from e


def _check_tensor_buffer(op: Operator, name: str, args: Mapping):
    """The overlap / aliasing rules of in-place buffer ``name`` (a torch tensor), from its strides and storage."""
    from ._buffers import tensor_layout_overlaps, tensors_may_share

    t = args[name]
    if str(t.layout) != "torch.strided":
        return  # rejected by name in _host_view
    if tensor_layout_overlaps(t):
        c = op.contract.constraint(f"{op.name}.{name}_overlap")
        raise c.error(Raw(f"shape {tuple(t.shape)} with strides {tuple(t.stride())} (elements)"))
    if t.device.type == "cpu":
        return  # the host views share the memory: the exact NumPy test of the contract applies
    for k, w in args.items():
        if k != name and is_torch(w) and str(w.layout) == "torch.strided" and tensors_may_share(t, w):
            c = op.contract.constraint(f"{op.name}.{name}_aliasing")
            raise c.error(Raw(f"shares memory with {k}"))


def _out_of_memory(host: Mapping) -> InvalidArgument:
    """A MemoryError of a backend, reported against the largest array argument."""
    arrays = [(v.size * v.dtype.itemsize, n, v) for n, v in host.items() if isinstance(v, np.ndarray)]
    if not arrays:
        return InvalidArgument("value", "arguments", Raw("out of memory"), "the call ran out of memory")
    _, name, v = max(arrays, key=lambda t: t[0])
    return InvalidArgument("shape", name, Raw(f"shape {tuple(v.shape)} of {v.dtype}"),
                           "the computation ran out of memory for an input of this size; split the call")


def _same_device(a, b) -> bool:
    """Whether tensor device ``a`` is the backend device ``b``; a ``b`` without an index ("npu", "cuda")
    names the current device of that type, so a caller's "npu:0" tensor is used as it is."""
    sb = str(b)
    return str(a) == sb or (":" not in sb and a.type == sb)


def _copy_into(orig, computed):
    """Write ``computed`` (NumPy or tensor) into the caller's buffer ``orig`` in place."""
    if is_torch(orig):
        src = computed if is_torch(computed) else to_torch(np.asarray(computed))
        orig.copy_(src.to(orig.device).view(orig.dtype) if src.dtype != orig.dtype else src.to(orig.device))
    else:
        src = to_numpy(computed) if is_torch(computed) else np.asarray(computed)
        np.copyto(orig, src.view(orig.dtype) if src.dtype != orig.dtype else src)

