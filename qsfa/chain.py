"""Operator chains as data: run one, keep every intermediate, and find the first link that diverges.

A chain (docs/golden.md#chains) is a JSON object::

    {"name": "indexer-cache-then-select",
     "inputs": ["x", "cache", "slots"],
     "links": [{"name": "k_cache", "op": "indexer_quant_cache",
                "args": {"x": "$input.x", "cache": "$input.cache", "slot_mapping": "$input.slots", ...}},
               {"name": "select", "op": "quant_lightning_indexer", "args": {"key": "$k_cache.cache", ...}}]}

Every link is a call of a registered operator (any of ``qsfa.operators()``); an argument is a literal (a JSON
number, string, bool, list or null) or a reference ``"$input.<name>"`` / ``"$<link>.<output>"`` to a chain input
or to an output of an *earlier* link, so a chain is acyclic by construction and runs in order; a view
``{"from": "$k.cache_scale", "reshape": [2, 6, 1]}`` passes a reshaped tensor (vLLM-Ascend's ``squeeze(-1)``
between a cache writer and an indexer). Tensors are named ``input.<name>`` and ``<link>.<output>``.

* :func:`run_chain` runs it on one backend and returns every tensor (in-place parameters are copied first, so an
  earlier intermediate keeps its value when a later link writes into a copy of it).
* :func:`write_chain_golden` stores every tensor (``<name>.npy``) beside ``chain.json`` and a manifest listing the
  chain's edges; :func:`compare_chain` walks a directory of another backend's tensors (the same names, e.g. dumped
  from an NPU run) link by link, each output with its own criterion (:func:`qsfa.compare.compare`: bytes for
  integer and 8-bit outputs, the float criterion otherwise), reports whether each link's inputs still matched, and
  runs the link again on the golden inputs (``rerun_backend``: the backend under test; never the reference, whose
  re-run on golden inputs reproduces the golden by construction) so that a link's own error is told apart from one
  it inherited; without one a failing link whose inputs already differed is "undecided". ``qsfa golden compare DIR --actual ADIR --chain`` is the command line.

Bad chains and missing tensors raise :class:`ChainError` (a ``qsfa.InvalidArgument``) naming the link and the field,
before anything is run or written.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ._errors import InvalidArgument, InvalidDtype

__all__ = ["ChainError", "Link", "Chain", "chain_from_dict", "load_chain", "run_chain", "write_chain_golden",
           "read_tensors", "LinkReport", "ChainReport", "compare_chain", "compare_chain_dirs", "register_chain",
           "get_chain", "chains", "chip_limited", "v32_mla_c8", "first_divergence", "run_link", "check_rerun_backend",
           "check_link", "check_args"]

_REF = re.compile(r"^\$([A-Za-z_][\w-]*)\.([A-Za-z_]\w*)$")
_NAME = re.compile(r"^[A-Za-z_][\w-]*$")


class ChainError(InvalidArgument):
    """A chain or a tensor directory that cannot be used (``Invalid <kind> for <field>, actual: ..., reason: ...``)."""

    def __init__(self, field_: str, actual: Any, reason: str, kind: str = "value"):
        super().__init__(kind, field_, actual, reason)


@dataclass(frozen=True)
class Link:
    name: str
    op: str
    args: dict

    def refs(self) -> dict[str, str]:
        """``{parameter: tensor name}`` of the arguments that reference a tensor (``"$a.b"`` or a view
        ``{"from": "$a.b", "reshape": [...]}``)."""
        out = {}
        for p, v in self.args.items():
            v = v.get("from") if isinstance(v, Mapping) else v
            m = _REF.match(v) if isinstance(v, str) else None
            if m:
                out[p] = f"{m.group(1)}.{m.group(2)}"
        return out


@dataclass(frozen=True)
class Chain:
    name: str
    inputs: tuple[str, ...]
    links: tuple[Link, ...]

    def edges(self) -> list[list[str]]:
        """``[source tensor, link, parameter]`` for every reference, in chain order."""
        return [[src, ln.name, p] for ln in self.links for p, src in ln.refs().items()]

    def to_dict(self) -> dict:
        return {"name": self.name, "inputs": list(self.inputs),
                "links": [{"name": ln.name, "op": ln.op, "args": dict(ln.args)} for ln in self.links]}


def _spec(op: str):
    from .golden.case import resolve_op
    from .golden.io import GoldenInputError

    try:
        return resolve_op(op)
    except GoldenInputError:
        return None


_VIEW_KEYS = ("reshape", "columns", "dtype", "shape")  # applied in this order
_VIEW_FORM = ("a view is {\"from\": \"$<link>.<output>\", \"reshape\": [int, ...]} with optionally \"columns\": "
              "[start, stop] (a slice of the last dimension), \"dtype\": \"<name>\" (the same bytes read as another "
              "dtype) and \"shape\": [int, ...] (a final reshape)")


def _view_dtype(name: str):
    from ._arrays import numpy_dtype

    try:
        return numpy_dtype(name)
    except TypeError:
        return None


def _check_view(where: str, v: Mapping, is_ref: bool) -> None:
    """A view's form (docs/golden.md#chains): ``reshape`` (required), then optionally ``columns`` [start, stop] of
    the last dimension, ``dtype`` (a reinterpretation of the bytes: vLLM-Ascend's ``.view(dtype)`` on a cache whose
    blocks hold codes then scales) and ``shape``."""
    def dims(x):
        return isinstance(x, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in x)

    if not is_ref or set(v) - {"from", *_VIEW_KEYS} or not dims(v.get("reshape")) or (
            "shape" in v and not dims(v["shape"])):
        raise ChainError(where, dict(v), _VIEW_FORM)
    for key in ("reshape", "shape"):
        shape = v.get(key)
        if shape is not None and (any(n < -1 or n >= 1 << 62 for n in shape) or shape.count(-1) > 1):
            raise ChainError(f"{where} {key}", shape, "each dimension is an int in [0, 2**62) or -1 (at most one -1)")
    cols = v.get("columns")
    if "columns" in v and not (dims(cols) and len(cols) == 2 and 0 <= cols[0] <= cols[1] < 1 << 62):
        raise ChainError(f"{where} columns", cols, "must be [start, stop] with 0 <= start <= stop")
    if "dtype" in v:
        if not isinstance(v["dtype"], str) or _view_dtype(v["dtype"]) is None:
            raise ChainError(f"{where} dtype", v["dtype"], "not a dtype name (e.g. 'float32', 'float8_e4m3fn')")


def _apply_view(where: str, src: str, a: np.ndarray, v: Mapping) -> np.ndarray:
    """``a`` through the view ``v`` (:func:`_check_view`); a step the tensor does not allow is a ChainError naming
    the link, the parameter and the step."""
    try:
        a = a.reshape(v["reshape"])
    except (ValueError, OverflowError, TypeError):
        raise ChainError(where, f"{src} {tuple(a.shape)}", f"cannot be reshaped to {v['reshape']}") from None
    if "columns" in v:
        lo, hi = v["columns"]
        if a.ndim < 1 or hi > a.shape[-1]:
            raise ChainError(f"{where} columns", v["columns"], f"outside the last dimension of {src} viewed as "
                             f"{tuple(a.shape)}")
        a = np.ascontiguousarray(a[..., lo:hi])
    if "dtype" in v:
        dt = _view_dtype(v["dtype"])
        if a.ndim < 1 or (a.shape[-1] * a.dtype.itemsize) % dt.itemsize:
            raise ChainError(f"{where} dtype", v["dtype"], f"{src} viewed as {tuple(a.shape)} {a.dtype} does not "
                             f"hold a whole number of {dt} values per row")
        a = np.ascontiguousarray(a).view(dt)
    if "shape" in v:
        try:
            a = a.reshape(v["shape"])
        except (ValueError, OverflowError, TypeError):
            raise ChainError(f"{where} shape", f"{src} viewed as {tuple(a.shape)}",
                             f"cannot be reshaped to {v['shape']}") from None
    return a


def chain_from_dict(d: Mapping) -> Chain:
    """Validate a chain object (see the module docstring) and build it."""
    if not isinstance(d, Mapping):
        raise ChainError("chain", type(d).__name__, "must be a JSON object with 'name', 'inputs' and 'links'")
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise ChainError("name", name, "must be a non-empty string")
    inputs = d.get("inputs", [])
    if not isinstance(inputs, list) or not all(isinstance(i, str) and _NAME.match(i) for i in inputs):
        raise ChainError("inputs", inputs, "must be a list of names ([A-Za-z_][A-Za-z0-9_-]*)")
    raw = d.get("links")
    if not isinstance(raw, list) or not raw:
        raise ChainError("links", raw, "must be a non-empty list of links")
    known = {f"input.{i}" for i in inputs}
    links, names = [], set()
    for i, ln in enumerate(raw):
        where = f"links[{i}]"
        if not isinstance(ln, Mapping):
            raise ChainError(where, type(ln).__name__, "must be an object with 'name', 'op' and 'args'")
        lname = ln.get("name")
        if not isinstance(lname, str) or not _NAME.match(lname) or lname == "input":
            raise ChainError(f"{where}.name", lname, "must be a name ([A-Za-z_][A-Za-z0-9_-]*, not 'input')")
        if lname in names:
            raise ChainError(f"{where}.name", lname, "repeats an earlier link's name")
        where = f"link {lname!r}"
        spec = _spec(ln.get("op"))
        if spec is None:
            raise ChainError(f"{where} op", ln.get("op"), "not an operator of this build of qsfa (qsfa.operators())")
        args = ln.get("args", {})
        if not isinstance(args, Mapping):
            raise ChainError(f"{where} args", type(args).__name__, "must be an object")
        unknown = sorted(set(args) - set(spec.params))
        if unknown:
            raise ChainError(f"{where} args", unknown, f"{spec.name} has no such parameter(s)")
        link = Link(lname, spec.name, dict(args))
        later = {x.get("name") for x in raw[i:] if isinstance(x, Mapping)}
        for p, src in link.refs().items():
            if src not in known:
                owner = src.split(".", 1)[0]
                why = ("names this link or a later one: a cycle or a forward reference (a link reads only chain "
                       "inputs and earlier links' outputs)" if owner in later or owner == lname
                       else "is neither a chain input nor an output of an earlier link")
                raise ChainError(f"{where} args.{p}", args[p], why)
        for p, v in args.items():
            if isinstance(v, Mapping):
                _check_view(f"{where} args.{p}", v, p in link.refs())
            elif isinstance(v, str) and v.startswith("$") and p not in link.refs():
                raise ChainError(f"{where} args.{p}", v, "a reference is '$input.<name>' or '$<link>.<output>'")
        names.add(lname)
        known |= {f"{lname}.{o}" for o in spec.outputs}
        links.append(link)
    return Chain(name, tuple(inputs), tuple(links))


def load_chain(path: str) -> Chain:
    """A chain from its JSON file."""
    if not isinstance(path, (str, os.PathLike)):
        raise ChainError("chain file", path, "must be a path (str or os.PathLike)")
    if not os.path.isfile(path):
        raise ChainError("chain file", os.fspath(path), "is a directory, not a chain's JSON file" if os.path.isdir(path)
                         else "no such file")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ChainError("chain file", os.fspath(path), f"not valid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ChainError("chain file", os.fspath(path), f"cannot be read ({e})") from None
    return chain_from_dict(d)


def _link_args(link: Link, spec, tensors: Mapping[str, np.ndarray], where: str) -> dict:
    args = {}
    for p, v in link.args.items():
        src = link.refs().get(p)
        if src is None:
            args[p] = v
            continue
        if src not in tensors:
            raise ChainError(f"link {link.name!r} args.{p}", src, f"the tensor is missing ({where})")
        a = tensors[src]
        if isinstance(v, Mapping):
            a = _apply_view(f"link {link.name!r} args.{p}", src, a, v)
        args[p] = np.array(a, copy=True) if p in spec.inplace else a  # an earlier tensor keeps its value
    return args


def _missing_required(link: Link, spec, args: Mapping) -> None:
    missing = sorted(set(spec.required) - set(args))
    if missing:
        raise ChainError(f"link {link.name!r} ({link.op}) args", missing, "required argument(s) of the operator "
                         "are not given")


def check_link(link: Link, tensors: Mapping[str, np.ndarray], where: str = "golden") -> None:
    """Everything the link's operator would check before computing (its contract, the chip, required arguments,
    each view's reshape), on ``tensors``, without computing: :func:`compare_chain` runs it on every link first, so
    a recorded chain that could never have run is bad input, not a verdict."""
    spec = _spec(link.op)
    check_args(link, _link_args(link, spec, tensors, where))


def check_args(link: Link, args: Mapping) -> None:
    """The link's operator's contract (and chip: ``args["chip"]``) on ``args``, without computing: the error a
    call would raise, named with the link."""
    from ._dispatch import check_call

    spec = _spec(link.op)
    _missing_required(link, spec, args)
    full = {**spec.defaults, **args}
    chip = full.pop("chip", None)
    try:
        check_call(link.op, full, "reference", chip)
    except (InvalidArgument, InvalidDtype) as e:
        raise ChainError(f"link {link.name!r} ({link.op})", "its arguments", f"the operator refused them: {e}") from None


def _call(link: Link, args: dict, backend: str) -> dict[str, np.ndarray]:
    spec = _spec(link.op)
    _missing_required(link, spec, args)
    try:
        res = spec.call(args, backend)
    except (InvalidArgument, InvalidDtype) as e:
        raise ChainError(f"link {link.name!r} ({link.op})", "its arguments", f"the operator refused them: {e}") from None
    res = res if isinstance(res, tuple) else (res,)
    return {f"{link.name}.{o}": np.asarray(r) for o, r in zip(spec.outputs, res) if r is not None}


def with_chip(link: Link, args: dict, chip: str | None) -> dict:
    """``args`` plus ``chip`` where the link's operator takes one and the link does not set it."""
    if chip is not None and "chip" in _spec(link.op).params and link.args.get("chip") is None:
        args = {**args, "chip": chip}
    return args


