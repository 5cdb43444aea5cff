"""A forced tool call through the gateway whose model writes a number past a double's range (issue 54,
item 7): the tiny model is pushed by ``logit_bias`` to write ``9E99...`` under a ``{"type": "number"}``
parameter (its byte-level vocabulary: one token per character), seeded, until some answers carry a number
past a double's range and others one that fits. Each answer is a 400 ``guide_failed`` (never
``Infinity``), or a call whose arguments are strict JSON, as the model wrote them; whole or streamed."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.helpers.gateway import parse_events

pytestmark = pytest.mark.integration
NUMBER = {"type": "function", "function": {"name": "n", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"], "additionalProperties": False}}}
BIAS = {"61": 40, "73": 100, "129": 41}  # '9', 'E', '}': an exponent of some 9s, then the object ends
BODY = {"model": "m", "messages": [{"role": "user", "content": "x?"}], "tools": [NUMBER], "max_tokens": 64,
        "tool_choice": {"type": "function", "function": {"name": "n"}}, "parallel_tool_calls": False,
        "temperature": 1.0, "logit_bias": BIAS}


def strict(arguments: str) -> None:
    """The arguments as a strict parser reads them: no NaN / Infinity, every number a finite double."""
    def refuse(name: str) -> None:
        raise ValueError(name)

    value = json.loads(arguments, parse_constant=refuse, parse_int=float)
    assert all(math.isfinite(v) for v in value.values()), arguments


def outcome(http: httpx.Client, seed: int) -> tuple[str, str | None]:
    """("refused", None) or ("fits", the arguments) of the whole answer, checked against the streamed one."""
    resp = http.post("/v1/chat/completions", json={**BODY, "seed": seed})
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "seed": seed, "stream": True}) as streamed:
        events = parse_events([line for line in streamed.iter_lines()])
    if resp.status_code == 400:
        assert resp.json()["error"]["code"] == "guide_failed" and resp.json()["error"]["param"] == "tools"
        assert any(isinstance(e, dict) and e.get("error", {}).get("code") == "guide_failed" for e in events)
        return "refused", None
    assert resp.status_code == 200, resp.text
    (call,) = resp.json()["choices"][0]["message"]["tool_calls"]
    arguments = call["function"]["arguments"]
    strict(arguments)
    deltas = [d for e in events if isinstance(e, dict) and e.get("choices")
              for d in e["choices"][0]["delta"].get("tool_calls") or ()]
    assert "".join(d["function"]["arguments"] for d in deltas) == arguments  # seeded: the same answer
    return "fits", arguments


def test_a_forced_call_never_carries_a_number_past_a_doubles_range(tool_served):
    _, gw = tool_served
    seen: dict[str, str | None] = {}
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        for seed in range(24):
            kind, arguments = outcome(http, seed)
            seen.setdefault(kind, arguments)
            if len(seen) == 2:
                break
    assert set(seen) == {"refused", "fits"}, seen  # both kinds met: the refusal is not vacuous
    assert seen["fits"] is not None and "E" in seen["fits"]  # as the model wrote it, not re-serialized
