"""OpenAI batch input lines, pure: what is a malformed line (fails a batch) and what is a refused body (an
error line carrying the gateway's own answer); output ids read back; long lines read with bounded memory."""

from __future__ import annotations

import io
import json

import pytest

from batchfleet.gateway.batches.lines import (
    Limits,
    LineError,
    failure_line,
    parse_line,
    request_name,
    written_index,
)
from batchfleet.gateway.errors import APIError
from batchfleet.gateway.openai.chat.request import request_job
from batchfleet.producer.bulk.lines import MAX_LINE_BYTES, numbered

pytestmark = pytest.mark.unit
LIMITS = Limits(600.0, 256)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def line(**kw) -> str:
    return json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT, **kw})


@pytest.mark.parametrize("raw, code", [
    ("{not json", "invalid_json_line"),
    ("[1, 2]", "invalid_json_line"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}, "x": 1}', "invalid_request"),
    (line(custom_id=""), "invalid_request"),
    (line(custom_id=7), "invalid_request"),
    (line(method="GET"), "invalid_request"),
    (line(url="/v1/moderations"), "invalid_url"),
    (line(url="/v1/completions"), "mismatched_endpoint"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}', "invalid_request"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": NaN}', "invalid_json_line"),
])
def test_malformed_lines_are_line_errors_with_their_line_number(raw, code):
    with pytest.raises(LineError) as err:
        parse_line(raw, 4, LIMITS, "/v1/chat/completions")
    assert err.value.code == code and err.value.line == 5 and err.value.message.startswith("line 5: ")


def test_a_repeated_custom_id_is_malformed_and_the_first_is_not():
    seen: set[str] = set()
    assert parse_line(line(), 0, LIMITS, None, seen).job is not None
    with pytest.raises(LineError) as err:
        parse_line(line(), 1, LIMITS, None, seen)
    assert err.value.code == "duplicate_custom_id"


@pytest.mark.parametrize("body", [{"messages": []}, {**CHAT, "temperature": "hot"}, {**CHAT, "bogus": 1},
                                  {**CHAT, "stream": True}, "not an object"])
def test_a_body_the_gateway_refuses_is_an_error_with_the_gateways_answer(body):
    parsed = parse_line(line(body=body), 0, LIMITS)
    assert parsed.job is None and isinstance(parsed.error, APIError) and parsed.error.status == 400
    if body != {**CHAT, "stream": True}:  # stream is refused only in a batch
        with pytest.raises(APIError) as gateway:
            request_job(True, body, LIMITS.timeout_cap, LIMITS.chat_max_tokens)
        assert gateway.value.body() == parsed.error.body()


def test_output_ids_give_back_their_line_number_for_this_run_only():
    assert written_index({"id": request_name("qabc", 17)}, "qabc") == 17
    assert written_index({"id": request_name("qabc", 17)}, "qother") is None
    assert written_index(failure_line("qabc", 3, None, "c", "m"), "qabc") == 3
    assert written_index({"id": "batch_req_qabc_x"}, "qabc") is None and written_index([], "qabc") is None


def test_numbered_skips_blank_lines_and_never_reads_a_huge_line_whole():
    data = b"a\n\n" + b"x" * (3 * MAX_LINE_BYTES) + b"\nb\nc"
    out = list(numbered(io.BytesIO(data)))
    assert [i for i, _ in out] == [0, 2, 3, 4]
    assert out[0][1] == b"a\n" and out[2][1] == b"b\n" and out[3][1] == b"c"
    with pytest.raises(LineError) as err:
        parse_line(out[1][1], out[1][0], LIMITS)
    assert err.value.code == "line_too_long" and err.value.line == 3


def test_validating_a_large_input_holds_one_line_at_a_time(tmp_path):
    import tracemalloc

    from batchfleet.gateway.batches.runner import validate

    body = {"messages": [{"role": "user", "content": "x" * 10_000}], "max_tokens": 4}
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(800):  # ~8 MB: nearly 3x the peak allowed
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    tracemalloc.start()
    try:
        total, errors = validate(str(path), "/v1/chat/completions", LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert total == 800 and errors == []
    assert peak < 3 << 20, f"peak {peak / 2**20:.1f} MiB for a {path.stat().st_size / 2**20:.0f} MiB file"


def test_a_responses_line_is_a_chat_job_and_cannot_chain():
    body = {"input": "hi", "instructions": "Be brief.", "max_output_tokens": 4}
    parsed = parse_line(line(url="/v1/responses", body=body), 0, LIMITS, "/v1/responses")
    assert parsed.error is None and parsed.call is not None and parsed.job.max_tokens_field == "max_output_tokens"
    assert parsed.job.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    chained = parse_line(line(url="/v1/responses", body={**body, "previous_response_id": "resp_1"}), 1, LIMITS)
    assert chained.job is None and chained.error.param == "previous_response_id"
    streamed = parse_line(line(url="/v1/responses", body={**body, "stream": True}), 2, LIMITS)
    assert streamed.job is None and streamed.error.param == "stream"


def test_an_embeddings_line_is_one_job_per_input():
    body = {"input": ["a", "bc"], "encoding_format": "base64"}
    parsed = parse_line(line(url="/v1/embeddings", body=body), 0, LIMITS, "/v1/embeddings")
    assert parsed.error is None and parsed.job.inputs == ["a", "bc"] and parsed.job.encoding_format == "base64"
    refused = parse_line(line(url="/v1/embeddings", body={"input": "a", "dimensions": 4}), 1, LIMITS)
    assert refused.job is None and refused.error.param == "dimensions"
