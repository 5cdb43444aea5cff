"""A config field that is also a command-line option: its metadata (``option(help, ...)``) and the one rule
that names its flag and environment variable. common/options.py builds the click options from it; the
config dataclasses (common/config.py, common/engine_config.py, gateway/config.py) declare it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import Field
from typing import Any

ENV_PREFIX = "BATCHFLEET_"


def option(help: str, *, flag: str | None = None, choices: tuple[str, ...] | None = None,
           parse: Callable[[str], Any] | None = None, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field metadata that makes a config field a CLI option (read by common/options.py).

    ``flag`` overrides ``--<field-name>`` (without the dashes); the environment variable is always
    ``BATCHFLEET_<FLAG>`` (one rule, no exceptions: docs/CONFIGURATION.md and --help say so). ``choices`` restricts the
    value, ``parse`` turns the command-line text into the field's value, ``aliases`` are the option's older
    names, still accepted as flags and, by the same rule, as environment variables (``BATCHFLEET_<ALIAS>``;
    the current name wins when both are set): a rename keeps old command lines and deployments working for a
    release (docs/CONFIGURATION.md, "Deprecated names").
    """
    return {"help": help, "flag": flag, "choices": choices, "parse": parse, "aliases": aliases}


def option_flag(f: Field) -> str:
    """The option's name without dashes: ``reply-ttl`` for ``reply_ttl_s``."""
    return f.metadata["flag"] or f.name.replace("_", "-")


def env_name(flag: str) -> str:
    """The environment variable of a flag name (without dashes): ``BATCHFLEET_REPLY_TTL`` for ``reply-ttl``."""
    return ENV_PREFIX + flag.upper().replace("-", "_")


def option_env(f: Field) -> str:
    """The option's environment variable: ``BATCHFLEET_REPLY_TTL`` for ``reply_ttl_s``."""
    return env_name(option_flag(f))


def option_envs(f: Field) -> list[str]:
    """Every environment variable the option reads, its own first (click takes the first one set)."""
    return [option_env(f), *(env_name(a) for a in f.metadata.get("aliases", ()))]


def is_option(f: Field) -> bool:
    """Whether a config field is also a command-line option."""
    return "help" in f.metadata
