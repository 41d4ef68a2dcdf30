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

A run writes into ``OUT/.qsfa-staging-*`` and swaps the new set in only when every case is written
(:func:`generate`): a failed or interrupted run leaves the previous set in ``OUT`` as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from . import io as gio
from .case import Case, available_ops
from .._errors import InvalidArgument, InvalidDtype
from .guard import (check_component, create_new, describe_path, is_inside, lexists_plain_dir, lexists_plain_file,
                    missing_dirs)
from .io import GoldenInputError
from .meta import describe
from .schema import ARRAY_NAME, WRITTEN_NAME, check_manifest
from ..chips import chip_violation, resolve_chip

__all__ = ["MANIFEST", "GOLDEN_FORMAT", "STAGING_PREFIX", "generate", "load_manifest", "load_array",
           "case_from_entry", "Progress", "select_shard", "parse_shard", "plural"]

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


#: the folder a run writes its new set into, inside ``--out`` (a name no case can have: case names start
#: with a letter or digit), swapped in only once every case is written
STAGING_PREFIX = ".qsfa-staging-"
#: where the swap parks the previous set's files until the new manifest is in place (removed after)
REPLACED_PREFIX = ".qsfa-replaced-"


@dataclass
class _OldSet:
    """The previous golden set found in ``--out``: what the swap replaces (nothing is deleted before it)."""

    manifest: dict | None = None
    files: list = field(default_factory=list)  # real paths of the listed files that exist (plain, inside)
    dirs: list = field(default_factory=list)  # the listed cases' folders that exist (plain)

    @property
    def case_names(self) -> list:
        return [c["name"] for c in self.manifest["cases"]] if self.manifest else []


def _check_out(out: str, names=()) -> _OldSet:
    """``out`` must be new, empty, or a previous golden directory; nothing is written or deleted here.

    Of a previous golden directory, its (fully checked) manifest's files are what a successful run replaces -
    only regular files (never symbolic links) whose real path is in ``out``. The run is refused when a listed
    path or a case folder of this run is a link or not a regular file / folder, or when a case folder of this
    run holds an unlisted entry with the name of a file generate writes (it would have to be overwritten).
    Other files stay.
    """
    if os.path.lexists(out) and not os.path.isdir(out):
        raise GoldenInputError(f"--out {out} exists and is not a directory")
    if not os.path.isdir(out):
        return _OldSet()
    root = os.path.realpath(out)
    for n in names:  # a case folder of this run must be absent or a plain folder (not a link out)
        d = os.path.join(root, n)
        if os.path.lexists(d) and not lexists_plain_dir(d):
            raise GoldenInputError(f"--out {out}: {n} exists and is not a plain folder (a symbolic link or a "
                                   "file): refusing to write there")
    if not os.listdir(root):
        return _OldSet()
    man_path = os.path.join(root, MANIFEST)
    if not os.path.lexists(man_path):
        raise GoldenInputError(f"--out {out} is not empty and holds no {MANIFEST}: refusing to write there")
    if not lexists_plain_file(man_path):
        raise GoldenInputError(f"--out {out}: {MANIFEST} is not a regular file (a symbolic link?): refusing "
                               "to write there")
    man = load_manifest(root)
    old = _OldSet(man)
    for c in man["cases"]:
        d = os.path.join(root, c["name"])
        if not os.path.lexists(d):
            continue
        if not lexists_plain_dir(d):
            raise GoldenInputError(f"--out {out}: the folder of case {c['name']} is not a plain folder (a "
                                   "symbolic link?): refusing to delete through it")
        old.dirs.append(d)
        for rel in c["files"]:
            p = os.path.join(root, rel)
            if not os.path.lexists(p):
                continue
            if not lexists_plain_file(p) or not is_inside(root, p):
                raise GoldenInputError(f"--out {out}: {rel}, listed in its {MANIFEST}, is not a regular file "
                                       "inside it (a symbolic link?): refusing to delete it")
            old.files.append(p)
    gone = set(old.files)
    for n in names:  # what this run writes must not land on a file no manifest lists
        d = os.path.join(root, n)
        if not lexists_plain_dir(d):
            continue
        for f in os.listdir(d):
            if WRITTEN_NAME.match(f) and os.path.join(d, f) not in gone:
                raise GoldenInputError(f"--out {out}: {n}/{f} is in the way and no earlier {MANIFEST} of it lists "
                                       "it: refusing to overwrite it")
    return old


