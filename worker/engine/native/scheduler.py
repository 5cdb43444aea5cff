"""Decides what runs each step: a prefill of newly admitted sequences, or one decode step of all
running ones (pure Python, no torch).

Policy (see docs/NATIVE_ENGINE.md):
- FIFO admission while the batch has room (``max_batch_size``), the prompt fits in free blocks with
  one spare block per running sequence (a watermark against immediate preemption), and the step's
  prefill token budget is not exceeded (the first candidate is always admitted if it fits).
- A prefill step runs before decode whenever something can be admitted (new requests join at once).
- When a decode step needs a block and none is free, the most recently admitted running sequence is
  preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
  (prompt + tokens generated so far) by a later prefill. Nothing ever runs out of memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from batchfleet.worker.engine.native.block_manager import BlockManager, blocks_for
from batchfleet.worker.engine.native.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    """One step's work. prefill: compute KV of all ``token_ids`` of each sequence and sample the
    next token; decode: feed each sequence's last token at position ``num_cached``."""

    is_prefill: bool
    seqs: list[Sequence]
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Waiting queue + running batch over one BlockManager."""

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_prefill_tokens: int = 16384) -> None:
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.peak_wasted = 0  # max over steps of allocated slots not holding a token
        self.peak_wasted_per_seq = 0.0  # max over steps of (wasted slots / live sequences)

    # -- queue management -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a sequence; ValueError if it could never fit in the whole pool."""
        # the last sampled token never gets KV written
        need = blocks_for(len(seq) + seq.max_new_tokens - 1, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs {need} KV blocks at full length; "
                             f"the pool only has {self.blocks.num_blocks}")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, ids: Iterable[str]) -> list[Sequence]:
        """Drop sequences by id wherever they are, freeing their blocks; returns the ones found."""
        wanted = set(ids)
        found = [s for s in self.running if s.id in wanted] + [s for s in self.waiting if s.id in wanted]
        for seq in found:
            self._finish(seq)
        self.waiting = deque(s for s in self.waiting if s.id not in wanted)
        return found

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the two phases ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's batch (None when there is nothing to run)."""
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        if not self.running:
            return None
        return self._schedule_decode()

    def postprocess(self, batch: ScheduledBatch, tokens: list[int]) -> list[Sequence]:
        """Record one sampled token per sequence of ``batch``; free and return finished ones."""
        assert len(tokens) == len(batch.seqs)
        finished = []
        for seq, tok in zip(batch.seqs, tokens, strict=True):
            # the step wrote KV for every token but the newly sampled one
            seq.num_cached = len(seq.token_ids)
            if seq.append(tok):
                finished.append(seq)
        for seq in finished:
            self._finish(seq)
        self._note_waste()
        return finished

    # -- internals --------------------------------------------------------------------------------
    def _schedule_prefill(self) -> ScheduledBatch | None:
        chosen: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(chosen) < self.max_batch_size:
            seq = self.waiting[0]
            n = len(seq)
            if chosen and n > budget:
                break
            reserve = len(self.running) + len(chosen)
            if not self.blocks.can_allocate(n, reserve=reserve):
                # nothing running and still no room: admit without the watermark (it fits the pool)
                if reserve or not self.blocks.can_allocate(n):
                    break
            self.waiting.popleft()
            self.blocks.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            chosen.append(seq)
            budget -= n
        if not chosen:
            return None
        self.running.extend(chosen)
        return ScheduledBatch(is_prefill=True, seqs=chosen)

    def _schedule_decode(self) -> ScheduledBatch:
        queue = deque(self.running)
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            while not self.blocks.can_append(seq):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slot(seq)
                scheduled.append(seq)
        self.running = scheduled
        return ScheduledBatch(is_prefill=False, seqs=scheduled, preempted=preempted)

    def requeue(self, seq: Sequence) -> None:
        """Take a running sequence back to the front of the queue, freeing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)

    def wasted_slots(self) -> int:
        """Allocated slots of running sequences that hold no token's KV."""
        bs = self.blocks.block_size
        return sum(len(s.block_table) * bs - s.num_cached for s in self.running)

    def _note_waste(self) -> None:
        wasted = self.wasted_slots()
        self.peak_wasted = max(self.peak_wasted, wasted)
        if self.running:
            self.peak_wasted_per_seq = max(self.peak_wasted_per_seq, wasted / len(self.running))
