"""Structured outputs in the sampler: one llguidance matcher per constrained request, and the batched
token masks that keep its sampled tokens inside its grammar.

Shared by both engines: a constrained row's logits are masked (disallowed tokens -inf) before any choice,
free rows of the same batch are not touched. The matcher consumes each token the row keeps
(``StopChecker.push``) and says when the output is complete.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import llguidance
import torch

from batchfleet.common.guided import Guide, GuideError, limits, matcher_error

log = logging.getLogger(__name__)
_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


class GuideCompiler:
    """Compiles guides against the served tokenizer. The llguidance tokenizer (a token trie over the
    vocabulary) is built once, at the first constrained request (about 1 s for a 150k vocabulary)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size,
                eos_token=self.eos_ids or None)
        return self._tokenizer

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the output, under the limits the clients' check uses; GuideError
        when the guide does not compile."""
        m = llguidance.LLMatcher(self.tokenizer(), guide.grammar(), log_level=0, limits=limits())
        if m.is_error():
            raise GuideError(f"invalid {guide.kind}: {matcher_error(m.get_error())}"[:1000])
        return m


def _shared_executor() -> llguidance.LLExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = llguidance.LLExecutor()
        return _executor


def apply_masks(logits: torch.Tensor, rows: Sequence[tuple[int, llguidance.LLMatcher]]) -> None:
    """Set to -inf, in place, every logit a row's grammar does not allow next.

    logits: [B, V] (any device); rows: (row index, matcher) of the constrained rows, each live (neither
    stopped nor in error). The masks are computed on CPU, in parallel, as bitmasks [R, ceil(V / 32)]."""
    if not rows:
        return
    n, vocab = len(rows), logits.shape[-1]
    words = (vocab + 31) // 32
    bits = torch.zeros(n, words, dtype=torch.int32)
    _shared_executor().unsafe_compute_mask_ptr([(m, j) for j, (_, m) in enumerate(rows)], bits.data_ptr(),
                                               words * 4, n)
    # [R, words] -> [R, words * 32] booleans, bit b of word w = token 32 w + b
    allowed = ((bits.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(n, -1)[:, :vocab].bool()
    empty = ~allowed.any(dim=-1)
    if empty.any():  # a matcher that failed computing its mask: the row's request fails at its next token
        failed = sum(1 for j, (_, m) in enumerate(rows) if empty[j] and m.is_error())
        if failed < int(empty.sum()):  # never expected of a live matcher
            log.warning("structured output: %d row(s) had no allowed token; left unmasked", int(empty.sum()) - failed)
        allowed[empty] = True
    idx = torch.tensor([i for i, _ in rows], device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
