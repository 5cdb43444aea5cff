"""``batchfleet bulk`` submits lines that start alike one after another (within its window), so a worker's
batch shares its prefix, while the output stays in input order with the right ids and answers."""

from __future__ import annotations

import asyncio
import json

import pytest

from batchfleet.producer.aclient import AsyncClient
from batchfleet.producer.bulk.file_run import bulk_file
from batchfleet.producer.bulk.lines import Line
from batchfleet.producer.bulk.prefix_order import prefix_key, submission_order
from batchfleet.producer.chat import Chat

SYSTEM_A = "You are a terse assistant that answers every question in one single word. Question: "
SYSTEM_B = "Translate the following sentence into French, keeping names as they are: "


@pytest.mark.unit
def test_prefix_key_reads_the_leading_block_of_every_prompt_kind():
    assert prefix_key(SYSTEM_A + "x") == prefix_key(SYSTEM_A + "yz") != prefix_key(SYSTEM_B)
    assert prefix_key("short") != prefix_key("short and more")  # under 64 characters: the whole text
    assert prefix_key(list(range(20))) == prefix_key(list(range(16)) + [99]) != prefix_key(list(range(1, 21)))
    chat = [{"role": "system", "content": SYSTEM_B}, {"role": "user", "content": "hi"}]
    assert prefix_key(chat) == prefix_key([chat[0], {"role": "user", "content": "bye"}]) != prefix_key(SYSTEM_B)
    tools = [{"type": "function", "function": {"name": "lookup_the_weather_of_a_city", "parameters": {}}}]
    assert prefix_key(Chat(chat, tools)) == prefix_key(Chat([chat[1]], tools)) != prefix_key(chat)  # tools lead


@pytest.mark.unit
def test_submission_order_groups_within_each_window():
    lines = [Line(i, {"prompt": (SYSTEM_A if i % 2 == 0 else SYSTEM_B) + str(i)}) for i in range(11)]
    lines[5].error = {"code": "invalid_request", "message": "bad"}  # its own group
    order = [ln.index for ln in submission_order(lines, window=8)]
    assert order == [0, 2, 4, 6, 1, 3, 7, 5, 8, 10, 9]
    assert [ln.index for ln in submission_order(lines, window=1)] == list(range(11))


def test_bulk_submits_lines_that_start_alike_together(start_worker, redis_url, namespace, tmp_path, monkeypatch):
    start_worker(max_wait_ms=20)
    submitted: list[str] = []
    real_submit = AsyncClient.submit

    async def spy(self, prompt, **kw):  # the real submit, recording the order
        submitted.append(prompt)
        return await real_submit(self, prompt, **kw)

    monkeypatch.setattr(AsyncClient, "submit", spy)
    prompts = [(SYSTEM_A if i % 3 else SYSTEM_B) + "q" * i for i in range(10)]
    text = "\n".join(json.dumps({"prompt": p, "id": f"line-{i}", "max_new_tokens": 1 + i % 3})
                     for i, p in enumerate(prompts))
    dst = tmp_path / "out.jsonl"
    summary = asyncio.run(bulk_file(None, str(dst), redis_url=redis_url, namespace=namespace, window=6, text=text))
    assert summary.written == 10 and summary.failed == 0
    # window 6: lines 0..5 -> B (0, 3) then A (1, 2, 4, 5); lines 6..9 -> B (6, 9) then A (7, 8)
    assert submitted == [prompts[i] for i in (0, 3, 1, 2, 4, 5, 6, 9, 7, 8)]
    out = sorted((json.loads(line) for line in dst.read_text().splitlines()), key=lambda o: o["index"])
    assert [o["index"] for o in out] == list(range(10)) and [o["id"] for o in out] == [f"line-{i}" for i in range(10)]
    assert [o["result"]["completion_tokens"] for o in out] == [1 + i % 3 for i in range(10)]
    # each answer is its own line's: the tiny preset's tokenizer is one token per byte, plus BOS
    assert [o["result"]["prompt_tokens"] for o in out] == [len(p) + 1 for p in prompts]
