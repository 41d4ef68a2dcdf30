"""The installed distribution holds every package of the source tree.

`pip install -e .` (the README's commands) finds sub-packages through the source folder, so a package missing
from pyproject's explicit `packages` list passes every other test and breaks only a regular (wheel) install:
`qsfa.strategies` was once left out that way and `qsfa conformance` died with ModuleNotFoundError.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _packages_on_disk() -> set[str]:
    found = set()
    for init in (ROOT / "qsfa").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if "__pycache__" in rel.parts or init.parent.is_symlink():
            continue
        found.add(".".join(rel.parts))
    for init in (ROOT / "kernels").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT / "kernels")
        found.add(".".join(("qsfa", "kernels") + rel.parts))
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(_setuptools_config()["packages"])
    missing = sorted(_packages_on_disk() - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}: a wheel install would omit them"


def test_every_listed_package_exists():
    cfg = _setuptools_config()
    dirs = cfg["package-dir"]
    for pkg in cfg["packages"]:
        base = next((k for k in sorted(dirs, key=len, reverse=True) if pkg == k or pkg.startswith(k + ".")), None)
        assert base is not None, pkg
        folder = ROOT / dirs[base] / Path(*pkg[len(base):].lstrip(".").split(".")) if pkg != base else ROOT / dirs[base]
        assert (folder / "__init__.py").is_file(), f"{pkg}: no {folder.relative_to(ROOT)}/__init__.py"


def test_non_python_files_the_code_reads_are_package_data():
    data = _setuptools_config().get("package-data", {})
    for f in (ROOT / "qsfa").rglob("*"):
        if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts and not any(
                p.is_symlink() for p in f.relative_to(ROOT).parents if p != Path(".")):
            pkg = ".".join(f.parent.relative_to(ROOT).parts)
            patterns = data.get(pkg, [])
            assert any(f.match(p) for p in patterns), f"{f.relative_to(ROOT)} is not in package-data of {pkg}"
