"""Hostile inputs for the golden CLI (issue 12, section 4): one scene per attack.

Shared by ``tests/test_golden_attacks.py`` (in process, asserting the refusal) and by the campaign, which
runs every attack as a subprocess against any checkout and classifies what happens::

    python tests/golden_attack_cases.py --root /path/to/a/qsfa/checkout [--python PY]

Classes (as in the issue): **clear** - exit 1 or 2, no traceback, nothing outside the command's folders
changed, nothing of its own folder lost; **traceback** - an uncaught exception; **silent** - exit 0 where the
input had to be refused, anything outside changed, a hang (30 s), a peak RSS over 1.5 GiB (the run is killed
there), or *data loss*: a failed command that removed or changed a file of its own folder (``work/``: a
previous golden set, a case file's inputs) or left a file or folder there (a staging folder). "clear" runs are
also counted as *naming* when their one line holds the file and the field the attack broke.

Every attack runs in a fresh folder ``base`` holding ``work/`` (what the command is pointed at) and
``outside/`` (a sentinel tree the command must never change: compared byte for byte, with mtimes).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

CASE = "dbq-int8-1x128-bf16"  # the template's one case: input x (bf16 [16, 384]), outputs y (int8), scale
TEMPLATE_ARGS = ["generate", "--set", "smoke", "--only", CASE, "-q"]
GIB = 1 << 30


# --------------------------------------------------------------------------------------------------
# scenes


@dataclass
class Replace:
    value: object  # what an edit puts in place of the whole JSON document (a str is written as is)


@dataclass
class Scene:
    base: Path
    template: Path  # a golden directory made by the code under test (bin, one case)

    def __post_init__(self):
        self.work = self.base / "work"
        self.outside = self.base / "outside"
        self.work.mkdir(parents=True)
        o = self.outside
        (o / "victim").mkdir(parents=True)
        (o / "empty_dir").mkdir()
        (o / "empty_dir2").mkdir()
        (o / "keep.txt").write_bytes(b"not yours\n")
        # an outside copy of the case's files (the targets of links), and of its input
        for f in (self.template / CASE).iterdir():
            shutil.copyfile(f, o / "victim" / f.name)
        shutil.copyfile(self.template / CASE / "in.x.bin", o / "data.bin")
        shutil.copyfile(self.template / CASE / "out.y.bin", o / "out.y.bin")

    # -- helpers ----------------------------------------------------------------------------------

    def golden(self, name="g") -> Path:
        g = self.work / name
        shutil.copytree(self.template, g, symlinks=True)
        return g

    @staticmethod
    def manifest(g: Path) -> dict:
        return json.loads((g / "manifest.json").read_text())

    @staticmethod
    def write_manifest(g: Path, man) -> Path:
        p = g / "manifest.json"
        p.write_text(man if isinstance(man, str) else json.dumps(man))
        return p

    def edit_manifest(self, edit: Callable[[dict], object]) -> tuple[Path, Path]:
        """Edit the manifest in place (an edit returning :class:`Replace` replaces it whole)."""
        g = self.golden()
        man = self.manifest(g)
        r = edit(man)
        return g, self.write_manifest(g, r.value if isinstance(r, Replace) else man)

    def case_file(self, edit: Callable[[dict], object] | None = None) -> Path:
        """The template case's own case.json with its input beside it, under work/cases/."""
        d = self.work / "cases"
        d.mkdir(exist_ok=True)
        shutil.copyfile(self.template / CASE / "in.x.bin", d / "in.x.bin")
        c = json.loads((self.template / CASE / "case.json").read_text())
        r = edit(c) if edit else None
        p = d / "c.json"
        p.write_text(r.value if isinstance(r, Replace) else json.dumps(c))
        return p

    def out(self) -> Path:
        return self.work / "out"


def _case(man, i=0) -> dict:
    return man["cases"][i]


def _arr(man, name, role="output") -> dict:
    return next(e for e in man["cases"][0]["arrays"] if e["name"] == name and e["role"] == role)


