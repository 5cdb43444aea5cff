"""Per-row sampling, logprobs and stop handling shared by every engine.

Each sampled request owns a torch.Generator seeded from its seed, and draws exactly one number per
step from it, so a seeded answer is reproducible whatever it is batched with. A constrained request's
row is masked by its grammar first (worker/engine/guided.py), then the logits processors apply (OpenAI's
logit_bias, vLLM's repetition_penalty, OpenAI's presence and frequency penalties, min_tokens); logprobs are
taken from the raw logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from batchfleet.common.errors import GUIDE_FAILED
from batchfleet.common.wire.guided import matcher_error
from batchfleet.worker.engine.base import GenRequest
from batchfleet.worker.engine.guided import apply_masks


def make_generator(req: GenRequest, device: torch.device) -> torch.Generator | None:
    """A private RNG for sampled requests; None for greedy ones. Sampling runs on CPU for determinism."""
    if req.params.temperature == 0.0:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(req.params.seed if req.params.seed is not None else torch.seed() & (2**63 - 1))
    return gen


def _adjusted(req: GenRequest, checker: StopChecker | None) -> bool:
    """Whether a row's logits change before picking (a bias, a penalty, or EOS still forbidden by min_tokens)."""
    p = req.params
    return (p.repetition_penalty != 1.0 or bool(p.logit_bias) or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0 or (checker is not None and len(checker.tokens) < p.min_tokens))


def adjust(row: torch.Tensor, req: GenRequest, checker: StopChecker | None) -> torch.Tensor:
    """The logits processors, before temperature, in vLLM's order: logit_bias (added to the named ids), the
    repetition penalty (HF/vLLM semantics: a token seen in the prompt or the output has its logit divided by
    the penalty when positive, multiplied when negative), the presence and frequency penalties (OpenAI's
    definition, over the output only: ``logit -= frequency * count + presence * (count > 0)``) and
    min_tokens (EOS ids masked until that many tokens are out). row: [V] float, CPU."""
    output = checker.tokens if checker is not None else []
    if req.params.logit_bias:  # ids past the logits' width never exist (the worker checks the vocabulary)
        ids = torch.tensor([i for i, _ in req.params.logit_bias], dtype=torch.long)
        bias = torch.tensor([b for _, b in req.params.logit_bias], dtype=row.dtype)
        keep = ids < row.numel()
        row = row.index_add(0, ids[keep], bias[keep])
    if req.params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt) | set(output)), dtype=torch.long)
        seen = seen[seen < row.numel()]
        vals = row[seen]
        row = row.clone()
        row[seen] = torch.where(vals > 0, vals / req.params.repetition_penalty, vals * req.params.repetition_penalty)
    if (req.params.presence_penalty or req.params.frequency_penalty) and output:
        ids, counts = torch.tensor(list(output), dtype=torch.long).unique(return_counts=True)
        keep = ids < row.numel()
        ids, counts = ids[keep], counts[keep].to(row.dtype)
        row = row.index_add(0, ids, -(req.params.frequency_penalty * counts + req.params.presence_penalty))
    if checker is not None and len(output) < req.params.min_tokens and checker.eos_ids:
        eos = torch.tensor(sorted(checker.eos_ids), dtype=torch.long)
        row = row.index_fill(0, eos[eos < row.numel()], float("-inf"))
    return row


