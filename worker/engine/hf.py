"""The honest baseline: transformers ``generate`` on one left-padded batch, run to completion.

Padding ``bucket`` pads every prompt to its bucket length (static shapes); ``longest`` pads to the
longest prompt of the batch. Per-request sampling and stop strings ride on a logits processor, so
greedy rows stay plain greedy and a seeded row draws from its own generator.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from batchfleet.common.config import DynamicBatchingConfig
from batchfleet.common.errors import GUIDE_FAILED
from batchfleet.common.wire.guided import GuideError
from batchfleet.worker.engine.base import Completion, GenRequest
from batchfleet.worker.engine.embed import EmbedQueue, dense_encoder
from batchfleet.worker.engine.guided import GuideCompiler
from batchfleet.worker.engine.models import LoadedModel
from batchfleet.worker.engine.sampling import StopChecker, make_generator, sample, token_logprobs


class _RowSampler(LogitsProcessor):
    """Chooses each row's token with the shared sampler and forces it (all other logits -inf).

    Also records when the first token was produced and feeds every token (and its logprobs, taken from
    the raw ``scores``) to the row's StopChecker; a constrained row chooses within its grammar's mask.
    """

    def __init__(self, reqs: Sequence[GenRequest], checkers: list[StopChecker], device: torch.device) -> None:
        self.reqs = reqs
        self.checkers = checkers
        self.gens = [make_generator(r, device) for r in reqs]
        self.first_token_at = 0.0
        self.done = torch.zeros(len(reqs), dtype=torch.bool)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # scores: [B, V], the raw logits of this step (float32)
        tokens = sample(scores, self.reqs, self.gens, self.checkers)
        logprobs = token_logprobs(scores, tokens, self.reqs)
        if not self.first_token_at:
            self.first_token_at = time.time()
        for i, tok in enumerate(tokens.tolist()):
            if not self.done[i]:
                self.done[i] = self.checkers[i].push(tok, logprobs[i])
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, tokens[:, None], 0.0)
        return forced


class _RowsDone(StoppingCriteria):
    """Per-row stop decided by the StopCheckers (eos, stop strings, each row's own max_new_tokens)."""

    def __init__(self, sampler: _RowSampler) -> None:
        self.sampler = sampler

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return self.sampler.done.to(input_ids.device).clone()


class HFEngine:
    """Runs each added batch to completion in one ``step``."""

    def __init__(self, loaded: LoadedModel, batching: DynamicBatchingConfig, pooling: str = "last") -> None:
        self.loaded = loaded
        self.batching = batching
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0
        self.eos_ids = loaded.eos_ids
        self.guides = GuideCompiler(self.tokenizer, loaded.model.config.vocab_size, self.eos_ids)
        self._pending: list[GenRequest] = []
        self._batches = 0
        self.embeds = EmbedQueue(dense_encoder(self.model, loaded.device, self.pad_id), pooling,
                                 batching.max_batch_size, max(batching.buckets[-1], 16384))

    def add(self, requests: Sequence[GenRequest]) -> None:
        assert not self.has_work(), "hf engine takes a new batch only when idle"
        self._pending = [r for r in requests if not r.embed]
        for r in requests:
            if r.embed:
                self.embeds.add(r)

    def has_work(self) -> bool:
        return bool(self._pending) or bool(self.embeds)

    def num_active(self) -> int:
        return len(self._pending) + len(self.embeds)

    def room(self, priority: int = 0) -> int:
        """A batch runs to completion inside one step: a new one only when idle (no preemption)."""
        return 0 if self.has_work() else self.batching.max_batch_size

    def failed_ids(self) -> list[str]:
        return self.embeds.ids() if self.embeds else [r.id for r in self._pending]

    def reset(self) -> None:
        self._pending = []
        self.embeds.reset()

    def abort(self, ids: Sequence[str]) -> list[str]:
        """Only requests not started can leave: a batch runs to completion inside one step."""
        found = [r.id for r in self._pending if r.id in set(ids)]
        self._pending = [r for r in self._pending if r.id not in set(ids)]
        return found + self.embeds.abort(ids)

    def progress(self, ids: Sequence[str]) -> dict[str, list[int]]:
        return {}  # a batch runs to completion inside one step: nothing to stream mid-way

    def stats(self) -> dict[str, float]:
        return {"batches": self._batches, "embed_batches": self.embeds.batches}

    def step(self) -> list[Completion]:
        if self.embeds:  # embed requests of an added batch first, its generate requests at the next step
            return self.embeds.step()
        reqs, self._pending = self._pending, []
        if not reqs:
            return []
        started = time.time()
        matchers, refused = {}, []
        for r in reqs:  # a guide the worker cannot compile fails its own request only
            try:
                matchers[r.id] = self.guides.matcher(r.params.guide) if r.params.guide is not None else None
            except GuideError as exc:
                refused.append(Completion(id=r.id, token_ids=[], text="", finish_reason="", started_at=started,
                                          first_token_at=started, batch_size=len(reqs), error=str(exc),
                                          error_code=GUIDE_FAILED))
        if refused:
            reqs = [r for r in reqs if r.id in matchers]
            if not reqs:
                return refused
        width = max(len(r.prompt) for r in reqs)
        if self.batching.padding == "bucket":
            width = max(width, reqs[0].bucket)
        device = self.loaded.device
        # Left padding: every row's last prompt token sits at the same column.
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        checkers = [StopChecker(r, self.eos_ids, self.tokenizer, matchers[r.id]) for r in reqs]
        sampler = _RowSampler(reqs, checkers, device)
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                max_new_tokens=max(r.params.max_new_tokens for r in reqs), min_new_tokens=0,
                logits_processor=LogitsProcessorList([sampler]),
                stopping_criteria=StoppingCriteriaList([_RowsDone(sampler)]),
                pad_token_id=self.pad_id, eos_token_id=None, num_beams=1,
                temperature=None, top_p=None, top_k=None,
            )
        self._batches += 1
        return refused + [
            Completion(id=r.id, token_ids=list(c.tokens), text=c.text(), **c.outcome(), started_at=started,
                       first_token_at=sampler.first_token_at or time.time(),
                       batch_size=len(reqs), logprobs=c.logprobs)
            for r, c in zip(reqs, checkers)
        ]
