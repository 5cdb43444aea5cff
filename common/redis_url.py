"""Redis URLs: checked before use, and redacted wherever one is shown (a usage error, a log line).

redis-py reads the password from the URL's user-info (``redis://user:pass@host``) or a ``password=``
query value; neither may reach a terminal or a log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from batchfleet.common.errors import ConfigError

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://")


def redact_url(url: str) -> str:
    """``url`` fit for messages and logs: the user-info's password (``user:pass@`` -> ``user:***@``;
    a bare ``token@`` -> ``***@``) and ``password=`` query values hidden."""
    head, at, rest = url.rpartition("@")  # the last "@": a password may itself hold one
    if at:
        scheme, sep, userinfo = head.partition("://")
        if not sep:
            scheme, userinfo = "", head
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        url = f"{scheme}{sep}{user + ':' if user else ''}***@{rest}"
    return re.sub(r"(?i)(password=)[^&#]*", r"\1***", url)


def check_redis_url(url: str) -> str:
    """``url`` when redis-py can parse it; ConfigError otherwise, whose message never shows the password."""
    if not isinstance(url, str) or not url.startswith(REDIS_SCHEMES):
        raise ConfigError("redis_url must start with redis://, rediss://, unix:// or redis+sentinel://, "
                          f"got {redact_url(str(url))!r}")
    if is_sentinel(url):
        parse_sentinel_url(url)  # ConfigError with the URL redacted
        return url
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not a number in 0..65535
        db = parts.path.strip("/")
        if parts.scheme != "unix" and ((parts.netloc and not parts.hostname) or (db and not db.isdigit())):
            raise ValueError
    except ValueError:
        # urllib's own message could quote a part of the URL: say what is wrong in our words
        raise ConfigError(f"redis_url is malformed (want redis://[user:pass@]host:port/db): {redact_url(url)!r}") \
            from None
    return url


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME + "://")


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://[user:pass@]h1:p1[,h2:p2]/service[/db]``; raises ConfigError on junk."""
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ConfigError(f"not a {SENTINEL_SCHEME}:// URL: {shown!r}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    sentinels = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        try:
            sentinels.append((host, int(port) if port else DEFAULT_SENTINEL_PORT))
        except ValueError:
            raise ConfigError(f"bad sentinel address {item!r} in {shown!r}") from None
    if not sentinels or any(not h for h, _ in sentinels):
        raise ConfigError(f"a sentinel URL needs at least one host: {shown!r}")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ConfigError(f"a sentinel URL needs /<master name>[/<db>]: {shown!r}")
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise ConfigError(f"bad db {path[1]!r} in {shown!r}") from None
    query = parse_qs(parts.query)
    return SentinelURL(tuple(sentinels), unquote(path[0]), db, unquote(user) or None, unquote(password) or None,
                       query.get("sentinel_password", [None])[0])
