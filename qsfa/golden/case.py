"""A golden case: operator + parameters + seed + input generator (+ optional explicit inputs).

The on-disk form (``"format": "qsfa-case/1"``) is shared with the conformance runner, which saves every
falsifying hypothesis example as a case with explicit inputs; ``qsfa golden generate --case FILE``
replays it. The format is documented in ``docs/golden.md``::

    {
      "format": "qsfa-case/1",
      "name": "kvce-mode1-rs",                    # [A-Za-z0-9._-]+, unique within a set
      "op": "kv_compress_epilog",                 # a qsfa operator: a name in qsfa.operators()
      "params": {"quant_mode": 1, "bs": 6},       # JSON scalars (or lists of scalars)
      "seed": 7,                                  # numpy.random.default_rng(seed) feeds the generator
      "generator": "kv_compress_epilog",          # a name in qsfa.golden.generators (or null)
      "inputs": {                                 # optional explicit inputs (then no generator runs)
        "x": {"file": "kvce-mode1-rs.x.npy", "dtype": "bfloat16", "shape": [6, 576], "sha256": "..."}
      },
      "description": "free text"
    }

The operator is called with every input array plus those ``params`` whose names are parameters of the
operator's public function; the generator sees all ``params``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from . import io as gio
from .io import GoldenInputError
from .._arrays import is_ml_dtype

__all__ = ["Case", "CASE_FORMAT", "OpSpec", "resolve_op", "available_ops"]

CASE_FORMAT = "qsfa-case/1"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# --------------------------------------------------------------------------------------------------
# operators


@dataclass(frozen=True)
class OpSpec:
    """How the golden machinery calls one operator."""

    name: str
    outputs: tuple[str, ...]
    params: frozenset  # parameter names of the public function (without ``backend``)
    defaults: dict  # their default values (where JSON-representable)
    required: frozenset  # parameters without a default (an absent optional array is passed as None)
    inplace: tuple[str, ...]
    call: Callable[[dict, str], Any]


def _public_function(name: str):
    """The public front door of an operator: ``qsfa.<name>`` (dotted names: ``qsfa.formats.encode``)."""
    import qsfa

    obj = qsfa
    try:
        for part in name.split("."):
            obj = getattr(obj, part)
    except (AttributeError, ImportError):
        return None
    return obj if callable(obj) else None


def _param_names(fn) -> tuple[frozenset, dict, frozenset]:
    sig = inspect.signature(fn)
    ps = {n: p for n, p in sig.parameters.items()
          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n != "backend"}
    defaults = {}
    for n, p in ps.items():
        if p.default is not p.empty:
            try:
                defaults[n] = _json_value(n, p.default)
            except GoldenInputError:
                pass
    required = frozenset(n for n, p in ps.items() if p.default is p.empty)
    return frozenset(ps), defaults, required


def _spec(name: str, op) -> OpSpec:
    fn = _public_function(name)
    if fn is not None and "backend" in inspect.signature(fn).parameters:
        names, defaults, required = _param_names(fn)

        def call(args, backend):
            return fn(**args, backend=backend)
    else:  # registered but not exposed: go through the dispatcher with the reference's names
        from .._dispatch import run

        names, defaults, required = _param_names(op.impls["reference"])

        def call(args, backend):
            return run(name, args, backend)
    return OpSpec(name, tuple(op.outputs), names, defaults, required, tuple(op.contract.inplace), call)


def available_ops() -> set[str]:
    """Names a case may use as ``op`` in this build of qsfa (``qsfa.operators()``)."""
    from .._dispatch import operators

    return set(operators())


def resolve_op(name: str) -> OpSpec:
    from .._dispatch import operators

    ops = operators()
    if name in ops:
        return _spec(name, ops[name])
    raise GoldenInputError(f"unknown operator {name!r}; this build of qsfa has: {', '.join(sorted(available_ops()))}")


# --------------------------------------------------------------------------------------------------
# parameters


def _json_value(key: str, v):
    """Normalise one parameter to a JSON value (NumPy scalars become Python scalars)."""
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        v = float(v)
    if isinstance(v, float) and not np.isfinite(v):
        raise GoldenInputError(f"parameter {key!r} is {v}: case parameters must be finite (JSON)")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_json_value(key, x) for x in v]
    raise GoldenInputError(
        f"parameter {key!r} has type {type(v).__name__}: case parameters are JSON scalars or lists; "
        "arrays belong in inputs"
    )


def _check_name(what: str, name: str):
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise GoldenInputError(f"{what} {name!r} must match [A-Za-z0-9][A-Za-z0-9._-]*")


# --------------------------------------------------------------------------------------------------
# the case


@dataclass
class Case:
    """One golden case (see the module docstring for the file format).

    ``inputs`` (optional) holds explicit input arrays (name -> NumPy array); without it the named
    ``generator`` builds them from ``params`` and ``numpy.random.default_rng(seed)``.
    """

    name: str
    op: str
    params: dict = field(default_factory=dict)
    seed: int = 0
    generator: str | None = None
    description: str = ""
    inputs_given: dict | None = None
    # explicit inputs of a loaded case file: name -> {"path", "key" (npz member or None), "dtype", "shape",
    # "sha256" (or None)}; read by inputs()
    _refs: dict | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        _check_name("case name", self.name)
        if not isinstance(self.op, str) or not self.op:
            raise GoldenInputError(f"case {self.name}: op must be a non-empty string")
        if not isinstance(self.params, Mapping):
            raise GoldenInputError(f"case {self.name}: params must be a JSON object")
        self.params = {str(k): _json_value(k, v) for k, v in self.params.items()}
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise GoldenInputError(f"case {self.name}: seed must be a non-negative integer, got {self.seed!r}")
        self.seed = int(self.seed)
        if self.inputs_given is not None:
            for k, v in self.inputs_given.items():
                _check_name("input name", k)
                if not isinstance(v, np.ndarray):
                    raise GoldenInputError(f"case {self.name}: input {k!r} must be a NumPy array")
        if self.generator is None and self.inputs_given is None and self._refs is None:
            raise GoldenInputError(f"case {self.name}: needs a generator or explicit inputs")

    @classmethod
    def from_args(cls, name: str, op: str, args: Mapping[str, Any], *, description: str = "",
                  seed: int = 0) -> "Case":
        """A case holding one concrete call ``op(**args)``: arrays (NumPy or torch, copied) become
        explicit inputs, everything else (scalars, None for an absent optional array) params.
        What the conformance runner saves for a falsifying example."""
        from .._arrays import is_torch, to_numpy

        inputs, params = {}, {}
        for k, v in args.items():
            if is_torch(v):
                v = to_numpy(v)
            if isinstance(v, np.ndarray):
                inputs[k] = np.array(v, copy=True)
            else:
                params[k] = v
        return cls(name=name, op=op, params=params, seed=seed, generator=None, description=description,
                   inputs_given=inputs)

    def for_chip(self, chip: str | None) -> "Case":
        """This case run for ``chip`` ("A2", "A3", "950"; None: the case as it is): ``chip`` joins its params,
        so the operator checks that chip's limits and uses its rounding modes (docs/numerics/chips.md)."""
        if chip is None:
            return self
        from ..chips import check_chip

        try:
            check_chip(chip)
        except ValueError as e:
            raise GoldenInputError(str(e)) from None
        return dataclasses.replace(self, params={**self.params, "chip": chip})

    # -- inputs -----------------------------------------------------------------------------------

    @property
    def has_explicit_inputs(self) -> bool:
        return self.inputs_given is not None or self._refs is not None

    def inputs(self) -> dict[str, np.ndarray]:
        """The input arrays: the explicit ones (loaded and checked), or the generator's output."""
        if self.inputs_given is not None:
            return {k: v.copy() for k, v in self.inputs_given.items()}
        if self._refs is not None:
            return {k: _load_ref(self.name, k, ref) for k, ref in self._refs.items()}
        from .generators import get_generator

        gen = get_generator(self.generator)
        check_dimension_params(self.name, self.params)
        out = gen(dict(self.params), np.random.default_rng(self.seed))
        arrays = {}
        for k, v in out.items():
            if v is None:
                continue
            if not isinstance(v, np.ndarray):
                raise RuntimeError(f"generator {self.generator!r} returned {type(v).__name__} for {k!r}")
            arrays[k] = v
        return arrays

    def args(self, inputs: Mapping[str, np.ndarray] | None = None, spec: OpSpec | None = None) -> dict:
        """The operator's arguments: input arrays plus the params the operator takes."""
        spec = spec or resolve_op(self.op)
        inputs = self.inputs() if inputs is None else inputs
        clash = sorted(set(inputs) & {k for k in self.params if k in spec.params})
        if clash:
            raise GoldenInputError(f"case {self.name}: {clash} given both as input arrays and as params")
        unknown = sorted(set(inputs) - spec.params)
        if unknown:
            raise GoldenInputError(f"case {self.name}: {self.op} has no parameter(s) {unknown}")
        args = {k: v for k, v in self.params.items() if k in spec.params}
        args.update(inputs)
        for k in spec.required - set(args):
            args[k] = None  # an optional array this case does not have (k_rope at rope 0, ...)
        return args

    def call_params(self, input_names=(), spec: OpSpec | None = None) -> dict:
        """The non-array arguments the operator is called with: its defaults, overridden by ``params``
        (``None`` = an optional argument not given)."""
        spec = spec or resolve_op(self.op)
        out = {k: v for k, v in spec.defaults.items() if k not in input_names}
        out.update({k: v for k, v in self.params.items() if k in spec.params})
        return out

    def run(self, backend: str = "reference", inputs: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Run the operator on (copies of) the inputs; returns ``{output name: array}``.

        In-place parameters (caches) are copied first, so the case's inputs stay as they were; their
        updated state is returned under the output of the same name.
        """
        spec = resolve_op(self.op)
        inputs = self.inputs() if inputs is None else inputs
        args = self.args({k: np.array(v, copy=True) for k, v in inputs.items()}, spec)
        result = spec.call(args, backend)
        results = result if isinstance(result, tuple) else (result,)
        if len(results) != len(spec.outputs):
            raise RuntimeError(f"{self.op} returned {len(results)} outputs, expected {spec.outputs}")
        out = {}
        for name, r in zip(spec.outputs, results):
            if r is None:
                continue
            out[name] = np.asarray(r)
        return out

    # -- files ------------------------------------------------------------------------------------

    def to_dict(self, input_refs: Mapping[str, dict] | None = None) -> dict:
        d = {
            "format": CASE_FORMAT,
            "name": self.name,
            "op": self.op,
            "params": copy.deepcopy(self.params),
            "seed": self.seed,
            "generator": self.generator,
            "description": self.description,
        }
        if input_refs is not None:
            d["inputs"] = {k: dict(v) for k, v in input_refs.items()}
        return d

    def save(self, path: str) -> str:
        """Write the case JSON to ``path``; explicit inputs go beside it as ``<stem>.<input>.npy``
        (storage dtype, see :mod:`qsfa.golden.io`). Returns ``path``.

        Missing folders are created (:func:`~qsfa.golden.guard.make_dirs`); every file is written through
        :func:`~qsfa.golden.guard.replacing` - a new file renamed over an older regular file of that name, never
        through a symbolic link -, and a name already taken by a link or anything but a regular file is refused
        (GoldenInputError) before any file is written."""
        from .guard import check_replaceable, make_dirs, replacing

        path = os.fspath(path)
        folder, base = os.path.split(os.path.abspath(path))
        stem = base[:-5] if base.endswith(".json") else base
        arrays = sorted(self.inputs().items()) if self.has_explicit_inputs else []
        files = [f"{stem}.{k}.npy" for k, _ in arrays]
        check_replaceable(folder, files + [base])
        make_dirs(folder)
        refs = None
        if self.has_explicit_inputs:
            refs = {}
            for (k, a), fname in zip(arrays, files):
                name, st = gio.to_storage(a)
                with replacing(folder, fname) as f:
                    np.lib.format.write_array(f, st, version=(1, 0), allow_pickle=False)
                refs[k] = {"file": fname, "dtype": name, "shape": list(a.shape), "sha256": gio.array_sha256(st)}
        with replacing(folder, base) as f:
            f.write(gio.dump_json(self.to_dict(refs)).encode("utf-8"))
        return path

    @classmethod
    def from_dict(cls, d: Mapping, base_dir: str = ".", source: str = "<case>", *,
                  allow_outside_inputs: bool = False) -> "Case":
        """A case from its parsed JSON. Input files resolve inside ``base_dir`` (symbolic links
        included); absolute paths and escapes are refused unless ``allow_outside_inputs``."""
        from .guard import field_error, resolve_inside
        from .schema import check_dtype, check_shape

        def bad(field, value, reason):
            return field_error(source, field, value, reason, kind="case field")

        if not isinstance(d, Mapping):
            raise GoldenInputError(f"{source}: a case must be a JSON object")
        fmt = d.get("format")
        if fmt != CASE_FORMAT:
            raise bad("format", fmt, f"must be {CASE_FORMAT!r}")
        missing = [k for k in ("name", "op") if k not in d]
        if missing:
            raise GoldenInputError(f"{source}: missing {missing}")
        known = {"format", "name", "op", "params", "seed", "generator", "inputs", "description"}
        extra = sorted(set(d) - known)
        if extra:
            raise GoldenInputError(f"{source}: unknown field(s) {extra}")
        for k, ok, what in (("name", isinstance(d["name"], str), "a string"),
                            ("op", isinstance(d["op"], str) and d["op"], "a non-empty string"),
                            ("params", d.get("params") is None or isinstance(d.get("params"), Mapping), "an object"),
                            ("generator", d.get("generator") is None or isinstance(d.get("generator"), str),
                             "a string or null"),
                            ("description", d.get("description") is None or isinstance(d.get("description"), str),
                             "a string"),
                            ("inputs", d.get("inputs") is None or isinstance(d.get("inputs"), Mapping), "an object"),
                            ("seed", "seed" not in d or (isinstance(d["seed"], int) and not isinstance(d["seed"], bool)
                                                         and 0 <= d["seed"] < 2 ** 63),
                             "an integer from 0 to 2**63 - 1")):
            if not ok:
                v = d.get(k)
                # an integer out of range is of the right type: say the range only
                of_type = k == "seed" and isinstance(v, int) and not isinstance(v, bool)
                raise bad(k, v, f"must be {what}" + ("" if of_type else f", not {type(v).__name__}"))
        refs = None
        if d.get("inputs") is not None:
            refs = {}
            for k, r in d["inputs"].items():
                _check_name("input name", k)
                f = f"inputs.{k}"
                if not isinstance(r, Mapping) or "file" not in r or "dtype" not in r or "shape" not in r:
                    raise bad(f, r, "an input needs an object with file, dtype and shape")
                dt = check_dtype(r["dtype"], source, f"{f}.dtype", kind="case field")
                shape = check_shape(r["shape"], gio.storage_dtype(dt).itemsize, source, f"{f}.shape",
                                    kind="case field")
                key, sha = r.get("key"), r.get("sha256")
                if key is not None and (not isinstance(key, str) or not key or "\0" in key):
                    raise bad(f"{f}.key", key, "must be a non-empty string (an .npz member) or null")
                if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
                    raise bad(f"{f}.sha256", sha, "must be 64 lowercase hex digits or null")
                refs[k] = {
                    "path": resolve_inside(base_dir, r["file"], source, f"{f}.file",
                                           allow_outside=allow_outside_inputs, kind="case field"),
                    "key": key,
                    "dtype": dt,
                    "shape": shape,
                    "sha256": sha,
                }
        try:
            return cls(
                name=d["name"], op=d["op"], params=dict(d.get("params") or {}), seed=d.get("seed", 0),
                generator=d.get("generator"), description=str(d.get("description") or ""), _refs=refs,
            )
        except GoldenInputError as e:
            raise GoldenInputError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str, *, allow_outside_inputs: bool = False) -> "Case":
        """A case file; the input files it names must lie in its folder unless ``allow_outside_inputs``."""
        path = os.fspath(path)
        return cls.from_dict(gio.load_json(path), os.path.dirname(os.path.abspath(path)), source=path,
                             allow_outside_inputs=allow_outside_inputs)


#: params that the input generators read as a dimension (a size or count of the arrays they make)
DIMENSION_PARAMS = ("B", "M", "N", "T", "bs", "d", "heads", "block_size", "block_num", "num_blocks", "num_slots",
                    "width", "table_width", "q_seq", "kv_seq")
#: the most elements the dimension params of one case may declare together (2^31: 8 GiB of float32)
MAX_DECLARED_ELEMENTS = 1 << 31


def check_dimension_params(case: str, params: Mapping) -> None:
    """Every dimension param of a generated case is a non-negative integer, and together they declare at most
    :data:`MAX_DECLARED_ELEMENTS` elements - so ``M=-16``, ``M=16.5`` or ``M=N=2**20`` are refused naming the field
    before a generator allocates anything (issue 27)."""
    dims = {}
    for k in DIMENSION_PARAMS:
        if k not in params:
            continue
        v = params[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise GoldenInputError(f"case {case}: Invalid value for params.{k}, actual: {v!r}, reason: must be a "
                                   "non-negative integer (a dimension of the generated inputs).")
        dims[k] = v
    total = 1
    for v in dims.values():
        total *= max(v, 1)
    if total > MAX_DECLARED_ELEMENTS:
        big = max(dims, key=dims.get)
        listing = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise GoldenInputError(f"case {case}: Invalid value for params.{big}, actual: {dims[big]}, reason: the "
                               f"dimension params ({listing}) declare {total} elements together, more than "
                               f"{MAX_DECLARED_ELEMENTS} (2^31).")


def _load_ref(case: str, name: str, ref: Mapping) -> np.ndarray:
    from .guard import read_npy

    path, key, dt, shape = ref["path"], ref.get("key"), ref["dtype"], tuple(ref["shape"])
    st = gio.storage_dtype(dt)
    if not os.path.isfile(path):
        raise GoldenInputError(f"case {case}: input file not found: {path}")
    if key is not None or path.endswith(".npz"):
        raw = gio.read_npz_member(path, key or name, shape=shape, itemsize=st.itemsize)
    elif path.endswith(".npy"):
        raw = read_npy(path, shape=shape, itemsize=st.itemsize)
    else:
        raw = gio.read_bin(path, st, shape)
    if raw.dtype.itemsize != st.itemsize or not (raw.dtype.kind == st.kind or is_ml_dtype(raw.dtype)):
        raise GoldenInputError(f"case {case}: input {name!r} in {path} is stored as {raw.dtype.str}, "
                               f"expected {st.str} for {dt}")
    if raw.dtype.byteorder == ">":
        raw = raw.astype(raw.dtype.newbyteorder("<"))
    raw = raw.view(st) if is_ml_dtype(raw.dtype) else raw.astype(st, copy=False)
    if ref.get("sha256") is not None and gio.array_sha256(raw) != ref["sha256"]:
        raise GoldenInputError(f"case {case}: input {name!r} in {path} does not match its sha256")
    return gio.from_storage(raw, dt)
