"""``batchfleet bulk`` on an OpenAI Batch API file: detected from the file, answered with OpenAI batch output
lines and an error file; bodies validated exactly as the gateway validates them; resumable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.chat.request import request_job

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def batch_line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def chat(text: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0,
            **kw}


def run_bulk(src: Path, dst: Path, redis_url: str, namespace: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchfleet.common.cli", "bulk", str(src), "-o", str(dst),
                           "--redis-url", redis_url, "--namespace", namespace, "--served-model-name", "tiny", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_bulk_answers_an_openai_batch_file_with_output_and_error_files(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    bad_body = chat("x", temperature="hot")
    src.write_text(
        batch_line("chat-0", chat("hello"))
        + batch_line("cmpl-1", {"model": "tiny", "prompt": "abc", "max_tokens": 2, "temperature": 0},
                     "/v1/completions")
        + "\n"  # blank lines are skipped, as OpenAI's reader does
        + batch_line("bad-body", bad_body)
        + '{"method": "POST", "url": "/v1/chat/completions", "body": {}}\n'  # no custom_id
        + batch_line("other-model", chat("x", model="gpt-nothing"))
        + batch_line("chat-5", chat("two choices", n=2)))
    first = run_bulk(src, dst, redis_url, namespace)
    assert first.returncode == 3, first.stderr[-3000:]
    out, errors = read(dst), read(tmp_path / "out.jsonl.errors.jsonl")
    assert sorted(o["custom_id"] for o in out) == ["chat-0", "chat-5", "cmpl-1"]
    by_id = {o["custom_id"]: o for o in out}
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    assert by_id["chat-0"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["cmpl-1"]["response"]["body"]["object"] == "text_completion"
    assert len(by_id["chat-5"]["response"]["body"]["choices"]) == 2
    assert by_id["chat-0"]["id"].startswith("batch_req_")
    assert by_id["chat-0"]["response"]["body"]["usage"]["completion_tokens"] == 3
    errs = {e["custom_id"]: e for e in errors}
    assert set(errs) == {"bad-body", None, "other-model"}
    with pytest.raises(APIError) as refused:  # the gateway's own validation, the same message
        request_job(True, bad_body, 600, 256)
    assert errs["bad-body"]["response"]["status_code"] == 400
    assert errs["bad-body"]["response"]["body"] == refused.value.body()
    assert errs["other-model"]["response"]["status_code"] == 404
    assert errs[None]["response"] is None and "custom_id" in errs[None]["error"]["message"]
    again = run_bulk(src, dst, redis_url, namespace)  # everything written: resumes with nothing to do
    assert again.returncode == 3 and "6 requests (6 kept from an earlier run), 3 in the error file" in again.stderr
    assert len(read(dst)) == 3 and len(read(tmp_path / "out.jsonl.errors.jsonl")) == 3


def test_bulk_openai_resumes_without_recomputing_what_is_written(start_worker, redis_url, namespace, tmp_path):
    start_worker(max_wait_ms=5)
    src, dst = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(batch_line(f"r{i}", chat(f"line {i}")) for i in range(8)))
    assert run_bulk(src, dst, redis_url, namespace, "--format", "openai").returncode == 0
    lines = dst.read_text().splitlines(keepends=True)
    dst.write_text("".join(lines[:5]) + lines[5][:20])  # as a kill mid-write leaves it
    again = run_bulk(src, dst, redis_url, namespace)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "(5 kept from an earlier run)" in again.stderr
    out = read(dst)
    assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(8)]
