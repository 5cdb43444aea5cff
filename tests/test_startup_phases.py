"""A starting worker's phases (common/startup.py): each phase's own seconds (those of phases inside it excluded), a
name run twice added up, one log line per phase in the order they began, "other" and the total from the start."""

from __future__ import annotations

import logging
import time

import pytest

from batchfleet.common.startup import Phases


@pytest.mark.unit
def test_phases_add_up_and_are_logged(caplog):
    now = [0.0]
    phases = Phases(clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="batchfleet.startup")
    with phases.phase("engine", "building"):
        now[0] += 2
        with phases.phase("kernels"):
            now[0] += 5
    with phases.phase("engine"):  # a name run again adds up
        now[0] += 1
    out = phases.report(started=time.time() - 10, note="n")
    assert list(out) == ["engine", "kernels", "other", "total"]
    assert (out["engine"], out["kernels"]) == (3, 5), "each phase its own seconds"
    assert abs(out["other"] - 2) < 0.5 and abs(out["engine"] + out["kernels"] + out["other"] - out["total"]) < 0.01
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines[0] == "building" and [ln.split()[2] for ln in lines[1:4]] == ["engine", "kernels", "other"]
    assert lines[-1].startswith("start total ") and lines[-1].endswith("(n)")
    assert phases.seconds == {}
