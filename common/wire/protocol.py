"""Wire types: Request (producer -> worker), Result, Error and Delta (worker -> producer), FleetInfo.

docs/PROTOCOL.md describes the same schemas for other languages; a change here is a change there.

Each is a small dataclass with explicit msgpack encode/decode, a schema version and bounded decoding:
a payload is size-checked before unpacking and every container length is capped, so a hostile entry
cannot make a worker allocate without bound. No pickle anywhere.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from batchfleet.common.errors import ProtocolError
from batchfleet.common.keys import TENANT_MAX_CHARS, valid_job_id, valid_tenant
from batchfleet.common.wire.codec import (  # noqa: F401 - SCHEMA_VERSION and the bounds are the protocol's names too
    MAX_BIN_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_TEXT_CHARS,
    MAX_TOKENS,
    SCHEMA_VERSION,
    int_field,
    pack,
    str_field,
    tokens_field,
    unpack,
)
from batchfleet.common.wire.params import DEFAULT, Params

FINISH_REASONS = ("stop", "length", "eos")
REQUEST_KINDS = ("generate", "embed")
MAX_EMBEDDING_DIMS = MAX_BIN_BYTES // 4
MAX_TIMEOUT_MS = 10 * 365 * 86400 * 1000


# logprobs on the wire: one entry per generated token, aligned with ``token_ids``:
# [logprob of the token, [top token ids], [their logprobs]] (top lists: ``Params.logprobs`` long, best first)
LogprobEntry = tuple[float, tuple[int, ...], tuple[float, ...]]


def _logprobs_wire(entries: list[LogprobEntry] | None) -> list | None:
    return None if entries is None else [[lp, list(ids), list(lps)] for lp, ids, lps in entries]


def _logprobs_of(obj: dict) -> list[LogprobEntry] | None:
    raw = obj.get("logprobs")
    if raw is None:
        return None
    return [(float(lp), tuple(ids), tuple(float(x) for x in lps)) for lp, ids, lps in raw]


@dataclass(frozen=True)
class Request:
    """One generation job. ``prompt`` is token ids: producers tokenize with the fleet's tokenizer.

    ``params`` (common/wire/params.py) travel as flat entries of the map, as they always did. ``timeout_ms``
    counts from the enqueue as Redis stamped it (the stream entry id), so a producer's clock never matters.
    ``reply_key`` is the submitting client's inbox stream (``<ns>:inbox:<token>``); ``stream`` asks for
    Delta entries there while the job runs. The job's priority is the stream it is enqueued in, and
    nothing else: a ``priority`` entry (older producers sent one) is ignored. ``kind``: "generate" (the
    default; absent on the wire means it) or "embed": a prefill-only job whose Result carries the prompt's
    pooled, normalised hidden state (``Result.embedding``) and no tokens; the worker keeps no KV for it.
    ``tenant``: who sent the job, a configured label (common/keys.py ``valid_tenant``; never an API key);
    "" (absent on the wire) is the default tenant. Workers share each class between tenants by it.
    """

    id: str
    prompt: list[int]
    params: Params = DEFAULT
    timeout_ms: int | None = None  # after enqueue + timeout_ms the answer is useless (deadline_exceeded)
    reply_key: str = ""
    stream: bool = False
    kind: str = "generate"
    tenant: str = ""

    def encode(self) -> bytes:
        obj = {"id": self.id, "prompt": list(self.prompt), **self.params.to_wire(),
               "timeout_ms": self.timeout_ms, "reply_key": self.reply_key, "stream": self.stream}
        if self.kind != "generate":
            obj["kind"] = self.kind
        if self.tenant:
            obj["tenant"] = self.tenant
        return pack(obj)

    @property
    def embed(self) -> bool:
        return self.kind == "embed"

    @classmethod
    def decode(cls, data: bytes) -> Request:
        """Decode and validate; raises ProtocolError with a message fit for the client."""
        obj = unpack(data)
        job_id = obj.get("id")
        if not valid_job_id(job_id):
            raise ProtocolError("id must be 1-128 chars of [A-Za-z0-9_.-]")
        timeout_ms = obj.get("timeout_ms")
        if timeout_ms is not None:
            timeout_ms = int_field(obj, "timeout_ms", 0, MAX_TIMEOUT_MS)
        stream = obj.get("stream", False)
        if type(stream) is not bool:
            raise ProtocolError(f"stream must be a boolean, got {stream!r}"[:200])
        kind = obj.get("kind", "generate")
        if kind not in REQUEST_KINDS:
            raise ProtocolError(f"kind must be one of {', '.join(REQUEST_KINDS)}, got {kind!r}"[:200])
        if kind == "embed" and stream:
            raise ProtocolError("an embed request cannot stream")
        tenant = obj.get("tenant", "")
        if tenant != "" and not valid_tenant(tenant):
            raise ProtocolError(f"tenant must be 1-{TENANT_MAX_CHARS} chars of [a-z0-9_-], got {tenant!r}"[:200])
        return cls(id=str(job_id), prompt=tokens_field(obj, "prompt", 1), params=Params.from_wire(obj),
                   timeout_ms=timeout_ms, reply_key=str_field(obj, "reply_key"), stream=stream, kind=kind,
                   tenant=tenant)


@dataclass(frozen=True)
class Result:
    """A finished generation, with the timings a user can see (all relative to ``enqueued_at``)."""

    id: str
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "eos"
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float  # enqueue -> the batch holding it started
    ttft_ms: float  # enqueue -> first token computed
    total_ms: float  # enqueue -> reply written
    worker: str
    batch_size: int
    extra: dict[str, Any] = field(default_factory=dict)
    # when the request asked: per token of ``token_ids``, (its logprob, top ids, their logprobs); the
    # log-softmax of the model's logits at that step (before temperature, top-k/p and structured masks)
    logprobs: list[LogprobEntry] | None = None
    # an embed request's answer: the pooled, L2-normalised hidden state (on the wire: float32 little-endian
    # bytes, so a vector costs 4 bytes a dimension and decodes exactly)
    embedding: list[float] | None = None

    def encode(self) -> bytes:
        obj = {
            "kind": "result", "id": self.id, "token_ids": list(self.token_ids), "text": self.text,
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "queue_ms": self.queue_ms, "ttft_ms": self.ttft_ms,
            "total_ms": self.total_ms, "worker": self.worker, "batch_size": self.batch_size,
            "extra": self.extra,
        }
        if self.embedding is not None:
            obj["embedding"] = struct.pack(f"<{len(self.embedding)}f", *self.embedding)
        if self.logprobs is None:
            return pack(obj)
        return pack({**obj, "logprobs": _logprobs_wire(self.logprobs)})


def _embedding_of(obj: dict) -> list[float] | None:
    raw = obj.get("embedding")
    if raw is None:
        return None
    if not isinstance(raw, bytes) or len(raw) % 4 or len(raw) > 4 * MAX_EMBEDDING_DIMS:
        raise ProtocolError("embedding must be float32 bytes")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


@dataclass(frozen=True)
class Error:
    """A request that could not be served; ``code`` is one of common.errors.ERROR_CODES."""

    id: str
    code: str
    message: str

    def encode(self) -> bytes:
        return pack({"kind": "error", "id": self.id, "code": self.code, "message": self.message[:2000]})


@dataclass(frozen=True)
class Delta:
    """Text generated since the previous Delta of a streamed job (``seq`` counts from 0).

    Deltas never split a UTF-8 character and concatenate to a prefix of the final ``Result.text``; the
    client yields the rest of that text when the Result arrives. ``token_ids`` are the tokens sampled
    since the previous Delta (their text may be held back while it is an incomplete character or could
    still start a stop string).
    """

    id: str
    seq: int
    offset: int  # where ``text`` starts in the final text: a re-run's repeated deltas are recognised by it
    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry] | None = None  # when the request asked: one per token of ``token_ids``

    def encode(self) -> bytes:
        obj = {"kind": "delta", "id": self.id, "seq": self.seq, "offset": self.offset, "text": self.text,
               "token_ids": list(self.token_ids)}
        if self.logprobs is None:
            return pack(obj)
        return pack({**obj, "logprobs": _logprobs_wire(self.logprobs)})


def decode_reply(data: bytes) -> Result | Error | Delta:
    """Decode what a worker wrote to an inbox (the ``p`` field of an inbox entry)."""
    obj = unpack(data)
    kind = obj.get("kind")
    if kind == "error":
        return Error(id=obj["id"], code=obj["code"], message=obj["message"])
    if kind == "delta":
        return Delta(id=obj["id"], seq=obj["seq"], offset=obj["offset"], text=obj["text"],
                     token_ids=list(obj["token_ids"]), logprobs=_logprobs_of(obj))
    if kind != "result":
        raise ProtocolError(f"unknown reply kind {kind!r}")
    return Result(
        id=obj["id"], token_ids=list(obj["token_ids"]), text=obj["text"], finish_reason=obj["finish_reason"],
        prompt_tokens=obj["prompt_tokens"], completion_tokens=obj["completion_tokens"],
        queue_ms=obj["queue_ms"], ttft_ms=obj["ttft_ms"], total_ms=obj["total_ms"], worker=obj["worker"],
        batch_size=obj["batch_size"], extra=obj.get("extra") or {}, logprobs=_logprobs_of(obj),
        embedding=_embedding_of(obj),
    )


def _shards(value: object) -> int:
    """A fleet description's shard count; a missing or broken one reads as 1 (a fleet from before shards)."""
    return value if isinstance(value, int) and 1 <= value <= 64 else 1


