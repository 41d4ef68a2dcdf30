"""Registers the npu backend's implementations (imported by the dispatch layer when "npu" is usable).

Each implementation receives the operator's validated, normalised arguments with tensors already on the
NPU, asks :mod:`qsfa.npu.mapping` for the call, runs the real torch_npu function or vLLM-Ascend custom op,
and returns the outputs in qsfa's order. Nothing is computed here besides that call.
"""

from __future__ import annotations

import importlib

import torch
import torch_npu  # noqa: F401  (registers the npu device and torch_npu.* functions)

from .._dispatch import register_impl
from .._errors import UnsupportedByBackend
from . import device, mapping

__all__ = ["resolve", "context", "run_call", "registered"]

_CUSTOM = (mapping.QSFA_CUSTOM_NAME, mapping.KCE_VLLM_CUSTOM_NAME, mapping.ICE2_CUSTOM_NAME,
           mapping.VQLI_CUSTOM_NAME, mapping.SAS_CUSTOM_NAME, mapping.KQS_CUSTOM_NAME, mapping.VCMP_CUSTOM_NAME)


def _import_package() -> None:
    """Import ops-transformer's ``cann_ops_transformer`` package (registers ``torch.ops.cann_ops_transformer.*``);
    imported here, on the first call of one of its operators, never when qsfa loads."""
    try:
        importlib.import_module(mapping.PACKAGE)
    except Exception as e:  # noqa: BLE001 - a missing or broken package: refuse the call, naming it
        raise UnsupportedByBackend(
            "npu", f"this operator runs through torch.ops.{mapping.PACKAGE}.*, and the {mapping.PACKAGE} package "
                   f"(ops-transformer torch_extension/, built for this CANN and torch_npu) failed to import "
                   f"({type(e).__name__}: {e}); build and install it (docs/backends.md)") from e


def resolve(target: str):
    """The callable a mapping names: ``torch_npu.<fn>`` or ``torch.ops.<namespace>.<op>`` (the
    ``cann_ops_transformer`` namespace is imported on first use)."""
    if target.startswith("torch.ops."):
        _, _, ns, name = target.split(".", 3)
        if ns == mapping.PACKAGE:
            _import_package()
        return getattr(getattr(torch.ops, ns), name)
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def context() -> mapping.NpuContext:
    return mapping.NpuContext(chip=device.chip_family(), custom_ops=device.loaded_custom_ops(_CUSTOM))


def run_call(call: mapping.NpuCall):
    # a keyword value that is itself a call (a metadata operator) runs first and passes its output
    kwargs = {k: run_call(v) if isinstance(v, mapping.NpuCall) else v for k, v in call.kwargs.items()}
    result = resolve(call.target)(*call.args, **kwargs)
    for index, dst in call.writeback:
        src = result[index]
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src)
    out = call.unpack(result)
    return out[0] if len(out) == 1 else out


def _make_impl(op: str):
    def impl(**args):
        try:
            call = mapping.map_call(op, args, context())
        except ValueError as e:  # an argument combination without a callable here (limits normally catch it)
            raise UnsupportedByBackend("npu", str(e)) from e
        return run_call(call)

    impl.__name__ = f"npu_{op.replace('.', '_')}"
    impl.__doc__ = f"{op} on the NPU through qsfa.npu.mapping.{mapping.MAPPINGS[op].__name__}"
    return impl


def _register() -> tuple[str, ...]:
    done = []
    for op in mapping.MAPPINGS:
        try:
            register_impl("npu", op, _make_impl(op))
        except KeyError:  # the operator is not defined (its module is not installed / written)
            continue
        done.append(op)
    return tuple(done)


#: operators registered for the npu backend in this process
registered = _register()
