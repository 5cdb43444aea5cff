"""The package's shape: what each top-level package may import (every import of every file, at top level
or inside a function), imports that run one way, no mixins, files near 400 lines flagged, unit test modules
that import no torch (the maps of the tree in README and docs/ARCHITECTURE.md: tests/test_docs.py). Static
checks (AST) are unit; the two checks in a clean subprocess are integration."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.helpers.imports import (
    PACKAGES,
    ROOT,
    imported_at_load,
    imported_names,
    imports_of,
    modules,
    top_package,
    tree_of,
)

ANYTHING = None  # scripts/ and tests/ may import any package
# Which top-level packages each one may import: the client (producer) and the worker share only common; the
# gateway is a client. A name that is not in this table may not be imported by any package.
MAY_IMPORT: dict[str, set[str] | None] = {
    "common": {"common"},
    "producer": {"common", "producer"},
    "worker": {"common", "worker"},
    "gateway": {"common", "producer", "gateway"},
    "scripts": ANYTHING,
    "tests": ANYTHING,
}
# Inside the worker package, the two programs that run a whole fleet on one machine also drive it as a client
# would (the worker itself never imports the client); the longest matching path wins.
MAY_IMPORT_WITHIN = {
    "worker/demo.py": {"common", "worker", "producer"},
    "worker/benchmark": {"common", "worker", "producer"},
}
# Inside each package, the role subfolders import one way: each may import the subfolders its row names (and
# its package's top-level modules: the shared base and the composition roots), never a subfolder above it.
# Every subfolder has a row.
SUBFOLDER_MAY_IMPORT: dict[str, set[str]] = {
    "common/wire": set(),
    "common/redis": {"common/wire"},
    "producer/bulk": set(),
    "producer/ops": {"producer/bulk"},
    "gateway/openai": set(),
    "gateway/batches": {"gateway/openai"},
    "gateway/cli": {"gateway/batches", "gateway/openai"},
    "worker/engine": set(),
    "worker/transport": set(),
    "worker/batching": set(),
    "worker/requests": {"worker/engine", "worker/transport", "worker/batching"},
    "worker/benchmark": {"worker/engine", "worker/transport", "worker/requests", "worker/batching"},
}
WARN_LINES = 400  # past this a file is flagged (a warning, not a failure)
CODE_SUFFIXES = {".py", ".c", ".h", ".sh", ".js", ".html"}
HEAVY = {"torch", "transformers"}  # seconds to import: never at a unit test module's collection

# Cases that break a rule below at the time of writing, each being removed by its own change; the lead
# empties this after merging them. Nothing may be added here.
KNOWN_VIOLATIONS_TO_REMOVE: dict[str, set[str]] = {
    # (file, top-level package it imports) that MAY_IMPORT refuses
    "imports": set(),
}


def folder_of(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def may_import(path: Path) -> set[str] | None:
    """The top-level packages a file may import: its folder's row, or the longest MAY_IMPORT_WITHIN match."""
    rel = path.relative_to(ROOT).as_posix()
    within = [k for k in MAY_IMPORT_WITHIN if rel == k or rel.startswith(k + "/")]
    return MAY_IMPORT_WITHIN[max(within, key=len)] if within else MAY_IMPORT[folder_of(path)]


@functools.cache
def every_python_file() -> tuple[Path, ...]:
    return tuple(p for folder in MAY_IMPORT for p in sorted((ROOT / folder).rglob("*.py")))


@pytest.mark.unit
def test_the_table_names_every_top_level_package():
    tops = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {"scripts"}
    assert tops == set(MAY_IMPORT)
    assert all((ROOT / k).exists() for k in MAY_IMPORT_WITHIN)


@pytest.mark.unit
def test_every_import_of_every_file_is_one_its_package_may_make():
    bad = set()
    for path in every_python_file():
        allowed = may_import(path)
        if allowed is ANYTHING:
            continue
        for name in imported_names(path):
            top = top_package(name)
            if top is not None and top not in allowed:
                bad.add(f"{path.relative_to(ROOT)} -> {top}")
    assert bad <= KNOWN_VIOLATIONS_TO_REMOVE["imports"], sorted(bad - KNOWN_VIOLATIONS_TO_REMOVE["imports"])
    assert not KNOWN_VIOLATIONS_TO_REMOVE["imports"] - bad, "fixed: remove from KNOWN_VIOLATIONS_TO_REMOVE"


@pytest.mark.unit
def test_no_package_imports_tests_or_scripts():
    for path in every_python_file():
        if folder_of(path) in PACKAGES:
            bad = {n for n in imported_names(path) if top_package(n) in ("tests", "scripts")}
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.unit
def test_the_client_packages_import_no_torch_anywhere():
    """common, producer and gateway run without the worker's stack (`pip install batchfleet`)."""
    for path in every_python_file():
        if folder_of(path) in ("common", "producer", "gateway"):
            heavy = {n.split(".")[0] for n in imported_names(path)} & HEAVY
            assert not heavy, f"{path.relative_to(ROOT)} imports {heavy}"