def run_chain(chain: Chain, inputs: Mapping[str, np.ndarray], backend: str = "reference", *,
              chip: str | None = None, until: str | None = None) -> dict[str, np.ndarray]:
    """Run every link in order; returns every tensor: ``input.<name>`` and ``<link>.<output>``. ``chip``: passed to
    every link whose operator takes one (and whose args do not name one). ``until``: stop before this link (its
    inputs are then all present)."""
    if not isinstance(inputs, Mapping):
        raise ChainError("inputs", type(inputs).__name__, "must be a dict {input name: array}")
    missing = [i for i in chain.inputs if i not in inputs]
    if missing:
        raise ChainError("inputs", missing, "the chain declares these inputs and they were not given")
    for k in chain.inputs:
        v = inputs[k]
        if v is None or isinstance(v, (str, bytes)):
            raise ChainError(f"inputs[{k!r}]", v, "must be an array", kind="type")
        if isinstance(v, np.ma.MaskedArray):
            raise ChainError(f"inputs[{k!r}]", "a masked array (np.ma.MaskedArray)", "the operators would read the "
                             "data under the mask; pass .filled(x) or .data", kind="type")
    if until is not None and until not in [ln.name for ln in chain.links]:
        raise ChainError("until", until, f"no such link; links: {', '.join(ln.name for ln in chain.links)}")
    tensors = {f"input.{k}": np.asarray(v) for k, v in inputs.items() if k in chain.inputs}
    for link in chain.links:
        if link.name == until:
            break
        spec = _spec(link.op)
        tensors.update(_call(link, with_chip(link, _link_args(link, spec, tensors, "run"), chip), backend))
    return tensors


