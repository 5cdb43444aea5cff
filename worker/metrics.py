"""What the worker loop reports about itself: ``LoopStats`` (always on; extra heartbeat fields for
``batchfleet status``) and ``WorkerMetrics`` (the same plus Prometheus metrics, with ``--metrics-port``).

The loop calls its observer in four places: ``started`` (a prefill batch entered the engine),
``stepped`` (one engine step and its duration), ``replied`` (final replies queued for writing, still
typed: every answer, results and errors alike, passes there; the latency histograms read the results)
and ``status`` (the heartbeat). Counts are the ledger's (worker/ledger.py), the one owner: the observer
only reads them. Gauges and counters are read at scrape time; per request the loop only observes the
three latency histograms, by priority (with ``--metrics-port``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, deque
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from batchfleet.common.errors import ERROR_CODES
from batchfleet.common.metrics import (
    PRIORITY_LABELS,
    MetricsServer,
    priority_labels,
    queue_collector,
    registry_with,
    serve_metrics,
)
from batchfleet.common.wire.priority import PRIORITIES
from batchfleet.common.wire.protocol import Result
from batchfleet.worker.ledger import Ledger
from batchfleet.worker.requests.table import Stage
from batchfleet.worker.transport.base import Reply

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0  # tokens/s in status is measured over this window
LAST_BATCHES = 8  # prefill batch sizes kept for status
TTFT_KEPT = 4096  # results whose time to first token the heartbeat's one-minute mean covers at most
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class LoopStats:
    """Totals and short histories the heartbeat publishes (tokens, outcomes, recent batch sizes)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.last_batches: deque[int] = deque(maxlen=LAST_BATCHES)
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic, generation_tokens) per heartbeat
        # (monotonic, ttft ms, priority) per result: the dashboard charts TTFT per priority, as a backlog of
        # background work waits long by design while interactive work is served at once
        self._ttfts: deque[tuple[float, float, str]] = deque(maxlen=TTFT_KEPT)

    def started(self, bucket: int, size: int) -> None:
        """A prefill batch of ``size`` requests of ``bucket`` entered the engine."""
        self.last_batches.append(size)

    def stepped(self, seconds: float) -> None:
        """One engine step returned after ``seconds``."""

    def replied(self, replies: list[Reply]) -> None:
        """Final replies were queued for writing (results and errors, typed)."""
        now = time.monotonic()
        for rep in replies:
            if isinstance(rep.message, Result):
                self._ttfts.append((now, rep.message.ttft_ms, rep.priority))
                self.observe(rep.message, rep.priority)

    def observe(self, result: Result, priority: str) -> None:
        """Per-result hook (the Prometheus histograms); ``priority``: the request's priority."""

    def tokens_per_s(self, now: float) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S (sampled at each heartbeat)."""
        generated = self.ledger.generation_tokens
        self._samples.append((now, generated))
        while len(self._samples) > 1 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        return (generated - n0) / (now - t0) if now > t0 else 0.0

    def ttft_1m(self, now: float, priority: str | None = None) -> tuple[float | None, int]:
        """(mean time to first token in ms, results) of the results of the last RATE_WINDOW_S, of one
        ``priority`` (None: all): a mean, so the dashboard's history sums a fleet's workers exactly (weighted by
        results)."""
        while self._ttfts and now - self._ttfts[0][0] > RATE_WINDOW_S:
            self._ttfts.popleft()
        ttfts = [t for _, t, p in self._ttfts if priority is None or p == priority]
        n = len(ttfts)
        return (round(sum(ttfts) / n, 1) if n else None), n

    def status(self) -> dict[str, Any]:
        """Fields added to the heartbeat status."""
        now = time.monotonic()
        ttft, results = self.ttft_1m(now)
        by_priority = {priority: self.ttft_1m(now, priority) for priority in PRIORITIES}
        return {"prompt_tokens": self.ledger.prompt_tokens, "generation_tokens": self.ledger.generation_tokens,
                "tokens_per_s": round(self.tokens_per_s(now), 2),
                "last_batch_sizes": list(self.last_batches), "outcomes": dict(self.ledger.outcomes),
                "ttft_mean_ms_1m": ttft, "results_1m": results,
                "ttft_mean_ms_1m_by_priority": {p: mean for p, (mean, _) in by_priority.items()},
                "results_1m_by_priority": {p: n for p, (_, n) in by_priority.items()}}

    def close(self) -> None:
        """Stop serving (nothing to stop here)."""


class WorkerMetrics(LoopStats):
    """LoopStats plus the worker's Prometheus metrics, in a registry of its own, optionally served."""

    def __init__(self, loop: Any, registry: CollectorRegistry | None = None,
                 server: MetricsServer | None = None) -> None:
        """``loop``: the WorkerLoop observed (typed loosely: the loop imports this module); ``registry`` and
        ``server``: an empty registry already served (the port is bound before the model loads)."""
        super().__init__(loop.ledger)
        self.loop = loop
        self.queues = queue_collector(loop.cfg.connection, loop.cfg.batching.buckets, loop.cfg.keys)
        self.registry: CollectorRegistry = registry_with(self.queues, _LoopCollector(self), registry=registry)
        # by priority: "bulk work does not slow interactive work" is read per priority, never from a mix
        self.ttft = Histogram("batchfleet_time_to_first_token_seconds", "From enqueue to the first generated token.",
                              PRIORITY_LABELS, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("batchfleet_e2e_request_latency_seconds", "From enqueue to the final result.",
                             PRIORITY_LABELS, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("batchfleet_request_queue_time_seconds", "From enqueue to entering the engine.",
                                    PRIORITY_LABELS, buckets=LATENCY_BUCKETS, registry=self.registry)
        for priority in PRIORITIES:  # each exported from the start (at 0), so per-priority queries never miss one
            for hist in (self.ttft, self.e2e, self.queue_time):
                hist.labels(*priority_labels(priority))
        self.batch_size = Histogram("batchfleet_batch_size", "Requests per prefill batch.", ["bucket"],
                                    buckets=BATCH_BUCKETS, registry=self.registry)
        self.decode_step = Histogram("batchfleet_decode_step_seconds", "Duration of one engine step (a decode "
                                     "step, with any prefill scheduled in it).", buckets=STEP_BUCKETS,
                                     registry=self.registry)
        self.server: MetricsServer | None = server

    def serve(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve /metrics on ``port`` from a thread (0: a free port, see ``.server.port``)."""
        self.server = serve_metrics(self.registry, port, addr)
        return self.server

    def started(self, bucket: int, size: int) -> None:
        super().started(bucket, size)
        self.batch_size.labels(bucket=str(bucket)).observe(size)

    def stepped(self, seconds: float) -> None:
        self.decode_step.observe(seconds)

    def observe(self, result: Result, priority: str) -> None:
        labels = priority_labels(priority)
        self.ttft.labels(*labels).observe(max(0.0, result.ttft_ms / 1000))
        self.e2e.labels(*labels).observe(max(0.0, result.total_ms / 1000))
        self.queue_time.labels(*labels).observe(max(0.0, result.queue_ms / 1000))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.queues.close()


TENANTS_READ_S = 10.0
TENANT_USAGE = {"requests": "Requests answered, by tenant (configured label, default or other).",
                "prompt_tokens": "Prompt tokens of answered requests, by tenant.",
                "cached_tokens": "Of those, tokens the prefix cache supplied, by tenant.",
                "generated_tokens": "Generated tokens of answered requests, by tenant."}


def tenant_label(tenant: str, configured: frozenset[str]) -> str:
    """The metric label of a tenant: ``default`` for the default tenant (""), its own label when configured
    (``Keys.tenants``), else ``other`` (a bounded label set)."""
    if not tenant:
        return "default"
    return tenant if tenant in configured else "other"


class _LoopCollector(Collector):
    """Gauges and counters read from the loop's state at scrape time (no work in the loop)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self._engine: dict[str, Any] = {}
        self._configured: tuple[float, frozenset[str]] = (-math.inf, frozenset())  # (monotonic, tenants configured)

    def _tenants(self) -> frozenset[str]:
        """The configured tenants (``Keys.tenants``' labels), read at most every TENANTS_READ_S: the tenant label
        set of the usage counters is these, ``default`` and ``other``, however many labels requests name."""
        at, known = self._configured
        if time.monotonic() - at > TENANTS_READ_S:
            queues = self.metrics.queues
            try:
                with queues._lock:
                    known = frozenset(t.decode(errors="replace") if isinstance(t, bytes) else t
                                      for t in queues.r.hkeys(queues.keys.tenants))
            except redis.RedisError as exc:
                log.debug("tenants not read: %r", exc)
            self._configured = (time.monotonic(), known)
        return known

    def _tenant_usage(self, ledger: Ledger):
        """Usage counters by tenant label (bounded: ``_tenants``)."""
        known = self._tenants()
        sums: Counter[tuple[str, str]] = Counter()
        for (tenant, what), n in list(ledger.usage.items()):
            sums[tenant_label(tenant, known), what] += n
        for what, text in TENANT_USAGE.items():
            family = CounterMetricFamily(f"batchfleet_tenant_{what}", text, labels=["tenant"])
            for label in sorted({label for label, _ in sums} | {"default"}):
                family.add_metric([label], sums[label, what])
            yield family

    def _engine_stats(self) -> dict[str, Any]:
        try:  # read from the scrape thread while the loop runs: on a race keep the last good figures
            self._engine = self.metrics.loop.engine.stats()
        except Exception as exc:
            log.debug("engine stats not read: %r", exc)
        return self._engine

    def collect(self):
        loop, ledger = self.metrics.loop, self.metrics.loop.ledger
        stats = self._engine_stats()
        reqs = loop.requests
        yield GaugeMetricFamily("batchfleet_requests_running", "Requests in the engine.",
                                value=reqs.count(Stage.RUNNING))
        yield GaugeMetricFamily("batchfleet_requests_waiting", "Requests held by this worker, not yet started.",
                                value=reqs.count(Stage.VALIDATING) + reqs.count(Stage.QUEUED) + reqs.count(Stage.SOLO))
        total = stats.get("kv_blocks_total") or 0
        used = stats.get("kv_blocks_used", 0) / total if total else 0.0
        yield GaugeMetricFamily("batchfleet_kv_cache_usage_ratio", "KV cache blocks in use / all (0 for engines "
                                "without a paged cache).", value=used)
        yield CounterMetricFamily("batchfleet_prompt_tokens", "Prompt tokens of answered requests.",
                                  value=ledger.prompt_tokens)
        yield CounterMetricFamily("batchfleet_generation_tokens", "Generated tokens of answered requests.",
                                  value=ledger.generation_tokens)
        outcomes = CounterMetricFamily("batchfleet_requests", "Requests answered, by outcome: ok or the error code "
                                       "(worker_failed: dead-lettered).", labels=["outcome"])
        counts = Counter({code: 0 for code in ("ok", *ERROR_CODES)})
        counts.update(dict(ledger.outcomes))  # dead-lettered entries are there as worker_failed
        for outcome, n in sorted(counts.items()):
            outcomes.add_metric([outcome], n)
        yield outcomes
        yield CounterMetricFamily("batchfleet_dead_letters", "Entries this worker dead-lettered.",
                                  value=ledger["dead_lettered"])
        # two causes, two meanings: "capacity" (the KV cache was full: trouble, the alert's signal) and
        # "priority" (a background sequence gave its slot to an interactive one: priority working as designed)
        preemptions = CounterMetricFamily("batchfleet_preemptions", "Sequences the engine preempted, by reason: "
                                          "capacity (KV cache full) or priority (a background sequence made room for "
                                          "an interactive one).", labels=["reason"])
        made_room = stats.get("priority_preemptions", 0)
        preemptions.add_metric(["capacity"], max(0, stats.get("preemptions", 0) - made_room))
        preemptions.add_metric(["priority"], made_room)
        yield preemptions
        # vLLM's prefix_cache_queries / prefix_cache_hits: hits / queries is the hit rate (in tokens)
        yield CounterMetricFamily("batchfleet_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                  "when their sequence was admitted (0 with --no-prefix-cache or the hf engine).",
                                  value=stats.get("prefix_cache_queries", 0))
        yield CounterMetricFamily("batchfleet_prefix_cache_hits", "Of those, tokens whose KV came from the prefix "
                                  "cache (prefill not computed).", value=stats.get("prefix_cache_hits", 0))
        cached = CounterMetricFamily("batchfleet_prompt_tokens_cached", "Of the prompt tokens of answered requests, "
                                     "those the prefix cache supplied (OpenAI's cached_tokens), by priority.",
                                     labels=PRIORITY_LABELS)
        preempted = CounterMetricFamily("batchfleet_request_preemptions", "Preemptions of answered requests "
                                        "(each one recomputed), by priority.", labels=PRIORITY_LABELS)
        for priority in sorted(ledger.cached_tokens):
            cached.add_metric(priority_labels(priority), ledger.cached_tokens[priority])
            preempted.add_metric(priority_labels(priority), ledger.preemptions[priority])
        yield cached
        yield preempted
        yield CounterMetricFamily("batchfleet_reclaimed", "Entries taken over from silent workers.",
                                  value=ledger["reclaimed"])
        yield from self._tenant_usage(ledger)
