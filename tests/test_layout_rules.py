"""The reshaping rules (issue 28) the import table of tests/test_layout.py does not cover, read from the source
(AST and text, no imports of the product): only the product in the package, Lua in one module per side, one
Redis layer and APIRouters in the gateway, one parameter type, priority carried once by the stream."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.helpers.imports import imports_of, modules

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# package modules that nothing in the packages imports, and why they are still the product
ENTRY_POINTS = {
    "batchfleet.producer.rq": "RQ enqueues its job functions by dotted name",
    "batchfleet.worker.health": "the Kubernetes probe runs `python -m batchfleet.worker.health`",
}
LUA_HOMES = {"common/redis/functions.py", "worker/transport/scripts.py"}  # the producer side's, the worker side's
REDIS_CLIENT_MAKERS = {"AsyncClient", "async_client", "sync_client", "Redis", "from_url", "dashboard_client"}
HTTP_METHODS = {"get", "post", "put", "patch", "delete", "api_route"}


def package_files() -> list[Path]:
    return sorted(p for folder in ("common", "producer", "worker", "gateway") for p in (ROOT / folder).rglob("*.py"))


def test_every_package_module_is_the_product():
    """A module of the packages is imported by another one, or is an entry point: never tooling that only
    scripts/ or tests/ use (those live in scripts/benchlib/ and tests/helpers/)."""
    mods = modules()
    commands = (ROOT / "common" / "cli.py").read_text()
    imported = {m for name, path in mods.items() for m in imports_of(path) if m != name}
    for name, path in mods.items():
        if name in imported or name in ENTRY_POINTS or path.name in ("__init__.py", "__main__.py"):
            continue
        assert f'"{name}:' in commands, f"{name} is used by nothing in the packages (tooling belongs in scripts/)"


def test_lua_lives_in_one_module_per_side():
    for path in package_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel not in LUA_HOMES:
            assert not re.search(r"redis\.p?call\(", path.read_text()), f"{rel} holds Lua"


def test_only_the_gateways_connections_module_makes_redis_clients():
    for path in (ROOT / "gateway").rglob("*.py"):
        if path.name == "connections.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                assert name not in REDIS_CLIENT_MAKERS, f"gateway/{path.name}:{node.lineno} makes a Redis client"


def test_gateway_routes_are_on_module_level_routers():
    """Every route is a module-level function on a module-level APIRouter (the key check is the router's
    dependency): no route closures inside create_app."""
    for path in (ROOT / "gateway").rglob("*.py"):
        tree = ast.parse(path.read_text())
        made = [n for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                and getattr(n.value.func, "id", "") == "APIRouter"]
        routers = {t.id for n in made for t in n.targets if isinstance(t, ast.Name)}
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if isinstance(target, ast.Attribute) and target.attr in HTTP_METHODS:
                    where = f"gateway/{path.name}:{node.lineno} {node.name}"
                    assert id(node) in top, f"{where}: a route defined inside a function"
                    assert getattr(target.value, "id", None) in routers, f"{where}: not on a module-level APIRouter"


def dataclass_fields(path: Path) -> dict[str, set[str]]:
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            out[node.name] = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign)
                              and isinstance(s.target, ast.Name)}
    return out


def test_generation_parameters_are_declared_once():
    """Only common/wire/params.py's Params declares the generation parameters; the wire Request and the engine's
    GenRequest embed it, and the wire carries no priority (the stream an entry is on is its priority)."""
    from_table = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos"}
    for path in package_files():
        for cls, names in dataclass_fields(path).items():
            if path.name == "params.py" and cls == "Params":
                assert from_table <= names
                continue
            assert not names & from_table, f"{path.relative_to(ROOT)} {cls} redeclares {sorted(names & from_table)}"
    wire = dataclass_fields(ROOT / "common" / "wire" / "protocol.py")["Request"]
    assert "params" in wire and "priority" not in wire
    assert "params" in dataclass_fields(ROOT / "worker" / "engine" / "base.py")["GenRequest"]