def run_link(link: Link, tensors: Mapping[str, np.ndarray], backend: str = "reference", *,
             chip: str | None = None) -> dict[str, np.ndarray]:
    """One link alone on ``tensors`` (``input.<name>`` / ``<link>.<output>``, e.g. what :func:`run_chain` returned):
    its in-place parameters copied first; returns ``{"<link>.<output>": array}``."""
    return _call(link, with_chip(link, _link_args(link, _spec(link.op), tensors, "run"), chip), backend)


def _safe(name: str) -> str:
    return name.replace("/", "_")


def write_chain_golden(chain: Chain, inputs: Mapping[str, np.ndarray], out_dir: str,
                       backend: str = "reference") -> dict[str, np.ndarray]:
    """Run the chain and store ``chain.json``, every tensor as ``<name>.npy`` and ``manifest.json`` (the chain's
    edges, every tensor's shape and dtype). Nothing is written when the chain refuses to run."""
    from ._arrays import dtype_name, is_ml_dtype

    tensors = run_chain(chain, inputs, backend)
    os.makedirs(out_dir, exist_ok=True)
    for name, a in tensors.items():  # ml_dtypes arrays as their raw bytes; the manifest keeps the dtype
        raw = a.view(f"u{a.dtype.itemsize}") if is_ml_dtype(a.dtype) else a
        np.save(os.path.join(out_dir, _safe(name) + ".npy"), np.ascontiguousarray(raw), allow_pickle=False)
    with open(os.path.join(out_dir, "chain.json"), "w", encoding="utf-8") as f:
        json.dump(chain.to_dict(), f, indent=1)
    manifest = {"chain": chain.name, "edges": chain.edges(), "backend": backend,
                "tensors": {n: {"shape": list(a.shape), "dtype": dtype_name(a)} for n, a in tensors.items()}}
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return tensors


