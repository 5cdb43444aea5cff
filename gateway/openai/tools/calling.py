"""Tool calling on /v1/chat/completions: the request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
validated into one ``ToolPlan``, the constraint that makes a forced call valid, and tool calls in answers.

* ``tools`` are handed to the chat template (producer/chat.py ``Chat``), which renders them as the model
  was trained to read them; ``tool_choice`` defaults to ``auto`` when tools are given, as OpenAI's.
* ``auto``: the model may answer in text or call tools; its answer is parsed by the model family's parser
  (gateway/openai/tools/parsers.py, ``--tool-call-parser``), and is plain text when it holds no well-formed call,
  or a call whose arguments fail its function's schema (jsonschema: a 200 never carries an invalid call).
  Every ``parameters`` must be a valid JSON schema (its draft's metaschema), whatever the choice.
* ``required`` / a named function: the output is constrained (llguidance) to the family's call format,
  each call's arguments to its function's ``parameters`` schema, so they always validate. A schema that
  llguidance cannot compile is a 400 naming ``tools.<i>.function.parameters``.
* ``none``: a text answer (the tools are still rendered, as vLLM does by default).
* A call's arguments are the model's JSON text, passed on as written. A number in them past a double's
  range (``2E0017489145``: no strict parser reads it) makes an ``auto`` answer text, and a constrained one a
  400 ``guide_failed`` (``unfit_call``), never ``Infinity``.
* ``parallel_tool_calls`` false: at most one call.

Answers carry ``message.tool_calls`` (``finish_reason`` ``tool_calls``; ``stop`` for a named function, as
OpenAI's), streams ``delta.tool_calls`` (a first delta with the call's id and name, then its arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from batchfleet.common.errors import GUIDE_FAILED
from batchfleet.common.wire.guided import MAX_GUIDE_CHARS, Guide, GuideError, dump_schema
from batchfleet.gateway.errors import APIError, invalid
from batchfleet.gateway.openai.tools.parsers import Call, Family, constraint
from batchfleet.gateway.openai.tools.schemas import conforms, schema_error

STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
MAX_TOOLS = 128  # OpenAI's limit
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters left out


class Function(BaseModel):
    model_config = STRICT
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # OpenAI's strict mode: here every constrained call is exact anyway


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: Function


class FunctionName(BaseModel):
    model_config = STRICT
    name: StrictStr


class NamedChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedChoice


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one chat request and what the model may do with them. ``choice``: ``none``, ``auto``,
    ``required`` or ``function`` (then ``forced`` names it)."""

    tools: tuple[dict[str, Any], ...]  # as the template takes them: {"type": "function", "function": {...}}
    choice: str
    parallel: bool = True
    forced: str | None = None
    flat: bool = False  # the Responses API's flat tools ({"type", "name", "parameters"}): refusals name its fields

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def parsed(self) -> bool:
        """Whether answers are read for tool calls (every choice but ``none``)."""
        return self.choice != "none"

    def functions(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, parameters schema) of the functions a constrained answer may call."""
        return [(t["function"]["name"], t["function"].get("parameters") or NO_PARAMETERS) for t in self.tools
                if self.forced is None or t["function"]["name"] == self.forced]

    def guide(self, family: Family) -> Guide:
        """The constraint of a ``required`` or named choice, checked (llguidance compiles each function's
        schema, then the whole grammar): a 400 naming the schema it cannot compile. Slow for large schemas:
        callers run it off the event loop."""
        for i, tool in enumerate(self.tools):
            name, schema = tool["function"]["name"], tool["function"].get("parameters") or NO_PARAMETERS
            if self.forced not in (None, name):
                continue
            try:
                Guide("json_schema", dump_schema(constraint(schema))).check()
            except GuideError as exc:
                where = f"tools.{i}.parameters" if self.flat else f"tools.{i}.function.parameters"
                raise invalid(f"{where} ({name}): {exc}"[:1000], where) from None
        grammar = family.grammar(self.functions(), self.parallel and self.forced is None)
        if len(grammar) > MAX_GUIDE_CHARS:  # before the Guide, whose shape check would refuse it
            raise invalid(f"the tools' schemas are longer than {MAX_GUIDE_CHARS} characters together", "tools")
        guide = Guide("grammar", grammar)
        try:
            guide.check()
        except GuideError as exc:
            raise invalid(f"the tools cannot be constrained: {exc}"[:1000], "tools") from None
        return guide

    def calls(self, family: Family, text: str, cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, OpenAI tool calls) of an answer; (text, []) when it holds none, or when a call's
        arguments fail its function's schema (``auto`` answers are not constrained: a model may write any
        arguments, and a 200 never carries a call that breaks its schema). A constrained answer ``cut`` short by
        ``max_tokens`` is (None, its whole calls): never the cut one, nor its markup as text."""
        if not self.parsed:
            return text, []
        content, calls = family.parse(text, self.names)
        if self.constrained and cut and not calls:  # the grammar wrote calls alone: keep those it finished
            content, calls = None, family.whole_calls(text, self.names)
        if not self.parallel:
            calls = calls[:1]
        if not all(c.fits for c in calls):  # a number no strict parser reads: never passed on
            if self.constrained:
                raise unfit_call()
            return text, []
        # a constrained answer was generated under the schemas (jsonschema's float arithmetic would refuse
        # some of its numbers: 0.3 as a multipleOf 0.1); an ``auto`` one is only read, so it is checked
        schemas = {t["function"]["name"]: t["function"].get("parameters") or NO_PARAMETERS for t in self.tools}
        if not self.constrained and not all(conforms(schemas[c.name], c.arguments) for c in calls):
            return text, []
        return content, [tool_call(family, c) for c in calls]

    def beside(self, guide: Guide | None) -> ToolPlan:
        """The plan beside a request's structured output (``response_format`` / ``guided_*``, which a
        constrained choice refuses): its answer follows that guide, so it is content, never read for calls
        (``auto`` acts as ``none``: the tools are still rendered)."""
        return self if guide is None or self.choice != "auto" else replace(self, choice="none")

    def finish(self, reason: str, called: bool) -> str:
        """OpenAI's finish_reason: ``tool_calls`` when the answer calls tools (``stop`` for a named
        function, as OpenAI's), else the fleet's own."""
        if not called or reason == "length":
            return reason
        return "stop" if self.forced is not None else "tool_calls"


