"""The JSON objects of the Responses API, in OpenAI's shapes (openai.types.responses): the response object
(its output: a message of one ``output_text`` part, and the ``function_call`` items of an answer that calls
tools) and its stream events, numbered by ``sequence_number``.

A streamed response sends, as OpenAI does: ``response.created``, ``response.in_progress``; for its text
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` (one per
text delta), ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
for each function call ``response.output_item.added`` (arguments ""), ``response.function_call_arguments.delta``,
``response.function_call_arguments.done``, ``response.output_item.done``; then ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut the answer). A job that fails once the stream
started sends an ``error`` event, then ``response.failed``. An answer that calls tools has a message only
for the text before its calls (none when there is none); any other has one message.

Pure: no I/O. Extension, as on the other routes: a finished response has a ``batchfleet`` field, the
fleet's own view of the job (gateway/openai/chat/format.py ``fleet_view``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.openai.chat.format import fleet_view, usage
from batchfleet.gateway.openai.tools.calling import ToolPlan, ToolStream
from batchfleet.gateway.openai.tools.parsers import Family


def response_usage(result: Result) -> dict[str, Any]:
    """Chat's usage (gateway/openai/chat/format.py) under this API's names. ``cache_write_tokens`` (required by
    openai.types.responses.ResponseUsage): 0, the fleet's prefix cache costs nothing extra to write."""
    u = usage([result])
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {**u["prompt_tokens_details"], "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


@dataclass
class ResponseShape:
    """How one response looks: its ids, model, creation time and the request fields it repeats (``echo``:
    gateway/openai/responses/request.py ``ResponsesCall.echo``); the request's tools and the family whose format
    answers are read in (gateway/openai/tools/calling.py); ``sequence``: the next event's number; ``sent``: the text a
    stream sent so far."""

    job_id: str
    model: str
    echo: dict[str, Any]
    tools: ToolPlan | None = None
    family: Family | None = None
    created: float = field(default_factory=time.time)
    sequence: int = 0
    sent: str | None = None  # None: no message item opened yet

    @property
    def id(self) -> str:
        return "resp_" + self.job_id

    @property
    def message_id(self) -> str:
        return "msg_" + self.job_id

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        """The output message item (``text`` None: no content part yet)."""
        content = [] if text is None else [self.part(text)]
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def function_call(self, index: int, call: dict[str, Any]) -> dict[str, Any]:
        """A ``function_call`` output item of chat's tool call ``call`` (its id is the item's ``call_id``)."""
        fn = call["function"]
        return {"id": f"fc_{self.job_id}_{index}", "type": "function_call", "status": "completed",
                "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"]}

    def tool_stream(self) -> ToolStream | None:
        """A stream's tool-call reader, when answers are read for tool calls."""
        if self.tools is None or not self.tools.parsed or self.family is None:
            return None
        return ToolStream(self.tools, self.family)

    def output(self, text: str | None, calls: list[dict[str, Any]], status: str) -> list[dict[str, Any]]:
        """The output items: the message (unless the answer is calls alone, as a constrained one always is:
        cut short before its first whole call, it has no item), then the calls."""
        alone = calls or (self.tools is not None and self.tools.constrained)
        items = [] if alone and not text else [self.message(text or "", status)]
        return items + [self.function_call(i, call) for i, call in enumerate(calls)]

    def response(self, result: Result | None = None, error: dict[str, Any] | None = None,
                 calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The response object: in progress (no ``result``), failed (``error``: {code, message}), else
        completed, or incomplete when the answer reached ``max_output_tokens``. ``calls``: a stream's tool
        calls (its text: what it sent); else the answer is read for calls here."""
        body: dict[str, Any] = {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                                "status": "in_progress", "error": None, "incomplete_details": None, "output": [],
                                "usage": None, **self.echo}
        if error is not None:
            return {**body, "status": "failed", "error": error}
        if result is None:
            return body
        cut = result.finish_reason == "length"
        if calls is not None:
            text: str | None = self.sent
        elif self.tools is not None and self.family is not None:
            text, calls = self.tools.calls(self.family, result.text, cut)
        else:
            text, calls = result.text, []
        status = "incomplete" if cut else "completed"
        return {**body, "status": status, "completed_at": time.time(),
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "output": self.output(text, calls, status), "usage": response_usage(result),
                "batchfleet": fleet_view(result)}

    def event(self, kind: str, **fields: Any) -> bytes:
        """One server-sent event: ``event: <kind>`` and its JSON, numbered."""
        obj = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def opening(self) -> list[bytes]:
        """The events before the answer's first."""
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def _open_message(self) -> list[bytes]:
        self.sent = ""
        return [self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
                self.event("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                           part=self.part(""))]

    def delta(self, text: str) -> list[bytes]:
        """The events of ``text``, the answer's next text (the message item opened at its first)."""
        if not text:
            return []
        out = self._open_message() if self.sent is None else []
        self.sent = (self.sent or "") + text
        return out + [self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                 content_index=0, delta=text, logprobs=[])]

    def closing(self, done: dict[str, Any]) -> list[bytes]:
        """The events after the last text delta: the items' ends (a function call whole), then the one that
        carries ``done``, the finished response."""
        out: list[bytes] = []
        for index, item in enumerate(done["output"]):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                where = {"item_id": self.message_id, "output_index": index, "content_index": 0}
                out += self._open_message() if self.sent is None else []
                out += [self.event("response.output_text.done", **where, text=text, logprobs=[]),
                        self.event("response.content_part.done", **where, part=self.part(text)),
                        self.event("response.output_item.done", output_index=index, item=item)]
                continue
            where = {"item_id": item["id"], "output_index": index}
            out += [self.event("response.output_item.added", output_index=index,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        return out + [self.event(kind, response=done)]

    def failure(self, error: dict[str, Any]) -> list[bytes]:
        """A job that failed mid-stream: the ``error`` event (OpenAI's clients raise it), then
        ``response.failed``. ``error``: an OpenAI error body's ``error`` object."""
        return [self.event("error", code=error.get("code"), message=error.get("message"), param=error.get("param")),
                self.event("response.failed", response=self.response(
                    error={"code": error.get("code") or "server_error", "message": error.get("message")}))]
