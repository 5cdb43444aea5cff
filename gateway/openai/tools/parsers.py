"""Tool calls in a model's own words, one parser per model family (as vLLM's ``--tool-call-parser``):

* ``hermes`` (Qwen 2.5/3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one
  block per call, text before the first block is the message's content;
* ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``), several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. ``[TOOL_CALLS]`` is a special token,
  and the fleet's text never holds special tokens, so an answer that is such a JSON array is one too.

Each family parses what a model wrote (``parse``: the content and the calls, or the whole text as content
when it is no well-formed call of a given function: ``auto`` falls back to text), and writes the Lark grammar
(llguidance) of its own format for ``tool_choice`` ``required`` or a named function: the model writes the
call the way it was trained to, and each call's arguments are generated under that function's JSON schema,
so they always validate (JSON read as written: gateway/openai/tools/written.py). Pure: no I/O.

A call's arguments are passed on as the model wrote them (their JSON text, never a re-serialization:
Python's json would turn ``2E0017489145`` into inf and write it back as ``Infinity``, which no strict parser
reads). A call whose arguments hold ``NaN`` or ``Infinity`` is no call; one with a number past a double's
range is marked (``Call.fits``) and refused by gateway/openai/tools/calling.py.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchfleet.common.wire.guided import JSON_OPTIONS
from batchfleet.gateway.openai.tools.written import fits, listed, members, whole

PARSERS = ("hermes", "llama3_json", "mistral")
MAX_CALLS = 8  # calls one constrained answer may hold (parallel_tool_calls): a random model stops in time


@dataclass(frozen=True)
class Call:
    """One tool call as parsed: the function's name and its arguments' JSON text as the model wrote it;
    ``fits``: every number in them fits a double (else a strict JSON parser cannot read them: such a call
    is refused, never passed on)."""

    name: str
    arguments: str
    fits: bool = True


@dataclass(frozen=True)
class Family:
    """A model family's tool-call format. ``read``: an answer -> (the text before the calls, the calls; None
    for one that is no call). ``starts``: what an answer's calls begin with (a stream holds text back from
    there on); ``anywhere``: calls may follow text (Hermes), else they are the whole answer. A constrained
    answer is ``open`` + calls joined by ``sep`` + ``close``, each call ``call_open`` + ``{"name": ...,
    <key>: <arguments>}`` + ``call_close``."""

    name: str
    read: Callable[[str], tuple[str, list[Call | None]]]
    starts: tuple[str, ...]
    anywhere: bool = False
    open: str = ""
    close: str = ""
    sep: str = "\n"
    call_open: str = ""
    call_close: str = ""
    key: str = "arguments"

    def parse(self, text: str, names: Sequence[str]) -> tuple[str | None, list[Call]]:
        """(content, calls) of an answer; (text, []) when it holds no well-formed call of ``names``."""
        head, calls = self.read(text)
        if not calls or any(c is None or c.name not in names for c in calls):
            return text, []
        return (head.strip() or None), calls  # type: ignore[return-value]

    def whole_calls(self, text: str, names: Sequence[str]) -> list[Call]:
        """The calls of a constrained answer cut short (``max_tokens``), read as the grammar wrote it (``open``,
        then calls joined by ``sep``, each ``call_open`` + a JSON object + ``call_close``), in one pass: every
        whole call of a given function up to the first that is cut. Empty when not even the first is whole."""
        calls: list[Call] = []
        at = len(self.open) if text.startswith(self.open) else -1
        while at >= 0 and text.startswith(self.call_open, at):
            try:
                obj, at = members(text, at + len(self.call_open))
            except (ValueError, RecursionError):
                break
            call = _call(obj, self.key)
            if call is None or call.name not in names or not text.startswith(self.call_close, at):
                break
            calls.append(call)
            at += len(self.call_close)
            at = at + len(self.sep) if text.startswith(self.sep, at) else -1
        return calls

    def grammar(self, functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of one or more calls (``parallel``: up to MAX_CALLS) of
        ``functions`` ((name, parameters schema) pairs) in this family's format."""
        more = f"({_lit(self.sep)} call){{0,{MAX_CALLS - 1}}}" if parallel else ""
        body = " ".join(p for p in (_lit(self.open) if self.open else "", "call", more,
                                    _lit(self.close) if self.close else "") if p)
        lines = [f"start: {body}", "call: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
        for i, (name, schema) in enumerate(functions):
            head = json.dumps({"name": name}, separators=(",", ":"))[:-1] + f',"{self.key}":'
            lines.append(f"fn{i}: {_lit(self.call_open + head)} args{i} {_lit('}' + self.call_close)}")
            lines.append(f"args{i}: %json {json.dumps(constraint(schema))}")
        return "\n".join(lines)

    def call_id(self) -> str:
        """A new call id: Mistral's templates require 9 letters or digits; OpenAI's look like call_<24>."""
        if self.name == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return "call_" + secrets.token_hex(12)


def pick(option: str, template: str) -> Family:
    """The family ``option`` names, or (``auto``) the one the fleet's chat template writes: a template that
    mentions ``<tool_call>`` is Hermes', ``[TOOL_CALLS]`` Mistral's, ``<|python_tag|>`` Llama 3's; Hermes
    otherwise (Qwen's, the most common)."""
    if option in FAMILIES:
        return FAMILIES[option]
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json")):
        if marker in (template or ""):
            return FAMILIES[name]
    return FAMILIES["hermes"]


def _call(obj: dict[str, tuple[Any, str]] | None, key: str = "arguments") -> Call | None:
    """A call from a JSON object's members {"name", "arguments" | "parameters"}, its arguments' text as
    the model wrote it; None when it is not one."""
    if obj is None or not isinstance(obj.get("name", (None,))[0], str):
        return None
    args, written = obj.get(key) or obj.get("parameters" if key == "arguments" else "arguments") or ({}, "{}")
    if isinstance(args, str):  # some models write the arguments as JSON text: that text is passed on
        inner = whole(args)
        if inner is None:
            return None
        args, written = {k: v for k, (v, _) in inner.items()}, args
    if not isinstance(args, dict):
        return None
    try:
        exact = fits(args)
    except RecursionError:
        return None
    return Call(obj["name"][0], written, exact)


HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _hermes(text: str) -> tuple[str, list[Call | None]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    return text[:start], [_call(whole(m.group(1))) for m in HERMES.finditer(text, start)]


def _llama3(text: str) -> tuple[str, list[Call | None]]:
    body = text.strip()
    body = body[len("<|python_tag|>"):].lstrip() if body.startswith("<|python_tag|>") else body
    if not body.startswith("{"):
        return text, []
    calls: list[Call | None] = []
    at = 0
    while at < len(body):
        try:
            obj, at = members(body, at)
        except (ValueError, RecursionError):
            return text, [None]
        calls.append(_call(obj, "parameters"))
        rest = body[at:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return text, [None]
        at = len(body) - len(rest) + 1
        while at < len(body) and body[at].isspace():
            at += 1
    return "", calls


def _mistral(text: str) -> tuple[str, list[Call | None]]:
    marker = text.find("[TOOL_CALLS]")
    head, body = (text[:marker], text[marker + len("[TOOL_CALLS]"):]) if marker >= 0 else ("", text)
    if marker < 0 and not body.lstrip().startswith("[{"):
        return text, []
    body = body.strip()
    if body.startswith("{"):  # one call, not in a list
        return head, [_call(whole(body))]
    try:
        return head, listed(body, _call)
    except (ValueError, RecursionError):
        return text, [None]


def constraint(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema as its arguments are generated: an object (OpenAI's rule; a schema
    without a type or a ``$ref`` gets it), compact JSON."""
    typed = {} if "type" in schema or "$ref" in schema else {"type": "object"}
    return {**typed, **schema, "x-guidance": JSON_OPTIONS}  # compact JSON, as every JSON guide


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text)


FAMILIES = {
    "hermes": Family("hermes", _hermes, ("<tool_call>",), anywhere=True, call_open="<tool_call>\n",
                     call_close="\n</tool_call>"),
    "llama3_json": Family("llama3_json", _llama3, ("{", "<|python_tag|>"), sep="; ", key="parameters"),
    "mistral": Family("mistral", _mistral, ("[", "[TOOL_CALLS]"), open="[", close="]", sep=","),
}
