"""Guides that cannot be followed are errors, never a 200 (issue 30 item 2), pure: the check every client and
the gateway run before queueing (compile, then walk the first steps with llguidance's limits) refuses the
guides llguidance gives up on, naming the request's field; a matcher that fails at run time ends its request
with ``guide_failed`` (worker log and outcome counter), which the gateway answers as a 400 naming the guide."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from batchfleet.common.errors import GUIDE_FAILED, InvalidRequest, JobFailed
from batchfleet.common.wire.guided import PROBE_EOS, PROBE_STEPS, Guide, GuideError, _probe_tokenizer, limits
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.protocol import Error, Request, Result
from batchfleet.gateway.errors import APIError, api_error
from batchfleet.gateway.openai.chat.request import request_job
from batchfleet.gateway.service import job_asks
from batchfleet.producer.ask import Ask
from batchfleet.worker.engine.base import Completion, GenRequest
from batchfleet.worker.ledger import Ledger
from batchfleet.worker.requests.replies import completion_reply
from batchfleet.worker.requests.validate import Accepted
from batchfleet.worker.transport.base import Entry

RECURSIVE_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
# the cases of issue 30: (request option, value, the reason's words); each passed llguidance's own validation
GIVEN_UP = [
    ("guided_regex", "a{500000}", "lexer error"),
    ("guided_json", RECURSIVE_REQUIRED, "Too many items"),
    ("guided_json", {"$ref": "#"}, "no output can match it"),
    ("guided_grammar", "start: a\na: a", "no output can match it"),
    ("guided_grammar", 'start: "a"~1000000', "Too many items"),
    ("guided_grammar", "root ::= ", "only matches the empty output"),  # an empty GBNF grammar
    ("guided_grammar", "start: ", "only matches the empty output"),  # an empty Lark one
    ("guided_regex", "()", "only matches the empty output"),
    # integers a float cannot hold: llguidance would generate a neighbour that breaks the schema
    ("guided_json", {"type": "object", "properties": {"x": {"const": 2**53 + 1}}, "required": ["x"]}, "past"),
    ("guided_json", {"type": "integer", "minimum": 2**60 + 1, "maximum": 2**60 + 3}, "past"),
    ("guided_json", {"type": "integer", "minimum": 2**70}, "past"),
    ("guided_json", {"enum": [1, [{"a": -(2**64)}]]}, "past"),
]
# passes the check (its first PROBE_STEPS tokens are fine), fails at run time on the byte-level tiny model
FAILS_LATER = f'start: /[ab]{{{PROBE_STEPS + 4}}}/ "c"~1000000'


@pytest.mark.unit
def test_integers_a_float_holds_exactly_pass_the_check():
    Guide("json_schema", json.dumps({"type": "object", "properties": {"x": {
        "type": "integer", "minimum": -(2**53), "maximum": 2**53}, "y": {"const": 2**53}}})).check()


def guide_of(option: str, value: object) -> Guide:
    kind = {"guided_regex": "regex", "guided_json": "json_schema", "guided_grammar": "grammar"}[option]
    return Guide(kind, json.dumps(value) if isinstance(value, dict) else value)


@pytest.mark.unit
@pytest.mark.parametrize(("option", "value", "why"), GIVEN_UP)
def test_guides_llguidance_gives_up_on_are_refused_by_the_check(option, value, why):
    with pytest.raises(GuideError, match=why):
        guide_of(option, value).check()


@pytest.mark.unit
def test_followable_guides_still_pass_and_a_later_failure_is_not_seen_by_the_check():
    for good in (Guide("json_object"), Guide("regex", "a?"), Guide("regex", "[0-9]{3}-[0-9]{4}"),
                 Guide("choice", '["yes", "no"]'), Guide("grammar", 'root ::= "a" | "b"'),
                 Guide("json_schema", json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}})),
                 Guide("json_schema", json.dumps({"enum": [f"v{i}" for i in range(1000)]})),
                 Guide("grammar", FAILS_LATER)):
        good.check()


@pytest.mark.unit
@pytest.mark.parametrize(("option", "value", "why"), GIVEN_UP)
def test_the_gateway_answers_a_400_naming_the_guide_field(option, value, why):
    for chat in (False, True):
        body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        job = request_job(chat, {**body, option: value}, 60, 16)
        with pytest.raises(APIError) as exc:
            asyncio.run(job_asks(job))
        assert (exc.value.status, exc.value.param, exc.value.type) == (400, option, "invalid_request_error")
        assert why in exc.value.message
    nested = {"structured_outputs": {option.removeprefix("guided_"): value}, "prompt": "hi"}
    with pytest.raises(APIError) as exc:
        asyncio.run(job_asks(request_job(False, nested, 60, 16)))
    assert exc.value.param == "structured_outputs"
    if option == "guided_json":  # OpenAI's own spelling
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}
        with pytest.raises(APIError) as exc:
            asyncio.run(job_asks(request_job(True, {"messages": [{"role": "user", "content": "hi"}],
                                                      "response_format": rf}, 60, 16)))
        assert exc.value.param == "response_format"


@pytest.mark.unit
def test_the_python_clients_refuse_them_before_sending():
    for option, value, why in GIVEN_UP:
        with pytest.raises(InvalidRequest, match=why):
            Ask.of({option: value, "max_new_tokens": 4})


def checker_for(guide: Guide):
    """A StopChecker over the check's byte vocabulary (the tiny model's is byte-level too)."""
    import llguidance

    from batchfleet.worker.engine.sampling import StopChecker  # imports torch: only when a test runs

    class Text:
        def decode(self, tokens, skip_special_tokens=True):
            return bytes(t for t in tokens if t < PROBE_EOS).decode(errors="replace")

    req = GenRequest(id="j", prompt=[1], bucket=32, params=Params(max_new_tokens=64, guide=guide))
    matcher = llguidance.LLMatcher(_probe_tokenizer(), guide.grammar(), log_level=0, limits=limits())
    return StopChecker(req, frozenset({PROBE_EOS}), Text(), matcher)


def test_a_matcher_failing_at_run_time_ends_its_request_with_guide_failed():
    checker = checker_for(Guide("grammar", FAILS_LATER))
    pushed = 0
    while True:  # as the engines do: the step's mask first (a failed one leaves the row free), then the token
        mask = checker.matcher.compute_bitmask()
        allowed = [b for b in range(PROBE_EOS) if mask[b >> 3] >> (b & 7) & 1]
        if checker.push(allowed[0] if allowed else ord("a")):
            break
        pushed += 1
        assert pushed < 40, "the matcher never failed"
    assert pushed >= PROBE_STEPS and checker.reason == "" and checker.live_matcher() is None
    outcome = checker.outcome()
    assert outcome["error_code"] == GUIDE_FAILED and outcome["finish_reason"] == ""
    assert "llguidance gave up on the grammar" in outcome["error"] and "Too many items" in outcome["error"]
    assert "<" not in outcome["error"]  # no parser state or grammar dump in a message
    done = type(checker)(checker.req, frozenset({PROBE_EOS}), checker.tokenizer, None)
    assert done.outcome() == {"finish_reason": "length"}  # a free request: its finish reason, as before


@pytest.mark.unit
def test_a_guide_failed_completion_is_an_error_reply_logged_and_counted(caplog):
    entry = Entry(bucket=32, entry_id="1-0", fields={b"id": b"j"})
    acc = Accepted(entry, Request(id="j", prompt=[1], reply_key="inbox"), GenRequest(id="j", prompt=[1], bucket=32),
                   0.0, None)
    failed = Completion(id="j", token_ids=[97], text="a", finish_reason="", started_at=0.0, first_token_at=0.0,
                        batch_size=1, error="llguidance gave up", error_code=GUIDE_FAILED)
    caplog.set_level(logging.WARNING)
    reply = completion_reply(failed, acc, 1.0, "w")
    assert reply.message == Error("j", GUIDE_FAILED, "llguidance gave up")
    assert any("j" in r.getMessage() and "llguidance gave up" in r.getMessage() for r in caplog.records)
    ledger = Ledger()
    ledger.replied([reply])
    assert ledger.outcomes[GUIDE_FAILED] == 1 and ledger["errors"] == 1


@pytest.mark.unit
def test_a_guide_failed_reply_is_a_400_naming_the_guide_at_the_gateway():
    err = api_error(JobFailed("j", GUIDE_FAILED, "structured output failed after 12 token(s)"), "guided_grammar")
    assert (err.status, err.type, err.code, err.param) == (400, "invalid_request_error", GUIDE_FAILED,
                                                          "guided_grammar")
    assert api_error(JobFailed("j", "engine_error", "boom"), "guided_grammar").status == 500  # not the guide's


@pytest.mark.unit
def test_a_result_reports_what_the_engine_did():
    entry = Entry(bucket=32, entry_id="1-0", fields={b"id": b"j"}, priority="background")
    acc = Accepted(entry, Request(id="j", prompt=[1] * 40, reply_key="inbox"),
                   GenRequest(id="j", prompt=[1] * 40, bucket=64), 0.0, None)
    ok = Completion(id="j", token_ids=[5], text="x", finish_reason="length", started_at=0.0, first_token_at=0.0,
                    batch_size=1, extra={"cached_tokens": 32, "preemptions": 2, "resumed_cached_tokens": 16})
    reply = completion_reply(ok, acc, 1.0, "w")
    assert isinstance(reply.message, Result)
    assert reply.message.extra == {"bucket": 32, "cached_tokens": 32, "preemptions": 2, "resumed_cached_tokens": 16}
    plain = completion_reply(Completion(id="j", token_ids=[5], text="x", finish_reason="length", started_at=0.0,
                                        first_token_at=0.0, batch_size=1), acc, 1.0, "w")
    assert plain.message.extra == {"bucket": 32, "cached_tokens": 0, "preemptions": 0}  # hf: nothing cached
    ledger = Ledger()
    ledger.replied([reply, plain])
    assert ledger.cached_tokens == {"interactive": 0, "background": 32}
    assert ledger.preemptions == {"interactive": 0, "background": 2}
