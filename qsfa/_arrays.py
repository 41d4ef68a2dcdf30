"""Lossless conversion between NumPy (+ ml_dtypes) arrays and torch tensors.

The reference backend computes in NumPy; torch backends compute on tensors. Every conversion here is a
bit-preserving reinterpretation, never a numeric cast:

* bfloat16 <-> ``ml_dtypes.bfloat16`` through an int16 view;
* float8_e4m3fn / float8_e5m2 <-> ml_dtypes' types through a uint8 view;
* HiFloat8 has no torch or NumPy dtype: it is carried as uint8 bytes everywhere.

CPU tensors convert without copying (so an in-place write through the NumPy view lands in the caller's
tensor); tensors on another device are copied to the host.

torch is imported only when a torch tensor is actually seen (or asked for).
"""

from __future__ import annotations

import sys
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "dtype_name",
    "is_torch",
    "torch_module",
    "to_numpy",
    "to_torch",
    "numpy_dtype",
    "caller_kind",
    "CallerKind",
]

_NP_BY_NAME = {
    "bool": np.dtype(np.bool_),
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
}
_NAME_BY_NP = {v: k for k, v in _NP_BY_NAME.items()}

# torch dtype name -> same-size integer dtype used for bit reinterpretation
_TORCH_BITCAST = {
    "bfloat16": ("int16", np.int16),
    "float8_e4m3fn": ("uint8", np.uint8),
    "float8_e5m2": ("uint8", np.uint8),
}


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch when it is not loaded."""
    mod = sys.modules.get("torch")
    return mod is not None and isinstance(x, mod.Tensor)


def torch_module():
    """Import torch or raise a clear error."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "this call needs torch; install it with `pip install qsfa[torch]` (torch==2.13.0 CPU) "
            "or the torch that matches your torch_npu"
        ) from e
    return torch


def numpy_dtype(name: str) -> np.dtype:
    try:
        return _NP_BY_NAME[name]
    except KeyError:
        raise TypeError(f"unknown dtype name {name!r}; known: {sorted(_NP_BY_NAME)}") from None


def is_ml_dtype(dt) -> bool:
    """Whether ``dt`` is one of ml_dtypes' types (bfloat16, the FP8 / FP6 / FP4 / E8M0 formats, int4...). Their NumPy
    ``kind`` is not a reliable test: most are "V", but ml_dtypes 0.7 registers float8_e5m2 as "f", so its values
    would be cast where its bits must be copied."""
    return np.dtype(dt).type.__module__.split(".")[0] == "ml_dtypes"


def dtype_name(x: Any) -> str:
    """Canonical dtype name of a NumPy array, torch tensor, dtype object or name."""
    if isinstance(x, str):
        return x
    if is_torch(x):
        return str(x.dtype).replace("torch.", "")
    mod = sys.modules.get("torch")
    if mod is not None and isinstance(x, mod.dtype):
        return str(x).replace("torch.", "")
    dt = x.dtype if hasattr(x, "dtype") else np.dtype(x)
    dt = np.dtype(dt)
    try:
        return _NAME_BY_NP[dt]
    except KeyError:
        return str(dt)


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy view (CPU tensors) or host copy (other devices) of ``x``, bits preserved."""
    if not is_torch(x):
        return x if isinstance(x, np.ndarray) else np.asarray(x)
    torch = torch_module()
    t = x.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    name = dtype_name(t)
    if name in _TORCH_BITCAST:
        int_name, _ = _TORCH_BITCAST[name]
        return t.view(getattr(torch, int_name)).numpy().view(_NP_BY_NAME[name])
    return t.numpy()


def to_torch(a: np.ndarray, device=None, like=None):
    """A torch tensor holding the same bits as ``a`` (on ``device``, or on ``like``'s device)."""
    torch = torch_module()
    if like is not None and device is None:
        device = like.device
    a = np.asarray(a)
    name = dtype_name(a)
    if not a.flags.c_contiguous or any(s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)
    if name in _TORCH_BITCAST:
        _, int_np = _TORCH_BITCAST[name]
        t = torch.from_numpy(a.view(int_np)).view(getattr(torch, name))
    else:
        t = torch.from_numpy(a)
    if device is not None and str(device) != "cpu":
        t = t.to(device)
    return t


class CallerKind:
    """How the caller passed arrays: ``kind`` is "numpy" or "torch"; ``device`` for torch."""

    __slots__ = ("kind", "device")

    def __init__(self, kind: str, device=None):
        self.kind = kind
        self.device = device

    def __repr__(self):
        return f"CallerKind({self.kind!r}, device={self.device!r})"

    def wrap(self, a):
        """Convert a backend result (NumPy array or tensor) to the caller's kind."""
        if a is None:
            return None
        if self.kind == "numpy":
            return to_numpy(a) if is_torch(a) else a
        if is_torch(a):
            return a if str(a.device) == str(self.device) else a.to(self.device)
        return to_torch(a, device=self.device)


def caller_kind(values, param_names=None) -> CallerKind:
    """Decide the caller's array kind; reject torch tensors spread over several devices."""
    devices = {}
    for i, v in enumerate(values):
        if is_torch(v):
            name = param_names[i] if param_names else f"argument {i}"
            devices.setdefault(str(v.device), name)
    if not devices:
        return CallerKind("numpy")
    if len(devices) > 1:
        from ._errors import InvalidArgument

        listing = ", ".join(f"{p} on {d}" for d, p in devices.items())
        raise InvalidArgument(
            "device", "tensors", listing, "all torch tensors of one call must be on the same device"
        )
    (dev,) = devices
    torch = torch_module()
    return CallerKind("torch", torch.device(dev))
