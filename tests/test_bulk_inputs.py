"""What a bulk run trusts, without a fleet: answers carry their input line's fingerprint; a rerun drops the
answers whose line changed (and, asked, the error lines) and refuses other run parameters; plain-text files
are read as one prompt per line; every API parameter is a line key; progress lines and the top error codes
read as the docs say; uploaded names are sanitised and ``expires_after`` is checked."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from batchfleet.common.wire.params import FIELDS
from batchfleet.gateway.batches.expiry import expiry_seconds, form_expiry
from batchfleet.gateway.batches.format import OpenAIFormat
from batchfleet.gateway.batches.lines import Limits, line_code
from batchfleet.gateway.batches.store import safe_name
from batchfleet.gateway.cli.bulk import detect
from batchfleet.gateway.cli.bulk_progress import EXIT_CODES, progress_line
from batchfleet.gateway.errors import APIError
from batchfleet.producer.ask import STRUCTURED
from batchfleet.producer.bulk.file_run import Fingerprints, verdict
from batchfleet.producer.bulk.files import RunChanged, read_back, run_record
from batchfleet.producer.bulk.lines import LINE_KEYS, SHA_KEY, PromptFormat, line_sha
from batchfleet.producer.bulk.report import why_failed
from batchfleet.producer.bulk.work import Summary

pytestmark = pytest.mark.unit


def test_every_api_parameter_is_a_line_key():
    assert set(FIELDS) - {"guide"} <= LINE_KEYS and set(STRUCTURED) <= LINE_KEYS
    fmt = PromptFormat("bx")
    work = fmt.parse(0, json.dumps({"prompt": "p", "min_p": 0.1, "logprobs": 2, "guided_choice": ["a", "b"],
                                    "repetition_penalty": 1.2}).encode())
    assert work.error is None


def test_answers_carry_their_line_fingerprint_and_jobs_are_named_after_it():
    fmt = PromptFormat("bx")
    a, b = fmt.parse(0, b'{"prompt": "a", "id": "q"}\n'), PromptFormat("bx").parse(0, b'{"prompt": "b", "id": "q"}\n')
    assert a.job_ids != b.job_ids  # a line changed since an interrupted run never collects the old answer
    assert fmt.answer(a, [_result()])[SHA_KEY] == line_sha(b'{"prompt": "a", "id": "q"}')
    bad = PromptFormat("bx").parse(3, b"not json at all\n")
    assert bad.error[SHA_KEY] == line_sha(b"not json at all") and "--format text" in bad.error["error"]["message"]


def test_plain_text_lines_are_prompts_and_detection_tells_them_apart():
    fmt = PromptFormat("bx", text=True)
    work = fmt.parse(0, b'What is 2+2? {"not": json}\r\n')
    assert work.error is None and work.prompt == 'What is 2+2? {"not": json}'
    assert PromptFormat("bx", text=True).parse(0, b"\xff\xfe\n").error["error"]["code"] == "invalid_request"
    assert detect(b"Tell me a joke\n") == "text"
    assert detect(b'{"prompt": "x"}\n') == detect(b'"x"\n') == detect(b"{broken\n") == "prompts"
    assert detect(b'{"custom_id": "a", "body": {}}\n') == "openai"


def _result():
    from batchfleet.common.wire.protocol import Result
    return Result("j", [1], "x", "length", 1, 1, 0.0, 0.0, 0.0, "w", 1)


def _written(tmp_path, lines: list[bytes], answers: list[dict]) -> tuple:
    prints = Fingerprints()
    for i, raw in enumerate(lines):
        prints.add(i, line_sha(raw))
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(a) + "\n" for a in answers) + '{"index": 9, "tru')  # a cut-off last line
    return prints, out


def test_a_rerun_keeps_only_answers_whose_line_is_unchanged_and_retries_errors_when_asked(tmp_path):
    lines = [b'{"prompt": "a"}', b'{"prompt": "B changed"}', b'{"prompt": "c"}']
    answers = [{"index": 0, SHA_KEY: line_sha(lines[0]), "result": {}},
               {"index": 1, SHA_KEY: line_sha(b'{"prompt": "b"}'), "result": {}},  # its line changed since
               {"index": 2, SHA_KEY: line_sha(lines[2]), "error": {"code": "deadline_exceeded", "message": "m"}},
               {"index": 7, "result": {}}]  # no fingerprint (or a line gone): not kept
    prints, out = _written(tmp_path, lines, answers)
    kept = read_back(str(out), PromptFormat("bx"), verdict=verdict(prints, retry_errors=False))
    assert kept.done == {0, 2} and kept.dropped == {1: "changed", 7: "changed"}
    assert kept.codes == Counter({"deadline_exceeded": 1})
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == [0, 2]  # rewritten without them
    again = read_back(str(out), PromptFormat("bx"), verdict=verdict(prints, retry_errors=True))
    assert again.done == {0} and again.dropped == {2: "retry"}
    assert [json.loads(x)["index"] for x in out.read_text().splitlines()] == [0]


def test_the_run_record_refuses_other_parameters_and_keeps_retry_tags(tmp_path):
    out = tmp_path / "out.jsonl"
    first, resumed = run_record(str(out), True, {"defaults": {"max_new_tokens": 16, "stop": ("x",)}})
    out.write_text("")
    same, resumed = run_record(str(out), True, {"defaults": {"max_new_tokens": 16, "stop": ["x"]}})
    assert resumed and same.names == first.names
    with pytest.raises(RunChanged, match=r"max_new_tokens.*16 -> 32.*--no-resume"):
        run_record(str(out), True, {"defaults": {"max_new_tokens": 32, "stop": ["x"]}})
    same.fresh[4] = "abcd1234"
    same.save(str(out) + ".run")
    back, _ = run_record(str(out), True, {"defaults": {"max_new_tokens": 16, "stop": ["x"]}})
    assert back.fresh == {4: "abcd1234"}
    (tmp_path / "out.jsonl.run").write_text(first.names.key + "\n")  # an older record: the bare key
    old, resumed = run_record(str(out), True, {"defaults": {}})
    assert resumed and old.names == first.names
    over, resumed = run_record(str(out), False, {"defaults": {"max_new_tokens": 32}})
    assert not resumed and over.names != first.names


def test_openai_lines_carry_the_fingerprint_in_their_id():
    fmt = OpenAIFormat("qabc", Limits(60, 16), ("tiny",))
    raw = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                      "body": {"model": "gpt-4o-mini", "prompt": "x"}}).encode()
    work = fmt.parse(5, raw)
    line = fmt.abandoned(5, work.line, "batch_expired", "m")
    assert fmt.index_of(line) == 5 and fmt.sha_of(line) == line_sha(raw) and work.job_ids[0].endswith(line_sha(raw))
    assert fmt.code_of(line) == line_code(line) == "batch_expired"


def test_why_lines_failed_names_the_top_codes_with_a_hint():
    why = why_failed(Counter({"model_not_found": 20, "deadline_exceeded": 2, "x": 1, "y": 1}))
    assert why.startswith("failed lines by error code: model_not_found 20 (serve this name with "
                          "--served-model-name") and "; 1 more" in why
    assert why_failed(Counter()) is None


def test_progress_lines_say_count_rate_and_eta():
    s = Summary(total=10_000, kept=200, written=1000)
    assert progress_line("prompts", s, 100.0, 10.0) == "prompts: 1200/10000 (12%), 10.0/s, ETA 14m40s"
    assert progress_line("prompts", s, 100.0, None) == "prompts: 1200/10000 (12%), measuring the rate"
    assert EXIT_CODES == {2: 130, 15: 143}


def test_uploaded_names_are_sanitised_and_expiry_is_checked():
    assert safe_name("../../etc/x") == "x" and safe_name('a"b\r\n.jsonl') == "a_b__.jsonl"
    assert safe_name("..") == safe_name("") == "upload.jsonl"
    assert expiry_seconds({"anchor": "created_at", "seconds": 3600}, "f") == 3600 and expiry_seconds(None, "f") is None
    for bad in ({"anchor": "created_at", "seconds": 10}, {"anchor": "last_active_at", "seconds": 3600}, "x"):
        with pytest.raises(APIError):
            expiry_seconds(bad, "expires_after")
    assert form_expiry({"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}) == 7200
    assert form_expiry({"purpose": "batch"}) is None