def _remove_made_dirs(dirs: list) -> None:
    """Remove the folders a failed run created (deepest first), as far as they are empty plain folders."""
    for d in dirs:
        try:
            if lexists_plain_dir(d) and not os.listdir(d):
                os.rmdir(d)
        except OSError:
            return


def _discard(folder: str | None) -> None:
    """Remove a staging or parking folder of this run (its own contents only: links are not followed)."""
    if folder is not None and lexists_plain_dir(folder):
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _interrupts_deferred():
    """Ctrl-C (SIGINT) and SIGTERM wait until the block is done (making the staging folder; the swap: a few
    renames), then take effect as usual. Only in the main thread, where Python runs signal handlers, and only
    for a signal whose handler is still Python's default; elsewhere the block's own roll-back is what keeps
    the previous set."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    saved, caught = {}, []
    try:
        for s, default in defaults.items():
            if signal.getsignal(s) is default:
                saved[s] = signal.signal(s, lambda num, frame: caught.append(num))
    except (ValueError, OSError):  # not settable here: restore what was changed and do without
        for s, h in saved.items():
            signal.signal(s, h)
        saved = {}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    if signal.SIGTERM in caught:
        signal.raise_signal(signal.SIGTERM)  # terminate as the signal would have
    if signal.SIGINT in caught:
        raise KeyboardInterrupt


def _swap_in(root: str, staging: str, old: _OldSet, entries: list) -> None:
    """Replace the previous set in ``root`` by the one written in ``staging`` (manifest last).

    The previous set's listed files are parked in a folder of ``root`` first, then the new files are moved
    into place and the new manifest replaces the old one in one rename: the moment the new set exists. Any
    error or interrupt before that moves everything back; after it, the parked files are removed, with the
    previous cases' folders that became empty.
    """
    parked, placed, made_dirs, park = [], [], [], None
    try:
        if old.files:
            park = tempfile.mkdtemp(prefix=REPLACED_PREFIX, dir=root)
            for i, p in enumerate(old.files):
                if not lexists_plain_file(p):
                    raise GoldenInputError(f"{p} changed while the new set was computed (it is no longer a "
                                           "regular file): refusing to replace it")
                q = os.path.join(park, str(i))
                os.rename(p, q)
                parked.append((p, q))
        for e in entries:
            folder = os.path.join(root, e["name"])
            if not os.path.lexists(folder):
                os.mkdir(folder)
                made_dirs.append(folder)
            elif not lexists_plain_dir(folder):
                raise GoldenInputError(f"{folder} is not a plain folder (a symbolic link?): refusing to write there")
            for rel in e["files"]:
                dst = os.path.join(root, rel)
                if os.path.lexists(dst):
                    raise GoldenInputError(f"refusing to overwrite {dst}: it appeared while the new set was "
                                           f"computed and no earlier {MANIFEST} lists it")
                os.rename(os.path.join(staging, rel), dst)
                placed.append(dst)
        os.replace(os.path.join(staging, MANIFEST), os.path.join(root, MANIFEST))
    except BaseException:
        for dst in reversed(placed):
            with contextlib.suppress(OSError):
                os.remove(dst)
        for d in reversed(made_dirs):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        for p, q in reversed(parked):
            with contextlib.suppress(OSError):
                os.rename(q, p)
        _discard(park)
        raise
    _discard(park)
    for d in old.dirs:
        with contextlib.suppress(OSError):
            if lexists_plain_dir(d) and not os.listdir(d):
                os.rmdir(d)


def _remove_partial(out: str, made: list, created: bool):
    """Undo a generate run that failed half way: remove exactly the files and folders it made."""
    for p in reversed(made):
        if lexists_plain_file(p):
            os.remove(p)
        elif lexists_plain_dir(p) and not os.listdir(p):
            os.rmdir(p)
    if created and lexists_plain_dir(out) and not os.listdir(out):
        os.rmdir(out)


def _check_array_name(case: str, name: str):
    if not isinstance(name, str) or not ARRAY_NAME.match(name):
        raise GoldenInputError(f"case {case}: array name {name!r} is not a plain identifier")


def _new_file(made: list, path: str):
    """A new file for writing (never an existing one or a link), remembered for :func:`_remove_partial`."""
    f = create_new(path)
    made.append(path)
    return f


def _case_folder(out: str, name: str, made: list) -> str:
    """``out/name``: made now (and remembered), or an existing plain folder - never a link."""
    check_component(name, out, "case name", kind="case folder")
    folder = os.path.join(out, name)
    if not os.path.lexists(folder):
        os.mkdir(folder)
        made.append(folder)
    elif not lexists_plain_dir(folder):
        raise GoldenInputError(f"{folder} is not a plain folder (a symbolic link?): refusing to write there")
    return folder


def write_case_files(out: str, files: dict, made: list) -> None:
    """Write ``{"<case>/<file>": bytes}`` under ``out`` as generate writes its own files: only the names
    generate writes, each a new file in a plain case folder, all remembered in ``made`` (for
    :func:`_remove_partial`). Used for files computed elsewhere (``qsfa.distributed``)."""
    for rel, data in files.items():
        parts = rel.split("/") if isinstance(rel, str) else []
        if len(parts) != 2 or not WRITTEN_NAME.match(parts[1]):
            raise GoldenInputError(f"{out}: refusing to write {rel!r}: not a file name generate writes")
        folder = _case_folder(out, parts[0], made)
        with _new_file(made, os.path.join(folder, parts[1])) as f:
            f.write(data)


def _write_case(case: Case, out: str, file_format: str, inputs: dict | None = None,
                outputs: dict | None = None, made: list | None = None) -> dict:
    """Write one case's files under ``out``; returns its manifest entry. ``inputs`` / ``outputs``: already
    computed (``qsfa.distributed`` assembles attention outputs from row ranges), else computed here.
    Every file and folder made is appended to ``made``."""
    if inputs is None:
        inputs = case.inputs()
    args = case.args(inputs)
    chip = resolve_chip(case.op, **args)  # the chip whose numerics the outputs model (qsfa.chips)
    if args.get("chip") is None:  # a golden is some chip's: a call that chip cannot make is not one
        bad = chip_violation(case.op, **{**args, "chip": chip})
        if bad is not None:
            raise GoldenInputError(f"case {case.name}: no chip runs this call, so it makes no golden: it models "
                                   f"chip {chip!r} (qsfa.resolve_chip), which refuses it: {str(bad).rstrip('.')} "
                                   f"(change the parameters, or pass a chip)")
    if outputs is None:
        outputs = case.run("reference", inputs)
    metas = describe(case.op, case.params, args, outputs)
    made = [] if made is None else made
    _case_folder(out, case.name, made)

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
            with _new_file(made, os.path.join(out, rel)) as f:
                f.write(gio.storage_bytes(st))
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
        with _new_file(made, path) as f:
            gio.write_npz(f, members)
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
    with _new_file(made, os.path.join(out, rel)) as f:
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
        text = str(e)
        # the case's own checks already name it ("case NAME: ..."): not twice
        return GoldenInputError(text if text.startswith(f"case {case.name}: ") else f"case {case.name}: {text}")
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
    except Exception as e:  # noqa: BLE001 - an invalid case fails in the run itself, with its own message
        # a layer chain's link case: the chip refused a link (or its input making) on the way
        from ..chain import chip_limited

        return f"chip {chip}: {e}" if case.generator == "chain-link" and chip_limited(e) else ""
    return f"chip {chip}: {err}" if err is not None else ""


def plural(n: int, word: str) -> str:
    """``1 case``, ``2 cases``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _nothing_to_generate(cases: list, skipped: list, out: str) -> GoldenInputError:
    """The error of a run none of whose cases can be written (the previous set stays as it was)."""
    if not cases:
        return GoldenInputError(f"nothing to generate: no cases selected; {out} was left as it was")
    chip = [s for s in skipped if s["reason"].startswith("chip ")]
    ops = [s for s in skipped if not s["reason"].startswith("chip ")]
    why = []
    if chip:
        why.append(f"{len(chip)} beyond the chip's limits, first {chip[0]['name']}: {chip[0]['reason']}")
    if ops:
        why.append(f"{len(ops)} needing an operator missing from this build, first {ops[0]['name']}: "
                   f"{ops[0]['reason']}")
    return GoldenInputError(f"nothing to generate: all {plural(len(cases), 'selected case')} were skipped "
                            f"({'; '.join(why)}); {out} was left as it was")


