"""Every Lua script a worker runs inside Redis, in one module, registered once per connection.

Producers' server-side code (enqueue, cancel) is common/redis/functions.py. Here: the heartbeat, joining and leaving the
fleet, making and retiring a named tenant's streams (worker/transport/tenant_gc.py), and the size-checking reads of
request entries, cancel entries and job markers (worker/transport/bounded.py says why).
Replies are plain commands (worker/transport/settle.py): a script's inner commands cost Redis ~3x the same commands sent
plain (issue 29). ``WorkerScripts(r)``
registers each body once on client ``r`` (redis-py then sends EVALSHA, loading the body again by itself after
a SCRIPT FLUSH or a restart; pipelines do not: ``load``); the stream consumer builds one for its parts."""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import ClusterPipeline

# KEYS: workers (zset), status key, fleet key. ARGV: name, status blob ('' = keep the status there is, its TTL
# renewed: a long engine step keeps the worker's last status, so it stays ready), status ttl, fleet ttl (0:
# none: a fleet that scales to zero), prune ('1': drop names silent for a day; only every few beats, since the
# set only grows by a restart).
# Redis' own clock scores liveness, so no host clock matters. Returns TIME (for this host's clock offset)
# and whether the fleet description still existed (0: the worker publishes it again).
HEARTBEAT = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now_ms, ARGV[1])
if ARGV[5] == '1' then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms - 86400000) end
if ARGV[2] ~= '' then redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[3]))
else redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3])) end
local kept
if tonumber(ARGV[4]) > 0 then kept = redis.call('EXPIRE', KEYS[3], tonumber(ARGV[4]))
else kept = redis.call('EXISTS', KEYS[3]) end  -- a fleet that scales to zero: no TTL
return {t[1], t[2], kept}
"""

_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: fleet, workers. ARGV: encoded FleetInfo, its fingerprint, worker name, live window ms, ttl ms (0: no
# TTL, a fleet that scales to zero), replace ('1'/'0'). Returns {1} when published, {0, published fingerprint,
# live workers other than us}.
JOIN = _NOW_MS + """
local since = now - tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. since)  -- dead workers' names
if ARGV[6] ~= '1' then
  local cur = redis.call('GET', KEYS[1])
  if cur then
    local ok, obj = pcall(cmsgpack.unpack, cur)
    local fp = ''
    if ok and type(obj) == 'table' and type(obj.fingerprint) == 'string' then fp = obj.fingerprint end
    if fp ~= ARGV[2] then
      local others = 0
      for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], since, '+inf')) do
        if w ~= ARGV[3] then others = others + 1 end
      end
      if others > 0 then return {0, fp, others} end
    end
  end
end
if tonumber(ARGV[5]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[5]))
else
  redis.call('SET', KEYS[1], ARGV[1])  -- scale to zero: kept with no worker left
end
redis.call('ZADD', KEYS[2], now, ARGV[3])
return {1}
"""

# KEYS: fleet, workers. ARGV: worker name, live window ms, keep ('1': a fleet that scales to zero keeps its
# description). Returns 1 when the fleet key was deleted.
LEAVE = _NOW_MS + """
redis.call('ZREM', KEYS[2], ARGV[1])
if ARGV[3] ~= '1' and redis.call('ZCOUNT', KEYS[2], now - tonumber(ARGV[2]), '+inf') == 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


# Shared by both scripts: whether an error is NOGROUP of a named tenant's stream (``:t:``): the stream was retired
# (worker/transport/tenant_gc.py; it held nothing, so nothing is pending there), or a producer's plain XADD made it
# again since without the workers' group (the worker's next look at the tenants gives it the group; nothing was read
# from it). Skipped. A default stream's NOGROUP is raised: Redis lost its data.
_TENANT_MADE_AGAIN = """
local function tenant_made_again(key, err)
  return string.find(key, ':t:', 1, true) ~= nil and string.find(err, 'NOGROUP', 1, true) ~= nil
end
"""

# Shared by both scripts: cut one entry down when it is too large. Returns fields, oversize (0 = whole),
# bytes it adds to the reply. A dropped big string is collected at once, so the Lua heap stays small.
_SHRINK = """
local function shrink(f, max_entry, max_fields, keep_fields, keep_bytes)
  local size = 0
  for j = 1, #f do size = size + #f[j] end
  if size <= max_entry and #f <= max_fields then return f, 0, size end
  local kept = {}
  for j = 1, math.min(#f, keep_fields) do kept[j] = string.sub(f[j], 1, keep_bytes) end
  return kept, math.max(size, 1), keep_fields * keep_bytes
end
"""

