"""A client's admission of a limited tenant's work (issue 57): before a request is enqueued, the tenant's limits
(common/tenants.py, read from ``Keys.tenants`` and trusted ``SETTINGS_TRUST_S``) are checked and the request
counted in its sliding minute by one Redis function (common/redis/functions.py ``ADMIT``), atomically, on Redis'
clock: every gateway and client of the fleet shares the same windows. Over a limit: ``RateLimited`` (nothing was
enqueued). A request admitted is enqueued as any other; nothing drops it later for a limit.

A tenant with no limit (or none configured, or the default tenant "") costs nothing here: no admission call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from batchfleet.common import tenants as tenant_settings
from batchfleet.common.errors import ConfigError, InvalidRequest, RateLimited
from batchfleet.common.keys import Keys
from batchfleet.common.tenants import (
    REFUSED_LIMITS,
    Tenant,
    Window,
    refusal_text,
    too_large_text,
    utc_day,
    window_of,
)
from batchfleet.producer.core import Deadline
from batchfleet.producer.redis_calls import RedisCalls

SETTINGS_TRUST_S = 2.0  # a tenant's settings read this long ago still stand: an operator's change applies within it
MAX_REMEMBERED = 4096  # tenants whose settings and last window a client keeps (labels are operator-made: few)


class Limits:
    """The admissions of one client (``AsyncClient.limits``); ``last(label)``: the tenant's limits as this client's
    latest admission for it left them (the gateway's ``x-ratelimit-*`` headers of a successful answer)."""

    def __init__(self, calls: RedisCalls, keys: Callable[[], Keys]) -> None:
        self.calls = calls
        self._keys = keys
        self._settings: dict[str, tuple[Tenant | None, float]] = {}
        self._last: dict[str, Window] = {}

    async def tenant(self, label: str, deadline: Deadline) -> Tenant | None:
        """The tenant's settings (None: not configured, so no limit), cached ``SETTINGS_TRUST_S``."""
        cached = self._settings.get(label)
        if cached is not None and time.monotonic() - cached[1] < SETTINGS_TRUST_S:
            return cached[0]
        keys = self._keys()
        raw = await self.calls.io(lambda: self.calls.r.hget(keys.tenants, label), deadline, f"tenant {label}")
        try:
            tenant = None if raw is None else Tenant.decode(label, raw)
        except ConfigError:  # a hand-written entry that does not decode: no limit rather than no service
            tenant = None
        if len(self._settings) >= MAX_REMEMBERED:
            self._settings.clear()
        self._settings[label] = (tenant, time.monotonic())
        return tenant

    def last(self, label: str) -> Window | None:
        return self._last.get(label)

    async def admit(self, label: str, job_id: str, tokens: int, deadline: Deadline) -> Window | None:
        """Count a request of ``tokens`` (estimated: prompt + max_new_tokens) against the tenant's limits; None
        when the tenant has none. RateLimited when it is over one; InvalidRequest when the request alone exceeds
        a token limit (it never fits)."""
        if not label:
            return None
        tenant = await self.tenant(label, deadline)
        if tenant is None or not tenant.limited:
            self._last.pop(label, None)  # its limits removed: a success no longer shows the old ones' headers
            return None
        too_large = too_large_text(tenant, tokens)
        if too_large is not None:
            raise InvalidRequest(too_large)
        keys = self._keys()
        window_key = keys.limit_window(label)
        args = [tenant.requests_per_minute or 0, tenant.tokens_per_minute or 0, tenant.tokens_per_day or 0, label,
                job_id, tokens, tenant_settings.WINDOW_MS]  # read per call: a test shortens the minute
        reply = await self.calls.io(
            lambda: self.calls.function("admit", [window_key, f"{window_key}:tokens", keys.usage(utc_day())], args),
            deadline, f"admission of tenant {label}")
        window = window_of(tenant, reply)
        if len(self._last) >= MAX_REMEMBERED:
            self._last.clear()
        self._last[label] = window
        if not int(reply[0]):
            limit, wait_s = REFUSED_LIMITS[int(reply[1])], int(reply[2]) / 1000
            raise RateLimited(refusal_text(tenant, limit, wait_s, tokens), limit, wait_s, window)
        return window
