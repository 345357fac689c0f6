"""The layering of the package, checked on every import statement (lazy ones included).

docs/architecture.md draws the layers: the ground vocabulary in ``peerckpt/``, the durable
library ``persist/``, one package per process (``runtime/`` the rank, ``replication/`` the
agent, ``recovery/`` the coordinator), and on top ``chaos/`` and the launchers and CLI
(``peerckpt/launch/``, ``peerckpt/cli.py``). The three process packages never import each
other, and production code never imports ``chaos/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
PROCESSES = ("runtime", "replication", "recovery")
TOP_LAUNCH = "launch"
EVERY = {"ground", "persist", *PROCESSES, "chaos", TOP_LAUNCH}

# Which layers a module of each layer may import.
ALLOWED = {
    "ground": {"ground"},
    "persist": {"ground", "persist"},
    "runtime": {"ground", "persist", "runtime"},
    "replication": {"ground", "persist", "replication"},
    "recovery": {"ground", "persist", "recovery"},
    "chaos": EVERY,
    # Launchers and the CLI start processes of every kind; of chaos only its public surface
    # (the package itself, ``peerckpt.chaos``), never its internals.
    TOP_LAUNCH: EVERY - {"chaos"},
}


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name (from pyproject's mapping)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    dirs = config["tool"]["setuptools"]["package-dir"]
    found: dict[str, Path] = {}
    for package in config["tool"]["setuptools"]["packages"]:
        folder = REPO / dirs.get(package, package.replace(".", "/"))
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


MODULES = _modules()


def layer(module: str) -> str:
    parts = module.split(".")
    if module in ("peerckpt.cli", "peerckpt.__main__") or parts[1:2] == [TOP_LAUNCH]:
        return TOP_LAUNCH
    if len(parts) > 1 and parts[1] in ("persist", "chaos", *PROCESSES):
        return parts[1]
    return "ground"


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a peerckpt module in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((node.lineno, sub if sub in MODULES else base))
    ours = {(line, name) for line, name in out if name.split(".")[0] == "peerckpt"}
    return sorted(ours)


def forbidden_edges() -> list[str]:
    problems = []
    for module, path in sorted(MODULES.items()):
        mine = layer(module)
        for line, target in _imports(module, path):
            theirs = layer(target)
            if theirs == "chaos" and mine == TOP_LAUNCH and target == "peerckpt.chaos":
                continue  # the chaos package's public surface
            if theirs not in ALLOWED[mine]:
                where = path.relative_to(REPO)
                problems.append(
                    f"{where}:{line}: {module} ({mine}) imports {target} ({theirs}); "
                    f"{mine} may import only {sorted(ALLOWED[mine])}"
                )
    return problems


def test_no_module_imports_across_the_layers() -> None:
    problems = forbidden_edges()
    assert not problems, "forbidden imports:\n" + "\n".join(problems)


def test_the_checker_sees_a_forbidden_edge_in_a_lazy_import(tmp_path: Path) -> None:
    # The checker itself must fail on what it exists to catch: an import inside a function
    # of the agent's package that reaches into the rank's package, and one into chaos.
    path = tmp_path / "probe.py"
    path.write_text(
        "def f():\n"
        "    from peerckpt.runtime.rank import RankRuntime\n"
        "    from peerckpt.chaos import points\n"
    )
    targets = [t for _, t in _imports("peerckpt.replication.probe", path)]
    assert targets == ["peerckpt.runtime.rank", "peerckpt.chaos.points"]  # by line
    assert {layer(t) for t in targets} - ALLOWED["replication"] == {"runtime", "chaos"}


@pytest.mark.parametrize("package", ["peerckpt", "persist", *PROCESSES, "chaos", TOP_LAUNCH])
def test_each_package_says_which_process_it_is_and_what_it_may_import(package: str) -> None:
    name = "peerckpt" if package == "peerckpt" else f"peerckpt.{package}"
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text())) or ""
    assert "may import" in doc, f"{MODULES[name]}: say what the package may import"
