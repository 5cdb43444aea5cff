"""What route handlers get from the app, as FastAPI dependencies: the API-key check (declared once per
router) and the app's state (``request.app.state``, filled by gateway/app.py at startup).

    Service  the Gateway (gateway/service.py): config, AsyncClient, the request logic
    Redis    the process' connections (gateway/connections.py): the stores, the dashboard pool
    Owner    the caller's owner name for the files and batches API (its key checked first)
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from fastapi import Depends
from starlette.requests import Request

from batchfleet.gateway.connections import GatewayRedis
from batchfleet.gateway.service import Gateway


async def service(request: Request) -> Gateway:
    return request.app.state.gateway


async def connections(request: Request) -> GatewayRedis:
    return request.app.state.redis


async def authorize(request: Request) -> None:
    """401 unless the request carries one of the API keys (or none are configured): gateway/service.py."""
    request.app.state.gateway.authorize(request)


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
