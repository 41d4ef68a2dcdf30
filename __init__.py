"""Not a package: the root folder of a qsfa clone (the package is the ``qsfa`` folder inside it).

Python runs this file when a script started from the folder that holds a clone named ``qsfa`` imports qsfa: the
script's folder comes first on ``sys.path``. Without this file the clone's root was an empty namespace package
that hid an editable install (``module 'qsfa' has no attribute 'c8_cache_write'``; issue 27). Now the import
continues with the qsfa installed elsewhere (found on the rest of ``sys.path`` or by an installed finder), as if
the clone were not there; if there is none, it fails saying what happened. pytest collects this folder as a plain
directory (tests/_clone_root.py), so it never imports this file.
"""

import os as _os
import sys as _sys


def _installed_qsfa():
    """The spec of a qsfa package found anywhere but this clone's root, or None."""
    from importlib.machinery import PathFinder

    here = _os.path.realpath(__file__)
    holder = _os.path.realpath(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))  # holds the clone
    paths = [p for p in _sys.path if _os.path.realpath(p or _os.getcwd()) != holder]
    candidates = [lambda: PathFinder.find_spec("qsfa", paths)]
    for finder in _sys.meta_path:  # e.g. the finder of an editable install
        if finder is not PathFinder and hasattr(finder, "find_spec"):
            candidates.append(lambda f=finder: f.find_spec("qsfa", None))
    for find in candidates:
        try:
            spec = find()
        except Exception:  # noqa: BLE001 - a broken finder is no qsfa
            continue
        if spec is not None and spec.origin and _os.path.realpath(spec.origin) != here:
            return spec
    return None


if __name__ == "qsfa":
    _spec = _installed_qsfa()
    if _spec is None:
        _root = _os.path.dirname(_os.path.abspath(__file__))
        raise ImportError(
            f"'import qsfa' found {_root}, the root folder of a qsfa clone, not the qsfa package (that is "
            f"{_os.path.join(_root, 'qsfa')}), and no installed qsfa: Python looks in the script's folder (or the "
            f"current one) first, and it holds this clone. Install it (pip install -e {_root}), or run the script "
            f"from the clone's folder, or put {_root} on PYTHONPATH."
        )
    import importlib.util as _util

    _module = _util.module_from_spec(_spec)
    _sys.modules["qsfa"] = _module  # the import statement returns what sys.modules holds once this file has run
    _spec.loader.exec_module(_module)