def generate(cases: Iterable[Case], out: str, *, file_format: str = "bin", set_name: str | None = None,
             shard: tuple[int, int] = (0, 1), progress: bool = True, stream=None, executor=None,
             replaced: dict | None = None) -> dict:
    """Run every case on the reference backend and write inputs, outputs and ``manifest.json``.

    The new set is written into a staging folder inside ``out`` (``.qsfa-staging-*``) and swapped in only
    when every case is written: until then the previous set in ``out`` (the files its manifest lists) is
    untouched, and an error, an interrupt or a run with nothing to write leaves it exactly as it was (the
    staging folder removed). Case files may read their inputs from ``out`` itself.

    Cases whose operator is not in this build of qsfa, or that the ``--chip`` cannot run, are skipped and
    listed under ``"skipped"``; when no case is left, :class:`GoldenInputError` (nothing is written).
    ``executor(cases, staging, file_format, made=made, out=out) -> entries`` (optional) writes the cases' files
    into ``staging`` (with :func:`write_case_files` / ``_write_case(..., made=made)``) and returns their
    manifest entries in case order, instead of the loop here (``qsfa.distributed.GoldenExecutor``: a Dask
    cluster computes, this process writes); ``out`` is the destination, for its messages. ``replaced``
    (optional) receives ``{"set": ..., "cases": [...]}``: the previous set's name and its cases this run
    removed (those it does not write again). Returns the manifest.
    """
    from .. import __version__

    if file_format not in FILE_FORMATS:
        raise GoldenInputError(f"--format must be one of {FILE_FORMATS}, got {file_format!r}")
    cases = list(cases)
    names = [c.name for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GoldenInputError(f"duplicate case names {dup}")
    bad = sorted({n for n in names if n == MANIFEST})
    if bad:
        raise GoldenInputError(f"a case may not be named {MANIFEST}")
    ops = available_ops()
    run_cases = [c for c in cases if c.op in ops]
    skipped = [{"name": c.name, "op": c.op, "reason": f"operator {c.op!r} is not in this build of qsfa"}
               for c in cases if c.op not in ops]
    beyond = {c.name: why for c in run_cases if (why := _beyond_chip(c))}  # --chip: cases that chip cannot run
    skipped += [{"name": c.name, "op": c.op, "reason": beyond[c.name]} for c in run_cases if c.name in beyond]
    run_cases = [c for c in run_cases if c.name not in beyond]
    if not run_cases:
        raise _nothing_to_generate(cases, skipped, out)
    old = _check_out(out, [c.name for c in run_cases])  # every refusal comes before anything is written
    created = missing_dirs(out)
    made: list = []
    staging = None
    bar = Progress(len(run_cases), "generate", enabled=progress and len(run_cases) > 1 and executor is None,
                   stream=stream)
    try:
        with _interrupts_deferred():  # what is made here is known to the clean-up below before Ctrl-C can land
            if created:
                os.makedirs(out)
            root = os.path.realpath(out)
            staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root)
        if executor is not None:
            entries = list(executor(run_cases, staging, file_format, made=made, out=out))
        else:
            entries = []
            for c in run_cases:
                bar.step(c.name)
                try:
                    entries.append(_write_case(c, staging, file_format, made=made))
                except Exception as e:
                    raise case_error(c, e) from e
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
        from .chain import chain_records

        chains = chain_records(entries)  # a layer chain's edges (docs/golden.md#chains); absent otherwise
        if chains:
            manifest["chains"] = chains
        with create_new(os.path.join(staging, MANIFEST)) as f:
            f.write(gio.dump_json(manifest).encode("utf-8"))
        with _interrupts_deferred():
            _swap_in(root, staging, old, entries)
    except BaseException:
        _discard(staging)
        _remove_made_dirs(created)
        raise
    _discard(staging)
    if replaced is not None:
        new = {e["name"] for e in entries}
        replaced.clear()
        replaced.update({"set": (old.manifest or {}).get("set"),
                         "cases": [n for n in old.case_names if n not in new]})
    return manifest


