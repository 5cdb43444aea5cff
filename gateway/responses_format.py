"""The JSON objects of the Responses API, in OpenAI's shapes (openai.types.responses): the response object
(one output message of one ``output_text`` part) and its stream events, numbered by ``sequence_number``.

A streamed response sends, as OpenAI does: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` (one per
text delta), ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the answer). A job that fails
once the stream started sends an ``error`` event, then ``response.failed``.

Pure: no I/O. Extension, as on the other routes: a finished response has a ``batchfleet`` field, the
fleet's own view of the job (gateway/formats.py ``fleet_view``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from batchfleet.common.protocol import Result
from batchfleet.gateway.formats import fleet_view, usage


def response_usage(result: Result) -> dict[str, Any]:
    """Chat's usage (gateway/formats.py) under this API's names."""
    u = usage([result])
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


@dataclass
class ResponseShape:
    """How one response looks: its ids, model, creation time and the request fields it repeats (``echo``:
    gateway/responses_request.py ``ResponsesCall.echo``); ``sequence``: the next event's number."""

    job_id: str
    model: str
    echo: dict[str, Any]
    created: float = field(default_factory=time.time)
    sequence: int = 0

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

    def response(self, result: Result | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object: in progress (no ``result``), failed (``error``: {code, message}), else
        completed, or incomplete when the answer reached ``max_output_tokens``."""
        body: dict[str, Any] = {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                                "status": "in_progress", "error": None, "incomplete_details": None, "output": [],
                                "usage": None, **self.echo}
        if error is not None:
            return {**body, "status": "failed", "error": error}
        if result is None:
            return body
        cut = result.finish_reason == "length"
        status = "incomplete" if cut else "completed"
        return {**body, "status": status, "completed_at": time.time(),
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "output": [self.message(result.text, status)], "usage": response_usage(result),
                "batchfleet": fleet_view(result)}

    def event(self, kind: str, **fields: Any) -> bytes:
        """One server-sent event: ``event: <kind>`` and its JSON, numbered."""
        obj = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def opening(self) -> list[bytes]:
        """The events before the first text delta."""
        item = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response()),
                self.event("response.output_item.added", output_index=0, item=self.message(None, "in_progress")),
                self.event("response.content_part.added", **item, part=self.part(""))]

    def delta(self, text: str) -> bytes:
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, done: dict[str, Any]) -> list[bytes]:
        """The events after the last text delta; the last carries ``done``, the finished response."""
        message = done["output"][0]
        text = message["content"][0]["text"]
        item = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        return [self.event("response.output_text.done", **item, text=text, logprobs=[]),
                self.event("response.content_part.done", **item, part=self.part(text)),
                self.event("response.output_item.done", output_index=0, item=message),
                self.event("response.incomplete" if done["status"] == "incomplete" else "response.completed",
                           response=done)]

    def failure(self, error: dict[str, Any]) -> list[bytes]:
        """A job that failed mid-stream: the ``error`` event (OpenAI's clients raise it), then
        ``response.failed``. ``error``: an OpenAI error body's ``error`` object."""
        return [self.event("error", code=error.get("code"), message=error.get("message"), param=error.get("param")),
                self.event("response.failed", response=self.response(
                    error={"code": error.get("code") or "server_error", "message": error.get("message")}))]


def input_items(response_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's input items, oldest first: the conversation it was asked (a chained response's
    earlier turns too, their answers as output messages), each with a stable id."""
    items = []
    for i, m in enumerate(messages):
        assistant = m["role"] == "assistant"
        part = {"type": "output_text", "text": m["content"], "annotations": []} if assistant else {
            "type": "input_text", "text": m["content"]}
        items.append({"id": f"msg_{response_id.removeprefix('resp_')}_{i}", "type": "message", "role": m["role"],
                      "status": "completed", "content": [part]})
    return items