def read_tensors(folder: str) -> dict[str, np.ndarray]:
    """Every ``<name>.npy`` of a folder as ``{name: array}``; where a ``manifest.json`` names a tensor's dtype
    (bfloat16, float8 ...) the raw bytes are viewed as it (a folder of dumps without one is read as stored, and
    :func:`compare_chain` views each actual tensor as its golden's dtype when the widths agree)."""
    from ._arrays import numpy_dtype

    if not os.path.isdir(folder):
        raise ChainError("tensor directory", folder, "is not a directory")
    dtypes = {}
    mpath = os.path.join(folder, "manifest.json")
    if os.path.isfile(mpath):
        try:
            with open(mpath, encoding="utf-8") as f:
                man = json.load(f)
        except (ValueError, OSError) as e:
            raise ChainError("manifest", mpath, f"cannot be read as JSON ({e})") from None
        tensors = man.get("tensors", {}) if isinstance(man, dict) else None
        if not isinstance(tensors, dict) or not all(isinstance(t, dict) for t in tensors.values()):
            raise ChainError("manifest", mpath, "must be a JSON object whose 'tensors' maps each tensor name to "
                             "{'shape': [...], 'dtype': name} (write it with write_chain_golden)")
        dtypes = {n: t.get("dtype") for n, t in tensors.items()}
    out = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".npy"):
            path = os.path.join(folder, fn)
            try:
                a = np.load(path, allow_pickle=False)
            except (ValueError, OSError, EOFError) as e:
                raise ChainError("tensor file", path, f"not a readable .npy file ({e})") from None
            dt = dtypes.get(fn[:-4])
            if dt and dt != str(a.dtype):
                try:
                    want = np.dtype(numpy_dtype(dt))
                except (ValueError, TypeError, KeyError) as e:
                    raise ChainError("tensor file", path, f"cannot be viewed as the manifest's dtype {dt!r} "
                                     f"({e})") from None
                if want.itemsize != a.dtype.itemsize:  # a dump of another dtype, not the raw bytes of this one:
                    # viewing it would change the last dimension and turn bad input into a FAIL verdict
                    raise ChainError(f"tensor {fn[:-4]}", str(a.dtype), f"the manifest's dtype is {dt} "
                                     f"({want.itemsize}-byte elements): a dump of another dtype cannot be read as it "
                                     f"({path})", kind="dtype")
                a = a.view(want)
            out[fn[:-4]] = a
    return out


