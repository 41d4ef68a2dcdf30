"""Byte-exact, machine-independent storage of golden arrays.

Every array is stored in a *storage dtype* that any reader understands, plus its *logical dtype* (the
dtype the operator works in) in the manifest:

==================  ==============  ==========================================================
logical dtype       storage         note
==================  ==============  ==========================================================
bfloat16            ``<u2``         the 16-bit pattern (top half of the fp32 bits)
float8_e4m3fn       ``|u1``         the 8-bit code
float8_e5m2         ``|u1``         the 8-bit code
uint8 + hifloat8    ``|u1``         HiFloat8 has no NumPy dtype: codes are uint8 everywhere
bool                ``|u1``         0 or 1
float16/32/64       ``<f2/4/8``     IEEE little-endian
(u)int8..64         ``|i1`` ...     two's complement little-endian
==================  ==============  ==========================================================

``bin`` files are the raw little-endian bytes in C (row-major) order, nothing else: read them with
``numpy.fromfile(path, dtype=storage).reshape(shape)``. ``npz`` files are zip archives (stored, not
compressed, fixed timestamps) of ``.npy`` members in the storage dtype, so the same bytes come out on
every machine and any ``.npy`` reader (cnpy, NumPy without ml_dtypes) can open them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from .._arrays import dtype_name, is_ml_dtype, numpy_dtype

__all__ = [
    "GoldenInputError",
    "storage_dtype",
    "to_storage",
    "from_storage",
    "logical_dtype",
    "sha256_bytes",
    "sha256_file",
    "array_sha256",
    "storage_bytes",
    "write_bin",
    "read_bin",
    "write_npz",
    "read_npz_member",
    "npz_members",
    "dump_json",
    "load_json",
]


class GoldenInputError(ValueError):
    """Bad input to a golden command: a missing, tampered or mismatched file, an unknown set.

    The command line prints it as one line on stderr (exit status 2)."""


# logical dtype name -> storage dtype string (little-endian, as numpy.fromfile expects it)
_STORAGE = {
    "bool": "|u1",
    "int8": "|i1",
    "uint8": "|u1",
    "int16": "<i2",
    "uint16": "<u2",
    "int32": "<i4",
    "uint32": "<u4",
    "int64": "<i8",
    "uint64": "<u8",
    "float16": "<f2",
    "float32": "<f4",
    "float64": "<f8",
    "bfloat16": "<u2",
    "float8_e4m3fn": "|u1",
    "float8_e5m2": "|u1",
}


def _ml_dtype(name: str) -> np.dtype | None:
    t = getattr(ml_dtypes, name, None)
    if t is None:
        return None
    try:
        return np.dtype(t)
    except TypeError:
        return None


def logical_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a logical dtype name (ml_dtypes for bfloat16 / float8 / other ml_dtypes)."""
    try:
        return numpy_dtype(name)
    except TypeError:
        dt = _ml_dtype(name)
    if dt is None and name in _STORAGE:  # plain NumPy names qsfa._arrays does not list (uint32, ...)
        dt = np.dtype(name)
    if dt is None:
        raise GoldenInputError(f"unknown dtype {name!r} in manifest")
    return dt


def storage_dtype(name: str) -> np.dtype:
    """The storage dtype of a logical dtype name (see the module docstring)."""
    s = _STORAGE.get(name)
    if s is None:
        dt = _ml_dtype(name)  # another ml_dtypes format (float8_e8m0fnu, float4_e2m1fn, ...)
        if dt is None or dt.itemsize not in (1, 2):
            raise GoldenInputError(f"dtype {name!r} has no golden storage form")
        s = "|u1" if dt.itemsize == 1 else "<u2"
    return np.dtype(s)


def to_storage(a: np.ndarray) -> tuple[str, np.ndarray]:
    """``(logical dtype name, C-contiguous little-endian storage array)`` for ``a``; bits preserved."""
    a = np.asarray(a)
    name = dtype_name(a)
    st = storage_dtype(name)
    if is_ml_dtype(a.dtype):  # ml_dtypes types: reinterpret the bits as an unsigned integer of that size
        raw = np.asarray(a, order="C").view(np.dtype(f"u{a.dtype.itemsize}"))
        return name, np.asarray(raw.astype(st, copy=False), order="C")
    # asarray(order="C"), not ascontiguousarray: that makes a 0-d array 1-d (the stored shape would not be a's)
    return name, np.asarray(a.astype(st, copy=False), order="C")


