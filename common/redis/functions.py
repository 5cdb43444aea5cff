"""The server-side code of the producer side, as Lua run inside Redis: enqueue and cancel (every
producer), a tenant's admission under its limits (producers of a limited tenant), and the compare-and-renew /
compare-and-release of a batch lease (the gateway's batch runner).

On Redis 7+ a worker (or an admin, see docs/SECURITY.md) loads them once as the function library
``batchfleet`` and producers call them with ``FCALL``, so a producer's ACL user needs no ``EVAL``: it can
run these functions and nothing else of Lua. On Redis 6.2 (no functions) producers send the same
bodies with ``EVALSHA``. One body each, used both ways (``Functions`` picks).

Both run with the caller's ACL permissions (Redis has no "run as definer"): whatever a function writes,
its caller may also write directly. docs/SECURITY.md says what that means for untrusted producers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import redis

from batchfleet.common.redis.clients import same_node

LIBRARY_NAME = "batchfleet"
LIVE_WORKER_MS = 30_000  # a worker whose last heartbeat (Redis time) is older than this is gone
CANCELS_MAXLEN = 10_000
BELL_MAXLEN = 1_000  # rings kept unread at most (``Keys.tenant_bell``): workers delete what they read

# KEYS: stream, workers (zset)[, queued tenants (set), tenant bell (stream)]. ARGV: max_len (0 = unbounded), job
# id, reply key, payload, max payload bytes, require workers ('1'/'0'), live worker window (ms)[, tenant, consumer
# group]. Returns 1 enqueued, 0 queue full, -1 no live worker, -2 payload too large. The entry's id is Redis' clock.
# A named tenant's stream (common/keys.py ``Keys.stream``) is made here with the workers' group (from the start)
# and the tenant added to the set workers read (``Keys.queued_tenants``), so its first entry is read; the limit
# counts that stream alone: a tenant that fills its queue is refused, not the others. A tenant new to the set
# rings the bell (``Keys.tenant_bell``), a stream every worker's read includes: an idle worker blocked on the
# streams it knows wakes and reads the new tenant's at once, instead of at its next look at the set (up to
# seconds later). Capped: workers delete the rings they read, and one ring a tenant is all it takes.
_ENQUEUE_CHECKS = """\
if string.len(ARGV[4]) > tonumber(ARGV[5]) then return -2 end
if ARGV[6] == '1' then
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if redis.call('ZCOUNT', KEYS[2], now_ms - tonumber(ARGV[7]), '+inf') == 0 then return -1 end
end
local max_len = tonumber(ARGV[1])
if max_len > 0 and redis.call('XLEN', KEYS[1]) >= max_len then return 0 end
"""
_ENQUEUE_TENANT = """\
if KEYS[3] and ARGV[8] and ARGV[8] ~= '' then
  if redis.call('EXISTS', KEYS[1]) == 0 then
    redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[9], '0', 'MKSTREAM')
  end
  if redis.call('SADD', KEYS[3], ARGV[8]) == 1 and KEYS[4] then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', '""" + str(BELL_MAXLEN) + """', '*', 't', ARGV[8])
  end
end
"""
# bf_enqueue_v2's tenant part: the same without the bell
_ENQUEUE_TENANT_V2 = """\
if KEYS[3] and ARGV[8] and ARGV[8] ~= '' then
  if redis.call('EXISTS', KEYS[1]) == 0 then
    redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[9], '0', 'MKSTREAM')
  end
  redis.call('SADD', KEYS[3], ARGV[8])