@dataclass
class LinkReport:
    link: str
    op: str
    passed: bool
    inputs_matched: bool
    rerun_passed: bool | None  # the link fed with the golden inputs on rerun_backend (None: not rerun)
    results: list = field(default_factory=list)  # qsfa.compare.CompareResult per output
    rerun_error: str = ""  # the re-run backend raised (no verdict: ERROR)

    @property
    def verdict(self) -> str:
        if self.passed:
            return "PASS"
        if self.rerun_error:
            return f"ERROR (the re-run raised: {self.rerun_error})"
        if self.inputs_matched or self.rerun_passed is False:
            return "FAIL (own error: its inputs matched)" if self.inputs_matched else "FAIL (own error)"
        if self.rerun_passed is None:
            return ("FAIL (undecided: its inputs already differed; re-run it on the backend under test, "
                    "rerun_backend / --backend, to tell)")
        return "FAIL (propagated: its inputs already differed; fed with the golden inputs it passes)"


@dataclass
class ChainReport:
    chain: str
    links: list

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.links)

    @property
    def errored(self) -> bool:
        """A re-run raised: the backend under test could not run a link, so the chain has no verdict (ERROR)."""
        return any(r.rerun_error for r in self.links)

    @property
    def first_failure(self) -> LinkReport | None:
        return next((r for r in self.links if not r.passed), None)

    def __str__(self):
        lines = [f"{'link':24s} {'op':34s} verdict"]
        for r in self.links:
            lines.append(f"{r.link:24s} {r.op:34s} {r.verdict}")
            for c in r.results:
                if not c.passed:
                    lines.append(f"    {c}".replace("\n", "\n    "))
        f = self.first_failure
        lines.append(f"{'PASS' if f is None else 'ERROR' if self.errored else 'FAIL'} chain {self.chain}: "
                     f"{len(self.links)} links"
                     + ("" if f is None else f"; first failing link {f.link!r}: {f.verdict}"))
        return "\n".join(lines)


