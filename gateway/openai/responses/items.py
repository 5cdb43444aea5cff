"""The Responses API's items as a chat conversation, both ways (OpenAI's shapes: openai.types.responses).

Input items: a message (``type`` "message" or absent; text content), a ``function_call`` (a call the model
made earlier: ``call_id``, ``name``, ``arguments`` JSON text) and a ``function_call_output`` (its result:
``call_id``, ``output``). They become chat messages: a function call joins the assistant turn just before
it (its text, and the parallel calls it made) as one of its ``tool_calls``, else opens an assistant turn of
its own; an output is a ``role: tool`` message answering ``call_id``.

A stored response keeps its conversation as chat messages (gateway/openai/responses/store.py); its answer is the
assistant message of its output items (``answer_message``), and ``input_items`` lists them back as items:
messages, function calls and their outputs. Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictStr

from batchfleet.gateway.errors import invalid
from batchfleet.gateway.openai.chat.request import STRICT, parse

TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output")
Status = Literal["in_progress", "completed", "incomplete"] | None


class ContentPart(BaseModel):
    model_config = STRICT
    type: Literal["input_text", "output_text"]
    text: StrictStr
    annotations: list[Any] | None = None  # an earlier answer's output_text part, sent back as it came
    logprobs: list[Any] | None = None


class InputMessage(BaseModel):
    """A message item. ``id`` and ``status``: an earlier output item sent back as it came (LangChain does)."""

    model_config = STRICT
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[ContentPart]
    id: StrictStr | None = None
    status: StrictStr | None = None

    def chat(self) -> dict[str, Any]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class FunctionCall(BaseModel):
    """A ``function_call`` item: a call the model made (an earlier response's output item, sent back)."""

    model_config = STRICT
    type: Literal["function_call"]
    call_id: StrictStr = Field(min_length=1, max_length=200)
    name: StrictStr
    arguments: StrictStr  # JSON text of an object
    id: StrictStr | None = None
    status: Status = None

    def call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class OutputText(BaseModel):
    model_config = STRICT
    type: Literal["input_text"]
    text: StrictStr


class FunctionCallOutput(BaseModel):
    """A ``function_call_output`` item: the result of the call ``call_id`` (text, or input_text parts)."""

    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: StrictStr = Field(min_length=1, max_length=200)
    output: StrictStr | list[OutputText]
    id: StrictStr | None = None
    status: Status = None

    def chat(self) -> dict[str, Any]:
        text = self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)
        return {"role": "tool", "tool_call_id": self.call_id, "content": text}


Item = InputMessage | FunctionCall | FunctionCallOutput
MODELS: dict[Any, type[BaseModel]] = {None: InputMessage, "message": InputMessage, "function_call": FunctionCall,
                                      "function_call_output": FunctionCallOutput}


def parse_items(raw: list[Any]) -> list[Item]:
    """``input``'s items, each checked by its type's model: a 400 naming ``input.<i>.<field>``."""
    items: list[Item] = []
    for i, item in enumerate(raw):
        where = f"input.{i}."
        kind = item.get("type") if isinstance(item, dict) else None
        if not isinstance(kind, (str, type(None))) or kind not in MODELS:
            raise invalid(f"input item type {str(kind)[:60]!r} is not supported: this gateway serves "
                          f"{', '.join(ITEM_TYPES)} items", f"{where}type")
        parts = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if isinstance(part, dict) and part.get("type") not in TEXT_PARTS:
                raise invalid(f"content part type {str(part.get('type'))[:60]!r} is not supported: the fleet's "
                              "models read text (input_text, output_text)", f"{where}content.{j}.type")
        parsed = parse(MODELS[kind], item, where)
        if isinstance(parsed, FunctionCall) and not isinstance(_loads(parsed.arguments), dict):
            raise invalid(f"{where}arguments must be the JSON text of an object", f"{where}arguments")
        items.append(parsed)
    return items


def chat_messages(items: list[Item]) -> list[dict[str, Any]]:
    """The chat messages of input items (each a new dict): function calls folded into assistant turns."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, FunctionCall):
            if out and out[-1]["role"] == "assistant":  # the text before it, or a parallel call: one turn
                out[-1].setdefault("tool_calls", []).append(item.call())
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [item.call()]})
        else:
            out.append(item.chat())
    return out


def check_outputs(items: list[Item], history: list[dict[str, Any]]) -> None:
    """A 400 (as OpenAI's) for a ``function_call_output`` item that answers no function call of the
    conversation: neither an input ``function_call`` item nor a call of the chained response's turns."""
    known = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    known |= {item.call_id for item in items if isinstance(item, FunctionCall)}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallOutput) and item.call_id not in known:
            raise invalid(f"input.{i}.call_id: no function call with call_id {item.call_id[:100]!r} in this "
                          "conversation (send its function_call item, or chain on the response that made it "
                          "with previous_response_id)", f"input.{i}.call_id")


def answer_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant message that continues its conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": None if calls and not text else text}
    if calls:
        message["tool_calls"] = calls
    return message


def input_items(response_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stored response's input items, oldest first: the conversation it was asked (a chained response's
    earlier turns too, their answers as output messages and function calls), each with a stable id."""
    stem = response_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            items.append({"id": f"fco_{stem}_{i}", "type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"], "status": "completed"})
            continue
        assistant = m["role"] == "assistant"
        if m["content"] is not None:
            part = {"type": "output_text", "text": m["content"], "annotations": []} if assistant else {
                "type": "input_text", "text": m["content"]}
            items.append({"id": f"msg_{stem}_{i}", "type": "message", "role": m["role"], "status": "completed",
                          "content": [part]})
        for j, call in enumerate(m.get("tool_calls") or ()):
            items.append({"id": f"fc_{stem}_{i}_{j}", "type": "function_call", "status": "completed",
                          "call_id": call["id"], "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"]})
    return items


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
