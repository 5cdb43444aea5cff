"""The app's exception handlers: whatever a route (or a dependency, such as the API-key check) raises is
answered with an OpenAI error body (gateway/errors.py maps exceptions to statuses). A request FastAPI
itself refuses (a path or query parameter of the wrong type) is a 400, never a 500. Under ``/v1`` the API
key comes first: an unknown path or method answers 401/403 to a caller without an API key (no key, a wrong
one, an operator key), 404/405 only to one with a key, so the API's shape is no secret from a stranger."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from batchfleet.common.errors import BatchfleetError, RateLimited
from batchfleet.gateway.errors import APIError, api_error, invalid
from batchfleet.gateway.service import CLIENT_CLOSED

log = logging.getLogger("batchfleet.gateway.app")  # the name these logs always had


def add_error_handlers(app: FastAPI) -> None:
    for exc_type in (APIError, BatchfleetError, ValueError, Exception):
        app.add_exception_handler(exc_type, error_response)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)


async def error_response(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ClientDisconnect):  # gone before its body was read: nobody to answer, nothing wrong
        log.debug("%s %s: client disconnected before sending its body", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED)
    err = api_error(exc)
    if isinstance(exc, RateLimited):  # only a configured tenant has limits: a bounded label
        request.app.state.metrics.rate_limited.labels(getattr(request.state, "tenant", "") or "default",
                                                      exc.limit).inc()
    if err.status == 500:
        log.error("%s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (404 unknown path, 405 wrong method) with an OpenAI error body; the message names the
    request (as OpenAI's ``Invalid URL (POST /v1/x)``) and the endpoints this gateway serves."""
    assert isinstance(exc, HTTPException)
    if exc.status_code in (404, 405) and keyed(request.url.path):
        try:
            request.app.state.gateway.authorize(request)
        except APIError as refused:
            return await error_response(request, refused)
    message = str(exc.detail)
    if exc.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
        what = "Invalid URL" if exc.status_code == 404 else "Method not allowed"
        message = f"{what} ({request.method} {request.url.path[:200]}); this gateway serves {served(request)}"
    err = APIError(exc.status_code, message, "invalid_request_error", None)
    return JSONResponse(err.body(), status_code=err.status, headers=dict(exc.headers or {}))


async def validation_error(request: Request, exc: Exception) -> Response:
    """A request FastAPI's own checks refused (the routes read their bodies and queries themselves: this is
    the safety net): a 400 naming the first parameter at fault."""
    assert isinstance(exc, RequestValidationError)
    first = next(iter(exc.errors()), {})
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = f"{param or 'the request'}: {first.get('msg', 'invalid')}"[:300]
    return await error_response(request, invalid(message, param))


def keyed(path: str) -> bool:
    """Whether ``path`` is under the API (``/v1``), whose every route is behind the API key."""
    return path == "/v1" or path.startswith("/v1/")


def served(request: Request) -> str:
    """The app's endpoints (``create_app`` lists them from its routers: ``endpoints``)."""
    return ", ".join(getattr(request.app.state, "endpoints", ()))


def endpoints(routers: Iterable[APIRouter]) -> tuple[str, ...]:
    """``METHOD /path`` of every route of ``routers`` (HEAD left out: it comes with every GET; routes left out
    of the schema, such as the icon, too: an unknown route's 404 names the API)."""
    return tuple(f"{'|'.join(sorted(set(r.methods) - {'HEAD'}))} {r.path.replace(':path', '')}" for router in routers
                 for r in router.routes if isinstance(r, APIRoute) and r.include_in_schema)
