"""The documentation holds together: links resolve, every operator and format has its section in
docs/numerics/, and nothing points at a document outside the repository.

Generic on purpose: an operator registered later (``qsfa.operators()``), a format added to
``qsfa.formats.FORMAT_NAMES`` or an OPEN fact added to ``qsfa.npu.mapping.IGNORED`` fails here until
docs/numerics/ has a section for it.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import unicodedata

import pytest

from qsfa import formats
from qsfa._dispatch import operators

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NUMERICS = DOCS / "numerics"
FAMILIES = ("formats", "layouts", "quantisers", "cache-writers", "attention", "indexer", "chips", "comparison",
            "open-facts")


def markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def tracked_files() -> list[pathlib.Path]:
    """Files under version control (the working tree of a checkout without git: every file outside
    virtual environments, caches and build outputs)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        names = [n for n in out.decode().split("\0") if n]
        if names:
            return [ROOT / n for n in names if (ROOT / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        pass
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist"}
    return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)]


# ---------------------------------------------------------------------------------------------------------
# anchors as GitHub renders them


def strip_code_blocks(text: str) -> str:
    """The text with fenced code blocks blanked (line count kept): links and headings there are not real."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"\s*(```+|~~~+)", line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's heading anchor: inline markup dropped, lower case, punctuation other than '-' and '_'
    removed, spaces to '-'."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays, its target goes
    text = text.replace("`", "").strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every anchor of a Markdown file: heading slugs (repeats get -1, -2, ...) and explicit
    ``<a id="...">`` / ``<a name="...">`` targets."""
    text = strip_code_blocks(path.read_text())
    found: set[str] = set()
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


def test_slug_follows_github():
    assert slug("FP4 packing") == "fp4-packing"
    assert slug("`kv_quant_sparse_flash_attention`") == "kv_quant_sparse_flash_attention"
    assert slug("rope 0") == "rope-0"
    assert slug("Scale rules (per group)") == "scale-rules-per-group"
    assert slug("E8M0: 2^(b-127)") == "e8m0-2b-127"


# ---------------------------------------------------------------------------------------------------------
# links


def markdown_links(path: pathlib.Path):
    """(line number, target) of every inline link and image in a Markdown file, code blocks and code spans
    excluded."""
    text = strip_code_blocks(path.read_text())
    for no, line in enumerate(text.splitlines(), 1):
        line = re.sub(r"`[^`]*`", "", line)
        for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line):
            yield no, m.group(1)


