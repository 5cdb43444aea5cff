"""Structured outputs: what a request's output must match (the wire's ``guide``), and its llguidance grammar.

A ``Guide`` is library-neutral on the wire (a kind and a spec string), so a client in any language can
send one; workers compile it with llguidance (the grammar library vLLM also uses) into a per-step token
mask. Clients and the gateway check it with the same compiler before anything is sent, so an invalid
schema is the caller's error (InvalidRequest / HTTP 400), never a worker's: ``check`` compiles it, then
walks its first steps with llguidance's limits (``limits()``, the workers' too) over a byte-level
vocabulary, so a guide llguidance gives up on at once (a regex or grammar too large for its lexer or
parser, a schema or grammar that can never produce a token, one that only matches the empty output) is
refused before it is queued. A guide that fails later, at run time, fails its request with
``guide_failed`` (worker/engine/sampling.py), never a 200 with output that does not match.

Whitespace is not free: JSON is generated compact (``{"a":1,"b":[2,3]}``), so the schema's bounds
(``maxLength``, ``minimum``/``maximum``, ``maxItems``, ``enum``, ``additionalProperties: false``) bound
the whole output and a bounded schema closes within a bounded number of tokens whatever the model does.

llguidance is imported lazily: importing this module costs nothing.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# json_object: any JSON object; json_schema: ``spec`` is the schema as JSON text; regex: a regular
# expression (Rust regex syntax) the whole output matches; choice: ``spec`` is a JSON list of strings,
# the output is exactly one of them; grammar: a Lark (or GBNF) grammar, as vLLM's guided_grammar
GUIDE_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_GUIDE_CHARS = 1 << 17  # 128 Ki characters: far above OpenAI's own schema size limits
MAX_CHOICES = 1024
# compact JSON: no whitespace between tokens (llguidance's default would allow any amount of it)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
PROBE_STEPS = 8  # tokens of the check's walk: llguidance's failures show at the first mask or soon after
PROBE_EOS = 256  # the probe vocabulary: the 256 bytes, then an end-of-sequence token
VERDICTS_KEPT = 256  # guides whose verdict is remembered per process (a service sends one schema many times)


class GuideError(ValueError):
    """A guide that cannot be compiled (invalid schema, regex or grammar); the message says why and
    ``param`` names the request option it came from (when known)."""

    param: str | None = None


@dataclass(frozen=True)
class Guide:
    """What the output must match: ``kind`` (one of GUIDE_KINDS) and its ``spec`` (see GUIDE_KINDS)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        """The shape check (kind, types, size), so every Guide has the wire's shape wherever it was made (a
        client's argument, the gateway's request, a decoded Request); ``check()`` compiles it. GuideError."""
        if self.kind not in GUIDE_KINDS:
            raise GuideError(f"guide kind must be one of {', '.join(GUIDE_KINDS)}, got {self.kind!r}"[:200])
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GUIDE_CHARS:
            raise GuideError(f"guide spec must be a string of at most {MAX_GUIDE_CHARS} characters")
        if self.kind != "json_object" and not self.spec:
            raise GuideError(f"guide of kind {self.kind} needs a spec")

    def to_wire(self) -> dict[str, str]:
        return {"kind": self.kind, "spec": self.spec}

    @classmethod
    def from_wire(cls, obj: Any) -> Guide:
        """A decoded guide map as a Guide (shape-checked, not compiled). Raises GuideError."""
        if not isinstance(obj, dict) or set(obj) - {"kind", "spec"}:
            raise GuideError("guide must be a map with 'kind' and 'spec'")
        return cls(obj.get("kind"), obj.get("spec", ""))  # type: ignore[arg-type]

    def grammar(self) -> str:
        """The llguidance grammar (its JSON text); raises GuideError when the spec does not parse."""
        import llguidance

        matcher = llguidance.LLMatcher
        try:
            if self.kind == "json_object":
                return matcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
            if self.kind == "json_schema":
                schema = _loads(self.spec, "schema")
                if not isinstance(schema, dict):
                    raise GuideError("a JSON schema must be a JSON object")
                if (big := inexact_integer(schema)) is not None:
                    raise GuideError(f"invalid json_schema: the integer {big} is past +-2^53, which llguidance "
                                     "holds as a float (it would generate another number)"[:300])
                return matcher.grammar_from_json_schema(self.spec, overrides=JSON_OPTIONS)
            if self.kind == "regex":
                return matcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                choices = _loads(self.spec, "choice list")
                if (not isinstance(choices, list) or not 0 < len(choices) <= MAX_CHOICES
                        or not all(isinstance(c, str) and c for c in choices)):
                    raise GuideError(f"choice must be a list of 1-{MAX_CHOICES} non-empty strings")
                return llguidance.grammar_from("choice", json.dumps(choices))
            return llguidance.grammar_from("grammar", self.spec)
        except GuideError:
            raise
        except (ValueError, RecursionError) as exc:  # llguidance's JSON parser, the GBNF converter
            raise GuideError(f"invalid {self.kind}: {exc}"[:500]) from None

    def check(self) -> None:
        """Compile it without the served tokenizer, then walk its first steps over a byte vocabulary
        (``_probe``); GuideError with llguidance's reason when it does not compile, when llguidance gives up
        on it there, or when it only matches the empty output. The verdicts of the last VERDICTS_KEPT guides
        are cached. Up to about a second for a pathological guide: a worker runs it off its loop thread."""
        error = self.known_verdict()
        if error is None:
            error = _verdict(self.kind, self.spec)
            with _verdicts_lock:
                _verdicts[(self.kind, self.spec)] = error
                while len(_verdicts) > VERDICTS_KEPT:
                    _verdicts.popitem(last=False)
        if error:
            raise GuideError(error)

    def known_verdict(self) -> str | None:
        """The cached verdict of ``check()`` ('' passed, else why not), or None when not checked yet
        (cheap: a worker's loop thread asks this before handing the check to its guide-check thread)."""
        with _verdicts_lock:  # the cache is shared by every thread that checks (gateway, worker pool)
            error = _verdicts.get((self.kind, self.spec))
            if error is not None:
                _verdicts.move_to_end((self.kind, self.spec))
            return error


