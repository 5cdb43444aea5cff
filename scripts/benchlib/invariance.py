"""Batch invariance on any device (scripts/bench_gpu.py --invariance): a small flood through the native engine,
each background request compared with itself alone, tokens and logprobs.

The same shape of check as tests/test_batch_invariance_torch.py, on the engine's real scheduler with the
device's defaults (on CUDA: padded prefill, the torch paged attention, static decode shapes): 9 background
requests (a third seeded sampling, all with logprobs) under 18 interactive ones added in waves, prefill chunks
of ``max_prefill_tokens``, a pool small enough to preempt, a shared system prompt (prefix-cache hits). Random
weights: the point is bits, not text."""

from __future__ import annotations

from dataclasses import replace

import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.wire.params import Params
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.models import LoadedModel
from batchfleet.worker.engine.native.engine import NativeEngine

BUCKETS = (16, 32, 64, 128)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(4, min(vocab, 30000), (n - 1,), generator=g).tolist()


def _requests(vocab: int) -> tuple[list[GenRequest], list[GenRequest]]:
    system = _prompt(7, 37, vocab)  # 2 full blocks of 16: prefix-cache hits after the first
    targets, flood = [], []
    for i in range(9):
        toks = system + _prompt(50 + i, 4 + 9 * i, vocab)[1:] if i % 2 else _prompt(50 + i, 6 + 11 * i, vocab)
        extra = dict(temperature=0.8, top_k=50, top_p=0.95, seed=100 + i) if i % 3 == 1 else {}
        targets.append((f"t{i}", toks, Params(max_new_tokens=30 + 4 * i, logprobs=3, **extra), 1))
    for i in range(18):
        toks = system + _prompt(200 + i, 3 + 5 * i, vocab)[1:] if i % 3 == 0 else _prompt(200 + i, 5 + 7 * i % 80,
                                                                                             vocab)
        flood.append((f"f{i}", toks, Params(max_new_tokens=4 + (5 * i) % 17), 0))

    def req(id: str, toks: list[int], params: Params, priority: int) -> GenRequest:
        bucket = next(b for b in BUCKETS if b >= len(toks))
        return GenRequest(id=id, prompt=toks, bucket=bucket, params=params, priority=priority)

    return [req(*t) for t in targets], [req(*f) for f in flood]


def _engine(loaded: LoadedModel, device: str, native_kernel: bool, batch_invariant: bool = False,
            **kw) -> NativeEngine:
    batching = DynamicBatchingConfig(max_batch_size=8, max_seq_len=256, buckets=BUCKETS)
    cfg = EngineConfig(engine="native", mode="continuous", device=device, block_size=16, kv_cache_gb=0.05,
                       native_kernel=native_kernel, batch_invariant=batch_invariant)
    return NativeEngine(loaded, batching, cfg, **kw)


def _drain(engine: NativeEngine, waves: list[list[GenRequest]]) -> dict:
    done, steps, pending = {}, 0, list(waves)
    while engine.has_work() or pending:
        if pending and steps % 2 == 0:
            engine.add([replace(r) for r in pending.pop(0)])
        for c in engine.step():
            if c.error is not None:
                raise RuntimeError(f"{c.id}: {c.error}")
            done[c.id] = (list(c.token_ids), c.logprobs)
        steps += 1
    return done


def flood_vs_alone(loaded: LoadedModel, device: str, native_kernel: bool = True, batch_invariant: bool = False) -> dict:
    """Run the flood and each target alone on ``loaded``; the count of targets whose tokens or logprobs differ.
    ``native_kernel``: False runs the torch path on CPU too (on CUDA/NPU it is the only one); ``batch_invariant``:
    the engine's ``--batch-invariant`` mode (CUDA only; CPU is invariant without it)."""
    vocab = loaded.model.config.vocab_size
    tg, fl = _requests(vocab)
    alone = {}
    for r in tg:
        alone.update(_drain(_engine(loaded, device, native_kernel, batch_invariant), [[r]]))
    engine = _engine(loaded, device, native_kernel, batch_invariant, max_prefill_tokens=24, max_running=6,
                     num_blocks=16)
    mixed = _drain(engine, [tg[:3] + fl[:4], fl[4:8], tg[3:6] + fl[8:11], fl[11:14], tg[6:] + fl[14:]])
    stats = engine.stats()
    differ = [r.id for r in tg if mixed[r.id] != alone[r.id]]
    tokens_differ = [r.id for r in tg if mixed[r.id][0] != alone[r.id][0]]
    return {"dtype": str(loaded.dtype).removeprefix("torch."), "targets": len(tg), "differ": len(differ),
            "tokens_differ": len(tokens_differ), "differ_ids": differ, "preemptions": stats["preemptions"],
            "prefix_cache_hits": stats["prefix_cache_hits"], "steps": stats["steps"],
            "attention": engine.runner.describe()["decode_attention"], "prefill": engine.runner.prefill_mode,
            "batch_invariant": engine.runner.batch_invariant, "decode_graphs": engine.runner.graphs is not None}