def check_target(source: pathlib.Path, target: str) -> str | None:
    """Why a relative link from ``source`` does not resolve, or None."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
        return None
    path_part, _, anchor = target.partition("#")
    dest = (source.parent / path_part).resolve() if path_part else source
    if not dest.exists():
        return f"{path_part} does not exist"
    if dest.is_dir():
        return None if not anchor else f"#{anchor} on a directory"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{path_part or source.name} has no anchor #{anchor}"
    return None


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for md in markdown_files():
        for no, target in markdown_links(md):
            why = check_target(md, target)
            if why:
                broken.append(f"{md.relative_to(ROOT)}:{no}: ({target}) {why}")
    assert not broken, "\n".join(broken)


#: A citation of a numerics page in code, docstrings, constraint sources or error messages.
CITATION = re.compile(r"docs/numerics/([a-z0-9-]+\.md)(?:#([A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*))?")


def test_every_numerics_citation_in_the_repository_resolves():
    pages = {p.name: anchors(p) for p in NUMERICS.glob("*.md")}
    broken, seen = [], 0
    for f in tracked_files():
        if f.suffix not in (".py", ".md", ".toml", ".txt", ".cfg", ".yaml", ".yml") and f.name != "run":
            continue
        for no, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in CITATION.finditer(line):
                seen += 1
                page, anchor = m.groups()
                if page not in pages:
                    broken.append(f"{f.relative_to(ROOT)}:{no}: docs/numerics/{page} does not exist")
                elif anchor and anchor not in pages[page]:
                    broken.append(f"{f.relative_to(ROOT)}:{no}: docs/numerics/{page} has no anchor #{anchor}")
    assert seen > 100, "the citation pattern no longer finds the code's citations"
    assert not broken, "\n".join(broken)


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Some section\n")
    src = tmp_path / "b.md"
    src.write_text("x")
    assert check_target(src, "a.md#some-section") is None
    assert check_target(src, "a.md") is None
    assert "no anchor #missing" in check_target(src, "a.md#missing")
    assert "does not exist" in check_target(src, "c.md")
    assert check_target(src, "https://example.org/nowhere") is None


# ---------------------------------------------------------------------------------------------------------
# coverage: every family, operator, format and OPEN fact has its section


def test_every_family_has_its_page_and_the_index_links_them_all():
    index = NUMERICS / "README.md"
    linked = {t.split("#")[0] for _, t in markdown_links(index)}
    for fam in FAMILIES:
        assert (NUMERICS / f"{fam}.md").is_file(), fam
        assert f"{fam}.md" in linked, f"docs/numerics/README.md does not link {fam}.md"


def _all_numerics_anchors() -> dict[str, str]:
    out = {}
    for p in sorted(NUMERICS.glob("*.md")):
        for a in anchors(p):
            out.setdefault(a, p.name)
    return out


@pytest.mark.parametrize("name", sorted(operators()))
def test_every_public_operator_has_its_section(name):
    where = _all_numerics_anchors()
    assert name in where, (f"operator {name!r} has no section in docs/numerics/: add a heading '## {name}' "
                           f"(or an <a id=\"{name}\"></a> anchor) to its family page")


@pytest.mark.parametrize("name", sorted(operators()))
def test_every_operator_contract_cites_the_numerics_pages(name):
    """Constraint sources say where a rule comes from: a numerics page (and the public source), never a
    document outside the repository."""
    sources = [c.source or "" for c in operators()[name].contract.constraints]
    assert any("docs/numerics/" in s for s in sources), f"no constraint of {name} cites docs/numerics/"
    assert not [s for s in sources if _OUTSIDE.search(s)]


@pytest.mark.parametrize("fmt", formats.FORMAT_NAMES)
def test_every_format_has_its_section(fmt):
    assert fmt in anchors(NUMERICS / "formats.md"), f"format {fmt!r} has no '## {fmt}' section in formats.md"


def test_every_open_fact_parameter_has_its_section():
    from qsfa.npu.mapping import IGNORED

    facts = [p for p, why in IGNORED.items() if "OPEN" in why]
    assert facts, "qsfa.npu.mapping.IGNORED no longer names the OPEN facts"
    have = anchors(NUMERICS / "open-facts.md")
    # fp4_nibble_order is the cache writer's name for the formats' nibble_order
    missing = [p for p in facts if p not in have and p.removeprefix("fp4_") not in have]
    assert not missing, f"OPEN parameters without a section in docs/numerics/open-facts.md: {missing}"


# ---------------------------------------------------------------------------------------------------------
# nothing outside the repository

#: Built from pieces so that this file does not match itself.
_OUTSIDE = re.compile("|".join((
    "SPEC" + r"\.md",
    r"\bSPEC" + r"(?:'s)?(?: sections?)? \d",
    r"\.\./" + "shared",
    r"(?<![\w/.-])" + "sha" + "red/",
    "seeds" + "/",
    r"\[(?:OT|VA|FM)" + r"\]",  # the source abbreviations of the old outside document ([OP] only before a
    r"\[OP" + r"\] (?:doc|torch_npu|Ascend)",  # source word: ``ops=[OP]`` is code)
)))


def test_nothing_points_outside_the_repository():
    hits = []
    for f in tracked_files():
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for no, line in enumerate(text.splitlines(), 1):
            if _OUTSIDE.search(line):
                hits.append(f"{f.relative_to(ROOT)}:{no}: {line.strip()[:120]}")
    assert not hits, "references to documents outside the repository:\n" + "\n".join(hits)


def test_the_outside_pattern_catches_the_old_forms():
    for old in ("see SPEC" + ".md 3.6", "(SPEC" + " 1.1)", "SPEC" + " section 4 tolerances", "../" + "sha" + "red/x",
                "kept in " + "sha" + "red/", "the [" + "OT] kernels"):
        assert _OUTSIDE.search(old), old
    for fine in ("_NO_SPECIALS", "shared memory", "torch.cuda.shared_mem", "spec_example", "select(ops=[" + "OP])"):
        assert not _OUTSIDE.search(fine), fine


# ---------------------------------------------------------------------------------------------------------
# the decode tables of formats.md say what the code decodes


def _section(page: pathlib.Path, heading: str) -> str:
    text = page.read_text()
    start = text.index(f"\n## {heading}\n")
    nxt = text.find("\n## ", start + 1)
    return text[start:nxt if nxt > 0 else None]


def _table_rows(section: str):
    for line in section.splitlines():
        if line.startswith("|") and not re.match(r"\|\s*-", line):
            yield [c.strip() for c in line.strip().strip("|").split("|")]


def _value(expr: str) -> float:
    """A value cell such as '1.75 × 2^-7 = 0.013671875' or '32768 (largest finite)': the last expression."""
    expr = re.sub(r"\([a-z ]+\)", "", expr.split("=")[-1]).replace("×", "*").replace("^", "**").strip()
    assert re.fullmatch(r"[-+*/().\d\s]+", expr), expr
    return float(eval(expr, {"__builtins__": {}}))  # digits and operators only (checked above)


def test_formats_page_fp4_table_is_the_decode_of_every_code():
    import numpy as np

    rows = [r for r in _table_rows(_section(NUMERICS / "formats.md", "float4_e2m1")) if r[0].startswith("0x")]
    seen = {}
    for r in rows:
        for code, _bits, value in (r[0:3], r[3:6]):
            seen[int(code, 16)] = float(value)
    assert sorted(seen) == list(range(16))
    got = formats.decode(np.arange(16, dtype=np.uint8), "float4_e2m1")
    for c, v in seen.items():
        assert got[c] == v and np.signbit(got[c]) == v.__repr__().startswith("-"), (c, v, got[c])


def test_formats_page_hifloat8_worked_examples_decode_as_stated():
    import numpy as np

    rows = [r for r in _table_rows(_section(NUMERICS / "formats.md", "hifloat8")) if re.fullmatch(r"0x[0-9A-F]{2}", r[0])]
    assert len(rows) >= 10
    for r in rows:
        code, value = int(r[0], 16), _value(r[-1])
        got = float(formats.decode(np.array([code], np.uint8), "hifloat8")[0])
        assert got == value, (r[0], r[-1], got)
        assert int(r[1].split()[0] + r[1].split()[1], 2) == code & 0x7F, r  # the bits column is the code


def test_formats_page_hifloat8_encode_examples():
    import numpy as np

    codes = formats.encode(np.float32([1.0625, 22.0, 40960.0, 1.5 * 2.0 ** -17]), "hifloat8")
    assert [int(c) for c in codes] == [0x09, 0x42, 0x6F, 0x07]  # the page's worked encodes


def test_the_catalogue_table_counts_every_operator():
    """docs/conformance.md states how many operators vs_reference / invalid_rejected cover: the registry's count."""
    text = (DOCS / "conformance.md").read_text(encoding="utf-8")
    for fam in ("vs_reference", "invalid_rejected"):
        m = re.search(rf"^\| `{fam}` \| all (\d+) \|", text, re.M)
        assert m, fam
        assert int(m.group(1)) == len(operators()), (fam, m.group(1), sorted(operators()))
