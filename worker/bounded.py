"""Reading stream entries with bounded worker memory, whatever size a producer gave them.

Enqueue caps payloads (common/functions.py), but a producer with raw ``XADD`` access can add entries of
any size (up to Redis' own limits: 512 MB per field). A plain ``XREADGROUP COUNT n`` would pull n of
them whole into the worker at once. Here every non-blocking read and every reclaim goes through a
script that takes entries one at a time inside Redis and returns a too-large entry cut short: at most
``KEEP_FIELDS`` fields of ``KEEP_BYTES`` each, with its real size, so the worker can answer it
(``invalid_request``) or dead-letter it without ever holding it. One call also stops after
``READ_BUDGET_BYTES`` returned or ``SCAN_BUDGET_BYTES`` looked at (what the script's own Lua heap
holds). The one read that is not size-checked is the idle worker's blocking read, made only after the
script found nothing: it takes at most one entry per stream (``COUNT 1``), the one that arrived during
the wait, cut down (``shrink``) as soon as it is read.

So a worker holds at most: one raw entry (while it is cut down) + ``READ_BUDGET_BYTES`` + one
``MAX_ENTRY_BYTES`` entry per read, on top of the requests it keeps (each <= ``MAX_ENTRY_BYTES``).
"""

from __future__ import annotations

from batchfleet.common.protocol import MAX_PAYLOAD_BYTES
from batchfleet.worker.transport import Entry

MAX_ENTRY_BYTES = MAX_PAYLOAD_BYTES + 64 * 1024  # payload + id, reply key and field names, with room to spare
MAX_FIELDS = 32  # names + values (16 pairs); a request has 3 pairs
KEEP_FIELDS = 32  # names + values kept of a too-large entry (16 pairs, as the dead-letter copy keeps)
KEEP_BYTES = 4096
READ_BUDGET_BYTES = 4 << 20  # whole entries returned by one script call
SCAN_BUDGET_BYTES = 64 << 20  # raw entry bytes one script call looks at (its Lua heap)

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

# KEYS: bucket streams. ARGV: group, consumer, count per stream, max_entry, max_fields, keep_fields,
# keep_bytes, read budget, scan budget.
# Returns {{stream, {{id, fields, oversize}, ...}}, ...} like XREADGROUP, plus each entry's oversize.
READ = _SHRINK + """
local out = {}
local returned, scanned = 0, 0
local count, budget, scan_budget = tonumber(ARGV[3]), tonumber(ARGV[8]), tonumber(ARGV[9])
for i = 1, #KEYS do
  local got = {}
  for _ = 1, count do
    if returned >= budget or scanned >= scan_budget then break end
    local ok, r = pcall(redis.call, 'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[i], '>')
    if not ok then
      -- what was read so far stays pending on us: hand it over; the error shows on the next call
      if #got > 0 then out[#out + 1] = {KEYS[i], got} end
      if #out > 0 then return out end
      return redis.error_reply(r.err or tostring(r))
    end
    if not r then break end
    local e = r[1][2][1]
    local fields, oversize, size = shrink(e[2], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]),
                                          tonumber(ARGV[7]))
    scanned = scanned + math.max(size, oversize)
    returned = returned + size
    got[#got + 1] = {e[1], fields, oversize}
    r, e = nil, nil
    if oversize > 0 then collectgarbage() end
  end
  if #got > 0 then out[#out + 1] = {KEYS[i], got} end
end
return out
"""

# KEYS: stream. ARGV: group, consumer, min idle ms, start cursor, count, max_entry, max_fields, keep_fields,
# keep_bytes, read budget, scan budget.
# Returns {next cursor, {{id, fields or false, oversize}, ...}, deleted count}: XAUTOCLAIM one entry at a
# time (so the Lua heap holds one raw entry), until count, the budgets, or the end of the pending list.
AUTOCLAIM = _SHRINK + """
local out, deleted = {}, 0
local returned, scanned = 0, 0
local cursor = ARGV[4]
local count, budget, scan_budget = tonumber(ARGV[5]), tonumber(ARGV[10]), tonumber(ARGV[11])
while #out < count and returned < budget and scanned < scan_budget do
  local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], cursor, 'COUNT', 1)
  cursor = r[1]
  if r[3] then deleted = deleted + #r[3] end
  local e = r[2][1]
  r = nil
  if e then
    local fields, oversize, size = shrink(e[2], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]),
                                          tonumber(ARGV[9]))
    scanned = scanned + math.max(size, oversize)
    returned = returned + size
    out[#out + 1] = {e[1], fields, oversize}
    e = nil
    if oversize > 0 then collectgarbage() end
  elseif e == false then
    out[#out + 1] = {'', false, 0}  -- Redis 6.2 reports an entry deleted while pending as nil
  end
  if cursor == '0-0' then break end
end
return {cursor, out, deleted}
"""

