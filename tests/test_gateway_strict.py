"""The gateway is strict (gateway/strict.py, docs/GATEWAY.md's table): unknown fields, unsupported values and coerced
types are a 400 naming the field; the neutral values that the openai client, LangChain, LiteLLM and
`vllm bench serve` send are accepted; vLLM's sampling extensions reach the fleet. Plus GET /v1/models/{id},
several served names, the HTTP metrics, and a too-large max_tokens named as such."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import generate_latest

from batchfleet.gateway.openai.chat.request import ChatCompletionRequest, CompletionRequest
from batchfleet.gateway.strict import HONOURED, NEUTRAL_CHAT, NEUTRAL_COMPLETIONS, NEUTRAL_MESSAGE
from tests.helpers.gateway import parse_events

ROOT = Path(__file__).resolve().parents[1]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "Hello", "max_tokens": 4}

REFUSED = [  # (endpoint, body additions, the param the 400 names)
    ("completions", {"temperature": "0.5"}, "temperature"), ("completions", {"temperature": True}, "temperature"),
    ("completions", {"max_tokens": 4.0}, "max_tokens"), ("completions", {"n": True}, "n"),
    ("completions", {"n": 33}, "n"), ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"bogus": 1}, "bogus"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"), ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"logit_bias": {"5": "1"}}, "logit_bias"), ("completions", {"frequency_penalty": "0"},
                                                                 "frequency_penalty"),
    ("completions", {"top_k": 2**64}, "top_k"), ("completions", {"seed": 2**64}, "seed"),
    ("completions", {"stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ("completions", {"repetition_penalty": "1.5"}, "repetition_penalty"), ("completions", {"min_p": 2}, "min_p"),
    ("completions", {"min_tokens": 9}, "min_tokens"), ("completions", {"ignore_eos": 1}, "ignore_eos"),
    ("completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("completions", {"stop_token_ids": [2]}, "stop_token_ids"), ("completions", {"timeout": "5"}, "timeout"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"), ("chat", {"logprobs": 1}, "logprobs"),
    ("chat", {"tool_choice": "required"}, "tool_choice"), ("chat", {"tools": [{"type": "function"}]}, "tools"),
    ("chat", {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages"),
    ("chat", {"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages.0.refusal"),
    ("chat", {"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages.0.extra"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"), ("chat", {"store": True}, "store"),
]

NEUTRAL = [  # what standard clients send with nothing asked: accepted
    # vllm bench serve, openai-completions backend (--ignore-eos)
    ("completions", {"model": None, "temperature": 0.0, "repetition_penalty": 1.0, "logprobs": None,
                     "ignore_eos": True, "stream": False}),
    # vllm bench serve, openai-chat backend
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "temperature": 0.0,
              "max_completion_tokens": 4, "ignore_eos": True, "stream": False}),
    # LangChain's ChatOpenAI defaults (older versions send n, temperature 0.7, stream false), LiteLLM's passthrough
    ("chat", {"n": 1, "temperature": 0.7, "stream": False, "presence_penalty": 0, "frequency_penalty": 0.0,
              "logit_bias": {}, "user": "u-1", "seed": 3, "stop": ["\n\n"], "tool_choice": "none",
              "parallel_tool_calls": False, "response_format": {"type": "text"}, "logprobs": False,
              "top_logprobs": 0, "top_p": 1, "tools": [], "store": False, "service_tier": "auto"}),
    ("completions", {"n": 1, "best_of": 1, "echo": False, "suffix": "", "logit_bias": {}, "top_k": -1,
                     "min_p": 0.0, "min_tokens": 0, "stop_token_ids": [], "skip_special_tokens": True,
                     "include_stop_str_in_output": False, "stream_options": {"include_usage": False}}),
]


def test_refused_and_neutral_fields_over_raw_http(start_worker, start_gateway):
    start_worker(max_wait_ms=5)
    gw = start_gateway()
    with httpx.Client(base_url=gw.url + "/v1", timeout=60) as http:
        for endpoint, extra, param in REFUSED:
            base = COMPLETION if endpoint == "completions" else CHAT
            path = "/completions" if endpoint == "completions" else "/chat/completions"
            resp = http.post(path, json={**base, **extra})
            assert resp.status_code == 400, (extra, resp.text)
            err = resp.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
            assert param.split(".")[-1] in err["message"] or param == "messages", (extra, err)
        for endpoint, body in NEUTRAL:
            body = {**(COMPLETION if endpoint == "completions" else CHAT), **body}
            body = {k: v for k, v in body.items() if v is not None or k != "model"}
            resp = http.post("/completions" if endpoint == "completions" else "/chat/completions", json=body)
            assert resp.status_code == 200, (body, resp.text)
        # NaN / Infinity are not JSON; a huge exponent is not a finite number
        for raw in (b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "temperature": 1e999}'):
            resp = http.post("/completions", content=raw, headers={"content-type": "application/json"})
            assert resp.status_code == 400, resp.text


def test_the_openai_client_extensions_and_refusals(start_worker, start_gateway):
    start_worker(max_wait_ms=5, engine="native", mode="continuous", kv_cache_gb=0.02)
    gw = start_gateway()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=7,
                                    extra_body={"ignore_eos": True, "min_tokens": 7, "repetition_penalty": 1.2,
                                                "min_p": 0.05, "top_k": 20})
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=out.model, prompt="Hello", max_tokens=4, extra_body={"guided_regex": "(a+"})
    assert info.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=out.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    # too long: max_tokens (or max_completion_tokens) is named, not the prompt (test worker: max_seq_len 512)
    for param in ("max_tokens", "max_completion_tokens"):
        kwargs = {param: 600}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=out.model, messages=[{"role": "user", "content": "hi"}], **kwargs)
        assert info.value.body["param"] == param and info.value.code == "context_length_exceeded", info.value.body
        assert param in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=out.model, prompt=[1] + [20] * 400, max_tokens=4)
    assert info.value.body["param"] == "prompt"


def test_served_names_model_route_and_http_metrics(start_worker, start_gateway):
    start_worker(max_wait_ms=5)
    gw = start_gateway(served_model_names=("alpha", "org/beta"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["alpha", "org/beta"]
    assert client.models.retrieve("org/beta").id == "org/beta"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gamma")
    for name in ("alpha", "org/beta"):  # either name is served; answers report the first (as vLLM)
        assert client.completions.create(model=name, prompt="Hi", max_tokens=2).model == "alpha"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt="Hi", max_tokens=2)
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/nowhere/x1").status_code == 404
        events = parse_events(http.post("/v1/completions", json={**COMPLETION, "stream": True}).text.splitlines())
        assert events[-1] == "[DONE]"
    histogram = 'batchfleet_gateway_request_duration_seconds_bucket{le="+Inf",method="POST",route="/v1/completions"}'
    deadline = time.monotonic() + 10
    while True:  # a request is counted once its last byte is sent: the client may have read it just before
        text = generate_latest(gw.app.state.metrics.registry).decode()
        if f"{histogram} 4.0" in text or time.monotonic() > deadline:
            break
        time.sleep(0.01)

    def count(route: str, method: str, status: int) -> float:
        pattern = (rf'batchfleet_gateway_requests_total\{{method="{method}",route="{re.escape(route)}",'
                   rf'status="{status}"\}} (\S+)')
        match = re.search(pattern, text)
        return float(match.group(1)) if match else 0.0

    assert count("/v1/completions", "POST", 200) == 3 and count("/v1/completions", "POST", 404) == 1
    assert count("/v1/models/{model_id:path}", "GET", 404) == 1 and count("/v1/models", "GET", 200) == 1
    assert count("/health", "GET", 200) == 1 and count("unmatched", "GET", 404) == 1
    assert f"{histogram} 4.0" in text


def test_readme_strictness_table_lists_every_field():
    """docs/GATEWAY.md's table of strictness rules names every field the schemas know, with its neutral values."""
    doc = (ROOT / "docs" / "GATEWAY.md").read_text()
    section = doc[doc.index("## Strictness"):]
    section = section.split("\n## ", 1)[0]  # up to the next section, or the document's end
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    named = {name for cell in first_cells for name in re.findall(r"`([a-z_.\[\]]+)`", cell)}
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert named == fields | {f"messages[].{f}" for f in NEUTRAL_MESSAGE}, named ^ fields
    assert set(NEUTRAL_COMPLETIONS) | set(NEUTRAL_CHAT) | set(HONOURED) <= fields
