"""The Responses API routes, behind the API key:

    POST   /v1/responses                 create (``stream: true``: server-sent events, OpenAI's event types)
    GET    /v1/responses/{response_id}   a stored response
    GET    /v1/responses/{response_id}/input_items   its input items (``limit``, ``order``, ``after``)
    DELETE /v1/responses/{response_id}

A request is validated into a chat job (gateway/openai/responses/request.py) and runs on the chat route's path
(gateway/service.py ``results`` / ``streams``); the answer is shaped by gateway/openai/responses/format.py.
Stored responses (``store``, default true) live in Redis (gateway/openai/responses/store.py), per API key, and a
request naming one as ``previous_response_id`` continues its conversation: its answer (text and function
calls, gateway/openai/responses/items.py) is the conversation's last turn, a new turn's ``function_call_output``
items answer its calls.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from batchfleet.gateway.deps import KEY_CHECKED, Owner, Redis, Service
from batchfleet.gateway.errors import api_error, invalid
from batchfleet.gateway.openai.responses.format import ResponseShape
from batchfleet.gateway.openai.responses.items import answer_message, input_items
from batchfleet.gateway.openai.responses.request import parse_call
from batchfleet.gateway.service import tenant_of
from batchfleet.gateway.sse import EventStream
from batchfleet.gateway.strict import query_limit, query_order, read_json

router = APIRouter(dependencies=KEY_CHECKED)
log = logging.getLogger(__name__)
Save = Callable[[dict[str, Any]], Awaitable[None]]


@router.post("/v1/responses")
async def create(request: Request, gateway: Service, redis: Redis, owner: Owner) -> Any:
    config = gateway.config
    call = parse_call(await read_json(request, config.max_body_bytes))
    history: list[dict[str, Any]] = []
    if call.request.previous_response_id is not None:
        record = await redis.responses.load(owner, call.request.previous_response_id, "previous_response_id")
        history = record["messages"]
    job = call.job(history, config.request_timeout_s, config.chat_max_tokens)
    model = await gateway.check_model(job.model)
    family = await gateway.tool_family()
    job_id = uuid.uuid4().hex
    shape = ResponseShape(job_id, model, call.echo(), job.tools, family)
    asked = history + call.messages

    async def save(done: dict[str, Any]) -> None:
        if call.request.store is not False:  # the answer (text, function calls) continues the conversation
            await redis.responses.save(owner, done, [*asked, answer_message(done["output"])])

    headers = {"x-request-id": job_id}
    if job.stream:
        (stream,) = await gateway.streams(job, job_id, family, tenant_of(request))
        return EventStream(response_events(stream, shape, save, job.guide_param),
                           headers={**headers, **gateway.rate_headers(request)})
    (result,) = await gateway.results(request, job, job_id, family)
    done = shape.response(result)
    await save(done)
    return JSONResponse(done, headers={**headers, **gateway.rate_headers(request)})


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, redis: Redis, owner: Owner) -> Any:
    return (await redis.responses.load(owner, response_id))["response"]


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, redis: Redis, owner: Owner) -> Any:
    """OpenAI's cursor page of a stored response's input items (newest first by default). The query is read
    here, strictly (gateway/strict.py): a typed parameter would make FastAPI's validation error of a bad one."""
    limit, order = query_limit(request, 20, 100), query_order(request)
    after = request.query_params.get("after")
    record = await redis.responses.load(owner, response_id)
    items = input_items(response_id, record["messages"][:-1])  # the last message is the response's answer
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid(f"after: no input item {after[:100]!r} in this response", "after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, redis: Redis, owner: Owner) -> Any:
    await redis.responses.delete(owner, response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def response_events(stream: Any, shape: ResponseShape, save: Save,
                          guide_param: str | None) -> AsyncIterator[bytes]:
    """The events of one streamed response (gateway/openai/responses/format.py), its record stored before the
    last event is sent (a client that chains on it at once finds it). However the iteration ends, the
    stream is closed, which cancels its job if still running."""
    try:
        try:
            for event in shape.opening():
                yield event
            reader = shape.tool_stream()  # text passes until the answer's tool calls begin; those are held
            async for delta in stream:
                for event in shape.delta(delta.text if reader is None else reader.feed(delta.text)):
                    yield event
            held, calls = ("", []) if reader is None else reader.end(cut=stream.result.finish_reason == "length")
            for event in shape.delta(held):
                yield event
            done = shape.response(stream.result, calls=calls)
            await save(done)
            for event in shape.closing(done):
                yield event
        except Exception as exc:  # noqa: BLE001 - every failure becomes the error events OpenAI sends
            err = api_error(exc, guide_param)
            if err.status >= 500 and err.code not in ("timeout", "deadline_exceeded"):
                log.warning("response stream %s failed: %s", shape.id, exc)
            for event in shape.failure(err.body()["error"]):
                yield event
    finally:
        await asyncio.shield(stream.aclose())
