"""The OpenAI-compatible gateway against a real Redis and a real worker: the official ``openai`` client
(streamed and not), OpenAI error bodies and statuses (401, 400, 404, 429, 503, 504), a client that goes
away cancels its job, docs/GATEWAY.md's gateway example, and the gateway's imports (no torch, no sync Redis).

The load and cancellation tests (200 streams, KV blocks freed) are in tests/test_gateway_load.py."""

from __future__ import annotations

import ast
import asyncio
import json
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import redis

from batchfleet.common.keys import Keys
from tests.helpers.gateway import joined_text, stream_events

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test-0123456789"
JSON = {"content-type": "application/json"}


def error_of(resp: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response that must have ``status``."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_openai_client_streamed_equals_whole(start_worker, start_gateway):
    start_worker(engine="native", mode="continuous", max_wait_ms=10, kv_cache_gb=0.02)
    gw = start_gateway(api_keys=(KEY,))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 1234}):
        whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, **sampling)
        chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, stream=True,
                                                stream_options={"include_usage": True}, **sampling))
        choice = whole.choices[0]
        assert choice.finish_reason in ("stop", "length") and whole.object == "text_completion"
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text, sampling
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        # the same usage, but for the prompt tokens the prefix cache supplied: the stream ran the prompt again
        counts = {"prompt_tokens_details"}
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(exclude=counts) == whole.usage.model_dump(
            exclude=counts), (chunks[-1], whole.usage)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, chunks[-1].usage
        assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens >= 1
        assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
        assert whole.model_extra["batchfleet"]["batch_size"] >= 1

        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, **sampling)
        chat_chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=24, stream=True,
                                                          stream_options={"include_usage": True}, **sampling))
        assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
        streamed = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
        assert streamed == chat.choices[0].message.content, sampling
        assert chat_chunks[0].choices[0].delta.role == "assistant"
        assert chat_chunks[-1].usage.model_dump(exclude=counts) == chat.usage.model_dump(exclude=counts)
        assert chat_chunks[-1].usage.prompt_tokens_details.cached_tokens > 0 and chat.usage.completion_tokens >= 1
    # the same seed twice gives the same sample; another seed (almost surely) another one
    again = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0.9, seed=1234)
    assert again.choices[0].text == whole.choices[0].text


def test_auth_and_invalid_requests(start_worker, start_gateway):
    start_worker(max_wait_ms=10)
    gw = start_gateway(api_keys=("key-one-12345", KEY))
    http = httpx.Client(base_url=gw.url, timeout=60)
    body = {"prompt": "Hello", "max_tokens": 4}
    assert http.get("/health").json()["workers"] == 1  # health needs no key
    assert error_of(http.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
    for auth in ("Bearer wrong-key-123", f"Basic {KEY}", "Bearer", KEY):
        assert error_of(http.post("/v1/completions", json=body, headers={"Authorization": auth}), 401)
    error_of(http.get("/v1/models"), 401)
    http.headers["Authorization"] = f"Bearer {KEY}"
    ok = http.post("/v1/completions", json=body)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1, ok.text

    # the test worker: buckets up to 256 tokens, max_seq_len 512
    long_prompt = {"prompt": [1] + [20] * 599, "max_tokens": 4}
    assert error_of(http.post("/v1/completions", json=long_prompt), 400)["code"] == "context_length_exceeded"
    too_many = {"prompt": [1] + [20] * 19, "max_tokens": 500}
    assert error_of(http.post("/v1/completions", json=too_many), 400)["code"] == "context_length_exceeded"
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({**body, "n": 0}, "n"), ({**body, "temperature": 3}, "temperature"), ({**body, "max_tokens": 0}, "max_tokens"),
        ({**body, "prompt": ["a", "b"]}, "prompt"), ({**body, "prompt": ""}, "prompt"), ({"max_tokens": 4}, "prompt"),
        ({**body, "logprobs": 21}, "logprobs"), ({**body, "stop": 3}, "stop"), ({**body, "stream": "yes"}, "stream"),
        ({**body, "seed": -1}, None), ({**body, "prompt": [1, 10**9]}, None),
        ({**body, "echo": True, "logprobs": 1}, "echo"),
    ]
    for bad, param in cases:
        err = error_of(http.post("/v1/completions", json=bad), 400)
        assert err["type"] == "invalid_request_error" and (param is None or err["param"] == param), (bad, err)
    for bad, param in [({"messages": []}, "messages"), ({"messages": [{"role": "tool", "content": "x"}]},
                                                                 "messages.0.tool_call_id"),
                       ({**chat, "tools": [{"type": "function"}]}, "tools"), ({**chat, "n": 0}, "n")]:
        assert error_of(http.post("/v1/chat/completions", json=bad), 400)["param"] == param, bad
    assert error_of(http.post("/v1/completions", content=b"{not json", headers=JSON), 400)
    for media in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
        refused = error_of(http.post("/v1/completions", content=json.dumps(body).encode(), headers=media), 415)
        assert refused["code"] == "unsupported_media_type" and "application/json" in refused["message"]
    for media in ("application/json; charset=utf-8", "Application/JSON"):  # parameters and case: as HTTP says
        resp = http.post("/v1/completions", content=json.dumps(body).encode(), headers={"content-type": media})
        assert resp.status_code == 200, resp.text
    assert error_of(http.post("/v1/completions", json=[1, 2]), 400)
    assert error_of(http.post("/v1/completions", json={**body, "model": "gpt-4o"}), 404)["code"] == "model_not_found"
    unknown = error_of(http.get("/v1/nothing-here"), 404)["message"]  # names what is served, as OpenAI's 404
    assert "Invalid URL (GET /v1/nothing-here)" in unknown and "POST /v1/chat/completions" in unknown
    error_of(http.get("/v1/completions"), 405)