def unfit_call() -> APIError:
    """The refusal of a forced call the model wrote with a number past a double's range (the grammar of a
    ``{"type": "number"}`` allows any exponent: ``2E0017489145``): as a structured-output guide that failed at
    run time, a 400 ``guide_failed`` naming the tools (bounding the number, ``minimum``/``maximum``, avoids it)."""
    return invalid("the model wrote a tool call with a number that does not fit a double (no strict JSON parser "
                   "reads it); bound the parameter's numbers with minimum/maximum", "tools", GUIDE_FAILED)


def tool_call(family: Family, call: Call) -> dict[str, Any]:
    return {"id": family.call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def plan(tools: Sequence[Tool] | None, choice: Any, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools, a text answer), or a 400 naming the field."""
    if not tools:
        if choice in ("required",) or isinstance(choice, NamedChoice):
            raise invalid("tool_choice 'required' or a named function needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools", "tools")
    for i, tool in enumerate(tools):  # OpenAI's rule: the arguments are an object
        if (tool.function.parameters or {}).get("type", "object") != "object":
            raise invalid(f"tools.{i}.function.parameters must be the JSON schema of an object (type: object)",
                          f"tools.{i}.function.parameters")
        if tool.function.parameters is not None:  # as OpenAI: a schema that is no JSON schema is a 400
            error = schema_error(tool.function.parameters)
            if error:
                raise invalid(f"tools.{i}.function.parameters is not a valid JSON schema: {error}"[:1000],
                              f"tools.{i}.function.parameters")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools must not repeat a function name", "tools")
    forced = None
    if isinstance(choice, NamedChoice):
        forced = choice.function.name
        if forced not in names:
            raise invalid(f"tool_choice names {forced[:100]!r}, which is not among the tools", "tool_choice")
    kind = "function" if forced is not None else (choice or "auto")
    rendered = tuple({"type": "function", "function": t.function.model_dump(exclude_none=True, exclude={"strict"})}
                     for t in tools)
    return ToolPlan(rendered, kind, parallel is not False, forced)


class ToolStream:
    """One streamed choice read for tool calls. Text is passed on as content until the family's calls begin
    (Hermes: at ``<tool_call>``, text that may begin it held back; Llama 3 and Mistral: calls are the whole
    answer, so its first non-blank characters decide); from there the rest is held and parsed when the
    choice ends: its calls as OpenAI's deltas, or (no well-formed call) the held text as content. A
    constrained choice is all calls."""

    def __init__(self, tools: ToolPlan, family: Family) -> None:
        self.tools = tools
        self.family = family
        self.held = ""
        self.state = "calls" if tools.constrained else "open"  # open -> text | calls

    def feed(self, text: str) -> str:
        """The content to send now for ``text``, the choice's next delta."""
        self.held += text
        if self.state == "calls":
            return ""
        if self.family.anywhere:
            at = min((i for m in self.family.starts if (i := self.held.find(m)) >= 0), default=-1)
            if at >= 0:
                self.state = "calls"
            else:  # keep back the longest tail that may begin a marker
                at = len(self.held) - max((k for m in self.family.starts for k in range(1, len(m))
                                          if self.held.endswith(m[:k])), default=0)
        elif self.state == "open":
            head = self.held.lstrip()
            if not head or any(m.startswith(head) for m in self.family.starts):
                return ""  # undecided
            self.state = "calls" if head.startswith(self.family.starts) else "text"
            at = 0 if self.state == "calls" else len(self.held)
        else:
            at = len(self.held)
        out, self.held = self.held[:at], self.held[at:]
        return out

    def end(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(the content still held, OpenAI's tool calls) when the choice ends (``cut``: by ``max_tokens``)."""
        held, self.held = self.held, ""
        if self.state != "calls":
            return held, []
        content, calls = self.tools.calls(self.family, held, cut)
        return (content or "", calls) if calls or content is None else (held, [])

    def finish(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(the content still held, the calls' deltas) when the choice ends (``cut``: by ``max_tokens``)."""
        content, calls = self.end(cut)
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls):  # as OpenAI streams them: id and name first, then the arguments
            fn = call["function"]
            deltas.append({"index": i, "id": call["id"], "type": "function",
                           "function": {"name": fn["name"], "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": fn["arguments"]}})
        return content, deltas
