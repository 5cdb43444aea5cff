"""Reading the repository's imports statically (AST), for tests/test_layout.py: what a file imports (at top
level or anywhere), which repository package an import name belongs to, and what importing a file loads."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"common": "batchfleet.common", "producer": "batchfleet.producer", "worker": "batchfleet.worker",
            "gateway": "batchfleet.gateway"}


def top_package(module: str) -> str | None:
    """The top-level package of the repository an absolute import names, or None for third-party code."""
    parts = module.split(".")
    if parts[0] == "batchfleet" and len(parts) > 1 and parts[1] in PACKAGES:
        return parts[1]
    if parts[0] in ("tests", "scripts"):
        return parts[0]
    if parts[0] == "benchlib":  # scripts/benchlib, as the scripts import it (scripts/ on sys.path)
        return "scripts"
    return None


@functools.cache
def tree_of(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@functools.cache
def imported_names(path: Path, top_level_only: bool = False) -> frozenset[str]:
    """Every module name a file imports (``from m import x`` gives m and m.x); relative imports resolved
    against the file's package. ``top_level_only``: only what runs at import (not inside functions/classes
    or ``if TYPE_CHECKING``)."""
    tree = tree_of(path)
    if top_level_only:
        nodes = []
        todo = list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo += node.orelse
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                todo += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
                todo += [s for h in getattr(node, "handlers", ()) for s in h.body]
            else:
                nodes.append(node)
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = dotted(path).split(".")[: -node.level]
                base = ".".join([*package, *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return frozenset(found)


def dotted(path: Path) -> str:
    """The import name of a file of the packages, scripts/ or tests/."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    if parts[0] in PACKAGES:
        return ".".join(["batchfleet", *parts])
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the packages."""
    return {dotted(p): p for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """Every batchfleet module a file imports, at top level or inside functions."""
    mods = modules()
    return {m for m in imported_names(path) if m in mods}


def file_of(module: str) -> Path | None:
    """The repository file of an import name (a module or a package), or None for third-party code."""
    parts = module.split(".")
    if parts[0] == "batchfleet":
        parts = parts[1:]
    for candidate in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if parts and candidate.exists():
            return candidate
    return None


def imported_at_load(path: Path) -> set[str]:
    """Third-party top-level names importing ``path`` loads: its top-level imports, followed through every
    repository module they import at top level (and the packages above each)."""
    seen: set[Path] = set()
    third_party: set[str] = set()
    todo = [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for name in imported_names(current, top_level_only=True):
            parts = name.split(".")
            files = [file_of(".".join(parts[:i])) for i in range(1, len(parts) + 1)]
            if top_package(name) is None and parts[0] != "batchfleet":
                third_party.add(parts[0])
            todo += [f for f in files if f is not None]
    return third_party
