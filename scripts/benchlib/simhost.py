"""One host process of the autoscaling simulation (scripts/autoscale_sim.py): many real worker loops over the
simulated engine (scripts/simulated_engine.py), one thread each, started and stopped on command.

A pod's life as Kubernetes gives it: ``start`` waits the start delay (image pull, model load: slept, in wall
seconds already divided by the speed-up), then runs the real WorkerLoop over the real Redis transport; ``stop``
is SIGTERM's path (``loop.stopping``: the worker finishes its running batch and hands the rest back). The host
itself is what the simulation SIGKILLs to remove workers the hard way: their entries stay pending and live
workers reclaim them (worker/transport/reclaim.py). Events go back to the controller: (kind, pod, wall time).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass

# scripts/ is on sys.path in the simulation and its spawned hosts (python scripts/autoscale_sim.py)
from simulated_engine import SIM_MODEL, VOCAB, SimulatedEngine, StepCost, tokenizer_json

from batchfleet.common.options import build_worker_config
from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.worker.loop import WorkerLoop
from batchfleet.worker.requests.validate import Limits
from batchfleet.worker.transport.fleet import with_fingerprint
from batchfleet.worker.transport.sharded import redis_transport

BUCKETS = (128, 256)


@dataclass(frozen=True)
class HostSpec:
    url: str
    namespace: str
    max_running: int
    step_ms: float  # wall milliseconds of one simulated engine step
    claim_idle_ms: int
    max_wait_ms: float


class _Pod:
    def __init__(self, spec: HostSpec, name: str, delay_s: float, events: mp.Queue, tok: str) -> None:
        self.spec, self.name, self.delay_s, self.events, self.tok = spec, name, delay_s, events, tok
        self.cancelled = threading.Event()  # stopped before it was ready
        self.loop: WorkerLoop | None = None
        self.thread = threading.Thread(target=self._run, name=f"pod-{name}", daemon=True)

    def _run(self) -> None:
        try:
            if self.cancelled.wait(self.delay_s):
                return
            spec = self.spec
            cfg = build_worker_config(redis_url=spec.url, namespace=spec.namespace, name=self.name, buckets=BUCKETS,
                                      max_seq_len=max(BUCKETS) * 2, max_batch_size=spec.max_running,
                                      mode="continuous", max_running=spec.max_running, max_wait_ms=spec.max_wait_ms,
                                      engine="native", claim_idle_ms=spec.claim_idle_ms,
                                      scale_to_zero=True)
            engine = SimulatedEngine(StepCost(0.0, 0.0, spec.step_ms, 0.0), spec.max_running)
            transport = redis_transport(cfg.connection, cfg.keys, BUCKETS, self.name, cfg.reply_ttl_s,
                                        cfg.claim_idle_ms)
            transport.setup()
            info = FleetInfo(model=SIM_MODEL, tokenizer_json=self.tok, buckets=BUCKETS,
                             max_seq_len=cfg.batching.max_seq_len, max_batch_size=spec.max_running,
                             vocab_size=VOCAB, eos_token_ids=(VOCAB - 1,), max_queue_len=0, batch_queue_len=0,
                             scale_to_zero=True)
            transport.presence.join(with_fingerprint(info))
            self.loop = WorkerLoop(cfg, engine, transport,
                                   Limits(max_seq_len=cfg.batching.max_seq_len, vocab_size=VOCAB))
            if self.cancelled.is_set():
                self.loop.stopping.set()
            self.events.put(("ready", self.name, time.time()))
            try:
                self.loop.run()
            finally:
                self.loop.transport.close()
        except Exception:
            logging.getLogger(__name__).exception("pod %s failed", self.name)
        finally:
            self.events.put(("gone", self.name, time.time()))

    def stop(self) -> None:
        self.cancelled.set()
        if self.loop is not None:
            self.loop.stopping.set()


def host_main(spec: HostSpec, commands: mp.Queue, events: mp.Queue) -> None:
    """Serve (``start``, pod, delay wall s) and (``stop``, pod) commands until ``exit``."""
    logging.basicConfig(level=logging.WARNING)
    tok = tokenizer_json()
    pods: dict[str, _Pod] = {}
    while True:
        cmd = commands.get()
        if cmd[0] == "start":
            pod = pods[cmd[1]] = _Pod(spec, cmd[1], cmd[2], events, tok)
            pod.thread.start()
        elif cmd[0] == "stop" and cmd[1] in pods:
            pods.pop(cmd[1]).stop()
        elif cmd[0] == "exit":
            for pod in pods.values():
                pod.stop()
            for pod in pods.values():
                pod.thread.join(60)
            return