def snapshot(root: Path) -> dict:
    """Every entry below ``root`` (links not followed): kind, size, mtime, bytes / link target."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                snap[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                snap[rel] = ("file", st.st_size, st.st_mtime_ns, p.read_bytes())
            elif stat.S_ISDIR(st.st_mode):
                snap[rel] = ("dir", st.st_mtime_ns)
            else:
                snap[rel] = ("other", stat.S_IFMT(st.st_mode))
    return snap


# --------------------------------------------------------------------------------------------------
# an .npz bomb: a few MB declaring huge arrays (DEFLATE of zeros, built without 2 GiB in memory)


def _npy_header(descr: str, shape) -> bytes:
    d = "{'descr': %r, 'fortran_order': False, 'shape': (%s), }" % (descr, "".join(f"{s}, " for s in shape))
    n = len(d) + 1
    pad = (-(10 + n)) % 64
    d = d + " " * pad + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(d)) + d.encode("latin1")


def _deflated_zeros(head: bytes, nbytes: int, crc: bool) -> tuple[bytes, int]:
    """Raw DEFLATE of ``head`` + ``nbytes`` zero bytes, and its CRC-32 (0 unless ``crc``)."""
    mib = 1 << 20
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    zeros = bytes(mib)
    seg = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    seg2 = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    assert seg == seg2  # a full flush resets the compressor: every MiB of zeros has the same bytes
    full, rest = divmod(nbytes, mib)
    body = first + seg * full + c.compress(bytes(rest)) + c.flush(zlib.Z_FINISH)
    value = 0
    if crc:
        value = zlib.crc32(head)
        for _ in range(full):
            value = zlib.crc32(zeros, value)
        value = zlib.crc32(bytes(rest), value)
    return body, value


#: whether bombs carry their true CRC-32 (the campaign: a reader checking CRCs late still inflates it all;
#: the tests skip the seconds the CRC of 2 GiB takes - a guarded reader never gets that far)
BOMB_CRC = False


def write_npz_bomb(path: Path, members: dict, crc: bool | None = None) -> int:
    """An .npz whose members ``name -> (descr, shape)`` hold zeros, DEFLATE-compressed; returns its size."""
    crc = BOMB_CRC if crc is None else crc
    out = bytearray()
    central = bytearray()
    for name, (descr, shape) in members.items():
        head = _npy_header(descr, shape)
        n = 1
        for s in shape:
            n *= s
        n *= int(descr[-1])
        body, value = _deflated_zeros(head, n, crc)
        usize = len(head) + n
        fname = f"{name}.npy".encode()
        off = len(out)
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, value, len(body), usize, len(fname), 0)
        out += fname + body
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21, value, len(body), usize,
                               len(fname), 0, 0, 0, 0, 0, off) + fname
    cd_off = len(out)
    out += central
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), cd_off, 0)
    path.write_bytes(bytes(out))
    return len(out)


# --------------------------------------------------------------------------------------------------
# the attacks


@dataclass
class Attack:
    name: str
    group: str  # symlink / traversal / absolute / bomb / deep-json / json-type / overflow / other
    build: Callable[[Scene], tuple[list, tuple]]  # -> (argv after "golden", substrings naming file + field)
    must_fail: bool = True  # exit 0 is a silent wrong result
    memory: bool = False  # measure peak memory (the bomb)
    rc: int = 2  # the exit status of a refusal (1: a verdict of FAIL, reported on stdout)
    note: str = ""
    #: the refusal comes once the run has started writing (into generate's staging folder inside --out): the
    #: folder's files must be as they were and nothing left behind, but its folders' mtimes may move
    touches_out: bool = False


ATTACKS: list[Attack] = []


def attack(group: str, **kw):
    def deco(fn):
        ATTACKS.append(Attack(fn.__name__.replace("_", "-"), group, fn, note=(fn.__doc__ or "").strip(), **kw))
        return fn
    return deco


def _regen(s: Scene, g: Path):
    return ["generate", "--set", "smoke", "--only", CASE, "--out", str(g), "-q"]


# -- generate --out: symbolic links -----------------------------------------------------------------

@attack("symlink")
def gen_symlinked_folder_in_files(s):
    """the issue's case: a files entry through a symlinked folder of DIR deletes outside"""
    g, m = s.edit_manifest(lambda man: _case(man)["files"].update(
        {"lnk/keep.txt": {"sha256": "0" * 64, "bytes": 10}}))
    os.symlink(s.outside, g / "lnk")
    return _regen(s, g), (str(m), "cases[0].files", "lnk/keep.txt")


@attack("symlink")
def gen_case_folder_is_symlink(s):
    """DIR/<case> replaced by a link to an outside folder holding same-named files"""
    g = s.golden()
    shutil.rmtree(g / CASE)
    os.symlink(s.outside / "victim", g / CASE)
    return _regen(s, g), (str(g), CASE, "symbolic link")


