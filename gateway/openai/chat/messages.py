"""A chat request's messages (OpenAI's shape), validated and rendered as the chat template reads them.

Roles ``system`` / ``developer`` (rendered as ``system``), ``user``, ``assistant`` and ``tool``. A message's
``name`` goes to the template (those that render it do). An assistant message may carry ``tool_calls``
(then its ``content`` may be null), each call's ``arguments`` JSON text handed to the template as an
object (as vLLM does: transformers' templates write ``arguments | tojson``); a ``tool`` message answers one
call: its ``tool_call_id`` is required. Every refusal is a 400 naming the field (``messages.<i>.<field>``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictStr

from batchfleet.gateway.errors import invalid
from batchfleet.gateway.strict import NEUTRAL_MESSAGE, refuse_non_neutral
from batchfleet.producer.chat import loads_object

STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: StrictStr


class CalledFunction(BaseModel):
    model_config = STRICT
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call an assistant message made (the conversation so far)."""

    model_config = STRICT
    id: StrictStr
    type: Literal["function"]
    function: CalledFunction


class Message(BaseModel):
    model_config = STRICT
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    # neutral-only (gateway/strict.py NEUTRAL_MESSAGE)
    function_call: Any = None
    refusal: StrictStr | None = None

    def rendered(self, index: int) -> dict[str, Any]:
        """The message as the chat template expects it: text parts joined, OpenAI's ``developer`` role as
        ``system``, tool calls' arguments as objects."""
        where = f"messages.{index}."
        refuse_non_neutral({k: getattr(self, k) for k in self.model_fields_set}, NEUTRAL_MESSAGE, where)
        if self.role not in ROLES:
            raise invalid(f"unsupported message role {self.role!r} (use system, developer, user, assistant or "
                          "tool)"[:300], "messages")
        calls = self.tool_calls or []
        if calls and self.role != "assistant":
            raise invalid(f"{where}tool_calls: only an assistant message makes tool calls", f"{where}tool_calls")
        if self.content is None and calls:
            content = None
        elif self.content is None or self.content == []:  # OpenAI: null only beside tool_calls
            raise invalid(f"{where}content is required: a string or a list of at least one text part",
                          f"{where}content")
        else:
            content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": ROLES[self.role], "content": content}
        if self.role == "tool":
            if self.tool_call_id is None:
                raise invalid(f"{where}tool_call_id is required in a tool message (the call it answers)",
                              f"{where}tool_call_id")
            out["tool_call_id"] = self.tool_call_id
        elif self.tool_call_id is not None:
            raise invalid(f"{where}tool_call_id belongs to tool messages only", f"{where}tool_call_id")
        if self.name is not None:
            out["name"] = self.name
        if calls:
            out["tool_calls"] = [_call(call, f"{where}tool_calls.{j}.") for j, call in enumerate(calls)]
        return out


def _call(call: ToolCall, where: str) -> dict[str, Any]:
    args = loads_object(call.function.arguments)
    if args is None:
        raise invalid(f"{where}function.arguments must be the JSON text of an object", f"{where}function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


def conversation(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages as the template reads them; as OpenAI's, a ``tool`` message answers a call an earlier
    assistant message made (its ``tool_call_id`` is one of their ids): a 400 naming it otherwise."""
    out, called = [], set()
    for i, message in enumerate(messages):
        rendered = message.rendered(i)
        called.update(call["id"] for call in rendered.get("tool_calls", ()))
        if rendered["role"] == "tool" and rendered["tool_call_id"] not in called:
            raise invalid(f"messages.{i}.tool_call_id {rendered['tool_call_id'][:100]!r} answers no tool call of an "
                          "earlier assistant message", f"messages.{i}.tool_call_id")
        out.append(rendered)
    return out
