"""One engine step's work, as the scheduler (scheduler.py) decides it and the runner (runner.py) computes it:
a prefill of some sequences' next prompt tokens, or one decode step of every running sequence (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchfleet.worker.engine.native.sequence import Sequence


@dataclass
class ScheduledBatch:
    """One step's work. prefill: compute the KV of ``num_new[i]`` tokens of ``seqs[i]`` starting at its
    ``num_cached`` and, when that reaches the end of its tokens, sample the next token; decode: feed each
    sequence's last token at position ``num_cached``."""

    is_prefill: bool
    seqs: list[Sequence]
    preempted: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens computed per sequence (decode: all 1)
    registered: list[int] = field(default_factory=list)  # blocks this step put in the prefix cache
    sampled: list[Sequence] = field(init=False)  # those that get a new token (a partial chunk gets none)

    def __post_init__(self) -> None:
        if not self.num_new:
            self.num_new = [len(s) - s.num_cached if self.is_prefill else 1 for s in self.seqs]
        self.sampled = [s for s, n in zip(self.seqs, self.num_new) if s.num_cached + n == len(s)]

    def __len__(self) -> int:
        return len(self.seqs)
