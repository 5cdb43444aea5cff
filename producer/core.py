"""What the clients send and receive, without I/O: tokenizing and routing, building the wire request from what
a call asks (producer/ask.py: its Params go into the Request as they are), what the enqueue function's answer
means, decoding replies, deadlines.

The clients own their connections (producer/aclient.py, producer/inbox.py); nothing here touches Redis.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from batchfleet.common.config import bucket_for
from batchfleet.common.errors import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    Cancelled,
    InvalidRequest,
    JobFailed,
    NoWorkers,
    ProtocolError,
    Timeout,
)
from batchfleet.common.keys import Keys, valid_job_id
from batchfleet.common.wire.params import ParamError, has_utf8
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.common.wire.protocol import (
    Delta,
    Error,
    FleetInfo,
    Request,
    Result,
    decode_reply,
)
from batchfleet.producer.ask import Ask
from batchfleet.producer.bounded_tokens import bounded_ids
from batchfleet.producer.chat import Chat, is_messages, render
from batchfleet.producer.outgoing import Outgoing

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]] | Chat  # text, token ids, chat messages (and tools)
FLEET_REFRESH_S = 30.0
# an enqueue that found a live worker vouches for the fleet this long: the next enqueues skip the check (a
# fleet that just lost its last worker is noticed within this long; a request taken meanwhile waits for one)
LIVENESS_TRUST_S = 1.0
RETRY_S = 30.0  # default: how long a call without a timeout keeps retrying through a Redis outage
# prompts up to this size are tokenized on the caller's thread (well under a millisecond); the async
# client tokenizes longer ones on a worker thread, with the GIL released
INLINE_PROMPT_CHARS = 16_384


class Deadline:
    """A caller's timeout as a monotonic end time (None: wait as long as it takes)."""

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None and not timeout >= 0:
            raise InvalidRequest(f"timeout must be >= 0 seconds or None, got {timeout!r}")
        self.timeout = timeout
        self.end = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        """Seconds left (never negative), None without a timeout."""
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def sooner(self, seconds: float) -> float:
        """``seconds``, cut to what is left."""
        left = self.left()
        return seconds if left is None else min(seconds, left)


