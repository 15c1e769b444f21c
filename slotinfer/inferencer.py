"""``Inferencer``: the slot engine as an embedded worker for a long-running program.

    >>> with slotinfer.Inferencer(model, slots=32) as inf:
    ...     h = inf.submit("Hello", max_tokens=32)       # from any thread
    ...     print(h.result().text)

A background thread owns the slot table and runs the engine loop; producers on any
thread (or an asyncio loop) submit requests and get :class:`Handle` objects back.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
import weakref
from dataclasses import dataclass, field

import mlx.core as mx

from .engine import Engine
from .errors import EngineClosed, EngineError, QueueFull, SlotinferError
from .handle import Handle
from .types import Completion


_live: "weakref.WeakSet[Inferencer]" = weakref.WeakSet()


@atexit.register
def _close_live():
    """A program that exits without closing its Inferencer still ends every request (cancelled)."""
    for inf in list(_live):
        inf.close(drain=False, timeout=10)


@dataclass
class Request:
    """A request for :meth:`Inferencer.serve_queue`: a prompt, its parameters and your id."""

    prompt: object
    params: dict = field(default_factory=dict)
    id: object = None


class Inferencer:
    """Continuous batching over ``slots`` slots of up to ``max_len`` tokens each.

    ``prefill_tokens`` bounds one prefill call (longer prompts arrive in chunks between
    decode steps); ``max_queue`` bounds the admission queue (0 = unbounded).
    """

    def __init__(self, model, *, slots: int = 32, max_len: int = 2048, prefill_tokens: int = 512,
                 max_queue: int = 0, start: bool = True):
        self.engine = Engine(model, slots=slots, max_len=max_len, prefill_tokens=prefill_tokens)
        self.model = model
        self._inbox: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._closed = False
        self._cancel_all = False
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # -- lifecycle --------------------------------------------------------------

    def start(self):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="slotinfer-worker", daemon=True)
                self._thread.start()
                _live.add(self)
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        self.close(drain=exc_type is None)

    def close(self, *, drain: bool = True, timeout: float | None = None):
        """Stop taking requests.  ``drain=True`` finishes what was submitted; ``False`` cancels it.

        Either way every request ends with its own finish reason; none is dropped.
        """
        with self._lock:
            self._closed = True
            self._cancel_all = not drain
        self._inbox.put(None)  # wake the worker
        if self._thread is not None:
            self._thread.join(timeout)

    # -- submitting -------------------------------------------------------------

    def submit(self, prompt, *, block: bool = True, timeout: float | None = None, **params) -> Handle:
        """Queue a request from any thread; returns its :class:`Handle` at once.

        Parameters are those of :meth:`Model.generate` plus ``logprobs``, ``top_logprobs``,
        ``on_token`` (a callback per :class:`StreamEvent`).  With a full queue, ``block=True``
        waits (up to ``timeout``) and ``block=False`` raises :class:`QueueFull`.
        """
        if self._closed:
            raise EngineClosed("this Inferencer is closed; create a new one to submit more requests")
        item = self.engine.make_item(prompt, **params)
        try:
            self._inbox.put(item, block=block, timeout=timeout)
        except queue.Full:
            raise QueueFull(f"the admission queue is full ({self._inbox.maxsize} waiting); retry later or "
                            "submit with block=True") from None
        return item.handle

    def generate(self, prompt, **params) -> Completion:
        """Submit and wait: the blocking one-liner."""
        return self.submit(prompt, **params).result()

    async def generate_async(self, prompt, **params) -> Completion:
        """``await inf.generate_async(prompt, ...)`` from asyncio code."""
        return await self.submit(prompt, loop=asyncio.get_running_loop(), **params)

    async def stream_async(self, prompt, **params):
        """``async for ev in inf.stream_async(prompt, ...)``: tokens and text as they come."""
        handle = self.submit(prompt, loop=asyncio.get_running_loop(), **params)
        async for ev in handle:
            yield ev
        handle.result()  # surface the request's error, if any

    def serve_queue(self, in_q, out_q, *, sentinel=None):
        """Consume requests from ``in_q`` until ``sentinel``; put a :class:`Completion` per request on ``out_q``.

        A request is a prompt, a :class:`Request`, or a dict with ``prompt`` and parameters.
        Each completion carries ``.request_id``; a request that failed gets
        ``finish_reason == "error"`` and ``.error``.  Returns once every request ended,
        after putting ``sentinel`` on ``out_q``.
        """
        pending = []
        while (req := in_q.get()) is not sentinel:
            if isinstance(req, dict):
                req = Request(req["prompt"], {k: v for k, v in req.items() if k not in ("prompt", "id")}, req.get("id"))
            elif not isinstance(req, Request):
                req = Request(req)
            try:
                handle = self.submit(req.prompt, **req.params)
            except (SlotinferError, ValueError, TypeError) as e:
                out_q.put(_failed(req.id, e))
                continue
            pending.append(handle)
            handle._future.add_done_callback(lambda f, rid=req.id: out_q.put(_outcome(rid, f)))
        for h in pending:
            h._future.exception()  # wait
        out_q.put(sentinel)

    # -- reporting --------------------------------------------------------------

    def memory(self) -> dict:
        """Bytes held: the K/V slot table (fixed up front), the weights, and MLX's peak."""
        return self.engine.memory()

    def stats(self) -> dict:
        """Engine counters: steps, slot occupancy, prefill and decode tokens/s, peak memory."""
        return self.engine.stats()

    # -- the worker -------------------------------------------------------------

    def _run(self):
        # MLX streams belong to the thread that made them: the worker gets its own, and
        # synchronizes it before leaving so no device work outlives the thread.
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            try:
                self._loop()
            finally:
                mx.synchronize(stream)

    def _loop(self):
        engine = self.engine
        while True:
            self._drain_inbox(block=not engine.busy)
            if self._cancel_all:
                for item in [*engine.items.waiting, *filter(None, engine.items.by_slot)]:
                    item.handle.cancel()
            if not engine.busy and self._closed and self._inbox.empty():
                return
            if not engine.busy:
                continue
            try:
                engine.step()
            except Exception as e:  # a device failure ends the items in flight, not the worker
                engine.fail_all(e)

    def _drain_inbox(self, block: bool):
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.1 if block else None)
            except queue.Empty:
                return
            block = False
            if item is not None:
                self.engine.add(item)


def _outcome(request_id, future) -> Completion:
    err = future.exception()
    if err is not None:
        return _failed(request_id, err)
    c = future.result()
    c.request_id = request_id
    return c


def _failed(request_id, err) -> Completion:
    c = Completion(tokens=[], text="", finish_reason="error")
    c.request_id, c.error = request_id, err
    return c


__all__ = ["Inferencer", "Request", "EngineError"]
