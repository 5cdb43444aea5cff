"""Running a whole OpenAI batch through the gateway with the openai client (tests of batch lines)."""

from __future__ import annotations

import json
import time
from typing import Any


def run_batch(client: Any, endpoint: str, bodies: dict[str, dict], timeout_s: float = 120) -> Any:
    """Upload one line per ``custom_id -> body`` for ``endpoint``, create the batch, wait until it ends."""
    text = "".join(json.dumps({"custom_id": k, "method": "POST", "url": endpoint, "body": v}) + "\n"
                   for k, v in bodies.items())
    uploaded = client.files.create(file=("batch.jsonl", text.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + timeout_s
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    return batch


def bodies_of(client: Any, file_id: str | None) -> dict[str, dict]:
    """An output or error file's response bodies by custom_id."""
    if file_id is None:
        return {}
    lines = client.files.content(file_id).text.splitlines()
    return {o["custom_id"]: o["response"]["body"] for o in map(json.loads, lines)}