end
"""
_ENQUEUE_ADD = """\
redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'r', ARGV[3], 'p', ARGV[4])
return 1
"""
# one copy of each part: the current body, v2 and v1 (below) differ only by the tenant's part
ENQUEUE = "\n" + _ENQUEUE_CHECKS + _ENQUEUE_TENANT + _ENQUEUE_ADD

# the older bodies, still registered for producers of before (they call them by name; an ACL user without EVAL
# has no fallback): v2's KEYS and ARGV are ENQUEUE's without the bell; v1's without the tenant's
ENQUEUE_V2 = "\n" + _ENQUEUE_CHECKS + _ENQUEUE_TENANT_V2 + _ENQUEUE_ADD
ENQUEUE_V1 = "\n" + _ENQUEUE_CHECKS + _ENQUEUE_ADD

# KEYS: cancel marker, cancels stream. ARGV: job id, reply key, ttl seconds, cancels maxlen.
# The marker stops a worker that reads the job later; the stream entry reaches workers already holding it.
# Workers honour a cancel only when its reply key is the job's own (only the submitter knows it).
CANCEL = """
redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', tonumber(ARGV[4]), '*', 'id', ARGV[1], 'r', ARGV[2])
return 1
"""

# KEYS: a batch lease (gateway/batches/store.py). ARGV: the holder's token, ttl ms. Only the holder extends it:
# returns 1 renewed, 0 not held (expired, or another process holds it now).
LEASE_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

# KEYS: a batch lease. ARGV: the holder's token. Only the holder drops it: returns 1 released, 0 not held.
LEASE_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: a tenant's window (zset: member "<job id>:<ms>:<n>|<tokens>", score = admission ms), its tokens in the window
# (string), the fleet's usage of today (hash, the workers': Keys.usage(day)). ARGV: requests per minute, tokens per
# minute, tokens per day (0 = no such limit), tenant label, job id, the request's estimated tokens, window ms.
# Admits (adds to the window) when every limit holds; returns {admitted 1/0, refused limit (0, 1 requests, 2 tokens
# per minute, 3 tokens per day), ms until it would fit, requests in the window, tokens in the window, ms until
# the oldest request leaves, the same for tokens, tokens of today (used + window)}. Clock: Redis', shared by every
# gateway and client. Today's tokens = the workers' count of finished jobs + the window's estimates (a job admitted
# within the minute is counted at its estimate, possibly twice once it finished: the quota errs on the safe side).
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[7])
local function tokens_of(member) return tonumber(string.match(member, '|(%d+)$')) or 0 end
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)
if #expired > 0 then
  local freed = 0
  for _, m in ipairs(expired) do freed = freed + tokens_of(m) end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  redis.call('DECRBY', KEYS[2], freed)
end
local count = redis.call('ZCARD', KEYS[1])
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
if count == 0 and used ~= 0 then
  redis.call('DEL', KEYS[2])
  used = 0
end
local rpm, tpm, tpd, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[6])
local finished = 0
if tpd > 0 then
  local u = redis.call('HMGET', KEYS[3], ARGV[4] .. '|prompt_tokens', ARGV[4] .. '|generated_tokens')
  finished = (tonumber(u[1]) or 0) + (tonumber(u[2]) or 0)
end
local function leaves(i)
  local e = redis.call('ZRANGE', KEYS[1], i, i, 'WITHSCORES')
  if #e == 0 then return 0 end
  return math.max(0, tonumber(e[2]) + window - now)
end
local function frees(need)
  local freed = 0
  local e = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  for i = 1, #e, 2 do
    freed = freed + tokens_of(e[i])
    if freed >= need then return math.max(0, tonumber(e[i + 1]) + window - now) end
  end
  return window
end
local refused, wait = 0, 0
if rpm > 0 and count + 1 > rpm then
  refused, wait = 1, leaves(count - rpm)
elseif tpm > 0 and used + tokens > tpm then
  refused, wait = 2, frees(used + tokens - tpm)
elseif tpd > 0 and finished + used + tokens > tpd then
  refused = 3
  if finished + tokens <= tpd then
    wait = frees(finished + used + tokens - tpd)
  else
    wait = 86400000 - now % 86400000
  end
end
if refused == 0 then
  -- the count makes a member unique even for one job id admitted twice within a millisecond
  redis.call('ZADD', KEYS[1], now, ARGV[5] .. ':' .. string.format('%.0f', now) .. ':' .. count .. '|' .. tokens)
  redis.call('INCRBY', KEYS[2], tokens)
  count, used = count + 1, used + tokens
end
redis.call('PEXPIRE', KEYS[1], window + 1000)
redis.call('PEXPIRE', KEYS[2], window + 1000)
local reset = leaves(0)
local reset_requests, reset_tokens = reset, reset
if refused == 1 then reset_requests = wait elseif refused > 1 then reset_tokens = wait end
return {refused == 0 and 1 or 0, refused, wait, count, used, reset_requests, reset_tokens, finished + used}
"""

