"""Native engine through the full Redis path: greedy outputs token-identical to transformers
``generate`` run one request at a time (fp32), for Llama, Qwen2 (GQA + qkv bias) and Mistral models,
over prompts spanning 3+ buckets, both padding strategies and both batching modes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import torch

from batchfleet.common.keys import Keys
from batchfleet.producer import Client
from tests.helpers.native import build_model, prompt

BUCKETS = (16, 32, 64, 128)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {fam: build_model(fam, root) for fam in ("llama", "qwen2", "mistral")}


def hf_alone(loaded, ids: list[int], n: int) -> list[int]:
    out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("padding", ["bucket", "longest"])
@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_native_matches_transformers_through_redis(family, padding, mode, family_dirs, start_worker, redis_url,
                                                   namespace):
    loaded = family_dirs[family]
    start_worker(model_dir=loaded.path, engine="native", mode=mode, padding=padding, buckets=BUCKETS,
                 max_seq_len=256, max_batch_size=8, max_wait_ms=30, kv_cache_gb=0.02)
    lengths = [5, 12, 20, 31, 40, 70, 100, 9, 15]  # buckets 16, 32, 64, 128
    new = [12, 5, 9, 14, 6, 11, 4, 16, 3]
    prompts = [prompt(100 + i, n) for i, n in enumerate(lengths)]
    with Client(redis_url, namespace) as client:
        jobs = [client.submit(p, max_new_tokens=m) for p, m in zip(prompts[:6], new[:6])]
        time.sleep(0.05)  # the rest arrive while the first batches run: continuous mode joins them
        jobs += [client.submit(p, max_new_tokens=m) for p, m in zip(prompts[6:], new[6:])]
        results = [client.result(j, timeout=120) for j in jobs]
    for p, m, res in zip(prompts, new, results):
        assert res.token_ids == hf_alone(loaded, p, m), (family, padding, mode, len(p))
    assert len({r.extra["bucket"] for r in results}) >= 3
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    bucket_of = {res.id: res.extra["bucket"] for res in results}
    for _, rec in r.xrange(Keys(namespace).batches):
        assert {bucket_of[i] for i in rec["ids"].split(",")} == {int(rec["bucket"])}


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
def test_long_request_does_not_hold_back_short_ones_in_continuous_mode(mode, start_worker, redis_url, namespace):
    start_worker(engine="native", mode=mode, max_wait_ms=10, max_batch_size=8, kv_cache_gb=0.02)
    done_at: dict[str, float] = {}
    with Client(redis_url, namespace) as client, ThreadPoolExecutor(8) as pool:
        def wait(job: str) -> None:
            client.result(job, timeout=120)
            done_at[job] = time.monotonic()

        long_job = client.submit(prompt(1, 10), max_new_tokens=480)
        waiter = [pool.submit(wait, long_job)]
        time.sleep(0.05)  # the long request is decoding now
        shorts = [client.submit(prompt(2 + i, 10 + i), max_new_tokens=4) for i in range(4)]  # same bucket
        submitted = time.monotonic()
        waiter += [pool.submit(wait, j) for j in shorts]
        for f in waiter:
            f.result()
    assert done_at[long_job] > submitted, "the long request ended before the short ones arrived: make it longer"
    if mode == "continuous":  # they joined the running batch and left as soon as they were done
        assert all(done_at[j] < done_at[long_job] for j in shorts)
    else:  # a dynamic batch runs to completion: they waited for it
        assert all(done_at[j] > done_at[long_job] for j in shorts)
