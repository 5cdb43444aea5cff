"""Point the Kubernetes manifests at a Redis: writes deploy/k8s/redis-target/ (a kustomize Component) and the
Secret's contents from one Redis URL, the one the workers and the gateway use (BATCHFLEET_REDIS_URL).

    python3 scripts/k8s_redis.py 'redis://:secret@redis.example:6380/2'
    kubectl -n batchfleet create secret generic batchfleet-redis --from-env-file=deploy/k8s/redis-target/secret.env
    kubectl apply -k deploy/k8s

The URL is checked with the fleet's own parser (every form: redis://, rediss://, redis+sentinel://,
redis+cluster://; a unix socket is refused: the pods run on other hosts), and a sharded fleet
(BATCHFLEET_SHARDS > 1 in config.yaml) must name a Redis Cluster. The Component records the URL, password
redacted, on the ScaledObject (``batchfleet.io/redis-url``); KEDA itself never reads Redis: it scales on the
fleet's demand, which the gateways compute from Redis and Prometheus scrapes (deploy/k8s/keda.yaml), so no
Redis address nor credential enters a KEDA object. The Secret's file (secret.env, mode 0600) is git-ignored;
the Component holds nothing secret.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from batchfleet.common.errors import ConfigError
from batchfleet.common.redis.url import (
    check_redis_url,
    is_cluster,
    is_sentinel,
    redact_url,
)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
SECRET = "batchfleet-redis"  # the Secret holding the URL (and so its credentials)
NAMESPACE = "batchfleet"
URL_ANNOTATION = "batchfleet.io/redis-url"  # the URL the Secret was written from, password redacted


def secret_keys(url: str) -> dict[str, str]:
    """The Secret's keys for ``url``: the URL itself (BATCHFLEET_REDIS_URL, what every pod reads). ConfigError
    for a URL the pods cannot use (malformed; a unix socket)."""
    check_redis_url(url)
    if not is_cluster(url) and not is_sentinel(url) and urlsplit(url).scheme == "unix":
        raise ConfigError("a unix:// socket is reachable from its own host only: the workers and gateways run in "
                          "pods on other hosts; give them a TCP URL (redis:// or rediss://)")
    return {"BATCHFLEET_REDIS_URL": url}


def component(url: str, k8s: Path = K8S) -> dict[str, str]:
    """The files of deploy/k8s/redis-target/ for ``url``: {file name: text}, secret.env included (the only file
    with a credential)."""
    secret = secret_keys(url)
    if int(configmap(k8s).get("BATCHFLEET_SHARDS", "1")) > 1 and not is_cluster(url):
        raise ConfigError("BATCHFLEET_SHARDS > 1 (config.yaml) needs a Redis Cluster URL (redis+cluster://)")
    ops = [{"op": "add", "path": "/metadata/annotations", "value": {URL_ANNOTATION: redact_url(url)}}]
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component", "resources": [],
                     "patches": [{"path": "url-patch.yaml",
                                  "target": {"kind": "ScaledObject", "name": "batchfleet-worker"}}]}
    head = (f"# Written by scripts/k8s_redis.py from {redact_url(url)} (rerun it to change the Redis; do not edit).\n"
            "# The URL is in the Secret batchfleet-redis (secret.env); KEDA reads no Redis (keda.yaml).\n")
    return {"kustomization.yaml": head + yaml.safe_dump(kustomization, sort_keys=False),
            "url-patch.yaml": head + yaml.safe_dump(ops, sort_keys=False, width=200),
            "secret.env": "".join(f"{k}={v}\n" for k, v in secret.items())}


def configmap(k8s: Path = K8S) -> dict[str, str]:
    """The fleet's settings (config.yaml's ConfigMap batchfleet-env)."""
    (cm,) = [d for d in yaml.safe_load_all((k8s / "config.yaml").read_text())
             if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "batchfleet-env"]
    return cm["data"]


def write(url: str, k8s: Path = K8S) -> Path:
    """Write the Component under ``k8s``/redis-target (replacing what was there); returns its folder."""
    out = k8s / "redis-target"
    out.mkdir(exist_ok=True)
    for old in ("trigger-auth.yaml", "triggers-patch.yaml"):  # what earlier versions wrote
        (out / old).unlink(missing_ok=True)
    for name, text in component(url, k8s).items():
        path = out / name
        if name == "secret.env":  # created 0600 before the credential is written into it
            path.unlink(missing_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        path.write_text(text)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the Redis URL the fleet uses (redis://, rediss://, redis+sentinel://, "
                                    "redis+cluster://)")
    parser.add_argument("--k8s", type=Path, default=K8S, help="the manifests' folder (default: deploy/k8s)")
    args = parser.parse_args(argv)
    try:
        out = write(args.url, args.k8s)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}/ for {redact_url(args.url)}; now:\n  kubectl -n {NAMESPACE} create secret generic {SECRET} "
          f"--from-env-file={out / 'secret.env'} --dry-run=client -o yaml | kubectl apply -f -\n"
          f"  kubectl apply -k {args.k8s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
