"""NativeEngine: the worker's Engine API over the scheduler (pure Python) and the model runner.

Each ``step()`` is two-phase: ``batch = scheduler.schedule()`` -> ``tokens = runner.run(batch)`` ->
``scheduler.postprocess(batch, tokens)``. Requests may be added between steps (continuous batching);
they join at the next step, and finished ones leave (and free their KV blocks) at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.engine_config import EngineConfig
from batchfleet.common.errors import ENGINE_ERROR, GUIDE_FAILED
from batchfleet.common.wire.guided import GuideError
from batchfleet.common.wire.priority import background_reserve
from batchfleet.worker.engine.base import Completion, GenRequest
from batchfleet.worker.engine.embed import EmbedQueue
from batchfleet.worker.engine.guided import GuideCompiler
from batchfleet.worker.engine.models import LoadedModel
from batchfleet.worker.engine.native.block_manager import BlockManager
from batchfleet.worker.engine.native.kernel_cache import KernelChoices
from batchfleet.worker.engine.native.linear import LinearFactory
from batchfleet.worker.engine.native.runner import ModelRunner
from batchfleet.worker.engine.native.scheduler import Scheduler
from batchfleet.worker.engine.native.sequence import Sequence as Seq
from batchfleet.worker.engine.native.step import ScheduledBatch
from batchfleet.worker.engine.sampling import StopChecker, make_generator

STEP_LOG_LEN = 4096


@dataclass
class ReqState:
    """Per-request engine data carried as ``Sequence.payload``."""

    req: GenRequest
    gen: torch.Generator | None
    checker: StopChecker
    started_at: float = 0.0
    first_token_at: float = 0.0
    batch_size: int = 0


def contiguous_waste(seq_lens: Iterable[int], max_seq_len: int) -> int:
    """Slots a contiguous cache reserving ``max_seq_len`` per sequence would waste for these lengths."""
    return sum(max_seq_len - n for n in seq_lens)


class NativeEngine:
    """Paged-KV continuous-batching engine (see docs/NATIVE_ENGINE.md).

    Capacity (``room``): continuous mode takes requests of any bucket between steps up to ``max_running``
    sequences; dynamic mode takes one batch of up to ``max_batch_size`` when idle. ``last_step_ids``
    lists the ids of the step that ran last (``failed_ids`` after a raising step). A raising step leaves
    the engine consistent: a failed prefill puts its sequences back in the queue; a failed decode leaves
    them as before the step.
    """

    def __init__(self, loaded: LoadedModel, batching: DynamicBatchingConfig, cfg: EngineConfig, *,
                 num_blocks: int | None = None, max_prefill_tokens: int | None = None,
                 max_running: int | None = None, prefill: str = "auto", decode: str = "auto",
                 graph: str | None = None, kernel_choices: KernelChoices | None = None) -> None:
        """Dynamic mode: prefill steps take whole prompts (up to max(16384, largest bucket) tokens) and
        ``max_batch_size`` sequences run at once. Continuous mode: up to ``max_running`` sequences of any
        bucket decode together, prefills are chunked to ``max_prefill_tokens`` and alternate with decodes.
        ``graph``: the runner's decode graphs (runner.py; default: "off" with ``cfg.enforce_eager``, else "auto").
        ``kernel_choices``: the weight matmuls' measured choices to look up and add to (kernel_cache.py)."""
        self.loaded = loaded
        self.batching = batching
        self.cfg = cfg
        self.tokenizer = loaded.tokenizer
        self.eos_ids = loaded.eos_ids
        self.guides = GuideCompiler(self.tokenizer, loaded.model.config.vocab_size, self.eos_ids)
        continuous = cfg.mode == "continuous"
        running = (max_running or cfg.max_running) if continuous else batching.max_batch_size
        self.runner = ModelRunner(loaded.model, cfg.block_size, running, batching.max_seq_len,
                                  kv_cache_gb=cfg.kv_cache_gb, buckets=batching.buckets,
                                  padding=batching.padding, num_blocks=num_blocks, prefill=prefill, decode=decode,
                                  kernel_dir=Path(cfg.cache_dir) / "kernels" if cfg.native_kernel else None,
                                  linear=LinearFactory(cfg.linear, kernel_choices), batch_invariant=cfg.batch_invariant,
                                  graph=graph or ("off" if cfg.enforce_eager else "auto"))
        self.blocks = BlockManager(self.runner.num_blocks, cfg.block_size, enable_caching=cfg.prefix_cache)
        if continuous:
            budget = max_prefill_tokens or cfg.max_prefill_tokens
        else:  # whole prompts, as many as fit (the reference behaviour)
            budget = max(max_prefill_tokens or 16384, batching.buckets[-1])
        self.joins = continuous  # dynamic mode: a batch runs to completion before the next is added
        reserve = background_reserve(running, cfg.background_min_share) if continuous else 0
        self.scheduler = Scheduler(self.blocks, batching.max_batch_size, max_prefill_tokens=budget,
                                   max_running=running, chunked=continuous, background_reserve=reserve)
        # (prefill?, ((id, bucket), ...)) of recent steps: which requests shared a step (tests, debugging)
        self.step_log: deque[tuple[bool, tuple[tuple[str, int], ...]]] = deque(maxlen=STEP_LOG_LEN)
        self._errors: list[Completion] = []
        # embed requests: a packed prefill of their own, no KV block ever taken (worker/engine/embed.py)
        self.embeds = EmbedQueue(self.runner.hidden_states, cfg.pooling, batching.max_batch_size, budget)
        self.last_step_ids: list[str] = []
        # decode_slots_*: sequences per decode step by priority, summed (background's share under load)
        self._counters = dict(steps=0, prefill_steps=0, decode_steps=0, tokens_generated=0,
                              decode_slots_interactive=0, decode_slots_background=0, peak_contiguous_waste=0)

    # -- Engine API -------------------------------------------------------------------------------
    def add(self, requests: Sequence[GenRequest]) -> None:
        """Queue requests; they start at the next step (invalid ones come back as error completions)."""
        for req in requests:
            try:
                self._validate(req)
                if req.embed:
                    self.embeds.add(req)
                    continue
                matcher = self.guides.matcher(req.params.guide) if req.params.guide is not None else None
                state = ReqState(req=req, gen=make_generator(req, self.runner.device),
                                 checker=StopChecker(req, self.eos_ids, self.tokenizer, matcher))
                seq = Seq(id=req.id, token_ids=list(req.prompt), max_new_tokens=req.params.max_new_tokens,
                          stopper=state.checker.push, payload=state, bucket=req.bucket, priority=req.priority)
                self.scheduler.add(seq)
            except ValueError as exc:
                code = GUIDE_FAILED if isinstance(exc, GuideError) else ENGINE_ERROR
                self._errors.append(Completion(id=req.id, token_ids=[], text="", finish_reason="",
                                               started_at=0.0, first_token_at=0.0, batch_size=0, error=str(exc),
                                               error_code=code))

    def step(self) -> list[Completion]:
        """Run one prefill or decode step; return the requests that finished in it."""
        out, self._errors = self._errors, []
        if self.embeds:  # a batch of embed requests is a step of its own (between two decode steps)
            self.last_step_ids = self.embeds.ids()
            try:
                return out + self.embeds.step()
            except BaseException:
                self._errors = out
                raise
        batch = self.scheduler.schedule()
        if batch is None or not batch.seqs:  # defensive: a scheduled batch is never empty
            self.last_step_ids = []
            return out
        self.last_step_ids = [s.id for s in batch.seqs]
        self.step_log.append((batch.is_prefill, tuple((s.id, s.bucket) for s in batch.seqs)))
        now = time.time()
        if batch.is_prefill:
            for seq in batch.seqs:
                st: ReqState = seq.payload
                if not st.started_at:
                    st.started_at, st.batch_size = now, len(self.scheduler.running) + len(self.scheduler.prefilling)
        try:
            tokens = self.runner.run(batch)
        except BaseException:
            self._rollback(batch)
            raise
        finished = self.scheduler.postprocess(batch, tokens)
        now = time.time()
        for seq in batch.sampled:
            if not seq.payload.first_token_at:
                seq.payload.first_token_at = now
        self._count(batch)
        return out + [self._completion(s) for s in finished]

    def has_work(self) -> bool:
        return bool(self._errors) or bool(self.embeds) or self.scheduler.has_work()

    def num_active(self) -> int:
        return len(self._errors) + len(self.embeds) + self.scheduler.num_active()

    def room(self, priority: int = 0) -> int:
        """Sequences of ``priority`` that may still be added (``Scheduler.room``: interactive work may
        displace background work beyond its reserve); dynamic mode: one batch, when idle."""
        if not self.joins:
            return 0 if self.has_work() else self.scheduler.max_running
        return max(0, self.scheduler.room(priority) - len(self._errors) - len(self.embeds))

    def failed_ids(self) -> list[str]:
        return list(self.last_step_ids)

    def stats(self) -> dict[str, Any]:
        """KV accounting (blocks, slots wasted now and at peak, vs. a contiguous cache) and counters."""
        s, b = self.scheduler, self.blocks
        return {
            "kv_blocks_total": b.num_blocks,
            "kv_blocks_used": b.num_used,
            "kv_blocks_peak": b.peak_used,
            "kv_block_size": b.block_size,
            "kv_slots_wasted": s.wasted_slots(),
            "kv_slots_wasted_peak": s.peak_wasted,
            "kv_slots_wasted_peak_per_seq": s.peak_wasted_per_seq,
            "kv_slots_wasted_contiguous_peak": self._counters["peak_contiguous_waste"],
            "running": len(s.running),
            "embed_batches": self.embeds.batches,
            "running_limit": s.max_running,
            # background sequences kept decoding beside a full interactive load: running may exceed the limit by this
            "background_reserve": s.background_reserve,
            "waiting": len(s.waiting),
            "preemptions": s.num_preemptions,
            "priority_preemptions": s.num_priority_preemptions,
            "prefix_cache": b.enable_caching,
            "prefix_cache_queries": b.queries,  # prompt tokens looked up at admission (vLLM's counters)
            "prefix_cache_hits": b.hits,  # of those, tokens whose KV came from the cache (not computed)
            "kv_blocks_cached": b.num_evictable,  # free blocks still holding reusable content
            "prefix_cache_evictions": b.evictions,
            "decode_shapes": [f"{b}x{w}" for b, w in sorted(self.runner.decode_shapes)],
            **self.runner.describe(),  # kernels chosen at load (weight matmuls, decode attention, small ops)
            **{k: v for k, v in self._counters.items() if k != "peak_contiguous_waste"},
        }

    # -- extras -----------------------------------------------------------------------------------
    def abort(self, ids: Iterable[str]) -> list[str]:
        """Forget requests (queued or running) and free their KV blocks; returns the ids found."""
        ids = set(ids)
        self._errors = [c for c in self._errors if c.id not in ids]
        return [s.id for s in self.scheduler.abort(ids)] + self.embeds.abort(ids)

    def progress(self, ids: Iterable[str]) -> dict[str, list[int]]:
        """Tokens generated so far by each of these requests that is admitted (prefilling or running)."""
        wanted = set(ids)
        s = self.scheduler
        return {q.id: q.payload.checker.tokens for q in (*s.running, *s.prefilling) if q.id in wanted}

    def reset(self) -> None:
        """Drop every request and free every block."""
        s = self.scheduler
        self.abort([q.id for q in (*s.running, *s.prefilling, *s.waiting)])
        self._errors = []
        self.embeds.reset()
        self.blocks.reset_cache()  # a reset follows a failure: trust no cached content

    # -- internals --------------------------------------------------------------------------------
    def _validate(self, req: GenRequest) -> None:
        if not req.prompt:
            raise ValueError("empty prompt")
        if req.embed:
            if len(req.prompt) > self.batching.max_seq_len:
                raise ValueError(f"prompt exceeds max_seq_len {self.batching.max_seq_len}")
            return
        if req.params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(req.prompt) + req.params.max_new_tokens > self.batching.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens exceeds max_seq_len {self.batching.max_seq_len}")

    def _rollback(self, batch: ScheduledBatch) -> None:
        if batch.is_prefill:  # their KV is incomplete: uncached, back to the queue, to be recomputed
            self.scheduler.rollback(batch)

    def _count(self, batch: ScheduledBatch) -> None:
        c = self._counters
        c["steps"] += 1
        c["prefill_steps" if batch.is_prefill else "decode_steps"] += 1
        c["tokens_generated"] += len(batch.sampled)  # a partial prefill chunk generates nothing
        if not batch.is_prefill:
            background_slots = sum(1 for s in batch.seqs if s.priority > 0)
            c["decode_slots_background"] += background_slots
            c["decode_slots_interactive"] += len(batch.seqs) - background_slots
        waste = contiguous_waste((s.num_cached for s in self.scheduler.running), self.batching.max_seq_len)
        c["peak_contiguous_waste"] = max(c["peak_contiguous_waste"], waste)

    def _completion(self, seq: Seq) -> Completion:
        st: ReqState = seq.payload
        # cached_tokens: prompt tokens not computed for this request (OpenAI's); resumed_cached_tokens: what
        # the cache gave back at its last re-admission after a preemption (its own blocks, mostly)
        extra = {"cached_tokens": seq.num_prompt_cache_hit or 0, "preemptions": seq.num_preemptions,
                 "resumed_cached_tokens": seq.num_cache_hit if seq.num_preemptions else 0}
        return Completion(id=seq.id, token_ids=list(st.checker.tokens), text=st.checker.text(),
                          **st.checker.outcome(), started_at=st.started_at,
                          first_token_at=st.first_token_at, batch_size=st.batch_size, extra=extra,
                          logprobs=st.checker.logprobs)
