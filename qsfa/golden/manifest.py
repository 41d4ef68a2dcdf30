"""Writing a golden directory (``qsfa golden generate``) and reading it back.

Directory layout (``--format bin``)::

    OUT/manifest.json                 everything below, with a sha256 per file (sorted keys, no dates)
    OUT/<case>/case.json              the case (qsfa-case/1) with its inputs as explicit files: replayable
    OUT/<case>/in.<name>.bin          each input array, raw little-endian bytes in the storage dtype
    OUT/<case>/out.<name>.bin         each output array (in-place buffers: their state after the call)
    OUT/<case>/mask.<name>.bin        uint8 0/1, only where an output has unspecified elements (1 = compared)

With ``--format npz`` the arrays of a case are the members ``in.<name>``, ``out.<name>``, ``mask.<name>``
of one ``OUT/<case>/arrays.npz``. The same case gives the same bytes on every machine (see
:mod:`qsfa.golden.io`); shapes, dtypes and layouts are in the manifest, so
``numpy.fromfile(OUT/<file>, dtype=entry["storage"]).reshape(entry["shape"])`` reads any ``bin`` file.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Sequence

import numpy as np

from . import io as gio
from .case import Case, available_ops
from .._errors import InvalidArgument, InvalidDtype
from .io import GoldenInputError
from .meta import describe
from ..chips import resolve_chip

__all__ = ["MANIFEST", "GOLDEN_FORMAT", "generate", "load_manifest", "load_array", "case_from_entry",
           "Progress", "select_shard", "parse_shard"]

MANIFEST = "manifest.json"
GOLDEN_FORMAT = "qsfa-golden/1"
FILE_FORMATS = ("bin", "npz")
_ROLE_PREFIX = {"input": "in", "output": "out", "mask": "mask"}


class Progress:
    """A one-line progress display on stderr (rewritten in place on a terminal, one line per step
    otherwise); silent when ``enabled`` is False."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.total, self.label, self.enabled = total, label, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.n = 0

    def step(self, what: str):
        self.n += 1
        if not self.enabled:
            return
        msg = f"{self.label} [{self.n}/{self.total}] {what}"
        if self.tty:
            self.stream.write("\r\033[K" + msg)
            if self.n == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(msg + "\n")
        self.stream.flush()


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n) -> ``(i, n)``; None -> ``(0, 1)``."""
    if text is None:
        return 0, 1
    try:
        i, n = (int(p) for p in str(text).split("/"))
    except ValueError:
        raise GoldenInputError(f"--shard must look like i/n (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise GoldenInputError(f"--shard {text}: need 0 <= i < n")
    return i, n


def select_shard(cases: Sequence[Case], index: int, count: int) -> list[Case]:
    """Case k of the set belongs to shard ``k % count`` (stable across machines and runs)."""
    return [c for k, c in enumerate(cases) if k % count == index]


def _prepare_out(out: str):
    """``out`` must be new, empty, or a previous golden directory (whose listed files are removed)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise GoldenInputError(f"--out {out} exists and is not a directory")
    if not os.path.isdir(out):
        os.makedirs(out)
        return
    entries = os.listdir(out)
    if not entries:
        return
    man_path = os.path.join(out, MANIFEST)
    if not os.path.isfile(man_path):
        raise GoldenInputError(f"--out {out} is not empty and holds no {MANIFEST}: refusing to write there")
    man = load_manifest(out)
    for c in man["cases"]:
        for rel in c["files"]:
            p = os.path.join(out, rel)
            if os.path.isfile(p):
                os.remove(p)
        d = os.path.join(out, c["name"])
        if os.path.isdir(d) and not os.listdir(d):
            os.rmdir(d)
    os.remove(man_path)


def _remove_partial(out: str, names, created: bool):
    """Undo a generate run that failed half way: remove its case folders (only files it writes)."""
    for n in names:
        d = os.path.join(out, n)
        if not os.path.isdir(d):
            continue
        for f in os.listdir(d):
            if f == "case.json" or f == "arrays.npz" or f.startswith(("in.", "out.", "mask.")):
                os.remove(os.path.join(d, f))
        if not os.listdir(d):
            os.rmdir(d)
    if created and os.path.isdir(out) and not os.listdir(out):
        os.rmdir(out)


def _check_array_name(case: str, name: str):
    if not name.replace("_", "a").isalnum():
        raise GoldenInputError(f"case {case}: array name {name!r} is not a plain identifier")