@attack("symlink")
def gen_listed_file_is_symlink(s):
    """a listed file replaced by a link to an outside file"""
    g = s.golden()
    (g / CASE / "in.x.bin").unlink()
    os.symlink(s.outside / "data.bin", g / CASE / "in.x.bin")
    return _regen(s, g), (str(g), f"{CASE}/in.x.bin", "symbolic link")


@attack("symlink")
def gen_unlisted_file_is_symlink(s):
    """an earlier manifest without the case; DIR/<case>/in.x.bin links outside: writing follows it"""
    g, m = s.edit_manifest(lambda man: man.update(cases=[]))
    (g / CASE / "in.x.bin").unlink()
    os.symlink(s.outside / "data.bin", g / CASE / "in.x.bin")
    return _regen(s, g), (str(g), CASE, "refusing to overwrite")


@attack("symlink")
def gen_unlisted_folder_is_symlink(s):
    """an earlier manifest without the case; DIR/<case> links to an outside folder: files land there"""
    g, m = s.edit_manifest(lambda man: man.update(cases=[]))
    shutil.rmtree(g / CASE)
    os.symlink(s.outside / "empty_dir", g / CASE)
    return _regen(s, g), (str(g), CASE, "symbolic link")


@attack("symlink")
def gen_manifest_is_symlink(s):
    """DIR/manifest.json is a link to a manifest outside"""
    g = s.golden()
    shutil.copyfile(g / "manifest.json", s.outside / "manifest.json")
    (g / "manifest.json").unlink()
    os.symlink(s.outside / "manifest.json", g / "manifest.json")
    return _regen(s, g), (str(g), "manifest.json", "symbolic link")


@attack("symlink")
def verify_listed_file_links_outside(s):
    """verify follows a listed file's link out of DIR (and passes on the outside copy)"""
    g = s.golden()
    (g / CASE / "out.y.bin").unlink()
    os.symlink(s.outside / "victim" / "out.y.bin", g / CASE / "out.y.bin")
    return ["verify", str(g), "-q"], (f"{CASE}/out.y.bin", "outside the golden directory")


@attack("symlink")
def compare_golden_file_links_outside(s):
    """compare reads a golden output through a link out of DIR"""
    g = s.golden()
    (g / CASE / "out.y.bin").unlink()
    os.symlink(s.outside / "victim" / "out.y.bin", g / CASE / "out.y.bin")
    return ["compare", str(g), "--actual", str(s.template)], (f"{CASE}/out.y.bin", "outside the golden directory")


# -- traversal: case names and file paths -----------------------------------------------------------

def _named(name):
    def edit(man):
        c = _case(man)
        c["name"] = name
        c["files"], c["arrays"] = {}, []
    return edit


@attack("traversal")
def gen_case_name_dotdot(s):
    """a case named ../outside/empty_dir: generate removes that folder"""
    g, m = s.edit_manifest(_named(os.path.relpath(s.outside / "empty_dir", s.work / "g")))
    return _regen(s, g), (str(m), "cases[0].name")


@attack("absolute")
def gen_case_name_absolute(s):
    """a case named by an absolute path: generate removes that folder"""
    g, m = s.edit_manifest(_named(str(s.outside / "empty_dir2")))
    return _regen(s, g), (str(m), "cases[0].name")


@attack("traversal")
def gen_files_dotdot(s):
    """a files entry with '..'"""
    g, m = s.edit_manifest(lambda man: _case(man)["files"].update(
        {"../../outside/keep.txt": {"sha256": "0" * 64, "bytes": 10}}))
    return _regen(s, g), (str(m), "cases[0].files")


@attack("absolute")
def gen_files_absolute(s):
    """a files entry with an absolute path"""
    g, m = s.edit_manifest(lambda man: _case(man)["files"].update(
        {str(s.outside / "keep.txt"): {"sha256": "0" * 64, "bytes": 10}}))
    return _regen(s, g), (str(m), "cases[0].files")


@attack("traversal")
def verify_case_name_dotdot(s):
    """verify accepts a case named '..'"""
    g, m = s.edit_manifest(_named(".."))
    return ["verify", str(g), "-q"], (str(m), "cases[0].name")


