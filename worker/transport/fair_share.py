"""Fair share of one priority class between tenants: how many entries a worker reads from each tenant's streams.

Start-time fair queuing over tokens. Each tenant has a virtual time ``served``: the tokens (prompt + generated)
charged to it, divided by its weight. A read of ``room`` entries gives them out one at a time to the tenant with
work whose start tag (``served`` plus what this read already gave it, each entry at the tenant's mean cost,
divided by its weight) is the smallest, ties by name. So, while several tenants have work waiting, each gets
entries in proportion to its weight counted in tokens; a tenant alone gets every entry; nobody's unused share is
held back (a tenant without work is given nothing and its room goes to the others).

The real cost of a request is known only once it is answered: a read charges each entry at its tenant's mean cost
so far (``estimate``), and the answer (``done``) charges the difference, so over the requests answered the charges
sum to their real tokens.

Whether a tenant has work waiting is learnt from the reads themselves: a tenant whose read came back full (as
many entries as asked from one of its streams) is ``busy``; one that came back short is idle. An idle tenant is
read one entry (a probe) beside the room, so its next request is found at the next read, not after the others'
backlog: at most one entry per idle tenant above the read-ahead bound. A tenant coming back from idle starts
no further than ``credit_tokens`` (over its weight) behind the least-served busy tenant: idle time earns no
unbounded credit.

Pure: no Redis, no torch. One ``FairShare`` per priority class (interactive still comes first: the class of a
read is decided before this, worker/requests/intake.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DEFAULT_COST = 256.0  # tokens an entry of a tenant never answered yet is charged when read
CREDIT_TOKENS = 4096.0  # the most tokens (times its weight) a tenant back from idle may be served ahead
ESTIMATE_KEEP = 0.8  # the mean cost follows the answers as an exponential mean: this much of the old per answer


@dataclass
class TenantState:
    """One tenant's standing in a class."""

    weight: float = 1.0
    served: float = 0.0  # virtual time: tokens charged / weight
    estimate: float = DEFAULT_COST  # mean tokens of its requests (prompt + generated)
    busy: bool = False  # its last read came back full: more waits
    charged: float = 0.0  # tokens charged at read for entries not answered yet
    open: int = 0  # entries charged at read, not answered yet


class FairShare:
    """The virtual times of the tenants of one priority class (module docstring)."""

    def __init__(self, credit_tokens: float = CREDIT_TOKENS, default_cost: float = DEFAULT_COST) -> None:
        self.credit_tokens = credit_tokens
        self.default_cost = default_cost
        self.tenants: dict[str, TenantState] = {}
        self._weights: dict[str, float] = {}

    def state(self, tenant: str) -> TenantState:
        st = self.tenants.get(tenant)
        if st is None:
            st = self.tenants[tenant] = TenantState(weight=self._weights.get(tenant, 1.0),
                                                    estimate=self.default_cost, served=self.floor(tenant))
        return st

    def weigh(self, weights: Mapping[str, float]) -> None:
        """Take the configured weights (tenant -> weight > 0); a tenant not named weighs 1."""
        self._weights = {t: float(w) for t, w in weights.items() if w > 0}
        for tenant, st in self.tenants.items():
            st.weight = self._weights.get(tenant, 1.0)

    def floor(self, tenant: str) -> float:
        """The least virtual time ``tenant`` may have when it gets work: ``credit_tokens`` (over its weight) behind
        the least-served busy tenant other than it; 0 when none is busy."""
        others = [st.served for t, st in self.tenants.items() if st.busy and t != tenant]
        if not others:
            return 0.0
        return min(others) - self.credit_tokens / self._weights.get(tenant, 1.0)

    def plan(self, room: int, tenants: Iterable[str]) -> dict[str, int]:
        """How many entries to read of each of ``tenants`` (those with streams in this class) for ``room``
        entries: busy tenants share ``room`` by start tag; each idle tenant gets one probe, or, when no tenant is
        known busy, ``room`` is split evenly (a lone tenant gets all of it)."""
        names = sorted(set(tenants))
        if room <= 0 or not names:
            return {}
        busy = [t for t in names if self.state(t).busy]
        if not busy:
            each = -(-room // len(names))
            return dict.fromkeys(names, each)
        out = {t: 1 for t in names if t not in busy}
        given = dict.fromkeys(busy, 0)
        for _ in range(room):
            pick = min(busy, key=lambda t: (self._tag(t, given[t]), t))
            given[pick] += 1
        out.update({t: n for t, n in given.items() if n})
        return out

    def order(self, waiting: Mapping[str, int], n: int) -> list[str]:
        """Whose entries start next: the tenants of the next ``n`` admissions (``waiting``: tenant -> entries held,
        not started), each to the tenant with an entry left whose start tag (as in ``plan``) is the smallest, ties
        by name. Every tenant with work counts here, busy or not: what a worker holds was charged when read."""
        left = {t: k for t, k in waiting.items() if k > 0}
        for t in left:
            self.state(t)
        given = dict.fromkeys(left, 0)
        out: list[str] = []
        while left and len(out) < n:
            pick = min(left, key=lambda t: (self._tag(t, given[t]), t))
            out.append(pick)
            given[pick] += 1
            left[pick] -= 1
            if not left[pick]:
                del left[pick]
        return out

    def _tag(self, tenant: str, given: int) -> float:
        st = self.tenants[tenant]
        return st.served + given * st.estimate / st.weight

    def got(self, tenant: str, n: int, full: bool) -> None:
        """A read gave ``n`` entries of ``tenant``; ``full``: one of its streams returned all that was asked
        (more may wait). Charges each at the tenant's estimate."""
        st = self.state(tenant)
        if n > 0 and not st.busy:
            st.served = max(st.served, self.floor(tenant))
        st.busy = full
        if n > 0:
            cost = n * st.estimate
            st.served += cost / st.weight
            st.charged += cost
            st.open += n

    def done(self, tenant: str, tokens: int) -> None:
        """One entry of ``tenant`` was answered having cost ``tokens`` (0 for an error): the charge is corrected
        to it, and the estimate follows it."""
        st = self.state(tenant)
        if st.open > 0:
            was = st.charged / st.open
            st.charged -= was
            st.open -= 1
        else:
            was = 0.0  # read by a worker before a restart, or reclaimed: never charged here
        st.served += (tokens - was) / st.weight
        if tokens > 0:
            st.estimate = ESTIMATE_KEEP * st.estimate + (1 - ESTIMATE_KEEP) * tokens
