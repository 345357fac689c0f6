"""The packages of the distribution, found by walking the folders that pyproject.toml maps
into ``peerckpt`` (``[tool.setuptools.package-dir]``), so that none is listed by hand.

Every folder at or under a mapped one that holds an ``__init__.py``, through a chain of such
folders, is a package: ``recovery/planning/`` is ``peerckpt.recovery.planning``,
``peerckpt/messages/`` is ``peerckpt.messages``. setuptools' own discovery
(``[tool.setuptools.packages.find]``) cannot do this: it finds the packages of one folder
tree, not of several folders each mapped to a different name. Everything else about the
build is declared in pyproject.toml; ``tests/test_wheel.py`` builds the wheel and imports
every module of the folders from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # pyproject.toml's build requirements bring it for Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent


def packages(root: Path) -> list[str]:
    """Every package under the folders of ``root``'s pyproject.toml mapping, sorted."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    found: set[str] = set()
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        top = root / folder
        for init in top.rglob("__init__.py"):
            parts = init.parent.relative_to(top).parts
            if all((top.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(len(parts))):
                found.add(".".join([package, *parts]))
    return sorted(found)


if __name__ == "__main__":
    setup(packages=packages(ROOT))
