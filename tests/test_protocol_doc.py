"""docs/PROTOCOL.md is enough to write a client: a client built from the document alone (raw redis-py
commands, msgpack, `tokenizers`; no batchfleet code on its request path) gets the same answer as
``Client.generate``, streams deltas, cancels; and the document's tables, codes and Lua bodies match the
code (common/wire/protocol.py, errors.py, functions.py, keys.py)."""

from __future__ import annotations

import re
import secrets
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import redis
from tokenizers import Tokenizer

DOC = Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md"
PROMPT = "the quick brown fox"


def doc_section(heading: str) -> str:
    """The text under a markdown heading of the document, up to the next heading of any level."""
    text = DOC.read_text()
    start = text.index(heading + "\n")
    following = re.search(r"\n#+ ", text[start + len(heading):])
    return text[start:start + len(heading) + following.start()] if following else text[start:]


def tables(heading: str) -> list[list[str]]:
    """The tables under ``heading``, each as its rows' first cells (header and rule rows dropped)."""
    out: list[list[str]] = []
    previous = ""
    for line in doc_section(heading).splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                out.append([])
            cell = line.split("|")[1].strip()
            if cell.startswith("`"):
                out[-1].append(cell)
        previous = line
    return out


def table_fields(heading: str, index: int = 0) -> set[str]:
    """Names in the first column of a table under ``heading`` (a cell may name several: `a`, `b`)."""
    return {name for cell in tables(heading)[index] for name in re.findall(r"`([a-z_]+)`", cell)}


def lua_blocks() -> list[str]:
    return [b.strip() for b in re.findall(r"```lua\n(.*?)```", DOC.read_text(), re.S)]


class DocClient:
    """A client written from docs/PROTOCOL.md: sections 1-6, nothing else."""

    def __init__(self, url: str, ns: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.ns = ns
        self.inbox = f"{ns}:inbox:{secrets.token_urlsafe(16)}"
        self.functions = int(self.r.info("server")["redis_version"].split(".")[0]) >= 7
        self.enqueue_body, self.cancel_body = lua_blocks()
        self.last = "0"
        self.seen: dict[str, list[dict]] = {}

    def fleet(self, wait_s: float = 60.0) -> dict:
        deadline = time.monotonic() + wait_s
        while (raw := self.r.get(f"{self.ns}:fleet")) is None:
            assert time.monotonic() < deadline, "no fleet description"
            time.sleep(0.1)
        fleet = msgpack.unpackb(raw, raw=False)
        assert fleet["v"] == 5
        return fleet

    def _call(self, name: str, body: str, keys: list, args: list):
        if self.functions:
            return self.r.fcall(name, len(keys), *keys, *args)
        return self.r.eval(body, len(keys), *keys, *args)  # Redis < 7: the same body

    def enqueue(self, fleet: dict, ids: list[int], **fields) -> str:
        bucket = min(b for b in fleet["buckets"] if b >= len(ids))
        job = fields.pop("id", uuid.uuid4().hex)
        request = {"v": 5, "id": job, "prompt": ids, "reply_key": self.inbox, **fields}
        payload = msgpack.packb(request, use_bin_type=True)
        ok = self._call("bf_enqueue_v3", self.enqueue_body, [f"{self.ns}:stream:{bucket}", f"{self.ns}:workers"],
                        [fleet["max_queue_len"], job, self.inbox, payload, 1 << 20, 1, 30_000])
        assert ok == 1, ok
        return job

    def cancel(self, job: str) -> None:
        assert self._call("bf_cancel_v1", self.cancel_body, [f"{self.ns}:cancel:{job}", f"{self.ns}:cancels"],
                          [job, self.inbox, 3600, 10_000]) == 1

    def replies(self, job: str, wait_s: float = 60.0) -> list[dict]:
        """Every entry of ``job`` up to and including its final reply (deltas first), XDELed once read."""
        deadline = time.monotonic() + wait_s
        while not (self.seen.get(job) and self.seen[job][-1]["kind"] != "delta"):
            assert time.monotonic() < deadline, f"no final reply for {job}"
            for _, entries in self.r.xread({self.inbox: self.last}, count=100, block=500) or []:
                for entry_id, fields in entries:
                    self.last = entry_id
                    answer = f"{self.inbox}:done:{fields[b'id'].decode()}"
                    raw = self.r.get(answer) if b"done" in fields else fields[b"p"]
                    if raw:  # empty: rung for again after it was taken
                        reply = msgpack.unpackb(raw, raw=False)
                        assert reply["v"] == 5 and reply["id"] == fields[b"id"].decode()
                        self.seen.setdefault(reply["id"], []).append(reply)
                    self.r.xdel(self.inbox, entry_id)
                    if b"done" in fields:
                        self.r.set(answer, "", xx=True, keepttl=True)
        return self.seen.pop(job)


@pytest.fixture
def doc_client(redis_url, namespace, start_worker):
    # continuous mode streams deltas; interval 0: a delta every step (the tiny model's random text is
    # often held back as incomplete UTF-8, so the test needs many chances to see one)
    start_worker(engine="native", mode="continuous", stream_interval_ms=0)
    client = DocClient(redis_url, namespace)
    yield client
    client.r.close()


def test_raw_request_gets_the_answer_client_generate_gets(doc_client, redis_url, namespace):
    fleet = doc_client.fleet()
    ids = Tokenizer.from_str(fleet["tokenizer_json"]).encode(PROMPT).ids
    job = doc_client.enqueue(fleet, ids, max_new_tokens=12, temperature=0.0, timeout_ms=60_000, stream=False)
    (result,) = doc_client.replies(job)
    assert result["kind"] == "result" and result["id"] == job
    assert result["prompt_tokens"] == len(ids) and result["completion_tokens"] == len(result["token_ids"]) > 0
    assert result["finish_reason"] in ("stop", "length", "eos")
    assert doc_client.r.xlen(doc_client.inbox) == 0  # consumed and deleted

    from batchfleet.producer import Client  # only to compare: the request path above used none of it

    with Client(redis_url, namespace) as client:
        expected = client.generate(PROMPT, max_new_tokens=12, timeout=60)
    assert (result["text"], result["token_ids"]) == (expected.text, expected.token_ids)

    doc_client.functions = False  # the Redis < 7 way: EVAL of the document's Lua body, same keys and arguments
    job = doc_client.enqueue(fleet, ids, max_new_tokens=12, timeout_ms=60_000)
    assert doc_client.replies(job)[0]["text"] == expected.text


def test_the_documents_example_runs_as_written(doc_client, redis_url, namespace, capsys):
    example = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)
    example = example.replace("r = redis.Redis()", f"r = redis.Redis.from_url({redis_url!r})", 1)
    example = example.replace('ns = "bf"', f"ns = {namespace!r}", 1)
    if not doc_client.functions:  # Redis < 7: EVAL of the same body, as the document says
        example = example.replace('r.fcall("bf_enqueue_v3", 2,', f"r.eval({doc_client.enqueue_body!r}, 2,", 1)
    exec(compile(example, str(DOC), "exec"), {})
    printed = capsys.readouterr().out

    from batchfleet.producer import Client

    with Client(redis_url, namespace) as client:
        assert printed == client.generate("Hello", max_new_tokens=16, timeout=60).text + "\n"