# (kind, spec) -> '' or why not, least recently used first
_verdicts: OrderedDict[tuple[str, str], str] = OrderedDict()
_verdicts_lock = threading.Lock()


def _verdict(kind: str, spec: str) -> str:
    """'' when the guide compiles and its first steps can be followed, else why not."""
    import llguidance

    try:
        grammar = Guide(kind, spec).grammar()
    except GuideError as exc:
        return str(exc)
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=limits())
    if error:
        return f"invalid {kind}: {error.strip()}"[:1000]
    return _probe(kind, grammar)


@functools.lru_cache(maxsize=1)
def limits() -> Any:
    """llguidance's parser limits (its defaults, named once: the checks here and the workers' matchers use
    the same), without verbose errors (they would copy the grammar and parser state into messages)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def matcher_error(message: str) -> str:
    """llguidance's error message as a user reads it (its first line, the cryptic reasons explained)."""
    reason = message.strip().split("\n", 1)[0].strip()
    if reason.startswith("NoExtension"):
        return f"no output can match it (llguidance: {reason})"
    return reason or "llguidance gave up on it"


def _probe(kind: str, grammar: str) -> str:
    """Walk the guide's first PROBE_STEPS tokens over a byte-level vocabulary (always the lowest byte it
    allows): '' when llguidance follows them, else why not. A guide whose first mask allows only the end
    of the output matches only the empty string: refused too (nothing to generate)."""
    import llguidance

    m = llguidance.LLMatcher(_probe_tokenizer(), grammar, log_level=0, limits=limits())
    for step in range(PROBE_STEPS):
        if m.is_error() or m.is_stopped():
            break
        mask = m.compute_bitmask()
        if m.is_error():
            break
        allowed = [b for b in range(PROBE_EOS) if mask[b >> 3] >> (b & 7) & 1]
        if not allowed:
            if step == 0:
                eos = mask[PROBE_EOS >> 3] >> (PROBE_EOS & 7) & 1
                return f"invalid {kind}: " + ("it only matches the empty output" if eos else "no output can match it")
            break
        m.consume_token(allowed[0])
    if m.is_error():
        return f"invalid {kind}: {matcher_error(m.get_error())}"[:1000]
    return ""


@functools.lru_cache(maxsize=1)
def _probe_tokenizer() -> Any:
    """The 256 bytes and an EOS: small (a fast check) and able to spell any output."""
    import llguidance

    class Bytes:
        eos_token_id = PROBE_EOS
        bos_token_id = None
        tokens = [bytes([b]) for b in range(PROBE_EOS)] + [b"</s>"]
        special_token_ids = [PROBE_EOS]

        def __call__(self, text: bytes | str) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise GuideError(f"the {what} is not valid JSON: {exc}"[:300]) from None