# --------------------------------------------------------------------------------------------------
# reading


def load_manifest(folder: str) -> dict:
    """The manifest of a golden directory, structurally checked (a clear error otherwise)."""
    if not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise GoldenInputError(f"{folder} is {describe_path(folder)}, not a golden directory")
        raise GoldenInputError(f"golden directory not found: {folder}")
    path = os.path.join(folder, MANIFEST)
    if not os.path.lexists(path):
        raise GoldenInputError(f"{folder} has no {MANIFEST}: not a golden directory")
    if not os.path.isfile(path):
        raise GoldenInputError(f"{path} is {describe_path(path)}, not a regular file: not a golden directory's "
                               "manifest")
    return check_manifest(gio.load_json(path), path)


def golden_path(folder: str, rel: str) -> str:
    """The path of a manifest-listed file; its real path must be inside the golden directory (a symbolic
    link out of it is refused)."""
    path = os.path.join(folder, rel)
    if not is_inside(os.path.realpath(folder), path):
        raise GoldenInputError(f"{path}: resolves outside the golden directory {folder} (a symbolic link): "
                               "refusing to read it")
    return path


def load_storage(folder: str, entry: dict) -> np.ndarray:
    """The storage array of one manifest entry, checked against its shape and storage dtype (from the
    file's size or .npy header, before its data is read)."""
    path = golden_path(folder, entry["file"])
    st = np.dtype(entry["storage"])
    shape = tuple(entry["shape"])
    if not os.path.isfile(path):
        raise GoldenInputError(f"file not found: {entry['file']}")
    if entry.get("key") is not None:
        raw = gio.read_npz_member(path, entry["key"], shape=shape, itemsize=st.itemsize)
        if raw.dtype != st:
            raise GoldenInputError(
                f"{entry['file']}:{entry['key']} is {raw.dtype.str} {list(raw.shape)}, the manifest says "
                f"{st.str} {list(shape)}")
        return raw
    return gio.read_bin(path, st, shape)


def load_array(folder: str, entry: dict) -> np.ndarray:
    """One array of a golden directory in its logical dtype (bfloat16 as ml_dtypes.bfloat16, ...)."""
    return gio.from_storage(load_storage(folder, entry), entry["dtype"])


def case_from_entry(folder: str, c: dict) -> Case:
    """The case of a manifest entry with its stored inputs as explicit inputs."""
    inputs = {e["name"]: load_array(folder, e) for e in c["arrays"] if e["role"] == "input"}
    return Case(name=c["name"], op=c["op"], params=c.get("params") or {}, seed=c.get("seed", 0),
                generator=c.get("generator"), description=c.get("description", ""), inputs_given=inputs)
