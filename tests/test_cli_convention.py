"""One command-line convention (issue 19): every option that reads an environment variable reads
BATCHFLEET_<ITS FLAG> and says so in --help, as docs/CONFIGURATION.md states; --log-level / --log-format, --redis-url
/ --namespace work on every subcommand as on the group (the subcommand's own option wins); JSON log mode writes
nothing but JSON objects to stderr; no --help names a source file; every option has a help text; `serve --help`
lists exactly the routes the gateway serves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from batchfleet.common.cli import _COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FILE = re.compile(r"\b[\w/]+\.py\b")


def commands() -> dict[str, click.Command]:
    return {name: main.get_command(click.Context(main), name) for name in sorted(_COMMANDS)}


def env_options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and p.envvar]


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(_COMMANDS))
def test_every_env_var_is_batchfleet_flag_and_shown(name: str):
    command = commands()[name]
    help_text = " ".join(CliRunner().invoke(main, [name, "--help"], terminal_width=400).output.split())
    for opt in env_options(command):
        flag = opt.opts[0]
        # an option with aliases (older names) reads one variable per name, by the same rule, its own first
        envs = [opt.envvar] if isinstance(opt.envvar, str) else list(opt.envvar)
        assert envs == ["BATCHFLEET_" + f[2:].upper().replace("-", "_") for f in opt.opts], (name, flag, envs)
        assert opt.show_envvar and f"env var: {', '.join(envs)}" in help_text, (name, flag)
    assert not SOURCE_FILE.search(help_text), f"`batchfleet {name} --help` names a source file"


@pytest.mark.unit
def test_group_help_names_the_rule_and_no_source_file():
    out = CliRunner().invoke(main, ["--help"]).output
    assert "BATCHFLEET_<OPTION>" in " ".join(out.split()) and not SOURCE_FILE.search(out)


@pytest.mark.unit
def test_readme_option_tables_hold_to_the_rule():
    """Each `--flag` of docs/CONFIGURATION.md's worker option table is an option of `batchfleet worker` whose
    variable is BATCHFLEET_<FLAG> (the document says so right above the table)."""
    readme = (ROOT / "docs" / "CONFIGURATION.md").read_text()
    assert "each also `BATCHFLEET_<NAME>`" in readme.replace("\n", " ")
    worker = commands()["worker"]
    by_flag = {o: p for p in env_options(worker) for o in p.opts}
    table = re.findall(r"^\| `(--[a-z0-9-]+)(?:/--no-[a-z0-9-]+)?` \|", readme, flags=re.M)
    assert len(table) >= 25
    for flag in table:
        assert flag in by_flag, f"docs/CONFIGURATION.md lists {flag}, which `batchfleet worker` lacks"
        envvar = by_flag[flag].envvar  # a list for an option with older names: its own variable first
        own = envvar if isinstance(envvar, str) else envvar[0]
        assert own == "BATCHFLEET_" + flag[2:].upper().replace("-", "_")


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(_COMMANDS))
def test_log_options_on_every_subcommand(name: str):
    params = {p.name for p in commands()[name].params}
    assert {"log_level", "log_format"} <= params, name


def test_subcommand_log_format_json_prints_only_json(namespace: str):
    """An error on an unreachable Redis, with the log options given to the subcommand (and, the other time,
    to the group): stderr is JSON objects only, stdout empty."""
    for argv in (["status", "--log-format", "json", "--log-level", "debug"], ["--log-format", "json", "status"]):
        proc = subprocess.run([sys.executable, "-m", "batchfleet.common.cli", *argv, "--redis-url",
                               "redis://127.0.0.1:1/0", "--namespace", namespace],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and not proc.stdout
        records = [json.loads(line) for line in proc.stderr.splitlines()]  # every line is one JSON object
        assert records and records[-1]["level"] == "ERROR" and "unreachable" in records[-1]["message"]


def test_subcommand_log_level_takes_effect(namespace: str):
    proc = subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "--log-level", "debug", "status",
                           "--log-level", "error", "--log-format", "json", "--redis-url", "redis://127.0.0.1:1/0",
                           "--namespace", namespace], capture_output=True, text=True, timeout=60)
    levels = {json.loads(line)["level"] for line in proc.stderr.splitlines()}
    assert levels == {"ERROR"}, proc.stderr  # the subcommand's own level wins over the group's


def all_commands() -> dict[str, click.Command]:
    """The group and every subcommand, by the words that run it."""
    return {"batchfleet": main, **{f"batchfleet {name}": command for name, command in commands().items()}}


@pytest.mark.unit
def test_every_option_has_help():
    missing = [f"{name} {'/'.join(p.opts)}" for name, command in all_commands().items() for p in command.params
               if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert not missing, f"options without a help text: {missing}"


ROUTE = re.compile(r"\b((?:GET|POST|PUT|PATCH|DELETE)(?:\|(?:GET|POST|PUT|PATCH|DELETE))*) (/[^\s,]*)")


@pytest.mark.unit
def test_serve_help_lists_exactly_the_routes_the_gateway_serves():
    from batchfleet.gateway.app import create_app

    app = create_app()
    # the app's routes as FastAPI publishes them, and as its 404 names them (a route kept out of the schema too)
    served = {(method.upper(), path) for path, ops in app.openapi()["paths"].items() for method in ops}
    served |= {(method, path) for line in app.state.endpoints for methods, path in [line.split(" ", 1)]
               for method in methods.split("|")}
    help_text = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output
    listed = {(method, path) for methods, path in ROUTE.findall(help_text) for method in methods.split("|")}
    assert listed == served, f"serve --help lacks {sorted(served - listed)}, lists {sorted(listed - served)} too"


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(_COMMANDS))
def test_group_connection_options_reach_every_subcommand(name: str):
    """--redis-url and --namespace on the group: every subcommand takes them (and so the group's value)."""
    assert {"redis_url", "namespace"} <= {p.name for p in main.params}
    assert {"redis_url", "namespace"} <= {p.name for p in commands()[name].params}, name


def test_group_connection_options_are_the_subcommands_defaults(start_worker, redis_url: str, namespace: str):
    """`batchfleet --redis-url URL --namespace NS status` (and submit) reach that Redis and namespace, over the
    BATCHFLEET_* variables; the subcommand's own options win over the group's."""
    start_worker(max_wait_ms=10)
    unreachable = "redis://127.0.0.1:1/0"
    env = {**os.environ, "BATCHFLEET_REDIS_URL": unreachable, "BATCHFLEET_NAMESPACE": "elsewhere"}

    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "batchfleet.common.cli", *argv], env=env, capture_output=True,
                              text=True, timeout=120)

    for argv in (["--redis-url", redis_url, "--namespace", namespace, "status"],
                 ["--redis-url", unreachable, "--namespace", "other", "status", "--redis-url", redis_url,
                  "--namespace", namespace]):
        proc = cli(*argv)
        assert proc.returncode == 0, (argv, proc.stderr)
        assert "worker " in proc.stdout and f"namespace {namespace} " in proc.stdout, (argv, proc.stdout)
    proc = cli("--redis-url", redis_url, "--namespace", namespace, "submit", "Hello", "--max-new-tokens", "4")
    assert proc.returncode == 0 and "finish=" in proc.stderr, proc.stderr
    proc = cli("--redis-url", redis_url, "--namespace", namespace, "status", "--redis-url", unreachable)
    assert proc.returncode == 1 and "unreachable" in proc.stderr, proc.stderr  # the subcommand's own URL won
