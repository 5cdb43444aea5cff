"""The shipped alert rules fire only on trouble, run by Prometheus' own rule evaluator (``promtool test rules``
over deploy/prometheus/alerts_test.yml): normal mixed operation (interactive load, a draining background backlog,
a nearly full KV cache, priority preemptions) fires nothing; a stuck worker, a KV cache out of blocks and an
interactive backlog each fire their own alert. Skipped, saying why, where promtool is not installed
(.ci/run installs it with apt, best effort)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROM = ROOT / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (apt package prometheus) is not installed")


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL or "promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
@needs_promtool
def test_alert_rules_check():
    out = promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.integration
@needs_promtool
def test_alerts_fire_only_on_trouble():
    out = promtool("test", "rules", "alerts_test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.unit
def test_alert_cases_cover_every_rule_and_each_trouble():
    """Every alert is asserted silent in normal operation, and each trouble case expects its own alert."""
    rules = {r["alert"] for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    cases = {c["name"]: c for c in yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]}
    normal = cases["normal mixed operation fires nothing"]["alert_rule_test"]
    assert {t["alertname"] for t in normal} == rules and all(t["exp_alerts"] == [] for t in normal)
    fired = {t["alertname"] for c in cases.values() for t in c["alert_rule_test"] if t["exp_alerts"]}
    assert fired == {"BatchfleetWorkerStuck", "BatchfleetKVCacheSaturated", "BatchfleetInteractiveQueueTooOld"}


@pytest.mark.integration
@needs_promtool
def test_alerts_test_fails_on_the_old_rules(tmp_path: Path):
    """The cases have teeth: the rules of issue 32 (preemptions of any cause, age merged across priorities)
    fire in normal operation, and promtool says so."""
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())
    for rule in groups["groups"][0]["rules"]:
        if rule["alert"] == "BatchfleetKVCacheSaturated":
            rule["expr"] = ("avg(batchfleet_kv_cache_usage_ratio) > 0.9 "
                            "or sum(rate(batchfleet_preemptions_total[5m])) > 0.1")
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(groups))
    shutil.copy(PROM / "alerts_test.yml", tmp_path / "alerts_test.yml")
    out = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert out.returncode != 0 and "BatchfleetKVCacheSaturated" in out.stdout + out.stderr
