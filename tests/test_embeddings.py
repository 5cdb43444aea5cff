"""Embeddings on the fleet: /v1/embeddings with the official ``openai`` client (float and base64, strings,
token arrays, several inputs of different lengths in one batch), the Python client's embed requests, both
engines and both poolings, each vector compared with transformers' own hidden states of the same tiny model
(``AutoModel`` forward, the same pooling, L2-normalised); no KV block is ever allocated for them."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from batchfleet.producer import Client
from tests.helpers.batches import bodies_of, run_batch
from tests.helpers.gateway import engine_stats, gateways

pytestmark = pytest.mark.integration
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog, again and again", "a"]
TOLERANCE = 1e-4  # float32 on both sides; padding and batch shape change the summation order only


def reference(model_dir, prompts: list[list[int]], pooling: str) -> list[np.ndarray]:
    """transformers' final hidden states of each prompt alone (no padding), pooled and normalised."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [T, H]
            vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            out.append(torch.nn.functional.normalize(vec, dim=0).numpy())
    return out


def close(got, want) -> bool:
    return np.allclose(np.asarray(got, dtype=np.float32), want, atol=TOLERANCE)


def test_openai_client_embeddings_match_transformers(start_worker, redis_url, namespace, tiny_model_dir):
    worker = start_worker(engine="native", mode="continuous", max_wait_ms=20, kv_cache_gb=0.02)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    want = reference(tiny_model_dir, prompts, "last")
    with gateways(redis_url, namespace) as start:
        gw = start()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        default = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes
        floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
        tokens = client.embeddings.create(model=model, input=prompts)
        one = client.embeddings.create(model=model, input=prompts[1])
        assert [d.index for d in default.data] == [0, 1, 2] and default.object == "list"
        for answer in (default, floats, tokens):
            assert all(close(d.embedding, w) for d, w in zip(answer.data, want)), answer.data[0].embedding[:4]
        assert close(one.data[0].embedding, want[1]) and len(one.data) == 1
        assert default.usage.prompt_tokens == default.usage.total_tokens == sum(map(len, prompts))
        assert abs(np.linalg.norm(floats.data[0].embedding) - 1) < 1e-5
        with httpx.Client(base_url=gw.url + "/v1", timeout=60) as http:
            for body, param in [({"input": "x", "dimensions": 8}, "dimensions"), ({"input": ""}, "input"),
                                ({"input": []}, "input"), ({"input": "x", "encoding_format": "int8"},
                                                           "encoding_format"),
                                ({"input": [[5] * 600]}, "input"), ({"input": "x", "frob": 1}, "frob")]:
                resp = http.post("/embeddings", json=body)
                assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)
            too_long = http.post("/embeddings", json={"input": [[5] * 600]}).json()["error"]
            assert too_long["code"] == "context_length_exceeded"
    stats = engine_stats(worker)
    assert stats["embed_batches"] >= 1 and stats["kv_blocks_peak"] == 0  # no KV block was ever taken
    assert stats["embed_batches"] < 3 * len(TEXTS) + 1  # several inputs of a request share a batch


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_embed_requests_mean_pooling_beside_generation(engine, start_worker, redis_url, namespace, tiny_model_dir):
    mode = "dynamic" if engine == "hf" else "continuous"
    start_worker(engine=engine, mode=mode, max_wait_ms=20, pooling="mean", kv_cache_gb=0.02)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    want = reference(tiny_model_dir, prompts, "mean")
    with Client(redis_url, namespace) as client:
        texts = [client.submit(p, max_new_tokens=4) for p in prompts]  # generation alongside
        vectors = [client.submit(p, kind="embed") for p in prompts]
        results = [client.result(j, timeout=120) for j in vectors]
        assert all(close(r.embedding, w) for r, w in zip(results, want))
        assert all(r.token_ids == [] and r.completion_tokens == 0 for r in results)
        assert all(len(client.result(j, timeout=120).token_ids) >= 1 for j in texts)
        for bad in ({"temperature": 0.5}, {"max_new_tokens": 3}):
            with pytest.raises(Exception, match="no generation parameters"):
                client.submit(prompts[0], kind="embed", **bad)


def test_batch_of_embeddings_lines(start_worker, start_gateway, tmp_path, tiny_model_dir):
    start_worker(max_wait_ms=5)
    gw = start_gateway(files_dir=str(tmp_path / "files"))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    bodies = {"one": {"input": TEXTS[0], "encoding_format": "float"},
              "many": {"input": TEXTS, "encoding_format": "float"},
              "bad": {"input": "x", "dimensions": 3}}
    batch = run_batch(client, "/v1/embeddings", bodies)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    out = bodies_of(client, batch.output_file_id)
    (error,) = bodies_of(client, batch.error_file_id).items()
    assert error[0] == "bad" and error[1]["error"]["param"] == "dimensions"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    want = reference(tiny_model_dir, [tokenizer(t)["input_ids"] for t in TEXTS], "last")
    assert [d["index"] for d in out["many"]["data"]] == [0, 1, 2]
    assert all(close(d["embedding"], w) for d, w in zip(out["many"]["data"], want))
    assert close(out["one"]["data"][0]["embedding"], want[0])