def _write_case(case: Case, out: str, file_format: str, inputs: dict | None = None,
                outputs: dict | None = None) -> dict:
    """Write one case's files under ``out``; returns its manifest entry. ``inputs`` / ``outputs``: already
    computed (``qsfa.distributed`` assembles attention outputs from row ranges), else computed here."""
    if inputs is None:
        inputs = case.inputs()
    if outputs is None:
        outputs = case.run("reference", inputs)
    args = case.args(inputs)
    chip = resolve_chip(case.op, **args)  # the chip whose numerics the outputs model (qsfa.chips)
    metas = describe(case.op, case.params, args, outputs)
    folder = os.path.join(out, case.name)
    os.makedirs(folder, exist_ok=True)

    arrays, members, files = [], {}, {}
    mask_items = []
    items = [("input", k, v) for k, v in sorted(inputs.items())] + [("output", k, v) for k, v in sorted(outputs.items())]
    for role, name, _ in items:
        m = metas.get((role, name))
        if role == "output" and m is not None and m.mask is not None:
            mask_items.append(("mask", name, np.asarray(m.mask, bool)))
    for role, name, a in items + mask_items:
        _check_array_name(case.name, name)
        m = metas.get((role, name))
        dt, st = gio.to_storage(a)
        key = f"{_ROLE_PREFIX[role]}.{name}"
        entry = {
            "role": role,
            "name": name,
            "shape": list(a.shape),
            "dtype": dt,
            "storage": st.dtype.str,
            "sha256": gio.array_sha256(st),
            "nbytes": int(st.nbytes),
        }
        if role == "mask":
            entry["layout"] = f"uint8 {list(a.shape)}: 1 where out.{name} is specified and compared, 0 where it is not"
        else:
            entry["layout"] = m.layout if m else ""
            entry["format"] = m.format if m else None
            if m is not None and m.segments:
                entry["segments"] = [list(s) for s in m.segments]
            if role == "output":
                entry["compare"] = m.compare if m else "bytes"
                entry["masked"] = bool(m is not None and m.mask is not None)
        if file_format == "bin":
            rel = f"{case.name}/{key}.bin"
            gio.write_bin(os.path.join(out, rel), st)
            files[rel] = {"sha256": entry["sha256"], "bytes": int(st.nbytes)}
            entry["file"] = rel
        else:
            rel = f"{case.name}/arrays.npz"
            members[key] = st
            entry["file"] = rel
            entry["key"] = key
        arrays.append(entry)

    if file_format == "npz":
        rel = f"{case.name}/arrays.npz"
        path = os.path.join(out, rel)
        gio.write_npz(path, members)
        files[rel] = {"sha256": gio.sha256_file(path), "bytes": os.path.getsize(path)}

    # the replayable case file, inputs pointing at the files just written
    refs = {}
    for e in arrays:
        if e["role"] == "input":
            r = {"file": os.path.basename(e["file"]), "dtype": e["dtype"], "shape": e["shape"], "sha256": e["sha256"]}
            if "key" in e:
                r["key"] = e["key"]
            refs[e["name"]] = r
    text = gio.dump_json(case.to_dict(refs)).encode("utf-8")
    rel = f"{case.name}/case.json"
    with open(os.path.join(out, rel), "wb") as f:
        f.write(text)
    files[rel] = {"sha256": gio.sha256_bytes(text), "bytes": len(text)}

    return {
        "name": case.name,
        "op": case.op,
        "chip": chip,
        "params": case.params,
        "seed": case.seed,
        "generator": case.generator,
        "description": case.description,
        "call": case.call_params(inputs),
        "files": dict(sorted(files.items())),
        "arrays": arrays,
    }


def case_error(case: Case, e: Exception) -> GoldenInputError:
    """The error reported for a case that could not be written: named, the cause's message kept."""
    if isinstance(e, (GoldenInputError, InvalidArgument, InvalidDtype)):
        return GoldenInputError(f"case {case.name}: {e}")
    # a case the operator cannot run
    return GoldenInputError(f"case {case.name}: {case.op} failed: {type(e).__name__}: {e}")


def _beyond_chip(case: Case) -> str:
    """Why the chip a case asks for (``params["chip"]``, from ``--chip``) cannot run it ("" if it can): the first
    chip-limited rule of the operator the case's arguments break for that chip."""
    chip = case.params.get("chip")
    if chip is None:
        return ""
    from ..chips import chip_violation

    try:
        err = chip_violation(case.op, **case.args(case.inputs()))
    except Exception:  # noqa: BLE001 - an invalid case fails in the run itself, with its own message
        return ""
    return f"chip {chip}: {err}" if err is not None else ""


