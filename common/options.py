"""Click options derived from the config dataclasses, and the two ways back from parsed values.

Each config field that carries ``option(...)`` metadata (common/optionspec.py) becomes ``--<flag>`` with
``envvar=BATCHFLEET_<FLAG>``, the field's default, a type from its annotation (or its choices / parse
function) and its help text. The click parameter's name is the field's name (``--reply-ttl`` fills
``reply_ttl_s``), so parsed values map onto the dataclasses without a translation table:
``build_worker_config`` assembles a WorkerConfig from them and ``option_args`` turns them back into
command-line args for a worker subprocess.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from batchfleet.common import logs
from batchfleet.common.config import ConnectionConfig, DynamicBatchingConfig, LogConfig, WorkerConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.errors import ConfigError
from batchfleet.common.optionspec import is_option, option_envs, option_flag

F = TypeVar("F", bound=Callable[..., Any])

# Every class whose fields are options, in the order the worker's --help lists them.
CONFIG_CLASSES: tuple[type, ...] = (ConnectionConfig, EngineConfig, DynamicBatchingConfig, WorkerConfig)


def option_fields(*classes: type) -> dict[str, dataclasses.Field]:
    """{field name: field} of the option fields of ``classes`` (default: all config classes), in order."""
    out: dict[str, dataclasses.Field] = {}
    for cls in classes or CONFIG_CLASSES:
        for f in dataclasses.fields(cls):
            if is_option(f):
                # one flat namespace of click parameter names: a clash would make one option shadow another
                assert f.name not in out, f"option {f.name} defined twice"
                out[f.name] = f
    return out


@functools.cache
def _field_types(cls: type) -> dict[str, type]:
    """Each field's type with ``| None`` removed (the annotations are strings under postponed evaluation)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
            (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        out[name] = typing.get_origin(hint) or hint
    return out


def _text(value: Any) -> str:
    """A value as the command line writes it: tuples comma-separated (the inverse of the parse functions)."""
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


class _Parsed(click.ParamType):
    """A field whose command-line text goes through the parse function its metadata names."""

    def __init__(self, parse: Callable[[str], Any], name: str) -> None:
        self.parse = parse
        self.name = name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return self.parse(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


def _click_option(cls: type, f: dataclasses.Field, default: Any, **extra: Any) -> Callable[[F], F]:
    flag, meta = option_flag(f), f.metadata
    kind = _field_types(cls)[f.name]
    envs = option_envs(f)  # a list only for an option with aliases: click reads the first one set
    kw: dict[str, Any] = {"envvar": envs[0] if len(envs) == 1 else envs, "show_envvar": True, "help": meta["help"],
                          "default": default, "show_default": default is not None, "callback": _group_value,
                          **extra}
    aliases = [f"--{a}" for a in meta.get("aliases", ())]
    if kind is bool:
        return click.option(f"--{flag}/--no-{flag}", f.name, **kw)
    if meta["parse"] is not None:
        kw["type"] = _Parsed(meta["parse"], flag)
        kw["default"] = None if default in (None, ()) else _text(default)
        kw["show_default"] = kw["default"] is not None
    elif meta["choices"] is not None:
        kw["type"] = click.Choice(meta["choices"], case_sensitive=False)
    else:
        kw["type"] = kind
    return click.option(f"--{flag}", *aliases, f.name, **kw)


def config_options(*classes: type, exclude: Iterable[str] = (),
                   defaults: Mapping[str, Any] | None = None) -> Callable[[F], F]:
    """Decorator: one click option per option field of ``classes``, minus ``exclude``.

    ``defaults`` replaces a field's default for this command only (``bench`` serves the ``bench`` preset).
    """
    defaults = dict(defaults or {})
    exclude = set(exclude)
    known = option_fields(*classes)
    if unknown := (exclude | set(defaults)) - set(known):
        raise ValueError(f"not options of {[c.__name__ for c in classes]}: {sorted(unknown)}")
    opts = [_click_option(cls, f, defaults.get(f.name, f.default))
            for cls in classes for f in dataclasses.fields(cls) if is_option(f) and f.name not in exclude]

    def decorate(fn: F) -> F:
        for opt in reversed(opts):  # click lists options in decoration order, innermost first
            fn = opt(fn)
        return fn

    return decorate


def _group_value(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A subcommand's option that the ``batchfleet`` group also takes (--redis-url, --namespace) and that was
    given on the group's command line but not on the subcommand's: the group's value
    (``batchfleet --redis-url URL status``). The subcommand's own command line wins, and the group's command
    line beats the subcommand's environment variable and default, as any command line beats them. A command of a
    subgroup (``batchfleet tenants set``) takes the nearest command line's that gave it."""
    if ctx.resilient_parsing or ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE:
        return value
    parent = ctx.parent
    while parent is not None:
        if param.name in parent.params and parent.get_parameter_source(param.name) is ParameterSource.COMMANDLINE:
            return parent.params[param.name]
        parent = parent.parent
    return value


def _apply_log_option(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Set up logging as soon as a --log-level / --log-format is parsed. On a subcommand a value left at
    its default keeps what the ``batchfleet`` group set (``batchfleet --log-format json status``)."""
    if value is None or ctx.resilient_parsing:
        return value
    if ctx.parent is not None and ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT:
        return value
    if param.name == "log_level":
        logs.configure(level=value)
    else:
        logs.configure(fmt=value)
    return value


def fatal(message: str) -> click.ClickException:
    """The one-line error a command stops with: ``Error: <message>`` on stderr (exit 1), or in JSON log mode
    one JSON log record (stderr stays one object per line). Raise what it returns."""
    if logs.current_format() == "json":
        import logging

        logging.getLogger("batchfleet").error(message)
        return _JsonExit(message)
    return click.ClickException(message)


class _JsonExit(click.ClickException):
    def show(self, file: Any = None) -> None:  # already logged as JSON
        pass


def log_options(fn: F) -> F:
    """``--log-level`` and ``--log-format`` (LogConfig; BATCHFLEET_LOG_LEVEL / _FORMAT), applied when parsed:
    on the group and on every subcommand alike."""
    for f in reversed(dataclasses.fields(LogConfig)):
        fn = _click_option(LogConfig, f, f.default, callback=_apply_log_option, expose_value=False,
                           is_eager=True)(fn)
    return fn


def _leaf_fields(cls: type) -> list[str]:
    """The fields of ``cls`` that hold values (WorkerConfig's nested configs are not leaves)."""
    return [name for name, kind in _field_types(cls).items() if kind not in CONFIG_CLASSES]


def config_values(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The values that are fields of ``cls``; a field absent here keeps its dataclass default."""
    return {name: values[name] for name in _leaf_fields(cls) if name in values}


def build_worker_config(**values: Any) -> WorkerConfig:
    """The one place a WorkerConfig is assembled from field values by name (parsed options, or Python callers
    that may also set fields that are not options, such as ``reclaim_budget``)."""
    if unknown := set(values) - {name for cls in CONFIG_CLASSES for name in _leaf_fields(cls)}:
        raise TypeError(f"not worker config fields: {sorted(unknown)}")  # never drop a value silently
    return WorkerConfig(connection=ConnectionConfig(**config_values(ConnectionConfig, values)),
                        batching=DynamicBatchingConfig(**config_values(DynamicBatchingConfig, values)),
                        engine=EngineConfig(**config_values(EngineConfig, values)),
                        **config_values(WorkerConfig, values))


def option_args(values: Mapping[str, Any]) -> list[str]:
    """Option values back into command-line args (to start a worker subprocess with them); None = default."""
    fields = option_fields()
    if unknown := set(values) - set(fields):
        raise TypeError(f"not worker options: {sorted(unknown)}")
    args: list[str] = []
    for name, value in values.items():
        flag = option_flag(fields[name])
        if isinstance(value, bool):
            args.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            args += [f"--{flag}", _text(value)]
    return args
