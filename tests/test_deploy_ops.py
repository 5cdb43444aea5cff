"""What an operator deploys (issue 19): the compose stack's gateway, Prometheus and Grafana, and the
Kubernetes manifests' image pinning, API-key Secret, /models volume, ServiceMonitor, KEDA settings taken
from the workers' ConfigMap, and requests that fit a small cluster. Parsed with pyyaml (no Docker, no
cluster); `kubectl kustomize` renders the real thing when kubectl is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.helpers.deploy import (
    GATEWAY_PORT,
    K8S,
    METRICS_PORT,
    ROOT,
    apply_component,
    compose,
    configmap_env,
    container,
    env_of,
    known_env,
    kustomization,
    manifests,
    of_kind,
)
from tests.helpers.deploy import redis_url as shipped_redis_url

SMALL_NODE = {"cpu": 4.0, "memory_gi": 16.0}  # one node of a small cluster
SMALL_CLUSTER = {"cpu": 12.0, "memory_gi": 48.0}  # three of them


def cpu(value: str | int) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def gib(value: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1.0}
    return float(value[:-2]) * units[value[-2:]]


# ---- compose -------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_compose_gateway_published_with_the_api_key_from_the_environment():
    gw = compose()["services"]["gateway"]
    assert gw["command"][:1] == ["serve"] and gw["command"][gw["command"].index("--host") + 1] == "0.0.0.0"
    port = int(gw["command"][gw["command"].index("--port") + 1])
    assert port == GATEWAY_PORT
    (published,) = gw["ports"]
    assert published.endswith(f":{port}") and published.startswith("127.0.0.1:")
    key = gw["environment"]["BATCHFLEET_API_KEY"]
    assert re.fullmatch(r"\$\{BATCHFLEET_API_KEY:\?.+\}", key), "required, from the environment, never a literal"
    assert set(gw["environment"]) <= known_env()
    assert int(gw["environment"]["BATCHFLEET_METRICS_PORT"]) == METRICS_PORT


@pytest.mark.unit
def test_compose_prometheus_scrapes_workers_and_gateway_with_the_rules():
    services = compose()["services"]
    prom = services["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"] and (ROOT / "deploy/prometheus/alerts.yml").exists()
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    (dns,) = jobs["batchfleet-worker"]["dns_sd_configs"]
    assert dns["names"] == ["worker"] and dns["port"] == METRICS_PORT  # every scaled worker container
    assert int(services["worker"]["environment"]["BATCHFLEET_METRICS_PORT"]) == METRICS_PORT
    (static,) = jobs["batchfleet-gateway"]["static_configs"]
    assert static["targets"] == [f"gateway:{METRICS_PORT}"]
    assert not re.search(r":latest$", prom["image"]) and not re.search(r":latest$", services["grafana"]["image"])


@pytest.mark.unit
def test_compose_grafana_provisions_the_dashboard():
    grafana = compose()["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_path = mounts["./deploy/grafana/batchfleet-dashboard.json"]
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/batchfleet.yml").read_text())
    assert dash_path.startswith(provider["providers"][0]["options"]["path"] + "/")
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090" and ds["datasources"][0]["isDefault"]
    assert json.loads((ROOT / "deploy/grafana/batchfleet-dashboard.json").read_text())["uid"] == "batchfleet"


# ---- Kubernetes ---------------------------------------------------------------------------------------
def containers() -> list[dict]:
    out = []
    for kind in ("Deployment", "StatefulSet"):
        out += [container(d) for d in of_kind(kind).values()]
    return out


@pytest.mark.unit
def test_image_pinned_by_kustomize_never_a_pulled_latest():
    (entry,) = [i for i in kustomization()["images"] if i["name"] == "batchfleet"]
    assert entry["newTag"] and entry["newTag"] != "latest" and "/" in entry["newName"]
    for c in containers():
        assert not c["image"].endswith(":latest"), c["name"]
        assert c.get("imagePullPolicy") == "IfNotPresent", c["name"]
    assert {container(d)["image"] for d in of_kind("Deployment").values()} == {"batchfleet"}
    docs = (ROOT / "docs" / "OPERATIONS.md").read_text()
    assert "docker build -t" in docs and "docker push" in docs and "kustomize edit set image" in docs


@pytest.mark.unit
def test_gateway_api_key_from_a_secret():
    env = {e["name"]: e for e in container(of_kind("Deployment")["batchfleet-gateway"])["env"]}
    ref = env["BATCHFLEET_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "batchfleet-api-key", "key": "BATCHFLEET_API_KEY"}
    assert "BATCHFLEET_API_KEY" not in configmap_env(), "a key never sits in the ConfigMap"
    assert "create secret generic batchfleet-api-key" in (K8S / "kustomization.yaml").read_text()
    assert "create secret generic batchfleet-api-key" in (ROOT / "docs" / "OPERATIONS.md").read_text()


@pytest.mark.unit
def test_the_models_volume_only_with_its_component_read_only():
    """Built-in presets need no volume: the shipped workers mount none (a claim a default storage class cannot
    bind kept them Pending); the component components/models adds the claim, the read-only mount and the
    checkpoint's path."""
    plain = of_kind("Deployment")["batchfleet-worker"]
    assert "/models" not in [m["mountPath"] for m in container(plain)["volumeMounts"]]
    assert "batchfleet-models" not in of_kind("PersistentVolumeClaim")
    docs = manifests()
    apply_component(docs, K8S / "components" / "models")
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "batchfleet-worker")
    c = container(dep)
    assert env_of(c)["BATCHFLEET_MODEL"].startswith("/models/")
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/models"]
    assert mount["readOnly"] is True
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"] or "ReadOnlyMany" in pvc["spec"]["accessModes"]


