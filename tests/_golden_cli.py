"""Helpers the golden-command tests share: running ``qsfa golden ...`` in-process and a writable copy of a set."""

import os
import shutil

from qsfa.cli import main


def cli(capsys, *argv):
    """``qsfa golden *argv`` in-process: (exit status, stdout, stderr) of this call only."""
    capsys.readouterr()
    rc = main(["golden", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def actual_copy(src, tmp_path):
    """A copy of the golden folder ``src`` at ``tmp_path / "actual"`` with writable files (a generated set's are
    read-only), to stand in for a backend's dump."""
    a = tmp_path / "actual"
    shutil.copytree(src, a)
    for root, _, files in os.walk(a):
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    return a
