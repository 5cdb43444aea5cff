"""Point the Kubernetes manifests at a Redis: writes deploy/k8s/redis-target/ (a kustomize Component) and the
Secret's contents from one Redis URL, the one the workers and the gateway use (BATCHFLEET_REDIS_URL).

    python3 scripts/k8s_redis.py 'redis://:secret@redis.example:6380/2'
    kubectl -n batchfleet create secret generic batchfleet-redis --from-env-file=deploy/k8s/redis-target/secret.env
    kubectl apply -k deploy/k8s

kustomize cannot parse a URL (its replacements only split on one delimiter: a URL without ``/db`` or with a
password broke them), so the parse happens here, with the fleet's own URL parser, and KEDA's redis-streams
trigger fields are written from it as KEDA documents them: ``address`` host:port, ``databaseIndex``,
``enableTLS`` (rediss://); a ``redis+sentinel://`` URL gives the ``redis-sentinel-streams`` scaler with
``addresses`` and ``sentinelMaster``; a ``redis+cluster://`` URL the ``redis-cluster-streams`` scaler with
``addresses`` (the seed nodes) and the streams' names as the cluster's keys have them, the namespace a hash tag
(``{bf}:stream:128``: written here from config.yaml, since a kustomize replacement cannot add the braces; rerun
after changing BATCHFLEET_NAMESPACE). Credentials never enter the ScaledObject: they go to the Secret
``batchfleet-redis`` (with the URL itself), which KEDA reads through the TriggerAuthentication written here.
The Secret's file (secret.env, mode 0600) is git-ignored; the Component holds nothing secret.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml

from batchfleet.common.errors import ConfigError
from batchfleet.common.keys import Keys
from batchfleet.common.redis.url import (
    check_redis_url,
    is_cluster,
    is_sentinel,
    parse_cluster_url,
    parse_sentinel_url,
    redact_url,
)

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
SECRET = "batchfleet-redis"  # the Secret (URL + credentials) and the TriggerAuthentication reading it
NAMESPACE = "batchfleet"
URL_ANNOTATION = "batchfleet.io/redis-url"  # the URL the triggers were written from, password redacted
PLACEHOLDER = "NAMESPACE"  # keda.yaml's streams begin with it: the namespace is written in its place


def trigger_fields(url: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """(KEDA scaler type, trigger metadata, Secret keys) for ``url``. The Secret keys are the URL itself
    (BATCHFLEET_REDIS_URL, what the pods read) and each credential under the name of the KEDA authentication
    parameter it fills (username, password, sentinelPassword). ConfigError for a URL KEDA cannot use."""
    check_redis_url(url)
    secret = {"BATCHFLEET_REDIS_URL": url}
    if is_cluster(url):  # KEDA's cluster client finds the slot's master from any seed node; a cluster has db 0 only
        c = parse_cluster_url(url)
        meta = {"addresses": ", ".join(f"{h}:{p}" for h, p in c.nodes), "enableTLS": "false"}
        creds = {"username": c.username, "password": c.password}
        return "redis-cluster-streams", meta, {**secret, **{k: v for k, v in creds.items() if v}}
    if is_sentinel(url):
        s = parse_sentinel_url(url)
        meta = {"addresses": ", ".join(f"{h}:{p}" for h, p in s.sentinels), "sentinelMaster": s.service,
                "databaseIndex": str(s.db), "enableTLS": "false"}
        creds = {"username": s.username, "password": s.password, "sentinelPassword": s.sentinel_password}
        return "redis-sentinel-streams", meta, {**secret, **{k: v for k, v in creds.items() if v}}
    parts = urlsplit(url)
    if parts.scheme == "unix":
        raise ConfigError("a unix:// socket is reachable from its own host only: KEDA's operator runs in another "
                          "pod; give the workers and KEDA a TCP URL (redis:// or rediss://)")
    host = parts.hostname or "localhost"
    meta = {"address": f"[{host}]:{parts.port or 6379}" if ":" in host else f"{host}:{parts.port or 6379}",
            "databaseIndex": parts.path.strip("/") or "0", "enableTLS": str(parts.scheme == "rediss").lower()}
    creds = {"username": unquote(parts.username or ""), "password": unquote(parts.password or "")}
    return "redis-streams", meta, {**secret, **{k: v for k, v in creds.items() if v}}


def component(url: str, k8s: Path = K8S) -> dict[str, str]:
    """The files of deploy/k8s/redis-target/ for ``url`` and the ScaledObject of ``k8s``/keda.yaml:
    {file name: text}, secret.env included (the only file with a credential). Each trigger's stream is
    ``NAMESPACE:stream:...`` in keda.yaml; the namespace comes from the ConfigMap (config.yaml): by a kustomize
    replacement for one Redis, so that the streams follow BATCHFLEET_NAMESPACE; written here for a cluster,
    whose keys carry the namespace as a hash tag (``{ns}:stream:...``), which a replacement cannot write (it
    only splits on a delimiter and writes the source's value between)."""
    kind, meta, secret = trigger_fields(url)
    auth = sorted(k for k in secret if k != "BATCHFLEET_REDIS_URL")
    ops: list[dict] = [{"op": "add", "path": "/metadata/annotations", "value": {URL_ANNOTATION: redact_url(url)}}]
    env = configmap(k8s)
    namespace = env["BATCHFLEET_NAMESPACE"] if is_cluster(url) else None
    shards = int(env.get("BATCHFLEET_SHARDS", "1"))
    if shards > 1 and namespace is None:
        raise ConfigError("BATCHFLEET_SHARDS > 1 (config.yaml) needs a Redis Cluster URL (redis+cluster://)")
    layout = Keys(namespace, hashtag=True, shards=shards) if namespace is not None else None
    shipped = shipped_triggers(k8s)
    for i, trigger in enumerate(shipped):
        stream = trigger["metadata"]["stream"].removeprefix(PLACEHOLDER)
        if layout is not None:
            ops.append({"op": "replace", "path": f"/spec/triggers/{i}/metadata/stream",
                        "value": layout.prefix + stream})
        ops.append({"op": "replace", "path": f"/spec/triggers/{i}/type", "value": kind})
        ops += [{"op": "add", "path": f"/spec/triggers/{i}/metadata/{k}", "value": v} for k, v in meta.items()]
        if auth:
            ops.append({"op": "add", "path": f"/spec/triggers/{i}/authenticationRef", "value": {"name": SECRET}})
    if layout is not None and shards > 1:
        ops += shard_triggers(layout, shipped, kind, meta, auth, int(env["BATCHFLEET_MAX_RUNNING"]))
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component",
                     "resources": ["trigger-auth.yaml"] if auth else [],
                     "patches": [{"path": "triggers-patch.yaml",
                                  "target": {"kind": "ScaledObject", "name": "batchfleet-worker"}}]}
    replacements = [] if shards > 1 else [capacity_replacement()]  # a sharded fleet's targets are written above
    if namespace is None:
        replacements.append(namespace_replacement())
    kustomization["replacements"] = replacements
    head = (f"# Written by scripts/k8s_redis.py from {redact_url(url)} (rerun it to change the Redis; do not edit).\n"
            "# KEDA's trigger fields for that URL; its credentials are in the Secret batchfleet-redis (secret.env).\n")
    if namespace is not None:
        head += (f"# The streams are the cluster's keys of BATCHFLEET_NAMESPACE {namespace!r} (config.yaml), written "
                 "here: rerun after changing it.\n")
    if shards > 1:
        head += (f"# A fleet of {shards} shards (BATCHFLEET_SHARDS): one trigger per stream of each shard, each "
                 "with a target of BATCHFLEET_MAX_RUNNING / shards: rerun after changing either.\n")
    files = {"kustomization.yaml": head + yaml.safe_dump(kustomization, sort_keys=False),
             "triggers-patch.yaml": head + yaml.safe_dump(ops, sort_keys=False, width=200),
             "secret.env": "".join(f"{k}={v}\n" for k, v in secret.items())}
    if auth:
        ta = {"apiVersion": "keda.sh/v1alpha1", "kind": "TriggerAuthentication",
              "metadata": {"name": SECRET, "namespace": NAMESPACE},
              "spec": {"secretTargetRef": [{"parameter": k, "name": SECRET, "key": k} for k in auth]}}
        files["trigger-auth.yaml"] = head + yaml.safe_dump(ta, sort_keys=False)
    return files