@pytest.mark.unit
def test_service_monitor_scrapes_workers_and_gateway():
    (sm,) = of_kind("ServiceMonitor").values()
    selector = sm["spec"]["selector"]["matchLabels"]
    (endpoint,) = sm["spec"]["endpoints"]
    scraped = [s for s in of_kind("Service").values()
               if selector.items() <= s["metadata"].get("labels", {}).items()]
    apps = set()
    for svc in scraped:
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert endpoint["port"] in ports
        target = ports[endpoint["port"]]["targetPort"]
        assert target in (METRICS_PORT, "metrics")
        apps.add(svc["spec"]["selector"]["app"])
    assert apps == {"batchfleet-worker", "batchfleet-gateway"}


@pytest.mark.unit
def test_keda_reads_capacity_and_cap_from_the_configmaps_and_no_redis():
    """The raw keda.yaml holds placeholders for the capacity, the cap and Prometheus' address (kustomize's
    replacements write the ConfigMaps' values in) and nothing about Redis: KEDA reads the gateways' gauge."""
    raw = [d for d in yaml.safe_load_all((K8S / "keda.yaml").read_text()) if d][0]
    words = raw["spec"]["advanced"]["scalingModifiers"]["formula"].split(" ")
    assert [words[2], *words[5:8]] == ["INTERACTIVE_UTILIZATION", "MAX_RUNNING", "*", "BACKGROUND_MAX_WORKERS"]
    assert "BATCHFLEET_REDIS_URL" not in configmap_env(), "the URL may hold a password: it is in the Secret"
    env = configmap_env()
    so = of_kind("ScaledObject")["batchfleet-worker"]
    assert so["spec"]["minReplicaCount"] == 0
    assert env["BATCHFLEET_SCALE_TO_ZERO"] == "true", "workers keep the fleet description at zero replicas"
    for t in so["spec"]["triggers"]:
        assert not {"address", "addresses", "stream", "password"} & set(t["metadata"]) and "authenticationRef" not in t
    assert not [d for d in manifests() if d["kind"] == "TriggerAuthentication"]
    assert so["metadata"]["annotations"]["batchfleet.io/redis-url"] == shipped_redis_url()


@pytest.mark.unit
def test_requests_fit_a_small_cluster():
    so = of_kind("ScaledObject")["batchfleet-worker"]
    total_cpu = total_mem = 0.0
    for d in [*of_kind("Deployment").values(), *of_kind("StatefulSet").values()]:
        req = container(d)["resources"]["requests"]
        assert cpu(req["cpu"]) <= SMALL_NODE["cpu"] / 2 and gib(req["memory"]) <= SMALL_NODE["memory_gi"] / 2
        replicas = so["spec"]["maxReplicaCount"] if d["metadata"]["name"] == "batchfleet-worker" else \
            d["spec"].get("replicas", 1)
        total_cpu += replicas * cpu(req["cpu"])
        total_mem += replicas * gib(req["memory"])
    assert total_cpu <= SMALL_CLUSTER["cpu"] and total_mem <= SMALL_CLUSTER["memory_gi"], (total_cpu, total_mem)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) is not installed")
def test_kubectl_kustomize_renders_what_these_tests_check():
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True)
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    (so,) = [d for d in rendered if d["kind"] == "ScaledObject"]
    assert so["spec"] == of_kind("ScaledObject")["batchfleet-worker"]["spec"]  # replacements: formula words too
    (entry,) = kustomization()["images"]
    for d in rendered:
        if d["kind"] == "Deployment":
            assert container(d)["image"] == f"{entry['newName']}:{entry['newTag']}"
    assert len(rendered) == len(manifests())
    assert env_of(container(of_kind("Deployment")["batchfleet-worker"]))["BATCHFLEET_THREADS"] == "2"
