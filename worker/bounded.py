"""Reading stream entries with bounded worker memory, whatever size a producer gave them.

Enqueue caps payloads (common/functions.py), but a producer with raw ``XADD`` access can add entries of
any size (up to Redis' own limits: 512 MB per field). A plain ``XREADGROUP COUNT n`` would pull n of
them whole into the worker at once. Here every non-blocking read and every reclaim goes through a
script that checks each entry's size inside Redis and returns a too-large entry cut short: at most
``KEEP_FIELDS`` fields of ``KEEP_BYTES`` each, with its real size, so the worker can answer it
(``invalid_request``) or dead-letter it without ever holding it. One call also stops after
``READ_BUDGET_BYTES`` returned or ``SCAN_BUDGET_BYTES`` looked at (what the script's own Lua heap
holds). The read script takes a stream's entries with one ``XREADGROUP`` where all it can return fits in
both budgets: the whole stream's raw bytes (``MEMORY USAGE``, exact with ``SAMPLES 0``) plus the field
names Redis stores once per stream node but returns with every entry (< 4 KB an entry while
``stream-node-max-bytes`` is at its default, 4096); else one at a time (also where the stream is longer
than ``MEASURED_ENTRIES`` or the ACL user lacks ``memory|usage``). The bounds are the same either way, and
the common case costs Redis one command per stream, not one per entry.

The one read that is not size-checked is the idle worker's blocking read, made only after the script found
nothing (or right after a blocking read that found nothing: only entries added since can be there): it takes
at most one entry per stream (``COUNT 1``), the one that arrived during the wait (or since the last one), cut
down (``shrink``) as soon as it is read.

So a worker holds at most: one raw entry (while it is cut down) + ``READ_BUDGET_BYTES`` + one
``MAX_ENTRY_BYTES`` entry per read, on top of the requests it keeps (each <= ``MAX_ENTRY_BYTES``).
"""

from __future__ import annotations

from batchfleet.common.protocol import MAX_PAYLOAD_BYTES
from batchfleet.common.redis_conn import xread
from batchfleet.worker.scripts import WorkerScripts
from batchfleet.worker.transport import Entry

MAX_ENTRY_BYTES = MAX_PAYLOAD_BYTES + 64 * 1024  # payload + id, reply key and field names, with room to spare
MAX_FIELDS = 32  # names + values (16 pairs); a request has 3 pairs
KEEP_FIELDS = 32  # names + values kept of a too-large entry (16 pairs, as the dead-letter copy keeps)
KEEP_BYTES = 4096
READ_BUDGET_BYTES = 4 << 20  # whole entries returned by one script call
SCAN_BUDGET_BYTES = 64 << 20  # raw entry bytes one script call looks at (its Lua heap)
# a stream of at most this many entries is measured whole (MEMORY USAGE walks its nodes) and, when it fits the
# budgets, read with one XREADGROUP inside the script; a longer one is read an entry at a time
MEASURED_ENTRIES = 10_000