@dataclass(frozen=True)
class FleetInfo:
    """What workers publish so producers can tokenize and route without model files or torch."""

    model: str
    tokenizer_json: str  # the `tokenizers` serialization of the served tokenizer
    buckets: tuple[int, ...]
    max_seq_len: int
    max_batch_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_queue_len: int = 0  # per-bucket interactive stream length at which producers get QueueFull; 0 = unbounded
    # the same for the background streams; the wire keeps the name from before background was called so, as the
    # streams keep their key suffix (common/keys.py): producers and workers of both releases share fleets
    batch_queue_len: int = 0
    chat_template: str = ""  # Jinja2 chat template (HF semantics); producers render messages with it
    bos_token: str = ""  # the template's ``bos_token`` / ``eos_token`` variables
    eos_token: str = ""
    fingerprint: str = ""  # hash of model, tokenizer and buckets: workers that differ refuse to join
    # the fleet may run with zero workers: the description is kept and producers enqueue without live workers
    scale_to_zero: bool = False
    pooling: str = "last"  # how workers pool embed requests' hidden states (--pooling): all must agree
    shards: int = 1  # a Redis Cluster fleet's shard count (--shards, common/keys.py): producers follow it

    def encode(self) -> bytes:
        return pack({
            "model": self.model, "tokenizer_json": self.tokenizer_json, "buckets": list(self.buckets),
            "max_seq_len": self.max_seq_len, "max_batch_size": self.max_batch_size,
            "vocab_size": self.vocab_size, "eos_token_ids": list(self.eos_token_ids),
            "max_queue_len": self.max_queue_len, "batch_queue_len": self.batch_queue_len,
            "chat_template": self.chat_template,
            "bos_token": self.bos_token, "eos_token": self.eos_token, "fingerprint": self.fingerprint,
            "scale_to_zero": self.scale_to_zero, "pooling": self.pooling, "shards": self.shards,
        })

    @classmethod
    def decode(cls, data: bytes) -> FleetInfo:
        obj = unpack(data)
        return cls(
            model=obj["model"], tokenizer_json=obj["tokenizer_json"], buckets=tuple(obj["buckets"]),
            max_seq_len=obj["max_seq_len"], max_batch_size=obj["max_batch_size"],
            vocab_size=obj["vocab_size"], eos_token_ids=tuple(obj["eos_token_ids"]),
            max_queue_len=obj.get("max_queue_len", 0), batch_queue_len=obj.get("batch_queue_len", 0),
            chat_template=obj.get("chat_template") or "",
            bos_token=obj.get("bos_token") or "", eos_token=obj.get("eos_token") or "",
            fingerprint=obj.get("fingerprint") or "", scale_to_zero=obj.get("scale_to_zero") is True,
            pooling=obj.get("pooling") or "last", shards=_shards(obj.get("shards")),
        )
