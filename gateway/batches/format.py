"""OpenAI batch lines as a bulk line format: what the producer's one bulk runner (producer/bulk/runner.py) runs
for the gateway's batches (gateway/batches/runner.py) and for ``batchfleet bulk --format openai``.

A line is parsed with the gateway's own validation (gateway/batches/lines.py); its jobs are named
``<prefix>.<line number>.<line fingerprint>`` (``-<choice>`` when ``n`` > 1), submitted at background priority
whatever the body says, and its answer is the response the gateway's route would give, in an OpenAI batch
output line (status 200) or error line. Answers are written as they come: OpenAI's output order is not the
input's. Written lines read back by their ``id``, which ends with the input line number and fingerprint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchfleet.common.errors import PromptTooLong
from batchfleet.common.wire.priority import BACKGROUND
from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.batches.lines import (
    BatchLine,
    Limits,
    LineError,
    custom_id_of,
    failure_line,
    line_code,
    parse_line,
    response_line,
    written_index,
    written_sha,
)
from batchfleet.gateway.errors import api_error
from batchfleet.gateway.openai.chat.format import Shape
from batchfleet.gateway.openai.embeddings.request import EmbedJob, check_vocabulary, embedding_response
from batchfleet.gateway.openai.embeddings.request import too_long as input_too_long
from batchfleet.gateway.openai.responses.format import ResponseShape
from batchfleet.gateway.openai.tools.parsers import Family, pick
from batchfleet.gateway.service import echoed, job_asks, token_texts, too_long, unknown_model
from batchfleet.producer.ask import Ask
from batchfleet.producer.bulk.lines import line_sha
from batchfleet.producer.bulk.prefix_order import prefix_key
from batchfleet.producer.bulk.work import Work

BULK_TIMEOUT_S = 24 * 3600.0  # a bulk line's deadline without --timeout: OpenAI's completion window


@dataclass
class OpenAIFormat:
    """``LineFormat`` of OpenAI batch lines. ``strict``: the lines were validated already (the gateway's
    batches), so a malformed one is a bug and ends the run; else it is an error line of its own.
    ``model_names`` and ``fleet`` (the client's fleet view) are needed only once lines run."""

    prefix: str
    limits: Limits
    model_names: tuple[str, ...] = ()
    fleet: Any = None
    endpoint: str | None = None  # the batch's url (None: each line names its own)
    strict: bool = False
    alias_any: bool = False  # answer whatever model a line names, with the served one (--model-alias-any)
    seen: set[str] = field(default_factory=set)  # custom_ids met so far
    texts: Callable[[int], str] | None = None
    ordered = False
    check_answered = True  # an output cut short by hand: its lines run again under fresh ids
    refused: tuple[type[BaseException], ...] = (Exception,)  # the client's checks (InvalidRequest, ...)

    def stem(self, line: BatchLine) -> str:
        return f"{self.prefix}.{line.index}.{line.sha}"

    def parse(self, index: int, raw: bytes) -> Work:
        try:
            line = parse_line(raw, index, self.limits, self.endpoint, self.seen)
        except LineError as exc:
            if self.strict:
                raise
            return Work(index, raw, error=failure_line(self.prefix, index, custom_id_of(raw), exc.code, exc.message,
                                                       line_sha(raw)))
        if line.job is None:
            assert line.error is not None
            return Work(index, line, error=self.refusal(line, line.error.status, line.error.body()))
        stem = self.stem(line)
        if isinstance(line.job, EmbedJob):  # one job per input
            inputs = line.job.inputs
            ids = [stem] if len(inputs) == 1 else [f"{stem}-{i}" for i in range(len(inputs))]
            return Work(index, line, ids, inputs[0], prefix_key(inputs[0]), line.job.timeout, prompts=inputs)
        ids = [stem] if line.job.n == 1 else [f"{stem}-{i}" for i in range(line.job.n)]
        return Work(index, line, ids, line.job.prompt, prefix_key(line.job.prompt), line.job.timeout)

    def sha(self, raw: bytes) -> str:
        return line_sha(raw)  # a JSON line: its text is what it asks

    async def asks(self, work: Work) -> list[Ask]:
        job = work.line.job
        error = unknown_model(job.model, self.model_names, any_name=self.alias_any)
        if error is not None:
            raise error
        # background work, whatever the body says
        if isinstance(job, EmbedJob):
            if self.fleet is not None:  # token ids of another vocabulary (tiktoken's): 400 naming input
                check_vocabulary(job.inputs, self.fleet.info.vocab_size)
            return [Ask.embed(BACKGROUND)] * len(job.inputs)
        return await job_asks(job, self.family(), BACKGROUND)

    def family(self) -> Family:
        """The served model's tool-call format, from the fleet's chat template (gateway/openai/tools/parsers.py)."""
        return pick("auto", self.fleet.info.chat_template if self.fleet is not None else "")

    def refusal(self, line: BatchLine, status: int, body: dict) -> dict:
        return response_line(self.prefix, line, self.stem(line), status, body)

    def answer(self, work: Work, results: list[Result]) -> dict:
        line: BatchLine = work.line
        assert line.job is not None and self.fleet is not None
        if isinstance(line.job, EmbedJob):
            return self.refusal(line, 200, embedding_response(results, self.model_names[0], line.job.encoding_format))
        if self.texts is None:
            self.texts = token_texts(self.fleet.tokenizer)
        if line.call is not None:  # a /v1/responses line: not stored (a batch's output file is its record)
            response = ResponseShape(self.stem(line), self.model_names[0], {**line.call.echo(), "store": False},
                                     line.job.tools, self.family())
            return self.refusal(line, 200, response.response(results[0]))
        shape = Shape(chat=line.chat, job_id=self.stem(line), model=self.model_names[0],
                      created=int(time.time()), fingerprint=self.fleet.info.fingerprint or None,
                      token_text=None if line.job.logprobs is None else self.texts, tools=line.job.tools,
                      family=self.family())
        return self.refusal(line, 200, echoed(shape, line.job, self.fleet.tokenizer).response(results))

    def failure(self, work: Work, exc: BaseException) -> dict:
        line: BatchLine = work.line
        if isinstance(line.job, EmbedJob):
            error = input_too_long(exc) if isinstance(exc, PromptTooLong) else api_error(exc)
            return self.refusal(line, error.status, error.body())
        error = too_long(exc, line.job) if isinstance(exc, PromptTooLong) and line.job else api_error(
            exc, line.job.guide_param if line.job else None)  # a guide_failed names the line's guide field
        return self.refusal(line, error.status, error.body())

    def abandoned(self, index: int, line: Any, code: str, message: str) -> dict:
        if isinstance(line, BatchLine):
            return failure_line(self.prefix, index, line.custom_id, code, message, line.sha)
        return failure_line(self.prefix, index, custom_id_of(line), code, message, line_sha(line))

    def index_of(self, obj: Any) -> int | None:
        return written_index(obj, self.prefix)

    def sha_of(self, obj: dict) -> str | None:
        return written_sha(obj, self.prefix)

    def failed(self, obj: dict) -> bool:
        return obj.get("error") is not None or (obj.get("response") or {}).get("status_code") != 200

    def code_of(self, obj: dict) -> str:
        return line_code(obj)


def bulk_format(timeout: float | None, model_names: tuple[str, ...], alias_any: bool = False,
                chat_max_tokens: int = 256) -> Callable[[str, Any], OpenAIFormat]:
    """``batchfleet bulk --format openai``'s format, for producer/bulk/file_run.py ``run_file``: each line's deadline
    ``timeout`` (default: OpenAI's completion window), the models lines may name (default: the fleet's;
    ``alias_any``: any)."""
    def make(prefix: str, fleet: Any) -> OpenAIFormat:
        return OpenAIFormat(prefix, Limits(timeout or BULK_TIMEOUT_S, chat_max_tokens),
                            model_names or (fleet.info.model,), fleet, alias_any=alias_any)
    return make
