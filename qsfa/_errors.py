"""Error types and the one message format every operator uses.

Every rejected argument produces ``Invalid <kind> for <param>, actual: <value>, reason: <why>.`` -
the wording the vLLM-Ascend operators use - so an Ascend user reads our errors the way they read the
kernel's. The exception carries the same pieces as attributes so tests and the conformance runner can
check *which* constraint fired, not just that something did.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "Raw",
    "InvalidArgument",
    "InvalidDtype",
    "BackendError",
    "BackendUnavailable",
    "UnknownBackend",
    "NotImplementedByBackend",
    "UnsupportedByBackend",
    "format_actual",
    "invalid_message",
]


class Raw(str):
    """An *actual* value that is already a description ("nan at index (0, 3)"): printed without quotes."""


def format_actual(value) -> str:
    """Render an offending value compactly (arrays by shape/dtype, long sequences truncated)."""
    if isinstance(value, Raw) or value is None or (isinstance(value, str) and value == "None"):
        return str(value)  # "None" is how the checks describe a missing argument: no quotes, like Python
    if isinstance(value, np.ndarray):
        if value.size <= 8:
            return f"array({value.tolist()}, dtype={value.dtype})"
        return f"array(shape={tuple(value.shape)}, dtype={value.dtype})"
    if isinstance(value, (list, tuple)) and len(value) > 12:
        head = ", ".join(repr(v) for v in value[:12])
        return f"[{head}, ... ({len(value)} items)]"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def invalid_message(kind: str, param: str, actual, reason: str) -> str:
    reason = reason.rstrip(".")
    return f"Invalid {kind} for {param}, actual: {format_actual(actual)}, reason: {reason}."


class _InvalidMixin:
    def _init(self, kind: str, param: str, actual, reason: str, constraint_id: str | None):
        self.kind = kind
        self.param = param
        self.actual = actual
        self.reason = reason
        self.constraint_id = constraint_id
        return invalid_message(kind, param, actual, reason)


class InvalidArgument(_InvalidMixin, ValueError):
    """A parameter has a bad value or shape. Raised before any buffer is written."""

    def __init__(self, kind: str, param: str, actual, reason: str, constraint_id: str | None = None):
        ValueError.__init__(self, self._init(kind, param, actual, reason, constraint_id))


class InvalidDtype(_InvalidMixin, TypeError):
    """A parameter has a dtype the operator does not accept. Raised before any buffer is written."""

    def __init__(self, kind: str, param: str, actual, reason: str, constraint_id: str | None = None):
        TypeError.__init__(self, self._init(kind, param, actual, reason, constraint_id))


class BackendError(RuntimeError):
    """Base class of the dispatch errors."""


class UnknownBackend(BackendError, ValueError):
    """A backend name that is not registered; the message lists the known ones."""


class BackendUnavailable(BackendError):
    """The backend exists but cannot run here (missing package, no device); the message says why."""


class NotImplementedByBackend(BackendError, NotImplementedError):
    """The backend exists and is usable but has no implementation of this operator."""


class UnsupportedByBackend(BackendError, ValueError):
    """The backend implements the operator but not this argument combination (kernel limits)."""

    def __init__(self, backend: str, message: str, constraint_id: str | None = None):
        self.backend = backend
        self.constraint_id = constraint_id
        super().__init__(f"backend {backend!r} does not support this call: {message}")
