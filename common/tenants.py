"""Tenants: who sends work to a fleet (a label, common/keys.py ``valid_tenant``), with a weight (its share of each
priority class when several tenants wait: the workers') and optional limits (requests and tokens per minute, tokens
per day: refused at admission, before a request is queued). Pure but for the small Redis helpers at the end (sync
and async clients alike: their calls are awaited or not by the caller).

Settings live in ``Keys.tenants`` (label -> JSON); a label absent there has weight 1 and no limit. The fleet's
usage per tenant lives in ``Keys.usage`` / ``Keys.usage(day)`` (written by the workers as jobs finish); this module
reads and shapes it for ``batchfleet usage``, the dashboard and the gateway's gauges.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from batchfleet.common.errors import ConfigError
from batchfleet.common.keys import TENANT_MAX_CHARS, Keys, valid_tenant

LIMITS = ("requests_per_minute", "tokens_per_minute", "tokens_per_day")
SETTINGS = ("weight", *LIMITS)
USAGE_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "generated_tokens")
DEFAULT_LABEL = "default"  # how the default tenant ("": requests naming none) is shown in tables and metric labels
OTHER_LABEL = "other"  # a metric label: every tenant not configured (bounded label set)
# what metrics and tables call the default tenant and the tenants not configured: a tenant of either name would
# be counted with them
RESERVED_LABELS = (DEFAULT_LABEL, OTHER_LABEL)
RESERVED_TEXT = (f"the tenant labels {DEFAULT_LABEL!r} and {OTHER_LABEL!r} are reserved (metrics and tables name the "
                 "default tenant and the tenants not configured so); the default tenant's settings are its own: "
                 "weight 1, no limit")
WINDOW_MS = 60_000  # the per-minute limits' sliding window
DAY_S = 86_400
MAX_WEIGHT = 1_000_000
MAX_LIMIT = 2**53 - 1  # the admit function compares in Lua's doubles: exact up to here


@dataclass(frozen=True)
class Tenant:
    """One tenant's settings, checked when made (an operator's input: a file, flags, ``Keys.tenants``).

    ``weight``: its share of a class when several tenants wait (> 0, default 1). Limits (None: none):
    ``requests_per_minute`` and ``tokens_per_minute`` over a sliding minute; ``tokens_per_day`` per UTC day.
    """

    label: str
    weight: float = 1.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None

    def __post_init__(self) -> None:
        if not valid_tenant(self.label):
            raise ConfigError(f"tenant label must be 1-{TENANT_MAX_CHARS} chars of [a-z0-9_-], got "
                              f"{str(self.label)[:40]!r}")
        if self.label in RESERVED_LABELS:
            raise ConfigError(RESERVED_TEXT)
        weight = self.weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                or not 0 < weight <= MAX_WEIGHT:
            raise ConfigError(f"tenant {self.label}: weight must be a number in (0, {MAX_WEIGHT}], got {weight!r}")
        object.__setattr__(self, "weight", float(weight))
        for name in LIMITS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= MAX_LIMIT):
                raise ConfigError(f"tenant {self.label}: {name} must be a whole number in [1, {MAX_LIMIT}] (or "
                                  f"absent: no limit), got {value!r:.40}")

    @property
    def limited(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMITS)

    def settings(self) -> dict[str, Any]:
        """The JSON stored in ``Keys.tenants`` (limits left out when absent)."""
        out: dict[str, Any] = {"weight": self.weight}
        out.update({k: v for k, v in asdict(self).items() if k in LIMITS and v is not None})
        return out

    @classmethod
    def of(cls, label: str, settings: Mapping[str, Any]) -> Tenant:
        """From a label and its settings (a file's entry, a stored JSON); an unknown setting is a ConfigError."""
        if not isinstance(settings, Mapping):
            raise ConfigError(f"tenant {label}: settings must be a mapping of {', '.join(SETTINGS)}")
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigError(f"tenant {label}: unknown setting(s) {', '.join(map(str, unknown))}; known: "
                              f"{', '.join(SETTINGS)}")
        return cls(label, **settings)

    @classmethod
    def decode(cls, label: str | bytes, raw: str | bytes) -> Tenant:
        label = label.decode(errors="replace") if isinstance(label, bytes) else label  # not UTF-8: no label
        try:
            settings = json.loads(raw)
        except ValueError:
            raise ConfigError(f"tenant {label}: stored settings are not JSON") from None
        return cls.of(label, settings)


def parse_tenants(data: Any) -> list[Tenant]:
    """A tenants file's content: ``{"tenants": {label: settings}}`` or ``{label: settings}`` (YAML, JSON or
    TOML read into a mapping). ConfigError naming the bad entry."""
    if isinstance(data, Mapping) and set(data) == {"tenants"}:
        data = data["tenants"]
    if not isinstance(data, Mapping):
        raise ConfigError("a tenants file maps each tenant label to its settings ({label: {weight: ..., ...}})")
    return [Tenant.of(str(label), settings or {}) for label, settings in data.items()]


def read_tenants_file(path: str | Path) -> list[Tenant]:
    """Tenants from a .json, .toml or .yaml/.yml file (``parse_tenants``)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:  # missing, unreadable or not text: one line naming the file
        raise ConfigError(f"{path.name} cannot be read as UTF-8 text: {exc}"[:300]) from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml  # type: ignore[import-untyped]  # an extra's (dev): JSON and TOML need nothing
            except ImportError:
                raise ConfigError(f"{path.name}: a YAML tenants file needs PyYAML (pip install pyyaml); "
                                  "JSON and TOML files need nothing more") from None
            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"{path.name}: a tenants file is .json, .toml, .yaml or .yml")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - each parser has its own error type: one line naming the file
        raise ConfigError(f"{path.name} is not valid {suffix[1:].upper()}: {exc}"[:300]) from None
    return parse_tenants(data)


# ---- admission arithmetic (pure) -------------------------------------------------------------------------------

def estimated_tokens(prompt_tokens: int, max_new_tokens: int) -> int:
    """What a request counts against its tenant's token limits when it is admitted: its prompt and the most it may
    generate, as OpenAI counts ``max_tokens`` (the real count is known only once it ran)."""
    return prompt_tokens + max_new_tokens


def utc_day(now: float | None = None) -> str:
    """``YYYY-MM-DD`` of ``now`` (default: this moment) in UTC: the day of ``Keys.usage(day)``."""
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if now is None else now))


def duration_text(seconds: float) -> str:
    """OpenAI's reset header format: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 10) / 10:g}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"


@dataclass(frozen=True)
class Window:
    """A tenant's limits as one admission left them: what OpenAI's ``x-ratelimit-*`` headers say (None: no such
    limit). ``reset_*_s``: until the oldest admission in the window leaves it (one more request or its tokens fit
    again); for a refused request, until it would fit."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float = 0.0
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float = 0.0

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for what in ("requests", "tokens"):
            limit = getattr(self, f"limit_{what}")
            if limit is not None:
                out[f"x-ratelimit-limit-{what}"] = str(limit)
                out[f"x-ratelimit-remaining-{what}"] = str(max(0, getattr(self, f"remaining_{what}") or 0))
                out[f"x-ratelimit-reset-{what}"] = duration_text(getattr(self, f"reset_{what}_s"))
        return out


def window_of(tenant: Tenant, reply: list[int]) -> Window:
    """The Window of an admit function's answer (common/redis/functions.py ``ADMIT``: admitted, refused limit,
    wait ms, requests in the window, tokens in the window, reset ms requests, reset ms tokens, tokens today)."""
    _, _, _, count, used, reset_requests, reset_tokens, today = (int(x) for x in reply[:8])
    requests, tokens, daily = tenant.requests_per_minute, tenant.tokens_per_minute, tenant.tokens_per_day
    # the token headers show the tighter of the minute's and the day's tokens left
    left = [x for x in ((tokens - used) if tokens else None, (daily - today) if daily else None) if x is not None]
    limit_tokens = tokens if tokens else daily
    return Window(requests, None if requests is None else requests - count, reset_requests / 1000,
                  limit_tokens, min(left) if left else None, reset_tokens / 1000)


REFUSED_LIMITS = {1: "requests_per_minute", 2: "tokens_per_minute", 3: "tokens_per_day"}


def refusal_text(tenant: Tenant, limit: str, wait_s: float, asked_tokens: int) -> str:
    """The message of a refused admission: which limit, how much, when to retry (OpenAI's wording's gist)."""
    value = getattr(tenant, limit)
    what = {"requests_per_minute": "requests per minute", "tokens_per_minute": "tokens per minute",
            "tokens_per_day": "tokens per day"}[limit]
    asked = "1 request" if limit == "requests_per_minute" else f"{asked_tokens} tokens (prompt + max_tokens)"
    return (f"rate limit reached for tenant {tenant.label} on {what}: limit {value}, asked {asked}; "
            f"try again in {duration_text(wait_s)}")


def too_large_text(tenant: Tenant, tokens: int) -> str | None:
    """Why a request can never be admitted (its estimate alone exceeds a token limit), else None."""
    for limit in ("tokens_per_minute", "tokens_per_day"):
        value = getattr(tenant, limit)
        if value is not None and tokens > value:
            return (f"request too large for tenant {tenant.label}: {tokens} tokens (prompt + max_tokens) exceed its "
                    f"{limit} of {value}; lower max_tokens or shorten the prompt")
    return None


# ---- usage (pure) ----------------------------------------------------------------------------------------------

def usage_rows(raw: Mapping[Any, Any]) -> dict[str, dict[str, int]]:
    """``Keys.usage`` hash -> {tenant: {what: count}} (fields ``<tenant>|<what>``; the default tenant "")."""
    out: dict[str, dict[str, int]] = {}
    for field_, value in raw.items():
        field_ = field_.decode() if isinstance(field_, bytes) else str(field_)
        tenant, sep, what = field_.rpartition("|")
        if not sep or what not in USAGE_FIELDS:
            continue
        try:
            out.setdefault(tenant, dict.fromkeys(USAGE_FIELDS, 0))[what] = int(value)
        except ValueError:
            continue
    return out


def shown(label: str) -> str:
    """A tenant as a table or a metric shows it: the default tenant ("") as ``default``."""
    return label or DEFAULT_LABEL


def metric_label(label: str, configured: Iterable[str]) -> str:
    """The bounded label a metric uses: a configured tenant's own, ``default``, else ``other``."""
    if not label:
        return DEFAULT_LABEL
    return label if label in set(configured) else OTHER_LABEL


