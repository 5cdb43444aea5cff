"""The randomized fault test (scripts/fault_test.py, scripts/faultlib/), short: one fixed seed, the mild
nemesis for 30 s (one fault at a time, 3-6 s apart: worker kill -9 and SIGSTOP, Redis kill -9 on its AOF,
SIGSTOP and full memory, client and bulk kill -9), two workers, a sync, an async and a gateway client process
(3 callers each) and ``batchfleet bulk`` rounds; about 90 s in all.

The checker's verdict is the test's: no violation passes, the shapes of issue 54's items (54.1, 54.5, 54.6)
and of the two this test found (new.A, new.B) included: all are fixed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.faultlib.run import Plan, run_once

SEED = 7

pytestmark = pytest.mark.timeout(420)


def test_randomized_faults_short_run(tiny_model_dir: Path, tmp_path: Path) -> None:
    plan = Plan(seed=SEED, minutes=0.5, intensity="mild", sync_clients=1, async_clients=1, callers=3,
                timeout_s=15.0, collect_s=15.0, slack_s=5.0)
    out = tmp_path / "run"
    summary = run_once(plan, out, tiny_model_dir)
    print("\n" + json.dumps({k: v for k, v in summary.items() if k not in ("examples", "plan")}, indent=1))
    ops = summary["operations_by_kind"]
    # the run did what it says: every channel ran, the nemesis acted, answers came back
    assert all(ops.get(kind, 0) > 0 for kind in ("sync/submit", "async/submit", "gateway/completion", "bulk/line")), ops
    assert summary["faults"] >= 3, summary["faults_by_kind"]
    assert summary["outcomes"].get("answer", 0) >= 100, summary["outcomes"]
    violations = [json.loads(line) for line in (out / "violations.jsonl").read_text().splitlines()]
    assert not violations, (f"{len(violations)} violations ({summary['violations_by_issue_item']}), e.g. "
                            f"{violations[:5]}")
