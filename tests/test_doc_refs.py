"""Every file, folder and test a document names exists: the docs describe the code as it is.

A reference is a path in backticks (`runtime/pg.py`, `tests/test_jobs.py::test_name`,
`bench/results/scale.json`) or a relative link target, in README.md and docs/*.md. A path
resolves when it exists from the repository's root or from the document's folder, or, for a
short form such as `launch/monitor.py` or `recovery.json`, when the tail of some file's
path in the repository matches it (results by their name, modules by their folder and
name); a result no benchmark has written here yet (a GPU's) resolves to the benchmark that
writes it. A `file::name` reference must name a function or class defined in that file.
Paths a job or the user creates (under /tmp, /dev/shm, `~`, a run directory, a URL, a glob)
are not references.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SUFFIXES = (".py", ".md", ".json", ".toml", ".sh", ".yaml", ".yml", ".txt", ".cfg")
# Not the repository's: the design beside it, other projects' sources, and names of files a
# job makes (placeholders in capitals)
ELSEWHERE = ("DESIGN.md", "STYLE.md", "ray/", "torch/", "torchft/")
MADE = {"result.json", "job.json", "NAME.json", "report.json"}
SKIP_DIRS = {".git", ".venv", "build", "node_modules", "__pycache__", ".mypy_cache"}

TICKED = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _candidate(token: str) -> str | None:
    """The path a backticked token names, or None when it is not a repository path."""
    token = token.rstrip(".,;:")
    if "://" in token or token.startswith(("/", "~", "$", "-", "<", "../shared")):
        return None
    if any(c in token for c in "*?{}[]=<>|\"'(),…"):
        return None
    if token.startswith(ELSEWHERE) or token in MADE:
        return None
    base = token.split("::", 1)[0]
    if base.endswith("/"):
        base = base.rstrip("/")
        return token if "/" in base and not base.startswith(".") else None
    if not base.endswith(SUFFIXES):
        return None
    if base.startswith("."):
        return None
    return token


@cache
def _files() -> tuple[str, ...]:
    out = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        out.append(rel.as_posix())
    return tuple(out)


def _resolve(doc: Path, ref: str) -> Path | None:
    for root in (REPO, doc.parent):
        if (root / ref).exists():
            return root / ref
    if ref.startswith("bench/results/"):  # not measured here yet (a GPU's): its writer
        name = ref.rpartition("/")[2]
        writers = [p for p in sorted((REPO / "bench").glob("*.py")) if name in p.read_text()]
        return writers[0] if writers else None
    tails = [f for f in _files() if f == ref or f.endswith("/" + ref)]
    return REPO / tails[0] if len(tails) >= 1 else None


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    names = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    return name.split("[", 1)[0].split("::")[-1] in names


def _shown(doc: Path) -> str:
    return doc.relative_to(REPO).as_posix() if doc.is_relative_to(REPO) else doc.name


def references(doc: Path) -> list[tuple[int, str]]:
    """(line number, reference) for every repository path the document names."""
    found = []
    in_code = False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for token in TICKED.findall(line):
            ref = _candidate(token)
            if ref is not None:
                found.append((number, ref))
        for target in LINK.findall(line):
            if "://" not in target and not target.startswith(("mailto:", "/", "../shared")):
                found.append((number, target))
    return found


def broken(doc: Path) -> list[str]:
    """What the document names that does not exist, as ``doc:line: reference``."""
    out = []
    for number, ref in references(doc):
        path, _, name = ref.partition("::")
        where = f"{_shown(doc)}:{number}: {ref}"
        resolved = _resolve(doc, path)
        if resolved is None:
            out.append(where)
        elif name and resolved.suffix == ".py" and not _defines(resolved, name):
            out.append(f"{where} (no {name} in {resolved.relative_to(REPO)})")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(REPO).as_posix())
def test_every_reference_of_a_document_resolves(doc: Path) -> None:
    assert not broken(doc), "references to nothing:\n" + "\n".join(broken(doc))


def test_a_reference_to_nothing_is_found(tmp_path: Path) -> None:
    doc = tmp_path / "planted.md"
    (tmp_path / "beside.md").write_text("")
    doc.write_text(
        "See `runtime/no_such_module.py` and `tests/test_jobs.py::test_not_a_test`,\n"
        "but `runtime/pg.py`, `launch/monitor.py`, `scale.json` and [a](beside.md) exist;\n"
        "[b](gone.md) does not.\n"
    )
    assert broken(doc) == [
        "planted.md:1: runtime/no_such_module.py",
        "planted.md:1: tests/test_jobs.py::test_not_a_test"
        " (no test_not_a_test in tests/test_jobs.py)",
        "planted.md:3: gone.md",
    ]


EXTRA = re.compile(r"install ['\"]?peerckpt\[([a-z0-9_-]+)\]")


def test_every_extra_named_to_the_user_is_declared() -> None:
    """``pip install 'peerckpt[X]'`` in a document, a message or a docstring names an extra
    that pyproject.toml declares (a message that sends the user to a missing extra fails)."""
    import tomllib

    declared = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    named: dict[str, set[str]] = {}
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO)
        if (
            rel.parts[0] in SKIP_DIRS
            or rel.parts[0] == "tests"
            or path.suffix not in (".py", ".md")
        ):
            continue
        for extra in EXTRA.findall(path.read_text(errors="replace")):
            named.setdefault(extra, set()).add(str(rel))
    assert named, "no extra is named anywhere: the pattern is wrong"
    missing = {extra: sorted(where) for extra, where in named.items() if extra not in declared}
    assert not missing, f"extras named but not declared in pyproject.toml: {missing}"
