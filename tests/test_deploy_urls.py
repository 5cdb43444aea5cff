"""The Kubernetes manifests apply anywhere (issue 32): every Redis URL form the fleet accepts (no database, a
database, a password, user and password, rediss://, Sentinel, Cluster, a sharded Cluster) renders with
`kubectl kustomize` (skipped, saying why, without kubectl), the URL and its credentials in the Secret only, never
in what is applied; KEDA reads no Redis (issue 56: it scales on the gateways' demand gauge), so its ScaledObject
is the same for every form. Also what restricted Pod Security asks of every pod, the probes, and the non-root
image."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import redis
import yaml

from batchfleet.common.errors import ConfigError
from batchfleet.common.keys import Keys
from batchfleet.common.redis.url import redact_url
from scripts.k8s_redis import SECRET, URL_ANNOTATION, secret_keys, write
from tests.helpers.deploy import K8S, ROOT, container, of_kind

# (URL, the credentials it carries)
FORMS = [
    ("redis://redis.example:6379", {}),
    ("redis://redis.example/3", {}),
    ("redis://:s3cret@redis.example:6380/2", {"password": "s3cret"}),
    ("redis://bf-user:p%40ss@redis.example:6379/1", {"username": "bf-user", "password": "p@ss"}),
    ("rediss://:s3cret@redis.example:6380/0", {"password": "s3cret"}),
    ("redis+sentinel://sentinel-0.sentinel:26379,sentinel-1.sentinel:26379/mymaster/0", {}),
    ("redis+sentinel://:s3cret@s0:26379,s1/mymaster/2?sentinel_password=sentpw",
     {"password": "s3cret", "sentinelPassword": "sentpw"}),
    ("redis+cluster://r0.redis:6379,r1.redis:6380", {}),
    ("redis+cluster://bf-user:s3cret@r0:7000,r1,r2:7002/0", {"username": "bf-user", "password": "s3cret"}),
]
IDS = ["no-db", "db-no-port", "password", "user-password", "rediss", "sentinel", "sentinel-passwords", "cluster",
       "cluster-user-password"]


@pytest.mark.unit
@pytest.mark.parametrize("url,creds", FORMS, ids=IDS)
def test_each_url_form_goes_to_the_secret_whole(url: str, creds: dict):
    assert secret_keys(url) == {"BATCHFLEET_REDIS_URL": url}
    assert all(v not in redact_url(url) for k, v in creds.items() if k != "username")


@pytest.mark.unit
def test_a_unix_socket_or_junk_url_is_refused_clearly():
    with pytest.raises(ConfigError, match="pods on other hosts"):
        secret_keys("unix:///run/redis.sock")
    with pytest.raises(ConfigError, match="malformed") as exc:
        secret_keys("redis://:hunter2@host:notaport/0")
    assert "hunter2" not in str(exc.value)


@pytest.mark.unit
def test_the_shipped_component_is_what_the_script_writes_for_the_shipped_url():
    """deploy/k8s/redis-target/ is generated, never edited by hand: it is what scripts/k8s_redis.py writes
    for the in-cluster Redis of redis.yaml (the URL kustomization.yaml's secret command holds)."""
    from scripts.k8s_redis import component

    url = "redis://redis.batchfleet.svc.cluster.local:6379/0"
    assert f"BATCHFLEET_REDIS_URL={url}" in (K8S / "kustomization.yaml").read_text()
    files = component(url)
    assert sorted(p.name for p in (K8S / "redis-target").iterdir() if p.name != "secret.env") == sorted(
        n for n in files if n != "secret.env")
    for name, text in files.items():
        if name != "secret.env":
            assert (K8S / "redis-target" / name).read_text() == text, name


def kustomize(folder: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def kustomize_version() -> tuple[int, ...]:
    """kubectl's built-in kustomize version ((0,) when kubectl is missing or does not say): components and
    replacements need kustomize v4.1+ (kubectl 1.24+); Debian's kubernetes-client 1.20 bundles v2."""
    if shutil.which("kubectl") is None:
        return (0,)
    out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"Kustomize Version: v(\d+)\.(\d+)", out)
    return tuple(int(x) for x in found.groups()) if found else (0,)


needs_kustomize = pytest.mark.skipif(kustomize_version() < (4, 1),
                                     reason="kubectl with kustomize v4.1+ (components, replacements) is not installed")


@pytest.mark.integration
@needs_kustomize
@pytest.mark.parametrize("url,creds", FORMS, ids=IDS)
def test_kubectl_kustomize_renders_each_url_form(tmp_path: Path, url: str, creds: dict):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("secret.env"))
    out = write(url, k8s)
    secret_file = out / "secret.env"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = dict(line.split("=", 1) for line in secret_file.read_text().splitlines())
    assert secret == {"BATCHFLEET_REDIS_URL": url}
    rendered = kustomize(k8s)
    text = yaml.safe_dump_all(rendered)
    for key, value in creds.items():  # no password anywhere in what is applied: only in the Secret (secret.env)
        assert key == "username" or value not in text  # (a user name shows in the redacted URL annotation)
    (so,) = [d for d in rendered if d["kind"] == "ScaledObject"]
    assert so["metadata"]["annotations"][URL_ANNOTATION] == redact_url(url)
    assert so["spec"] == of_kind("ScaledObject")["batchfleet-worker"]["spec"]  # KEDA reads no Redis
    assert not [d for d in rendered if d["kind"] == "TriggerAuthentication"]
    for d in rendered:  # every pod reads the URL from the same Secret
        if d["kind"] in ("Deployment",):
            assert {"secretRef": {"name": SECRET}} in container(d)["envFrom"]


