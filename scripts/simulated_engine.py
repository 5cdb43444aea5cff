"""A SIMULATED engine and the worker process around it, for fleet-scale benchmarks only (scripts/bench_scale.py).

No model, no torch: each step sleeps for the time a cost model gives, then emits one token per running
sequence. Everything else is the real worker (real Redis transport, intake, batcher, dispatcher,
loop, reply writes), so what the benchmark measures at N workers is the fleet's own overhead: Redis work,
queueing, read-ahead and reclaim. Never a default and never imported by the product.

The cost model (milliseconds), from issue 29: a step that starts new sequences pays their prefill,
``prefill_a + prefill_b x prompt tokens``; every step pays one decode, ``decode_c + decode_d x running``.
The defaults are accelerator-like (a 7B model on one GPU or NPU at batch 32: ~40 ms a step).

    python scripts/simulated_engine.py --redis-url redis://127.0.0.1:6379/0 --namespace simfleet
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import click

from batchfleet.common.options import build_worker_config
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.worker.engine.base import Completion, GenRequest
from batchfleet.worker.loop import WorkerLoop
from batchfleet.worker.requests.validate import Limits
from batchfleet.worker.transport.fleet import with_fingerprint
from batchfleet.worker.transport.sharded import redis_transport

VOCAB = 512
TOKEN = 7  # every simulated token; EOS is never produced, so each request runs its max_new_tokens
SIM_MODEL = "simulated-engine"


@dataclass(frozen=True)
class StepCost:
    """Milliseconds a simulated step takes (see the module docstring)."""

    prefill_a: float = 8.0
    prefill_b: float = 0.02
    decode_c: float = 30.0
    decode_d: float = 0.3

    def ms(self, new_prompt_tokens: int, running: int) -> float:
        prefill = self.prefill_a + self.prefill_b * new_prompt_tokens if new_prompt_tokens else 0.0
        return prefill + (self.decode_c + self.decode_d * running if running else 0.0)


def _max_new(req: GenRequest) -> int:
    params = getattr(req, "params", None)  # the engine request embeds the request's parameters
    return int(params.max_new_tokens if params is not None else req.max_new_tokens)


class _Seq:
    __slots__ = ("req", "tokens", "started_at", "first_token_at", "batch_size")

    def __init__(self, req: GenRequest, started_at: float, batch_size: int) -> None:
        self.req, self.tokens, self.started_at, self.batch_size = req, [], started_at, batch_size
        self.first_token_at = 0.0


class SimulatedEngine:
    """Continuous batching over simulated steps: up to ``max_running`` sequences decode together."""

    def __init__(self, cost: StepCost, max_running: int) -> None:
        self.cost = cost
        self.max_running = max_running
        self.waiting: list[GenRequest] = []
        self.running: dict[str, _Seq] = {}
        self.steps = 0

    def add(self, requests: Sequence[GenRequest]) -> None:
        self.waiting.extend(requests)

    def step(self) -> list[Completion]:
        started = time.time()
        new = self.waiting[:max(0, self.max_running - len(self.running))]
        self.waiting = self.waiting[len(new):]
        for req in new:
            self.running[req.id] = _Seq(req, started, len(self.running) + len(new))
        time.sleep(self.cost.ms(sum(len(r.prompt) for r in new), len(self.running)) / 1000)
        self.steps += 1
        now, done = time.time(), []
        for seq in list(self.running.values()):
            seq.tokens.append(TOKEN)
            if len(seq.tokens) == 1:
                seq.first_token_at = now
            if len(seq.tokens) >= _max_new(seq.req):
                del self.running[seq.req.id]
                done.append(Completion(id=seq.req.id, token_ids=seq.tokens, text="", finish_reason="length",
                                       started_at=seq.started_at, first_token_at=seq.first_token_at,
                                       batch_size=seq.batch_size))
        return done

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    def room(self, priority: int = 0) -> int:
        return self.max_running - self.num_active()

    def failed_ids(self) -> list[str]:
        return []

    def stats(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def reset(self) -> None:
        self.waiting.clear()
        self.running.clear()

    def abort(self, ids: Sequence[str]) -> list[str]:
        found = [i for i in ids if i in self.running or any(r.id == i for r in self.waiting)]
        self.waiting = [r for r in self.waiting if r.id not in ids]
        for i in ids:
            self.running.pop(i, None)
        return found

    def progress(self, ids: Sequence[str]) -> dict[str, list[int]]:
        return {i: list(self.running[i].tokens) for i in ids if i in self.running}


def tokenizer_json() -> str:
    """A word-level tokenizer over VOCAB tokens: producers need one to read the fleet description; the
    benchmark's clients send token ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    return tok.to_str()


@click.command()
@click.option("--redis-url", required=True)
@click.option("--namespace", required=True)
@click.option("--name", default=None, help="Consumer name (default host-pid-rand).")
@click.option("--buckets", default="128,256")
@click.option("--max-running", type=int, default=32)
@click.option("--max-wait-ms", type=float, default=10.0)
@click.option("--cost", default="8,0.02,30,0.3", help="prefill_a,prefill_b,decode_c,decode_d (ms).")
@click.option("--shards", type=int, default=1, help="A Redis Cluster fleet's shards (common/keys.py).")
def main(redis_url: str, namespace: str, name: str | None, buckets: str, max_running: int, max_wait_ms: float,
         cost: str, shards: int) -> None:
    """One real worker process over the simulated engine (started by scripts/bench_scale.py)."""
    bucket_sizes = tuple(int(b) for b in buckets.split(","))
    cfg = build_worker_config(redis_url=redis_url, namespace=namespace, name=name, buckets=bucket_sizes,
                              max_seq_len=max(bucket_sizes) * 2, max_batch_size=max_running, mode="continuous",
                              max_running=max_running, max_wait_ms=max_wait_ms, engine="native", shards=shards)
    engine = SimulatedEngine(StepCost(*(float(x) for x in cost.split(","))), max_running)
    transport = redis_transport(cfg.connection, cfg.keys, bucket_sizes, name or f"sim-{time.time_ns()}",
                                cfg.reply_ttl_s, cfg.claim_idle_ms)
    transport.setup()
    info = FleetInfo(model=SIM_MODEL, tokenizer_json=tokenizer_json(), buckets=bucket_sizes,
                     max_seq_len=cfg.batching.max_seq_len, max_batch_size=max_running, vocab_size=VOCAB,
                     eos_token_ids=(VOCAB - 1,), max_queue_len=0, batch_queue_len=0, shards=shards)
    transport.presence.join(with_fingerprint(info))
    loop = WorkerLoop(cfg, engine, transport, Limits(max_seq_len=cfg.batching.max_seq_len, vocab_size=VOCAB))
    signal.signal(signal.SIGTERM, lambda *_: loop.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: loop.stopping.set())
    print(f"simulated worker {transport.name} ready", flush=True)
    try:
        loop.run()
    finally:
        loop.transport.close()


if __name__ == "__main__":
    main()
