"""Hostile inputs for every public operator, generated from the operators' contracts (issue 12).

For every operator (and ``qsfa.formats.round_to``) and every parameter of its contract's example, this module
builds the hostile variants a careless or malicious caller produces - None, a wrong type, a wrong dtype, a wrong
rank, NaN / Inf, an empty array, read-only, stride-0 and aliased buffers, a huge declared size, torch sparse and
``expand()``-ed tensors; since issue 27 also masked arrays, ``np.matrix``, structured / object / void dtypes,
integers beyond float64 (and beyond int64) and 1e300 for float parameters, unsigned NumPy integers for int parameters and in-place
tensors that require grad - from the parameter's *declared type* (``Contract.params``), so a new parameter is covered
without new code. Each case says what a correct library does with it:

* ``must_reject``: an invalid call; it must raise a qsfa error (``InvalidArgument`` / ``InvalidDtype``) naming the
  parameter, and leave every array argument byte-identical;
* ``may_accept``: a call that can be valid (an empty array, NaN in a float input, a stride-0 input); it must
  either succeed or raise a qsfa error naming the parameter - never another exception, never a partial write;
* ``must_accept``: a valid call in a hostile-looking form (a read-only input); it must succeed.

:func:`run_case` sorts an outcome into the issue's classes: ``clear`` (a qsfa error naming the parameter, nothing
written), ``foreign`` (a traceback from inside NumPy / Python), ``silent`` (an invalid call accepted, a partial
write, a hang), plus ``related`` (a qsfa error, nothing written, naming another parameter: a rule relating two
parameters, e.g. an empty ``x`` reported as ``slot_mapping`` not matching ``x.shape[:-1]``) and ``accepted`` (a
call that may or must succeed did). ``python tests/hostile_cases.py`` runs the whole campaign, each case in a forked child with a time and memory
limit, and prints the counts per class (``--declared FILE`` supplies the parameter types for a qsfa version whose
contracts do not declare them, e.g. to measure an older commit).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

HUGE = 1 << 48  # elements of a "huge declared size" view (256 TiB even of bytes: beyond any machine)
HUGE_INT = 1 << 40  # a huge integer parameter (a block size, a count)
_FLOAT_KINDS = "fV"  # ml_dtypes' float types have kind "V"


@dataclass
class Case:
    op: str  # operator name (or "formats.round_to")
    param: str
    kind: str
    expect: str  # "must_reject" | "may_accept" | "must_accept"
    build: Callable[[dict], dict]  # valid example -> hostile arguments
    torch: bool = False  # the case passes torch tensors

    @property
    def id(self) -> str:
        return f"{self.op}:{self.param}:{self.kind}"


# ---------------------------------------------------------------------------------------------------------------
# operators, examples, declared types


def public_function(op: str):
    """The public callable of an operator (``qsfa.formats.encode`` for "formats.encode")."""
    import importlib

    import qsfa

    if "." in op:  # "formats.encode" -> qsfa.formats.encode, "layouts.x" -> qsfa.layouts.x
        mod, name = op.split(".", 1)
        return getattr(importlib.import_module(f"qsfa.{mod}"), name)
    return getattr(qsfa, op)


def operator_table(declared: dict | None = None) -> dict:
    """op -> (example(rng) -> dict, inplace names, {param: (type, optional)})."""
    from qsfa._dispatch import operators

    out = {}
    for name, op in sorted(operators().items()):
        c = op.contract
        if declared is not None:
            types = {p: tuple(t) for p, t in declared.get(name, {}).items()}
        else:
            types = {p.name: (p.type, p.optional) for p in getattr(c, "params", {}).values()}
        out[name] = (c.example, tuple(c.inplace), types)
    if "formats.encode" in out:  # round_to = decode(encode(...)): the same parameters as encode
        out["formats.round_to"] = out["formats.encode"]
    return out


def declared_types() -> dict:
    """{op: {param: [type, optional]}} of this qsfa (for ``--declared`` runs against another version)."""
    return {op: {p: list(t) for p, t in types.items()} for op, (_, _, types) in operator_table().items()}


# ---------------------------------------------------------------------------------------------------------------
# case generation


def _set(param, value_fn):
    def build(base):
        out = dict(base)
        out[param] = value_fn(base.get(param), base)
        return out

    return build


def _huge_view(v):
    v = np.ascontiguousarray(v if v.ndim else v.reshape(1))
    if v.size == 0:
        v = np.zeros((1,) + v.shape[1:], v.dtype) if all(v.shape[1:]) else np.zeros((1,), v.dtype)
    rest = int(np.prod(v.shape[1:]))
    n0 = -(-HUGE // max(rest, 1))
    return np.lib.stride_tricks.as_strided(v, (n0, *v.shape[1:]), (0, *v.strides[1:]), writeable=False)


def _stride0(v):
    v = np.array(v)
    ax = next((i for i, n in enumerate(v.shape) if n > 1), None)
    if ax is None:
        return None
    strides = tuple(0 if i == ax else s for i, s in enumerate(v.strides))
    return np.lib.stride_tricks.as_strided(v, v.shape, strides, writeable=True)


def _readonly(v):
    v = np.array(v)
    v.flags.writeable = False
    return v


def _with_nonfinite(x):
    def f(v, _):
        v = np.array(v)
        v.reshape(-1)[0] = x
        return v

    return f


def _masked(v, _):
    """A masked array (the first element masked; a float one holds NaN under the mask)."""
    data = np.array(v)
    if data.dtype.kind in _FLOAT_KINDS:
        data.reshape(-1)[0] = np.nan
    mask = np.zeros(data.shape, bool)
    mask.reshape(-1)[0] = True
    return np.ma.masked_array(data, mask=mask)


def _matrix(v, _):
    import warnings

    with warnings.catch_warnings():  # NumPy's PendingDeprecationWarning for np.matrix: the point of the case
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.asmatrix(v)


def _structured(v, _):
    """The same bytes as a structured dtype of one field of ``v``'s dtype."""
    return np.ascontiguousarray(v).view([("a", v.dtype)])


