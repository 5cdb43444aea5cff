"""Embed requests (``Request.kind == "embed"``): prefill-only jobs whose answer is the prompt's pooled,
L2-normalised final hidden state, for both engines.

An engine hands its embed requests to an ``EmbedQueue`` at ``add`` and runs ``EmbedQueue.step`` before its
own work: one batch of the oldest pending prompts (of the buckets they came from; at most ``max_batch``
prompts and ``max_tokens`` tokens, the first always taken) through the engine's ``encoder``, a prefill
that keeps no KV: the native engine packs the prompts into one row of its own forward, each attending
causally to itself, writing nothing to the paged pool (``ModelRunner.hidden_states``); the hf engine runs
the model's base transformer, right-padded with an attention mask, ``use_cache=False`` (``dense_encoder``).
No KV block is taken; the activations are freed as soon as the vectors are taken. Pooling is the worker's
``--pooling``: ``last`` (the last prompt token's state: what causal-LM embedders such as e5-mistral and
Qwen3-Embedding use, and vLLM's default for them) or ``mean`` (over the prompt's tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from batchfleet.worker.engine.base import Completion, GenRequest

POOLINGS = ("last", "mean")
# prompts -> each prompt's final-norm hidden states, [len(prompt), hidden] each
Encoder = Callable[[list[list[int]]], list[torch.Tensor]]


def pool(hidden: torch.Tensor, pooling: str) -> torch.Tensor:
    """[T, H] hidden states of one prompt -> [H] float32, L2-normalised."""
    vec = hidden[-1].float() if pooling == "last" else hidden.float().mean(dim=0)
    return F.normalize(vec, p=2, dim=0)


def dense_encoder(model: torch.nn.Module, device: torch.device, pad_id: int = 0) -> Encoder:
    """The hf engine's encoder: the model's base transformer (every layer and the final norm, no LM head),
    the prompts right-padded into one [B, T] batch with an attention mask, no KV cache."""
    base = model.base_model

    @torch.inference_mode()
    def encode(prompts: list[list[int]]) -> list[torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, T]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        out = base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        hidden = out.last_hidden_state  # [B, T, H]
        return [hidden[i, : len(p)] for i, p in enumerate(prompts)]

    return encode


class EmbedQueue:
    """An engine's pending embed requests, run a batch per ``step``."""

    def __init__(self, encoder: Encoder, pooling: str, max_batch: int, max_tokens: int) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        self.encoder = encoder
        self.pooling = pooling
        self.max_batch = max_batch
        self.max_tokens = max_tokens
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

    def next_batch(self) -> list[GenRequest]:
        """The requests the next step runs (after a raising step: the ones it ran)."""
        batch, tokens = [], 0
        for r in self.pending[: self.max_batch]:
            if batch and tokens + len(r.prompt) > self.max_tokens:
                break
            batch.append(r)
            tokens += len(r.prompt)
        return batch

    def ids(self) -> list[str]:
        return [r.id for r in self.next_batch()]

    def step(self) -> list[Completion]:
        """Embed the next batch; its requests leave the queue only once their vectors exist (a raising
        forward leaves them queued, for the loop's retry-alone policy)."""
        reqs = self.next_batch()
        if not reqs:
            return []
        started = time.time()
        hidden = self.encoder([r.prompt for r in reqs])
        vectors = [pool(h, self.pooling).cpu().tolist() for h in hidden]
        self.pending = self.pending[len(reqs):]
        self.batches += 1
        done = time.time()
        return [Completion(id=r.id, token_ids=[], text="", finish_reason="stop", started_at=started,
                           first_token_at=done, batch_size=len(reqs), embedding=v)
                for r, v in zip(reqs, vectors)]
