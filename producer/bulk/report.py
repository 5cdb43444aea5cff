"""Why lines failed, in one line: the most frequent error codes of a run's error lines, each with what to do.

``batchfleet bulk``'s summary (gateway/cli/bulk.py) and a batch's status (gateway/batches/runner.py: its
``errors`` list) say it alike, so a script copied from OpenAI's docs that names ``gpt-4o-mini`` learns at once
that the name is the problem and which option fixes it. Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter

MODEL_HINT = ("serve this name with --served-model-name, or map every requested name to the served model with "
              "--model-alias-any")
HINTS = {
    "model_not_found": MODEL_HINT,
    "404": MODEL_HINT,
    "deadline_exceeded": "no answer in time: raise --timeout, add workers or lower --window",
    "504": "no answer in time: add workers or a longer timeout",
    "prompt_too_long": "shorten the prompt or lower max_new_tokens",
    "context_length_exceeded": "shorten the prompt or lower max_tokens",
    "invalid_request": "fix the line as its message says",
    "invalid_request_error": "fix the line as its message says",
    "400": "fix the request as its message says",
    "invalid_json_line": "each line must be one JSON object",
    "queue_full": "the fleet's queue was full: lower --window or add workers",
    "batch_expired": "ask a longer completion_window or add workers",
    "batch_cancelled": "the batch was cancelled",
}
TOP = 3


def top_codes(codes: Counter, n: int = TOP) -> list[tuple[str, int, str | None]]:
    """(code, error lines, hint) of the ``n`` most frequent codes."""
    return [(code, count, HINTS.get(code)) for code, count in codes.most_common(n)]


def why_failed(codes: Counter) -> str | None:
    """``failed lines by error code: model_not_found 20 (serve this name with ...)``; None without errors."""
    if not codes:
        return None
    parts = [f"{code} {count}" + (f" ({hint})" if hint else "") for code, count, hint in top_codes(codes)]
    rest = sum(codes.values()) - sum(c for _, c, _ in top_codes(codes))
    return "failed lines by error code: " + "; ".join(parts) + (f"; {rest} more" if rest else "")
