"""What CI checks besides the tests (.ci/run): ruff over the tree, mypy over common/ and producer/, then the
README's test command; and the commit convention (subjects of at most 72 characters) from the commit that
adopted it on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONVENTION_SINCE = "c20bd8e"  # the first commit under the 72-character subject rule
MAX_SUBJECT = 72
# merged before this test saw them (history is not rewritten); nothing may be added here
LONG_SUBJECTS_MERGED = {"12d1229", "051ff4a"}


@pytest.mark.unit
def test_ci_runs_the_linter_and_the_type_checker_before_the_tests():
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    readme = (ROOT / "README.md").read_text()
    test_command = 'python3 -m pip install -e ".[dev]" && python3 -m pytest -q'
    assert test_command in readme and lines[-1] == test_command
    assert lines.index("python3 -m ruff check .") < lines.index("scripts/typecheck.sh") < len(lines) - 1


@pytest.mark.unit
def test_the_type_checker_covers_common_and_producer():
    script = (ROOT / "scripts" / "typecheck.sh").read_text()
    assert "-p batchfleet.common" in script and "-p batchfleet.producer" in script


def test_commit_subjects_are_at_most_72_characters():
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "log", "--format=%H %s", f"{CONVENTION_SINCE}^..HEAD"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no git history here ({e})")
    long = [line for line in out.splitlines()
            if len(line.split(" ", 1)[1]) > MAX_SUBJECT and line[:7] not in LONG_SUBJECTS_MERGED]
    assert not long, long
