"""Deployment files agree with the code: docker-compose.yml, the Dockerfile and every deploy/k8s manifest
are parsed (pyyaml) and checked for the settings issue #11 requires and for names (streams, group, env
vars, ports) derived from the code, so they cannot drift. Also the cgroup-aware memory sizing. No
Docker, no cluster."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from batchfleet.common.keys import Keys
from batchfleet.common.optionspec import is_option, option_flag
from batchfleet.gateway.config import GatewayConfig
from batchfleet.worker.engine.native import memlimit
from tests.helpers.deploy import (
    GATEWAY_PORT,
    K8S,
    METRICS_PORT,
    ROOT,
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


# ---- compose + Dockerfile ---------------------------------------------------------------------------
@pytest.mark.unit
def test_compose_worker_threads_cpus_memory_cache():
    w = compose()["services"]["worker"]
    env = w["environment"]
    assert "BATCHFLEET_THREADS" in env
    assert env["BATCHFLEET_THREADS"] == w["cpus"], "threads = the CPUs this worker's cgroup gets"
    assert w["mem_limit"], "a memory limit, so the KV pool is sized from the cgroup, not the host"
    assert env["BATCHFLEET_CACHE_DIR"] == "/cache"
    assert any(str(v).split(":")[1] == "/cache" for v in w["volumes"] if not str(v).startswith(".")), \
        "the /cache dir (presets, compiled kernel) is a volume"
    assert w["stop_grace_period"] and int(str(w["stop_grace_period"]).rstrip("s")) >= 60


@pytest.mark.unit
def test_compose_no_sleep_race_and_healthchecks():
    services = compose()["services"]
    for name, svc in services.items():
        cmd = " ".join(map(str, svc.get("command") or [])) + " ".join(map(str, svc.get("entrypoint") or []))
        assert not re.search(r"\bsleep\b", cmd), f"{name} waits with sleep"
    health = services["worker"]["healthcheck"]["test"]
    assert "batchfleet.worker.health" in " ".join(health)
    assert services["producer"]["depends_on"]["worker"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.unit
def test_metrics_bind_localhost_unless_the_deployment_says_otherwise():
    from batchfleet.common.config import WorkerConfig

    assert WorkerConfig().metrics_host == GatewayConfig().metrics_host == "127.0.0.1"
    for name in ("worker", "gateway"):  # Prometheus scrapes them from its own container
        env = compose()["services"][name]["environment"]
        assert env["BATCHFLEET_METRICS_HOST"] == "0.0.0.0" and env["BATCHFLEET_METRICS_PORT"]  # noqa: S104


@pytest.mark.unit
def test_compose_redis_fsyncs_every_write():
    cmd = compose()["services"]["redis"]["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert cmd[cmd.index("--appendfsync") + 1] == "always"


@pytest.mark.unit
def test_compose_env_names_and_streams_match_the_code():
    for name, svc in compose()["services"].items():
        unknown = {k for k in svc.get("environment", {}) if k.startswith("BATCHFLEET_")} - known_env()
        assert not unknown, f"{name}: {unknown} is not a batchfleet setting"
        url = svc.get("environment", {}).get("BATCHFLEET_REDIS_URL")
        if url:
            assert urlsplit(url).hostname in compose()["services"]


@pytest.mark.unit
def test_dockerfile_cpu_torch_by_default_gpu_by_arg():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r'^ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"$', text, re.M)
    install = next(line for line in text.splitlines() if "pip install" in line and "TORCH_SPEC" in line)
    assert '--index-url "$TORCH_INDEX"' in install
    assert "ENV" in text and "BATCHFLEET_CACHE_DIR=/cache" in text
    assert compose()["services"]["worker"]["build"]["args"]["TORCH_INDEX"].endswith("whl/cpu}")


# ---- cgroup memory ------------------------------------------------------------------------------------
def _meminfo(tmp: Path, avail_kib: int) -> Path:
    p = tmp / "meminfo"
    p.write_text(f"MemTotal:       99999999 kB\nMemFree:         1000 kB\nMemAvailable:   {avail_kib} kB\n")
    return p


@pytest.mark.unit
def test_memory_v2_limit_caps_memavailable(tmp_path: Path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "memory.max").write_text(f"{8 << 30}\n")
    (root / "memory.current").write_text(f"{3 << 30}\n")
    assert memlimit.available_bytes(root, _meminfo(tmp_path, 64 << 20)) == 5 << 30  # 64 GiB host, 8 GiB cgroup
    assert memlimit.available_bytes(root, _meminfo(tmp_path, 2 << 20)) == 2 << 30  # the host is the tighter


@pytest.mark.unit
def test_memory_v2_max_means_no_limit(tmp_path: Path):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "memory.max").write_text("max\n")
    (root / "memory.current").write_text("123\n")
    assert memlimit.cgroup_headroom(root) is None
    assert memlimit.available_bytes(root, _meminfo(tmp_path, 1 << 20)) == 1 << 30


@pytest.mark.unit
def test_memory_v1_limit_and_unlimited(tmp_path: Path):
    root = tmp_path / "cg"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    (root / "memory" / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    assert memlimit.available_bytes(root, _meminfo(tmp_path, 64 << 20)) == 3 << 30
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 "no limit"
    assert memlimit.cgroup_headroom(root) is None


@pytest.mark.unit
def test_memory_without_any_source(tmp_path: Path):
    assert memlimit.available_bytes(tmp_path / "none", tmp_path / "nomeminfo") == memlimit.FALLBACK_BYTES
    (tmp_path / "cg").mkdir()
    (tmp_path / "cg" / "memory.max").write_text(f"{1 << 30}\n")
    (tmp_path / "cg" / "memory.current").write_text(f"{2 << 30}\n")  # over the limit: nothing left, not negative
    assert memlimit.available_bytes(tmp_path / "cg", tmp_path / "nomeminfo") == 0


# ---- Kubernetes + KEDA: names agree with the code -----------------------------------------------------
@pytest.mark.unit
def test_manifests_parse_with_the_expected_objects():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in manifests()}
    assert {("Deployment", "batchfleet-worker"), ("Deployment", "batchfleet-gateway"), ("Service", "redis"),
            ("Service", "batchfleet-gateway"), ("StatefulSet", "redis"), ("ScaledObject", "batchfleet-worker"),
            ("ConfigMap", "batchfleet-env")} <= kinds
    listed = kustomization()["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.unit
def test_keda_scales_on_the_fleets_demand_per_worker_capacity_with_the_background_cap():
    """One demand figure (issue 56): the gateways' batchfleet_demand_requests gauge (gateway/demand_metrics.py),
    its two priorities composed by scalingModifiers, interactive never capped, against the workers' capacity."""
    so = of_kind("ScaledObject")["batchfleet-worker"]
    assert so["spec"]["scaleTargetRef"]["name"] in of_kind("Deployment")
    assert so["spec"]["minReplicaCount"] == 0
    env, scaling = configmap_env(), of_kind("ConfigMap")["batchfleet-scaling"]["data"]
    capacity, cap = env["BATCHFLEET_MAX_RUNNING"], scaling["BACKGROUND_MAX_WORKERS"]
    u = scaling["INTERACTIVE_UTILIZATION"]
    triggers = {t["name"]: t for t in so["spec"]["triggers"]}
    assert sorted(triggers) == ["background", "interactive"]
    for name, t in triggers.items():
        md = t["metadata"]
        assert t["type"] == "prometheus" and md["serverAddress"] == scaling["PROMETHEUS_URL"]
        # every gateway exports the same fleet-wide figure: max, never sum; this namespace's gateways only
        assert md["query"] == f'max(batchfleet_demand_requests{{namespace="batchfleet",priority="{name}"}})'
        assert md["threshold"] == capacity and md["activationThreshold"] == "0" and md["ignoreNullValues"] == "false"
    mod = so["spec"]["advanced"]["scalingModifiers"]
    # headroom for interactive demand only (0 < u <= 1); background work asks for its slots, capped
    assert mod["formula"] == f"interactive / {u} + min(background, {capacity} * {cap} )" and 0 < float(u) <= 1
    assert mod["target"] == capacity and mod["activationTarget"] == "0" and mod["metricType"] == "AverageValue"
    assert all(d["metadata"]["namespace"] == "batchfleet" for d in manifests() if d["kind"] != "Namespace")


