"""The folder graph of the package, read from the tree and checked on every edge.

The package is a set of top-level folders, each mapped into ``peerckpt`` by pyproject.toml's
``[tool.setuptools.package-dir]``: the ground vocabulary ``peerckpt/``, the durable library
``persist/``, one package per process (``runtime/`` the rank, ``replication/`` the agent,
``recovery/`` the coordinator), the fault injection ``chaos/``, and on top the launchers and
the CLI ``launch/``. docs/architecture.md draws the layers. Which folders exist, and which
modules each holds, is read from that mapping and a walk of the folders, never from a list
kept here; only the rule of which folder may import which is written below, and a folder the
rule does not place fails the test.

An edge is any way one folder's code reaches another's: an import statement (inside a
function or under ``TYPE_CHECKING`` too), the module a process is started as (``"-m",
"peerckpt.replication.agent"`` in an argv), and the names of a table loaded with
``importlib.import_module`` (the lazy public names of a package). The graph of those edges
between folders must be a DAG that only goes down the rule: an upward edge, and any cycle
(a two-way edge first), fails, named by file and line. The package's ``__init__`` in the
ground folder is the public API (``peerckpt.resilient`` is the rank's): it is a node of its
own, ``API``, above the ground and the rank's package, so that the ground folder's modules
still import nothing above them.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
GROUND = "peerckpt"  # the folder of the package itself
API = "peerckpt (API)"  # the ground folder's __init__: the public API, a node of its own
PROCESSES = ("runtime", "replication", "recovery")

# The rule: each folder and the folders it may import besides itself, lowest first.
MAY_IMPORT: dict[str, set[str]] = {
    GROUND: set(),
    "persist": {GROUND},
    **{process: {GROUND, "persist"} for process in PROCESSES},
    # Faults reach a launcher through chaos's own protocol (chaos/actions.py, Machines) and
    # the processes through the hooks of peerckpt/faults.py: chaos names neither.
    "chaos": {GROUND},
    API: {GROUND, "runtime"},
    # The launchers start processes of every kind, so they know all their packages; of
    # chaos only its public surface (the package itself, ``peerckpt.chaos``).
    "launch": {GROUND, API, "persist", *PROCESSES, "chaos"},
}
PUBLIC_ONLY = {"chaos"}  # folders that others may import only as the package itself


@dataclass(frozen=True)
class Edge:
    """One way ``module`` (in ``path``, at ``line``) reaches ``target``."""

    path: Path
    line: int
    module: str
    target: str
    how: str  # "import", "-m", "import_module"


class Tree:
    """The package as the folders of ``root`` and its pyproject.toml lay it out."""

    def __init__(self, root: Path) -> None:
        self.root = root
        config = tomllib.loads((root / "pyproject.toml").read_text())
        self.package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
        self.modules = self._walk()

    def _walk(self) -> dict[str, Path]:
        """Every module under each mapped folder, by dotted name: a folder is a package where
        it has an ``__init__.py``, down from the mapped one."""
        found: dict[str, Path] = {}
        for package, folder in self.package_dir.items():
            top = self.root / folder
            for init in sorted(top.rglob("__init__.py")):
                parts = init.parent.relative_to(top).parts
                if any(
                    not (top.joinpath(*parts[:i]) / "__init__.py").exists()
                    for i in range(len(parts))
                ):
                    continue  # below a folder that is not a package
                name = ".".join([package, *parts])
                for path in sorted(init.parent.glob("*.py")):
                    found[name if path.stem == "__init__" else f"{name}.{path.stem}"] = path
        return found

    def folder(self, module: str) -> str:
        """The node of the folder graph that ``module`` belongs to."""
        path = self.modules[module]
        if path == self.root / GROUND / "__init__.py":
            return API
        return path.relative_to(self.root).parts[0]

    def edges(self, module: str) -> list[Edge]:
        """Every edge from ``module`` to a module named ``peerckpt...``, by line."""
        path = self.modules[module]
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        found: list[tuple[int, str, str]] = []
        dynamic = False
        strings: list[ast.Constant] = []
        used: set[int] = set()  # the strings already read as an edge
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(node.lineno, a.name, "import") for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:  # a module of the package, or a name in it
                    sub = f"{base}.{alias.name}"
                    found.append((node.lineno, sub if sub in self.modules else base, "import"))
            elif isinstance(node, ast.List | ast.Tuple):
                # an argv that starts a process as a module: [..., "-m", "peerckpt.x", ...]
                for flag, name in zip(node.elts, node.elts[1:], strict=False):
                    if _text(flag) == "-m" and _text(name) is not None:
                        found.append((name.lineno, str(_text(name)), "-m"))
                        used.add(id(name))
            elif isinstance(node, ast.Call) and _called(node) in ("import_module", "__import__"):
                argument = _text(node.args[0]) if node.args else None
                if argument is None:
                    dynamic = True
                else:
                    found.append((node.lineno, argument, "import_module"))
                    used.add(id(node.args[0]))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(node)
        if dynamic:
            # A module loaded by a name computed at run time: every module named in this file
            # may be one (a table of lazy names).
            found += [
                (s.lineno, s.value, "import_module")
                for s in strings
                if s.value in self.modules and id(s) not in used
            ]
        out = {
            Edge(path, line, module, name, how)
            for line, name, how in found
            if name.split(".")[0] == "peerckpt"
        }
        return sorted(out, key=lambda e: (e.line, e.target))

    def all_edges(self) -> list[Edge]:
        return [edge for module in sorted(self.modules) for edge in self.edges(module)]


def _text(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _called(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _where(tree: Tree, edge: Edge) -> str:
    return f"{edge.path.relative_to(tree.root)}:{edge.line}"


def check(tree: Tree) -> list[str]:
    """Every problem of the folder graph: a name that is no module, a folder the rule does
    not place, an edge against the rule, a cycle; empty when the graph is a DAG that obeys
    the rule."""
    problems: list[str] = []
    graph: dict[str, dict[str, Edge]] = {}
    for edge in tree.all_edges():
        if edge.target not in tree.modules:
            problems.append(
                f"{_where(tree, edge)}: {edge.module} names {edge.target} ({edge.how}), "
                "which is no module of the tree"
            )
            continue
        mine, theirs = tree.folder(edge.module), tree.folder(edge.target)
        if mine == theirs:
            continue
        graph.setdefault(mine, {}).setdefault(theirs, edge)
        if mine not in MAY_IMPORT:
            problems.append(f"{_where(tree, edge)}: folder {mine}/ is not placed in MAY_IMPORT")
        elif theirs not in MAY_IMPORT[mine]:
            problems.append(
                f"{_where(tree, edge)}: {edge.module} ({mine}) reaches {edge.target} "
                f"({theirs}) by {edge.how}: an upward edge; {mine} may import only "
                f"{sorted(MAY_IMPORT[mine])}"
            )
        elif theirs in PUBLIC_ONLY and edge.target != f"peerckpt.{theirs}":
            problems.append(
                f"{_where(tree, edge)}: {edge.module} reaches {edge.target}, inside {theirs}/: "
                f"use the package's public surface (peerckpt.{theirs}) instead"
            )
    problems += [_cycle_message(tree, graph, cycle) for cycle in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """The cycles of the folder graph, one per strongly connected part, shortest first (a
    two-way edge is a cycle of two)."""
    found: list[list[str]] = []
    seen: set[frozenset[str]] = set()
    for start in sorted(graph):
        # the shortest way back to ``start`` (breadth first)
        paths = [[start]]
        while paths:
            path = paths.pop(0)
            for nxt in sorted(graph.get(path[-1], {})):
                if nxt == start:
                    if frozenset(path) not in seen:
                        seen.add(frozenset(path))
                        found.append(path)
                    paths = []
                    break
                if nxt not in path:
                    paths.append([*path, nxt])
    return sorted(found, key=len)


def _cycle_message(tree: Tree, graph: dict[str, dict[str, Edge]], cycle: list[str]) -> str:
    kind = "a two-way edge" if len(cycle) == 2 else "a cycle"
    steps = []
    for mine, theirs in zip(cycle, [*cycle[1:], cycle[0]], strict=True):
        edge = graph[mine][theirs]
        steps.append(f"{mine} -> {theirs} ({_where(tree, edge)}: {edge.target} by {edge.how})")
    return f"{kind} between folders: " + "; ".join(steps)


TREE = Tree(REPO)


def test_the_folder_graph_is_a_dag_that_only_goes_down() -> None:
    problems = check(TREE)
    assert not problems, "the folder graph is broken:\n" + "\n".join(problems)


def test_the_rule_itself_is_a_dag() -> None:
    graph = {mine: {theirs: None for theirs in allowed} for mine, allowed in MAY_IMPORT.items()}
    assert not _cycles(graph)  # type: ignore[arg-type]


def test_every_package_folder_of_the_repository_is_mapped_and_placed() -> None:
    # A folder at the top with an __init__.py that pyproject does not map is not installed,
    # and one the rule does not place is checked against nothing.
    mapped = {Path(folder).parts[0] for folder in TREE.package_dir.values()}
    tops = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert tops == mapped
    assert mapped == set(MAY_IMPORT) - {API}


def test_the_tree_holds_the_modules_of_every_folder() -> None:
    # The walk, not a list: nested packages and the typed messages are found.
    for name in ("peerckpt.messages", "peerckpt.recovery.planning", "peerckpt.launch.cli"):
        assert name in TREE.modules
    assert TREE.folder("peerckpt.recovery.planning") == "recovery"
    assert TREE.folder("peerckpt") == API
    assert TREE.folder("peerckpt.errors") == GROUND


def test_the_edges_include_lazy_imports_argv_modules_and_lazy_tables(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"peerckpt" = "peerckpt"\n"peerckpt.runtime" = "runtime"\n'
    )
    for folder in ("peerckpt", "runtime"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "runtime" / "rank.py").write_text("")
    (tmp_path / "peerckpt" / "probe.py").write_text(
        "import importlib, sys\n"
        "_LAZY = {'x': 'peerckpt.runtime.rank'}\n"
        "def f(name):\n"
        "    from peerckpt.runtime import rank\n"
        "    argv = [sys.executable, '-m', 'peerckpt.runtime.rank']\n"
        "    return importlib.import_module(_LAZY[name])\n"
    )
    edges = Tree(tmp_path).edges("peerckpt.probe")
    assert [(e.line, e.target, e.how) for e in edges] == [
        (2, "peerckpt.runtime.rank", "import_module"),
        (4, "peerckpt.runtime.rank", "import"),
        (5, "peerckpt.runtime.rank", "-m"),
    ]


def _scratch_copy(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    root.mkdir()
    shutil.copy(REPO / "pyproject.toml", root)
    for folder in {Path(f).parts[0] for f in TREE.package_dir.values()}:
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _plant(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code)


def test_the_checker_fails_on_an_edge_planted_in_a_scratch_copy(tmp_path: Path) -> None:
    root = _scratch_copy(tmp_path)
    assert check(Tree(root)) == []
    # An upward edge: the ground reaches the CLI inside a function.
    _plant(root / "peerckpt" / "units.py", "def _f():\n    from peerckpt.launch.cli import main\n")
    # An agent module starting a launcher's process by module name.
    _plant(
        root / "replication" / "stats.py",
        "_ARGV = ['python', '-m', 'peerckpt.launch.prefork']\n",
    )
    problems = check(Tree(root))
    assert any(
        p.startswith("peerckpt/units.py:") and "reaches peerckpt.launch.cli" in p for p in problems
    ), problems
    assert any(
        p.startswith("replication/stats.py:") and "peerckpt.launch.prefork (launch) by -m" in p
        for p in problems
    ), problems
    assert any("two-way edge between folders: launch -> peerckpt" in p for p in problems), problems


def test_the_checker_names_a_two_way_edge_between_process_packages(tmp_path: Path) -> None:
    root = _scratch_copy(tmp_path)
    _plant(root / "runtime" / "env.py", "def _f():\n    import peerckpt.replication.stats\n")
    _plant(root / "replication" / "stats.py", "def _g():\n    import peerckpt.runtime.env\n")
    problems = check(Tree(root))
    cycles = [p for p in problems if p.startswith("a two-way edge")]
    assert len(cycles) == 1, problems
    assert "replication -> runtime (replication/stats.py:" in cycles[0]
    assert "runtime -> replication (runtime/env.py:" in cycles[0]


def test_the_checker_fails_on_a_module_name_that_does_not_exist(tmp_path: Path) -> None:
    root = _scratch_copy(tmp_path)
    _plant(root / "launch" / "processes.py", "_ARGV = ['python', '-m', 'peerckpt.cli']\n")
    problems = check(Tree(root))
    assert any("names peerckpt.cli (-m), which is no module" in p for p in problems), problems


def test_every_entry_point_names_a_module_of_the_tree() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    targets = dict(project["scripts"])
    for group in project["entry-points"].values():
        targets.update(group)
    for name, target in targets.items():
        module = target.partition(":")[0]
        assert module in TREE.modules, f"entry point {name} names {module}, no module"


@pytest.mark.parametrize("folder", sorted(set(MAY_IMPORT) - {API}))
def test_each_package_says_which_process_it_is_and_what_it_may_import(folder: str) -> None:
    path = REPO / folder / "__init__.py"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "may import" in doc, f"{path}: say what the package may import"
