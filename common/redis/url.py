"""Redis URLs: checked before use, and redacted wherever one is shown (a usage error, a log line).

redis-py reads the password from the URL's user-info (``redis://user:pass@host``) or a ``password=``
query value; neither may reach a terminal or a log.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

from batchfleet.common.errors import ConfigError

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_REDIS_PORT = 6379
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://")


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
        raise ConfigError("redis_url must start with redis://, rediss://, unix://, redis+sentinel:// or "
                          f"redis+cluster://, got {redact_url(str(url))!r}")
    if not url.isprintable():
        # bytes that were no UTF-8 (argv and the environment decode them to lone surrogates, not printable) or
        # control characters: no host, user or password has them, and the socket layer would fail with a traceback
        raise ConfigError(f"redis_url holds characters no Redis address has (invalid UTF-8 or control "
                          f"characters): {redact_url(url)!r}")
    if is_sentinel(url):
        parse_sentinel_url(url)  # ConfigError with the URL redacted
        return url
    if is_cluster(url):
        parse_cluster_url(url)
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


def _split_multi_host(url: str, scheme: str, default_port: int) \
        -> tuple[SplitResult, str, tuple[tuple[str, int], ...], str | None, str | None]:
    """A ``scheme://[user:pass@]h1:p1[,h2:p2...]/...`` URL (Sentinel, Cluster): (urlsplit parts, redacted URL,
    (host, port) pairs, user, password); ConfigError (URL redacted) on junk."""
    parts = urlsplit(url)
    shown = redact_url(url)
    if parts.scheme != scheme:
        raise ConfigError(f"not a {scheme}:// URL: {shown!r}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    return parts, shown, _hosts(hostlist, default_port, shown), unquote(user) or None, unquote(password) or None


def _hosts(hostlist: str, default_port: int, shown: str) -> tuple[tuple[str, int], ...]:
    """``h1:p1[,h2:p2...]`` as (host, port) pairs; ConfigError (URL redacted) on junk."""
    out = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        try:
            number = int(port) if port else default_port
            if not 0 < number < 65536:
                raise ValueError
        except ValueError:
            raise ConfigError(f"bad address {item!r} in {shown!r}") from None
        out.append((host, number))
    if not out or any(not h for h, _ in out):
        raise ConfigError(f"the URL needs at least one host: {shown!r}")
    return tuple(out)


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis+sentinel://[user:pass@]h1:p1[,h2:p2]/service[/db]``; raises ConfigError on junk."""
    parts, shown, sentinels, user, password = _split_multi_host(url, SENTINEL_SCHEME, DEFAULT_SENTINEL_PORT)
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ConfigError(f"a sentinel URL needs /<master name>[/<db>]: {shown!r}")
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise ConfigError(f"bad db {path[1]!r} in {shown!r}") from None
    query = parse_qs(parts.query)
    return SentinelURL(sentinels, unquote(path[0]), db, user, password, query.get("sentinel_password", [None])[0])


@dataclass(frozen=True)
class ClusterURL:
    """A parsed ``redis+cluster://`` URL: seed nodes (any few of the cluster's; the client learns the rest)."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None


def is_cluster(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME + "://")


def parse_cluster_url(url: str) -> ClusterURL:
    """Parse ``redis+cluster://[user:pass@]h1:p1[,h2:p2...][/0]``; raises ConfigError on junk. A cluster has
    only database 0."""
    parts, shown, nodes, user, password = _split_multi_host(url, CLUSTER_SCHEME, DEFAULT_REDIS_PORT)
    if parts.path.strip("/") not in ("", "0"):
        raise ConfigError(f"a Redis Cluster has only database 0: {shown!r}")
    return ClusterURL(nodes, user, password)
