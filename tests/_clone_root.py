"""pytest plugin (loaded by tests/conftest.py): collect the repository's root folder as a plain directory.

The root holds an ``__init__.py`` that tells a script importing a clone named ``qsfa`` what happened (see that
file); pytest would collect a folder with an ``__init__.py`` as a package and import it - as ``qsfa`` in a clone
named so, shadowing the package the tests import.
"""

import pytest


def pytest_collect_directory(path, parent):
    if (path / "__init__.py").is_file() and (path / "qsfa" / "__init__.py").is_file() \
            and (path / "pyproject.toml").is_file():
        return pytest.Dir.from_parent(parent, path=path)
    return None