def from_storage(raw: np.ndarray, name: str) -> np.ndarray:
    """Inverse of :func:`to_storage`: a native-order array of logical dtype ``name``."""
    ldt = logical_dtype(name)
    if name == "bool":
        return raw.astype(np.bool_)
    if is_ml_dtype(ldt):  # ml_dtypes: the stored unsigned integers are the bits
        return np.asarray(raw, order="C").astype(np.dtype(f"u{ldt.itemsize}"), copy=False).view(ldt)
    return raw.astype(ldt.newbyteorder("="), copy=False)


def sha256_bytes(b: bytes | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def storage_bytes(storage: np.ndarray) -> memoryview:
    """The bytes of an array in C order, without a copy where it is contiguous (an empty array too: a
    memoryview of a shape holding a 0 cannot be cast to bytes, its flat view can)."""
    return memoryview(np.ascontiguousarray(storage).reshape(-1)).cast("B")


def array_sha256(storage: np.ndarray) -> str:
    """sha256 of an array's storage bytes (what a ``bin`` file holds)."""
    return sha256_bytes(storage_bytes(storage))


def write_bin(path: str, storage: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(storage_bytes(storage))


def read_bin(path: str, storage: np.dtype, shape) -> np.ndarray:
    """Read a raw file; the size must match ``shape`` x ``storage.itemsize`` exactly (checked, with the
    cap of :func:`qsfa.golden.guard.max_array_bytes`, before any data is read)."""
    import stat

    from .guard import declared_nbytes, max_array_bytes

    shape = tuple(int(s) for s in shape)
    expected = declared_nbytes(shape, storage.itemsize)
    if min(shape, default=0) < 0 or expected > max_array_bytes():
        raise GoldenInputError(f"{path}: Invalid shape for the expected array, actual: {list(shape)}, reason: "
                               f"{expected} bytes are negative or exceed the cap of {max_array_bytes()} "
                               "(QSFA_GOLDEN_MAX_BYTES).")
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        raise GoldenInputError(f"file not found: {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise GoldenInputError(f"{path} is not a regular file")
    size = st.st_size
    if size != expected:
        raise GoldenInputError(
            f"{path} has {size} bytes, expected {expected} (shape {list(shape)}, {storage.str})"
        )
    return np.fromfile(path, dtype=storage).reshape(shape)


_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def write_npz(path, members: Mapping[str, np.ndarray]) -> None:
    """An ``.npz`` whose bytes depend only on the arrays: stored members, fixed dates, sorted order.
    ``path`` may be a binary file object opened for writing."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key in sorted(members):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(members[key]), version=(1, 0),
                                      allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.create_system = 3
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def npz_members(path: str) -> list[str]:
    try:
        with zipfile.ZipFile(path) as zf:
            return [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
    except (OSError, zipfile.BadZipFile) as e:
        raise GoldenInputError(f"cannot read {path} as .npz: {e}") from None


def read_npz_member(path: str, key: str, *, shape=None, itemsize=None, what=None) -> np.ndarray:
    """One member of an ``.npz`` (no pickles), judged from its zip entry and .npy header (``shape`` and
    ``itemsize`` when given, and the size cap) before its data is inflated: see :mod:`qsfa.golden.guard`."""
    from .guard import read_npz_member as _read

    return _read(path, key, shape=shape, itemsize=itemsize, what=what)


def dump_json(obj: Any) -> str:
    """Canonical JSON: sorted keys, no NaN, one trailing newline (the same bytes on every machine)."""
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=True, allow_nan=False) + "\n"


def load_json(path: str) -> Any:
    """A JSON file that may be hostile (a regular file, bounded size and nesting, strict JSON): see
    :func:`qsfa.golden.guard.load_json`."""
    from .guard import load_json as _load

    return _load(path)
