"""Redis URLs: checked before use, and redacted wherever one is shown (a usage error, a log line).

redis-py reads the password from the URL's user-info (``redis://user:pass@host``) or a ``password=``
query value; neither may reach a terminal or a log.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from batchfleet.common.errors import ConfigError

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
    if url.startswith("redis+sentinel://"):
        from batchfleet.common.redis_conn import parse_sentinel_url  # redis-py only where it is needed

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