def _like(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``a`` seen with ``g``'s dtype where ``a`` holds its raw bytes: the same width and ``a`` read back from .npy as
    void, or as the unsigned integers :func:`write_chain_golden` stores an ml_dtypes tensor as. Any other dtype is
    left as it is (a dump of another dtype is refused, not reinterpreted)."""
    from ._arrays import is_ml_dtype

    if a.dtype != g.dtype and a.dtype.itemsize == g.dtype.itemsize and (
            a.dtype.kind == "V" or (a.dtype.kind == "u" and is_ml_dtype(g.dtype))):
        return np.ascontiguousarray(a).view(g.dtype)
    return a


def check_rerun_backend(backend: str | None, field_: str = "rerun_backend") -> None:
    """Refuse a re-run backend that cannot tell a link's own error from an inherited one: the reference (fed with
    the golden inputs it reproduces the golden outputs by construction, so every failure would read
    "propagated"), or a name that is not a string."""
    if backend is None:
        return
    if not isinstance(backend, str):
        raise ChainError(field_, backend, "must be a backend name (a string) or None")
    if backend == "reference":
        raise ChainError(field_, backend, "a re-run on the reference fed with the golden inputs reproduces the "
                         "golden by construction, so it cannot tell own from propagated; name the backend under "
                         "test (or none: such links are undecided)")
    from ._dispatch import get_backend

    try:
        get_backend(backend)
    except Exception as e:  # noqa: BLE001 - unknown / unusable backend: bad input, said before any comparison
        raise ChainError(field_, backend, str(e)) from None


def compare_chain(chain: Chain, golden: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray], *,
                  rerun_backend: str | None = None) -> ChainReport:
    """Compare ``actual`` tensors with ``golden`` ones link by link (see the module docstring). ``rerun_backend``:
    the backend under test, on which each failing link is re-run fed with the golden inputs (None: not re-run;
    the reference is refused, see :func:`check_rerun_backend`)."""
    from .compare import compare

    check_rerun_backend(rerun_backend)
    for link in chain.links:  # every needed tensor first: a missing one is bad input, nothing is compared
        spec = _spec(link.op)
        for o in spec.outputs:
            t = f"{link.name}.{o}"
            if t in golden and t not in actual:
                raise ChainError(f"link {link.name!r} output {o!r}", t, "missing from the actual tensors")
            if t not in golden:
                raise ChainError(f"link {link.name!r} output {o!r}", t, "missing from the golden tensors")
        check_link(link, golden)  # the recorded call itself: one the operator refuses is bad input, not a verdict
        for t in [f"{link.name}.{o}" for o in spec.outputs] + [s_ for s_ in link.refs().values() if s_ in actual]:
            a, g = _like(actual[t], golden[t]), golden[t]
            if a.dtype != g.dtype:
                raise ChainError(f"tensor {t}", str(actual[t].dtype), f"the golden's dtype is {g.dtype}: a dump of "
                                 "another dtype cannot be compared", kind="dtype")
    reports = []
    for link in chain.links:
        spec = _spec(link.op)
        outs = [f"{link.name}.{o}" for o in spec.outputs]
        results = [compare(_like(actual[t], golden[t]), golden[t], name=t) for t in outs]
        srcs = [s for s in link.refs().values() if s in actual and s in golden]
        inputs_ok = all(compare(_like(actual[s], golden[s]), golden[s], name=s).passed for s in srcs)
        passed = all(r.passed for r in results)
        rerun, error = None, ""
        if not passed and rerun_backend is not None:
            try:
                got = _call(link, _link_args(link, spec, golden, "golden"), rerun_backend)
            except Exception as e:  # noqa: BLE001 - the backend under test raised: no verdict (ERROR), not fatal
                error = f"{type(e).__name__}: {e}"
            else:
                rerun = all(compare(_like(got[t], golden[t]), golden[t], name=t).passed for t in outs)
        reports.append(LinkReport(link.name, link.op, passed, inputs_ok, rerun, results, error))
    return ChainReport(chain.name, reports)


def compare_chain_dirs(golden_dir: str, actual_dir: str, *, rerun_backend: str | None = None) -> ChainReport:
    """:func:`compare_chain` on a golden directory (``chain.json`` + tensors) and a directory of actual tensors."""
    check_rerun_backend(rerun_backend)
    path = os.path.join(golden_dir, "chain.json")
    if not os.path.isfile(path):
        raise ChainError("golden directory", golden_dir, "holds no chain.json (write it with write_chain_golden)")
    chain = load_chain(path)
    return compare_chain(chain, read_tensors(golden_dir), read_tensors(actual_dir), rerun_backend=rerun_backend)


# --------------------------------------------------------------------------------------------------
# conformance of a whole chain on a backend


def _bad_outputs(link: Link, args: Mapping, got: Mapping, want: Mapping) -> list[str]:
    """The outputs of ``link`` (``{output: array}``) whose ``got`` fails ``want`` by the golden criterion of that
    output (``qsfa.golden.meta``: bytes, or the float criterion with masked elements not compared)."""
    from . import compare as qc
    from .golden.meta import describe

    scalars = {k: v for k, v in args.items() if not isinstance(v, np.ndarray)}
    metas = describe(link.op, scalars, dict(args), dict(want))
    bad = []
    for name, w in want.items():
        g, m = got.get(name), metas.get(("output", name))
        if g is None or np.shape(g) != np.shape(w):
            bad.append(name)
            continue
        if m is not None and m.compare == "float":
            g = np.asarray(g)
            if m.mask is not None:
                g = np.where(np.asarray(m.mask, bool), g, w)
            ok = qc.compare_float(g, w, dtype=str(np.asarray(w).dtype)).passed
        else:
            ok = qc.compare_bytes(g, w).passed
        if not ok:
            bad.append(name)
    return bad


def first_divergence(chain: Chain, inputs: Mapping[str, np.ndarray], *, backend: str,
                     chip: str | None = None) -> dict | None:
    """Run ``chain`` on the reference and on ``backend`` from the same inputs and compare link by link in chain
    order (each output by its golden criterion); None when every link matches, else the first failing link:
    ``{"link", "op", "outputs", "differing_inputs", "rerun_passed", "verdict"}``. Every earlier link passed, but an
    input from one of them may still differ in its bytes (a float output within tolerance): such a link is re-run
    on ``backend`` fed with the reference's inputs; failing again it is its own error ("own"), passing the error
    came from upstream ("propagated"). A link whose inputs are byte-equal is "own"."""
    want = run_chain(chain, inputs, chip=chip)
    got = run_chain(chain, inputs, backend, chip=chip)
    for link in chain.links:
        spec = _spec(link.op)
        outs = [o for o in spec.outputs if f"{link.name}.{o}" in want]
        w = {o: want[f"{link.name}.{o}"] for o in outs}
        g = {o: got.get(f"{link.name}.{o}") for o in outs}
        args = with_chip(link, _link_args(link, spec, want, "reference run"), chip)
        bad = _bad_outputs(link, args, g, w)
        if not bad:
            continue
        # every earlier link passed its criterion; an input still differs where it is not byte-equal (a float
        # output within its tolerance)
        differing = [f"{p} = {src}" for p, src in link.refs().items() if not src.startswith("input.")
                     and (src not in got or np.asarray(got[src]).tobytes() != np.asarray(want[src]).tobytes())]
        if not differing:
            return {"link": link.name, "op": link.op, "outputs": bad, "differing_inputs": [], "rerun_passed": None,
                    "verdict": "own"}
        rerun = {k.split(".", 1)[1]: v for k, v in _call(link, args, backend).items()}
        own = bool(_bad_outputs(link, args, rerun, w))
        return {"link": link.name, "op": link.op, "outputs": bad, "differing_inputs": differing,
                "rerun_passed": not own, "verdict": "own" if own else "propagated"}
    return None


# --------------------------------------------------------------------------------------------------
# named chains: a builder from the chain's parameters (key dtype, top-k ...) to a Chain, and the generator
# (qsfa.golden.generators) that makes its inputs; chain golden sets (qsfa.golden.chain) use them


_CHAINS: dict = {}


def register_chain(name: str, builder, *, replace: bool = False):
    """Register ``builder(**params) -> Chain`` under ``name`` (a generator of the same name makes its inputs)."""
    if name in _CHAINS and not replace:
        raise ValueError(f"chain {name!r} is already registered")
    _CHAINS[name] = builder
    return builder


def get_chain(name: str, params: Mapping | None = None, *, ignore_unknown: bool = False) -> Chain:
    """The registered chain ``name`` built with ``params`` (a dict of the builder's parameters; one it does not take
    is refused by name, or ignored with ``ignore_unknown=True``: a golden case's or a strategy's parameters, which
    also hold its input generator's)."""
    import inspect

    if not isinstance(name, str) or name not in _CHAINS:
        raise ChainError("chain", name, f"no such chain; known: {', '.join(sorted(_CHAINS))}")
    if params is not None and not isinstance(params, Mapping):
        raise ChainError("params", type(params).__name__, "must be a dict of the chain builder's parameters or None")
    builder = _CHAINS[name]
    known = list(inspect.signature(builder).parameters)
    unknown = sorted(str(k) for k in (params or {}) if k not in known)
    if unknown and not ignore_unknown:
        raise ChainError("params", unknown, f"chain {name!r} takes no such parameter(s); its parameters: {known}")
    return builder(**{k: v for k, v in (params or {}).items() if k in known})


def chains() -> list[str]:
    return sorted(_CHAINS)


def chip_limited(e: BaseException) -> bool:
    """Whether ``e`` (an operator's refusal, possibly wrapped by a link) comes from a rule of the modelled chip only
    (docs/numerics/chips.md): another chip may run the same chain."""
    from ._dispatch import operators

    e = e.__context__ if isinstance(e, ChainError) and e.__context__ is not None else e
    cid = getattr(e, "constraint_id", None)
    if not isinstance(e, (InvalidArgument, InvalidDtype)) or not cid:
        return False
    return any(c.id == cid and c.chips is not None for op in operators().values() for c in op.contract.constraints)


def v32_mla_c8(key_dtype: str = "int8", sparse_count: int = 2048, scale_value: float = 576 ** -0.5,
               return_softmax_lse: bool = False) -> Chain:
    """DeepSeek-V3.2 MLA layer on vLLM-Ascend's C8 path (``qsfa.c8_pipeline`` as data): c8_rmsnorm_rope_cache ->
    scatter_by_slot (indexer keys) -> lightning_indexer -> kv_quant_sparse_flash_attention, TND query, PA_BSND
    caches. Inputs: those of the ``v32-mla-c8`` generator."""
    return chain_from_dict({
        "name": "v32-mla-c8",
        "inputs": ["kv", "gamma", "cos", "sin", "slot_mapping", "kv_cache", "index_key", "index_cache", "index_query",
                   "weights", "query", "block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv"],
        "links": [
            {"name": "cache", "op": "c8_rmsnorm_rope_cache",
             "args": {"kv": "$input.kv", "gamma": "$input.gamma", "cos": "$input.cos", "sin": "$input.sin",
                      "slot_mapping": "$input.slot_mapping", "kv_cache": "$input.kv_cache", "epsilon": 1e-6,
                      "rope_head_dim": 64, "key_dtype": key_dtype}},
            {"name": "index_cache", "op": "scatter_by_slot",
             "args": {"cache": "$input.index_cache", "rows": "$input.index_key", "slot_mapping": "$input.slot_mapping"}},
            {"name": "indexer", "op": "lightning_indexer",
             "args": {"query": "$input.index_query", "key": "$index_cache.cache", "weights": "$input.weights",
                      "actual_seq_lengths_query": "$input.actual_seq_lengths_query",
                      "actual_seq_lengths_key": "$input.actual_seq_lengths_kv", "block_table": "$input.block_table",
                      "layout_query": "TND", "layout_key": "PA_BSND", "sparse_count": int(sparse_count),
                      "sparse_mode": 3}},
            {"name": "attention", "op": "kv_quant_sparse_flash_attention",
             "args": {"query": "$input.query", "key": "$cache.kv_cache", "value": "$cache.kv_cache",
                      "sparse_indices": "$indexer.sparse_indices", "block_table": "$input.block_table",
                      "actual_seq_lengths_query": "$input.actual_seq_lengths_query",
                      "actual_seq_lengths_kv": "$input.actual_seq_lengths_kv", "scale_value": float(scale_value),
                      "layout_query": "TND", "layout_kv": "PA_BSND", "sparse_mode": 3, "rope_head_dim": 64,
                      "return_softmax_lse": bool(return_softmax_lse), "key_dtype": key_dtype}},
        ]})


register_chain("v32-mla-c8", v32_mla_c8)


from . import chain_v4  # noqa: E402,F401 - registers the DeepSeek-V4 layer chains (v4-swa / -csa / -hca)
