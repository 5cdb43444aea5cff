"""vLLM's sampling extensions (ignore_eos, min_tokens, repetition_penalty, min_p): the shared sampler's
exact effect on hand-made logits (unit), the wire's version rule, and both engines honouring them on a real
checkpoint whose greedy answer is always EOS."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import msgpack
import pytest

from batchfleet.common.errors import ProtocolError
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.protocol import Request
from batchfleet.producer import Client, InvalidRequest
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.tokenizer import EOS_ID


@pytest.fixture(scope="module")
def torch() -> ModuleType:
    import torch

    return torch


def req(**kw) -> GenRequest:
    return GenRequest(id="r", prompt=kw.pop("prompt", [5]), bucket=8, params=Params(**{"max_new_tokens": 8, **kw}))


def checker(r: GenRequest, tokens: list[int] = ()):
    from batchfleet.worker.engine.sampling import StopChecker
    from batchfleet.worker.engine.tokenizer import byte_level_tokenizer

    c = StopChecker(r, frozenset({EOS_ID}), byte_level_tokenizer())
    c.tokens.extend(tokens)
    return c


def sample(*args):
    from batchfleet.worker.engine.sampling import sample

    return sample(*args)


def test_min_tokens_masks_eos_until_reached_and_ignore_eos_never_stops(torch):
    logits = torch.zeros(1, 10)
    logits[0, EOS_ID] = 5.0
    logits[0, 7] = 1.0
    r = req(min_tokens=2)
    assert sample(logits, [r], [None], [checker(r, [7])]).tolist() == [7]  # 1 token out: EOS masked
    assert sample(logits, [r], [None], [checker(r, [7, 7])]).tolist() == [EOS_ID]  # 2 out: allowed again
    c = checker(r)
    assert not c.push(EOS_ID) and c.push(EOS_ID) and c.reason == "eos"  # nor does EOS end it before 2
    forever = checker(req(ignore_eos=True, max_new_tokens=3))
    assert [forever.push(EOS_ID) for _ in range(3)] == [False, False, True] and forever.reason == "length"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens(torch):
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 2.0, -1.0, -1.5]])
    r = req(prompt=[5], repetition_penalty=2.0)
    assert sample(logits, [r], [None], [checker(r)]).tolist() == [6]  # 3 / 2 < 2
    r = req(prompt=[8], repetition_penalty=2.0)
    logits = torch.tensor([[-9.0, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0, -2.5, -1.5]])
    assert sample(logits, [r], [None], [checker(r)]).tolist() == [7]  # -1.5 * 2 < -2.5
    r = req(prompt=[1], repetition_penalty=2.0)  # the output counts too
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 2.0, 0.0, 0.0]])
    assert sample(logits, [r], [None], [checker(r, [5])]).tolist() == [6]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(torch):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    r = req(temperature=1.0, min_p=0.25)  # keeps p >= 0.125: tokens 0, 1, 2
    gen = torch.Generator().manual_seed(0)
    drawn = {int(sample(logits, [r], [gen], [checker(r)])[0]) for _ in range(200)}
    assert drawn == {0, 1, 2}


@pytest.mark.unit
def test_requests_carry_the_extensions_in_version_4():
    plain = Request(id="j", prompt=[1], reply_key="k")
    assert msgpack.unpackb(plain.encode())["v"] == 5 and Request.decode(plain.encode()) == plain
    ext = Request(id="j", prompt=[1], reply_key="k",
                  params=Params(ignore_eos=True, min_tokens=2, repetition_penalty=1.3, min_p=0.1))
    assert msgpack.unpackb(ext.encode())["v"] == 5 and Request.decode(ext.encode()) == ext
    with pytest.raises(ProtocolError, match="min_tokens"):
        Request.decode(Request(id="j", prompt=[1], params=Params(max_new_tokens=2, min_tokens=3)).encode())
    with pytest.raises(ProtocolError, match="repetition_penalty"):
        Request.decode(Request(id="j", prompt=[1], params=Params(repetition_penalty=0.0)).encode())


def make_eos_model(target: Path) -> Path:
    """A checkpoint whose greedy next token is always EOS (every layer's output zero, each embedding a ones
    vector, the LM head's EOS row ones): the case ignore_eos and min_tokens change."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from batchfleet.worker.engine.tokenizer import BOS_ID, PAD_ID, byte_level_tokenizer

    if (target / "config.json").exists():
        return target
    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096, bos_token_id=BOS_ID,
                         eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)
        model.get_input_embeddings().weight.fill_(1.0)
        model.get_output_embeddings().weight[EOS_ID].fill_(1.0)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    byte_level_tokenizer().save_pretrained(target)
    return target


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_both_engines_honour_ignore_eos_and_min_tokens(engine, start_worker, redis_url, namespace, cache_dir):
    start_worker(engine=engine, model_dir=make_eos_model(cache_dir / "eos-model"), max_wait_ms=5,
                 kv_cache_gb=0.02)
    with Client(redis_url, namespace) as client:
        plain, ignoring, at_least, penalized = [
            client.generate("hi", max_new_tokens=12, timeout=60, **kw)
            for kw in ({}, {"ignore_eos": True}, {"min_tokens": 5}, {"repetition_penalty": 1.5, "min_p": 0.1})]
        assert (plain.finish_reason, plain.completion_tokens) == ("eos", 1)
        assert (ignoring.finish_reason, ignoring.completion_tokens) == ("length", 12)
        assert (at_least.finish_reason, at_least.completion_tokens) == ("eos", 6)
        assert penalized.completion_tokens >= 1  # a version-3 request runs through the engine
        with pytest.raises(InvalidRequest, match="min_tokens"):
            client.generate("hi", max_new_tokens=2, min_tokens=3, timeout=60)


def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(torch):
    # 1e-320 is a valid top_p (> 0) that rounds to 0 in float32: every token was dropped, the sampler failed
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    r = req(temperature=1.0, top_p=1e-320)
    assert sample(logits, [r], [torch.Generator().manual_seed(0)], [checker(r)]).tolist() == [1]
