"""The routes vLLM's server has beside OpenAI's (issue 58, item 1), against a real Redis, worker and gateway:
``/tokenize`` and ``/detokenize`` (vLLM's shapes, counting what the completion routes run), ``/version``,
``/metrics`` on the API port (behind the operator key, parsed with prometheus_client's text parser, the same
registry as ``--metrics-port``), completions' ``echo`` with the openai client (whole, streamed, n, token ids,
a batch line), ``/v1/models/{id}`` with ``client.models.retrieve``, and docs/GATEWAY.md's curl lines."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from batchfleet.gateway.metrics import serve_gateway_metrics
from tests.helpers.batches import bodies_of, run_batch

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-0123456789"
OPERATOR = "op-test-0123456789"
MAX_MODEL_LEN = 512  # the test worker's max_seq_len (tests/conftest.py TEST_WORKER)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_of(resp: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response that must have ``status``."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_tokenize_and_detokenize_count_what_the_completion_routes_run(start_worker, start_gateway, tiny_model_dir):
    start_worker(max_wait_ms=5)
    gw = start_gateway(api_keys=(KEY,), operator_keys=(OPERATOR,))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    tokenizer = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = "Hello world, once more"
    ids = tokenizer.encode(text).ids  # the tokenizer's special tokens: <s> first
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = "<|system|>\nBe brief.\n<|user|>\nHi there\n"  # the tiny model's template, which writes no BOS
    with httpx.Client(base_url=gw.url, headers=auth(KEY), timeout=60) as http:
        out = http.post("/tokenize", json={"model": model, "prompt": text}).json()
        assert out == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
        assert out["count"] == client.completions.create(model=model, prompt=text, max_tokens=1).usage.prompt_tokens
        bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
        assert bare.json()["tokens"] == ids[1:] and ids[0] == tokenizer.token_to_id("<s>"), bare.text
        assert bare.json()["token_strs"] == [tokenizer.id_to_token(i) for i in ids[1:]]
        # vLLM's detokenize keeps special tokens: the text of exactly these tokens
        assert http.post("/detokenize", json={"model": model, "tokens": ids}).json() == {"prompt": "<s>" + text}
        assert http.post("/detokenize", json={"tokens": ids[1:]}).json() == {"prompt": text}
        assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}

        # chat messages: the ids the chat route runs (its template, its generation prompt, its BOS rule)
        chat = http.post("/tokenize", json={"model": model, "messages": messages}).json()
        usage = client.chat.completions.create(model=model, messages=messages, max_tokens=1).usage
        assert chat["count"] == usage.prompt_tokens == len(chat["tokens"])
        assert chat["tokens"] == tokenizer.encode(rendered + "<|assistant|>\n").ids
        turns = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                             "add_special_tokens": False}).json()
        assert turns["tokens"] == tokenizer.encode(rendered, add_special_tokens=False).ids
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        assert http.post("/tokenize", json={"messages": messages, "tools": [tool]}).status_code == 200

        cases = [  # (path, body, the param the 400 names)
            ("/tokenize", {"prompt": text, "messages": messages}, "prompt"), ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": text, "frob": 1}, "frob"),
            ("/tokenize", {"prompt": text, "add_special_tokens": "no"}, "add_special_tokens"),
            ("/tokenize", {"messages": messages, "continue_final_message": True}, "continue_final_message"),
            ("/tokenize", {"messages": messages, "chat_template": "{{ messages }}"}, "chat_template"),
            ("/tokenize", {"messages": messages, "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
            ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
            ("/tokenize", {"messages": []}, "messages"),
            ("/tokenize", {"messages": messages, "tools": [{"type": "function"}]}, "tools"),
            ("/detokenize", {"tokens": [1, 320]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
            ("/detokenize", {"tokens": [2**70]}, "tokens"), ("/detokenize", {"tokens": "abc"}, "tokens"),
            ("/detokenize", {}, "tokens"),
        ]
        for path, body, param in cases:
            err = error_of(http.post(path, json=body), 400)
            assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
        # past max_model_len tokens: refused, whether the text is tokenized whole or a prefix at a time
        for long_text in ("ab" * 1000, "word " * 20_000):
            err = error_of(http.post("/tokenize", json={"prompt": long_text}), 400)
            assert err["param"] == "prompt" and err["code"] == "context_length_exceeded", err
            assert str(MAX_MODEL_LEN) in err["message"]
        err = error_of(http.post("/tokenize", json={"messages": [{"role": "user", "content": "ab" * 1000}]}), 400)
        assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
        for path, body in (("/tokenize", {"model": "gpt-4o", "prompt": "x"}), ("/detokenize", {"model": "gpt-4o",
                                                                                              "tokens": [1]})):
            assert error_of(http.post(path, json=body), 404)["code"] == "model_not_found"
        assert error_of(http.post("/tokenize", content=b"x", headers={"content-type": "text/plain"}), 415)
        # behind the API key: none is a 401, a read-only operator key a 403
        assert error_of(http.post("/tokenize", json={"prompt": "x"}, headers=auth("wrong-key-123")), 401)
        assert error_of(http.post("/detokenize", json={"tokens": [1]}, headers=auth(OPERATOR)), 403)


def scrape(http: httpx.Client, key: str, until: str) -> str:
    """The API port's /metrics, read again until it holds ``until`` (a request is counted once its last byte
    is sent: its client may have read it just before)."""
    deadline = time.monotonic() + 30
    while True:
        resp = http.get("/metrics", headers=auth(key))
        assert resp.status_code == 200, resp.text
        if until in resp.text or time.monotonic() > deadline:
            return resp.text
        time.sleep(0.05)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, through prometheus_client's own parser."""
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_version_and_metrics_on_the_api_port(start_worker, start_gateway):
    start_worker(max_wait_ms=5)
    gw = start_gateway(api_keys=(KEY,), operator_keys=(OPERATOR,))
    counted = 'route="/v1/completions",status="200"'
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        assert http.get("/version").json() == {"version": version("batchfleet")}  # no key, as vLLM's and /health
        resp = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=auth(KEY))
        assert resp.status_code == 200, resp.text
        # the fleet's state, as /dashboard/data: the operator key where one is set
        assert error_of(http.get("/metrics"), 401)["code"] == "invalid_api_key"
        assert error_of(http.get("/metrics", headers=auth(KEY)), 403)["code"] == "operator_key_required"
        text = scrape(http, OPERATOR, counted)
        assert http.get("/metrics", headers=auth(OPERATOR)).headers["content-type"].startswith("text/plain")
    got = samples(text)
    post = frozenset({"route": "/v1/completions", "method": "POST", "status": "200"}.items())
    assert got[("batchfleet_gateway_requests_total", post)] == 1
    assert got[("batchfleet_workers_live", frozenset())] == 1  # the fleet's queue gauges, read from Redis
    assert any(name == "batchfleet_queue_depth" for name, _ in got)
    assert any(name == "batchfleet_gateway_request_duration_seconds_bucket" for name, _ in got)
    # --metrics-port serves the same registry, without a key (its address decides who reaches it)
    server = serve_gateway_metrics(gw.app.state.metrics, 0)
    try:
        on_port = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=30).text
    finally:
        server.close()
    assert {name for name, _ in samples(on_port)} == {name for name, _ in got}

    # no operator key: the API key sees /metrics; no key at all: anyone does
    keyed, open_ = start_gateway(api_keys=(KEY,)), start_gateway()
    with httpx.Client(base_url=keyed.url, timeout=60) as http:
        assert error_of(http.get("/metrics"), 401)
        assert "batchfleet_workers_live 1.0" in scrape(http, KEY, "batchfleet_workers_live 1.0")
    with httpx.Client(base_url=open_.url, timeout=60) as http:
        assert "batchfleet_gateway_requests_in_progress" in http.get("/metrics").text


