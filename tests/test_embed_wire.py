"""Embed requests on the wire, pure: ``Request.kind`` and ``Result.embedding`` round trips (float32, exact),
what a worker refuses, the clients' ``kind="embed"`` checks, the pooling in the fleet description and its
fingerprint; the /v1/embeddings and /v1/responses bodies as the gateway validates them."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from batchfleet.common.errors import InvalidRequest, ProtocolError
from batchfleet.common.wire.codec import pack
from batchfleet.common.wire.protocol import FleetInfo, Request, Result, decode_reply
from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.embeddings.request import embed_job, embedding_response
from batchfleet.gateway.openai.responses.format import ResponseShape
from batchfleet.gateway.openai.responses.request import parse_call
from batchfleet.producer.ask import Ask
from batchfleet.worker.transport.fleet import fingerprint

pytestmark = pytest.mark.unit


def result(**kw) -> Result:
    return Result("j", [], "", "stop", 3, 0, 0.0, 0.0, 0.0, "w", 1, **kw)


def test_kind_and_embedding_round_trip_exactly():
    req = Request(id="j", prompt=[1, 2], kind="embed")
    assert Request.decode(req.encode()) == req
    assert Request.decode(Request(id="j", prompt=[1]).encode()).kind == "generate"
    assert "kind" not in Request(id="j", prompt=[1]).encode().decode("latin-1")  # generate: as before
    vec = [0.1, -2.5, 3e-8]
    got = decode_reply(result(embedding=vec).encode()).embedding
    assert got == list(struct.unpack("<3f", struct.pack("<3f", *vec)))  # float32, bit for bit
    assert decode_reply(result().encode()).embedding is None


@pytest.mark.parametrize("fields, match", [({"kind": "pool"}, "kind"), ({"kind": 1}, "kind"),
                                           ({"kind": "embed", "stream": True}, "cannot stream")])
def test_a_worker_refuses_bad_kinds(fields, match):
    raw = pack({"id": "j", "prompt": [1], "max_new_tokens": 1, "reply_key": "r", **fields})
    with pytest.raises(ProtocolError, match=match):
        Request.decode(raw)


def test_a_bad_embedding_is_a_protocol_error():
    raw = pack({"kind": "result", "id": "j", "token_ids": [], "text": "", "finish_reason": "stop", "prompt_tokens": 1,
                "completion_tokens": 0, "queue_ms": 0, "ttft_ms": 0, "total_ms": 0, "worker": "w", "batch_size": 1,
                "embedding": b"abc"})
    with pytest.raises(ProtocolError):
        decode_reply(raw)


def test_the_clients_embed_kind_takes_no_generation_parameters():
    ask = Ask.of({"kind": "embed", "priority": "background"})
    assert ask.kind == "embed" and ask.params.max_new_tokens == 1 and ask.priority == "background"
    for bad in ({"kind": "embed", "temperature": 0.5}, {"kind": "other"}):
        with pytest.raises(InvalidRequest):
            Ask.of(bad)


def test_pooling_is_published_and_changes_the_fingerprint_only_when_not_the_default():
    info = FleetInfo("m", "{}", (8,), 16, 1, 10, (0,))
    mean = FleetInfo("m", "{}", (8,), 16, 1, 10, (0,), pooling="mean")
    assert FleetInfo.decode(mean.encode()).pooling == "mean" and FleetInfo.decode(info.encode()).pooling == "last"
    assert fingerprint(info) != fingerprint(mean)
    # the default keeps the fingerprint workers from before embeddings computed: a rolling upgrade joins
    before = [info.model, info.tokenizer_json, list(info.buckets), info.vocab_size, info.max_seq_len,
              sorted(info.eos_token_ids), info.chat_template, info.bos_token, info.eos_token]
    assert fingerprint(info) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]


def test_embeddings_bodies():
    assert embed_job({"input": [[1, 2], [3]]}, 60).inputs == [[1, 2], [3]]
    assert embed_job({"input": [1, 2]}, 60).inputs == [[1, 2]]
    job = embed_job({"input": ["a", "b"], "encoding_format": "base64", "timeout": 1e9, "service_tier": "flex"}, 60)
    assert job.timeout == 60 and job.ask == Ask.embed("background") and job.ask.priority == "background"
    for body, param in [({"input": "a", "dimensions": 2}, "dimensions"), ({"input": [""]}, "input"),
                        ({"input": ["a"] * 2049}, "input"), ({"input": "a", "priority": 1, "service_tier": "auto"},
                                                             "priority"), ({"input": 3}, "input")]:
        with pytest.raises(APIError) as info:
            embed_job(body, 60)
        assert info.value.status == 400 and info.value.param == param, body
    body = embedding_response([result(embedding=[1.0, 0.0])], "m", "base64")
    assert body["data"][0]["embedding"] == "AACAPwAAAAA=" and body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    with pytest.raises(APIError) as info:  # a worker from before embed requests: never a vector-less 200
        embedding_response([result()], "m", "float")
    assert info.value.status == 502


def test_responses_bodies_become_chat_jobs_with_their_own_field_names():
    call = parse_call({"input": [{"role": "developer", "content": "d"}, {"type": "message", "role": "assistant",
                                                                       "content": [{"type": "output_text", "text": "a",
                                                                                    "annotations": []}]}],
                       "instructions": "i", "max_output_tokens": 3, "seed": 4, "metadata": {"k": "v"}})
    job = call.job([{"role": "user", "content": "earlier"}], 60, 256)
    assert [m["content"] for m in job.prompt] == ["i", "earlier", "d", "a"] and job.params.seed == 4
    assert job.params.max_new_tokens == 3 and call.echo()["metadata"] == {"k": "v"}
    for body, param in [({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 1}}}, "text.format"),
                        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"), ({"input": "x", "n": 2}, "n")]:
        with pytest.raises(APIError) as info:
            parse_call(body).job([], 60, 256)
        assert info.value.param == param, (body, info.value.message)


def test_response_events_are_numbered_in_order():
    shape = ResponseShape("abc", "m", {})
    events = shape.opening() + shape.delta("hi") + shape.delta("") + shape.failure({"code": "x", "message": "m"})
    kinds = [e.split(b"\n")[0].decode() for e in events]
    assert kinds == ["event: response.created", "event: response.in_progress", "event: response.output_item.added",
                     "event: response.content_part.added", "event: response.output_text.delta", "event: error",
                     "event: response.failed"]
    assert [int(e.split(b'"sequence_number":')[1].split(b",")[0]) for e in events] == list(range(7))