def _torch_grad(base, param):
    """Every array argument a CPU tensor; ``param`` one that requires grad."""
    out = _to_torch_all(base)
    out[param] = out[param].detach().clone().requires_grad_(True)
    return out


def _can_require_grad(v) -> bool:
    try:
        _torch_grad({"x": v}, "x")
        return True
    except (RuntimeError, TypeError, ImportError):
        return False


def _aliased(param, base):
    """``param`` replaced by a view sharing its first bytes with the first other non-empty array argument."""
    v = base[param]
    other = next((k for k, w in base.items() if k != param and isinstance(w, np.ndarray) and w.size), None)
    if other is None:
        return None
    w = base[other]
    buf = np.zeros(max(v.nbytes, w.nbytes) + 16, np.uint8)
    ow = buf[:w.nbytes].view(w.dtype).reshape(w.shape)
    ow[...] = w
    out = dict(base)
    out[other] = ow
    out[param] = buf[:v.nbytes].view(v.dtype).reshape(v.shape)
    return out


_WRONG_TYPE = {"int": "1", "float": "1.0", "float32": "1.0", "bool": "yes", "str": 1, "any": object()}


def cases_for(op: str, example: dict, inplace: tuple, types: dict, *, with_torch: bool = True) -> list[Case]:
    out = []
    elementwise = op.startswith("formats.")  # the format functions take any rank

    def add(param, kind, expect, build, torch=False):
        out.append(Case(op, param, kind, expect, build, torch))

    sig = _signature(op)  # defaulted parameters the example leaves out (that this version's function takes)
    declared_only = {p: None for p in types if p not in example and p in sig}
    for param, value in {**example, **declared_only}.items():
        t, optional = types.get(param, (None, False))
        if t is None:  # undeclared: infer from the example (None -> anything, optional)
            t = ("array" if isinstance(value, np.ndarray) else "bool" if isinstance(value, bool) else "int"
                 if isinstance(value, int) else "float" if isinstance(value, float) else "str"
                 if isinstance(value, str) else "any")
            optional = value is None
        if not optional:
            add(param, "none", "must_reject", _set(param, lambda v, b: None))
        elif value is not None:  # an optional parameter the example gives, left out: valid, or refused by name
            add(param, "none_optional", "may_accept", _set(param, lambda v, b: None))
        if t == "array":
            arr = value
            add(param, "wrong_type_list", "must_reject",
                _set(param, lambda v, b: (v if v is not None else np.zeros(2, np.float32)).tolist()))
            add(param, "wrong_type_str", "must_reject", _set(param, lambda v, b: "not an array"))
            if arr is None:
                continue  # an optional array absent from the example: the rest needs its shape
            add(param, "dtype_complex", "must_reject", _set(param, lambda v, b: v.astype(np.complex64)))
            if param in inplace or arr.dtype.kind != "b":
                add(param, "dtype_bool", "must_reject", _set(param, lambda v, b: v.astype(np.bool_)))
            if not elementwise:
                add(param, "rank_plus_4", "must_reject", _set(param, lambda v, b: v.reshape((1,) * 4 + v.shape)))
            add(param, "empty", "may_accept", _set(param, lambda v, b: v[:0] if v.ndim else v.reshape(-1)[:0]))
            if arr.dtype.kind in _FLOAT_KINDS and arr.size:
                add(param, "nan", "may_accept", _set(param, _with_nonfinite(np.nan)))
                add(param, "inf", "may_accept", _set(param, _with_nonfinite(np.inf)))
            add(param, "huge_view", "must_reject", _set(param, lambda v, b: _huge_view(v)))
            if param in inplace:
                add(param, "readonly", "must_reject", _set(param, lambda v, b: _readonly(v)))
                if _stride0(arr) is not None:
                    add(param, "stride0", "must_reject", _set(param, lambda v, b: _stride0(v)))
                if _aliased(param, example) is not None:
                    add(param, "aliased", "must_reject", lambda b, p=param: _aliased(p, b))
                if with_torch and _stride0(arr) is not None:
                    add(param, "torch_expand", "must_reject", lambda b, p=param: _torch_expanded(b, p), torch=True)
            else:
                add(param, "readonly", "must_accept", _set(param, lambda v, b: _readonly(v)))
                if _stride0(arr) is not None:
                    add(param, "stride0", "may_accept", _set(param, lambda v, b: _readonly(_stride0(v))))
            if with_torch and arr.size:
                add(param, "torch_sparse", "must_reject", lambda b, p=param: _torch_sparse(b, p), torch=True)
            # issue 27: ndarray subclasses and dtypes that are not numbers
            if arr.size:
                add(param, "masked", "must_reject", _set(param, _masked))
            if arr.ndim == 2:  # np.matrix is 2-D only: the same data as the base ndarray it views
                add(param, "matrix", "must_accept", _set(param, _matrix))
            add(param, "dtype_structured", "must_reject", _set(param, _structured))
            add(param, "dtype_object", "must_reject", _set(param, lambda v, b: v.astype(object)))
            add(param, "dtype_void", "must_reject", _set(param, lambda v, b: np.ascontiguousarray(v).view(
                f"V{v.dtype.itemsize}")))
            if with_torch and param in inplace and arr.dtype.kind in _FLOAT_KINDS and _can_require_grad(arr):
                # written in place: autograd cannot see the write (torch refuses it on a leaf); a read input
                # that requires grad is read detached (tests/test_dispatch.py)
                add(param, "requires_grad", "must_reject", lambda b, p=param: _torch_grad(b, p), torch=True)
        else:
            add(param, "wrong_type", "must_reject", _set(param, lambda v, b, t=t: _WRONG_TYPE[t]))
            if t == "str":
                add(param, "bad_value", "must_reject", _set(param, lambda v, b: "bogus"))
            if t == "int":
                add(param, "int64_overflow", "must_reject", _set(param, lambda v, b: 1 << 70))
                add(param, "huge", "may_accept", _set(param, lambda v, b: HUGE_INT))
                add(param, "float_for_int", "must_reject", _set(param, lambda v, b: 1.5))
                add(param, "numpy_uint8", "may_accept", _set(param, lambda v, b: np.uint8(64)))
                if isinstance(value, int) and 0 <= value < 1 << 63:
                    add(param, "numpy_uint64", "must_accept", _set(param, lambda v, b: np.uint64(v)))
            if t in ("float", "float32"):
                add(param, "nan", "must_reject", _set(param, lambda v, b: float("nan")))
                add(param, "inf", "must_reject", _set(param, lambda v, b: float("inf")))
                add(param, "int_beyond_float64", "must_reject", _set(param, lambda v, b: 1 << 1024))
                # an int beyond int64 that float64 (and float32) holds: np.isfinite(1 << 70) is a NumPy TypeError
                add(param, "int_beyond_int64", "may_accept", _set(param, lambda v, b: 1 << 70))
                # 1e300: a float64, not a float32 (the kernels' attributes): refused where declared float32
                add(param, "float_1e300", "must_reject" if t == "float32" else "may_accept",
                    _set(param, lambda v, b: 1e300))
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    add(param, "numpy_float32", "must_accept", _set(param, lambda v, b: np.float32(v)))
            if t == "bool":
                add(param, "int_for_bool", "must_reject", _set(param, lambda v, b: 1))
    if "chip" in sig and "chip" not in example:  # the per-chip keyword every operator takes
        add("chip", "bad_value", "must_reject", lambda b: {**b, "chip": "A5"})
        add("chip", "wrong_type", "must_reject", lambda b: {**b, "chip": 950})
    return out