def test_completions_echo_starts_each_text_with_the_prompt(start_worker, start_gateway, tmp_path):
    start_worker(max_wait_ms=5)
    gw = start_gateway(files_dir=str(tmp_path / "files"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    prompt = "Once upon a time"
    greedy = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    plain = client.completions.create(**greedy)
    echoed = client.completions.create(**greedy, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text, echoed.choices[0].text
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (plain.usage.prompt_tokens,
                                                                            plain.usage.completion_tokens)
    chunks = [c for c in client.completions.create(**greedy, echo=True, stream=True) if c.choices]
    assert chunks[0].choices[0].text == prompt  # as vLLM's: the prompt first
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    several = client.completions.create(**{**greedy, "temperature": 0.9}, seed=7, n=2, echo=True)
    assert len(several.choices) == 2 and all(c.text.startswith(prompt) for c in several.choices)
    by_ids = client.completions.create(model=model, prompt=[1, 76, 105, 112, 112, 115], max_tokens=4, echo=True)
    assert by_ids.choices[0].text.startswith("<s>Hello"), by_ids.choices[0].text  # decoded, special tokens kept
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**greedy, echo=True, logprobs=1)  # the prompt's logprobs are not computed
    assert info.value.body["param"] == "echo" and "logprobs" in info.value.body["message"]
    assert client.completions.create(**greedy, echo=False, logprobs=1).choices[0].logprobs is not None
    with pytest.raises(openai.BadRequestError) as info:  # chat's echo (vLLM's extension): false only
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={"echo": True})
    assert info.value.body["param"] == "echo"
    batch = run_batch(client, "/v1/completions", {"e": {**greedy, "echo": True}})
    assert batch.status == "completed" and batch.request_counts.completed == 1, batch
    assert bodies_of(client, batch.output_file_id)["e"]["choices"][0]["text"] == echoed.choices[0].text


def test_models_retrieve_answers_openai_model_objects(start_worker, start_gateway):
    start_worker(max_wait_ms=5)
    gw = start_gateway(api_keys=(KEY,))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    (listed,) = client.models.list().data
    got = client.models.retrieve(listed.id)
    assert (got.id, got.object, got.owned_by, got.created) == (listed.id, "model", "batchfleet", 0)
    assert got.model_extra["max_model_len"] == MAX_MODEL_LEN and got.model_extra["root"] == listed.id
    assert got.model_extra["parent"] is None and got.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body == {"message": info.value.body["message"], "type": "invalid_request_error",
                               "param": None, "code": "model_not_found"}
    assert "no-such-model" in info.value.body["message"]
    assert error_of(httpx.get(gw.url + "/v1/models/no-such-model", timeout=30), 401)  # the key first


def doc_curl_lines() -> list[str]:
    text = (ROOT / "docs" / "GATEWAY.md").read_text()
    (block,) = re.findall(r"^vLLM's endpoints:\s*\n```bash\n(.*?)^```", text, flags=re.S | re.M)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_gateway_doc_vllm_endpoint_lines_run(start_worker, start_gateway):
    """docs/GATEWAY.md's curl lines for vLLM's endpoints, as written, against a gateway with the doc's key."""
    start_worker(max_wait_ms=5)
    key = re.search(r"--api-key (\S+)", (ROOT / "docs" / "GATEWAY.md").read_text()).group(1)
    gw = start_gateway(api_keys=(key,))
    lines = doc_curl_lines()
    assert {re.search(r"127\.0\.0\.1:8000(/\w+)", line).group(1) for line in lines} == {
        "/tokenize", "/detokenize", "/version", "/metrics"}
    for line in lines:
        args = shlex.split(line.replace("http://127.0.0.1:8000", gw.url), comments=True)
        out = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (line, out.stderr)
        if "/metrics" in line:
            assert samples(out.stdout)[("batchfleet_workers_live", frozenset())] == 1, out.stdout
            continue
        answer = json.loads(out.stdout)
        assert "error" not in answer, (line, answer)
        if "/tokenize" in line:
            assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == MAX_MODEL_LEN
            assert (answer["token_strs"] is not None) == ("return_token_strs" in line)
        elif "/detokenize" in line:
            assert answer["prompt"].startswith("<s>")
        else:
            assert answer == {"version": version("batchfleet")}
