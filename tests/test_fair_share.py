"""The tenants' fair share of a class (worker/transport/fair_share.py): exact shares on synthetic arrivals."""

from __future__ import annotations

import pytest

from batchfleet.worker.transport.fair_share import CREDIT_TOKENS, FairShare

pytestmark = pytest.mark.unit


def serve(share: FairShare, backlog: dict[str, list[int]], picks: int) -> list[str]:
    """A worker with one free slot per read: reads what the share plans, answers it at once (its real cost),
    while each tenant's backlog lasts; returns whose the first ``picks`` entries read were."""
    order: list[str] = []
    while len(order) < picks:
        tenants = list(backlog)
        plan = share.plan(1, tenants)
        for tenant in tenants:
            if not (asked := plan.get(tenant, 0)):
                continue
            took = backlog[tenant][:asked]
            del backlog[tenant][:asked]
            share.got(tenant, len(took), full=len(took) >= asked)  # as the reader tells it
            for cost in took:
                order.append(tenant)
                share.done(tenant, cost)
    return order[:picks]


def flood(n: int, cost: int = 100) -> list[int]:
    return [cost] * n


def test_equal_weights_split_entries_of_equal_cost_exactly_in_half():
    share = FairShare()
    order = serve(share, {"a": flood(1000), "b": flood(1000)}, 400)
    assert order.count("a") == order.count("b") == 200


def test_weights_three_to_one_give_three_quarters_of_the_tokens():
    share = FairShare()
    share.weigh({"a": 3})
    order = serve(share, {"a": flood(1000), "b": flood(1000)}, 400)
    assert (order.count("a"), order.count("b")) == (300, 100)


def test_the_share_is_counted_in_tokens_not_requests():
    share = FairShare()
    order = serve(share, {"a": flood(1000, cost=200), "b": flood(1000, cost=50)}, 500)
    tokens = {t: 200 * order.count("a") if t == "a" else 50 * order.count("b") for t in ("a", "b")}
    assert (order.count("a"), order.count("b")) == (100, 400)
    assert tokens["a"] == tokens["b"]


def test_a_lone_tenant_gets_every_entry_of_the_room():
    share = FairShare()
    assert share.plan(8, [""]) == {"": 8}
    share.got("", 8, full=True)
    assert share.plan(8, [""]) == {"": 8}
    share.got("", 3, full=False)  # drained: still all of the room
    assert share.plan(8, [""]) == {"": 8}


def test_an_idle_tenant_holds_back_no_share_and_is_probed_with_one_entry():
    share = FairShare()
    share.weigh({"b": 100})
    share.got("a", 8, full=True)
    share.got("b", 0, full=False)
    assert share.plan(8, ["a", "b"]) == {"a": 8, "b": 1}


def test_an_idle_tenant_comes_back_with_bounded_credit():
    share = FairShare()
    order = serve(share, {"a": flood(2000)}, 1000)  # b has no stream yet: a alone for 100,000 tokens
    assert order == ["a"] * 1000
    share.got("b", 0, full=False)
    order = serve(share, {"a": flood(1000), "b": flood(1000)}, 200)
    first = order.index("b")  # b's probe came with a read of a's
    run = len(order[first:]) - len("".join(order[first:]).lstrip("b"))  # b's entries in a row from there
    assert CREDIT_TOKENS / 100 - 2 <= run <= CREDIT_TOKENS / 100 + 2
    rest = order[first + run:]
    assert abs(rest.count("a") - rest.count("b")) <= 1  # then alternate


def test_without_a_busy_tenant_the_room_is_split_evenly():
    share = FairShare()
    assert share.plan(8, ["", "a", "b"]) == {"": 3, "a": 3, "b": 3}
    assert share.plan(0, ["a"]) == {}


def test_held_entries_start_with_the_tenant_furthest_behind_its_share():
    share = FairShare()
    share.got("a", 10, full=True)  # a flood: a's virtual time 10 x 256
    share.got("b", 1, full=False)  # b's one request: b starts the credit behind a, then is charged for it
    assert (share.tenants["a"].served, share.tenants["b"].served) == (2560.0, 2560.0 - CREDIT_TOKENS + 256)
    assert share.order({"a": 3, "b": 2}, 5) == ["b", "b", "a", "a", "a"]
    assert share.order({"a": 3, "b": 2}, 1) == ["b"]
    assert share.order({"a": 3}, 5) == ["a", "a", "a"]  # no more than is waiting
    assert share.order({"a": 3, "b": 0}, 2) == ["a", "a"]


def test_held_entries_of_busy_tenants_start_by_weight_ties_by_name():
    share = FairShare()
    share.weigh({"a": 3})
    share.state("a"), share.state("b")  # both known before either is busy: both start at 0
    share.got("a", 1, full=True)
    share.got("b", 1, full=True)
    assert (share.tenants["a"].served, share.tenants["b"].served) == (256 / 3, 256.0)
    assert share.order({"a": 8, "b": 8}, 8) == ["a", "a", "a", "b", "a", "a", "a", "b"]
