"""What route handlers get from the app, as FastAPI dependencies: the API-key check (declared once per
router) and the app's state (``request.app.state``, filled by gateway/app.py at startup).

    Service  the Gateway (gateway/service.py): config, AsyncClient, the request logic
    Redis    the process' connections (gateway/connections.py): the stores, the dashboard pool
    Owner    the caller's owner name for the files and batches API (its key checked first)
    OPERATOR_CHECKED  the fleet's state (/dashboard/data, /metrics): operator keys first (``operator``)
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import Depends
from starlette.requests import Request

from batchfleet.gateway.connections import GatewayRedis
from batchfleet.gateway.errors import APIError
from batchfleet.gateway.service import Gateway
from batchfleet.producer.ops.dashboard import ACCESS_ERRORS, access


async def service(request: Request) -> Gateway:
    return request.app.state.gateway


async def connections(request: Request) -> GatewayRedis:
    return request.app.state.redis


async def authorize(request: Request) -> None:
    """401 unless the request carries one of the API keys (or none are configured): gateway/service.py."""
    request.app.state.gateway.authorize(request)


async def operator(request: Request) -> None:
    """The rule of the routes that show the fleet's state (/dashboard/data, /metrics), as ``batchfleet
    dashboard``'s (producer/ops/dashboard.py ``access``): a read-only operator key where ``--operator-key``
    is set (an API key: 403), else an API key where keys are set (401 otherwise), else anyone."""
    config = request.app.state.config
    status = access(request.headers.get("authorization"), config.api_keys, config.operator_keys)
    if status != 200:
        message, code = ACCESS_ERRORS[status]
        raise APIError(status, message, "invalid_request_error" if status == 401 else "permission_error", code,
                       headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


async def owner(request: Request, _: None = Depends(authorize)) -> str:
    """The caller's owner name: a digest of its API key ("public" when the gateway has no keys)."""
    if not request.app.state.gateway.config.api_keys:
        return "public"
    key = request.headers["authorization"].partition(" ")[2].strip()
    return hashlib.sha256(key.encode()).hexdigest()[:32]


Service = Annotated[Gateway, Depends(service)]
Redis = Annotated[GatewayRedis, Depends(connections)]
Owner = Annotated[str, Depends(owner)]
KEY_CHECKED = [Depends(authorize)]  # a router's ``dependencies``: every route behind the API key
OPERATOR_CHECKED = [Depends(operator)]  # a route's ``dependencies``: behind the operator key (``operator``)
