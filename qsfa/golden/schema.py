"""The structure of ``manifest.json`` (``qsfa-golden/1``), checked field by field before anything uses it.

Every golden command reads a manifest through :func:`check_manifest`, so a manifest that is not one
``qsfa golden generate`` could have written is refused with one line naming the file and the field
(``<manifest>: Invalid manifest field for cases[2].arrays[0].shape, actual: [-1], reason: ...``) instead
of a ``TypeError`` later, a read outside the directory, or - worst - ``generate`` deleting what it lists.

What is enforced (see ``docs/golden.md`` for the meaning of the fields):

* case ``name``: a single path component ``[A-Za-z0-9][A-Za-z0-9._-]*``, unique, not ``manifest.json``;
* ``files``: keys exactly ``<case>/case.json``, ``<case>/arrays.npz`` or ``<case>/<in|out|mask>.<array>.bin``
  (what generate writes: nothing else can ever be deleted on regeneration), values ``{sha256, bytes}``;
* arrays: ``role`` input/output/mask, ``name`` an identifier, ``shape`` non-negative integers (not
  booleans) whose byte size fits the cap (:func:`qsfa.golden.guard.max_array_bytes`, so nothing
  overflows int64), ``dtype`` one of the golden storage table, ``storage`` the storage dtype of that
  dtype, ``file`` / ``key`` the ones generate writes for the role and name, ``nbytes`` consistent;
* the optional descriptive fields have their JSON types.

Unknown fields are ignored (a newer qsfa may add some); missing required ones are refused.
"""

from __future__ import annotations

import re

from . import io as gio
from .guard import check_component, declared_nbytes, field_error, max_array_bytes
from .io import GoldenInputError
from ..reference.formats import FORMAT_NAMES

__all__ = ["check_manifest", "check_shape", "check_dtype", "ARRAY_NAME", "ROLE_PREFIX", "WRITTEN_NAME"]

