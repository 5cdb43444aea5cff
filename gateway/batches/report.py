"""What a finished batch reports besides its counts, as OpenAI's batch object: ``usage`` (the tokens of its
answered requests) and, when requests failed, ``errors`` naming the most frequent error codes with what to
do (producer/bulk/report.py: "serve this name with --served-model-name" for a model name the gateway does
not serve). Read from the output and error files, streamed, so a batch taken over reports its whole run.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from batchfleet.gateway.batches.lines import line_code
from batchfleet.producer.bulk.report import top_codes


def _lines(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    yield obj
    except FileNotFoundError:
        return


def usage(out_path: str) -> dict[str, Any]:
    """OpenAI's batch ``usage`` summed over the output file's responses."""
    prompt = completion = 0
    for obj in _lines(out_path):
        used = ((obj.get("response") or {}).get("body") or {}).get("usage") or {}
        # chat and completions count prompt/completion tokens; /v1/responses, input/output tokens
        prompt += int(used.get("prompt_tokens") or used.get("input_tokens") or 0)
        completion += int(used.get("completion_tokens") or used.get("output_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def error_codes(err_path: str) -> Counter:
    return Counter(line_code(obj) for obj in _lines(err_path))


def errors_object(codes: Counter) -> dict[str, Any] | None:
    """The batch's ``errors`` list for failed requests: one entry per top code, its count and hint."""
    if not codes:
        return None
    data = [{"code": code, "message": f"{count} request(s) failed with {code}" + (f": {hint}" if hint else ""),
             "param": None, "line": None} for code, count, hint in top_codes(codes)]
    return {"object": "list", "data": data}


def summarize(out_path: str, err_path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(usage, errors) of a batch's files."""
    return usage(out_path), errors_object(error_codes(err_path))
