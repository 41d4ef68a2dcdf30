"""The backends qsfa ships: "reference" (NumPy oracle), "npu" (torch_npu), "triton" (Triton kernels).

Only availability lives here (cheap to ask: no torch import unless the package exists). Each backend's
implementations are registered by its own module, imported on first use.
"""

from __future__ import annotations

import importlib.util
import os

from ._dispatch import Backend, register_backend


class ReferenceBackend(Backend):
    name = "reference"
    array_kind = "numpy"
    description = "pure NumPy + ml_dtypes oracle (qsfa.reference); always usable"


class NpuBackend(Backend):
    """Ascend NPUs through torch_npu and the vLLM-Ascend custom ops (see qsfa.npu)."""

    name = "npu"
    array_kind = "torch"
    module = "qsfa.npu.backend"
    description = "Ascend NPU through torch_npu / torch.ops._C_ascend (qsfa.npu)"
    models_numerics = False  # the device rounds as its chip does

    def availability(self):
        if importlib.util.find_spec("torch") is None:
            return False, "torch is not installed"
        if importlib.util.find_spec("torch_npu") is None:
            return False, "torch_npu is not installed (pip install qsfa[npu] on an Ascend machine)"
        from .npu import device as npu_device

        return npu_device.availability()

    def chip(self):
        from .npu import device as npu_device

        return npu_device.chip_family()

    def device(self):
        return "npu"

    def limits(self, op):
        from .npu import device as npu_device

        return npu_device.backend_limits(op)

    def missing(self, op):
        from .npu import mapping as npu_mapping

        return npu_mapping.NOT_MAPPED.get(op, "")


class TritonBackend(Backend):
    """Triton kernels from kernels/ (qsfa.kernels): CUDA GPUs, Ascend via triton-ascend, or the CPU
    interpreter when TRITON_INTERPRET=1."""

    name = "triton"
    array_kind = "torch"
    module = "qsfa.triton_backend"
    description = "Triton kernels (qsfa.kernels): CUDA, triton-ascend, or the interpreter (TRITON_INTERPRET=1)"

    def availability(self):
        if importlib.util.find_spec("torch") is None:
            return False, "torch is not installed (pip install qsfa[triton])"
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed (pip install qsfa[triton])"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return True, "Triton interpreter on the CPU (TRITON_INTERPRET=1)"
        import torch

        if torch.cuda.is_available():
            return True, f"CUDA device {torch.cuda.get_device_name(0)}"
        if importlib.util.find_spec("torch_npu") is not None:
            import torch_npu  # noqa: F401

            if hasattr(torch, "npu") and torch.npu.is_available():
                return True, "Ascend NPU through triton-ascend"
        return False, "no CUDA or Ascend device visible and TRITON_INTERPRET is not 1"

    def device(self):
        if os.environ.get("TRITON_INTERPRET") == "1":
            return "cpu"
        import torch

        if torch.cuda.is_available():
            return "cuda"
        return "npu"

    def limits(self, op):
        from . import triton_backend

        return triton_backend.limits(op)


register_backend(ReferenceBackend())
register_backend(NpuBackend())
register_backend(TritonBackend())