@pytest.mark.integration
@needs_kustomize
def test_a_sharded_fleet_needs_a_cluster_url_and_renders_with_one(tmp_path: Path):
    """BATCHFLEET_SHARDS 3 (config.yaml): the demand KEDA reads counts every shard (producer/ops/demand.py reads
    the layout from the fleet description), so the manifests are the same; only a Cluster URL is accepted."""
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("secret.env"))
    config = k8s / "config.yaml"
    config.write_text(config.read_text().replace('BATCHFLEET_SHARDS: "1"', 'BATCHFLEET_SHARDS: "3"'))
    write("redis+cluster://r0:6379,r1:6379", k8s)
    (so,) = [d for d in kustomize(k8s) if d["kind"] == "ScaledObject"]
    assert so["spec"] == of_kind("ScaledObject")["batchfleet-worker"]["spec"]
    with pytest.raises(ConfigError, match="Cluster"):
        write("redis://r0:6379/0", k8s)


@pytest.mark.integration
@needs_kustomize
def test_the_models_component_renders_with_kubectl(tmp_path: Path):
    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s, ignore=shutil.ignore_patterns("secret.env"))
    assert "batchfleet-models" not in {d["metadata"]["name"] for d in kustomize(k8s)}
    kust = yaml.safe_load((k8s / "kustomization.yaml").read_text())
    kust["components"].append("components/models")
    (k8s / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    rendered = kustomize(k8s)
    (worker,) = [d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"] == "batchfleet-worker"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container(worker)["volumeMounts"]
    assert "batchfleet-models" in {d["metadata"]["name"] for d in rendered if d["kind"] == "PersistentVolumeClaim"}


# ---- restricted Pod Security, probes, non-root image ---------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("kind,name", [("Deployment", "batchfleet-worker"), ("Deployment", "batchfleet-gateway"),
                                       ("StatefulSet", "redis")])
def test_every_pod_meets_restricted_pod_security(kind: str, name: str):
    spec = of_kind(kind)[name]["spec"]["template"]["spec"]
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] > 0 and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in spec["containers"]:
        sec = c["securityContext"]
        assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"]
        assert not sec.get("privileged") and "add" not in sec["capabilities"]
    assert not any(v.get("hostPath") for v in spec.get("volumes", []))


@pytest.mark.unit
def test_the_image_runs_as_the_user_the_manifests_name():
    text = (ROOT / "Dockerfile").read_text()
    (user,) = re.findall(r"^USER (\S+)$", text, re.M)
    assert user.isdigit() and int(user) > 0, "numeric: runAsNonRoot can only check a numeric USER"
    for name in ("batchfleet-worker", "batchfleet-gateway"):
        assert of_kind("Deployment")[name]["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(user)
    assert re.search(rf"chown {user}:{user} /cache /models /files", text), "its volumes' folders are its own"


@pytest.mark.unit
def test_worker_probes_ready_live_and_startup():
    c = container(of_kind("Deployment")["batchfleet-worker"])
    assert c["readinessProbe"]["exec"]["command"][-1] == "batchfleet.worker.health"
    assert c["livenessProbe"]["exec"]["command"][-2:] == ["batchfleet.worker.health", "--live"]
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60, "never faster than the 60 s heartbeat window"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300, "a model load"
    gw = container(of_kind("Deployment")["batchfleet-gateway"])
    assert gw["livenessProbe"]["tcpSocket"]["port"] == gw["readinessProbe"]["tcpSocket"]["port"]


def test_liveness_fails_only_on_a_stale_heartbeat_never_on_a_redis_outage(redis_url: str, namespace: str,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """The worker's liveness probe (`health --live`): a heartbeat a minute old restarts the pod; a Redis that
    does not answer does not (restarting every worker would only add model loads to the outage)."""

    from batchfleet.worker import health
    from batchfleet.worker.devtools import free_port

    r, keys = redis.Redis.from_url(redis_url), Keys(namespace)
    sec, usec = r.time()
    now = sec * 1000 + usec // 1000
    r.zadd(keys.workers, {"fresh-1-a": now - 30_000, "stale-1-b": now - 90_000})
    monkeypatch.setenv("BATCHFLEET_REDIS_URL", redis_url)
    monkeypatch.setenv("BATCHFLEET_NAMESPACE", namespace)
    monkeypatch.setenv("BATCHFLEET_WORKER_NAME", "fresh-1-a")
    assert health.main(["--live"]) == 0 and health.main([]) == 1  # alive, but not ready (30 s > 10 s)
    monkeypatch.setenv("BATCHFLEET_WORKER_NAME", "stale-1-b")
    assert health.main(["--live"]) == 1
    monkeypatch.setenv("BATCHFLEET_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    assert health.main(["--live"]) == 0 and health.main([]) == 1