def _signature(op):
    import inspect

    try:
        return inspect.signature(public_function(op)).parameters
    except (AttributeError, ValueError, TypeError):
        return {}


def _to_torch_all(args):
    from qsfa._arrays import to_torch

    return {k: (to_torch(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for k, v in args.items()}


def _torch_sparse(base, param):
    out = _to_torch_all(base)
    t = out[param]
    try:
        out[param] = t.to_sparse()
    except (RuntimeError, TypeError):  # dtypes without a sparse kernel: a sparse int tensor of the same shape
        import torch

        out[param] = torch.zeros(t.shape, dtype=torch.int64).to_sparse()
    return out


def _torch_expanded(base, param):
    out = _to_torch_all(base)
    t = out[param]
    ax = next(i for i, n in enumerate(t.shape) if n > 1)
    idx = [slice(None)] * t.dim()
    idx[ax] = slice(0, 1)
    out[param] = t[tuple(idx)].expand(t.shape)
    return out


_OUT_LIKE: dict = {}
#: kinds that only change what a valid output buffer holds before the call (it is overwritten) or leave it out (the
#: example's own call): nothing to attack
_BUFFER_CONTENT_KINDS = ("nan", "inf", "none_optional")


def _out_like(op: str, base: dict, name: str) -> np.ndarray:
    """A valid ``name=`` output buffer (zeros of the output's shape and dtype) for the example ``base`` of ``op``;
    the shape and dtype come from one reference call on the example (cached per operator)."""
    from qsfa._dispatch import operators

    if (op, name) not in _OUT_LIKE:
        from threadpoolctl import threadpool_limits

        from qsfa.reference import parallel

        # one thread, BLAS included: the campaign forks a child per case from this process, and a BLAS thread pool
        # started here would leave each child waiting on its locks (every case a 20 s "hang")
        saved = parallel._requested
        parallel.set_num_threads(1)
        try:
            with threadpool_limits(limits=1, user_api="blas"):
                res = public_function(op)(**base)
        finally:
            parallel.set_num_threads(saved)
        res = res if isinstance(res, tuple) else (res,)
        got = np.asarray(res[operators()[op].outputs.index(name)])
        _OUT_LIKE[(op, name)] = (got.shape, got.dtype)
    shape, dt = _OUT_LIKE[(op, name)]
    return np.zeros(shape, dt)


def out_buffer_cases(op: str, example: dict, types: dict, seen: set, *, with_torch: bool = True) -> list[Case]:
    """Cases for the output buffers a contract declares (``Contract.out_buffers``, e.g. ``attention_out=``) that are
    outputs of the operator: absent from the example (None), so the declared-type pass attacks only their type; here
    a valid buffer is built for every case and attacked as an in-place buffer is (read-only, stride-0, aliased,
    dtype, rank, empty, huge, masked, torch sparse / expand()-ed / requires_grad), plus a valid buffer that must be
    accepted. ``seen``: case ids already generated (left out here). Before this, an output buffer met only the two
    wrong-type cases."""
    from qsfa._dispatch import operators

    if "." in op or op not in operators():
        return []
    o = operators()[op]
    out = []
    for name in getattr(o.contract, "out_buffers", ()):
        if name not in o.outputs or example.get(name) is not None:
            continue
        like = _out_like(op, example, name)
        for c in cases_for(op, {**example, name: like}, (name,), {name: types.get(name, ("array", True))},
                           with_torch=with_torch):
            if c.param != name or c.id in seen or c.kind in _BUFFER_CONTENT_KINDS:
                continue
            build = (lambda b, f=c.build, n=name: f({**b, n: _out_like(op, b, n)}))
            out.append(Case(op, name, c.kind, c.expect, build, c.torch))
        out.append(Case(op, name, "valid", "must_accept", lambda b, n=name: {**b, n: _out_like(op, b, n)}))
    return out


def all_cases(declared: dict | None = None, *, with_torch: bool = True) -> list[Case]:
    out = []
    for op, (example, inplace, types) in operator_table(declared).items():
        ex = example(np.random.default_rng(0))
        mine = cases_for(op, ex, inplace, types, with_torch=with_torch)
        mine += out_buffer_cases(op, ex, types, {c.id for c in mine}, with_torch=with_torch)
        out += mine
    return out


# ---------------------------------------------------------------------------------------------------------------
# running and classifying one case


def _memory(v):
    """Bytes an argument's memory holds (stride-0 axes collapsed; torch tensors through their storage)."""
    if isinstance(v, np.ndarray):
        shape = tuple(1 if st == 0 else n for n, st in zip(v.shape, v.strides))
        return np.lib.stride_tricks.as_strided(v, shape, v.strides, writeable=False).tobytes()
    mod = sys.modules.get("torch")
    if mod is not None and isinstance(v, mod.Tensor) and v.layout == mod.strided:
        # the storage's bytes through a uint8 view (bytes(storage) reads byte by byte: seconds per megabyte)
        return mod.empty(0, dtype=mod.uint8).set_(v.untyped_storage()).numpy().tobytes()
    return None


def snapshot(args: dict) -> dict:
    return {k: m for k, v in args.items() if (m := _memory(v)) is not None}


def names_param(exc, param) -> bool:
    return getattr(exc, "param", None) == param or f" for {param}, actual: " in str(exc)


def run_case(case: Case, table: dict) -> tuple[str, str]:
    """Run one case in this process: ``(class, detail)``."""
    from qsfa._errors import InvalidArgument, InvalidDtype

    example, _, _ = table[case.op]
    args = case.build(example(np.random.default_rng(0)))
    before = snapshot(args)
    fn = public_function(case.op)
    try:
        fn(**args)
    except (InvalidArgument, InvalidDtype) as e:
        changed = [k for k, m in snapshot(args).items() if before.get(k) != m]
        if changed:
            return "silent", f"rejected after writing {changed}: {e}"
        if names_param(e, case.param):
            return "clear", str(e)
        return "related", f"qsfa error naming another parameter: {e}"
    except Exception as e:  # noqa: BLE001 - the classification is the point
        changed = [k for k, m in snapshot(args).items() if before.get(k) != m]
        if changed:
            return "silent", f"{type(e).__name__} after writing {changed}: {e}"
        return "foreign", f"{type(e).__name__}: {str(e)[:200]}"
    changed = [k for k, m in snapshot(args).items() if before.get(k) != m]
    if case.expect == "must_reject":
        return "silent", f"accepted (wrote {changed})" if changed else "accepted"
    return "accepted", ""


# ---------------------------------------------------------------------------------------------------------------
# the campaign: every case in a forked child with a time and memory limit


def _run_forked(case, table, timeout_s, mem_bytes):
    import resource
    import select

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            if "torch" in sys.modules:  # the parent's OpenMP team does not survive fork(): a parallel torch op would wait
                sys.modules["torch"].set_num_threads(1)  # on it for ever (every torch case a 20 s "hang")
            with open("/proc/self/status") as f:  # the address space already mapped (torch maps a lot) + the budget
                vm = next((int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:")), 0)
            resource.setrlimit(resource.RLIMIT_AS, (vm + mem_bytes, vm + mem_bytes))
            res = run_case(case, table)
        except BaseException as e:  # noqa: BLE001
            res = ("foreign", f"{type(e).__name__}: {str(e)[:200]}")
        os.write(w, json.dumps(res).encode())
        os._exit(0)
    os.close(w)
    ready, _, _ = select.select([r], [], [], timeout_s)
    if not ready:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
        return "silent", f"no answer within {timeout_s} s (hang)"
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    if not data:
        return "foreign", "child died"
    return tuple(json.loads(data))


def campaign(declared=None, timeout_s=20.0, mem_gib=6.0, verbose=False):
    table = operator_table(declared)
    counts = {}
    rows = []
    for case in all_cases(declared):
        cls, detail = _run_forked(case, table, timeout_s, int(mem_gib * (1 << 30)))
        counts[cls] = counts.get(cls, 0) + 1
        rows.append((case.id, case.expect, cls, detail))
        if verbose:
            print(f"{cls:9s} {case.expect:12s} {case.id}  {detail[:150]}", flush=True)
    return counts, rows


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--declared", help="JSON {op: {param: [type, optional]}} for a qsfa without Contract.params")
    ap.add_argument("--dump-declared", help="write this qsfa's declared parameter types to FILE and exit")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--verbose", action="store_true")
    ns = ap.parse_args(argv)
    if ns.dump_declared:
        with open(ns.dump_declared, "w") as f:
            json.dump(declared_types(), f, indent=1)
        return 0
    declared = None
    if ns.declared:
        with open(ns.declared) as f:
            declared = json.load(f)
    import qsfa

    print(f"qsfa from {os.path.dirname(qsfa.__file__)}", flush=True)
    counts, rows = campaign(declared, ns.timeout, verbose=ns.verbose)
    total = sum(counts.values())
    print(f"{total} cases: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in ("clear", "foreign", "silent", "related",
                                                                                  "accepted")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
