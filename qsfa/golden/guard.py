"""Guards of the golden commands against hostile input: paths, JSON, and array headers.

The golden CLI reads files other people made (a manifest, a case file, a kernel's ``.npz``) and writes
into a folder that may already hold files. The rules it keeps, each enforced here:

* **Paths.** ``generate --out DIR`` creates, overwrites and deletes only files it made inside DIR: every
  path is the real path under DIR (a symbolic link is never followed, neither a file nor a folder), case
  names are single path components (no ``/``, no ``..``, no NUL), and a file is never overwritten - it is
  either one an earlier qsfa manifest of DIR listed (deleted first, and only if it is a regular file whose
  real path is inside DIR) or a new file (``O_CREAT | O_EXCL | O_NOFOLLOW``). Files named by a case file
  resolve inside the case file's folder (:func:`resolve_inside`). Files that are rewritten in place (the
  case files ``qsfa conformance`` saves into ``--cases-dir``) are written by :func:`replacing`: new bytes in a
  new file beside the old one, renamed over it - never through a link - and folders a tool creates are made
  by :func:`make_dirs`, which never follows a link it did not find there.
* **JSON.** Only regular files of at most :data:`MAX_JSON_BYTES`; nesting deeper than
  :data:`MAX_JSON_DEPTH` is refused before parsing (no ``RecursionError``); ``NaN`` / ``Infinity`` and
  duplicate keys are refused.
* **Sizes before data.** An ``.npy`` (alone or an ``.npz`` member) is judged from its header: the declared
  shape and element size must be the expected ones and at most :func:`max_array_bytes`; an ``.npz``
  member must be stored or deflated, declare exactly header + data bytes, and claim no more than
  :data:`MAX_INFLATE_RATIO` times its compressed size (beyond DEFLATE's own limit of about 1032:1: a
  header that lies). Only then is the data read, into one buffer of the declared size.

Errors are :class:`~qsfa.golden.io.GoldenInputError` in the project's one-line format,
``<file>: Invalid <kind> for <field>, actual: <value>, reason: <why>.``
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import reprlib
import stat
import zipfile
import zlib

import numpy as np

from .io import GoldenInputError

__all__ = [
    "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "MAX_INFLATE_RATIO", "max_array_bytes", "field_error", "short",
    "load_json", "check_component", "is_inside", "resolve_inside", "create_new", "lexists_plain_file",
    "lexists_plain_dir", "describe_path", "missing_dirs", "make_dirs", "check_replaceable", "replacing", "read_npy",
    "read_npz_member", "check_npz_member", "declared_nbytes",
]

#: largest JSON file (manifest, case file) read (a 1,000-case manifest is about 20 MB)
MAX_JSON_BYTES = 64 << 20
#: deepest nesting of arrays/objects accepted in a JSON file (a manifest needs 5)
MAX_JSON_DEPTH = 64
#: an .npz member claiming more than this many times its compressed size is refused (DEFLATE tops out
#: at about 1032:1, so only a lying header exceeds it)
MAX_INFLATE_RATIO = 1100
#: default cap on one array's bytes (override with the environment variable QSFA_GOLDEN_MAX_BYTES)
DEFAULT_MAX_ARRAY_BYTES = 1 << 34

_REPR = reprlib.Repr()
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlist = 6
_REPR.maxdict = 4
_REPR.maxlevel = 2


def short(value) -> str:
    """A one-line, bounded repr of a (possibly huge or hostile) value for an error message; a value that is
    already a description (:class:`qsfa._errors.Raw`, as a contract reports an array) is shown as it is."""
    from .._errors import Raw

    s = _REPR.repr(str(value))[1:-1] if isinstance(value, Raw) else _REPR.repr(value)
    return s.replace("\n", "\\n").replace("\r", "\\r")


def field_error(file, field: str, value, reason: str, kind: str = "value") -> GoldenInputError:
    """``<file>: Invalid <kind> for <field>, actual: <value>, reason: <reason>.``"""
    return GoldenInputError(f"{file}: Invalid {kind} for {field}, actual: {short(value)}, reason: {reason}.")


def max_array_bytes() -> int:
    """The largest array (in bytes) any golden command reads or accepts in a manifest or case file."""
    v = os.environ.get("QSFA_GOLDEN_MAX_BYTES")
    if v is None:
        return DEFAULT_MAX_ARRAY_BYTES
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n <= 0:
        raise GoldenInputError(f"Invalid value for QSFA_GOLDEN_MAX_BYTES, actual: {short(v)}, "
                               "reason: must be a positive integer (bytes).")
    return n


def declared_nbytes(shape, itemsize: int) -> int:
    """Bytes of an array of ``shape`` (Python integers: no int64 overflow)."""
    n = int(itemsize)
    for d in shape:
        n *= int(d)
    return n


# --------------------------------------------------------------------------------------------------
# JSON

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def _nesting_depth(data: bytes, chunk: int = 1 << 22) -> int:
    """Deepest ``[``/``{`` nesting outside strings (a byte scan in chunks: no recursion, no parse, memory
    bounded by the chunk)."""
    bare = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    depth = best = 0
    for i in range(0, bare.size, chunk):
        b = bare[i:i + chunk]
        step = ((b == 0x5B).astype(np.int32) + (b == 0x7B)) - ((b == 0x5D).astype(np.int32) + (b == 0x7D))
        run = np.cumsum(step, dtype=np.int64)
        best = max(best, depth + int(run.max()))
        depth += int(run[-1])
    return best


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def load_json(path) -> object:
    """Parse a JSON file that may be hostile: a regular file, bounded size and nesting, strict JSON."""
    path = os.fspath(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)  # non-blocking: a FIFO named as a case file does not hang the open
    except FileNotFoundError:
        raise GoldenInputError(f"file not found: {path}") from None
    except OSError as e:
        raise GoldenInputError(f"cannot open {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GoldenInputError(f"{path} is not a regular file")
        if st.st_size > MAX_JSON_BYTES:
            raise GoldenInputError(f"{path} has {st.st_size} bytes; JSON files over {MAX_JSON_BYTES} bytes are refused")
        data = f.read(st.st_size + 1)  # not the cap: read(n) allocates n bytes up front
    if len(data) > st.st_size:
        raise GoldenInputError(f"{path} grew while being read")
    depth = _nesting_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise GoldenInputError(f"{path}: Invalid JSON for nesting depth, actual: {depth}, "
                               f"reason: at most {MAX_JSON_DEPTH} nested arrays/objects are accepted.")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicates)
    except RecursionError:  # not reachable after the depth check; kept so no parse can end in a traceback
        raise GoldenInputError(f"{path} is nested too deeply to parse") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise GoldenInputError(f"{path} is not valid JSON: {short(str(e))[1:-1]}") from None


# --------------------------------------------------------------------------------------------------
# paths

_COMPONENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_component(value, file, field: str, kind: str = "value") -> str:
    """``value`` must be one plain path component: ``[A-Za-z0-9][A-Za-z0-9._-]*`` (so no ``/``, ``\\``,
    ``.``, ``..``, NUL, drive or absolute path)."""
    if not isinstance(value, str):
        raise field_error(file, field, value, f"must be a string, not {type(value).__name__}", kind)
    if not _COMPONENT.match(value) or value in (".", ".."):
        raise field_error(file, field, value,
                          "must be a single path component matching [A-Za-z0-9][A-Za-z0-9._-]*", kind)
    return value


def _real(path) -> str:
    return os.path.realpath(os.fspath(path))


def is_inside(root_real: str, path) -> bool:
    """Whether the real path of ``path`` is ``root_real`` or below it (``root_real`` already real)."""
    real = _real(path)
    try:
        return os.path.commonpath([root_real, real]) == root_real
    except ValueError:  # different drives
        return False


def resolve_inside(root, rel, file, field: str, *, allow_outside: bool = False, kind: str = "value") -> str:
    """``root/rel`` as a real path that must stay inside ``root`` (symbolic links resolved); absolute paths
    and escapes are refused unless ``allow_outside``."""
    if not isinstance(rel, str) or not rel:
        raise field_error(file, field, rel, "must be a non-empty string (a path relative to the case file)", kind)
    if "\0" in rel:
        raise field_error(file, field, rel, "holds a NUL byte", kind)
    if allow_outside:
        return os.path.join(os.fspath(root), rel)
    if os.path.isabs(rel) or os.path.splitdrive(rel)[0]:
        raise field_error(file, field, rel, "is an absolute path; files a case names must lie in its folder "
                          "(pass --allow-outside-inputs to permit this)", kind)
    root_real = _real(root)
    path = os.path.join(root_real, rel)
    if not is_inside(root_real, path):
        raise field_error(file, field, rel, f"resolves outside {root_real} (through '..' or a symbolic link); "
                          "pass --allow-outside-inputs to permit this", kind)
    return path  # the name as given (its extension says how to read it), known to resolve inside


def lexists_plain_file(path) -> bool:
    """A regular file, not a symbolic link (the link itself is looked at)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def lexists_plain_dir(path) -> bool:
    """A directory, not a symbolic link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def describe_path(path) -> str:
    """What is at ``path``, in words for an error message: "a directory", "a symbolic link to /dev/zero (a
    character device)", "a symbolic link to x (which does not exist)", "missing"."""
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return "missing"
    if not stat.S_ISLNK(st.st_mode):
        return _kind(st.st_mode)
    try:
        target = short(os.readlink(path))[1:-1]
    except OSError:
        target = "?"
    try:
        what = _kind(os.stat(path).st_mode)
    except (OSError, ValueError):
        what = "which does not exist"
    return f"a symbolic link to {target} ({what})"


def create_new(path):
    """Open ``path`` for writing only if nothing (not even a dangling link) is there: a binary file object."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        raise GoldenInputError(f"refusing to overwrite {path}: it is not a file an earlier qsfa manifest of "
                               "this directory lists") from None
    return os.fdopen(fd, "wb")


def missing_dirs(path) -> list:
    """The folders ``os.makedirs(path)`` would create, deepest first (absolute paths)."""
    made, p = [], os.path.abspath(os.fspath(path))
    while not os.path.lexists(p):
        made.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return made


def make_dirs(path) -> list:
    """Create ``path`` and the folders above it that are missing, each a new folder (``os.mkdir``); returns the
    folders made, outermost first. Folders that already exist are used as they are (the caller named them);
    one that appears between the check and the ``mkdir`` must be a plain folder, not a link, or the call is
    refused (GoldenInputError)."""
    path = os.path.abspath(os.fspath(path))
    missing = missing_dirs(path)
    p = os.path.dirname(missing[-1]) if missing else path  # the deepest folder that exists
    if os.path.lexists(p) and p not in missing and not os.path.isdir(p):
        raise GoldenInputError(f"cannot create {path}: {p} exists and is not a folder")
    made = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
            made.append(d)
        except FileExistsError:
            if not lexists_plain_dir(d):
                raise GoldenInputError(f"cannot create {path}: {d} appeared meanwhile and is not a plain folder "
                                       "(a symbolic link?): refusing to write there") from None
    return made


def _replaceable(path: str) -> None:
    """``path`` may be replaced: nothing is there, or a regular file (a link, folder, FIFO ... is refused)."""
    if os.path.lexists(path) and not lexists_plain_file(path):
        raise GoldenInputError(f"refusing to write {path}: it exists and is not a regular file (a symbolic link, "
                               "a folder or a device), so it is neither written through nor replaced")


def check_replaceable(folder, names) -> None:
    """Each ``folder/name`` may be written by :func:`replacing` (``name`` a file name, no folder in it; nothing
    there, or a regular file): what a writer of several files checks for all of them before it writes the first."""
    for n in names:
        if (not isinstance(n, str) or n in ("", ".", "..") or "\0" in n
                or any(sep and sep in n for sep in ("/", os.sep, os.altsep))):
            raise field_error(folder, "file name", n, "must be a plain file name (not '', '.' or '..'; no '/' "
                              "or NUL)")
        _replaceable(os.path.join(os.fspath(folder), n))


@contextlib.contextmanager
def replacing(folder, name: str):
    """A binary file object whose bytes become ``folder/name`` when the block ends without an error.

    ``name`` must be a file name without a folder. What is at ``folder/name`` must be nothing
    or a regular file (checked before and after the block: a symbolic link or anything else is refused, never
    written through). The bytes go to a new file beside it (``O_CREAT | O_EXCL | O_NOFOLLOW``, via
    :func:`create_new`), which is then renamed over ``name`` - a rename replaces the directory entry itself,
    so even a link put there meanwhile is replaced, not followed. On an error the new file is removed and the
    old one is left as it was."""
    check_replaceable(folder, [name])
    path = os.path.join(os.fspath(folder), name)
    tmp = os.path.join(os.fspath(folder), f".qsfa-{secrets.token_hex(8)}.partial")
    f = create_new(tmp)
    try:
        with f:
            yield f
        _replaceable(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


# --------------------------------------------------------------------------------------------------
# .npy headers before data


def _header(fp, where: str):
    """``(shape, fortran_order, dtype)`` from an .npy header (pickled object arrays are refused)."""
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            raise ValueError(f".npy format version {version} is not supported (1.0 and 2.0 are)")
    except (ValueError, EOFError, OSError, SyntaxError, TypeError) as e:
        raise GoldenInputError(f"{where}: not a readable .npy header: {short(str(e))[1:-1]}") from None
    if dtype.hasobject or dtype.itemsize == 0:
        raise GoldenInputError(f"{where}: Invalid dtype for .npy header, actual: {dtype.str}, "
                               "reason: object and zero-size dtypes are not arrays of numbers.")
    return tuple(int(d) for d in shape), fortran, dtype


def _check_declared(where: str, shape, dtype, expect_shape, expect_itemsize, what) -> int:
    of = f" ({what})" if what else ""
    nbytes = declared_nbytes(shape, dtype.itemsize)
    if expect_shape is not None and tuple(shape) != tuple(expect_shape):
        raise GoldenInputError(f"{where}: Invalid shape for .npy header, actual: {list(shape)}, "
                               f"reason: expected {list(expect_shape)}{of}.")
    if expect_itemsize is not None and dtype.itemsize != expect_itemsize:
        raise GoldenInputError(f"{where}: Invalid dtype for .npy header, actual: {dtype.name} ({dtype.str}), "
                               f"reason: expected {expect_itemsize}-byte elements{of}.")
    cap = max_array_bytes()
    if nbytes > cap:
        raise GoldenInputError(f"{where}: Invalid shape for .npy header, actual: {list(shape)}, "
                               f"reason: {nbytes} bytes exceed the cap of {cap} (QSFA_GOLDEN_MAX_BYTES).")
    return nbytes


def _fill(fp, shape, fortran: bool, dtype: np.dtype, where: str) -> np.ndarray:
    count = declared_nbytes(shape, 1)
    a = np.empty(count, dtype=dtype)
    buf = memoryview(a.view(np.uint8).reshape(-1)) if a.size else memoryview(b"")
    got = 0
    while got < len(buf):
        chunk = fp.read(min(len(buf) - got, 1 << 24))
        if not chunk:
            raise GoldenInputError(f"{where}: the data ends after {got} of {len(buf)} bytes")
        buf[got:got + len(chunk)] = chunk
        got += len(chunk)
    if fp.read(1):
        raise GoldenInputError(f"{where}: more data than its header declares")
    return a.reshape(shape, order="F" if fortran else "C")


def read_npy(path, *, shape=None, itemsize=None, where=None, what=None) -> np.ndarray:
    """An .npy file, judged from its header first (shape, element size, cap, file size); ``what`` names
    the expectation in errors (e.g. "the golden case/out.y")."""
    where = where or os.fspath(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise GoldenInputError(f"file not found: {where}") from None
    except OSError as e:
        raise GoldenInputError(f"cannot open {where}: {e.strerror}") from None
    with f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise GoldenInputError(f"{where} is not a regular file")
        hshape, fortran, dtype = _header(f, where)
        nbytes = _check_declared(where, hshape, dtype, shape, itemsize, what)
        size = os.fstat(f.fileno()).st_size
        if size != f.tell() + nbytes:
            raise GoldenInputError(f"{where}: {size} bytes, but its header declares {f.tell()} + {nbytes}")
        try:
            return _fill(f, hshape, fortran, dtype, where)
        except OSError as e:
            raise GoldenInputError(f"cannot read {where}: {e}") from None


def read_npz_member(path, key: str, *, shape=None, itemsize=None, what=None) -> np.ndarray:
    """Member ``key`` (``key.npy``) of an .npz, judged from the zip entry and its .npy header before
    anything is inflated beyond the header."""
    return _npz_member(path, key, shape, itemsize, what, data=True)


def check_npz_member(path, key: str, *, shape=None, itemsize=None, what=None) -> tuple:
    """The checks of :func:`read_npz_member` without reading the data: ``(shape, dtype)`` of the member."""
    return _npz_member(path, key, shape, itemsize, what, data=False)


def _npz_member(path, key, shape, itemsize, what, data: bool):
    where = f"{os.fspath(path)}:{key}"
    try:
        with zipfile.ZipFile(path) as zf:
            try:
                info = zf.getinfo(f"{key}.npy")
            except KeyError:
                raise GoldenInputError(f"{path} has no array {key!r}") from None
            if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                raise GoldenInputError(f"{where}: Invalid zip entry for compression, actual: {info.compress_type}, "
                                       "reason: only stored and deflated members are read.")
            if info.file_size > MAX_INFLATE_RATIO * max(info.compress_size, 1):
                raise GoldenInputError(
                    f"{where}: Invalid zip entry for uncompressed size, actual: {info.file_size}, reason: more "
                    f"than {MAX_INFLATE_RATIO} x its {info.compress_size} compressed bytes (a zip bomb or a "
                    "lying header).")
            with zf.open(info) as fp:
                hshape, fortran, dtype = _header(fp, where)
                nbytes = _check_declared(where, hshape, dtype, shape, itemsize, what)
                head = fp.tell()
                if info.file_size != head + nbytes:
                    raise GoldenInputError(f"{where}: the zip entry declares {info.file_size} bytes, its .npy "
                                           f"header {head} + {nbytes}")
                if not data:
                    return hshape, dtype
                return _fill(fp, hshape, fortran, dtype, where)
    except (OSError, zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as e:
        # RuntimeError: an encrypted member; zlib.error: corrupt deflate data
        raise GoldenInputError(f"cannot read {path} as .npz: {short(str(e))[1:-1]}") from None
