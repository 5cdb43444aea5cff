"""The package's shape: one import namespace, imports that run one way, no mixins, a README map that
matches the tree. Static checks (AST) plus clean subprocesses; no Redis, no model."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # pure: no Redis, no model, no subprocess

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"common": "batchfleet.common", "producer": "batchfleet.producer", "worker": "batchfleet.worker",
            "gateway": "batchfleet.gateway"}


def modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the packages."""
    out = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


def imports_of(path: Path) -> set[str]:
    """Every batchfleet module a file imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("batchfleet.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchfleet."):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    mods = modules()
    return {m for m in found if m in mods}


def test_common_imports_neither_producer_nor_worker():
    for name, path in modules().items():
        if name.startswith("batchfleet.common"):
            bad = {m for m in imports_of(path) if not m.startswith("batchfleet.common")}
            assert not bad, f"{name} imports {bad}"


def test_producer_imports_no_worker_and_no_torch():
    for name, path in modules().items():
        if name.startswith("batchfleet.producer"):
            assert not {m for m in imports_of(path) if m.startswith("batchfleet.worker")}, name
    code = "import sys, batchfleet.producer, batchfleet.producer.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


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


def test_no_mixins():
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert "Mixin" not in node.name, name
                bases = [ast.unparse(b) for b in node.bases]
                assert not any("Mixin" in b for b in bases), f"{name}.{node.name}({bases})"


@pytest.mark.parametrize("top", ["common", "producer", "worker", "gateway"])
def test_top_level_names_are_not_claimed(top, tmp_path):
    """Only batchfleet.* is installed: a web backend's own `common` or `worker` is never shadowed."""
    proc = subprocess.run([sys.executable, "-c", f"import {top}"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr
    subprocess.run([sys.executable, "-c", f"import batchfleet.{top}"], cwd=tmp_path, check=True)


def test_readme_map_matches_the_tree():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Where things are"):text.index("### Request lifecycle")]
    for path in re.findall(r"`((?:common|producer|worker|gateway|scripts|tests)/[^`]*)`", section):
        assert (ROOT / path.rstrip("/")).exists(), f"README names {path}, which does not exist"
    for path in modules().values():
        if path.name not in ("__init__.py", "__main__.py"):
            assert path.name in section or path.stem in section, f"README's map does not mention {path}"
