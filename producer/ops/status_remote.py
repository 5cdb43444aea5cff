"""``batchfleet status --gateway URL``: the status read through a gateway's (or ``batchfleet dashboard``'s)
``/dashboard/data`` with a read-only operator key, for an operator who has that key but no Redis access.
Plain urllib (the client-only install has no HTTP library)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from batchfleet.common.errors import BatchfleetError

TIMEOUT_S = 10.0


class StatusUnavailable(BatchfleetError):
    """The gateway did not give the status (unreachable, key refused, not a batchfleet gateway)."""


def fetch_status(base_url: str, key: str | None, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """The dashboard's data (``batchfleet status --json``'s snapshot plus the work) from ``base_url``, without
    the history samples."""
    url = base_url.rstrip("/") + "/dashboard/data?history_after=" + "9" * 13  # no history: the far future
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - the operator's URL
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise StatusUnavailable(f"{base_url} answered HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusUnavailable(f"cannot read the status from {base_url}: {reason}") from None
    for k in ("history", "batches", "dead_letter_entries", "time"):
        body.pop(k, None)
    return body