def shipped_triggers(k8s: Path = K8S) -> list[dict]:
    """The triggers of keda.yaml's ScaledObject, as written there (streams ``NAMESPACE:stream:...``)."""
    (so,) = [d for d in yaml.safe_load_all((k8s / "keda.yaml").read_text()) if d and d["kind"] == "ScaledObject"]
    streams = [t["metadata"]["stream"] for t in so["spec"]["triggers"]]
    if not all(s.startswith(PLACEHOLDER + ":") for s in streams):
        raise ConfigError(f"keda.yaml's streams must begin with {PLACEHOLDER}: (the namespace's place): {streams}")
    return so["spec"]["triggers"]


def shard_triggers(layout: Keys, shipped: list[dict], kind: str, meta: dict[str, str], auth: list[str],
                   capacity: int) -> list[dict]:
    """Patch ops for a sharded fleet (common/keys.py): the triggers of shards 1..n-1 appended, and every
    trigger's target set to ceil(capacity / n). KEDA takes the largest trigger's ask, and producers spread a
    bucket's requests over the shards, so each shard's stream holds about 1/n of the bucket's backlog: against
    1/n of a worker's capacity, the fullest shard asks for at least what the whole backlog needs (more when
    the spread is uneven: never fewer)."""
    target = str(-(-capacity // layout.shards))
    ops = [{"op": "replace", "path": f"/spec/triggers/{i}/metadata/streamLength", "value": target}
           for i in range(len(shipped))]
    for shard in layout.every_shard[1:]:
        for trigger in shipped:
            metadata = {**trigger["metadata"], **meta, "streamLength": target,
                        "stream": shard.prefix + trigger["metadata"]["stream"].removeprefix(PLACEHOLDER)}
            added = {"type": kind, "metadata": metadata, **({"authenticationRef": {"name": SECRET}} if auth else {})}
            ops.append({"op": "add", "path": "/spec/triggers/-", "value": added})
    return ops


def configmap(k8s: Path = K8S) -> dict[str, str]:
    """The fleet's settings (config.yaml's ConfigMap batchfleet-env)."""
    (cm,) = [d for d in yaml.safe_load_all((k8s / "config.yaml").read_text())
             if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "batchfleet-env"]
    return cm["data"]


def capacity_replacement() -> dict:
    """The kustomize replacement writing BATCHFLEET_MAX_RUNNING into each trigger's streamLength (one worker per
    that many unanswered requests of a stream)."""
    return {"source": {"kind": "ConfigMap", "name": "batchfleet-env", "fieldPath": "data.BATCHFLEET_MAX_RUNNING"},
            "targets": [{"select": {"kind": "ScaledObject", "name": "batchfleet-worker"},
                         "fieldPaths": ["spec.triggers.*.metadata.streamLength"]}]}


def namespace_replacement() -> dict:
    """The kustomize replacement writing BATCHFLEET_NAMESPACE into each trigger's stream (its first
    ``:``-delimited part, the placeholder NAMESPACE), so that KEDA reads the streams the workers use."""
    return {"source": {"kind": "ConfigMap", "name": "batchfleet-env", "fieldPath": "data.BATCHFLEET_NAMESPACE"},
            "targets": [{"select": {"kind": "ScaledObject", "name": "batchfleet-worker"},
                         "fieldPaths": ["spec.triggers.*.metadata.stream"],
                         "options": {"delimiter": ":", "index": 0}}]}


def write(url: str, k8s: Path = K8S) -> Path:
    """Write the Component under ``k8s``/redis-target (replacing what was there); returns its folder."""
    out = k8s / "redis-target"
    out.mkdir(exist_ok=True)
    (out / "trigger-auth.yaml").unlink(missing_ok=True)
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
