"""Per-row sampling and stop handling shared by every engine.

Each sampled request owns a torch.Generator seeded from its seed, and draws exactly one number per
step from it, so a seeded answer is reproducible whatever it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchfleet.worker.engine.base import GenRequest


def make_generator(req: GenRequest, device: torch.device) -> torch.Generator | None:
    """A private RNG for sampled requests; None for greedy ones. Sampling runs on CPU for determinism."""
    if req.temperature == 0.0:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(req.seed if req.seed is not None else torch.seed() & (2**63 - 1))
    return gen


def sample(logits: torch.Tensor, reqs: Sequence[GenRequest], gens: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Pick one token per row. logits: [B, V] -> tokens: [B] (long, on logits.device)."""
    out = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(reqs) if r.temperature > 0.0]
    if not sampled:
        return out
    rows = logits[sampled].float().cpu()  # [S, V]
    for j, i in enumerate(sampled):
        r = reqs[i]
        row = rows[j] / max(r.temperature, 1e-5)  # validated >= 1e-3 on the wire; never overflow here
        if 0 < r.top_k < row.numel():
            kth = torch.topk(row, r.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if r.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p (the first is always kept)
            drop = probs.cumsum(-1) - probs >= r.top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = row.softmax(-1)
        out[i] = torch.multinomial(probs, 1, generator=gens[i]).to(out.device)[0]
    return out


class StopChecker:
    """Decides, token by token, whether one request is finished and why.

    EOS ids are kept in token_ids (as transformers and vLLM do) and never appear in text; a matched
    stop string is cut from the text (OpenAI semantics) and the token completing it is the last one.
    """

    def __init__(self, req: GenRequest, eos_ids: frozenset[int], tokenizer) -> None:
        self.req = req
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.reason = ""
        self.stop_at: int | None = None  # char index where a stop string begins

    def push(self, token: int) -> bool:
        """Record one generated token; return True when the request is finished."""
        self.tokens.append(token)
        if token in self.eos_ids:
            self.reason = "eos"
        elif self.req.stop and self._match_stop():
            self.reason = "stop"
        elif len(self.tokens) >= self.req.max_new_tokens:
            self.reason = "length"
        return bool(self.reason)

    def _match_stop(self) -> bool:
        """A new match can only end in the newest token's text: decode a bounded tail each step (a
        stop string of L chars spans at most 4 L byte-level tokens), the whole output only on a hit."""
        longest = max(len(s) for s in self.req.stop)
        tail = self.tokenizer.decode(self.tokens[-(4 * longest + 4):], skip_special_tokens=True)
        if not any(s in tail for s in self.req.stop):
            return False
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        start = max(0, len(text) - len(tail) - longest)
        hits = [i for s in self.req.stop if (i := text.find(s, start)) >= 0]
        if hits:
            self.stop_at = min(hits)
            return True
        return False

    def text(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return text[: self.stop_at] if self.stop_at is not None else text