# KEYS: streams a read cut off by the reply guard delivered into (worker/transport/bounded.py). ARGV: group, consumer,
# max_entry, max_fields, keep_fields, keep_bytes, read budget, scan budget, bytes the guard charges an element,
# then one id per stream: the entries pending on this consumer above it are the ones never seen. Returns per
# stream {last id looked at, {{id, fields, oversize, deliveries}, ...}, 1 when none is left}: one entry at a time
# (XPENDING, then XRANGE: the Lua heap holds one raw entry, and the delivery count stays what the read made it),
# until the budgets; what an entry adds to the reply counts as the guard counts it, so the reply always passes.
RECOVER = _SHRINK + _TENANT_MADE_AGAIN + """
local budget, scan_budget, element = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local returned, scanned, res = 0, 0, {}
for i = 1, #KEYS do
  local cursor, out, done = ARGV[9 + i], {}, 0
  while returned < budget and scanned < scan_budget do
    local pend = redis.pcall('XPENDING', KEYS[i], ARGV[1], '(' .. cursor, '+', 1, ARGV[2])
    if pend.err then
      if not tenant_made_again(KEYS[i], pend.err) then return redis.error_reply(pend.err) end
      done = 1; break
    end
    local p = pend[1]
    if not p then done = 1; break end
    cursor = p[1]
    local e = redis.call('XRANGE', KEYS[i], cursor, cursor)[1]
    if e then
      local fields, oversize, size = shrink(e[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]),
                                            tonumber(ARGV[6]))
      scanned = scanned + math.max(size, oversize)
      returned = returned + size + element * (#fields + 5)  -- + its id, counts and two array headers
      out[#out + 1] = {cursor, fields, oversize, p[4]}
      e = nil
      if oversize > 0 then collectgarbage() end
    else
      redis.call('XACK', KEYS[i], ARGV[1], cursor)  -- deleted while pending: nothing left to answer
    end
  end
  res[i] = {cursor, out, done}
end
return res
"""

# KEYS: the bucket streams. ARGV: group, consumer, min idle ms, count, max_entry, max_fields, keep_fields,
# keep_bytes, read budget, scan budget, then one start cursor per stream.
# Returns per stream {next cursor, {{id, fields or false, oversize}, ...}, deleted count}: XAUTOCLAIM one
# entry at a time (so the Lua heap holds one raw entry), stream after stream, until count, the budgets, or
# the end of each pending list. One call for every stream: a reclaim pass costs 1 + streams commands.
AUTOCLAIM = _SHRINK + _TENANT_MADE_AGAIN + """
local res = {}
local count, budget, scan_budget = tonumber(ARGV[4]), tonumber(ARGV[9]), tonumber(ARGV[10])
local n, returned, scanned = 0, 0, 0
for i = 1, #KEYS do
  local cursor, out, deleted = ARGV[10 + i], {}, 0
  while n < count and returned < budget and scanned < scan_budget do
    local r = redis.pcall('XAUTOCLAIM', KEYS[i], ARGV[1], ARGV[2], ARGV[3], cursor, 'COUNT', 1)
    if r.err then
      if not tenant_made_again(KEYS[i], r.err) then return redis.error_reply(r.err) end
      cursor = '0-0'; break
    end
    cursor = r[1]
    if r[3] then deleted = deleted + #r[3] end
    local e = r[2][1]
    r = nil
    if e then
      local fields, oversize, size = shrink(e[2], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]),
                                            tonumber(ARGV[8]))
      scanned = scanned + math.max(size, oversize)
      returned = returned + size
      out[#out + 1] = {e[1], fields, oversize}
      n = n + 1
      e = nil
      if oversize > 0 then collectgarbage() end
    elseif e == false then
      -- Redis 6.2 reports an entry deleted while pending as nil: charged to the read budget as the reply guard
      -- charges it (4 elements, 64 bytes each), so a call past thousands of them (a trimmed backlog) stays under
      -- the reply cap; the caller acks them, and the next call goes on from the cursor
      out[#out + 1] = {'', false, 0}
      returned = returned + 256
    end
    if cursor == '0-0' then break end
  end
  res[i] = {cursor, out, deleted}
end
return res
"""

# KEYS: cancels stream. ARGV: last id seen, most entries, bytes kept per field value. Returns {last id, {{id,
# job id, reply key}, ...}}: entries one at a time (the Lua heap holds one), each field cut to ARGV[3] bytes.
CANCELS = """
local last, out = ARGV[1], {}
for _ = 1, tonumber(ARGV[2]) do
  local r = redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', 1)
  local e = r[1]
  r = nil
  if not e then break end
  last = e[1]
  local id, reply = '', ''
  for j = 1, #e[2], 2 do
    if e[2][j] == 'id' then id = string.sub(e[2][j + 1], 1, tonumber(ARGV[3])) end
    if e[2][j] == 'r' then reply = string.sub(e[2][j + 1], 1, tonumber(ARGV[3])) end
  end
  out[#out + 1] = {last, id, reply}
  e = nil
end
return {last, out}
"""

