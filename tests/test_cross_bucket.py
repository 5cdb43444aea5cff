"""One worker serves every bucket at once (default buckets, default mode = continuous): prefill per
bucket, decode across buckets, long prompts prefilled in chunks; outputs token-identical to transformers
``generate`` run one request at a time (fp32), for Llama, Qwen2 and Mistral, through Redis."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from batchfleet.common.config import DEFAULT_BUCKETS
from batchfleet.producer import Client
from tests.helpers.native import build_model, prompt

# (prompt tokens, new tokens): buckets 128, 256, 512 and 1024; 700 > the 256-token prefill budget: chunked
SHAPES = [(40, 24), (100, 20), (200, 24), (400, 22), (700, 24)]


def hf_alone(loaded, ids: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_every_bucket_decodes_together_token_exact(family, tmp_path, start_worker, redis_url, namespace):
    # max_position_embeddings / sliding_window cover the default max_seq_len (4096)
    loaded = build_model(family, tmp_path, max_position_embeddings=4096,
                         **({"sliding_window": 4096} if family == "mistral" else {}))
    w = start_worker(model_dir=loaded.path, engine="native", mode=None, buckets=DEFAULT_BUCKETS, max_seq_len=4096,
                     max_prefill_tokens=256, kv_cache_gb=0.05)
    assert w.loop.engine.joins  # continuous: every bucket joins one decode
    prompts = [prompt(300 + i, n) for i, (n, _) in enumerate(SHAPES)]
    with Client(redis_url, namespace) as client:
        jobs = [client.submit(p, max_new_tokens=m) for p, (_, m) in zip(prompts, SHAPES)]
        results = [client.result(j, timeout=300) for j in jobs]
    for p, (_, m), res in zip(prompts, SHAPES, results):
        assert res.token_ids == hf_alone(loaded, p, m), (family, len(p))
    assert {r.extra["bucket"] for r in results} == {128, 256, 512, 1024}
    log = list(w.loop.engine.step_log)
    prefills = [step for is_prefill, step in log if is_prefill]
    assert all(len({bucket for _, bucket in step}) == 1 for step in prefills), "a prefill step mixed buckets"
    job_700 = jobs[-1]
    assert sum(1 for step in prefills if job_700 in {i for i, _ in step}) >= 3, "the 700-token prompt was not chunked"
    shared = max(len({bucket for _, bucket in step}) for is_prefill, step in log if not is_prefill)
    assert shared >= 3, f"decode steps held at most {shared} buckets"


def test_short_request_overtakes_long_ones_of_other_buckets(tmp_path, start_worker, redis_url, namespace):
    """A bucket-128 request arriving while bucket-512 and -1024 requests decode gets its answer first."""
    loaded = build_model("llama", tmp_path, max_position_embeddings=4096)
    start_worker(model_dir=loaded.path, engine="native", mode=None, buckets=DEFAULT_BUCKETS, max_seq_len=4096,
                 max_wait_ms=10, kv_cache_gb=0.05)
    done_at: dict[str, float] = {}
    with Client(redis_url, namespace) as client, ThreadPoolExecutor(4) as pool:
        def wait(job: str) -> None:
            client.result(job, timeout=300)
            done_at[job] = time.monotonic()

        longs = [client.submit(prompt(1, 400), max_new_tokens=600), client.submit(prompt(2, 700), max_new_tokens=600)]
        waits = [pool.submit(wait, j) for j in longs]
        time.sleep(0.5)  # both are decoding by now
        assert not done_at
        short = client.submit(prompt(3, 30), max_new_tokens=4)
        res = client.result(short, timeout=120)
        short_done = time.monotonic()
        for f in waits:
            f.result()
    assert res.extra["bucket"] == 128
    assert all(short_done < done_at[j] for j in longs), "the short request waited for the long ones"