def generate(cases: Iterable[Case], out: str, *, file_format: str = "bin", set_name: str | None = None,
             shard: tuple[int, int] = (0, 1), progress: bool = True, stream=None, executor=None) -> dict:
    """Run every case on the reference backend and write inputs, outputs and ``manifest.json``.

    Cases whose operator is not in this build of qsfa are skipped and listed under ``"skipped"``.
    ``executor(cases, out, file_format) -> entries`` (optional) writes the cases' files and returns their
    manifest entries in case order, instead of the loop here (``qsfa.distributed.golden_executor``: a Dask
    cluster computes, this process writes). Returns the manifest.
    """
    from .. import __version__

    if file_format not in FILE_FORMATS:
        raise GoldenInputError(f"--format must be one of {FILE_FORMATS}, got {file_format!r}")
    cases = list(cases)
    names = [c.name for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GoldenInputError(f"duplicate case names {dup}")
    ops = available_ops()
    run_cases = [c for c in cases if c.op in ops]
    skipped = [{"name": c.name, "op": c.op, "reason": f"operator {c.op!r} is not in this build of qsfa"}
               for c in cases if c.op not in ops]
    beyond = {c.name: why for c in run_cases if (why := _beyond_chip(c))}  # --chip: cases that chip cannot run
    skipped += [{"name": c.name, "op": c.op, "reason": beyond[c.name]} for c in run_cases if c.name in beyond]
    run_cases = [c for c in run_cases if c.name not in beyond]
    created = not os.path.isdir(out)
    _prepare_out(out)
    bar = Progress(len(run_cases), "generate", enabled=progress and len(run_cases) > 1 and executor is None,
                   stream=stream)
    entries = []
    try:
        if executor is not None:
            entries = list(executor(run_cases, out, file_format))
        else:
            for c in run_cases:
                bar.step(c.name)
                try:
                    entries.append(_write_case(c, out, file_format))
                except Exception as e:
                    raise case_error(c, e) from e
    except BaseException:
        _remove_partial(out, [c.name for c in run_cases], created)
        raise
    manifest = {
        "format": GOLDEN_FORMAT,
        "qsfa_version": __version__,
        "byte_order": "little",
        "file_format": file_format,
        "set": set_name,
        "shard": {"index": shard[0], "count": shard[1]},
        "skipped": skipped,
        "cases": entries,
    }
    with open(os.path.join(out, MANIFEST), "w", encoding="utf-8") as f:
        f.write(gio.dump_json(manifest))
    return manifest


# --------------------------------------------------------------------------------------------------
# reading


def load_manifest(folder: str) -> dict:
    """The manifest of a golden directory, structurally checked (a clear error otherwise)."""
    if not os.path.isdir(folder):
        raise GoldenInputError(f"golden directory not found: {folder}")
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise GoldenInputError(f"{folder} has no {MANIFEST}: not a golden directory")
    man = gio.load_json(path)
    if not isinstance(man, dict) or man.get("format") != GOLDEN_FORMAT:
        raise GoldenInputError(f"{path}: format must be {GOLDEN_FORMAT!r}")
    cases = man.get("cases")
    if not isinstance(cases, list):
        raise GoldenInputError(f"{path}: no case list")
    for c in cases:
        if not isinstance(c, dict) or not {"name", "op", "files", "arrays"} <= set(c) \
                or not isinstance(c["files"], dict) or not isinstance(c["arrays"], list):
            raise GoldenInputError(f"{path}: a case entry lacks name/op/files/arrays")
        for rel in c["files"]:
            if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
                raise GoldenInputError(f"{path}: file path {rel!r} leaves the golden directory")
        for e in c["arrays"]:
            if not isinstance(e, dict) or not {"role", "name", "shape", "dtype", "storage", "file", "sha256"} <= set(e):
                raise GoldenInputError(f"{path}: case {c['name']}: an array entry lacks role/name/shape/dtype/storage/file/sha256")
            if not isinstance(e["shape"], list) or not all(isinstance(d, int) and d >= 0 for d in e["shape"]):
                raise GoldenInputError(f"{path}: case {c['name']}: {e['file']} has shape {e['shape']!r}")
            try:
                np.dtype(e["storage"])
            except TypeError:
                raise GoldenInputError(f"{path}: case {c['name']}: {e['file']} has storage {e['storage']!r}") from None
            if e["file"] not in c["files"]:
                raise GoldenInputError(f"{path}: case {c['name']}: {e['file']} is not listed in its files")
    return man


def load_storage(folder: str, entry: dict) -> np.ndarray:
    """The storage array of one manifest entry, checked against its shape and storage dtype."""
    path = os.path.join(folder, entry["file"])
    st = np.dtype(entry["storage"])
    shape = tuple(entry["shape"])
    if entry.get("key") is not None:
        if not os.path.isfile(path):
            raise GoldenInputError(f"file not found: {entry['file']}")
        raw = gio.read_npz_member(path, entry["key"])
        if raw.dtype != st or tuple(raw.shape) != shape:
            raise GoldenInputError(
                f"{entry['file']}:{entry['key']} is {raw.dtype.str} {list(raw.shape)}, the manifest says "
                f"{st.str} {list(shape)}")
        return raw
    if not os.path.isfile(path):
        raise GoldenInputError(f"file not found: {entry['file']}")
    return gio.read_bin(path, st, shape)


def load_array(folder: str, entry: dict) -> np.ndarray:
    """One array of a golden directory in its logical dtype (bfloat16 as ml_dtypes.bfloat16, ...)."""
    return gio.from_storage(load_storage(folder, entry), entry["dtype"])


def case_from_entry(folder: str, c: dict) -> Case:
    """The case of a manifest entry with its stored inputs as explicit inputs."""
    inputs = {e["name"]: load_array(folder, e) for e in c["arrays"] if e["role"] == "input"}
    return Case(name=c["name"], op=c["op"], params=c.get("params") or {}, seed=c.get("seed", 0),
                generator=c.get("generator"), description=c.get("description", ""), inputs_given=inputs)
