"""``Inferencer``: the slot engine as an embedded worker for a long-running program.

    >>> with slotinfer.Inferencer(model, slots=32) as inf:
    ...     h = inf.submit("Hello", max_tokens=32)       # from any thread
    ...     print(h.result().text)

A background thread owns the slot table and runs the engine loop; producers on any
thread (or an asyncio loop) submit requests and get :class:`Handle` objects back.  The same
thread runs classifications (:meth:`Inferencer.submit_classify`), one unit of work after each
engine step.
Worker threads outlive their Inferencer and serve the next one (see :class:`~slotinfer.workers.Workers`).

The Inferencer only hands work between threads: a request waits for its slot in the
engine's one queue, and every request ends through the engine's item processor, even when
the worker itself fails or the Inferencer is dropped unclosed.

This module keeps that handoff (the lock, the inbox, the worker's turn and lifecycle); the
worker threads are :mod:`slotinfer.workers`, the job handle :class:`~slotinfer.handle.ClassifyHandle`
and the ``serve_queue`` records :mod:`slotinfer.queues`.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import threading
import time
import weakref
from collections import deque

from . import request
from .engine.engine import Engine
from .errors import Cancelled, EngineClosed, EngineError, QueueFull
from .handle import ClassifyHandle, Handle
from .queues import QueuedRequest, serve_queue
from .types import Completion
from .workers import WORKERS

_live: "weakref.WeakSet[Inferencer]" = weakref.WeakSet()
# Started Inferencers with work in hand: kept alive until it is done even if their user drops
# them.  Idle, an Inferencer is referred to only by its users (its worker holds a weakref).
_working: "set[Inferencer]" = set()


@atexit.register
def _close_live():
    """A program that exits without closing its Inferencer still ends every request (cancelled)."""
    for inf in list(_live):
        inf.close(drain=False, timeout=10)


class Inferencer:
    """Continuous batching over ``slots`` slots of up to ``max_len`` tokens each, their K/V in one pool of blocks.

    ``prefill_tokens`` bounds one prefill call (longer prompts arrive in chunks between
    decode steps); ``max_queue`` bounds how many requests may wait for a slot (0 =
    unbounded): past it, :meth:`submit` blocks or raises :class:`QueueFull`.
    ``prefix_cache_bytes`` caps the prefix cache: the K/V pool's blocks of earlier prompts (and
    what they generated), kept so that a request starting with the same tokens shares them
    instead of computing them again; it bounds those no request holds (they are evicted first
    when the pool needs blocks) (None: the device's default,
    :func:`slotinfer.device.prefix_cache_bytes`; 0: off).
    ``kv_dtype`` ("float16", "bfloat16", "float32", "q8_0"; None: the model's compute dtype) is the
    dtype K/V are kept in: "float16" halves their memory, "q8_0" (blocks of 32 int8 values and a
    float16 scale) takes 0.27x float32's (docs/kv-cache.md measures their cost and agreement).
    ``kv_cache_bytes`` sizes the pool of K/V blocks every slot draws on (None: ``slots x max_len``
    tokens, at most a quarter of the machine's memory): a request is admitted when the free blocks
    hold its prompt, and waits otherwise; it takes a block more as its output crosses each block
    boundary, and when none is free the newest request is preempted, to resume later by recompute
    with the same output (``stats()["preempted"]`` counts them); ``max_len`` caps one request.
    ``speculative="ngram"`` lets rows draft up to ``draft_tokens`` tokens (prompt lookup, a suffix
    pool shared by requests of the same ``cache_salt``, a constraint's forced tokens) and verifies
    them inside the batched step, where a gate expects it to pay; the output is the same
    (docs/speculative.md).  ``stats()`` counts ``spec_drafted`` and ``spec_accepted`` tokens.

    Lifetime: :meth:`close` it (or use ``with``); a closed Inferencer holds no thread and
    is freed with its slot table once you drop it.  One dropped without ``close()`` finishes
    the requests it was given and is then freed too (its worker holds it only while it has
    work); either way its worker thread waits, idle, for the next Inferencer.

    Nothing a request carries can stop the worker: a callback raising anything
    (``BaseException`` included) ends its own request with :class:`EngineError`.  Should
    the loop itself fail (a bug), every request, pending or submitted later, ends with
    :class:`EngineError` rather than hang.
    """

    def __init__(self, model, *, slots: int = 32, max_len: int = 2048, prefill_tokens: int = 512,
                 max_queue: int = 0, prefix_cache_bytes: int | None = None, kv_dtype=None,
                 kv_cache_bytes: int | None = None, speculative: str | None = None, draft_tokens: int = 8,
                 start: bool = True):
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0 (0: unbounded), got {max_queue!r}")
        self.engine = Engine(model, slots=slots, max_len=max_len, prefill_tokens=prefill_tokens,
                             prefix_cache_bytes=prefix_cache_bytes, kv_dtype=kv_dtype, kv_cache_bytes=kv_cache_bytes,
                             speculative=speculative, draft_tokens=draft_tokens)
        self.model = model
        # The handoff between threads: requests submitted since the worker's last turn, which
        # moves them all into the engine's one waiting queue.  ``_backlog`` is the worker's count
        # of those no free slot awaits; with the inbox it is what ``max_queue`` bounds.
        # Submitting, closing and the worker's decision to exit all happen under this condition.
        self._inbox: deque = deque()
        self._jobs: deque[ClassifyHandle] = deque()  # classifications, first come first run, one unit a turn
        self._backlog = 0
        self._max_queue = max_queue
        self._cv = threading.Condition()
        self._closed = False
        self._cancel_all = False
        self._done: threading.Event | None = None  # set when the worker left the loop
        self._worker: threading.Thread | None = None  # the thread running the loop
        self._failure: EngineError | None = None  # set if the loop itself failed (a bug): every request gets it
        self._accepted = self._refused = 0  # requests queued; requests refused at submit (full queue, closed)
        # not at exit: there _close_live cancels what is still running, as close() would
        weakref.finalize(self, _abandoned, self._inbox, self._jobs, self.engine).atexit = False
        if start:
            self.start()

    @property
    def max_queue(self) -> int:
        """How many requests may wait for a slot (0: unbounded)."""
        return self._max_queue

    # -- lifecycle --------------------------------------------------------------

    def start(self):
        with self._cv:
            if self._done is None:
                # The worker holds the Inferencer weakly while idle, so one dropped without close()
                # is freed, its slot table with it, once its requests are done.
                self._done = WORKERS.run(functools.partial(_work, weakref.ref(self)))
                _live.add(self)
                _working.add(self)  # until its worker finds it idle
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, exc_type, exc, tb):
        self.close(drain=exc_type is None)

    def close(self, *, drain: bool = True, timeout: float | None = None):
        """Stop taking requests.  ``drain=True`` finishes what was submitted; ``False`` cancels it.

        Either way every request ends with its own finish reason; none is dropped (a worker
        never started is started to do so).  A submit still waiting for room in a full queue
        gets :class:`EngineClosed`.  Safe to call more than once.
        """
        with self._cv:
            self._closed = True
            if not drain:
                self._cancel_all = True
            self._cv.notify_all()
        self.start()
        if self._worker is not threading.current_thread():  # not from a callback on the worker
            self._done.wait(timeout)

    # -- submitting -------------------------------------------------------------

    def submit(self, prompt=None, *, messages=None, block: bool = True, timeout: float | None = None,
               **params) -> Handle:
        """Queue a request from any thread; returns its :class:`Handle` at once.

        Give a ``prompt``, or chat ``messages`` (rendered with the model's chat template).

        Parameters are those of :meth:`Model.generate` plus ``logprobs``, ``top_logprobs``,
        ``on_token`` (a callback per :class:`StreamEvent`).  With a full queue, ``block=True``
        waits (up to ``timeout`` seconds) and ``block=False`` raises :class:`QueueFull`.

        ``on_token`` runs on the worker thread between steps, so it sees events in order and
        without delay, but a slow callback delays every slot: keep it quick, and iterate the
        handle from a thread of your own for heavy work.  If it raises, its request ends
        with finish reason ``"error"`` and the others go on.
        """
        self._check_open()
        item, block, timeout = self._make_item(prompt, messages, params, block, timeout)
        try:
            self._enqueue(item, block, timeout)
        except BaseException:
            self._count_refused()
            raise
        return item.handle

    def generate(self, prompt=None, **params) -> Completion:
        """Submit and wait: the blocking one-liner."""
        return self.submit(prompt, **params).result()

    def submit_classify(self, prompts, **params) -> "ClassifyHandle":
        """Queue a classification (:meth:`Model.classify`'s arguments) from any thread; returns its
        :class:`ClassifyHandle` at once.

        The worker runs it between engine steps, one unit of work a step (a batch of prompts, or a
        share of a batch's label continuations, each at most ``token_budget`` padded tokens; None:
        the engine's ``prefill_tokens``), so a running stream waits at most one unit for each
        token, and the results are those of ``model.classify`` with the same ``token_budget``.
        Classifications run one after another, in the order submitted.  Checking the request and
        tokenizing happen here, on the calling thread: a bad request raises
        :class:`InvalidRequestError`.  ``on_result`` runs on the worker thread.
        """
        from .classify import ClassifyJob

        self._check_open()
        params.setdefault("token_budget", self.engine.encoder.budget)
        return self._submit_job(ClassifyJob(self.model, prompts, **params))

    def submit_embed(self, texts, **params) -> "ClassifyHandle":
        """Queue embeddings (:meth:`Model.embed`'s arguments) from any thread; returns a handle at once,
        whose :meth:`~ClassifyHandle.result` is the list of :class:`~slotinfer.embed.EmbedResult`.

        They run as classifications do (:meth:`submit_classify`): a batch of at most ``token_budget``
        padded tokens (None: the engine's ``prefill_tokens``) between two engine steps, so a stream
        waits at most one batch per token.

            >>> h = inf.submit_embed(["a cat sat", "the dog ran"])
            >>> [r.vector for r in h.result()]
        """
        from .embed import EmbedJob

        self._check_open()
        params.setdefault("token_budget", self.engine.encoder.budget)
        return self._submit_job(EmbedJob(self.model, texts, **params))

    def embed(self, texts, **params):
        """:meth:`submit_embed` and wait: float32 ``[len(texts), dims]`` as :meth:`Model.embed` returns.

            >>> with slotinfer.Inferencer(model) as inf:
            ...     v = inf.embed(["a cat sat", "the dog ran"], pooling="last")
        """
        from .embed import stack

        return stack(self.submit_embed(texts, **params).result(), params.get("dimensions") or
                     self.model.config.hidden_size)

    def submit_score(self, prompts, **params) -> "ClassifyHandle":
        """Queue prompt log-probs (:meth:`Model.score`'s arguments), run as :meth:`submit_classify` runs;
        the handle's result is the list of :class:`~slotinfer.prefill_jobs.PromptScores`."""
        from .prefill_jobs import ScoreJob

        self._check_open()
        params.setdefault("token_budget", self.engine.encoder.budget)
        return self._submit_job(ScoreJob(self.model, prompts, **params))

    def _submit_job(self, job) -> "ClassifyHandle":
        handle = ClassifyHandle(job)
        with self._cv:
            self._check_open()
            if self._failure is not None:
                handle._end(error=self._failure)
                return handle
            self._jobs.append(handle)
            if self._done is not None:
                _working.add(self)
            self._cv.notify_all()
        return handle

    def classify(self, prompts, **params) -> list:
        """:meth:`submit_classify` and wait: a list of :class:`ClassifyResult`, in input order."""
        return self.submit_classify(prompts, **params).result()

    async def chat_async(self, messages, **params) -> Completion:
        """:meth:`generate_async` for chat ``messages``."""
        return await self.generate_async(messages=messages, **params)

    def stream_chat_async(self, messages, **params):
        """:meth:`stream_async` for chat ``messages``."""
        return self.stream_async(messages=messages, **params)

    async def generate_async(self, prompt=None, **params) -> Completion:
        """``await inf.generate_async(prompt, ...)`` from asyncio code.

        Never blocks the event loop (a full queue is waited for asynchronously); cancelling
        the awaiting task cancels the request.
        """
        handle = await self._submit_async(prompt, params)
        return await handle

    async def stream_async(self, prompt=None, **params):
        """``async for ev in inf.stream_async(prompt, ...)``: tokens and text as they come.

        Leaving the loop early (``break``, an exception, the task cancelled) cancels the request.
        """
        handle = await self._submit_async(prompt, params)
        try:
            async for ev in handle:
                yield ev
            handle.result()  # surface the request's error, if any
        finally:
            handle.cancel()  # a no-op once it ended

    async def _submit_async(self, prompt, params) -> Handle:
        block, timeout, messages = params.pop("block", True), params.pop("timeout", None), params.pop("messages", None)
        self._check_open()
        item, block, timeout = self._make_item(prompt, messages, params, block, timeout, asyncio.get_running_loop())
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        try:
            while True:
                try:
                    self._enqueue(item, block=False, timeout=None)
                    return item.handle
                except QueueFull:
                    if not block or (deadline is not None and time.monotonic() >= deadline):
                        raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.02)
        except BaseException:  # the queue stayed full, it closed, or the awaiting task was cancelled
            self._count_refused()
            raise

    def _make_item(self, prompt, messages, params: dict, block, timeout, loop=None):
        """The request's item, and its ``block`` and ``timeout`` checked; a parameter's own error
        comes before the prompt's (an async caller's ``loop`` is its running one)."""
        p = request.check({**params, "block": block, "timeout": timeout}, self.model.config.vocab_size,
                          names=request.SUBMIT)
        if loop is not None:
            params = {**params, "loop": loop}
        item = self.engine.make_item(self.model.chat_prompt(prompt, messages), **params)
        return item, p["block"], p["timeout"]

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called (no more requests are taken)."""
        return self._closed

    def _check_open(self):
        if self._closed:
            raise EngineClosed("this Inferencer is closed; create a new one to submit more requests")

    def _enqueue(self, item, block: bool, timeout: float | None):
        with self._cv:
            bound = self._max_queue
            on_worker = self._worker is threading.current_thread()  # from an on_token callback
            if bound and block and not self._closed and not on_worker:
                self._cv.wait_for(lambda: self._closed or self._queued() < bound, timeout)
            self._check_open()
            if bound and self._queued() >= bound:
                how = ("is full, and a submit from the worker thread (an on_token callback) cannot wait for "
                       "room that only that thread makes; submit from another thread, or retry later" if on_worker
                       else f"stayed full for {timeout} s; retry later, wait longer, or raise max_queue" if block
                       else "is full; retry later, or submit with block=True to wait for room")
                raise QueueFull(f"the admission queue ({bound} waiting) {how}")
            self._accepted += 1
            if self._failure is not None:  # the loop is gone: end at once rather than wait for it
                self.engine.fail([item], self._failure)
                return
            self._inbox.append(item)
            if self._done is not None:
                _working.add(self)
            self._cv.notify_all()

    def _queued(self) -> int:
        """Requests waiting for a slot (under the condition)."""
        return len(self._inbox) + self._backlog

    def _count_refused(self):
        with self._cv:
            self._refused += 1

    def serve_queue(self, in_q, out_q, *, sentinel=None):
        """Consume requests from ``in_q`` until ``sentinel``; put a :class:`Completion` per request on ``out_q``.

        A request is a prompt, a :class:`~slotinfer.queues.QueuedRequest` (``slotinfer.Request``), or a
        dict with ``prompt`` and parameters (and optionally ``id``).  Each completion carries ``.request_id``: the request's ``id``,
        or its 0-based position among the items read from ``in_q`` when it has none; a request that
        failed, or was malformed, gets ``finish_reason == "error"`` and ``.error``.  Returns
        once every request's completion is on ``out_q``, after putting ``sentinel`` there.
        A full admission queue blocks the reading of ``in_q`` (backpressure); ``out_q`` is
        written by a thread of its own, so a slow or bounded ``out_q`` never stalls the engine.
        """
        serve_queue(self, in_q, out_q, sentinel=sentinel)

    # -- reporting --------------------------------------------------------------

    def memory(self) -> dict:
        """Bytes: the K/V pool's budget (``kv_cache_bytes``) and what its arrays hold now (they grow with
        the blocks in use and are cut back when idle), its blocks, the prefix cache's, the weights,
        and MLX's peak (:meth:`slotinfer.engine.Engine.memory`)."""
        return self.engine.memory()

    def stats(self) -> dict:
        """Engine counters: steps, slot occupancy, prefill and decode tokens/s, peak memory.

        ``submitted`` counts the requests accepted into the queue; ``refused`` those turned
        away at submit (queue full, closed, or the awaiting task cancelled while waiting for room).
        """
        out = self.engine.stats()
        out["waiting"] += len(self._inbox)
        out["submitted"], out["refused"] = self._accepted, self._refused
        return out

    # -- the worker -------------------------------------------------------------

    def _turn(self) -> bool:
        """One turn of the worker's loop: take requests, then step; True when the worker should exit."""
        engine = self.engine
        if self._take(block=not engine.busy and not self._jobs):
            return True
        if self._cancel_all:
            for item in engine.in_flight():
                item.handle.cancel()
            for job in list(self._jobs):
                job.cancel()
        if engine.busy:
            engine.step_or_fail()  # a device failure ends the items in flight, not the worker
        if self._jobs:
            self._classify_unit()  # between two decode steps, as a prefill chunk would be
        return False

    def _classify_unit(self):
        """Run one unit of the first classification (or end it: done or failed alone); those cancelled
        end first, wherever they wait."""
        with self._cv:
            cancelled = [h for h in self._jobs if h.cancelled]
            for h in cancelled:
                self._jobs.remove(h)
            handle = self._jobs[0] if self._jobs else None
        for h in cancelled:
            h._end(error=Cancelled("the classification was cancelled before it finished"))
        if handle is None:
            return
        try:
            if not handle.job.advance():
                return
            handle._end(result=handle.job.results)
        except BaseException as e:  # what the request carries (its on_result, a device failure) ends it alone
            handle._end(error=e if isinstance(e, Exception)
                        else EngineError(f"the classification failed: {type(e).__name__} ({e!r})"))
        with self._cv:
            self._jobs.remove(handle)

    def _idle(self) -> bool:
        """On the worker: True (and no longer kept alive for work) when nothing is queued or running."""
        with self._cv:
            if self._inbox or self._jobs or self.engine.busy:
                return False
            _working.discard(self)
            return True

    def _fail(self, error: BaseException):
        """The loop itself failed (a bug): end every request, queued, in flight or submitted later."""
        with self._cv:
            self._failure = EngineError(
                f"the Inferencer's worker failed ({type(error).__name__}: {error}); it serves no more requests: "
                f"close it and create a new one")
            pending = [*self._inbox, *self.engine.in_flight()]
            self._inbox.clear()
            jobs = list(self._jobs)
            self._jobs.clear()
            self._cv.notify_all()
        self.engine.fail(pending, self._failure)
        for job in jobs:
            job._end(error=self._failure)

    def _take(self, block: bool) -> bool:
        """Hand every submitted request to the engine; True when the worker should exit."""
        engine = self.engine
        with self._cv:
            self._recount(self._queued())  # the last step may have admitted some
            if block and not self._inbox and not self._jobs and not self._closed:
                self._cv.wait(timeout=0.1)
            queued = self._queued()
            while self._inbox:
                engine.add(self._inbox.popleft())
            self._recount(queued)  # those a free slot awaits no longer count
            return self._closed and not engine.busy and not self._jobs

    def _recount(self, queued: int):
        """Count the engine's backlog again (under the condition), waking a blocked submit if fewer
        than ``queued`` requests now wait for a slot."""
        self._backlog = self.engine.waiting_for_slots()
        if self._queued() < queued:
            self._cv.notify_all()


def _work(ref):
    """The worker's loop over the Inferencer ``ref`` refers to, holding it only while it has work."""
    inf = ref()
    if inf is None:
        return
    inf._worker = threading.current_thread()
    try:
        while not inf._turn():
            if not inf._idle():
                continue
            inf = None  # idle, the Inferencer lives only as long as its users keep it
            inf = ref()
            if inf is None:
                return
    except BaseException as e:
        inf._fail(e)
        raise  # reported by the worker thread, which serves on
    finally:
        _working.discard(inf)


def _abandoned(inbox, jobs, engine):
    """An Inferencer freed without :meth:`~Inferencer.close` (one never started, say): end what it
    still held, so no request hangs."""
    error = EngineClosed(
        "the Inferencer was dropped (garbage-collected) without close() while this request was pending; "
        "close it, or use it in a `with` block, to let its requests finish")
    engine.fail([*inbox, *engine.in_flight()], error)
    for job in jobs:
        job._end(error=error)


Request = QueuedRequest  # the name slotinfer exports

__all__ = ["Inferencer", "Request", "QueuedRequest", "ClassifyHandle", "EngineError"]
