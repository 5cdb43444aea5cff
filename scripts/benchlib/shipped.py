"""What deploy/k8s ships to the autoscaler, read for the autoscaling simulation (scripts/autoscale_sim.py), so
that its defaults are the manifests' settings rather than copies that drift: the interactive utilization of
keda.yaml's formula (the ConfigMap batchfleet-scaling of config.yaml, which kustomize copies into the formula)
and the ScaledObject's pollingInterval, cooldownPeriod and HPA scale-down stabilization. Read from the raw
files: none of these is a kustomize placeholder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
HPA_DOWN_WINDOW_S = 300.0  # Kubernetes' default scaleDown stabilizationWindowSeconds


@dataclass(frozen=True)
class Shipped:
    interactive_utilization: float
    polling_interval_s: float
    cooldown_period_s: float
    down_window_s: float


def _doc(path: Path, kind: str, name: str) -> dict:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == kind and doc["metadata"]["name"] == name:
            return doc
    raise LookupError(f"no {kind} {name} in {path}")


def shipped(k8s: Path = K8S) -> Shipped:
    scaling = _doc(k8s / "config.yaml", "ConfigMap", "batchfleet-scaling")["data"]
    spec = _doc(k8s / "keda.yaml", "ScaledObject", "batchfleet-worker")["spec"]
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
    down = behavior.get("scaleDown", {}).get("stabilizationWindowSeconds", HPA_DOWN_WINDOW_S)
    return Shipped(float(scaling["INTERACTIVE_UTILIZATION"]), float(spec["pollingInterval"]),
                   float(spec["cooldownPeriod"]), float(down))
