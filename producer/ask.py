"""What one request asks (``Ask``), made once and passed as is from where the request is first read to the wire.

A client call's keyword arguments are checked into one (``Ask.of``); the gateway validates a request body once
into the fleet's one parameter type (common/wire/params.py ``Params``) and hands the Ask it makes to the client
(``submit(..., ask=)``): no keyword dict in between, no guide serialised and parsed again, nothing checked twice.
The wire ``Request`` (common/wire/protocol.py) embeds the Ask's very Params. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchfleet.common.errors import InvalidRequest
from batchfleet.common.keys import TENANT_MAX_CHARS, valid_tenant
from batchfleet.common.wire.guided import Guide, GuideError, from_options
from batchfleet.common.wire.params import FIELDS, Params
from batchfleet.common.wire.priority import INTERACTIVE, PRIORITIES, priority_of
from batchfleet.common.wire.protocol import REQUEST_KINDS

STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# OpenAI's (and the gateway's) names for what the client calls otherwise: an unknown-parameter error names ours
CLIENT_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                "service_tier": "priority"}


EMBED_PARAMS = Params(max_new_tokens=1)  # an embed request's: routing counts the prompt and one position


@dataclass(frozen=True)
class Ask:
    """What one request asks, made once and passed as is to the wire: the generation parameters (the fleet's
    one type, common/wire/params.py: checked when made, its guide compiled before anything is sent; the wire
    ``Request`` embeds this very object), the priority (common/wire/priority.py) and the kind (``embed``:
    an embed request, common/wire/protocol.py ``Request.kind``, answered with ``Result.embedding``; it takes
    no generation parameter).

    Made from a call's keyword arguments (``of``: the clients' API) or by the caller itself (the gateway: its
    request bodies, validated once into a Params, gateway/openai/chat/request.py), then handed to
    ``submit(..., ask=)``: no keyword dict in between, nothing checked or compiled twice.
    """

    params: Params
    priority: str = INTERACTIVE
    kind: str = "generate"
    tenant: str = ""  # on whose account (common/tenants.py); "": the client's own (``AsyncClient(tenant=)``)

    def __post_init__(self) -> None:
        if self.tenant != "" and not valid_tenant(self.tenant):
            raise InvalidRequest(f"tenant must be 1-{TENANT_MAX_CHARS} chars of [a-z0-9_-], got "
                                 f"{str(self.tenant)[:40]!r}")
        if not isinstance(self.params, Params):
            raise InvalidRequest(f"an Ask's params must be a Params, got {type(self.params).__name__}")
        if self.priority not in PRIORITIES:
            raise InvalidRequest(f"priority must be one of {', '.join(PRIORITIES)}, got {self.priority!r}"[:200])
        if self.kind not in REQUEST_KINDS:
            raise InvalidRequest(f"kind must be one of {', '.join(REQUEST_KINDS)}, got {self.kind!r}"[:200])
        if self.kind == "embed" and self.params != EMBED_PARAMS:
            raise InvalidRequest("an embed request takes no generation parameters")

    @classmethod
    def embed(cls, priority: str = INTERACTIVE) -> Ask:
        """An embed request's."""
        return cls(EMBED_PARAMS, priority, "embed")

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> Ask:
        """From a generate/submit/stream call's keyword arguments; an unknown name is an InvalidRequest (not
        a TypeError). The fields of common/wire/params.py by name; ``tenant``: on whose account; ``priority``: a
        priority name, OpenAI's ``service_tier`` names or vLLM's integer ``priority``; ``kind``: ``generate`` or
        ``embed``.

        Structured outputs: at most one of ``response_format`` (OpenAI's: ``{"type": "json_object"}`` or
        ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``), ``guided_json`` (a JSON
        schema), ``guided_regex``, ``guided_choice`` (a list of strings), ``guided_grammar`` (Lark or GBNF), as
        vLLM names them, or ``guide`` (a ``batchfleet.common.wire.guided.Guide``), compiled here. ``logprobs`` =
        k (0-20): each generated token's logprob and its k most likely alternatives, in ``Result.logprobs``."""
        values = dict(kwargs)
        unknown = set(values) - set(FIELDS) - set(STRUCTURED) - {"priority", "kind", "tenant"}
        if unknown:
            named = [f"{k} (the client's name is {CLIENT_NAMES[k]})" if k in CLIENT_NAMES else k
                     for k in sorted(unknown)]
            raise InvalidRequest(f"unknown generation parameter(s): {', '.join(named)}")
        kind = values.pop("kind", "generate")
        tenant = values.pop("tenant", None)
        tenant = "" if tenant is None else tenant  # None: the client's; 0 or False is no label (checked when made)
        if kind not in REQUEST_KINDS:
            raise InvalidRequest(f"kind must be one of {', '.join(REQUEST_KINDS)}, got {kind!r}"[:200])
        if kind == "embed" and set(values) - {"priority"}:
            raise InvalidRequest("an embed request takes no generation parameters, got "
                                 f"{', '.join(sorted(set(values) - {'priority'}))}")
        options = {k: values.pop(k) for k in STRUCTURED if k in values}
        given = values.pop("guide", None)
        asked = values.pop("priority", INTERACTIVE)
        params = EMBED_PARAMS if kind == "embed" else Params(**values)  # first: a bad number costs no compile
        try:
            priority = priority_of(asked)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        try:
            guide = from_options(**options)
            if given is not None:
                if guide is not None or not isinstance(given, Guide):  # a Guide is shape-checked when made
                    raise GuideError("guide must be a Guide, and the only structured-output option given")
                guide = given
            if guide is not None:
                guide.check()
        except GuideError as exc:
            raise InvalidRequest(str(exc)) from None
        return cls(params if guide is None else params.changed(guide=guide), priority, kind, tenant)

    @classmethod
    def called(cls, ask: Ask | None, kwargs: Mapping[str, Any]) -> Ask:
        """A call's Ask: the one it was handed (``ask=``, made once by its caller), else its keyword
        arguments' (``of``); both at once is an InvalidRequest."""
        if ask is None:
            return cls.of(kwargs)
        if kwargs:
            raise InvalidRequest(f"give ask= or generation parameters, not both (got {', '.join(sorted(kwargs))})")
        if not isinstance(ask, Ask):
            raise InvalidRequest(f"ask must be an Ask, got {type(ask).__name__}")
        return ask
