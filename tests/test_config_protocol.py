"""Config validation, bucket routing and the wire protocol (no Redis, no torch)."""

from __future__ import annotations

import msgpack
import pytest

from batchfleet.common.config import (
    ConnectionConfig,
    DynamicBatchingConfig,
    bucket_for,
    connection_from_env,
    parse_buckets,
)
from batchfleet.common.engine_config import PRESETS, EngineConfig
from batchfleet.common.errors import ConfigError, PromptTooLong, ProtocolError
from batchfleet.common.keys import Keys
from batchfleet.common.wire.params import Params
from batchfleet.common.wire.protocol import SCHEMA_VERSION, Delta, Error, FleetInfo, Request, Result, decode_reply

pytestmark = pytest.mark.unit  # pure: no Redis, no model, no subprocess


@pytest.mark.parametrize("kw, match", [
    ({"max_wait_ms": -1}, "max_wait_ms"),
    ({"max_wait_ms": float("nan")}, "max_wait_ms"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"buckets": (256, 128)}, "increasing"),
    ({"buckets": (128, 128)}, "increasing"),
    ({"buckets": ()}, "empty"),
    ({"buckets": (128, 8192)}, "exceeds max_seq_len"),
    ({"padding": "middle"}, "padding"),
])
def test_batching_config_rejects_bad_values(kw, match):
    with pytest.raises(ConfigError, match=match):
        DynamicBatchingConfig(**kw)


def test_batching_config_defaults():
    cfg = DynamicBatchingConfig()
    assert (cfg.max_wait_ms, cfg.max_batch_size, cfg.max_seq_len) == (50, 32, 4096)
    assert cfg.buckets == (128, 256, 512, 1024, 4096) and cfg.padding == "bucket"


def test_other_configs_validate():
    with pytest.raises(ConfigError):
        EngineConfig(device="tpu")
    with pytest.raises(ConfigError):
        EngineConfig(engine="hf", mode="continuous")
    with pytest.raises(ConfigError):
        EngineConfig(threads=0)
    with pytest.raises(ConfigError):
        ConnectionConfig(redis_url="http://x")
    with pytest.raises(ValueError):
        Keys("bad namespace!")
    with pytest.raises(ConfigError):
        parse_buckets("1,a")
    assert parse_buckets("128, 256") == (128, 256)


def test_presets_and_connection_env():
    assert all(EngineConfig(preset=name).preset == name for name in PRESETS)
    with pytest.raises(ConfigError, match="preset"):
        EngineConfig(preset="huge")
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="int8")
    assert connection_from_env(environ={}) == ConnectionConfig()
    env = {"BATCHFLEET_REDIS_URL": "redis://h:1/0", "BATCHFLEET_NAMESPACE": "tenant"}
    assert connection_from_env(environ=env) == ConnectionConfig(redis_url="redis://h:1/0", namespace="tenant")
    assert connection_from_env("redis://x:2/0", "n", environ=env) == ConnectionConfig("redis://x:2/0", "n")


def test_bucket_routing():
    b = (128, 256, 512)
    assert bucket_for(b, 1024, 1, 10) == 128
    assert bucket_for(b, 1024, 128, 10) == 128
    assert bucket_for(b, 1024, 129, 10) == 256
    assert bucket_for(b, 1024, 512, 10) == 512
    with pytest.raises(PromptTooLong):
        bucket_for(b, 1024, 513, 10)
    with pytest.raises(PromptTooLong):
        bucket_for(b, 600, 500, 101)
    with pytest.raises(PromptTooLong):
        bucket_for(b, 1024, 0, 1)


def test_request_roundtrip_and_validation():
    params = Params(max_new_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=3, stop=("\n",))
    req = Request(id="j1", prompt=[1, 2, 3], params=params, timeout_ms=1500, reply_key="bf:inbox:abcdefghijklmnop",
                  stream=True)
    assert Request.decode(req.encode()) == req

    def bad(obj):
        good = {"v": SCHEMA_VERSION, "id": "j", "prompt": [1], "max_new_tokens": 1, "reply_key": "k"}
        Request.decode(msgpack.packb(good))
        with pytest.raises(ProtocolError):
            Request.decode(msgpack.packb({**good, **obj}))

    bad({"prompt": []})
    bad({"prompt": [-1]})
    bad({"prompt": [True]})
    bad({"max_new_tokens": 0})
    bad({"temperature": -1})
    bad({"temperature": 1e-300})  # logits / t would overflow to inf and make sampling raise
    bad({"top_p": 0})
    bad({"seed": -5})
    bad({"stop": ["x"] * 100})
    bad({"stop": [b"\xff"]})
    bad({"id": "has space"})
    bad({"id": "newline\n"})
    bad({"timeout_ms": -1})
    bad({"timeout_ms": 1.5})
    bad({"stream": 1})
    with pytest.raises(ProtocolError) as exc:
        Request.decode(msgpack.packb({"v": 99, "id": "j"}))
    assert exc.value.code == "unsupported_schema"
    for fake_one in (1.0, True, "1"):
        with pytest.raises(ProtocolError):
            Request.decode(msgpack.packb({"v": fake_one, "id": "j", "prompt": [1], "max_new_tokens": 1,
                                          "reply_key": "k"}))
    for junk in (b"", b"\xc1", b"\x00" * 10, msgpack.packb([1, 2]), b"\xdd\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError):
            Request.decode(junk)
    with pytest.raises(ProtocolError, match="exceeds"):
        Request.decode(b"\x80" * (2 << 20))


def test_reply_roundtrip():
    res = Result(id="a", token_ids=[5, 6], text="hi", finish_reason="length", prompt_tokens=3,
                 completion_tokens=2, queue_ms=1.0, ttft_ms=2.0, total_ms=3.0, worker="w", batch_size=4)
    assert decode_reply(res.encode()) == res
    err = Error(id="a", code="invalid_request", message="nope")
    assert decode_reply(err.encode()) == err
    delta = Delta(id="a", seq=2, offset=5, text="é日", token_ids=[199, 171])
    assert decode_reply(delta.encode()) == delta
    info = FleetInfo(model="m", tokenizer_json="{}", buckets=(1, 2), max_seq_len=8, max_batch_size=2,
                     vocab_size=10, eos_token_ids=(2,), max_queue_len=5, chat_template="{{ x }}",
                     bos_token="<s>", eos_token="</s>", fingerprint="f")
    assert FleetInfo.decode(info.encode()) == info


@pytest.mark.unit
def test_a_request_carries_its_tenant_label_and_refuses_a_label_that_is_not_one():
    req = Request(id="t1", prompt=[1, 2], tenant="acme-eu")
    assert Request.decode(req.encode()).tenant == "acme-eu"
    assert Request.decode(Request(id="t2", prompt=[1]).encode()).tenant == ""  # absent: the default tenant
    raw = msgpack.unpackb(req.encode())
    for bad in ("sk-Secret", "a" * 33, "x y", 7):
        with pytest.raises(ProtocolError, match="tenant must be"):
            Request.decode(msgpack.packb({**raw, "tenant": bad}))