def test_no_fleet_is_503(start_gateway):
    http = httpx.Client(base_url=start_gateway().url, timeout=30)
    err = error_of(http.post("/v1/completions", json={"prompt": "Hello"}), 503)
    assert err["code"] in ("fleet_unavailable", "no_workers")
    error_of(http.get("/v1/models"), 503)
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["redis"] is True and health.json()["workers"] == 0


def test_queue_full_is_429_and_a_gone_client_cancels_its_job(start_worker, start_gateway, redis_url, namespace):
    # static batching (max_wait_ms=inf) with batches of 8: the worker holds what it reads and never runs it,
    # so two requests fill a queue of 2
    start_worker(max_wait_ms=float("inf"), max_batch_size=8, max_queue_len=2)
    gw = start_gateway()
    r, keys = redis.Redis.from_url(redis_url), Keys(namespace)
    body = {"prompt": "Hello", "max_tokens": 4, "timeout": 60}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            waiting = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(2)]
            while sum(r.xlen(keys.stream(b)) for b in (32, 64, 128, 256)) < 2:
                await asyncio.sleep(0.02)
            resp = await http.post("/v1/completions", json=body)
            err = error_of(resp, 429)
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error" and resp.headers["retry-after"]
            for task in waiting:  # the clients give up: their connections close
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while len(list(r.scan_iter(match=keys.cancel("*")))) < 2:
        assert time.monotonic() < deadline, "a request whose client left was not cancelled"
        time.sleep(0.02)
    while sum(r.xlen(keys.stream(b)) for b in (32, 64, 128, 256)):  # the worker dropped both (answered cancelled)
        assert time.monotonic() < deadline, "cancelled jobs still queued"
        time.sleep(0.02)


def test_deadline_is_504_whole_or_as_a_stream_error(start_worker, start_gateway):
    start_worker(max_wait_ms=float("inf"), max_batch_size=8)  # nothing ever runs: every deadline passes
    gw = start_gateway(request_timeout_s=30)
    body = {"prompt": "Hello", "max_tokens": 4, "timeout": 0.5}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        t0 = time.monotonic()
        err = error_of(http.post("/v1/completions", json=body), 504)
        assert err["code"] in ("timeout", "deadline_exceeded") and time.monotonic() - t0 < 5

    async def streamed() -> list:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
            return await stream_events(http, "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "hi"}], "timeout": 0.5})

    events = asyncio.run(streamed())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] in ("timeout", "deadline_exceeded"), events
    assert joined_text(events) == ""


def readme_gateway_lines() -> list[str]:
    text = (ROOT / "docs" / "GATEWAY.md").read_text()
    (block,) = re.findall(r"^Gateway:\s*\n```bash\n(.*?)^```", text, flags=re.S | re.M)
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_gateway_example_runs(start_worker, redis_url, namespace, tmp_path):
    """docs/GATEWAY.md's gateway block as written, on another port: `batchfleet serve` (a subprocess) + curl."""
    start_worker(max_wait_ms=10)
    serve, *curls = readme_gateway_lines()
    argv = shlex.split(serve, comments=True)
    assert argv[:2] == ["batchfleet", "serve"] and curls and all(c.startswith("curl ") for c in curls)
    port = free_port()
    argv[argv.index("--port") + 1] = str(port)
    env = {"PATH": "/usr/bin:/bin", "BATCHFLEET_REDIS_URL": redis_url, "BATCHFLEET_NAMESPACE": namespace}
    proc = subprocess.Popen([sys.executable, "-m", "batchfleet.common.cli", *argv[1:]], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "batchfleet serve did not come up"
            time.sleep(0.1)
        for line in curls:
            args = shlex.split(line.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), comments=True)
            out = subprocess.run(args, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, (line, out.stderr)
            if '"stream": true' in line:
                assert out.stdout.rstrip().endswith("data: [DONE]"), out.stdout
            else:
                assert json.loads(out.stdout)["choices"][0]["finish_reason"] in ("stop", "length"), out.stdout
    finally:
        proc.terminate()
        proc.wait(30)


def test_gateway_holds_no_model_and_no_sync_redis():
    """The app imports neither torch nor the worker, and no synchronous Redis client (every Redis call is
    the AsyncClient's, so no handler can block the event loop on Redis; the dashboard's status reads run
    in a worker thread, producer/ops/dashboard.py)."""
    for path in (ROOT / "gateway").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] != "redis" or name.startswith("redis.asyncio"), (path, name)
                assert not name.startswith(("batchfleet.worker", "torch", "batchfleet.producer.client")), (path, name)
    code = ("import sys, batchfleet.gateway.app, batchfleet.gateway.cli.serve; "
            "assert 'torch' not in sys.modules and 'batchfleet.worker' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")