def prompt_size(prompt: Prompt) -> int:
    """Characters (text, chat contents) or ids (token ids) of a prompt: what tokenizing it costs."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, Chat):  # the tools' schemas are rendered too
        return prompt_size(prompt.messages) + sum(len(str(t)) for t in prompt.tools or ())
    if is_messages(prompt):
        # rendering costs per message too (templates loop over them): 1,000 short messages go to a thread
        contents = (m.get("content") for m in prompt)  # type: ignore[union-attr]
        return sum(len(c) if isinstance(c, str) else 0 for c in contents) + 256 * len(prompt)
    return len(prompt)


class FleetView:
    """The fleet's tokenizer, chat template and limits as published by workers, cached and refreshed."""

    def __init__(self) -> None:
        self.info: FleetInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.fetched_at = 0.0

    def stale(self) -> bool:
        return self.info is None or time.monotonic() - self.fetched_at > FLEET_REFRESH_S

    def update(self, raw: bytes | None) -> None:
        """Take a fetched fleet description (None: the key is gone: no live worker published one)."""
        if raw is None:
            self.info, self.tokenizer = None, None
            return
        info = FleetInfo.decode(raw)
        if self.info is None or info.tokenizer_json != self.info.tokenizer_json:
            self.tokenizer = Tokenizer.from_str(info.tokenizer_json)
        self.info = info
        self.fetched_at = time.monotonic()

    @property
    def scales_to_zero(self) -> bool:
        """The fleet runs with zero workers at times (``--scale-to-zero``): enqueue without a live worker."""
        return bool(self.info is not None and self.info.scale_to_zero)

    def require(self, keys: Keys) -> FleetView:
        """This view, once a worker has published the fleet; NoWorkers before that (or after it expired)."""
        if self.info is None:
            raise NoWorkers(f"no live worker serves namespace {keys.namespace!r} (no fleet description "
                            "published); start a worker first")
        return self

    def tokenize(self, prompt: Prompt, *, add_special_tokens: bool | None = None, add_generation_prompt: bool = True,
                 most: int | None = None) -> list[int]:
        """A prompt's token ids: a text tokenized; chat messages rendered with the fleet's chat template
        (``add_generation_prompt``: ending with the assistant's header, as a generation needs), then tokenized;
        token ids checked against the vocabulary. ``add_special_tokens`` None: the fleet's rule (the tokenizer's
        special tokens, for a chat unless its template wrote the BOS itself). PromptTooLong once a prefix holds
        more than ``most`` tokens (default: the largest bucket). The one tokenization of the clients, the
        gateway's requests and its ``/tokenize`` (vLLM's)."""
        assert self.info is not None and self.tokenizer is not None
        most = self.info.buckets[-1] if most is None else most
        if isinstance(prompt, str):
            if not has_utf8(prompt):  # the tokenizer would raise TypeError
                raise InvalidRequest("the prompt is not valid Unicode (it holds a lone surrogate)")
            return bounded_ids(self._encoding, prompt, most, add_special_tokens=add_special_tokens is not False)
        if is_messages(prompt) or isinstance(prompt, Chat):
            info = self.info
            chat = prompt if isinstance(prompt, Chat) else Chat(prompt)  # type: ignore[arg-type]
            text = render(info.chat_template, chat.messages, info.bos_token, info.eos_token, chat.tools,
                          add_generation_prompt)
            if not has_utf8(text):
                raise InvalidRequest("a message is not valid Unicode (it holds a lone surrogate)")
            if add_special_tokens is None:  # a template that writes the BOS itself must not get a second one
                add_special_tokens = not (info.bos_token and text.startswith(info.bos_token))
            return bounded_ids(self._encoding, text, most, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        if not ids or not all(type(t) is int and 0 <= t < self.info.vocab_size for t in ids):
            raise InvalidRequest("a prompt is text, chat messages, or a non-empty list of token ids in "
                                 f"[0, {self.info.vocab_size})")
        return ids  # type: ignore[return-value]  # every item checked an int above

    def _encoding(self, text: str, add_special_tokens: bool) -> Any:
        """The tokenizer's Encoding of ``text`` (bounded_ids stops early). A long text goes through ``encode_batch``,
        which releases the GIL while it runs (``encode`` holds it: on a worker thread it would still stall the loop)."""
        assert self.tokenizer is not None
        if len(text) <= INLINE_PROMPT_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def build(self, keys: Keys, reply_key: str, prompt: Prompt, ask: Ask, timeout: float | None,
              job_id: str | None, stream: bool = False, tenant: str = "") -> Outgoing:
        """Tokenize, route (raises PromptTooLong) and build the request; nothing is sent. The priority picks
        the stream (and its queue limit): the one place it travels; so does the tenant (its own streams): the Ask's,
        else ``tenant``."""
        assert self.info is not None
        ids = self.tokenize(prompt)
        biased = ask.params.logit_bias
        if biased and biased[-1][0] >= self.info.vocab_size:  # pairs sorted by id: the last is the largest
            raise ParamError("logit_bias", f"logit_bias names token id {biased[-1][0]}, outside the fleet's "
                                           f"vocabulary [0, {self.info.vocab_size})")
        bucket = bucket_for(self.info.buckets, self.info.max_seq_len, len(ids), ask.params.max_new_tokens)
        job_id = job_id or uuid.uuid4().hex
        if not valid_job_id(job_id):
            raise InvalidRequest("job_id must be 1-128 chars of [A-Za-z0-9_.-]")
        if stream and ask.kind == "embed":
            raise InvalidRequest("an embed request cannot stream")
        tenant = ask.tenant or tenant  # the call's own (Ask.tenant), else the client's
        req = Request(id=job_id, prompt=ids, params=ask.params, reply_key=reply_key, stream=stream,
                      timeout_ms=None if timeout is None else int(timeout * 1000), kind=ask.kind, tenant=tenant)
        limit = self.info.batch_queue_len if ask.priority == BACKGROUND else self.info.max_queue_len
        return Outgoing(bucket, keys.stream(bucket, ask.priority, tenant), req, limit, ask.priority)


def parse_reply(job_id: str, raw: bytes) -> Result | Delta:
    """Decode an inbox entry's payload: a Result or a Delta; raise the error an Error stands for."""
    try:
        reply = decode_reply(raw)
    except (ProtocolError, KeyError, TypeError) as exc:
        raise JobFailed(job_id, getattr(exc, "code", "invalid_reply"), f"undecodable reply: {exc}") from None
    if isinstance(reply, Error):
        if reply.code == DEADLINE_EXCEEDED:
            raise Timeout(f"job {job_id}: {reply.message}")
        if reply.code == CANCELLED:
            raise Cancelled(job_id, reply.code, reply.message)
        raise JobFailed(job_id, reply.code, reply.message)
    return reply