@attack("traversal")
def verify_case_name_dot(s):
    """verify accepts a case named '.'"""
    g, m = s.edit_manifest(_named("."))
    return ["verify", str(g), "-q"], (str(m), "cases[0].name")


@attack("traversal")
def verify_case_name_slash(s):
    """verify accepts a case name with '/'"""
    g, m = s.edit_manifest(_named("a/b"))
    return ["verify", str(g), "-q"], (str(m), "cases[0].name")


@attack("traversal")
def verify_case_name_nul(s):
    """verify accepts a case name with a NUL byte"""
    g, m = s.edit_manifest(_named("a\x00b"))
    return ["verify", str(g), "-q"], (str(m), "cases[0].name")


@attack("traversal")
def compare_case_name_dotdot_reads_beside_actual(s):
    """compare with a case named '..' reads the actual output from the parent of --actual"""
    def edit(man):
        c = _case(man)
        c["name"] = ".."
    g, m = s.edit_manifest(edit)
    actual = s.work / "actual"
    actual.mkdir()
    shutil.copyfile(s.template / CASE / "out.y.bin", s.work / "out.y.bin")
    shutil.copyfile(s.template / CASE / "out.scale.bin", s.work / "out.scale.bin")
    return ["compare", str(g), "--actual", str(actual)], (str(m), "cases[0].name")


@attack("traversal")
def case_input_dotdot(s):
    """a case file names its input as ../../outside/data.bin: copied into the set"""
    p = s.case_file(lambda c: c["inputs"]["x"].update(file=os.path.relpath(s.outside / "data.bin", s.work / "cases")))
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p), "inputs.x.file")


@attack("absolute")
def case_input_absolute(s):
    """a case file names its input by an absolute path (the issue: /etc/passwd)"""
    p = s.case_file(lambda c: c["inputs"]["x"].update(file=str(s.outside / "data.bin")))
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p), "inputs.x.file", "absolute")


@attack("symlink")
def case_input_symlink(s):
    """a case file's input is a link (in its folder) to an outside file"""
    p = s.case_file()
    (p.parent / "in.x.bin").unlink()
    os.symlink(s.outside / "data.bin", p.parent / "in.x.bin")
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p), "inputs.x.file")


@attack("symlink")
def case_input_symlinked_folder(s):
    """a case file's input lies in a linked folder that points outside"""
    p = s.case_file(lambda c: c["inputs"]["x"].update(file="sub/data.bin"))
    os.symlink(s.outside, p.parent / "sub")
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p), "inputs.x.file")


@attack("traversal")
def case_name_dotdot(s):
    """a case file named ../x"""
    p = s.case_file(lambda c: c.update(name="../x"))
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p), "case name")


@attack("other")
def case_named_manifest_json(s):
    """a case named manifest.json: its folder takes the manifest's place"""
    p = s.case_file(lambda c: c.update(name="manifest.json"))
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], ("manifest.json",)


# -- data loss: a run that fails after it started must leave the set in --out as it was --------------------

@attack("data-loss", touches_out=True)
def gen_failing_case_over_a_set(s):
    """a case whose input file is missing fails while computing; --out holds a set (the review: all deleted)"""
    g = s.golden()
    p = s.case_file()
    (p.parent / "in.x.bin").unlink()
    return (["generate", "--case", str(p), "--out", str(g), "-q"],
            (f"case {CASE}: input file not found", str(p.parent / "in.x.bin")))


@attack("data-loss")
def gen_every_case_skipped_over_a_set(s):
    """--chip A2 and only cases A2 cannot run, over a set: nothing to write (the review: an empty manifest)"""
    g = s.golden()
    return (["generate", "--set", "smoke", "--only", "kvce-mode1-rs", "--chip", "A2", "--out", str(g), "-q"],
            ("nothing to generate", "kvce-mode1-rs", "chip A2", str(g)))


@attack("data-loss")
def gen_case_op_not_an_operator_over_a_set(s):
    """a case file whose op is 'os.system', over a set (the review: exit 1 and an empty manifest)"""
    g = s.golden()
    p = s.case_file(lambda c: c.update(op="os.system"))
    return ["generate", "--case", str(p), "--out", str(g), "-q"], (str(p), "for op", "os.system", "not an operator")


# -- sizes before data --------------------------------------------------------------------------------

