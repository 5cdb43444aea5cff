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
    value, ``parse`` turns the command-line text into the field's value, ``aliases`` are older flag names
    still accepted.
    """
    return {"help": help, "flag": flag, "choices": choices, "parse": parse, "aliases": aliases}


def option_flag(f: Field) -> str:
    """The option's name without dashes: ``reply-ttl`` for ``reply_ttl_s``."""
    return f.metadata["flag"] or f.name.replace("_", "-")


def option_env(f: Field) -> str:
    """The option's environment variable: ``BATCHFLEET_REPLY_TTL`` for ``reply_ttl_s``."""
    return ENV_PREFIX + option_flag(f).upper().replace("-", "_")


def is_option(f: Field) -> bool:
    """Whether a config field is also a command-line option."""
    return "help" in f.metadata
