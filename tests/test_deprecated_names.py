"""The names the priority rename deprecated still work for one release (docs/CONFIGURATION.md, "Deprecated
names"): the value ``batch`` means ``background`` on input, the old options and variables still set the new
fields, and the outputs carry the old metric label and status key beside the new ones. Pure: no Redis."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.keys import Keys
from batchfleet.common.metrics import PRIORITY_LABELS, priority_labels
from batchfleet.common.options import config_options
from batchfleet.common.redis.fleetstate import QueueStats
from batchfleet.common.wire.priority import BACKGROUND, INTERACTIVE, old_name, priority_of
from batchfleet.producer.ask import Ask
from batchfleet.producer.cli import priority_option


@pytest.mark.unit
def test_priority_batch_on_input_means_background():
    assert priority_of("batch") == BACKGROUND and priority_of("background") == BACKGROUND
    assert Ask.of({"max_new_tokens": 2, "priority": "batch"}).priority == BACKGROUND  # Client, bulk lines
    assert Ask.of({"kind": "embed", "priority": "batch"}).priority == BACKGROUND

    @click.command()
    @priority_option(BACKGROUND)
    def cmd(priority: str) -> None:
        click.echo(priority)

    runner = CliRunner()
    assert runner.invoke(cmd, ["--priority", "batch"]).output.strip() == BACKGROUND
    assert runner.invoke(cmd, []).output.strip() == BACKGROUND
    assert runner.invoke(cmd, ["--priority", "interactive"]).output.strip() == INTERACTIVE
    assert runner.invoke(cmd, ["--priority", "urgent"]).exit_code != 0


@pytest.mark.unit
def test_the_old_option_and_variable_still_set_the_renamed_field():
    @click.command()
    @config_options(EngineConfig)
    def cmd(**values) -> None:
        click.echo(values["background_min_share"])

    runner = CliRunner()

    def share(args: list[str], env: dict[str, str] | None = None) -> float:
        out = runner.invoke(cmd, args, env=env)
        assert out.exit_code == 0, out.output
        return float(out.output)

    assert share([]) == 0.1
    assert share(["--background-min-share", "0.3"]) == 0.3
    assert share(["--batch-min-share", "0.2"]) == 0.2
    assert share([], {"BATCHFLEET_BACKGROUND_MIN_SHARE": "0.4"}) == 0.4
    assert share([], {"BATCHFLEET_BATCH_MIN_SHARE": "0.5"}) == 0.5
    # both set: the new name wins, so a deployment can move over one variable at a time
    assert share([], {"BATCHFLEET_BATCH_MIN_SHARE": "0.5", "BATCHFLEET_BACKGROUND_MIN_SHARE": "0.4"}) == 0.4
    help_text = " ".join(runner.invoke(cmd, ["--help"], terminal_width=400).output.split())
    assert "BATCHFLEET_BACKGROUND_MIN_SHARE, BATCHFLEET_BATCH_MIN_SHARE" in help_text


@pytest.mark.unit
def test_outputs_carry_the_old_label_and_key_beside_the_new():
    from batchfleet.producer.ops.status import _queue_row

    assert PRIORITY_LABELS == ["priority", "class"]
    assert priority_labels(BACKGROUND) == ["background", "batch"]
    assert priority_labels(INTERACTIVE) == ["interactive", "interactive"]
    assert old_name(BACKGROUND) == "batch" and old_name(INTERACTIVE) == INTERACTIVE
    row = _queue_row(QueueStats(128, BACKGROUND, 3, 2, 1, 2, 0.5))
    assert (row["priority"], row["class"]) == ("background", "batch")


@pytest.mark.unit
def test_background_streams_keep_their_key():
    """Work queued before the rename sits in ``<ns>:stream:<bucket>:batch``: the same key is read after it."""
    assert Keys("bf").stream(128, BACKGROUND) == "bf:stream:128:batch"
    assert Keys("bf").stream(128) == "bf:stream:128"
    with pytest.raises(ValueError):
        Keys("bf").stream(128, "batch")  # the key's suffix, not a priority: callers normalise first


@pytest.mark.unit
def test_a_bulk_run_recorded_with_batch_resumes_after_the_upgrade(tmp_path):
    """A run record written before the rename keeps ``"priority": "batch"`` in its defaults; the same run
    resumed now asks for ``background``: the same parameters, not a RunChanged."""
    import json

    from batchfleet.producer.bulk.files import KEY_SUFFIX, run_record
    from batchfleet.producer.bulk.lines import prompt_params

    output = tmp_path / "answers.jsonl"
    output.write_text("")
    old = prompt_params({"max_new_tokens": 8, "priority": "batch"}, None, False)
    (tmp_path / ("answers.jsonl" + KEY_SUFFIX)).write_text(json.dumps({"key": "ab" * 32, "params": old}))
    now = prompt_params({"max_new_tokens": 8, "priority": BACKGROUND}, None, False)
    record, resuming = run_record(str(output), True, now)
    assert resuming and record.names.key == "ab" * 32 and record.params == now
