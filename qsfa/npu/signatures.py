"""The recorded signatures of the torch_npu functions and vLLM-Ascend custom ops the npu backend calls.

The data lives in ``signatures.json`` beside this module (regenerate the torch_npu part with
``python -m qsfa.npu._record_signatures``; see that module for the procedure and the sources). Each entry
is keyed by the callable's dotted name as the mapping names it (``"torch_npu.npu_dynamic_block_quant"``,
``"torch.ops._C_ascend.npu_kv_quant_sparse_flash_attention"``) and holds:

* ``params``: in order, each with ``name``, schema ``type`` (``"Tensor"``, ``"Tensor?"``, ``"int"``,
  ``"int?"``, ``"float"``, ``"str"``, ``"bool"``, ``"Tensor(a!)"`` for in-place arguments), ``kind``
  (``"positional"`` - positional or keyword - or ``"keyword_only"``) and ``default`` when optional;
* ``returns``: the schema's return types; ``schema``: the schema string;
* ``source``: file and line in the torch_npu 2.14.0 wheel (meta registration and codegen yaml), or the
  vLLM-Ascend repository, commit, file and line of the ``ops.def`` schema.

No torch import here: the signatures are usable on any machine.
"""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path

__all__ = ["load", "record", "targets", "signature", "type_problems"]

_PATH = Path(__file__).with_name("signatures.json")


@functools.lru_cache(maxsize=1)
def load() -> dict:
    """The whole record (parsed ``signatures.json``)."""
    return json.loads(_PATH.read_text(encoding="utf-8"))


def targets() -> list[str]:
    return sorted(load()["functions"])


def record(target: str) -> dict:
    try:
        return load()["functions"][target]
    except KeyError:
        raise KeyError(f"no recorded signature for {target!r}; recorded: {targets()}") from None


def signature(target: str) -> inspect.Signature:
    """An :class:`inspect.Signature` rebuilt from the record (for ``bind``)."""
    params = []
    for p in record(target)["params"]:
        kind = inspect.Parameter.KEYWORD_ONLY if p["kind"] == "keyword_only" \
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = p["default"] if "default" in p else inspect.Parameter.empty
        params.append(inspect.Parameter(p["name"], kind, default=default))
    return inspect.Signature(params)


def _is_tensor(v) -> bool:
    mod = type(v).__module__
    return mod.startswith("torch") and type(v).__name__ in ("Tensor", "Parameter")


def _type_ok(schema_type: str, v) -> bool:
    t = schema_type.split("(")[0] if schema_type.startswith("Tensor(") else schema_type
    optional = t.endswith("?")
    t = t.rstrip("?")
    if v is None:
        return optional
    if t == "Tensor":
        return _is_tensor(v)
    if t == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "float":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "bool":
        return isinstance(v, bool)
    if t == "str":
        return isinstance(v, str)
    if t == "int[]":
        return isinstance(v, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    if t == "ScalarType":
        return type(v).__module__ == "torch" and type(v).__name__ == "dtype"
    raise ValueError(f"schema type {schema_type!r} is not handled")


def type_problems(target: str, args: tuple = (), kwargs: dict | None = None) -> list[str]:
    """Bind ``args``/``kwargs`` to the recorded signature and check every value against its schema type.

    Returns a list of problems (empty when the call matches); a binding failure is reported as one
    problem rather than raised, so callers can assert on the list.
    """
    kwargs = kwargs or {}
    try:
        bound = signature(target).bind(*args, **kwargs)
    except TypeError as e:
        return [f"{target}: {e}"]
    types = {p["name"]: p["type"] for p in record(target)["params"]}
    out = []
    for name, value in bound.arguments.items():
        if not _type_ok(types[name], value):
            shown = f"tensor {value.dtype}" if _is_tensor(value) else repr(value)
            out.append(f"{target}: {name} expects {types[name]}, got {shown}")
    return out
