"""``Handle``: what ``Inferencer.submit`` returns — a future, a token stream, and a cancel button.

Thread-safe: the worker fills it, any thread (or an asyncio loop) reads it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from .types import Completion

_END = object()


@dataclass(frozen=True)
class StreamEvent:
    """One generated token and the text it completed (possibly ``""``: text waits for whole characters).

    ``logprob`` and ``top_logprobs`` ([(id, logprob)]) are set when the request asked for them.
    """

    token: int
    text: str
    logprob: float | None = None
    top_logprobs: list | None = None


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
        self._ended = False  # the end of the stream was pushed
        self._on_cancel = None  # set by the ItemProcessor as the request is made: tells the worker without a scan

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
        if not self._cancel.is_set():  # asked once: the worker hears of it once
            self._cancel.set()
            if self._on_cancel is not None:
                self._on_cancel()
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
        return self._wait().__await__()

    async def _wait(self) -> Completion:
        """The completion, awaited without blocking the loop.  Cancelling the awaiting task
        (``task.cancel()``, ``asyncio.wait_for`` timing out) cancels the request too."""
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def resolve():
            if not woken.done():
                woken.set_result(None)

        def wake(_):
            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop closed meanwhile: no one is waiting any more
                pass

        self._future.add_done_callback(wake)
        try:
            await woken
        except asyncio.CancelledError:
            self.cancel()
            raise
        return self._future.result()

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
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._aevents.put_nowait, ev)
            except Exception:  # its event loop closed (or broke): no one can read the async stream any more
                self._loop = None

    def _finish(self, completion: Completion | None = None, error: BaseException | None = None):
        """End the request once: the result first, so a finished stream finds it set.

        Setting the future runs its done callbacks here, on the worker; whatever one raises
        (``concurrent.futures`` logs an ``Exception`` but lets a ``BaseException`` through)
        stays with this request: the future is set by then and the stream still ends.
        """
        if self._ended:
            return
        self._ended = True
        self._on_cancel = None  # its closure refers back to the request's record: free both by refcount, now
        try:
            if not self._future.done():
                if error is not None:
                    self._future.set_exception(error)
                else:
                    self._future.set_result(completion)
        except BaseException:  # noqa: BLE001 -- a done callback's failure is its own, never the worker's
            pass
        finally:
            self._push(_END)


class ClassifyHandle:
    """A classification queued with :meth:`Inferencer.submit_classify` (embeddings and prompt log-probs,
    :meth:`Inferencer.submit_embed` and :meth:`Inferencer.submit_score`, get the same handle).

    :meth:`result` waits for the list of :class:`ClassifyResult`; ``await handle`` does so in
    asyncio code.  :meth:`cancel` (from any thread) stops it before its next unit of work: its
    result then raises :class:`Cancelled`.
    """

    def __init__(self, job):
        self.job = job
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._cancelled = False

    def cancel(self):
        """Stop the classification at its next unit of work (a no-op once it ended)."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> list:
        """The results, in input order; raises what ended the classification (:class:`Cancelled`, say)."""
        return self._future.result(timeout)

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    def _end(self, result=None, error: BaseException | None = None):
        if self._future.done():
            return
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(result)
        self.job = None  # its arrays and tokens go with it