GOLDEN_FORMAT = "qsfa-golden/1"
FILE_FORMATS = ("bin", "npz")
ROLE_PREFIX = {"input": "in", "output": "out", "mask": "mask"}
ARRAY_NAME = re.compile(r"^[A-Za-z0-9_]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: the names of the files generate writes in a case folder
WRITTEN_NAME = _LEAF = re.compile(r"^(case\.json|arrays\.npz|(in|out|mask)\.[A-Za-z0-9_]+\.bin)$")
_MANIFEST = "manifest.json"
_INT64_MAX = (1 << 63) - 1


def _err(path, field, value, reason):
    return field_error(path, field, value, reason, kind="manifest field")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(d: dict, key: str, path, where: str):
    if key not in d:
        raise _err(path, f"{where}.{key}" if where else key, None, "required field is missing")
    return d[key]


def _typed(v, types, path, field, what: str, *, none: bool = False):
    if v is None and none:
        return v
    if not isinstance(v, types):
        raise _err(path, field, v, f"must be {what}, not {type(v).__name__}")
    return v


def check_dtype(v, path, field: str, kind: str = "manifest field") -> str:
    """A logical dtype name of the golden storage table (``qsfa.golden.io``)."""
    if not isinstance(v, str):
        raise field_error(path, field, v, f"must be a dtype name string, not {type(v).__name__}", kind)
    try:
        gio.storage_dtype(v)
        gio.logical_dtype(v)
    except (GoldenInputError, TypeError, ValueError):
        raise field_error(path, field, v, "not a dtype of the golden storage table (bool, (u)int8..64, "
                          "float16/32/64, bfloat16, float8_e4m3fn, float8_e5m2, ...)", kind) from None
    return v


def check_shape(v, itemsize: int, path, field: str, kind: str = "manifest field") -> list:
    """A list of non-negative Python integers (not booleans) whose byte size is within the cap."""
    if not isinstance(v, list):
        raise field_error(path, field, v, f"must be a list of integers, not {type(v).__name__}", kind)
    for i, d in enumerate(v):
        if not _is_int(d):
            raise field_error(path, f"{field}[{i}]", d, f"must be an integer, not {type(d).__name__}", kind)
        if d < 0 or d > _INT64_MAX:
            raise field_error(path, f"{field}[{i}]", d, "must be in [0, 2**63)", kind)
    nbytes = declared_nbytes(v, itemsize)
    cap = max_array_bytes()
    if nbytes > cap:
        raise field_error(path, field, v, f"{nbytes} bytes (int64 holds at most {_INT64_MAX}) exceed the cap "
                          f"of {cap} bytes per array (QSFA_GOLDEN_MAX_BYTES)", kind)
    return v


def _check_array(e, c_name: str, files: dict, file_format, path, where: str) -> None:
    _typed(e, dict, path, where, "an object")
    role = _need(e, "role", path, where)
    if not isinstance(role, str) or role not in ROLE_PREFIX:
        raise _err(path, f"{where}.role", role, f"must be one of {sorted(ROLE_PREFIX)}")
    name = _typed(_need(e, "name", path, where), str, path, f"{where}.name", "a string")
    if not ARRAY_NAME.match(name):
        raise _err(path, f"{where}.name", name, "must be an identifier [A-Za-z0-9_]+")
    dtype = check_dtype(_need(e, "dtype", path, where), path, f"{where}.dtype")
    st = gio.storage_dtype(dtype)
    storage = _need(e, "storage", path, where)
    if storage != st.str:
        raise _err(path, f"{where}.storage", storage, f"the storage of {dtype} is {st.str!r}")
    shape = check_shape(_need(e, "shape", path, where), st.itemsize, path, f"{where}.shape")
    if "nbytes" in e and (not _is_int(e["nbytes"]) or e["nbytes"] != declared_nbytes(shape, st.itemsize)):
        raise _err(path, f"{where}.nbytes", e["nbytes"], f"shape {shape} of {st.str} holds "
                   f"{declared_nbytes(shape, st.itemsize)} bytes")
    sha = _need(e, "sha256", path, where)
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise _err(path, f"{where}.sha256", sha, "must be 64 lowercase hex digits")
    f = _typed(_need(e, "file", path, where), str, path, f"{where}.file", "a string")
    key = e.get("key")
    stem = f"{ROLE_PREFIX[role]}.{name}"
    if key is None:
        want = f"{c_name}/{stem}.bin"
    else:
        if key != stem:
            raise _err(path, f"{where}.key", key, f"the {role} {name!r} is the member {stem!r}")
        want = f"{c_name}/arrays.npz"
    if file_format is not None and (key is None) != (file_format == "bin"):
        raise _err(path, f"{where}.key", key, f"file_format {file_format!r} "
                   + ("has no npz keys" if file_format == "bin" else "needs the npz member key"))
    if f != want:
        raise _err(path, f"{where}.file", f, f"the {role} {name!r} of case {c_name!r} is {want!r}")
    if f not in files:
        raise _err(path, f"{where}.file", f, "is not listed in the case's files")
    for k in ("format", "compare"):
        _typed(e.get(k), str, path, f"{where}.{k}", "a string or null", none=True)
    if e.get("compare") not in (None, "bytes", "float"):
        raise _err(path, f"{where}.compare", e["compare"], "must be 'bytes' or 'float'")
    if e.get("format") is not None and e["format"] not in FORMAT_NAMES:  # compare / verify decode codes by it
        raise _err(path, f"{where}.format", e["format"], f"must be null or a qsfa.formats name, one of "
                   f"{list(FORMAT_NAMES)}")
    _typed(e.get("layout", ""), str, path, f"{where}.layout", "a string")
    if "masked" in e:
        _typed(e["masked"], bool, path, f"{where}.masked", "true or false")
    segs = e.get("segments")
    if segs is not None:
        _typed(segs, list, path, f"{where}.segments", "a list")
        for i, s in enumerate(segs):
            ok = (isinstance(s, list) and len(s) == 4 and _is_int(s[0]) and _is_int(s[1])
                  and 0 <= s[0] <= s[1] <= (shape[-1] if shape else 1) and isinstance(s[2], str) and isinstance(s[3], str))
            if not ok:
                raise _err(path, f"{where}.segments[{i}]", s, "must be [start, end, kind, label] with "
                           "0 <= start <= end <= the last dimension")


def _check_case(c, i: int, path, file_format, seen: set) -> None:
    where = f"cases[{i}]"
    _typed(c, dict, path, where, "an object")
    name = check_component(_need(c, "name", path, where), path, f"{where}.name", kind="manifest field")
    if name == _MANIFEST:
        raise _err(path, f"{where}.name", name, f"{_MANIFEST} is the manifest's own name")
    if name in seen:
        raise _err(path, f"{where}.name", name, "another case has this name")
    seen.add(name)
    op = _need(c, "op", path, where)
    if not isinstance(op, str) or not op:
        raise _err(path, f"{where}.op", op, "must be a non-empty string")
    files = _typed(_need(c, "files", path, where), dict, path, f"{where}.files", "an object")
    for rel, info in files.items():
        fw = f"{where}.files[{rel!r}]"
        parts = rel.split("/")
        if len(parts) != 2 or parts[0] != name or not _LEAF.match(parts[1]):
            raise _err(path, f"{where}.files", rel, f"a file of case {name!r} is {name}/case.json, "
                       f"{name}/arrays.npz or {name}/<in|out|mask>.<array>.bin")
        _typed(info, dict, path, fw, "an object {sha256, bytes}")
        sha = info.get("sha256")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise _err(path, f"{fw}.sha256", sha, "must be 64 lowercase hex digits")
        b = info.get("bytes")
        if not _is_int(b) or not 0 <= b <= _INT64_MAX:
            raise _err(path, f"{fw}.bytes", b, "must be an integer in [0, 2**63)")
    arrays = _typed(_need(c, "arrays", path, where), list, path, f"{where}.arrays", "a list")
    pairs = set()
    in_npz: dict = {}  # npz file -> bytes its members' data need
    for j, e in enumerate(arrays):
        aw = f"{where}.arrays[{j}]"
        _check_array(e, name, files, file_format, path, aw)
        if (e["role"], e["name"]) in pairs:
            raise _err(path, f"{aw}.name", e["name"], f"a second {e['role']} of that name")
        pairs.add((e["role"], e["name"]))
        # the declared shape must fit the file the manifest lists for it (its size is checked against the disk)
        need = declared_nbytes(e["shape"], gio.storage_dtype(e["dtype"]).itemsize)
        if e.get("key") is None:
            have = files[e["file"]]["bytes"]
            if need != have:
                raise _err(path, f"{aw}.shape", e["shape"], f"{need} bytes of {e['storage']}, but its file "
                           f"{e['file']} is listed with {have} bytes")
        else:
            in_npz[e["file"]] = in_npz.get(e["file"], 0) + need
    for f, need in in_npz.items():
        if need > files[f]["bytes"]:
            raise _err(path, f"{where}.files[{f!r}].bytes", files[f]["bytes"], f"its arrays' data alone need "
                       f"{need} bytes")
    if "params" in c:
        _typed(c["params"], dict, path, f"{where}.params", "an object", none=True)
    if "call" in c:
        _typed(c["call"], dict, path, f"{where}.call", "an object", none=True)
    if "seed" in c and not (_is_int(c["seed"]) and 0 <= c["seed"] <= _INT64_MAX):
        raise _err(path, f"{where}.seed", c["seed"], "must be an integer in [0, 2**63)")
    _typed(c.get("generator"), str, path, f"{where}.generator", "a string or null", none=True)
    from ..chips import CHIPS

    chip = _typed(c.get("chip"), str, path, f"{where}.chip", "a chip name or null", none=True)
    if chip is not None and chip not in CHIPS:
        raise _err(path, f"{where}.chip", chip, f"must be one of {list(CHIPS)} (the chip whose numerics the "
                   "outputs model) or null")
    pchip = (c.get("params") or {}).get("chip")
    if pchip is not None and pchip not in CHIPS:
        raise _err(path, f"{where}.params.chip", pchip, f"must be one of {list(CHIPS)} or null (--chip)")
    _typed(c.get("description", ""), str, path, f"{where}.description", "a string")


def check_manifest(man, path) -> dict:
    """``man`` (parsed from ``path``) if it is a well-formed ``qsfa-golden/1`` manifest; else one-line
    :class:`GoldenInputError` naming ``path`` and the field."""
    _typed(man, dict, path, "(top level)", "an object")
    fmt = man.get("format")
    if fmt != GOLDEN_FORMAT:
        raise _err(path, "format", fmt, f"must be {GOLDEN_FORMAT!r}")
    file_format = man.get("file_format")
    if file_format is not None and file_format not in FILE_FORMATS:
        raise _err(path, "file_format", file_format, f"must be one of {FILE_FORMATS}")
    if man.get("byte_order", "little") != "little":
        raise _err(path, "byte_order", man["byte_order"], "must be 'little'")
    _typed(man.get("set"), str, path, "set", "a string or null", none=True)
    _typed(man.get("qsfa_version", ""), str, path, "qsfa_version", "a string")
    shard = man.get("shard")
    if shard is not None:
        _typed(shard, dict, path, "shard", "an object {index, count}")
        i, n = shard.get("index"), shard.get("count")
        for k, v in (("index", i), ("count", n)):
            if not _is_int(v):
                raise _err(path, f"shard.{k}", v, "must be an integer")
        if not 0 <= i < n:
            raise _err(path, "shard", shard, "needs 0 <= index < count")
    skipped = man.get("skipped", [])
    _typed(skipped, list, path, "skipped", "a list")
    for i, s in enumerate(skipped):
        _typed(s, dict, path, f"skipped[{i}]", "an object")
        for k in ("name", "op", "reason"):
            _typed(s.get(k), str, path, f"skipped[{i}].{k}", "a string")
    cases = _typed(_need(man, "cases", path, ""), list, path, "cases", "a list")
    seen: set = set()
    for i, c in enumerate(cases):
        _check_case(c, i, path, file_format, seen)
    return man
