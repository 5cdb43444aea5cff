"""Structured outputs in the sampler: one llguidance matcher per constrained request, and the batched
token masks that keep its sampled tokens inside its grammar.

Shared by both engines: a constrained row's logits are masked (disallowed tokens -inf) before any choice,
free rows of the same batch are not touched. The matcher consumes each token the row keeps
(``StopChecker.push``) and says when the output is complete.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import torch

from batchfleet.common.wire.guided import Guide, GuideError, limits, matcher_error

log = logging.getLogger(__name__)
# guides whose compiled matcher a worker keeps: few, as one holds its lexer states (about 65 MiB for the
# costliest guides that pass the check, such as a{200000}; far less for ordinary schemas)
COMPILED_KEPT = 8
_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


class GuideCompiler:
    """Compiles guides against the served tokenizer. The llguidance tokenizer (a token trie over the
    vocabulary) is built once, at the first constrained request (about 1 s for a 150k vocabulary).

    Compiling a guide and computing its first mask can take most of a second (llguidance builds its
    lexer's states then), so the worker's guide-check thread does it (``warm``) before the request may run:
    the loop's thread then only copies the compiled matcher (``matcher``: a few ms, the lexer states are
    shared). A guide evicted from the cache meanwhile is compiled again at admission (it takes
    COMPILED_KEPT other guides warmed between its check and its start)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are never allowed
        self.eos_ids = sorted(eos_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the loop's thread and the guide-check thread share the two below
        self._compiled: OrderedDict[Guide, llguidance.LLMatcher] = OrderedDict()  # least recently used first

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size,
                    eos_token=self.eos_ids or None)
            return self._tokenizer

    def matcher(self, guide: Guide) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the output, under the limits the clients' check uses (a copy of
        the warmed one when there is one); GuideError when the guide does not compile."""
        with self._lock:
            warm = self._compiled.get(guide)
            if warm is not None:
                self._compiled.move_to_end(guide)
                return warm.deep_copy()
        return self._compile(guide)

    def warmed(self, guide: Guide) -> bool:
        """Whether ``matcher`` would copy a compiled matcher for ``guide`` now (cheap; any thread)."""
        with self._lock:
            return guide in self._compiled

    def warm(self, guide: Guide) -> None:
        """Compile ``guide`` and compute its first mask, kept for ``matcher`` (any thread; a guide that does
        not compile is left to ``matcher``, whose GuideError answers its request)."""
        with self._lock:
            if guide in self._compiled:
                return
        try:
            m = self._compile(guide)
        except GuideError:
            return
        m.compute_bitmask()  # builds the lexer states every copy shares; the matcher stays at the start
        if m.is_error():  # llguidance gave up at once: left to a fresh matcher, which fails its request
            return
        with self._lock:
            self._compiled[guide] = m
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)

    def _compile(self, guide: Guide) -> llguidance.LLMatcher:
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
