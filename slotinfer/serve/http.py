"""The HTTP shell around the routes: API keys, bounded JSON bodies, disconnects, event streams."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .errors import APIError

# What the server still reads of a body it refused as too large, so that the client can read the 413:
# closing a socket with unread bytes makes the kernel reset the connection, and a client that reads its
# answer only once it has sent its whole body (urllib, any `Connection: close` client) then sees
# ECONNRESET.  Past this much, or past the read timeout, the connection is closed as is.
DRAIN_BYTES = 64 << 20


def check_key(request: Request, api_key: str | None):
    """401 unless the request carries ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` (Anthropic's
    header); no check when no key is set."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else None
    for given in (bearer, request.headers.get("x-api-key")):
        if given is not None and hmac.compare_digest(given.strip().encode(), api_key.encode()):
            return
    raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY') with the "
                        "server's key", code="invalid_api_key")


async def read_json(request: Request, limit: int, timeout: float) -> dict:
    """The body as a JSON object: 413 past ``limit`` bytes (declared or received), 408 unless it has
    all arrived within ``timeout`` seconds, 400 if not JSON."""
    deadline = asyncio.get_running_loop().time() + timeout
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        # a client that waits for "100 Continue" sends no body: there is nothing to drain
        waits = request.headers.get("expect", "").lower() == "100-continue"
        raise _TooLarge(limit, deadline, pending=not waits)
    chunks = []

    async def receive():
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _TooLarge(limit, deadline, pending=True)
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


class _TooLarge(APIError):
    """413 for a body over the limit, answered at once and followed by the body's drain (:class:`_Draining`)."""

    def __init__(self, limit: int, deadline: float, *, pending: bool):
        super().__init__(413, f"the request body is over the server's limit of {limit} bytes",
                         code="request_too_large", headers={"Connection": "close"})
        self.deadline, self.pending = deadline, pending

    def response(self, shape=None) -> JSONResponse:
        return _Draining(self.body() if shape is None else shape(self), status_code=self.status, headers=self.headers, deadline=self.deadline,
                         pending=self.pending)


class _Draining(JSONResponse):
    """A response sent whole at once but ended (and its connection closed) only once the rest of the
    request's body is read and discarded, up to :data:`DRAIN_BYTES` and until ``deadline`` (loop time)."""

    def __init__(self, content, *, deadline: float, pending: bool, **kw):
        super().__init__(content, **kw)
        self.deadline, self.pending = deadline, pending

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": True})
        if self.pending:
            left = self.deadline - asyncio.get_running_loop().time()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(_discard(receive, DRAIN_BYTES), max(left, 0.0))
        await send({"type": "http.response.body", "body": b""})


async def _discard(receive, most: int):
    """Reads what is left of a request's body, at most ``most`` bytes, and forgets it."""
    while most > 0:
        message = await receive()
        if message["type"] != "http.request":
            return  # the client left
        most -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def disconnected(request: Request):
    """Returns once the client has gone away (the body was read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