# KEYS: n cancel markers, then n done markers. ARGV: n, longest marker value kept. Returns {cancel value or false,
# ..., done 0/1, ...}: a marker longer than ARGV[2] comes back false (it cannot be a reply key), so a hostile value
# is never read into the worker. Only when a plain EXISTS found one (a cancel before delivery, a job answered).
MARKS = """
local n, out = tonumber(ARGV[1]), {}
for i = 1, n do
  if redis.call('STRLEN', KEYS[i]) <= tonumber(ARGV[2]) then out[i] = redis.call('GET', KEYS[i]) else out[i] = false end
  out[n + i] = redis.call('EXISTS', KEYS[n + i])
end
return out
"""

# A named tenant's streams on one shard (worker/transport/tenant_gc.py). KEYS: queued tenants (set), then the tenant's
# streams (every bucket, both classes). ARGV: tenant, the workers' group. While the tenant is queued, makes each of
# its streams that is missing with the group (from its start: ids '0'; an existing group is kept), so a worker reads
# them all without NOGROUP; a retired tenant's are never made again here (only its next enqueue does, adding it to
# the set in the same call). Returns 1 when the tenant is queued (its streams exist now), else 0.
ENSURE_TENANT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return 0 end
for i = 2, #KEYS do
  local ok = redis.pcall('XGROUP', 'CREATE', KEYS[i], ARGV[2], '0', 'MKSTREAM')
  if type(ok) == 'table' and ok.err and not string.find(ok.err, 'BUSYGROUP', 1, true) then
    return redis.error_reply(ok.err)
  end
end
return 1
"""

# Retires a named tenant of one shard once its streams stayed empty (worker/transport/tenant_gc.py). KEYS: queued
# tenants (set), idle tenants (hash), then the tenant's streams (every bucket, both classes). ARGV: tenant, how long
# they must stay empty (ms). An answered entry is deleted, so XLEN 0 everywhere means nothing queued or running.
# Empty for the first time: the tenant's clock starts (HSET now); empty still, with no entry added since the clock
# started (every stream's last-generated-id older) and for long enough: its streams are deleted and it leaves the
# set, in this one call, so an enqueue is either before (its entry keeps the tenant) or after (it makes the stream
# and its group and adds the tenant again, as a first enqueue does). Returns 0 not queued, 1 has work, 2 idle
# (waiting), 3 retired.
RETIRE_TENANT = """
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  return 0
end
local newest = 0
for i = 3, #KEYS do
  if redis.call('XLEN', KEYS[i]) > 0 then
    redis.call('HDEL', KEYS[2], ARGV[1])
    return 1
  end
  if redis.call('EXISTS', KEYS[i]) == 1 then
    local info = redis.call('XINFO', 'STREAM', KEYS[i])
    for j = 1, #info - 1, 2 do
      if info[j] == 'last-generated-id' then
        newest = math.max(newest, tonumber(string.match(info[j + 1], '^(%d+)')) or 0)
      end
    end
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local since = tonumber(redis.call('HGET', KEYS[2], ARGV[1]))
if not since or newest >= since then
  redis.call('HSET', KEYS[2], ARGV[1], now)
  return 2
end
if now - since < tonumber(ARGV[2]) then return 2 end
for i = 3, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 3
"""


class WorkerScripts:
    """The worker's scripts registered on one client (call each with keys=[...], args=[...], client=pipe)."""

    def __init__(self, r) -> None:
        self.heartbeat = r.register_script(HEARTBEAT)
        self.join = r.register_script(JOIN)
        self.leave = r.register_script(LEAVE)
        self.recover = r.register_script(RECOVER)
        self.autoclaim = r.register_script(AUTOCLAIM)
        self.cancels = r.register_script(CANCELS)
        self.marks = r.register_script(MARKS)
        self.ensure_tenant = r.register_script(ENSURE_TENANT)
        self.retire_tenant = r.register_script(RETIRE_TENANT)

    def load(self) -> None:
        """``SCRIPT LOAD`` every script (a cluster client: on every master): no pipeline meets a NOSCRIPT at startup."""
        for script in vars(self).values():
            script.registered_client.script_load(script.script)

    @staticmethod
    def queue(pipe: Any, script: Any, keys: list, args: list) -> None:
        """Queue ``script`` on ``pipe``. redis-py's cluster pipeline refuses the ``evalsha`` method (a Script
        call), so it gets the raw command; the script is then expected loaded (``run_pipeline`` reloads it)."""
        if isinstance(pipe, ClusterPipeline):
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        else:
            script(keys=keys, args=args, client=pipe)

    @staticmethod
    def run_pipeline(pipe: Any, *scripts: Any) -> list:
        """``pipe.execute()``. On a cluster a NOSCRIPT (a promoted replica has an empty script cache) loads
        ``scripts`` on every master and raises a ConnectionError, a transient error: the caller's retry
        rebuilds the pipeline, and what it writes is idempotent."""
        try:
            return pipe.execute()
        except redis.exceptions.NoScriptError:
            if not isinstance(pipe, ClusterPipeline):
                raise
            for script in scripts:
                script.registered_client.script_load(script.script)
            raise redis.ConnectionError("NOSCRIPT on a cluster master (after a failover): scripts reloaded") from None
