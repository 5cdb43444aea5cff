"""What the sync and async clients send and receive: tokenizing, routing, building requests, reading replies.

Nothing here does I/O; the clients own their connections (and producer/plan.py decides retries and waits).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from batchfleet.common.config import bucket_for
from batchfleet.common.errors import (
    DEADLINE_EXCEEDED,
    FleetUnavailable,
    JobFailed,
    ProtocolError,
    QueueFull,
    Timeout,
)
from batchfleet.common.keys import Keys, valid_job_id
from batchfleet.common.protocol import MAX_STOP, MIN_TEMPERATURE, Error, FleetInfo, Request, Result, decode_reply

Prompt = str | Sequence[int]
FLEET_REFRESH_S = 30.0
RETRY_S = 30.0  # default: how long submit()/fleet() keep retrying through a Redis outage

# KEYS: stream. ARGV: max_len (0 = unbounded), id, payload. Returns 0 when the queue is full.
ENQUEUE_SCRIPT = """
local max_len = tonumber(ARGV[1])
if max_len > 0 and redis.call('XLEN', KEYS[1]) >= max_len then return 0 end
redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'p', ARGV[3])
return 1
"""


@dataclass
class Params:
    """Generation parameters accepted by generate/submit (validated here before anything is sent)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if type(self.max_new_tokens) is not int or self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be an integer >= 1")
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            if len(self.stop) > MAX_STOP or not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be at most {MAX_STOP} non-empty strings")


class FleetView:
    """The fleet's tokenizer and limits as published by workers, cached and refreshed now and then."""

    def __init__(self) -> None:
        self.info: FleetInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.fetched_at = 0.0

    def stale(self) -> bool:
        return self.info is None or time.monotonic() - self.fetched_at > FLEET_REFRESH_S

    def update(self, raw: bytes | None) -> None:
        if raw is None:
            return
        info = FleetInfo.decode(raw)
        if self.info is None or info.tokenizer_json != self.info.tokenizer_json:
            self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self.info = info
        self.fetched_at = time.monotonic()

    def tokenize(self, prompt: Prompt) -> list[int]:
        assert self.info is not None and self.tokenizer is not None
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt).ids
        ids = list(prompt)
        if not ids or not all(type(t) is int and 0 <= t < self.info.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be a non-empty list of ints in [0, {self.info.vocab_size})")
        return ids

    def require(self, keys: Keys) -> FleetView:
        """This view, once a worker has published the fleet; FleetUnavailable before that."""
        if self.info is None:
            raise FleetUnavailable(f"no worker has published a fleet under namespace {keys.namespace!r}; "
                                   "start a worker first")
        return self

    def build(self, keys: Keys, prompt: Prompt, params: Params, timeout: float | None,
              job_id: str | None) -> Outgoing:
        """Tokenize, route (raises PromptTooLong) and build the request; nothing is sent."""
        assert self.info is not None
        ids = self.tokenize(prompt)
        bucket = bucket_for(self.info.buckets, self.info.max_seq_len, len(ids), params.max_new_tokens)
        job_id = job_id or uuid.uuid4().hex
        if not valid_job_id(job_id):
            raise ValueError("job_id must be 1-128 chars of [A-Za-z0-9_.-]")
        now = time.time()
        req = Request(
            id=job_id, prompt=ids, max_new_tokens=params.max_new_tokens, temperature=float(params.temperature),
            top_p=float(params.top_p), top_k=params.top_k, seed=params.seed, stop=tuple(params.stop or ()),
            deadline=now + timeout if timeout is not None else None, enqueued_at=now,
            reply_key=keys.reply(job_id),
        )
        return Outgoing(bucket, keys.stream(bucket), req, self.info.max_queue_len)

    def build_many(self, keys: Keys, prompts: Sequence[Prompt], params: Params,
                   timeout: float | None) -> list[Outgoing]:
        """Build every prompt of a generate_many call first, so a bad one raises before anything is sent."""
        return [self.build(keys, prompt, params, timeout, None) for prompt in prompts]


@dataclass(frozen=True)
class Outgoing:
    """One request ready to enqueue: the stream it goes to, the ENQUEUE_SCRIPT arguments, and what the
    script's answer means."""

    bucket: int
    stream: str
    request: Request
    max_queue_len: int

    @property
    def id(self) -> str:
        return self.request.id

    def script_args(self) -> list:
        """ARGV of ENQUEUE_SCRIPT (KEYS is ``[self.stream]``)."""
        return [self.max_queue_len, self.request.id, self.request.encode()]

    def accepted(self, ok: int, *, in_batch: bool = False) -> str:
        """The job id when the script enqueued it; raises QueueFull when the bucket was full. ``in_batch``:
        sent in one pipeline with others (the message then says earlier ones went through)."""
        if ok:
            return self.id
        if in_batch:
            raise QueueFull(f"bucket {self.bucket} is full; earlier prompts of this call were enqueued")
        raise QueueFull(f"bucket {self.bucket} holds {self.max_queue_len} entries; retry later")


def connection_kwargs(conn) -> dict:
    """redis-py client options shared by Client and AsyncClient: every blocking call fits the socket timeout."""
    return {"socket_timeout": conn.socket_timeout_s, "socket_connect_timeout": conn.socket_timeout_s,
            "decode_responses": False}


def parse_reply(job_id: str, raw: bytes) -> Result:
    """Decode a reply; raise JobFailed (or Timeout for an expired deadline) for an Error."""
    try:
        reply = decode_reply(raw)
    except ProtocolError as exc:
        raise JobFailed(job_id, exc.code, f"undecodable reply: {exc}") from None
    if isinstance(reply, Error):
        if reply.code == DEADLINE_EXCEEDED:
            raise Timeout(f"job {job_id}: {reply.message}")
        raise JobFailed(job_id, reply.code, reply.message)
    return reply