@attack("bomb", memory=True)
def compare_npz_bomb(s):
    """--actual: a few-MB .npz declaring 2 x 2 GiB arrays (the issue: 4.3 GB RSS)"""
    bomb = s.work / "bomb.npz"
    write_npz_bomb(bomb, {f"{CASE}/out.y": ("|i1", (2 * GIB,)), f"{CASE}/out.scale": ("<f4", (GIB // 2,))})
    g = s.golden()
    return ["compare", str(g), "--actual", str(bomb)], (str(bomb), f"{CASE}/out.", "Invalid shape")


@attack("bomb", memory=True)
def compare_npz_bomb_in_actual_dir(s):
    """--actual DIR: DIR/<case>/arrays.npz declaring 2 GiB members"""
    actual = s.work / "actual"
    (actual / CASE).mkdir(parents=True)
    write_npz_bomb(actual / CASE / "arrays.npz", {"out.y": ("|i1", (2 * GIB,))})
    g = s.golden()
    return (["compare", str(g), "--actual", str(actual), "--output", "y"],
            (str(actual / CASE / "arrays.npz"), "out.y", "shape"))


@attack("bomb", memory=True)
def compare_npy_header_declares_1tib(s):
    """--actual y.npy: a 128-byte file whose header declares 1 TiB"""
    p = s.work / "y.npy"
    p.write_bytes(_npy_header("|i1", (1 << 40,)))
    g = s.golden()
    return (["compare", str(g), "--actual", str(p), "--output", "y"], (str(p), "shape", "[1099511627776]"))


@attack("bomb", memory=True)
def case_input_npz_bomb(s):
    """a case file's input is an .npz member declaring 2 GiB (the case says [16, 384])"""
    p = s.case_file(lambda c: c["inputs"]["x"].update(file="x.npz", key="x"))
    write_npz_bomb(p.parent / "x.npz", {"x": ("<u2", (GIB,))})
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p.parent / "x.npz"), "shape")


@attack("bomb", memory=True)
def verify_npz_golden_member_bomb(s):
    """a golden npz directory whose member is swapped for one declaring 2 GiB (the file's sha256 listed: only
    the member's header gives it away)"""
    g = s.golden()
    man = s.manifest(g)
    c = _case(man)
    arrays = c["arrays"]
    for e in arrays:
        e["key"] = f"{ {'input': 'in', 'output': 'out'}[e['role']]}.{e['name']}"
        e["file"] = f"{CASE}/arrays.npz"
    man["file_format"] = "npz"
    write_npz_bomb(g / CASE / "arrays.npz", {"in.x": ("<u2", (GIB,)), "out.y": ("|i1", (GIB,)),
                                             "out.scale": ("<f4", (GIB // 4,))})
    for f in ("in.x.bin", "out.y.bin", "out.scale.bin"):
        del c["files"][f"{CASE}/{f}"]
        (g / CASE / f).unlink()
    import hashlib

    c["files"][f"{CASE}/arrays.npz"] = {"sha256": hashlib.sha256((g / CASE / "arrays.npz").read_bytes()).hexdigest(),
                                        "bytes": (g / CASE / "arrays.npz").stat().st_size}
    s.write_manifest(g, man)
    return ["verify", str(g), "-q"], (str(g / CASE / "arrays.npz"), "Invalid shape")


@attack("bomb")
def compare_npz_lying_zip_header(s):
    """an .npz member whose zip entry claims 1 GiB from 1 KiB (more than DEFLATE can do)"""
    p = s.work / "lie.npz"
    write_npz_bomb(p, {f"{CASE}/out.y": ("|i1", (16, 384))})
    raw = bytearray(p.read_bytes())
    # uncompressed size in the local header (offset 22) and the central directory entry (offset 24)
    struct.pack_into("<I", raw, 22, GIB)
    cd = raw.rfind(b"PK\x01\x02")
    struct.pack_into("<I", raw, cd + 24, GIB)
    p.write_bytes(bytes(raw))
    g = s.golden()
    return ["compare", str(g), "--actual", str(p), "--output", "y"], (str(p), "uncompressed size")


# -- JSON: nesting, types -----------------------------------------------------------------------------

DEEP = "[" * 200_000 + "]" * 200_000


@attack("deep-json")
def verify_deep_json(s):
    """a manifest of 200,000 nested '['"""
    g = s.golden()
    m = s.write_manifest(g, DEEP)
    return ["verify", str(g), "-q"], (str(m), "nesting depth")


@attack("deep-json")
def compare_deep_json(s):
    """the same, read by compare"""
    g = s.golden()
    m = s.write_manifest(g, DEEP)
    return ["compare", str(g), "--actual", str(s.template)], (str(m), "nesting depth")


@attack("deep-json")
def gen_deep_json(s):
    """the same, found in --out by generate"""
    g = s.golden()
    m = s.write_manifest(g, DEEP)
    return _regen(s, g), (str(m), "nesting depth")


@attack("deep-json")
def case_deep_json(s):
    """a case file of 200,000 nested '['"""
    p = s.case_file(lambda c: Replace(DEEP))
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p), "nesting depth")


@attack("deep-json")
def case_deep_params(s):
    """a case file whose params nest 100,000 lists"""
    p = s.case_file()
    text = p.read_text().replace('"params": {', '"params": {"deep": ' + "[" * 100_000 + "]" * 100_000 + ", ", 1)
    p.write_text(text)
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p), "nesting depth")


def _manifest_attack(name, edit, fields, cmd="verify", doc=""):
    def build(s):
        g, m = s.edit_manifest(edit)
        if cmd == "verify":
            argv = ["verify", str(g), "-q"]
        elif cmd == "compare":
            argv = ["compare", str(g), "--actual", str(s.template)]
        else:
            argv = _regen(s, g)
        return argv, (str(m),) + tuple(fields)
    build.__name__ = name
    build.__doc__ = doc
    return attack("overflow" if "overflow" in name else "json-type")(build)


def _set(path, value):
    """An edit setting manifest[path...] = value (path: keys / indices; 'A' = the output y's entry)."""
    def edit(man):
        obj = man
        keys = list(path)
        if keys and keys[0] == "A":
            obj, keys = _arr(man, "y"), keys[1:]
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value
    return edit


_F = f"{CASE}/out.y.bin"
for _name, _edit, _fields, _cmd in [
    ("manifest-top-level-list", lambda m: Replace([m]), ["(top level)"], "verify"),
    ("manifest-format-wrong", _set(["format"], "qsfa-golden/9"), ["format"], "verify"),
    ("manifest-cases-object", _set(["cases"], {}), ["cases"], "verify"),
    ("manifest-case-is-string", _set(["cases", 0], "x"), ["cases[0]"], "verify"),
    ("manifest-case-name-number", _set(["cases", 0, "name"], 5), ["cases[0].name"], "verify"),
    ("gen-manifest-case-name-number", _set(["cases", 0, "name"], 5), ["cases[0].name"], "generate"),
    ("compare-manifest-case-name-number", _set(["cases", 0, "name"], 5), ["cases[0].name"], "compare"),
    ("manifest-case-op-number", _set(["cases", 0, "op"], 7), ["cases[0].op"], "verify"),
    ("manifest-files-string", _set(["cases", 0, "files"], "x"), ["cases[0].files"], "verify"),
    ("manifest-files-value-string", lambda m: _case(m)["files"].update({_F: "x"}), ["cases[0].files", "out.y.bin"], "verify"),
    ("manifest-files-bytes-string", lambda m: _case(m)["files"][_F].update(bytes="6144"), ["bytes"], "verify"),
    ("manifest-files-sha256-number", lambda m: _case(m)["files"][_F].update(sha256=5), ["sha256"], "verify"),
    ("manifest-arrays-object", _set(["cases", 0, "arrays"], {}), ["cases[0].arrays"], "verify"),
    ("manifest-array-missing-shape", lambda m: _arr(m, "y").pop("shape"), ["cases[0].arrays[2].shape"], "verify"),
    ("manifest-shape-string", _set(["A", "shape"], "16,384"), ["cases[0].arrays[2].shape"], "verify"),
    ("manifest-shape-float", _set(["A", "shape"], [16.0, 384]), ["cases[0].arrays[2].shape[0]"], "verify"),
    ("manifest-shape-bool", _set(["A", "shape"], [True, 6144]), ["cases[0].arrays[2].shape[0]"], "verify"),
    ("manifest-shape-negative", _set(["A", "shape"], [-16, -384]), ["cases[0].arrays[2].shape[0]"], "verify"),
    ("manifest-shape-int64-overflow", _set(["A", "shape"], [(1 << 62) + 1536, 4]), ["cases[0].arrays[2].shape"], "verify"),
    ("compare-shape-int64-overflow", _set(["A", "shape"], [(1 << 62) + 1536, 4]), ["cases[0].arrays[2].shape"], "compare"),
    ("manifest-shape-beyond-int64", _set(["A", "shape"], [1 << 64, 1]), ["cases[0].arrays[2].shape[0]"], "verify"),
    ("manifest-dtype-unknown", _set(["A", "dtype"], "complex64"), ["cases[0].arrays[2].dtype"], "verify"),
    ("manifest-dtype-number", _set(["A", "dtype"], 5), ["cases[0].arrays[2].dtype"], "verify"),
    ("manifest-storage-object", _set(["A", "storage"], "|O"), ["cases[0].arrays[2].storage"], "verify"),
    ("manifest-storage-mismatch", lambda m: _arr(m, "y").update(storage="<f8", shape=[16, 48]),
     ["cases[0].arrays[2].storage"], "verify"),
    ("manifest-role-unknown", _set(["A", "role"], "weird"), ["cases[0].arrays[2].role"], "verify"),
    ("manifest-array-name-number", _set(["A", "name"], 3), ["cases[0].arrays[2].name"], "verify"),
    ("manifest-file-number", _set(["A", "file"], 3), ["cases[0].arrays[2].file"], "verify"),
    ("manifest-segments-malformed", _set(["A", "segments"], [[0, "x"]]), ["cases[0].arrays[2].segments[0]"], "verify"),
    ("manifest-params-list", _set(["cases", 0, "params"], [1, 2]), ["cases[0].params"], "verify"),
    ("manifest-seed-string", _set(["cases", 0, "seed"], "7"), ["cases[0].seed"], "verify"),
]:
    _manifest_attack(_name.replace("-", "_"), _edit, _fields, _cmd, doc=f"manifest: {_name}")


@attack("json-type")
def compare_segments_malformed_on_mismatch(s):
    """malformed segments, hit when an output differs (compare reports the packed-row field)"""
    g, m = s.edit_manifest(_set(["A", "segments"], [[0, "x"]]))
    actual = s.work / "y.bin"
    y = bytearray((s.template / _F).read_bytes())
    y[0] ^= 1
    actual.write_bytes(bytes(y))
    return (["compare", str(g), "--actual", str(actual), "--output", "y"],
            (str(m), "cases[0].arrays[2].segments[0]"))


def _case_attack(name, edit, fields, doc=""):
    def build(s):
        p = s.case_file(edit)
        return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p),) + tuple(fields)
    build.__name__ = name
    build.__doc__ = doc
    return attack("overflow" if "overflow" in name else "json-type")(build)