def from_response_format(rf: Any) -> Guide | None:
    """OpenAI's ``response_format``: {"type": "text"} (None), {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise GuideError("response_format must be an object with a 'type'")
    kind = rf["type"]
    extra = set(rf) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in rf):
        raise GuideError(f"response_format has unknown field(s): {', '.join(sorted(extra or {'json_schema'}))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_object")
    if kind != "json_schema":
        raise GuideError(f"response_format type must be text, json_object or json_schema, got {kind!r}"[:200])
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise GuideError("response_format json_schema must be an object with a 'schema'")
    unknown = set(js) - {"name", "schema", "strict", "description"}
    if unknown:
        raise GuideError(f"response_format json_schema has unknown field(s): {', '.join(sorted(unknown))}")
    if not isinstance(js.get("name", ""), str) or not isinstance(js.get("description", ""), str):
        raise GuideError("response_format json_schema name and description must be strings")
    if js.get("strict") not in (None, True, False):
        raise GuideError("response_format json_schema strict must be a boolean")
    schema = js.get("schema", {})  # OpenAI: a missing schema means any JSON... object: {} allows any value
    if not isinstance(schema, dict):
        raise GuideError("response_format json_schema schema must be an object")
    return Guide("json_schema", dump_schema(schema))


def dump_schema(schema: Any) -> str:
    """A schema as the spec string (compact JSON); GuideError when it is not JSON-serializable."""
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise GuideError(f"the schema is not JSON: {exc}"[:300]) from None
    if len(text) > MAX_GUIDE_CHARS:
        raise GuideError(f"the schema is longer than {MAX_GUIDE_CHARS} characters")
    return text


def from_options(*, response_format: Any = None, guided_json: Any = None, guided_regex: Any = None,
                 guided_choice: Any = None, guided_grammar: Any = None) -> Guide | None:
    """One Guide from OpenAI's ``response_format`` or vLLM's ``guided_*`` options (at most one of them);
    GuideError names the option when it is malformed or when several are given."""
    if response_format == {"type": "text"}:  # OpenAI's default: no constraint
        response_format = None
    given = {k: v for k, v in (("response_format", response_format), ("guided_json", guided_json),
                               ("guided_regex", guided_regex), ("guided_choice", guided_choice),
                               ("guided_grammar", guided_grammar)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise GuideError(f"give at most one of {', '.join(sorted(given))}")
    (name, value), = given.items()
    try:
        return _from_option(name, value)
    except GuideError as exc:
        exc.param = name
        raise


def _from_option(name: str, value: Any) -> Guide:
    if name == "response_format":
        guide = from_response_format(value)
        assert guide is not None  # {"type": "text"} was dropped before
        return guide
    if name == "guided_json":  # a schema (object), or its JSON text
        if isinstance(value, str):
            value = _loads(value, "guided_json schema")
        if not isinstance(value, dict):
            raise GuideError("guided_json must be a JSON schema (an object)")
        return Guide("json_schema", dump_schema(value))
    if name == "guided_choice":
        if not isinstance(value, (list, tuple)) or not all(isinstance(c, str) for c in value):
            raise GuideError("guided_choice must be a list of strings")
        return Guide("choice", json.dumps(list(value)))
    if not isinstance(value, str) or not value or len(value) > MAX_GUIDE_CHARS:
        raise GuideError(f"{name} must be a non-empty string of at most {MAX_GUIDE_CHARS} characters")
    return Guide("regex" if name == "guided_regex" else "grammar", value)


# JSON-schema numbers llguidance cannot hold: it reads a schema's numbers as 64-bit floats, so an integer bound,
# ``const`` or ``enum`` value past 2^53 loses its value, and output generated under it would break the schema the
# client sent (a 200 with invalid output). Such schemas are refused.
EXACT = 2**53  # llguidance reads a schema's numbers as 64-bit floats: integers past this lose their value
NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "const", "enum")


def inexact_integer(schema: Any) -> int | None:
    """An integer of a schema's numeric keywords (bounds, ``const``, ``enum``, at any depth) that a float
    cannot hold exactly, or None. Walked without recursion (schemas may nest deeply)."""
    todo: list[Any] = [schema]
    values: list[Any] = []
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                (values if key in NUMERIC else todo).append(value)
        elif isinstance(node, list):
            todo.extend(node)
    while values:  # everything inside a numeric keyword's value: const and enum may hold objects and lists
        value = values.pop()
        if isinstance(value, dict):
            values.extend(value.values())
        elif isinstance(value, list):
            values.extend(value)
        elif type(value) is int and abs(value) > EXACT:
            return value
    return None
