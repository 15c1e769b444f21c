"""uvicorn with a shutdown that ends requests instead of killing them.

On SIGINT/SIGTERM uvicorn stops accepting and waits for the requests in flight; past its
``timeout_graceful_shutdown`` it cancels their handlers, which cuts streams without a last
event, answers whole requests with a plain-text 500 and logs a ``CancelledError`` per
request.  :class:`GracefulServer` instead calls ``end_requests`` once the grace period runs
out (the CLI closes the Inferencer without draining): every row ends as cancelled, and each
handler answers as it would any end — a stream with an error event and ``[DONE]``, a whole
request with a JSON 503.  uvicorn's own cancel stays only as a backstop, ``settle`` seconds
later, for a handler that never returns.
"""

from __future__ import annotations

import asyncio

import uvicorn

SETTLE_S = 5.0  # after end_requests, the time handlers get to send their last bytes


class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown runs ``end_requests()`` (on a thread) ``grace`` seconds in."""

    def __init__(self, config: uvicorn.Config, *, grace: float, end_requests, settle: float = SETTLE_S):
        config.timeout_graceful_shutdown = grace + settle
        super().__init__(config)
        self.grace, self._end_requests = grace, end_requests

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        ending: list[asyncio.Future] = []
        timer = loop.call_later(self.grace, lambda: ending.append(loop.run_in_executor(None, self._end_requests)))
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            for f in ending:  # requests are ended before the server returns, whatever happened meanwhile
                await f
