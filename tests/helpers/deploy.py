"""The deployment files as tools read them (tests only): docker-compose.yml and every deploy/k8s manifest
parsed with pyyaml, kustomize's components (their resources and JSON 6902 patches) and ``replacements``
applied as kustomization.yaml uses them, and the names the code derives (env variables, ports).
tests/test_deploy*.py and tests/test_keda_signal.py read them here; `kubectl kustomize` renders the real thing
(tests/test_deploy_urls.py)."""

from __future__ import annotations

import copy
import functools
from dataclasses import fields
from pathlib import Path

import yaml

from batchfleet.common.options import CONFIG_CLASSES
from batchfleet.common.optionspec import is_option, option_env
from batchfleet.gateway.config import GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
METRICS_PORT = 9400  # the manifests' choice (the option's default is 0 = off)
GATEWAY_PORT = next(f.default for f in fields(GatewayConfig) if f.name == "port")


def known_env() -> set[str]:
    """Every environment variable a batchfleet process reads: the config fields' option_env (worker and
    gateway)."""
    return {option_env(f) for cls in (*CONFIG_CLASSES, GatewayConfig) for f in fields(cls) if is_option(f)}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def _split(value: str, options: dict | None) -> tuple[list[str], int | None]:
    if not options:
        return [value], None
    return value.split(options["delimiter"]), int(options.get("index", 0))


def _replace(docs: list[dict], rep: dict) -> None:
    """kustomize's `replacements` for what kustomization.yaml uses: a source field (optionally one
    delimited part of it) written into target fields (``*`` over a list; optionally one part of them)."""
    src = rep["source"]
    (doc,) = [d for d in docs if d["kind"] == src["kind"] and d["metadata"]["name"] == src["name"]]
    value = doc
    for part in src["fieldPath"].split("."):
        value = value[part]
    parts, index = _split(value, src.get("options"))
    value = parts[index] if index is not None else value
    for target in rep["targets"]:
        sel = target["select"]
        for d in (d for d in docs if d["kind"] == sel["kind"] and d["metadata"]["name"] == sel["name"]):
            for path in target["fieldPaths"]:
                *head, leaf = path.split(".")
                nodes = [d]
                for part in head:
                    nodes = [x for n in nodes for x in (n if part == "*" else [n[part]])]
                for n in nodes:
                    parts, index = _split(str(n[leaf]), target.get("options"))
                    if index is None:
                        n[leaf] = value
                    else:
                        parts[index] = value
                        n[leaf] = target["options"]["delimiter"].join(parts)


def _json6902(doc: dict, ops: list[dict]) -> None:
    """The ``add`` and ``replace`` operations of a JSON patch (RFC 6902), what the components use."""
    for op in ops:
        *head, leaf = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for part in head:
            node = node[int(part)] if isinstance(node, list) else node[part]
        value = copy.deepcopy(op["value"])
        if op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if leaf == "-" else int(leaf), value)
        elif op["op"] in ("add", "replace"):
            if op["op"] == "replace" and (leaf not in node if isinstance(node, dict) else False):
                raise KeyError(f"replace of a missing {op['path']}")
            node[int(leaf) if isinstance(node, list) else leaf] = value
        else:
            raise NotImplementedError(op["op"])


def apply_component(docs: list[dict], folder: Path) -> None:
    """A kustomize Component: its resources added, its JSON 6902 patches applied to their targets, then its
    replacements (over everything accumulated so far: the parent's resources too)."""
    comp = yaml.safe_load((folder / "kustomization.yaml").read_text())
    for res in comp.get("resources") or []:
        docs += [d for d in yaml.safe_load_all((folder / res).read_text()) if d]
    for patch in comp.get("patches") or []:
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        target = patch["target"]
        for d in docs:
            if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]:
                _json6902(d, ops)
    for rep in comp.get("replacements") or []:
        _replace(docs, rep)


def redis_url() -> str:
    """The Redis URL (password redacted) redis-target/ was written for (scripts/k8s_redis.py): the one the
    ScaledObject's triggers point at, and the Secret batchfleet-redis holds."""
    return of_kind("ScaledObject")["batchfleet-worker"]["metadata"]["annotations"]["batchfleet.io/redis-url"]


def manifests() -> list[dict]:
    """Every object of deploy/k8s as `kubectl apply -k` applies it: its replacements applied (a fresh copy:
    callers may change it)."""
    return copy.deepcopy(_rendered())


def render(k8s: Path = K8S) -> list[dict]:
    """Every object of the manifests in ``k8s`` as `kubectl apply -k` applies them (components, then the
    kustomization's replacements)."""
    kust = yaml.safe_load((k8s / "kustomization.yaml").read_text())
    docs = []
    for path in sorted(p for p in k8s.glob("*.yaml") if p.name != "kustomization.yaml"):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for folder in kust.get("components") or []:
        apply_component(docs, k8s / folder)
    for rep in kust.get("replacements", []):
        _replace(docs, rep)
    return docs


@functools.cache
def _rendered() -> list[dict]:  # parsed once per test process: pyyaml is slow
    return render(K8S)


def of_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests() if d.get("kind") == kind}


def configmap_env() -> dict[str, str]:
    return of_kind("ConfigMap")["batchfleet-env"]["data"]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}
