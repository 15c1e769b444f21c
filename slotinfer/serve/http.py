"""The HTTP shell around the routes: API keys, bounded JSON bodies, disconnects, event streams."""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.requests import Request
from starlette.responses import StreamingResponse

from .errors import APIError


def check_key(request: Request, api_key: str | None):
    """401 unless the request carries ``Authorization: Bearer KEY`` (no check when no key is set)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' with the server's key",
                       code="invalid_api_key")


async def read_json(request: Request, limit: int, timeout: float) -> dict:
    """The body as a JSON object: 413 past ``limit`` bytes (declared or received), 408 unless it has
    all arrived within ``timeout`` seconds, 400 if not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks = []

    async def receive():
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s; send it at once",
                       code="request_timeout", headers={"Connection": "close"}) from None
    try:
        body = json.loads(b"".join(chunks))
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply to read; no parameter nests more than a few "
                            "levels") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    return body


class EventStream(StreamingResponse):
    """Server-sent events whose rows are cancelled however the response ends, even when the
    client leaves before the body's generator first runs (its ``finally`` would never run)."""

    def __init__(self, events, handles):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._handles = handles

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for h in self._handles:
                h.cancel()  # a no-op for rows that ended


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over the server's limit of {limit} bytes", code="request_too_large")


async def disconnected(request: Request):
    """Returns once the client has gone away (the body was read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