@pytest.mark.unit
def test_redis_manifest_aof_always_and_service_port():
    redis_url = urlsplit(shipped_redis_url())
    name, namespace, *svc_domain = redis_url.hostname.split(".")  # fully qualified: any pod resolves it
    assert svc_domain == ["svc", "cluster", "local"] and namespace == "batchfleet"
    svc = of_kind("Service")[name]
    assert [p["port"] for p in svc["spec"]["ports"]] == [redis_url.port]
    sts = of_kind("StatefulSet")["redis"]
    args = container(sts)["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--appendfsync") + 1] == "always"
    assert sts["spec"]["volumeClaimTemplates"]
    # a full Redis refuses writes (the producer gets a clear error) rather than being OOM-killed or evicting
    # queued requests: maxmemory leaves the rest of the memory limit to the AOF rewrite's fork and buffers
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    maxmemory = args[args.index("--maxmemory") + 1]
    units = {"gb": 1 << 30, "mb": 1 << 20}
    limit = container(sts)["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and maxmemory[-2:] in units
    assert 0.25 <= int(maxmemory[:-2]) * units[maxmemory[-2:]] / (float(limit[:-2]) * (1 << 30)) <= 0.75


@pytest.mark.unit
@pytest.mark.parametrize("name", ["batchfleet-worker", "batchfleet-gateway"])
def test_env_names_and_metrics_port(name: str):
    dep = of_kind("Deployment")[name]
    c = container(dep)
    assert c["envFrom"] == [{"configMapRef": {"name": "batchfleet-env"}}, {"secretRef": {"name": "batchfleet-redis"}}]
    env = {**configmap_env(), **env_of(c)}
    unknown = {k for k in env if k.startswith("BATCHFLEET_")} - known_env()
    assert not unknown, f"{name}: {unknown} is not a batchfleet setting"
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == ports["metrics"] == int(env["BATCHFLEET_METRICS_PORT"]) == METRICS_PORT
    # the default bind is 127.0.0.1 (no key on /metrics): the manifests open it to the pod's network explicitly
    assert env["BATCHFLEET_METRICS_HOST"] == "0.0.0.0"  # noqa: S104
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


@pytest.mark.unit
def test_worker_deployment_grace_threads_and_probe():
    dep = of_kind("Deployment")["batchfleet-worker"]
    spec = dep["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] >= 60
    c = container(dep)
    env = env_of(c)
    assert env["BATCHFLEET_THREADS"] == str(c["resources"]["limits"]["cpu"])
    assert env["BATCHFLEET_CACHE_DIR"] == "/cache"
    assert "/cache" in [m["mountPath"] for m in c["volumeMounts"]]
    assert "batchfleet.worker.health" in " ".join(c["readinessProbe"]["exec"]["command"])


@pytest.mark.unit
def test_gateway_command_and_service_ports():
    dep = of_kind("Deployment")["batchfleet-gateway"]
    c = container(dep)
    args = c["args"]
    flags = {option_flag(f) for f in fields(GatewayConfig) if is_option(f)}
    assert {a[2:] for a in args if a.startswith("--")} <= flags, "every gateway flag exists"
    assert args[0] == "serve" and args[args.index("--port") + 1] == str(GATEWAY_PORT)
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["http"] == GATEWAY_PORT
    svc = of_kind("Service")["batchfleet-gateway"]
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"http": GATEWAY_PORT,
                                                                            "metrics": METRICS_PORT}


def test_gateways_share_the_batch_files_volume():
    gw = compose()["services"]["gateway"]
    mount = next(v for v in gw["volumes"] if v.startswith("batch-files:"))
    assert gw["environment"]["BATCHFLEET_FILES_DIR"] == mount.split(":")[1] and "batch-files" in compose()["volumes"]
    c = container(of_kind("Deployment")["batchfleet-gateway"])
    env = {e["name"]: e.get("value") for e in c["env"]}
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "files"]
    assert env["BATCHFLEET_FILES_DIR"] == mount["mountPath"]
    spec = of_kind("Deployment")["batchfleet-gateway"]["spec"]["template"]["spec"]
    (vol,) = spec["volumes"]
    claim = of_kind("PersistentVolumeClaim")[vol["persistentVolumeClaim"]["claimName"]]
    # ReadWriteOnce binds on any storage class; every replica mounts it because they share one node
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == of_kind("Deployment")["batchfleet-gateway"]["spec"]["selector"][
        "matchLabels"]


def test_health_check_sees_a_fresh_heartbeat_and_a_status(redis_url: str, namespace: str):
    """The readiness check the compose healthcheck and the k8s probes run, against the real Redis: ready = a
    fresh heartbeat and the status only a serving loop publishes; live (``serving=False``) = the heartbeat."""
    import redis

    from batchfleet.worker.health import ready

    r = redis.Redis.from_url(redis_url)
    keys = Keys(namespace)
    assert not ready(r, keys, host="podhost")
    sec, usec = r.time()
    now = sec * 1000 + usec // 1000
    r.zadd(keys.workers, {"podhost-12-abc": now, "other-1-x": now, "podhost-9-old": now - 60_000})
    assert not ready(r, keys, host="podhost") and not ready(r, keys, name="other-1-x"), "joined, not serving"
    assert ready(r, keys, host="podhost", serving=False) and ready(r, keys, name="other-1-x", serving=False)
    for name in ("podhost-12-abc", "other-1-x", "podhost-9-old"):
        r.set(keys.worker(name), b"status", ex=30)
    assert ready(r, keys, host="podhost") and ready(r, keys, name="other-1-x")
    assert not ready(r, keys, name="podhost-9-old") and not ready(r, keys, host="nohost")

