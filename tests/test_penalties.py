"""OpenAI's presence_penalty, frequency_penalty and logit_bias: the one parameter type's bounds (OpenAI's:
penalties in [-2, 2], biases in [-100, 100], at most 300 ids), the sampler's exact effect on hand-made logits
(penalties count the tokens generated so far, never the prompt), both engines honouring them, and the
gateway taking them from the openai client (a logit_bias past the vocabulary is a 400 naming it)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import msgpack
import openai
import pytest

from batchfleet.common.wire.params import MAX_BIASED, ParamError, Params
from batchfleet.common.wire.protocol import Request
from batchfleet.producer import Client, InvalidRequest
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.tokenizer import BYTE_OFFSET, EOS_ID
from tests.test_sampling_extensions import make_eos_model

A, B = BYTE_OFFSET + ord("a"), BYTE_OFFSET + ord("b")


@pytest.fixture(scope="module")
def torch() -> ModuleType:
    import torch

    return torch


@pytest.mark.unit
def test_the_parameter_type_takes_openais_shapes_and_bounds():
    p = Params(logit_bias={"7": 5, "3": -100}, presence_penalty=-2, frequency_penalty=2)
    assert p.logit_bias == ((3, -100.0), (7, 5.0)) and p.presence_penalty == -2.0  # sorted pairs, floats
    assert Params(logit_bias=[[7, 5.0], [3, -100]]) == Params(logit_bias={"3": -100, "7": 5})
    wire = msgpack.unpackb(Request(id="j", prompt=[1], params=p, reply_key="k").encode())
    assert wire["v"] == 5 and wire["logit_bias"] == [[3, -100.0], [7, 5.0]]  # a list: map keys are strings
    assert Request.decode(Request(id="j", prompt=[1], params=p, reply_key="k").encode()).params == p
    for bad in ({"logit_bias": {"x": 1}}, {"logit_bias": {"1": 100.5}}, {"logit_bias": {"-1": 1}},
                {"logit_bias": {"1": True}}, {"logit_bias": [[1, 1], [1, 2]]}, {"logit_bias": {"²": 1}},
                {"logit_bias": {str(i): 1 for i in range(MAX_BIASED + 1)}}, {"presence_penalty": 2.01},
                {"frequency_penalty": -2.5}, {"presence_penalty": float("nan")}):
        with pytest.raises(ParamError) as exc:
            Params(**bad)
        assert exc.value.field == next(iter(bad))


@pytest.mark.unit
def test_workers_answer_a_bias_past_their_vocabulary_invalid_request():
    from batchfleet.common.keys import Keys
    from batchfleet.worker.requests.validate import Accepted, Limits, Rejected, accept
    from batchfleet.worker.transport.base import Entry

    keys = Keys("t")
    inbox = keys.inbox("client0123456789")
    for bias, ok in (({"319": 5}, True), ({"1": 1, "320": 5}, False)):
        payload = Request(id="j", prompt=[1], reply_key=inbox, params=Params(max_new_tokens=2, logit_bias=bias))
        entry = Entry(32, "1-0", {b"id": b"j", b"r": inbox.encode(), b"p": payload.encode()})
        out = accept(entry, keys, Limits(max_seq_len=64, vocab_size=320), now=2.0)
        assert isinstance(out, Accepted) if ok else (isinstance(out, Rejected) and "logit_bias" in out.reason)


def req(**kw) -> GenRequest:
    return GenRequest(id="r", prompt=kw.pop("prompt", [5]), bucket=8, params=Params(**{"max_new_tokens": 8, **kw}))


def pick(torch, logits: list[float], r: GenRequest, output: list[int]) -> int:
    from batchfleet.worker.engine.sampling import StopChecker, sample
    from batchfleet.worker.engine.tokenizer import byte_level_tokenizer

    checker = StopChecker(r, frozenset({EOS_ID}), byte_level_tokenizer())
    checker.tokens.extend(output)
    return int(sample(torch.tensor([logits]), [r], [None], [checker])[0])


def test_penalties_count_the_output_so_far_and_bias_shifts_logits(torch):
    base = [0.0, 0.0, 0.0, 0.0, 3.0, 2.5, 1.0]
    assert pick(torch, base, req(frequency_penalty=0.3), [4]) == 4  # 3 - 0.3 > 2.5
    assert pick(torch, base, req(frequency_penalty=0.3), [4, 4]) == 5  # 3 - 0.6 < 2.5: counted per occurrence
    assert pick(torch, base, req(presence_penalty=0.3), [4, 4, 4]) == 4  # once, however often: 2.7 > 2.5
    assert pick(torch, base, req(presence_penalty=0.6), [4]) == 5
    assert pick(torch, base, req(prompt=[4, 4, 4], frequency_penalty=2.0), []) == 4  # the prompt is not counted
    assert pick(torch, base, req(frequency_penalty=-2.0), [6, 6]) == 6  # negative: repetition encouraged
    assert pick(torch, base, req(logit_bias={"6": 2.5}), []) == 6 and pick(torch, base, req(logit_bias={"4": -100}),
                                                                         []) == 5
    assert pick(torch, base, req(logit_bias={"4": -1.0}, presence_penalty=0.1), [5]) == 5  # 2 < 2.4


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_both_engines_honour_bias_and_penalties(engine, start_worker, redis_url, namespace, cache_dir: Path):
    """On a checkpoint whose logits are EOS 1, every other token 0: the biases decide, the penalties change
    the order in which a (bias 100) and b (bias 99) come."""
    start_worker(engine=engine, model_dir=make_eos_model(cache_dir / "eos-model"), max_wait_ms=5, kv_cache_gb=0.02)
    bias = {str(A): 100, str(B): 99}
    with Client(redis_url, namespace) as client:
        def text(**kw) -> str:
            return client.generate("hi", max_new_tokens=6, timeout=60, **kw).text
        assert text(logit_bias=bias) == "aaaaaa"
        assert text(logit_bias=bias, frequency_penalty=2.0) == "ababab"  # a: 100 - 2 n_a, b: 99 - 2 n_b
        assert text(logit_bias=bias, presence_penalty=2.0) == "abaaaa"  # each only once: 98 > 97
        assert text(logit_bias={str(EOS_ID): -100, str(B): 1}) == "bbbbbb"
        with pytest.raises(InvalidRequest, match="logit_bias"):
            client.generate("hi", max_new_tokens=2, logit_bias={"320": 1}, timeout=60)  # the vocabulary is 320


def test_the_gateway_takes_them_from_the_openai_client(start_worker, start_gateway, cache_dir: Path):
    start_worker(model_dir=make_eos_model(cache_dir / "eos-model"), max_wait_ms=5)
    gw = start_gateway(model_alias_any=True)
    with openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0) as client:
        answer = client.completions.create(model="m", prompt="hi", max_tokens=4, temperature=0,
                                           logit_bias={str(A): 100, str(B): 99}, frequency_penalty=2.0)
        assert answer.choices[0].text == "abab"
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi", "name": "ann"}],
                                              max_completion_tokens=3, logit_bias={str(B): 100}, presence_penalty=-2)
        assert chat.choices[0].message.content == "bbb"
        for bad, param in (({"logit_bias": {"320": 1}}, "logit_bias"), ({"presence_penalty": 2.5}, "presence_penalty"),
                           ({"logit_bias": {"a": 1}}, "logit_bias"), ({"max_tokens": 3, "max_completion_tokens": 4},
                                                                     "max_completion_tokens")):
            with pytest.raises(openai.BadRequestError) as exc:
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], **bad)
            assert exc.value.body["param"] == param
        with pytest.raises(openai.NotFoundError) as exc:
            client.post("/embeddingz", cast_to=object, body={})
        assert "POST /v1/chat/completions" in exc.value.body["message"] and exc.value.body["type"]
