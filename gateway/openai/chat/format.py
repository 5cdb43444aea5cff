"""The JSON objects the gateway answers with, in OpenAI's shapes: completions and chat completions,
whole or as stream chunks, with ``n`` choices and logprobs when asked.

Extension: every finished answer (the response object, or the stream chunk carrying ``finish_reason``)
has a ``batchfleet`` field: ``{"job_id", "worker", "batch_size", "queue_ms", "ttft_ms", "total_ms",
"preemptions"}``, the fleet's own view of the job (``batch_size``: the sequences in the batch that ran it;
``preemptions``: how often the engine preempted it, each time recomputed); with ``n`` > 1 the response's
is the first choice's, plus ``"choices"``: one such view per choice. OpenAI clients keep unknown fields
(``response.model_extra["batchfleet"]`` in the Python client). ``usage`` carries OpenAI's
``prompt_tokens_details.cached_tokens``: the prompt tokens the fleet's prefix cache supplied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.openai.tools.calling import ToolPlan, ToolStream
from batchfleet.gateway.openai.tools.parsers import Family

# the fleet's finish reasons -> OpenAI's: an end-of-sequence token and a stop string both "stop"
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(results: Sequence[Result]) -> dict[str, Any]:
    """As OpenAI counts n choices: the prompt once (and its tokens the prefix cache supplied, OpenAI's
    ``prompt_tokens_details.cached_tokens``: the first choice's, as its prompt is the one counted), every
    choice's completion tokens."""
    prompt = results[0].prompt_tokens
    completion = sum(r.completion_tokens for r in results)
    cached = results[0].extra.get("cached_tokens")
    cached = min(cached, prompt) if type(cached) is int and cached > 0 else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def fleet_view(result: Result) -> dict[str, Any]:
    """The ``batchfleet`` extension field."""
    preemptions = result.extra.get("preemptions")
    return {"job_id": result.id, "worker": result.worker, "batch_size": result.batch_size,
            "queue_ms": round(result.queue_ms, 3), "ttft_ms": round(result.ttft_ms, 3),
            "total_ms": round(result.total_ms, 3),
            "preemptions": preemptions if type(preemptions) is int and preemptions > 0 else 0}


@dataclass(frozen=True)
class Shape:
    """How the answers to one request look: its endpoint (chat or not), id, model and creation time;
    ``token_text`` (token id -> its text) when logprobs were asked for; ``guide_param``: the request field
    its structured-output guide came from (a stream's ``guide_failed`` error names it); ``echo``: the prompt's
    text, when a completion asked for it (whole: each choice's text starts with it; streamed: each choice's
    first chunk is it)."""

    chat: bool
    job_id: str
    model: str
    created: int
    fingerprint: str | None = None
    include_usage: bool = False
    token_text: Callable[[int], str] | None = None
    guide_param: str | None = None
    # a chat request's tools: answers are read for tool calls (gateway/openai/tools/calling.py)
    tools: ToolPlan | None = None
    family: Family | None = None  # the model family whose tool-call format they are read in
    echo: str | None = None  # completions' echo: the prompt's text, which every choice's text starts with

    def tool_stream(self) -> ToolStream | None:
        """A streamed choice's tool-call reader, when answers are read for tool calls."""
        if self.tools is None or not self.tools.parsed or self.family is None:
            return None
        return ToolStream(self.tools, self.family)

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.job_id

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def logprobs(self, token_ids: Sequence[int], entries: Sequence | None, offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens (None when not asked). ``offset``: where the first
        token's text starts in the choice's text (completions' ``text_offset``)."""
        if entries is None or self.token_text is None:
            return None
        text = self.token_text
        if self.chat:
            def item(tid: int, lp: float) -> dict[str, Any]:
                s = text(tid)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}

            return {"content": [{**item(t, lp), "top_logprobs": [item(i, x) for i, x in zip(ids, lps)]}
                                for t, (lp, ids, lps) in zip(token_ids, entries)], "refusal": None}
        tokens, offsets, tops = [], [], []
        for t, (lp, ids, lps) in zip(token_ids, entries):
            tokens.append(text(t))
            offsets.append(offset)
            offset += len(tokens[-1])
            top = {text(i): x for i, x in zip(ids, lps)}
            top.setdefault(tokens[-1], lp)  # as OpenAI's legacy API: the sampled token is always listed
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e[0] for e in entries], "top_logprobs": tops,
                "text_offset": offsets}

    def response(self, results: Sequence[Result]) -> dict[str, Any]:
        """The whole (non-streamed) answer: one choice per result."""
        choices = []
        for index, result in enumerate(results):
            finish = FINISH_REASONS.get(result.finish_reason, result.finish_reason)
            logprobs = self.logprobs(result.token_ids, result.logprobs)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": result.text}
                if self.tools is not None and self.family is not None:
                    message["content"], calls = self.tools.calls(self.family, result.text, finish == "length")
                    if calls:
                        message["tool_calls"] = calls
                    finish = self.tools.finish(finish, bool(calls))
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": index, "text": (self.echo or "") + result.text, "logprobs": logprobs,
                                "finish_reason": finish})
        view = fleet_view(results[0])
        if len(results) > 1:
            view["choices"] = [fleet_view(r) for r in results]
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage(results), "batchfleet": view}

    def chunk(self, text: str, *, index: int = 0, first: bool = False, result: Result | None = None,
              logprobs: dict | None = None, finish: str | None = None,
              tool_calls: list[dict] | None = None) -> dict[str, Any]:
        """One stream chunk of choice ``index``: ``text`` generated since its previous one; ``first``
        (chat) announces the assistant's role; ``result`` (its last chunk) carries the finish reason
        (``finish``: OpenAI's, when tool calls decide it); ``logprobs``: those of the tokens this chunk
        stands for (``self.logprobs(...)``); ``tool_calls``: OpenAI's tool-call deltas."""
        if finish is None and result is not None:
            finish = FINISH_REASONS.get(result.finish_reason, result.finish_reason)
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else (
                {"tool_calls": tool_calls} if tool_calls else {"content": text} if text or result is None else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: only the final usage chunk fills it
        if result is not None:
            out["batchfleet"] = fleet_view(result)
        return out

    def usage_chunk(self, results: Sequence[Result]) -> dict[str, Any]:
        """The chunk ``stream_options.include_usage`` asks for: after the last choice, with no choices."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(results)}
