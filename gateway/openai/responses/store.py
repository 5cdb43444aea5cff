"""Stored Responses API responses (``store: true``, OpenAI's default), in Redis under ``Keys.response``: one
JSON value per response, written once it finished, expiring after the gateway's ``--response-ttl``.

A record holds the response object (what GET /v1/responses/{id} answers), its owner (a digest of the
caller's API key: gateway/deps.py ``Owner``; another key's response is "not found", as another key's
batch is) and the conversation it ends: the messages it was asked (without ``instructions``, which OpenAI
does not carry over) and its answer, which a request naming it as ``previous_response_id`` continues.
It uses the AsyncClient's connection pool (gateway/connections.py); no client of its own.
"""

from __future__ import annotations

import json
from typing import Any

from batchfleet.common.keys import Keys, valid_job_id
from batchfleet.gateway.errors import APIError

MAX_RECORD_BYTES = 8 << 20  # a chained conversation grows with each turn; past this it is refused


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no response with id {response_id[:200]!r} (never stored, deleted, expired, or "
                    "another API key's)", "invalid_request_error", "response_not_found", param)


class ResponseStore:
    def __init__(self, r: Any, keys: Keys, ttl_s: float) -> None:
        self.r = r
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)

    def _key(self, response_id: str) -> str | None:
        """The record's key; None for an id no stored response can have (never a key built from junk)."""
        rid = response_id.removeprefix("resp_")
        return self.keys.response(rid) if response_id.startswith("resp_") and valid_job_id(rid) else None

    async def save(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Store a finished response and the conversation it ends (a 400 when that is too large to keep)."""
        key = self._key(response["id"])
        assert key is not None, response["id"]
        data = json.dumps({"owner": owner, "response": response, "messages": messages},
                          ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) > MAX_RECORD_BYTES:
            raise APIError(400, f"the conversation is too long to store ({len(data)} bytes, at most "
                           f"{MAX_RECORD_BYTES}); send store: false", "invalid_request_error", "invalid_request",
                           "store")
        await self.r.set(key, data, px=self.ttl_ms)

    async def load(self, owner: str, response_id: str, param: str | None = None) -> dict[str, Any]:
        """The record of ``response_id`` (a 404 when there is none for this owner)."""
        key = self._key(response_id)
        raw = None if key is None else await self.r.get(key)
        record = None if raw is None else json.loads(raw)
        if record is None or record.get("owner") != owner:
            raise not_found(response_id, param)
        return record

    async def delete(self, owner: str, response_id: str) -> None:
        """Delete a stored response (a 404 when there is none for this owner)."""
        await self.load(owner, response_id)
        key = self._key(response_id)
        assert key is not None
        await self.r.delete(key)