def sample(logits: torch.Tensor, reqs: Sequence[GenRequest], gens: Sequence[torch.Generator | None],
           checkers: Sequence[StopChecker | None] | None = None,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Pick one token per row. logits: [B, V] -> tokens: [B] (long, on logits.device). ``checkers`` (each
    row's output so far, EOS ids and grammar matcher): a constrained row chooses among the tokens its
    grammar allows (``logits`` itself is left as it was); repetition_penalty and min_tokens need the output.
    ``argmax``: the greedy pick of every row, exactly ``logits.argmax(dim=-1)`` (default: that)."""
    masked = [(i, m) for i, c in enumerate(checkers or ()) if c is not None and (m := c.live_matcher()) is not None]
    if masked:
        logits = logits.clone()
        apply_masks(logits, masked)
    out = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    picked = [i for i, r in enumerate(reqs)
              if r.params.temperature > 0.0 or _adjusted(r, checkers[i] if checkers is not None else None)]
    if not picked:
        return out
    rows = logits[picked].float().cpu()  # [S, V]
    for j, i in enumerate(picked):
        r = reqs[i]
        row = adjust(rows[j], r, checkers[i] if checkers is not None else None)
        if r.params.temperature == 0.0:
            out[i] = int(row.argmax())
            continue
        row = row / max(r.params.temperature, 1e-5)  # validated >= 1e-3 on the wire; never overflow here
        if 0 < r.params.top_k < row.numel():
            kth = torch.topk(row, r.params.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if r.params.min_p > 0.0:  # relative to the most likely token, after temperature (as vLLM)
            probs = row.softmax(-1)
            row = row.masked_fill(probs < r.params.min_p * probs.max(), float("-inf"))
        if r.params.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p (the first is always kept)
            drop = probs.cumsum(-1) - probs >= r.params.top_p
            drop[0] = False  # a top_p below float32's range (1e-320) rounds to 0: the first would go too
            row = row.scatter(0, order[drop], float("-inf"))
        probs = row.softmax(-1)
        out[i] = torch.multinomial(probs, 1, generator=gens[i]).to(out.device)[0]
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, reqs: Sequence[GenRequest]) -> list:
    """Per row, None, or (logprob of its token, top-k ids, their logprobs) for rows whose request asked
    (k = ``req.params.logprobs``): the log-softmax of the raw logits [B, V] of this step, in float32."""
    want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    out: list = [None] * len(reqs)
    if not want:
        return out
    lp = torch.log_softmax(logits[want].float(), dim=-1).cpu()  # [W, V]
    chosen = lp.gather(1, tokens[want].cpu().view(-1, 1)).view(-1).tolist()
    k = max(reqs[i].params.logprobs for i in want)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    for j, i in enumerate(want):
        n = reqs[i].params.logprobs
        out[i] = (chosen[j], tuple(top_ids[j, :n].tolist()), tuple(top_lp[j, :n].tolist()))
    return out


class Generated(list):
    """The token ids a request generated so far; ``logprobs``, when it asked for them, one entry per token."""

    logprobs: list | None = None


class StopChecker:
    """Decides, token by token, whether one request is finished and why; holds its generated tokens, its
    logprobs and its grammar matcher.

    EOS ids are kept in token_ids (as transformers and vLLM do) and never appear in text; a matched
    stop string is cut from the text (OpenAI semantics) and the token completing it is the last one.
    A structured output ends ("stop") as soon as its grammar is complete and allows no further token; a
    matcher that fails (llguidance gave up: a limit hit, no token possible) ends the request with
    ``error`` set: it is answered ``guide_failed``, never as a normal stop with output that may not match.
    """

    def __init__(self, req: GenRequest, eos_ids: frozenset[int], tokenizer, matcher=None) -> None:
        self.req = req
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.matcher = matcher  # llguidance.LLMatcher of a constrained request
        self.tokens = Generated()
        if req.params.logprobs is not None:
            self.tokens.logprobs = []
        self.reason = ""
        self.error: str | None = None  # why the guide failed (the request is answered guide_failed)
        self.stop_at: int | None = None  # char index where a stop string begins

    @property
    def logprobs(self) -> list | None:
        return self.tokens.logprobs

    def live_matcher(self):
        """The matcher, while it may still constrain a next token (None: free, or finished)."""
        m = self.matcher
        return m if m is not None and not self.reason and self.error is None and not m.is_stopped() else None

    def push(self, token: int, logprob=None) -> bool:
        """Record one generated token (and its logprob entry, if asked); return True when finished."""
        self.tokens.append(token)
        if self.tokens.logprobs is not None and logprob is not None:
            self.tokens.logprobs.append(logprob)
        if self.matcher is not None and token not in self.eos_ids:
            self.matcher.consume_token(token)
        if self.matcher is not None and self.matcher.is_error():
            kind = self.req.params.guide.kind if self.req.params.guide is not None else "guide"
            self.error = (f"structured output failed after {len(self.tokens)} token(s): llguidance gave up on "
                          f"the {kind}: {matcher_error(self.matcher.get_error())}")[:1000]
            return True
        early = len(self.tokens) < self.req.params.min_tokens  # min_tokens: neither EOS nor a stop string ends it
        if token in self.eos_ids and not self.req.params.ignore_eos and not early:
            self.reason = "eos"
        elif self.req.params.stop and not early and self._match_stop():
            self.reason = "stop"
        elif self.matcher is not None and self.matcher.is_stopped():
            self.reason = "stop"  # the structured output is complete
        elif len(self.tokens) >= self.req.params.max_new_tokens:
            self.reason = "length"
        return bool(self.reason)

    def outcome(self) -> dict:
        """The finished request's Completion fields: its finish reason, or the guide's failure."""
        if self.error is not None:
            return {"finish_reason": "", "error": self.error, "error_code": GUIDE_FAILED}
        return {"finish_reason": self.reason or "length"}

    def _match_stop(self) -> bool:
        """A new match can only end in the newest token's text: decode a bounded tail each step (a
        stop string of L chars spans at most 4 L byte-level tokens), the whole output only on a hit."""
        longest = max(len(s) for s in self.req.params.stop)
        tail = self.tokenizer.decode(self.tokens[-(4 * longest + 4):], skip_special_tokens=True)
        if not any(s in tail for s in self.req.params.stop):
            return False
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        start = max(0, len(text) - len(tail) - longest)
        hits = [i for s in self.req.params.stop if (i := text.find(s, start)) >= 0]
        if hits:
            self.stop_at = min(hits)
            return True
        return False

    def text(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        return text[: self.stop_at] if self.stop_at is not None else text
