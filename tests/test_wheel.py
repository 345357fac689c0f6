"""The wheel ships the whole package: built from a copy of the tree with pip (no network, no
build isolation: the virtual environment's setuptools), it holds every module of the folders
that pyproject.toml maps, and every one of them imports from the wheel's contents alone.

The editable install every other test uses finds modules in the source folders whatever the
distribution lists, so only a built wheel shows a package left out (``peerckpt.messages``
once was, and ``import peerckpt.wire`` failed from a wheel).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .test_layers import REPO, Tree

# Importing these runs something: the command line's ``python -m`` entry.
NOT_IMPORTED = {"peerckpt.launch.__main__"}

_IMPORT_ALL = """
import importlib, json, sys, traceback
failed = {}
where = {}
for name in json.loads(sys.argv[1]):
    try:
        where[name] = importlib.import_module(name).__file__
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps({"failed": failed, "where": where}))
"""


def _source_copy(root: Path) -> Path:
    """What a clean checkout holds of the build: no build/, no egg-info, no caches."""
    tree = Tree(REPO)
    root.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, root / name)
    for folder in {Path(f).parts[0] for f in tree.package_dir.values()}:
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_the_wheel_holds_every_module_and_each_imports_from_it(tmp_path: Path) -> None:
    source = _source_copy(tmp_path / "src")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    built = subprocess.run(
        [*pip, str(source), "-w", str(tmp_path / "dist")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("peerckpt-*.whl")

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    shipped = {
        name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for name in names
        if name.endswith(".py")
    }
    modules = set(Tree(REPO).modules)
    assert {"peerckpt.messages", "peerckpt.recovery.planning"} <= modules
    assert modules - shipped == set(), "modules left out of the wheel"
    assert shipped - modules == set(), "modules in the wheel that no source folder holds"

    # The entry points name modules the wheel holds (the command, the hooks, the supervisor).
    (points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    declared = [
        line.partition("=")[2].strip().partition(":")[0]
        for line in (tmp_path / "site" / points).read_text().splitlines()
        if "=" in line
    ]
    assert "peerckpt.launch.cli" in declared and "peerckpt.launch.torchrun" in declared
    assert set(declared) <= modules

    # Out of the repository, with the wheel's contents first on the path: every module comes
    # from there (the virtual environment gives torch and the rest).
    wanted = sorted(modules - NOT_IMPORTED)
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, json.dumps(wanted)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["failed"] == {}, "\n".join(result["failed"].values())
    site = str(tmp_path / "site")
    outside = {n: f for n, f in result["where"].items() if not f.startswith(site)}
    assert outside == {}, "modules imported from outside the wheel"
