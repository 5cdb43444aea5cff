"""The OpenAI inference routes, all behind the API key:

    POST /v1/completions        POST /v1/chat/completions   (``stream: true``: server-sent events)
    GET  /v1/models             GET  /v1/models/{model_id}

Each validates its body (gateway/openai/chat/request.py) and hands the job to the Gateway (gateway/service.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request

from batchfleet.common.wire.protocol import FleetInfo
from batchfleet.gateway.deps import KEY_CHECKED, Service
from batchfleet.gateway.openai.chat.request import request_job
from batchfleet.gateway.strict import read_json

router = APIRouter(dependencies=KEY_CHECKED)


@router.post("/v1/completions")
async def completions(request: Request, gateway: Service) -> Any:
    config = gateway.config
    body = await read_json(request, config.max_body_bytes)
    job = request_job(False, body, config.request_timeout_s, config.chat_max_tokens)
    return await gateway.complete(request, job, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, gateway: Service) -> Any:
    config = gateway.config
    body = await read_json(request, config.max_body_bytes)
    job = request_job(True, body, config.request_timeout_s, config.chat_max_tokens)
    return await gateway.complete(request, job, chat=True)


@router.get("/v1/models")
async def models(gateway: Service) -> Any:
    info = (await gateway.client.fleet()).info
    return {"object": "list", "data": [model_object(name, info) for name in await gateway.model_names()]}


@router.get("/v1/models/{model_id:path}")  # :path: ids like "org/model" hold a slash
async def model(model_id: str, gateway: Service) -> Any:
    await gateway.check_model(model_id, param=None)
    return model_object(model_id, (await gateway.client.fleet()).info)


def model_object(name: str, info: FleetInfo) -> dict[str, Any]:
    """A model object in OpenAI's shape (plus vLLM's ``root``: the model the fleet serves, ``parent``,
    ``max_model_len``, and the largest prompt bucket)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "batchfleet", "root": info.model,
            "parent": None, "max_model_len": info.max_seq_len, "max_prompt_tokens": info.buckets[-1]}
