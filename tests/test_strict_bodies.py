"""The gateway's strictness gaps closed (issue 30 item 4), pure: every integer field is bounded (64 bits at
most: past it a 400 naming the field, never an exception), a chat message needs its ``content`` (OpenAI's
rule: null only beside tool_calls, which this gateway does not take), and a JSON body must be sent as JSON
(``Content-Type: application/json``, else a 415 in OpenAI's error shape)."""

from __future__ import annotations

import pytest

from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.chat.request import ChatCompletionRequest, CompletionRequest, request_job
from batchfleet.gateway.strict import check_json_type

pytestmark = pytest.mark.unit
COMPLETION = {"prompt": "hi"}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# where a refusal of an integer's value may point: the field itself, or the field a length is counted in
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens"}


def refusal(chat: bool, body: dict) -> APIError:
    with pytest.raises(APIError) as exc:
        request_job(chat, body, 60, 16)
    return exc.value


def test_priority_is_refused_past_64_bits():
    for chat, base in ((False, COMPLETION), (True, CHAT)):
        for big in (2**63, 2**64, -(2**63) - 1, 10**30):
            err = refusal(chat, {**base, "priority": big})
            assert (err.status, err.param) == (400, "priority"), big
        assert request_job(chat, {**base, "priority": 2**63 - 1}, 60, 16).priority == "background"
        assert request_job(chat, {**base, "priority": -(2**63)}, 60, 16).priority == "interactive"


@pytest.mark.parametrize(("chat", "model"), [(False, CompletionRequest), (True, ChatCompletionRequest)])
def test_every_integer_field_is_bounded(chat, model):
    base = CHAT if chat else COMPLETION
    ints = [name for name, f in model.model_fields.items() if "int" in str(f.annotation).lower()
            and name not in ("prompt", "messages")]
    assert {"priority", "seed", "top_k", "min_tokens", "n", "max_tokens"} <= set(ints)
    for name in ints:
        for big in (2**64, -(2**64), 10**400):
            err = refusal(chat, {**base, name: big})
            assert err.status == 400 and (err.param == name or err.param in LENGTH_FIELDS), (name, big, err.param)


def test_a_chat_message_needs_its_content():
    for role in ("user", "system", "developer", "assistant"):
        for message in ({"role": role}, {"role": role, "content": None}, {"role": role, "content": []},
                        {"role": role, "content": None, "tool_calls": []}):
            body = {"messages": [{"role": "user", "content": "hi"}, message]}
            err = refusal(True, body)
            assert (err.status, err.param) == (400, "messages.1.content"), message
            assert "content is required" in err.message
    for content in ("", [{"type": "text", "text": "hi"}]):  # empty text is text; one part is content
        job = request_job(True, {"messages": [{"role": "user", "content": content}]}, 60, 16)
        assert job.prompt == [{"role": "user", "content": "" if content == "" else "hi"}]


def test_a_body_must_be_sent_as_json():
    for ok in ("application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "application/merge+json"):
        check_json_type(ok)
    for bad in (None, "", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                "application/jsonx", "text/json"):
        with pytest.raises(APIError) as exc:
            check_json_type(bad)
        err = exc.value
        assert (err.status, err.type, err.code) == (415, "invalid_request_error", "unsupported_media_type"), bad
        assert set(err.body()["error"]) == {"message", "type", "param", "code"} and "application/json" in err.message
