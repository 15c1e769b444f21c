"""``Handle``: what ``Inferencer.submit`` returns — a future, a token stream, and a cancel button.

Thread-safe: the worker fills it, any thread (or an asyncio loop) reads it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .types import Completion

_END = object()


@dataclass(frozen=True)
class StreamEvent:
    """One generated token and the text it completed (possibly ``""``: text waits for whole characters)."""

    token: int
    text: str


class Handle:
    """A submitted request.

        >>> h = inf.submit("Tell me a story", max_tokens=64)
        >>> for ev in h:                 # stream
        ...     print(ev.text, end="")
        >>> h.result().finish_reason     # or just wait
    """

    def __init__(self, request_id: int, loop: asyncio.AbstractEventLoop | None = None):
        self.id = request_id
        self._future: Future = Future()
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._loop = loop
        self._aevents: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._cancel = threading.Event()

    # -- reading ------------------------------------------------------------

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the completion; raises the request's error if it failed."""
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Ask the worker to stop this request; it ends with ``finish_reason == "cancelled"``."""
        if self._future.done():
            return False
        self._cancel.set()
        return True

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self):
        while True:
            ev = self._events.get()
            if ev is _END:
                self._events.put(_END)  # let a second iteration end too
                return
            yield ev

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    async def __aiter__(self):
        if self._aevents is None:
            raise RuntimeError("async iteration needs a handle made by Inferencer.stream_async or submit(..., loop=...)")
        while True:
            ev = await self._aevents.get()
            if ev is _END:
                return
            yield ev

    # -- writing (worker side) ----------------------------------------------

    def _push(self, ev):
        self._events.put(ev)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._aevents.put_nowait, ev)

    def _finish(self, completion: Completion | None = None, error: BaseException | None = None):
        if self._future.done():
            return
        self._push(_END)
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(completion)
