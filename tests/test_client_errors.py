"""The client fails fast and clearly: NoWorkers when no worker is alive (or enqueue anyway for fleets
that scale from zero), typed InvalidRequest for bad parameters, timeouts that say how long they waited
and whether any worker is alive; chat messages rendered with the fleet's template."""

from __future__ import annotations

import time

import pytest
import redis

from batchfleet.common.keys import Keys
from batchfleet.common.wire.protocol import FleetInfo, Request
from batchfleet.producer import Ask, Client, FleetUnavailable, InvalidRequest, NoWorkers, PromptTooLong, Timeout
from batchfleet.producer.chat import render
from batchfleet.worker.engine.tokenizer import PRESET_CHAT_TEMPLATE


def _publish_stale_fleet(redis_url: str, keys: Keys, tiny_model_dir) -> None:
    """A fleet description with no live worker behind it (its worker died a moment ago)."""
    info = FleetInfo(model="tiny", tokenizer_json=(tiny_model_dir / "tokenizer.json").read_text(),
                     buckets=(32, 64), max_seq_len=128, max_batch_size=4, vocab_size=320, eos_token_ids=(2,))
    redis.Redis.from_url(redis_url).set(keys.fleet, info.encode(), ex=60)


def test_no_workers_fails_fast_unless_told_to_enqueue_anyway(redis_url, namespace, tiny_model_dir):
    keys = Keys(namespace)
    with Client(redis_url, namespace) as client:
        with pytest.raises(NoWorkers, match="start a worker"):  # nothing published at all
            client.submit("hello")
    _publish_stale_fleet(redis_url, keys, tiny_model_dir)
    r = redis.Redis.from_url(redis_url)
    with Client(redis_url, namespace) as client:
        t0 = time.monotonic()
        with pytest.raises(NoWorkers, match="no live worker") as exc:
            client.generate("hello", max_new_tokens=2)
        assert time.monotonic() - t0 < 1 and isinstance(exc.value, FleetUnavailable)
        assert r.xlen(keys.stream(32)) == 0
    with Client(redis_url, namespace, require_workers=False) as client:
        job = client.submit("hello", max_new_tokens=2)
        assert [f[b"id"].decode() for _, f in r.xrange(keys.stream(32))] == [job]
        with pytest.raises(Timeout, match=r"within 0.5 s; no live worker"):
            client.result(job, timeout=0.5)
        # an Ask made already (the gateway's) is sent as is: the entry's Request carries its very parameters
        ask = Ask.of({"max_new_tokens": 2, "seed": 9, "guided_regex": "[ab]+", "priority": "background"})
        client.submit("hello", ask=ask)
        ((_, entry),) = r.xrange(keys.stream(32, "background"))
        assert Request.decode(entry[b"p"]).params == ask.params
        with pytest.raises(InvalidRequest, match="not both"):
            client.submit("hello", ask=ask, seed=1)


def test_invalid_parameters_raise_invalid_request_before_sending(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=5)
    with Client(redis_url, namespace) as client:
        for bad in ({"temperature": -1}, {"top_p": 0}, {"max_new_tokens": 0}, {"top_k": -2}, {"seed": -1},
                    {"stop": [""]}, {"max_tokens": 5}, {"max_new_tokens": "3"}):
            with pytest.raises(InvalidRequest) as exc:
                client.submit("hello", **bad)
            assert isinstance(exc.value, ValueError)
        with pytest.raises(InvalidRequest):
            client.submit([1, 2, 10**6])
        with pytest.raises(InvalidRequest, match="job_id"):
            client.submit("hello", job_id="abc\n")
        with pytest.raises(PromptTooLong):
            client.submit("x" * 600)
        with pytest.raises(InvalidRequest, match="role"):
            client.submit([{"role": "wizard", "content": "hi"}])
        res = client.generate("hello", max_new_tokens=2, timeout=30)
        with pytest.raises(Timeout, match=r"within 0.2 s; 1 live worker"):
            client.result("never-submitted", timeout=0.2)
    assert res.completion_tokens == 2


def test_chat_messages_use_the_fleets_template(start_worker, redis_url, namespace):
    start_worker(max_wait_ms=5)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    with Client(redis_url, namespace) as client:
        info = client.fleet().info
        assert info.chat_template == PRESET_CHAT_TEMPLATE
        chat = client.generate(messages, max_new_tokens=6)
        text = client.generate(render(info.chat_template, messages), max_new_tokens=6)
    assert chat.token_ids == text.token_ids and chat.prompt_tokens == text.prompt_tokens
    assert render(PRESET_CHAT_TEMPLATE, messages) == "<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\n"


def test_a_closed_redis_port_is_reported_as_refused():
    """Nothing listens on the port: the Timeout says the connection was refused, not that Redis was slow."""
    from batchfleet.worker.devtools import free_port

    with Client(f"redis://127.0.0.1:{free_port()}/0", "bf-closed") as client:
        with pytest.raises(Timeout) as exc:
            client.generate("hello", max_new_tokens=2, timeout=1)
    assert "connection refused" in str(exc.value) and "did not answer" not in str(exc.value), exc.value


def test_a_too_short_timeout_is_the_requests_deadline_not_redis(redis_url, namespace):
    # 1 us: gone before the client's first Redis call (the fleet lookup) is sent, on any machine; with 1 ms a fast
    # Redis answered the lookup in time and the namespace's missing worker (NoWorkers) came first
    with Client(redis_url, namespace) as client:
        with pytest.raises(Timeout) as exc:
            client.generate("hello", max_new_tokens=2, timeout=1e-6)
    message = str(exc.value)
    assert "deadline passed (timeout 1e-06 s)" in message and "did not answer" not in message, message


@pytest.mark.unit
def test_openai_parameter_names_point_to_the_clients():
    with pytest.raises(InvalidRequest, match=r"max_tokens \(the client's name is max_new_tokens\)"):
        Ask.of({"max_tokens": 5})
    with pytest.raises(InvalidRequest, match=r"unknown generation parameter\(s\): bogus$"):
        Ask.of({"bogus": 1})