LIMIT_ARGS = (MAX_ENTRY_BYTES, MAX_FIELDS, KEEP_FIELDS, KEEP_BYTES, READ_BUDGET_BYTES, SCAN_BUDGET_BYTES)


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def fields_dict(flat: list) -> dict[bytes, bytes]:
    """A script's flat [name, value, ...] list as the dict redis-py gives for XREADGROUP (last name wins)."""
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def entry_of(bucket: int, raw: list) -> Entry | None:
    """An Entry from a script's {id, fields or false, oversize}; None for one deleted while pending."""
    entry_id, flat, oversize = raw[0], raw[1], int(raw[2] or 0)
    if not isinstance(flat, list):
        return None
    return Entry(bucket, as_str(entry_id), fields_dict(flat), oversize=oversize)


def shrink(entry: Entry) -> Entry:
    """Cut a too-large entry read whole (the blocking read) down, as the scripts do: the caller drops the
    original right away, so the worker keeps nothing of its size."""
    flat = [x for kv in entry.fields.items() for x in kv]
    size = sum(len(x) for x in flat)
    if size <= MAX_ENTRY_BYTES and len(flat) <= MAX_FIELDS:
        return entry
    kept = fields_dict([bytes(x[:KEEP_BYTES]) for x in flat[:KEEP_FIELDS]])
    return Entry(entry.bucket, entry.entry_id, kept, entry.deliveries, oversize=max(size, 1))


class BoundedReader:
    """``XREADGROUP`` of a consumer over its bucket streams, through ``READ`` (see the module docstring)."""

    def __init__(self, r, group: str, consumer: str, streams: dict[str, int]) -> None:
        self.r = r
        self.group = group
        self.consumer = consumer
        self.bucket_of = {s.encode(): b for s, b in streams.items()}
        self.stream_keys = list(streams)
        self._script = r.register_script(READ)

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to ``count`` new entries per stream. When there are none and ``block_ms`` is not None, waits
        for the first with a plain ``XREADGROUP COUNT 1`` (a script cannot block), cuts it down at once,
        then takes the rest through the script."""
        out = self.read_now(count)
        if out or block_ms is None:
            return out
        # nothing there: wait; only an entry arriving during this wait is read whole (then cut down)
        resp = self.r.xreadgroup(self.group, self.consumer, {s: ">" for s in self.stream_keys}, count=1,
                                 block=block_ms)
        out = [shrink(Entry(self._bucket(stream), as_str(eid), fields or {}))
               for stream, entries in resp or [] for eid, fields in entries]
        del resp  # the raw (maybe huge) entries go now, not at the end of the call
        if out and count > 1:
            out += self.read_now(count - 1)
        return out

    def read_now(self, count: int) -> list[Entry]:
        """Up to ``count`` new entries per stream, without blocking; too-large entries come cut short."""
        resp = self._script(keys=self.stream_keys, args=[self.group, self.consumer, count, *LIMIT_ARGS])
        out = []
        for stream, entries in resp or []:
            bucket = self._bucket(stream)
            out += [e for raw in entries if (e := entry_of(bucket, raw)) is not None]
        return out

    def _bucket(self, stream: bytes | str) -> int:
        return self.bucket_of[stream if isinstance(stream, bytes) else stream.encode()]


def autoclaim_script(r):
    """``AUTOCLAIM`` registered on client ``r``; call with keys=[stream] and ``autoclaim_args``."""
    return r.register_script(AUTOCLAIM)


def autoclaim_args(group: str, consumer: str, min_idle_ms: int, cursor: str, count: int) -> list:
    return [group, consumer, min_idle_ms, cursor, count, *LIMIT_ARGS]
