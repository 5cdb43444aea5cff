"""Least privilege that holds: every command a Lua script calls inside Redis (which checks it against the
caller's ACL) is granted to each documented user that runs the script (docs/SECURITY.md's ACL block), so
no script fails under the documented users only when a rarely taken branch runs (the gateway's lease
renewal lacked PEXPIRE: a batch failed only once it ran longer than a third of its lease)."""

from __future__ import annotations

import re

import pytest

from batchfleet.common.redis import functions
from batchfleet.worker.transport import scripts
from tests.helpers.acl import acl_block

pytestmark = pytest.mark.unit
CALL_RE = re.compile(r"redis\.p?call\s*(?:\(\s*|,\s*)'([A-Za-z]+)'")


def commands_of(body: str) -> set[str]:
    """The commands a Lua body calls (``redis.call('X'``, ``redis.pcall('X'``, ``pcall(redis.call, 'X'``)."""
    return {name.lower() for name in CALL_RE.findall(body)}


def granted(user: str) -> set[str]:
    """Every command the block grants ``user``, at the root or in any selector (``+cmd`` and ``+cmd|sub``)."""
    out: set[str] = set()
    for line in acl_block().splitlines():
        words = line.split()
        if words[:3] != ["ACL", "SETUSER", user]:
            continue
        out.update(w.strip("()")[1:].split("|")[0].lower() for w in words[3:] if w.strip("()").startswith("+"))
    return out


def worker_bodies() -> dict[str, str]:
    return {name: value for name, value in vars(scripts).items()
            if isinstance(value, str) and "redis.call" in value and name.isupper()}


RUNS = {  # who runs which scripts (docs/SECURITY.md's users)
    "worker-a": worker_bodies(),
    "producer-a": functions.BODIES,
    "gateway-a": functions.ALL_BODIES,  # the client protocol's functions and the batch leases
}


def test_the_parser_finds_every_form_of_call():
    assert commands_of("redis.call('GET', k) redis.pcall('XACK', a) pcall(redis.call, 'XREADGROUP', x)") == {
        "get", "xack", "xreadgroup"}
    assert commands_of(functions.LEASE_RENEW) == {"get", "pexpire"}
    assert len(worker_bodies()) >= 5 and "RECOVER" in worker_bodies()


@pytest.mark.parametrize("user", sorted(RUNS))
def test_every_script_command_is_granted_to_the_user_that_runs_it(user):
    grants = granted(user)
    assert grants, f"docs/SECURITY.md's block has no user {user}"
    missing = {f"{name}: {cmd}" for name, body in RUNS[user].items() for cmd in commands_of(body) - grants}
    assert not missing, f"{user} runs scripts calling commands its ACL does not grant: {sorted(missing)}"
    runner = "fcall" if user != "worker-a" else "evalsha"
    assert runner in grants, f"{user} cannot run its scripts at all ({runner})"