BODIES = {"enqueue": ENQUEUE, "cancel": CANCEL}  # the client protocol's (docs/PROTOCOL.md): any producer
LEASE_BODIES = {"lease_renew": LEASE_RENEW, "lease_release": LEASE_RELEASE}  # the gateway's batch leases
LIMIT_BODIES = {"admit": ADMIT}  # a tenant's rate limits (common/tenants.py): any client admitting work for one
# bump a name's version with a body change: a worker of an older version loads its library over a newer one's
# (FUNCTION LOAD REPLACE), and a caller then falls back to EVALSHA of its own body rather than run an older one
# (enqueue v2: a named tenant's stream, its group and the queued-tenants set; v3: the tenant bell)
FUNCTION_NAMES = {"enqueue": "bf_enqueue_v3", "cancel": "bf_cancel_v1"}
# registered for older callers; nobody here calls them
LEGACY_BODIES = {"bf_enqueue_v1": ENQUEUE_V1, "bf_enqueue_v2": ENQUEUE_V2}
LEASE_FUNCTION_NAMES = {name: f"bf_{name}_v1" for name in LEASE_BODIES}
LIMIT_FUNCTION_NAMES = {name: f"bf_{name}_v1" for name in LIMIT_BODIES}
ALL_BODIES = {**BODIES, **LEASE_BODIES, **LIMIT_BODIES}
ALL_FUNCTION_NAMES = {**FUNCTION_NAMES, **LEASE_FUNCTION_NAMES, **LIMIT_FUNCTION_NAMES}


def library_code() -> str:
    """The ``FUNCTION LOAD`` source: every body registered under its versioned name."""
    parts = [f"#!lua name={LIBRARY_NAME}"]
    for name, body in ALL_BODIES.items():
        parts.append(f"local function {name}(KEYS, ARGV)\n{body.strip()}\nend")
        parts.append(f"redis.register_function('{ALL_FUNCTION_NAMES[name]}', {name})")
    for fname, body in LEGACY_BODIES.items():
        parts.append(f"local function {fname}(KEYS, ARGV)\n{body.strip()}\nend")
        parts.append(f"redis.register_function('{fname}', {fname})")
    return "\n".join(parts) + "\n"


def load_library(r) -> bool:
    """Load (or replace) the library with a sync redis-py client; False on a Redis without functions (< 7)."""
    try:
        r.execute_command("FUNCTION", "LOAD", "REPLACE", library_code())
    except redis.ResponseError as exc:
        if "unknown command" in str(exc).lower():
            return False
        raise
    return True


Command = Callable[[Any], Awaitable[Any]]  # client or pipeline -> the reply


class Functions:
    """Calls the library's functions on an asyncio client: ``FCALL``, or ``EVALSHA`` of the same body where
    Redis has no functions (6.2) or the library is not loaded (yet, or an older one without the function)."""

    def __init__(self, r: Any) -> None:
        self.r = r
        self._scripts = {name: r.register_script(body) for name, body in ALL_BODIES.items()}
        self._fcall = True  # False once Redis says it has no FCALL (< 7)

    async def call(self, name: str, keys: list[str], args: list[Any],
                   send: Callable[[Command], Awaitable[Any]] | None = None) -> Any:
        """Run function ``name``. ``send(command)`` awaits ``command(client)`` (default: on this client), so a
        caller may wrap it (common/redis/clients.py ``write_acked`` runs it in a pipeline with ``WAIT``)."""
        send = send or (lambda command: command(self.r))
        if self._fcall:
            try:
                # on a cluster, sent to the master of the first key: redis-py would ask a node which keys an
                # FCALL names (COMMAND GETKEYS, one more round trip) before every call
                where = same_node(self.r, keys[0]) if keys else {}
                return await send(lambda c: c.execute_command("FCALL", ALL_FUNCTION_NAMES[name], len(keys), *keys,
                                                              *args, **where))
            except redis.ResponseError as exc:
                msg = str(exc).lower()
                if "unknown command" in msg:
                    self._fcall = False
                elif "function not found" not in msg:
                    raise
        return await send(lambda c: self._scripts[name](keys=keys, args=args, client=c))