for _name, _edit, _fields in [
    ("case-name-number", lambda c: c.update(name=5), ["name"]),
    ("case-params-list", lambda c: c.update(params=[1, 2]), ["params"]),
    ("case-inputs-list", lambda c: c.update(inputs=[1]), ["inputs"]),
    ("case-generator-number", lambda c: c.update(generator=3), ["generator"]),
    ("case-shape-negative", lambda c: c["inputs"]["x"].update(shape=[-16, -384]), ["inputs.x.shape[0]"]),
    ("case-shape-overflow", lambda c: c["inputs"]["x"].update(shape=[(1 << 62) + 3072, 2]), ["inputs.x.shape"]),
    ("case-dtype-number", lambda c: c["inputs"]["x"].update(dtype=5), ["inputs.x.dtype"]),
    ("case-key-number", lambda c: c["inputs"]["x"].update(key=5), ["inputs.x.key"]),
]:
    _case_attack(_name.replace("-", "_"), _edit, _fields, doc=f"case file: {_name}")


@attack("other")
def case_file_is_a_fifo(s):
    """--case names a FIFO: the open blocks forever"""
    p = s.work / "fifo.json"
    os.mkfifo(p)
    return ["generate", "--case", str(p), "--out", str(s.out()), "-q"], (str(p), "not a regular file")


