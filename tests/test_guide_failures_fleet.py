"""Guides that cannot be followed, against a real gateway and worker (issue 30 item 2): the guides
llguidance gives up on at once are 400s naming the field before anything is queued; one that fails while
generating is answered ``guide_failed`` (the Python client raises JobFailed, the gateway answers a 400 naming
the guide, streamed or not, and so does a Batch API line), logged by the worker and counted in its
outcomes; never a 200."""

from __future__ import annotations

import asyncio
import io
import logging

import httpx
import openai
import pytest

from batchfleet.common.errors import GUIDE_FAILED, JobFailed
from batchfleet.producer import Client
from batchfleet.worker.devtools import free_port
from tests.helpers.gateway import stream_events
from tests.test_guide_checks import FAILS_LATER, GIVEN_UP
from tests.test_metrics import one, scrape
from tests.test_openai_batches import batch_line, lines_of, wait_until

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0}
COMPLETION = {"prompt": "Hi", "max_tokens": 40, "temperature": 0}


def test_guides_given_up_at_once_are_400s_before_queueing(start_worker, start_gateway):
    w = start_worker(max_wait_ms=5)
    gw = start_gateway()
    with httpx.Client(base_url=gw.url, timeout=60) as http:
        for option, value, why in GIVEN_UP:
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                resp = http.post(path, json={**body, option: value})
                assert resp.status_code == 400, (option, value, resp.text)
                err = resp.json()["error"]
                assert (err["param"], err["type"]) == (option, "invalid_request_error") and why in err["message"]
        assert http.post("/v1/completions", json={**COMPLETION, "guided_regex": "[ab]{3}"}).status_code == 200
    assert w.loop.ledger["batched_requests"] == 1  # only the good one reached the worker


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_a_guide_failing_while_generating_is_an_error_never_a_200(start_worker, start_gateway, redis_url,
                                                                  namespace, engine, caplog):
    port = free_port()
    kw = {"engine": "native", "mode": "continuous", "kv_cache_gb": 0.02} if engine == "native" else {}
    w = start_worker(max_wait_ms=5, metrics_port=port, **kw)
    gw = start_gateway()
    caplog.set_level(logging.WARNING)
    with Client(redis_url, namespace) as client:
        with pytest.raises(JobFailed) as exc:
            client.generate("Hi", max_new_tokens=40, guided_grammar=FAILS_LATER, timeout=60)
        assert exc.value.code == GUIDE_FAILED and "llguidance gave up on the grammar" in exc.value.message

    async def over_http() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
            answers = []
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                resp = await http.post(path, json={**body, "guided_grammar": FAILS_LATER})
                answers.append((resp.status_code, resp.json()))
            nested = {**CHAT, "structured_outputs": {"grammar": FAILS_LATER}, "n": 2}
            resp = await http.post("/v1/chat/completions", json=nested)
            answers.append((resp.status_code, resp.json()))
            events = await stream_events(http, "/v1/chat/completions", {**CHAT, "guided_grammar": FAILS_LATER})
            return answers, events

    answers, events = asyncio.run(over_http())
    for (status, body), param in zip(answers, ("guided_grammar", "guided_grammar", "structured_outputs")):
        assert status == 400, body
        assert (body["error"]["code"], body["error"]["param"]) == (GUIDE_FAILED, param), body
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert events[-1] == "[DONE]" and len(errors) == 1, events
    assert (errors[0]["error"]["code"], errors[0]["error"]["param"]) == (GUIDE_FAILED, "guided_grammar")
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"] for e in events)
    # 1 client + 2 whole + at least 1 of the n = 2 (the other may be cancelled first) + 1 streamed
    assert w.loop.ledger.outcomes[GUIDE_FAILED] >= 5
    assert one(scrape(port), "batchfleet_requests_total", outcome=GUIDE_FAILED) >= 5
    logged = [r for r in caplog.records if "failed its structured output" in r.getMessage()]
    assert len(logged) >= 5 and all(r.levelno == logging.WARNING for r in logged)


def test_a_batch_line_whose_guide_fails_is_a_400_naming_it(start_worker, start_gateway, tmp_path):
    start_worker(max_wait_ms=5)
    gw = start_gateway(files_dir=str(tmp_path / "files"), served_model_names=("m",))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    text = (batch_line("late", {**CHAT, "model": "m", "guided_grammar": FAILS_LATER})
            + batch_line("early", {**CHAT, "model": "m", "guided_regex": "a{500000}"})
            + batch_line("fine", {**CHAT, "model": "m", "guided_regex": "[ab]{3}"}))
    uploaded = client.files.create(file=("b.jsonl", io.BytesIO(text.encode())), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = wait_until(client, batch.id, ("completed", "failed"))
    lines = {ln["custom_id"]: ln for ln in lines_of(client, done.output_file_id) + lines_of(client, done.error_file_id)}
    assert lines["fine"]["response"]["status_code"] == 200
    for custom_id, param, code in (("late", "guided_grammar", GUIDE_FAILED), ("early", "guided_regex", None)):
        response = lines[custom_id]["response"]
        assert response["status_code"] == 400, response
        error = response["body"]["error"]
        assert error["param"] == param and (code is None or error["code"] == code), error