LIMIT_ARGS = (MAX_ENTRY_BYTES, MAX_FIELDS, KEEP_FIELDS, KEEP_BYTES, READ_BUDGET_BYTES, SCAN_BUDGET_BYTES)


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def fields_dict(flat: list) -> dict[bytes, bytes]:
    """A script's flat [name, value, ...] list as the dict redis-py gives for XREADGROUP (last name wins)."""
    return {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def entry_of(bucket: int, lane: str, raw: list) -> Entry | None:
    """An Entry from a script's {id, fields or false, oversize}; None for one deleted while pending."""
    entry_id, flat, oversize = raw[0], raw[1], int(raw[2] or 0)
    if not isinstance(flat, list):
        return None
    return Entry(bucket, as_str(entry_id), fields_dict(flat), oversize=oversize, lane=lane)


def shrink(entry: Entry) -> Entry:
    """Cut a too-large entry read whole (the blocking read) down, as the scripts do: the caller drops the
    original right away, so the worker keeps nothing of its size."""
    flat = [x for kv in entry.fields.items() for x in kv]
    size = sum(len(x) for x in flat)
    if size <= MAX_ENTRY_BYTES and len(flat) <= MAX_FIELDS:
        return entry
    kept = fields_dict([bytes(x[:KEEP_BYTES]) for x in flat[:KEEP_FIELDS]])
    return Entry(entry.bucket, entry.entry_id, kept, entry.deliveries, oversize=max(size, 1), lane=entry.lane)


class BoundedReader:
    """``XREADGROUP`` of a consumer over its bucket streams through the ``READ`` script (module docstring)."""

    def __init__(self, r, scripts: WorkerScripts, group: str, consumer: str,
                 streams: list[tuple[str, int, str]]) -> None:
        """``streams``: (stream, bucket, lane), most urgent first (``Keys.streams``)."""
        self.r = r
        self.group = group
        self.consumer = consumer
        self.where = {s.encode(): (b, lane) for s, b, lane in streams}
        self.streams = streams
        self._script = scripts.read
        # the last read was a blocking one that found nothing: whatever is there now arrived since, and a
        # blocking XREADGROUP returns it at once, so the next read goes straight to the blocking read
        self._quiet = False

    def read(self, counts: dict[str, int], block_ms: int | None) -> list[Entry]:
        """Up to ``counts[lane]`` new entries per stream of each lane (interactive streams first). When
        there are none and ``block_ms`` is not None, waits for the first with a plain ``XREADGROUP COUNT 1``
        over the streams of lanes with room (a script cannot block), cuts it down at once and returns it:
        the rest come with the next call, through the script. Right after a blocking read that found nothing,
        goes straight to the blocking read (an idle worker's cycle is one command)."""
        wanted = [s for s, _, lane in self.streams if counts.get(lane, 0) > 0]
        quiet, self._quiet = self._quiet, False
        out = [] if quiet and block_ms is not None and wanted else self.read_now(counts)
        if out or block_ms is None or not wanted:
            return out
        out = self.wait(counts, block_ms)
        # what else arrived meanwhile is the next read's (through the script): a lone request starts one round
        # trip sooner, and the next read is not blocking (the engine is busy then) or finds them at once
        self._quiet = not out
        return out

    def wait(self, counts: dict[str, int], block_ms: int, r=None) -> list[Entry]:
        """The blocking read alone: the first entry to arrive in a stream of a lane with room (``COUNT 1``
        per stream), cut down at once; ``r``: the client to block on (default this reader's)."""
        wanted = {s: ">" for s, _, lane in self.streams if counts.get(lane, 0) > 0}
        if not wanted:
            return []
        # only an entry arriving during this wait is read whole (then cut down)
        resp = xread(r or self.r, wanted, 1, block_ms, (self.group, self.consumer))
        out = []
        for stream, entries in resp or []:
            bucket, lane = self._where(stream)
            out += [shrink(Entry(bucket, as_str(eid), fields or {}, lane=lane)) for eid, fields in entries]
        del resp  # the raw (maybe huge) entries go now, not at the end of the call
        return out

    def read_now(self, counts: dict[str, int]) -> list[Entry]:
        """Up to ``counts[lane]`` new entries per stream, without blocking; too-large entries come cut short."""
        per_key = [max(0, counts.get(lane, 0)) for _, _, lane in self.streams]
        if not any(per_key):
            return []
        resp = self._script(keys=[s for s, _, _ in self.streams],
                            args=[self.group, self.consumer, 0, *LIMIT_ARGS, MEASURED_ENTRIES, *per_key])
        out = []
        for stream, entries in resp or []:
            bucket, lane = self._where(stream)
            out += [e for raw in entries if (e := entry_of(bucket, lane, raw)) is not None]
        return out

    def _where(self, stream: bytes | str) -> tuple[int, str]:
        return self.where[stream if isinstance(stream, bytes) else stream.encode()]


def autoclaim_args(group: str, consumer: str, min_idle_ms: int, count: int) -> list:
    """The AUTOCLAIM script's args before the per-stream cursors (worker/scripts.py)."""
    return [group, consumer, min_idle_ms, count, *LIMIT_ARGS]