@pytest.mark.unit
def test_code_files_near_400_lines_are_flagged():
    """One idea per file, its size following the idea: no hard limit (splitting a file to stay under one
    scattered ideas over several files); a file past WARN_LINES gets a warning in the test report, a hint
    to see whether it holds two ideas."""
    long = {}
    for folder in MAY_IMPORT:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in CODE_SUFFIXES and "__pycache__" not in path.parts:
                if (n := len(path.read_text().splitlines())) > WARN_LINES:
                    long[str(path.relative_to(ROOT))] = n
    for name, n in sorted(long.items()):
        warnings.warn(f"{name}: {n} lines; does it hold one idea?", stacklevel=1)


def unit_test_modules() -> list[Path]:
    return [p for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.unit" in p.read_text()]


@pytest.mark.unit
def test_unit_test_modules_import_no_torch_at_collection():
    """A module with unit tests imports torch/transformers (directly or through any module it loads) only
    inside the tests or fixtures that need them: `pytest -m unit` collects in a few seconds."""
    assert len(unit_test_modules()) > 10
    for path in unit_test_modules():
        heavy = imported_at_load(path) & HEAVY
        assert not heavy, f"{path.relative_to(ROOT)} imports {heavy} when collected"


@pytest.mark.unit
def test_the_load_closure_sees_through_repository_modules():
    """The check above follows imports: a test module importing the native engine loads torch."""
    engine = ROOT / "worker" / "engine" / "native" / "engine.py"
    assert "torch" in imported_at_load(engine)
    assert "torch" not in imported_at_load(ROOT / "producer" / "cli.py")


@pytest.mark.unit
def test_engine_imports_run_one_way():
    """Implementations (hf, native) import the engine's base/sampling/models; never the other way; the
    engine never imports the loop, the transport or the benchmarks."""
    for name, path in modules().items():
        deps = imports_of(path)
        if name.startswith("batchfleet.worker.engine") and not name.startswith("batchfleet.worker.engine.native"):
            assert not {m for m in deps if m.startswith("batchfleet.worker.engine.native")}, name
            assert not {m for m in deps if m.startswith("batchfleet.worker.engine.hf")} or name.endswith(".hf"), name
        if name.startswith("batchfleet.worker.engine"):
            outside = {m for m in deps if m.startswith("batchfleet.worker") and ".engine" not in m}
            assert not outside, f"{name} imports {outside}"


@pytest.mark.unit
def test_no_import_cycles_between_modules():
    graph = {name: imports_of(path) - {name} for name, path in modules().items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join([*trail[trail.index(dep):], dep]))
            if dep not in state:
                visit(dep, [*trail, dep])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


@pytest.mark.unit
def test_no_mixins():
    for name, path in modules().items():
        for node in ast.walk(tree_of(path)):
            if isinstance(node, ast.ClassDef):
                assert "Mixin" not in node.name, name
                bases = [ast.unparse(b) for b in node.bases]
                assert not any("Mixin" in b for b in bases), f"{name}.{node.name}({bases})"


# --- in a clean interpreter (subprocesses: integration) ------------------------------------------------

def test_producer_imports_no_torch_when_run():
    code = "import sys, batchfleet.producer, batchfleet.producer.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


@pytest.mark.parametrize("top", ["common", "producer", "worker", "gateway"])
def test_top_level_names_are_not_claimed(top, tmp_path):
    """Only batchfleet.* is installed: a web backend's own `common` or `worker` is never shadowed."""
    proc = subprocess.run([sys.executable, "-c", f"import {top}"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr
    subprocess.run([sys.executable, "-c", f"import batchfleet.{top}"], cwd=tmp_path, check=True)


def subfolder_of(module: str) -> str | None:
    """``batchfleet.worker.requests.table`` -> ``worker/requests``; None for a package's top-level module."""
    parts = module.split(".")
    if len(parts) < 4 or parts[0] != "batchfleet":
        return None
    folder = "/".join(parts[1:3])
    return folder if (ROOT / folder).is_dir() else None


@pytest.mark.unit
def test_every_role_subfolder_has_a_row():
    found = {p.parent.relative_to(ROOT).as_posix() for top in PACKAGES for p in (ROOT / top).glob("*/__init__.py")}
    assert found == set(SUBFOLDER_MAY_IMPORT)


@pytest.mark.unit
def test_role_subfolders_import_one_way():
    """Between packages MAY_IMPORT rules; within one, SUBFOLDER_MAY_IMPORT."""
    bad = set()
    for name, path in modules().items():
        here = subfolder_of(name)
        if here is None:
            continue
        for dep in imports_of(path):
            there = subfolder_of(dep)
            same_package = there is not None and there.split("/")[0] == here.split("/")[0]
            if same_package and there != here and there not in SUBFOLDER_MAY_IMPORT[here]:
                bad.add(f"{here} -> {there} ({name} imports {dep})")
    assert not bad, sorted(bad)
