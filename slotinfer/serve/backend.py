"""The engine side of the routes: what a request does once the HTTP shell has parsed and encoded it.

The shell (:mod:`slotinfer.serve.app`: routes, bodies, auth, error shapes, streaming) talks to a
backend only through this small surface, so that the one shell serves an Inferencer in this
process (:class:`LocalBackend`, ``slotinfer serve``) and replicas elsewhere (the Ray Serve
application's ``RemoteBackend``).  A backend's handles are read as :class:`~slotinfer.Handle`\\ s
are: ``async for`` their events, ``result()``, ``done()`` and ``cancel()``.
"""

from __future__ import annotations

import asyncio
import time

from .errors import bad_param

ROOM_WAIT_S = 30.0  # the longest a request that fits waits for the worker's next turn to make room


class LocalBackend:
    """Requests run on ``inferencer`` (started; closing it stays the caller's), in this process."""

    def __init__(self, inferencer):
        self.inf = inferencer

    # -- what the shell reads ---------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.inf.closed

    @property
    def max_len(self) -> int:
        return self.inf.engine.max_len

    @property
    def slots(self) -> int:
        return self.inf.engine.slots

    @property
    def max_queue(self) -> int:
        return self.inf.max_queue

    @property
    def block_tokens(self) -> int:
        return self.inf.stats()["block_tokens"]

    def stats(self) -> dict:
        return self.inf.stats()

    # -- generation ----------------------------------------------------------------------

    async def submit(self, rows: list[tuple[list[int], dict]]) -> list:
        """One handle per ``(prompt ids, params)`` row, all or none submitted (never blocking: a full
        queue raises :class:`~slotinfer.QueueFull`, which the shell answers with 429)."""
        loop = asyncio.get_running_loop()
        handles = []
        try:
            for left, (ids, params) in zip(range(len(rows), 0, -1), rows):
                await self.await_room(left)
                handles.append(self.inf.submit(ids, block=False, loop=loop, **params))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    async def await_room(self, rows: int):
        """Wait, briefly, while the queue bound is full of rows that free slots await (those this request
        submitted a moment ago, until the worker's next turn moves them), so that a request that fits the
        server is taken whole.  With no room to come, return at once: the submit that follows is a 429.
        The worker's turn can take seconds (a long prefill chunk on a loaded CPU): a request that fits
        is not refused for that, up to ``ROOM_WAIT_S``."""
        bound, slots = self.inf.max_queue, self.inf.engine.slots
        pause, deadline = 0.001, time.monotonic() + ROOM_WAIT_S
        while bound and time.monotonic() < deadline:
            s = self.inf.stats()
            if s["waiting"] < bound or s["active_slots"] + s["waiting"] + rows > slots + bound:
                return
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.02)

    # -- prefill jobs (called on a worker thread; the job they return is awaited, and cancellable) ----

    def submit_classify(self, rows, **kw):
        return self.inf.submit_classify(rows, **kw)

    def submit_score(self, prompts, **kw):
        return self.inf.submit_score(prompts, **kw)

    def submit_embed(self, rows, **kw):
        return self.inf.submit_embed(rows, **kw)

    def end_requests(self):
        """End every request now (the server shuts down): the Inferencer closes without draining."""
        self.inf.close(drain=False)


def warm_up(inf) -> float:
    """Seconds taken to run one short request through ``inf`` before any client's: MLX compiles the
    prefill and the decode step on first use, on the Inferencer's worker thread, where they then stay,
    so the first client does not wait for that.  The app's metrics count from after it."""
    t0 = time.perf_counter()
    one = inf.model.encode_prompt("Hello")[-1:]  # a one-token prompt, then a decode step: fits any --max-len
    inf.generate(one, max_tokens=min(2, inf.engine.max_len - 1), ignore_eos=True)
    return time.perf_counter() - t0


def check_fits(backend, req) -> None:
    """400 for a request with more rows than the slots and the queue bound hold together: a 429 would
    have its client retry forever."""
    bound, slots = backend.max_queue, backend.slots
    rows, most = len(req.prompts) * req.n, slots + bound
    if bound and rows > most:
        param = "prompt" if len(req.prompts) > most else "n"
        what = f"{len(req.prompts)} prompts x n={req.n}" if len(req.prompts) > 1 else f"n={req.n}"
        raise bad_param(param, f"this request asks for {rows} rows ({what}); this server holds at most {most} "
                               f"at once ({slots} slots + {bound} queued): lower n or send fewer prompts per request")
