"""Decides what runs each step: a prefill of newly admitted sequences, or one decode step of all
running ones (pure Python, no torch). The policy in full: docs/NATIVE_ENGINE.md, "Scheduling and
preemption policy". In short:
- FIFO admission per priority (0 interactive before 1 background) within the step's sequence limit
  (``max_batch_size``), ``max_running``, free blocks (one spare per running sequence) and the prefill
  token budget; a prefill step holds ONE bucket, a decode step every running sequence.
- Unchunked (dynamic mode): a prefill step runs before decode whenever something can be admitted. Chunked
  (continuous mode): long prompts are prefilled in chunks, prefill and decode steps alternate.
- Out of blocks: the least urgent running sequence (background before interactive, then the most recently
  admitted) is preempted, its blocks freed (kept in the prefix cache) and recomputed later.
- While interactive work is active, background work keeps ``background_reserve`` sequences decoding (the
  others pause with their KV); interactive work preempts background work beyond the reserve.
- Prefix cache: an admitted sequence starts with every cached full block of its tokens; blocks a prefill
  computes are registered when it is scheduled (a failed step unregisters them).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from batchfleet.worker.engine.native.block_manager import BlockManager, blocks_for
from batchfleet.worker.engine.native.sequence import SeqStatus, Sequence
from batchfleet.worker.engine.native.step import ScheduledBatch


class Scheduler:
    """Waiting queue, partly prefilled sequences and the decoding set, over one BlockManager."""

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_prefill_tokens: int = 16384,
                 max_running: int | None = None, chunked: bool = False, background_reserve: int = 0) -> None:
        self.blocks = blocks
        self.max_batch_size = max_batch_size  # sequences per prefill step
        self.max_running = max_running or max_batch_size  # sequences holding KV (decoding + prefilling)
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked = chunked
        self.background_reserve = background_reserve  # background sequences kept running while interactive runs
        self.waiting: list[Sequence] = []  # ordered by (priority, arrival)
        self.prefilling: list[Sequence] = []  # admitted, prompt KV partly computed (chunked prefill)
        self.running: list[Sequence] = []  # prefill complete: decoding
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # background sequences preempted to make room for interactive ones
        self._arrivals = 0
        self.peak_wasted = 0  # max over steps of allocated slots not holding a token
        self.peak_wasted_per_seq = 0.0  # max over steps of (wasted slots / live sequences)
        self._last_was_prefill = False

    # -- queue management -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; ValueError if it could never fit in the whole pool."""
        # the last sampled token never gets KV written
        need = blocks_for(len(seq) + seq.max_new_tokens - 1, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs {need} KV blocks at full length; "
                             f"the pool only has {self.blocks.num_blocks}")
        seq.status = SeqStatus.WAITING
        self._arrivals += 1
        seq.arrival = self._arrivals
        self._enqueue(seq)

    def room(self, priority: int) -> int:
        """How many more sequences of ``priority`` may be added now. Interactive ones may displace background
        sequences beyond the reserve; background ones always have room up to the reserve (never starved)."""
        active_i = sum(1 for q in self._all() if q.priority == 0)
        active_b = self.num_active() - active_i
        if priority == 0:
            return max(0, self.max_running - active_i - min(active_b, self.background_reserve))
        return max(0, self.max_running - active_i - active_b, self.background_reserve - active_b)

    def abort(self, ids: Iterable[str]) -> list[Sequence]:
        """Drop sequences by id wherever they are, freeing their blocks; returns the ones found."""
        wanted = set(ids)
        found = [s for s in self._all() if s.id in wanted]
        for seq in found:
            self._finish(seq)
        self.waiting = [s for s in self.waiting if s.id not in wanted]
        return found

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def num_active(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.prefilling)

    # -- the two phases ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's batch (None when there is nothing to run)."""
        if self.chunked and self._last_was_prefill and self.running:
            batch: ScheduledBatch | None = self._schedule_decode()  # alternate: decodes stall one chunk at most
        else:
            batch = self._schedule_prefill()
            if batch is None and self.running:
                batch = self._schedule_decode()
        self._last_was_prefill = batch is not None and batch.is_prefill
        return batch

    def postprocess(self, batch: ScheduledBatch, tokens: list[int]) -> list[Sequence]:
        """Record the step: KV now cached, one sampled token per ``batch.sampled`` sequence (``tokens``,
        in that order); free and return finished ones."""
        sampled = batch.sampled
        assert len(tokens) == len(sampled)
        full = (self.blocks.block_size if self.blocks.enable_caching else 0) or None
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            seq.num_cached += n  # the step wrote KV for these tokens (never for the newly sampled one)
            if full and seq.num_cached >= (seq.num_committed + 1) * full:
                self.blocks.commit(seq, seq.num_cached)  # a block a decode step just filled
        finished = [seq for seq, tok in zip(sampled, tokens, strict=True) if seq.append(tok)]
        for seq in finished:
            self._finish(seq)
        self._note_waste()
        return finished

    # -- internals --------------------------------------------------------------------------------
    def _schedule_prefill(self) -> ScheduledBatch | None:
        chosen: list[Sequence] = []
        num_new: list[int] = []
        budget = self.max_prefill_tokens
        bucket = None
        urgent = any(q.priority == 0 for q in self.waiting)  # interactive work queued: background chunks wait
        registered: list[int] = []
        for seq in self.prefilling:  # partly prefilled sequences go on first (they hold their blocks)
            if budget <= 0 or (bucket is not None and seq.bucket != bucket):
                break
            if urgent and seq.priority > 0:
                continue
            bucket = seq.bucket
            n = min(len(seq) - seq.num_cached, budget)
            chosen.append(seq)
            num_new.append(n)
            registered += self.blocks.commit(seq, seq.num_cached + n)
            budget -= n
        i = 0
        while i < len(self.waiting) and budget > 0 and len(chosen) < self.max_batch_size:
            seq = self.waiting[i]
            if seq.priority == 0 and self._holding(0) >= self.max_running - self._kept_for_batch():
                i += 1  # interactive work is at its share: background work may use its reserve
                continue
            if bucket is not None and seq.bucket != bucket:
                break
            if seq.priority > 0 and self._interactive_active() and self._holding(1) >= self.background_reserve:
                break  # background work keeps its reserve while interactive work is active, no more
            hits = self._make_room(seq)  # cached leading blocks: their tokens are not computed
            if hits is None:
                break
            n = len(seq) - len(hits) * self.blocks.block_size
            if not self.chunked and chosen and n > budget:
                break
            self.waiting.pop(i)
            bucket = seq.bucket
            self.blocks.allocate(seq, len(seq), hits)  # the whole prompt, even when prefilled in chunks
            seq.status = SeqStatus.RUNNING
            n = min(n, budget) if self.chunked else n
            chosen.append(seq)
            num_new.append(n)
            registered += self.blocks.commit(seq, seq.num_cached + n)  # later ones of this step share them
            budget -= n
            self.prefilling.append(seq)  # until its prompt is complete (below)
        if not chosen:
            return None
        for seq, n in zip(chosen, num_new):
            if seq.num_cached + n == len(seq):
                self.prefilling.remove(seq)
                self.running.append(seq)
        return ScheduledBatch(is_prefill=True, seqs=chosen, num_new=num_new, registered=registered)

    def _make_room(self, seq: Sequence) -> list[int] | None:
        """The prefix-cache hits ``seq`` is admitted with, when it can be admitted now: a slot within
        ``max_running`` and free blocks for the rest of its prompt (with one spare per holding sequence, a
        watermark against immediate preemption); None when it cannot. An interactive sequence preempts
        background sequences beyond the reserve until it fits (its hits are looked up again after each)."""
        while True:
            holding = len(self.running) + len(self.prefilling)
            hits = self.blocks.match(seq)
            if holding < self.max_running and (self.blocks.can_allocate(len(seq), reserve=holding, hits=hits)
                                               or (not holding and self.blocks.can_allocate(len(seq), hits=hits))):
                return hits  # (nothing holding and still no watermark room: admit, it fits the pool)
            victim = self._batch_victim() if seq.priority == 0 else None
            if victim is None:
                return None
            self._preempt(victim)
            self.num_priority_preemptions += 1

    def _schedule_decode(self) -> ScheduledBatch:
        # while interactive work is active, background sequences beyond the reserve keep their KV but pause
        cap = self.background_reserve if self._interactive_active() else len(self.running)
        batch_seqs = [q for q in self.running if q.priority > 0]
        paused = batch_seqs[cap:]
        queue = [q for q in self.running if q.priority == 0] + batch_seqs[:cap]
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            while not self.blocks.can_append(seq):
                # least urgent first: paused background sequences, then the tail of the step's own queue
                victim = paused.pop() if paused else (self._least_urgent(queue) if queue else seq)
                if victim in queue:
                    queue.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slot(seq)
                scheduled.append(seq)
        stepping, kept = set(scheduled), set(scheduled) | set(paused)
        self.running = [q for q in self.running if q in kept]  # admission order, paused ones included
        return ScheduledBatch(is_prefill=False, seqs=[q for q in self.running if q in stepping],
                              preempted=preempted)

    def rollback(self, batch: ScheduledBatch) -> None:
        """Undo a prefill step whose forward failed: its KV is incomplete, so the blocks it registered
        leave the prefix cache and its sequences go back to the front of the queue, in order."""
        self.blocks.uncache(batch.registered)
        for seq in reversed(batch.seqs):
            self.requeue(seq)

    def requeue(self, seq: Sequence) -> None:
        """Take an admitted sequence back to the front of its priority in the queue, freeing its blocks."""
        self._drop(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._drop(seq)
        self.blocks.free(seq)  # num_cached = 0: recomputed from scratch (prompt + tokens generated so far)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into the queue by (priority, arrival): a preempted sequence returns to the front of its priority."""
        keys = [(q.priority, q.arrival) for q in self.waiting]
        self.waiting.insert(bisect.bisect(keys, (seq.priority, seq.arrival)), seq)

    def _all(self) -> list[Sequence]:
        return [*self.running, *self.prefilling, *self.waiting]

    def _interactive_active(self) -> bool:
        return any(q.priority == 0 for q in self._all())

    def _holding(self, priority: int) -> int:
        return sum(1 for q in (*self.running, *self.prefilling) if q.priority == priority)

    def _kept_for_batch(self) -> int:
        """Slots interactive work leaves to background work: its reserve, while it has that much work."""
        return min(self.background_reserve, sum(1 for q in self._all() if q.priority > 0))

    def _batch_victim(self) -> Sequence | None:
        """The background sequence to preempt for an interactive one: beyond the reserve, most recently admitted
        (a paused one when there is one), else None."""
        holding = [q for q in (*self.running, *self.prefilling) if q.priority > 0]
        return max(holding, key=lambda q: q.arrival) if len(holding) > self.background_reserve else None

    @staticmethod
    def _least_urgent(queue: list[Sequence]) -> Sequence:
        return max(queue, key=lambda q: (q.priority, q.arrival))

    def _finish(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        self._drop(seq)

    def _drop(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)

    def wasted_slots(self) -> int:
        """Allocated slots of admitted sequences that hold no token's KV."""
        bs = self.blocks.block_size
        return sum(len(s.block_table) * bs - s.num_cached for s in (*self.running, *self.prefilling))

    def _note_waste(self) -> None:
        wasted = self.wasted_slots()
        self.peak_wasted = max(self.peak_wasted, wasted)
        live = len(self.running) + len(self.prefilling)
        if live:
            self.peak_wasted_per_seq = max(self.peak_wasted_per_seq, wasted / live)