def test_streamed_request_gives_deltas_then_the_result(doc_client):
    fleet = doc_client.fleet()
    ids = Tokenizer.from_str(fleet["tokenizer_json"]).encode(PROMPT).ids
    job = doc_client.enqueue(fleet, ids, max_new_tokens=200, temperature=0.0, stream=True)
    *deltas, result = doc_client.replies(job)
    assert result["kind"] == "result" and deltas and all(d["kind"] == "delta" for d in deltas)
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))
    joined = "".join(d["text"] for d in deltas)
    assert [d["offset"] for d in deltas] == [len("".join(d["text"] for d in deltas[:i])) for i in range(len(deltas))]
    assert result["text"].startswith(joined)
    streamed_ids = [t for d in deltas for t in d["token_ids"]]
    assert result["token_ids"][:len(streamed_ids)] == streamed_ids


def test_cancel_and_errors_as_documented(doc_client):
    fleet = doc_client.fleet()
    long = doc_client.enqueue(fleet, [5, 6, 7], max_new_tokens=400, stream=True)
    doc_client.cancel(long)
    final = doc_client.replies(long)[-1]
    assert final["kind"] == "error" and final["code"] == "cancelled"
    bad = doc_client.enqueue(fleet, [5, fleet["vocab_size"]], max_new_tokens=4)
    (error,) = doc_client.replies(bad)
    assert error["kind"] == "error" and error["code"] == "invalid_request" and error["message"]
    old = doc_client.enqueue(fleet, [5, 6], max_new_tokens=4, v=1)
    assert doc_client.replies(old)[-1]["code"] == "unsupported_schema"


def test_document_matches_the_code():
    from batchfleet.common.errors import ERROR_CODES
    from batchfleet.common.keys import Keys
    from batchfleet.common.redis.functions import CANCEL, ENQUEUE, FUNCTION_NAMES, LIBRARY_NAME
    from batchfleet.common.wire.guided import GUIDE_KINDS, Guide
    from batchfleet.common.wire.params import Params
    from batchfleet.common.wire.protocol import SCHEMA_VERSION, Delta, Error, FleetInfo, Request, Result

    def fields(obj) -> set[str]:
        return set(msgpack.unpackb(obj.encode(), raw=False))

    assert SCHEMA_VERSION == 5 and "`v` = 5" in DOC.read_text()
    assert lua_blocks() == [ENQUEUE.strip(), CANCEL.strip()]
    assert f"name={LIBRARY_NAME}" in DOC.read_text()
    assert all(f"FCALL {name} 2" in DOC.read_text() for name in FUNCTION_NAMES.values())
    full = Request(id="j", prompt=[1], params=Params(guide=Guide("json_object"), logprobs=0), kind="embed",
                   tenant="t")
    assert table_fields("### Request") | table_fields("### Request", 1) == fields(full)
    assert set(GUIDE_KINDS) == table_fields("### Request", 2)
    result = Result("j", [1], "a", "eos", 1, 1, 0.0, 0.0, 0.0, "w", 1, logprobs=[(-0.5, (1,), (-0.5,))],
                    embedding=[0.5])
    assert table_fields("### Result (`kind` = `result`)") == fields(result)
    assert table_fields("### Error (`kind` = `error`)") == fields(Error("j", "cancelled", "m"))
    assert table_fields("### Delta (`kind` = `delta`, only when `stream` was true)") == fields(
        Delta(id="j", seq=0, offset=0, text="", token_ids=[], logprobs=[]))
    assert table_fields("## 1. Read the fleet description") == fields(FleetInfo("m", "{}", (1,), 1, 1, 1, ()))
    assert table_fields("### Error (`kind` = `error`)", 1) == ERROR_CODES
    k = Keys("bf")
    for key in (k.fleet, k.workers, k.stream(128).replace("128", "<bucket>"),
                k.stream(128, "background").replace("128", "<bucket>"), k.inbox("<token>"),
                k.cancel("<id>"), k.cancels, k.done("<id>", k.inbox("<token>")), k.worker("<name>"), k.batches,
                k.dead, k.flush):
        assert f"`{key}`" in doc_section("## Keys"), key
