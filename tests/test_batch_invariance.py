"""Batch invariance of the native engine (bf16 and fp32): a request's greedy tokens, its seeded sampled
tokens and the logprobs of every token are the same bits whatever else runs in its steps: batch size,
neighbours, chunk boundaries of chunked prefill, prefix-cache hits, preemption and recompute.

Batch-class requests (a third of them seeded sampling) run under a flood of interactive ones, through the
engine's real scheduler (chunked prefill, a pool small enough to preempt, a shared system prompt) and
through a real worker and Redis; each is then run alone. Logprobs are compared exactly too, so a one-ulp
difference anywhere in the forward fails the test even where the tokens happen to agree: the test is
deterministic, not a matter of a near-tie falling one way. The model's head dim is 64, so bf16 takes the
decode kernel's AVX512-BF16 path where the CPU has it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.models import LoadedModel, load_model
from batchfleet.worker.engine.native.engine import NativeEngine
from tests.helpers.native import build_model, gen_request, prompt

pytestmark = pytest.mark.integration

BUCKETS = (16, 32, 64, 128)
SYSTEM = prompt(7, 37)  # a shared system prompt: 2 full blocks of 16 are prefix-cache hits after the first
DTYPES = ("bfloat16", "float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    # head dim 64, GQA 4:1 (the decode kernel's AMX path on CPUs with AMX-BF16, its AVX-512 path with the
    # grouped QK pass elsewhere with AVX512-BF16); 2 layers, hidden 256
    build_model("llama", root, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                intermediate_size=512)
    return root / "llama"


def _loaded(model_dir, dtype: str) -> LoadedModel:
    return load_model(model_dir, "cpu", dtype)


def _bucket(n: int) -> int:
    return next(b for b in BUCKETS if b >= n)


def targets() -> list[tuple[list[int], dict]]:
    """Batch-class requests: (prompt, params); every third samples with a seed; all ask for logprobs."""
    out = []
    for i in range(9):
        toks = SYSTEM + prompt(50 + i, 4 + 9 * i)[1:] if i % 2 else prompt(50 + i, 6 + 11 * i)
        params = dict(max_new_tokens=30 + 4 * i, logprobs=3)
        if i % 3 == 1:
            params.update(temperature=0.8, top_k=50, top_p=0.95, seed=100 + i)
        out.append((toks, params))
    return out


def flood() -> list[tuple[list[int], dict]]:
    """Interactive neighbours: short and long prompts, many with the shared system prompt."""
    return [(SYSTEM + prompt(200 + i, 3 + 5 * i)[1:] if i % 3 == 0 else prompt(200 + i, 5 + 7 * i % 80),
             dict(max_new_tokens=4 + (5 * i) % 17)) for i in range(18)]


def _engine(loaded: LoadedModel, **kw) -> NativeEngine:
    batching = DynamicBatchingConfig(max_batch_size=8, max_seq_len=256, buckets=BUCKETS)
    cfg = EngineConfig(engine="native", mode="continuous", block_size=16, kv_cache_gb=0.01)
    return NativeEngine(loaded, batching, cfg, **kw)


def _req(id: str, toks: list[int], params: dict, priority: int) -> GenRequest:
    return gen_request(id, toks, _bucket(len(toks)), priority=priority, **params)


def _drain(engine: NativeEngine, waves: list[list[GenRequest]], every: int = 2) -> dict:
    """Add one wave every ``every`` steps while the engine runs; {id: (tokens, logprobs)}."""
    done, steps, pending = {}, 0, list(waves)
    while engine.has_work() or pending:
        if pending and steps % every == 0:
            engine.add(pending.pop(0))
        for c in engine.step():
            assert c.error is None, c.error
            done[c.id] = (list(c.token_ids), c.logprobs)
        steps += 1
    return done


def assert_flood_leaves_batch_requests_as_alone(fresh: Callable[..., NativeEngine], what: str) -> None:
    """Each target alone on ``fresh()`` (whole prompt, no neighbours, no preemption), then all of them under
    the flood on one ``fresh(**tight)`` engine: waves of interactive requests joining the background work, prompts
    cut into chunks of 24 tokens at whatever place the shared budget leaves, 16 blocks for 6 running sequences
    of up to 11 blocks (preemptions). Tokens and logprobs must be the same bits."""
    tg = [_req(f"t{i}", t, p, priority=1) for i, (t, p) in enumerate(targets())]
    fl = [_req(f"f{i}", t, p, priority=0) for i, (t, p) in enumerate(flood())]
    alone = {}
    for r in tg:
        alone.update(_drain(fresh(), [[r]]))
    engine = fresh(max_prefill_tokens=24, max_running=6, num_blocks=16)
    mixed = _drain(engine, [tg[:3] + fl[:4], fl[4:8], tg[3:6] + fl[8:11], fl[11:14], tg[6:] + fl[14:]])
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["steps"] > 50
    differ = [r.id for r in tg if mixed[r.id] != alone[r.id]]
    assert differ == [], f"{len(differ)}/{len(tg)} batch requests differ from themselves alone ({what})"
    assert all(len(alone[r.id][1]) == len(alone[r.id][0]) > 0 for r in tg)  # logprobs compared, token by token


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_requests_under_an_interactive_flood_match_them_alone(model_dir, dtype):
    loaded = _loaded(model_dir, dtype)
    assert_flood_leaves_batch_requests_as_alone(lambda **kw: _engine(loaded, **kw), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_matmuls_give_a_row_the_same_bits_at_every_row_count(model_dir, dtype):
    """The matmuls alone (linear.py's default kernel choice): the forward's shapes, every row of every call of
    2 to 70 rows and a few larger ones against that row alone, on an input other than the load-time check's
    (on AMX in bf16 some rows of 33+ row calls differ unless calls are cut into blocks)."""
    loaded = _loaded(model_dir, dtype)
    model = _engine(loaded).runner.model
    lw = model.layers[0]
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for lin in (lw.qkv_l, lw.o_l, lw.gate_up_l, lw.down_l, model.lm_head_l):
            x = torch.randn(300, lin.weight.shape[1], generator=g).to(loaded.model.dtype)
            res = torch.randn(300, lin.weight.shape[0], generator=g).to(loaded.model.dtype)
            alone = torch.cat([lin(x[j:j + 1]) for j in range(300)])
            alone_add = torch.cat([lin.add_to(x[j:j + 1], res[j:j + 1]) for j in range(300)])
            for rows in (*range(2, 71), 100, 129, 300):
                assert torch.equal(lin(x[:rows]), alone[:rows]), (tuple(lin.weight.shape), rows)
                assert torch.equal(lin.add_to(x[:rows], res[:rows]), alone_add[:rows]), (tuple(lin.weight.shape), rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_requests_under_a_flood_through_a_worker_match_them_alone(model_dir, dtype, start_worker,
                                                                       redis_url, namespace):
    from batchfleet.producer import Client

    w = start_worker(model_dir=model_dir, engine="native", mode="continuous", dtype=dtype, buckets=BUCKETS,
                     max_seq_len=256, max_batch_size=8, max_running=6, max_prefill_tokens=24, max_wait_ms=5,
                     kv_cache_gb=40 * 2 * 2 * 16 * 2 * 64 * (2 if dtype == "bfloat16" else 4) / 2**30)
    with Client(redis_url, namespace) as client:
        batch = [client.submit(t, priority="background", **p) for t, p in targets()]
        inter = [client.submit(t, **p) for t, p in flood()]
        mixed = [client.result(j, timeout=300) for j in batch]
        for j in inter:
            client.result(j, timeout=300)
        stats = w.loop.engine.stats()
        alone = [client.generate(t, priority="background", timeout=300, **p) for t, p in targets()]  # the idle worker
    assert stats["prefix_cache_hits"] > 0  # preemptions depend on arrival timing here: the engine test forces them
    differ = [i for i, (a, b) in enumerate(zip(mixed, alone))
              if (a.token_ids, a.logprobs) != (b.token_ids, b.logprobs)]
    assert differ == [], f"{len(differ)}/{len(alone)} batch requests differ from themselves alone ({dtype})"
