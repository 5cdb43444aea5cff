"""The yardstick: every (prompt, max_new_tokens) the run sent, run alone, one request at a time, on a fresh
worker no fault touched, through the channel the run used (the gateway's completions render and decode as the
gateway does). Greedy decoding on the native engine is batch-invariant, so an answer in the run equals its
reference whatever it was batched with: any difference is an answer attached to the wrong request (or
computed from the wrong prompt)."""

from __future__ import annotations

from collections.abc import Iterable

from batchfleet.producer import Client

from .workload import Workload

CALL_TIMEOUT_S = 120.0


def ref_key(channel: str, prompt: int, mnt: int) -> str:
    """Sync, async and bulk send the same request: one reference for all of them; the gateway its own."""
    return f"{'gateway' if channel == 'gateway' else 'fleet'}:{prompt}:{mnt}"


def run_references(redis_url: str, namespace: str, gateway_url: str | None, workload: Workload,
                   wanted: Iterable[str]) -> dict[str, dict]:
    """``{ref_key: {"tokens": [...] | None, "text": str}}`` for every key in ``wanted``."""
    keys = sorted(set(wanted))
    out: dict[str, dict] = {}
    with Client(redis_url, namespace) as client:
        for key in keys:
            channel, prompt, mnt = key.split(":")
            if channel != "fleet":
                continue
            res = client.generate(workload.prompts[int(prompt)], timeout=CALL_TIMEOUT_S, max_new_tokens=int(mnt),
                                  temperature=0)
            out[key] = {"tokens": list(res.token_ids), "text": res.text}
    gateway_keys = [k for k in keys if k.startswith("gateway:")]
    if gateway_keys and gateway_url:
        import openai

        client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="unused", max_retries=0,
                               timeout=CALL_TIMEOUT_S)
        try:
            for key in gateway_keys:
                _, prompt, mnt = key.split(":")
                done = client.completions.create(model="fleet", prompt=workload.prompts[int(prompt)],
                                                 max_tokens=int(mnt), temperature=0)
                out[key] = {"tokens": None, "text": done.choices[0].text}
        finally:
            client.close()
    return out
