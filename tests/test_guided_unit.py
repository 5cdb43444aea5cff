"""Structured-output specs and the v3 wire fields, pure: OpenAI's and vLLM's options read into one
``Guide``, compiled and refused with reasons; version 2 is written unless a v3 field is used; the token
mask leaves free rows of a batch untouched; logprobs are a torch log-softmax."""

from __future__ import annotations

import json

import msgpack
import pytest

from batchfleet.common.errors import InvalidRequest, ProtocolError
from batchfleet.common.wire.guided import Guide, GuideError, from_options, from_response_format
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.protocol import Delta, Request, Result, decode_reply
from batchfleet.producer.ask import Ask

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.unit
def test_options_become_one_guide():
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert from_response_format(rf) == Guide("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    assert from_options(response_format={"type": "json_object"}) == Guide("json_object")
    assert from_options(response_format={"type": "text"}) is None and from_options() is None
    assert from_options(guided_json=json.dumps(SCHEMA)).kind == "json_schema"
    assert from_options(guided_choice=["a", "b"]) == Guide("choice", '["a", "b"]')
    assert from_options(guided_regex="[0-9]+") == Guide("regex", "[0-9]+")
    assert from_options(guided_grammar='start: "x"').kind == "grammar"
    for kwargs, param in [({"guided_regex": "a", "guided_choice": ["a"]}, None),
                          ({"response_format": {"type": "xml"}}, "response_format"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
                           "response_format"),
                          ({"response_format": {"type": "json_object", "extra": 1}}, "response_format"),
                          ({"guided_json": [1]}, "guided_json"), ({"guided_json": "{"}, "guided_json"),
                          ({"guided_choice": "ab"}, "guided_choice"), ({"guided_regex": ""}, "guided_regex")]:
        with pytest.raises(GuideError) as exc:
            from_options(**kwargs)
        assert exc.value.param == param, kwargs


@pytest.mark.unit
def test_guides_compile_or_say_why():
    for good in (Guide("json_object"), Guide("json_schema", json.dumps(SCHEMA)), Guide("regex", "[a-z]{3}"),
                 Guide("choice", '["yes", "no"]'), Guide("grammar", 'start: "a" | "b"'),
                 Guide("grammar", 'root ::= "a" | "b"')):
        good.check()
    for bad, why in ((Guide("json_schema", '{"type": "foo"}'), "foo"),
                     (Guide("json_schema", '{"type": "string", "minLength": 3, "maxLength": 1}'), "minLength"),
                     (Guide("json_schema", "[1]"), "object"), (Guide("regex", "(a"), "regex"),
                     (Guide("choice", "[]"), "choice"), (Guide("grammar", "start: ("), "grammar"),
                     (Guide("json_schema", '{"a":' * 5000 + "1" + "}" * 5000), "recursion")):
        with pytest.raises(GuideError, match=why):
            bad.check()


@pytest.mark.unit
def test_wire_versions_and_roundtrip():
    plain = Request(id="j", prompt=[1], reply_key="k")
    assert msgpack.unpackb(plain.encode())["v"] == 5 and msgpack.unpackb(plain.encode())["guide"] is None
    rich = Request(id="j", prompt=[1], reply_key="k", params=Params(guide=Guide("regex", "a+"), logprobs=5))
    assert msgpack.unpackb(rich.encode())["v"] == 5 and Request.decode(rich.encode()) == rich
    base = {"v": 5, "id": "j", "prompt": [1], "max_new_tokens": 1, "reply_key": "k"}
    for bad in ({"guide": {"kind": "sql", "spec": "x"}}, {"guide": {"kind": "regex"}}, {"guide": "a+"},
                {"guide": {"kind": "regex", "spec": "a", "x": 1}}, {"logprobs": 21}, {"logprobs": True},
                {"logprobs": -1}, {"guide": {"kind": "regex", "spec": "a" * (1 << 18)}}):
        with pytest.raises(ProtocolError):
            Request.decode(msgpack.packb({**base, **bad}))
    res = Result("j", [5, 6], "ab", "stop", 1, 2, 0.0, 0.0, 0.0, "w", 1)
    assert msgpack.unpackb(res.encode())["v"] == 5 and "logprobs" not in msgpack.unpackb(res.encode())
    lp = [(-0.1, (5, 7), (-0.1, -2.5)), (-1.0, (9, 6), (-0.5, -1.0))]
    with_lp = Result("j", [5, 6], "ab", "stop", 1, 2, 0.0, 0.0, 0.0, "w", 1, logprobs=lp)
    assert msgpack.unpackb(with_lp.encode())["v"] == 5 and decode_reply(with_lp.encode()) == with_lp
    delta = Delta("j", 0, 0, "a", [5], [lp[0]])
    assert decode_reply(delta.encode()) == delta


@pytest.mark.unit
def test_client_params_refuse_bad_options_before_sending():
    assert Ask.of({"guided_regex": "[0-9]"}).params.guide == Guide("regex", "[0-9]")
    assert Ask.of({"logprobs": 0}).params.logprobs == 0
    for bad in ({"guided_json": {"type": "foo"}}, {"logprobs": 21}, {"logprobs": 1.0}, {"structured": None},
                {"guide": "a+"}, {"guide": Guide("regex", "a"), "guided_regex": "a"}):
        with pytest.raises(InvalidRequest):
            Ask.of(bad)


def test_masks_touch_only_constrained_rows_and_logprobs_are_log_softmax():
    import torch

    from batchfleet.worker.engine.base import GenRequest
    from batchfleet.worker.engine.guided import GuideCompiler
    from batchfleet.worker.engine.sampling import StopChecker, sample, token_logprobs
    from batchfleet.worker.engine.tokenizer import byte_level_tokenizer

    compiler = GuideCompiler(byte_level_tokenizer(), 320, frozenset([2]))
    digits = compiler.matcher(Guide("regex", "[0-9]{2}"))
    logits = torch.randn(3, 320, generator=torch.Generator().manual_seed(0))
    reqs = [GenRequest(id=str(i), prompt=[1], bucket=16, params=Params(max_new_tokens=4, logprobs=3)) for i in range(3)]
    before = logits.clone()
    constrained = StopChecker(reqs[1], frozenset([2]), byte_level_tokenizer(), digits)
    tokens = sample(logits, reqs, [None] * 3, [None, constrained, None])
    assert torch.equal(logits, before)  # the mask works on a copy: logprobs see the raw logits
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert chr(int(tokens[1]) - 4) in "0123456789"  # byte-level ids: 4 + byte value
    lps = token_logprobs(logits, tokens, reqs)
    ref = torch.log_softmax(logits, dim=-1)
    for i, (lp, ids, top) in enumerate(lps):
        assert lp == pytest.approx(ref[i, tokens[i]].item(), abs=1e-6)
        assert list(ids) == ref[i].topk(3).indices.tolist()
        assert list(top) == pytest.approx(ref[i].topk(3).values.tolist(), abs=1e-6)