# --------------------------------------------------------------------------------------------------
# the campaign: every attack as a subprocess against a checkout


def _run(py: str, root: Path, argv, timeout: float = 30.0, rss_cap: int = 3 * GIB // 2):
    env = dict(os.environ, PYTHONPATH=str(root))
    # what the console script `qsfa` runs (qsfa.cli:main)
    code = "import sys; from qsfa.cli import main; sys.exit(main())"
    p = subprocess.Popen([py, "-c", code, "golden", *argv], cwd=str(root), env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, killed, t0 = 0, None, time.monotonic()
    while p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
        if peak > rss_cap:
            killed = f"killed at {peak >> 20} MiB RSS"
        elif time.monotonic() - t0 > timeout:
            killed = f"hung for {timeout:.0f} s"
        if killed:
            p.kill()
            break
        time.sleep(0.005)
    out, err = p.communicate()
    return p.returncode, out, err, peak, killed


def damage(before: dict, after: dict) -> list[str]:
    """What a failed command did to its own folder (two :func:`snapshot` s): files or links ``before`` held that
    ``after`` lacks or holds with other bytes ("lost ..."), and entries ``after`` holds that were not there
    ("left ..."). Folder mtimes are not compared."""
    out = []
    for rel, v in before.items():
        w = after.get(rel)
        if v[0] == "file" and (w is None or w[0] != "file" or w[3] != v[3]):
            out.append(f"lost {rel}")
        elif v[0] == "link" and w != v:
            out.append(f"lost {rel}")
    out += [f"left {rel}" for rel in after if rel not in before]
    return sorted(out)


def refusal_ok(a: Attack, rc, out, err, expect) -> bool:
    """The refusal the attack must get: its exit status, one line on stderr, file and field named."""
    if rc != a.rc or "Traceback" in err:
        return False
    text = err if rc == 2 else out
    return (err.count("\n") == 1 if rc == 2 else True) and all(x in text for x in expect)


def classify(a: Attack, rc, out, err, changed, killed, expect, damaged=()) -> tuple[str, bool]:
    if killed or changed or (rc != 0 and damaged):
        return "silent", False
    if "Traceback" in err or rc not in (0, 1, 2):
        return "traceback", False
    if rc == 0 and a.must_fail:
        return "silent", False
    return "clear", refusal_ok(a, rc, out, err, expect)


def campaign(root: Path, py: str, workdir: Path) -> list[dict]:
    template = workdir / "template"
    rc, out, err, _, _ = _run(py, root, TEMPLATE_ARGS + ["--out", str(template)], timeout=300)
    if rc != 0:
        raise SystemExit(f"cannot make the template golden directory with {root}: {err}")
    rows = []
    for i, a in enumerate(ATTACKS):
        base = workdir / f"a{i:02d}"
        s = Scene(base, template)
        argv, expect = a.build(s)
        before_o, before_w = snapshot(s.outside), snapshot(s.work)
        rc, out, err, peak, killed = _run(py, root, argv)
        changed = snapshot(s.outside) != before_o
        after_w = snapshot(s.work)
        damaged = damage(before_w, after_w)
        cls, names = classify(a, rc, out, err, changed, killed, expect, damaged)
        first = (killed or (err.strip().splitlines() or [""])[-1])[:160]
        rows.append({"attack": a.name, "group": a.group, "class": cls, "names_file_and_field": names, "rc": rc,
                     "peak_rss_mib": peak >> 20, "outside_changed": changed,
                     "work_changed": after_w != before_w, "work_damage": damaged[:20],
                     "work_lost": sum(d.startswith("lost ") for d in damaged), "last_line": first})
        shutil.rmtree(base, ignore_errors=True)
    return rows


def main(argv=None) -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="a qsfa checkout (its qsfa/ is put first on PYTHONPATH)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    global BOMB_CRC
    BOMB_CRC = True
    with tempfile.TemporaryDirectory(prefix="qsfa-golden-attacks-") as tmp:
        rows = campaign(Path(args.root).resolve(), args.python, Path(tmp))
    for r in rows:
        print(f"{r['class']:9s} {'N' if r['names_file_and_field'] else '-'} rc={r['rc']!s:4s} "
              f"rss={r['peak_rss_mib']:5d}M {r['attack']:45s} {r['last_line']}")
    counts = {c: sum(r["class"] == c for r in rows) for c in ("clear", "traceback", "silent")}
    naming = sum(r["names_file_and_field"] for r in rows)
    lossy = [r for r in rows if r["rc"] != 0 and r["work_damage"]]
    print(f"\n{len(rows)} attacks: clear {counts['clear']} (naming file and field: {naming}) / "
          f"traceback {counts['traceback']} / silent, hang or data loss {counts['silent']} "
          f"(data loss: {len(lossy)} failed runs, {sum(r['work_lost'] for r in lossy)} files lost)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
