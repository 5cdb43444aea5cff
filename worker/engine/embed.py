"""Embed requests (``Request.kind == "embed"``): prefill-only jobs whose answer is the prompt's pooled,
L2-normalised final hidden state, shared by both engines.

An engine hands its embed requests to an ``EmbedQueue`` at ``add`` and runs ``EmbedQueue.step`` before its
own work: one batch of up to ``max_batch`` prompts (of the buckets they came from) through the model's
base transformer (``model.base_model``: every layer and the final norm, no LM head), dense and
right-padded with an attention mask, no KV cache kept (``use_cache=False``): the batch's activations are
freed as soon as its vectors are taken. Pooling is the worker's ``--pooling`` option: ``last`` (the last
prompt token's state, what causal-LM embedders such as e5-mistral and Qwen3-Embedding use, and vLLM's
default for them) or ``mean`` (over the prompt's tokens).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from batchfleet.worker.engine.base import Completion, GenRequest

POOLINGS = ("last", "mean")


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """[B, T, H] hidden states of right-padded rows, [B, T] mask (1 = a prompt token) -> [B, H] float32,
    each row L2-normalised."""
    h = hidden.float()
    if pooling == "last":
        last = mask.sum(dim=1) - 1  # [B]: right padding puts each row's last token there
        vec = h[torch.arange(h.shape[0], device=h.device), last]
    else:
        m = mask.to(h.dtype).unsqueeze(-1)  # [B, T, 1]
        vec = (h * m).sum(dim=1) / m.sum(dim=1)
    return F.normalize(vec, p=2, dim=-1)


class EmbedQueue:
    """An engine's pending embed requests, run a batch per ``step``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pooling: str, max_batch: int,
                 pad_id: int = 0) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.base = model.base_model  # the transformer without its LM head
        self.device = device
        self.pooling = pooling
        self.max_batch = max_batch
        self.pad_id = pad_id
        self.pending: list[GenRequest] = []
        self.batches = 0

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, req: GenRequest) -> None:
        self.pending.append(req)

    def abort(self, ids: Iterable[str]) -> list[str]:
        wanted = set(ids)
        found = [r.id for r in self.pending if r.id in wanted]
        self.pending = [r for r in self.pending if r.id not in wanted]
        return found

    def reset(self) -> None:
        self.pending = []

    def ids(self) -> list[str]:
        """The requests the next step runs (after a raising step: the ones it ran)."""
        return [r.id for r in self.pending[: self.max_batch]]

    def step(self) -> list[Completion]:
        """Embed the oldest ``max_batch`` pending prompts; they leave the queue only once their vectors
        exist (a raising forward leaves them queued, for the loop's retry-alone policy)."""
        reqs = self.pending[: self.max_batch]
        if not reqs:
            return []
        started = time.time()
        vectors = self.embed([r.prompt for r in reqs])
        self.pending = self.pending[len(reqs):]
        self.batches += 1
        done = time.time()
        return [Completion(id=r.id, token_ids=[], text="", finish_reason="stop", started_at=started,
                           first_token_at=done, batch_size=len(reqs), embedding=v)
                for r, v in zip(reqs, vectors)]

    def embed(self, prompts: Sequence[list[int]]) -> list[list[float]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            hidden = self.base(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # [B, T, H]
            return pool(hidden, mask, self.pooling).cpu().tolist()
