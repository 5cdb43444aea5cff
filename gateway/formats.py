"""The JSON objects the gateway answers with, in OpenAI's shapes: completions and chat completions,
whole or as stream chunks.

Extension: every finished answer (the response object, or the stream chunk carrying ``finish_reason``)
has a ``batchfleet`` field: ``{"job_id", "worker", "batch_size", "queue_ms", "ttft_ms", "total_ms"}``,
the fleet's own view of the job (``batch_size``: the sequences in the batch that ran it). OpenAI
clients keep unknown fields (``response.model_extra["batchfleet"]`` in the Python client).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfleet.common.protocol import Result

# the fleet's finish reasons -> OpenAI's: an end-of-sequence token and a stop string both "stop"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(result: Result) -> dict[str, int]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def fleet_view(result: Result) -> dict[str, Any]:
    """The ``batchfleet`` extension field."""
    return {"job_id": result.id, "worker": result.worker, "batch_size": result.batch_size,
            "queue_ms": round(result.queue_ms, 3), "ttft_ms": round(result.ttft_ms, 3),
            "total_ms": round(result.total_ms, 3)}


@dataclass(frozen=True)
class Shape:
    """How the answers to one request look: its endpoint (chat or not), id, model and creation time."""

    chat: bool
    job_id: str
    model: str
    created: int
    fingerprint: str | None = None
    include_usage: bool = False

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.job_id

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def response(self, result: Result) -> dict[str, Any]:
        """The whole (non-streamed) answer."""
        finish = FINISH_REASONS.get(result.finish_reason, result.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(result), "batchfleet": fleet_view(result)}

    def chunk(self, text: str, *, first: bool = False, result: Result | None = None) -> dict[str, Any]:
        """One stream chunk: ``text`` generated since the previous one; ``first`` (chat) announces the
        assistant's role; ``result`` (the last chunk with choices) carries the finish reason."""
        finish = None if result is None else FINISH_REASONS.get(result.finish_reason, result.finish_reason)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else (
                {"content": text} if text or result is None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: only the final usage chunk fills it
        if result is not None:
            out["batchfleet"] = fleet_view(result)
        return out

    def usage_chunk(self, result: Result) -> dict[str, Any]:
        """The chunk ``stream_options.include_usage`` asks for: after the last choice, with no choices."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(result)}
