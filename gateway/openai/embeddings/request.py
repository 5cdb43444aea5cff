"""Request bodies of /v1/embeddings, validated into an ``EmbedJob`` (one prompt per input), and the answer
in OpenAI's shape. Pure: shared by the route (gateway/openai/embeddings/routes.py) and batch lines
(gateway/batches/lines.py).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictInt, StrictStr

from batchfleet.common.wire.priority import priority_of
from batchfleet.common.wire.protocol import Result
from batchfleet.gateway.errors import APIError, invalid
from batchfleet.gateway.openai.chat.request import STRICT, Number, TokenIds, parse
from batchfleet.producer.ask import Ask

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(BaseModel):
    model_config = STRICT
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    timeout: Number | None = Field(default=None, gt=0.0)
    service_tier: Literal["auto", "default", "flex"] | None = None
    priority: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)


@dataclass(frozen=True)
class EmbedJob:
    """A validated request: one prompt per input, what each asks (one Ask, made here: an embed request in the
    request's priority) and how to answer."""

    inputs: list[str | list[int]]
    model: str | None
    encoding_format: str
    timeout: float
    ask: Ask


def embed_job(body: Any, timeout_cap: float) -> EmbedJob:
    """A decoded /v1/embeddings body, checked (a 400 naming the field otherwise): the one path for the
    route and for batch lines."""
    req: EmbeddingRequest = parse(EmbeddingRequest, body)
    raw = req.input
    inputs: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not inputs:
        raise invalid("input must not be empty", "input")
    if len(inputs) > MAX_INPUTS:
        raise invalid(f"input holds {len(inputs)} items; at most {MAX_INPUTS} per request", "input")
    for i, item in enumerate(inputs):
        if len(item) == 0:
            raise invalid(f"input item {i} is empty", "input")
    if req.dimensions is not None:
        raise invalid("dimensions is not supported: the served model is not trained for shortened embeddings "
                      "(Matryoshka); leave it out to get the full vector", "dimensions")
    if req.priority is not None and req.service_tier is not None and priority_of(req.priority) != priority_of(
            req.service_tier):
        raise invalid(f"priority {req.priority} contradicts service_tier {req.service_tier!r}", "priority")
    priority = priority_of(req.priority if req.priority is not None else req.service_tier or "auto")
    return EmbedJob(inputs, req.model, req.encoding_format or "float", min(req.timeout or timeout_cap, timeout_cap),
                    Ask.embed(priority))


def check_vocabulary(inputs: list[str | list[int]], vocab_size: int) -> None:
    """A 400 naming ``input`` for a token-id input with an id outside the served model's vocabulary: token ids
    are the model's own. LangChain's ``OpenAIEmbeddings`` sends tiktoken's ids (OpenAI's vocabulary) unless
    made with ``check_embedding_ctx_length=False``: the message says so."""
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            continue
        bad = next((t for t in item if not 0 <= t < vocab_size), None)
        if bad is not None:
            where = "input" if len(inputs) == 1 else f"input[{i}]"
            raise invalid(f"{where} holds token id {bad}, outside the served model's vocabulary of {vocab_size} "
                          f"tokens (ids 0 to {vocab_size - 1}): send text, or the served model's own token ids. "
                          "LangChain's OpenAIEmbeddings sends OpenAI's tiktoken ids by default: create it with "
                          "OpenAIEmbeddings(..., check_embedding_ctx_length=False) to send text", "input")


def embedding_response(results: list[Result], model: str, encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings list, one item per input, in input order."""
    if any(r.embedding is None for r in results):  # a worker from before embed requests generated instead
        raise APIError(502, "the worker that answered does not serve embeddings (it predates embed requests): "
                       "upgrade the fleet's workers", "server_error", "embeddings_unsupported")
    data = []
    for index, result in enumerate(results):
        vector = result.embedding
        value: Any = vector if encoding_format == "float" else base64.b64encode(
            struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": value})
    tokens = sum(r.prompt_tokens for r in results)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def too_long(exc: Exception) -> APIError:
    """The 400 for an input too long for the fleet's largest bucket."""
    return invalid(str(exc).replace("max_new_tokens", "input"), "input", "context_length_exceeded")