def usage_table(tenants: Mapping[str, Tenant], total: Mapping[str, Mapping[str, int]],
                today: Mapping[str, Mapping[str, int]]) -> list[dict[str, Any]]:
    """One row per tenant (configured or seen in the usage): its usage in total and today, its share of the
    generated tokens, its weight and limits. Sorted by label (the default tenant first)."""
    generated = sum(u.get("generated_tokens", 0) for u in total.values()) or 0
    rows = []
    for label in sorted(set(tenants) | set(total) | set(today)):
        t = tenants.get(label)
        used = {k: int(total.get(label, {}).get(k, 0)) for k in USAGE_FIELDS}
        day = {k: int(today.get(label, {}).get(k, 0)) for k in USAGE_FIELDS}
        rows.append({"tenant": shown(label), "configured": t is not None, **used,
                     "tokens_today": day["prompt_tokens"] + day["generated_tokens"],
                     "requests_today": day["requests"],
                     "share": round(used["generated_tokens"] / generated, 4) if generated else 0.0,
                     "weight": t.weight if t else 1.0,
                     **{k: getattr(t, k) if t else None for k in LIMITS}})
    return rows


def render_usage(rows: list[dict[str, Any]]) -> str:
    """``batchfleet usage``'s table."""
    head = ("tenant", "requests", "prompt", "cached", "generated", "share", "today", "weight", "rpm", "tpm", "tpd")
    lines = [list(head)]
    for r in rows:
        lines.append([r["tenant"], str(r["requests"]), str(r["prompt_tokens"]), str(r["cached_tokens"]),
                      str(r["generated_tokens"]), f"{100 * r['share']:.1f}%", str(r["tokens_today"]),
                      f"{r['weight']:g}", *("-" if r[k] is None else str(r[k]) for k in LIMITS)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


# ---- Redis (the caller's client, sync or async: the calls are returned for it to await or not) ------------------

def decode_tenants(raw: Mapping[Any, Any]) -> dict[str, Tenant]:
    """``HGETALL Keys.tenants`` -> {label: Tenant}; an entry that does not decode is left out (never fatal to a
    reader: ``batchfleet tenants list`` shows what is stored)."""
    out = {}
    for label, value in raw.items():
        try:
            t = Tenant.decode(label, value)
        except (ConfigError, TypeError):
            continue
        out[t.label] = t
    return out


def write_tenants(r: Any, keys: Keys, tenants: Iterable[Tenant], replace: bool = False) -> None:
    """Store ``tenants`` (sync client); ``replace``: the others are removed (a file applied as the whole truth)."""
    tenants = list(tenants)
    pipe = r.pipeline(transaction=True)
    if replace:
        pipe.delete(keys.tenants)
    if tenants:
        pipe.hset(keys.tenants, mapping={t.label: json.dumps(t.settings()) for t in tenants})
    pipe.execute()


def read_usage(r: Any, keys: Keys, day: str | None = None) -> tuple[dict[str, Tenant], dict, dict]:
    """(tenants, usage in total, usage of ``day`` (default today, UTC)) with a sync client."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.tenants)
    pipe.hgetall(keys.usage())
    pipe.hgetall(keys.usage(day or utc_day()))
    tenants, total, today = pipe.execute()
    return decode_tenants(tenants), usage_rows(total), usage_rows(today)


def read_table(r: Any, keys: Keys, day: str | None = None) -> list[dict[str, Any]]:
    """``usage_table`` read with a sync client, each limited tenant's row with what its sliding minute holds now
    (``minute_requests``, ``minute_tokens``: admitted within the last minute, at their estimates; None when not
    limited): the dashboard's and ``batchfleet usage``'s rows."""
    tenants, total, today = read_usage(r, keys, day)
    rows = usage_table(tenants, total, today)
    limited = [label for label, t in sorted(tenants.items()) if t.limited]
    pipe = r.pipeline(transaction=False)
    cutoff = int(time.time() * 1000) - WINDOW_MS  # this host's clock: a display, not an admission
    for label in limited:
        pipe.zcount(keys.limit_window(label), cutoff, "+inf")
        pipe.get(f"{keys.limit_window(label)}:tokens")
    answers = pipe.execute() if limited else []
    minute = {label: (int(answers[2 * i]), int(answers[2 * i + 1] or 0)) for i, label in enumerate(limited)}
    for row in rows:
        requests, tokens = minute.get(row["tenant"], (None, None))
        row["minute_requests"], row["minute_tokens"] = requests, tokens
    return rows
