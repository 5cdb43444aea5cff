"""Wire types: Request (producer -> worker), Result, Error and Delta (worker -> producer), FleetInfo.

docs/PROTOCOL.md describes the same schemas for other languages; a change here is a change there.

Each is a small dataclass with explicit msgpack encode/decode, a schema version and bounded decoding:
a payload is size-checked before unpacking and every container length is capped, so a hostile entry
cannot make a worker allocate without bound. No pickle anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchfleet.common.errors import ProtocolError
from batchfleet.common.guided import Guide, GuideError
from batchfleet.common.keys import INTERACTIVE, LANES, valid_job_id
from batchfleet.common.wire import (  # noqa: F401 - SCHEMA_VERSION and the bounds are the protocol's names too
    MAX_PAYLOAD_BYTES,
    MAX_TEXT_CHARS,
    MAX_TOKENS,
    SCHEMA_VERSION,
    float_field,
    int_field,
    pack,
    str_field,
    tokens_field,
    unpack,
)

MAX_REPETITION_PENALTY = 10.0
MAX_TOP_K = 1 << 20
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
MAX_STOP = 16
MAX_STOP_CHARS = 256
FINISH_REASONS = ("stop", "length", "eos")
MAX_TIMEOUT_MS = 10 * 365 * 86400 * 1000


# logprobs on the wire: one entry per generated token, aligned with ``token_ids``:
# [logprob of the token, [top token ids], [their logprobs]] (top lists: ``Request.logprobs`` long, best first)
LogprobEntry = tuple[float, tuple[int, ...], tuple[float, ...]]


def _logprobs_wire(entries: list[LogprobEntry] | None) -> list | None:
    return None if entries is None else [[lp, list(ids), list(lps)] for lp, ids, lps in entries]


def _logprobs_of(obj: dict) -> list[LogprobEntry] | None:
    raw = obj.get("logprobs")
    if raw is None:
        return None
    return [(float(lp), tuple(ids), tuple(float(x) for x in lps)) for lp, ids, lps in raw]


MIN_TEMPERATURE = 1e-3  # below it logits / t overflow; 0 means greedy


def _temperature(obj: dict) -> float:
    t = float_field(obj, "temperature", 0.0, 100.0, 0.0)
    if 0.0 < t < MIN_TEMPERATURE:
        raise ProtocolError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100], got {t!r}")
    return t


@dataclass(frozen=True)
class Request:
    """One generation job. ``prompt`` is token ids: producers tokenize with the fleet's tokenizer.

    ``timeout_ms`` counts from the enqueue as Redis stamped it (the stream entry id), so a producer's
    clock never matters. ``reply_key`` is the submitting client's inbox stream (``<ns>:inbox:<token>``);
    ``stream`` asks for Delta entries there while the job runs. ``priority`` is the job's class (one of
    ``LANES``) and must name the class of the stream it is enqueued in (a worker answers a mismatch
    ``invalid_request``).
    """

    id: str
    prompt: list[int]
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    timeout_ms: int | None = None  # after enqueue + timeout_ms the answer is useless (deadline_exceeded)
    reply_key: str = ""
    stream: bool = False
    priority: str = INTERACTIVE
    # sampling extensions (vLLM's names and meanings)
    ignore_eos: bool = False  # an end-of-sequence token does not end the request
    min_tokens: int = 0  # EOS and stop strings cannot end it before this many tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or the output
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    guide: Guide | None = None  # structured output the tokens must match (None: free)
    logprobs: int | None = None  # None = off; k = each token's logprob and its k best alternatives

    def encode(self) -> bytes:
        return pack({
            "id": self.id, "prompt": list(self.prompt), "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
            "stop": list(self.stop), "timeout_ms": self.timeout_ms, "reply_key": self.reply_key,
            "stream": self.stream, "priority": self.priority, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "repetition_penalty": self.repetition_penalty, "min_p": self.min_p,
            "guide": None if self.guide is None else self.guide.to_wire(), "logprobs": self.logprobs,
        })

    @classmethod
    def decode(cls, data: bytes) -> Request:
        """Decode and validate; raises ProtocolError with a message fit for the client."""
        obj = unpack(data)
        job_id = obj.get("id")
        if not valid_job_id(job_id):
            raise ProtocolError("id must be 1-128 chars of [A-Za-z0-9_.-]")
        stop = obj.get("stop", [])
        if not isinstance(stop, list) or len(stop) > MAX_STOP:
            raise ProtocolError(f"stop must be a list of at most {MAX_STOP} strings")
        for s in stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise ProtocolError(f"each stop string must be 1-{MAX_STOP_CHARS} chars of valid UTF-8")
        seed = obj.get("seed")
        if seed is not None:
            seed = int_field(obj, "seed", 0, 2**63 - 1)
        timeout_ms = obj.get("timeout_ms")
        if timeout_ms is not None:
            timeout_ms = int_field(obj, "timeout_ms", 0, MAX_TIMEOUT_MS)
        stream = obj.get("stream", False)
        if type(stream) is not bool:
            raise ProtocolError(f"stream must be a boolean, got {stream!r}"[:200])
        priority = obj.get("priority", INTERACTIVE)
        if priority not in LANES:
            raise ProtocolError(f"priority must be one of {', '.join(LANES)}, got {priority!r}"[:200])
        ext: dict[str, Any] = {"ignore_eos": obj.get("ignore_eos", False)}
        if type(ext["ignore_eos"]) is not bool:
            raise ProtocolError(f"ignore_eos must be a boolean, got {ext['ignore_eos']!r}"[:200])
        ext["min_tokens"] = int_field(obj, "min_tokens", 0, MAX_TOKENS, 0)
        penalty = float_field(obj, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, 1.0)
        if penalty <= 0.0:
            raise ProtocolError("repetition_penalty must be > 0")
        ext["repetition_penalty"] = penalty
        ext["min_p"] = float_field(obj, "min_p", 0.0, 1.0, 0.0)
        max_new_tokens = int_field(obj, "max_new_tokens", 1, MAX_TOKENS)
        if ext["min_tokens"] > max_new_tokens:
            raise ProtocolError(f"min_tokens ({ext['min_tokens']}) must be <= max_new_tokens ({max_new_tokens})")
        guide = obj.get("guide")
        if guide is not None:
            try:
                guide = Guide.from_wire(guide)
            except GuideError as exc:
                raise ProtocolError(str(exc)) from None
        logprobs = obj.get("logprobs")
        if logprobs is not None:
            logprobs = int_field(obj, "logprobs", 0, MAX_LOGPROBS)
        return cls(
            id=job_id,
            prompt=tokens_field(obj, "prompt", 1),
            max_new_tokens=max_new_tokens,
            temperature=_temperature(obj),
            top_p=float_field(obj, "top_p", 1e-6, 1.0, 1.0),
            top_k=int_field(obj, "top_k", 0, MAX_TOP_K, 0),
            seed=seed,
            stop=tuple(stop),
            timeout_ms=timeout_ms,
            reply_key=str_field(obj, "reply_key"),
            stream=stream,
            priority=priority,
            **ext,
            guide=guide,
            logprobs=logprobs,
        )


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

    def encode(self) -> bytes:
        obj = {
            "kind": "result", "id": self.id, "token_ids": list(self.token_ids), "text": self.text,
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "queue_ms": self.queue_ms, "ttft_ms": self.ttft_ms,
            "total_ms": self.total_ms, "worker": self.worker, "batch_size": self.batch_size,
            "extra": self.extra,
        }
        if self.logprobs is None:
            return pack(obj)
        return pack({**obj, "logprobs": _logprobs_wire(self.logprobs)})


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
    )


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
    batch_queue_len: int = 0  # the same for the batch class's streams
    chat_template: str = ""  # Jinja2 chat template (HF semantics); producers render messages with it
    bos_token: str = ""  # the template's ``bos_token`` / ``eos_token`` variables
    eos_token: str = ""
    fingerprint: str = ""  # hash of model, tokenizer and buckets: workers that differ refuse to join
    # the fleet may run with zero workers: the description is kept and producers enqueue without live workers
    scale_to_zero: bool = False

    def encode(self) -> bytes:
        return pack({
            "model": self.model, "tokenizer_json": self.tokenizer_json, "buckets": list(self.buckets),
            "max_seq_len": self.max_seq_len, "max_batch_size": self.max_batch_size,
            "vocab_size": self.vocab_size, "eos_token_ids": list(self.eos_token_ids),
            "max_queue_len": self.max_queue_len, "batch_queue_len": self.batch_queue_len,
            "chat_template": self.chat_template,
            "bos_token": self.bos_token, "eos_token": self.eos_token, "fingerprint": self.fingerprint,
            "scale_to_zero": self.scale_to_zero,
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
        )
