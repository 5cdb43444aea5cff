"""Tool schemas as JSON Schema defines them (jsonschema, the draft a schema's ``$schema`` names, 2020-12
otherwise): whether a function's ``parameters`` is a schema at all (its draft's metaschema), and whether a
call a model wrote freely (``tool_choice`` ``auto``) has arguments that validate, formats checked.

Regular expressions are the client's and the strings the model's, so no backtracking engine meets them:
``pattern`` is matched by llguidance (linear time, the semantics forced calls are generated under), and a
schema with ``patternProperties`` (whose keys jsonschema would search with Python's ``re`` in three
keywords) gives no checkable call. A call that cannot be checked is no valid call.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

from batchfleet.common.wire.guided import Guide, GuideError, _probe_tokenizer, limits


def schema_error(schema: dict[str, Any]) -> str:
    """'' when ``schema`` is a valid JSON schema (checked against its draft's metaschema), else why not."""
    from jsonschema.exceptions import SchemaError

    try:
        validator = _validator(_key(schema))
        validator.check_schema(validator.schema)
    except SchemaError as exc:
        return f"{exc.message} (at {'/'.join(map(str, exc.path)) or 'the top'})"
    except Exception as exc:  # noqa: BLE001 - jsonschema raises what it meets (AttributeError for $schema: 5)
        return f"{type(exc).__name__}: {exc}"
    return ""


def conforms(schema: dict[str, Any], arguments: str) -> bool:
    """Whether a call's arguments (JSON text) validate against its function's schema. One that cannot be
    checked (a ``$ref`` that does not resolve or loops, ``patternProperties``, a ``pattern`` llguidance
    cannot read) is not a valid call."""
    key = _key(schema)
    if '"patternProperties"' in key:
        return False
    try:
        return bool(_validator(key).is_valid(json.loads(arguments)))
    except Exception:  # noqa: BLE001 - jsonschema raises what it meets on hostile schemas: no call then
        return False


def _key(schema: dict[str, Any]) -> str:
    return json.dumps(schema, sort_keys=True)


@functools.lru_cache(maxsize=256)
def _validator(schema: str) -> Any:
    """jsonschema's validator of a schema (its JSON text), ``pattern`` matched by llguidance, formats checked;
    cached: a service sends the same tools again and again."""
    from jsonschema import Draft202012Validator, validators

    parsed = json.loads(schema)
    cls = validators.validator_for(parsed, default=Draft202012Validator)
    linear = validators.extend(cls, {"pattern": _pattern})
    return linear(parsed, format_checker=cls.FORMAT_CHECKER)


def _pattern(validator: Any, pattern: Any, instance: Any, schema: dict[str, Any]) -> Iterator[Any]:
    """jsonschema's ``pattern`` keyword (a search: anchored only by ``^`` / ``$``), matched by llguidance."""
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield ValidationError(f"{instance[:100]!r} does not match {str(pattern)[:100]!r}")


def search(pattern: Any, text: str) -> bool:
    """Whether ``pattern`` (JSON Schema's) is found in ``text``: the JSON string ``text`` walked byte by
    byte through llguidance's grammar of ``{"type": "string", "pattern": pattern}``. False for a pattern
    llguidance cannot read."""
    import llguidance

    grammar = _string_grammar(pattern) if isinstance(pattern, str) else None
    if grammar is None:
        return False
    matcher = llguidance.LLMatcher(_probe_tokenizer(), grammar, log_level=0, limits=limits())
    return all(matcher.consume_token(b) for b in json.dumps(text, ensure_ascii=False).encode()) and bool(
        matcher.is_accepting())


@functools.lru_cache(maxsize=256)
def _string_grammar(pattern: str) -> str | None:
    try:  # a pattern past the guide's size limit is refused when the Guide is made
        guide = Guide("json_schema", json.dumps({"type": "string", "pattern": pattern}))
        guide.check()
        return guide.grammar()
    except GuideError:
        return None
