"""The engine side over Ray Serve replicas: :class:`RemoteBackend` gives the HTTP shell (the same
routes ``slotinfer serve`` runs) handles whose tokens come from a replica's Inferencer.

A request's rows are one streaming call of a replica's ``generate``; its first item says the
replica took them (or why not: a full queue is the shell's 429).  A row cancelled here while
others of its call run on is stopped on the replica by a ``cancel_rows`` call pinned to it (the
routers honour ``pin``); once every row is, the streaming call itself is cancelled, which ends
the replica's generator and the rows it still ran.  A call whose replica died
before taking it is sent again, to another replica; rows under way when their replica dies end
with an error the shell turns into a stream's error event (or a 503), never a silent cut.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from ..errors import QueueFull
from ..types import Completion
from .errors import APIError
from .routing import prefix_hashes

TRIES = 3  # replicas a row that no replica took is offered to
CANCEL_TRIES = 6  # a cancel_rows call refused (the handle's queue full) is sent again, after 0.05 s, 0.1 s, ...

log = logging.getLogger(__name__)
_pending: set = set()  # cancel_rows calls under way (a task with no reference may be collected)


def replica_gone(action: str) -> APIError:
    return APIError(503, f"the replica serving this request stopped {action}; Ray Serve starts another in its place: "
                         f"send the request again", type="server_error", code="replica_died")


class RemoteBackend:
    """Rows run on the replicas behind ``handle`` (a DeploymentHandle of the replicas' deployment);
    ``info``: one replica's :meth:`Replica.info` (the replicas of a deployment are alike)."""

    def __init__(self, handle, info: dict):
        self.handle, self.info = handle, info
        self.closed = False
        self.max_len, self.slots, self.max_queue = info["max_len"], info["slots"], info["max_queue"]
        self.block_tokens = info["block_tokens"]
        self.streaming = handle.options(stream=True)  # built once: each request's call goes through it
        self._stats = {info["replica"]: info["stats"]}  # each replica's stats, as its last row reported them

    def stats(self) -> dict:
        """The replicas' stats, summed (each as its last finished row reported it)."""
        return {**_summed(list(self._stats.values())), "block_tokens": self.block_tokens}

    async def submit(self, rows: list[tuple[list[int], dict]]) -> list:
        """A request's rows, all on one replica in one call (taken whole or refused whole there, as one
        server takes them), routed by its first prompt."""
        call = RemoteCall(self, rows)
        await call.start()
        return call.rows

    def submit_classify(self, rows, **kw):
        return RemoteJob(self.handle, "submit_job", "classify", rows, kw)

    def submit_score(self, prompts, **kw):
        return RemoteJob(self.handle, "submit_job", "score", prompts, kw)

    def submit_embed(self, rows, **kw):
        return RemoteJob(self.handle, "submit_job", "embed", rows, kw)

    def end_requests(self):
        self.closed = True


class RemoteCall:
    """One request's rows on one replica: a streaming call whose items the ingress hands to each row."""

    def __init__(self, backend: RemoteBackend, rows: list[tuple[list[int], dict]]):
        self.backend, self.todo = backend, rows
        ids, params = rows[0]
        self.route = prefix_hashes(ids, backend.block_tokens, params.get("cache_salt"))
        self.blocks = sum(-(-(len(i) + (p.get("max_tokens") or 0)) // backend.block_tokens) for i, p in rows)
        self.rows = [RemoteHandle(self, i, ids) for i, (ids, _) in enumerate(rows)]
        self.id, self.replica = uuid.uuid4().hex, None  # the call's name on its replica; the replica's id
        self._gen = self._reader = None
        self._running = set(range(len(rows)))  # the rows the replica has not ended
        self._to_cancel: list[int] = []  # rows cancelled here since the last cancel_rows call

    async def start(self):
        """Until a replica takes the rows: one that dies first is replaced by another; a refusal raises."""
        for _ in range(TRIES):
            gen = self.backend.streaming.generate.remote(self.todo, route=self.route, blocks=self.blocks, call=self.id)
            try:
                kind, *payload = await gen.__anext__()
            except RayActorError:
                continue  # died before it took the rows: nothing ran, another replica takes them
            except BackPressureError:
                raise QueueFull("every replica is at capacity") from None
            except StopAsyncIteration:
                continue
            except BaseException:  # the caller went away while waiting: the rows are not left running
                gen.cancel()
                raise
            if kind == "error":
                raise payload[0]
            self._gen, self.replica = gen, payload[0]
            self._reader = asyncio.ensure_future(self._read())
            return
        raise replica_gone("before it took this request, as did the replicas tried after it")

    async def _read(self):
        rows = self.rows
        try:
            async for batch in self._gen:  # what the replica had since its last message, in order
                for kind, *payload in batch:
                    if kind == "event":
                        rows[payload[0]]._event(payload[1])
                    elif kind == "done":
                        self._running.discard(payload[0])
                        rows[payload[0]]._end(result=payload[1])
                    elif kind == "error":
                        self._running.discard(payload[0])
                        rows[payload[0]]._end(error=payload[1])
                    elif kind == "stats":
                        self.backend._stats[payload[0]] = payload[1]
        except RequestCancelledError:  # every row cancelled here: each ends with what came so far
            pass
        except RayActorError:
            for r in rows:
                r._end(error=replica_gone(f"while it ran, after {len(r._tokens)} tokens"))
        except Exception as e:  # noqa: BLE001 -- whatever ended the call ends its rows, said
            for r in rows:
                r._end(error=e)
        finally:
            for r in rows:
                r._end()

    def row_cancelled(self, row: int):
        """Row ``row`` was cancelled here: stop it on the replica too, once the rows cancelled in the same
        turn of the loop are known (a request that ends cancels all its rows at once: one message)."""
        if not self._to_cancel:
            asyncio.get_running_loop().call_soon(self._send_cancels)
        self._to_cancel.append(row)

    def _send_cancels(self):
        rows, self._to_cancel = sorted(set(self._to_cancel) & self._running), []
        if self._gen is None or not rows:
            return
        if all(r.done() for r in self.rows):  # nothing left to read: the call ends, and its rows with it
            self._gen.cancel()
            return
        task = asyncio.ensure_future(self._cancel_rows(rows))
        _pending.add(task)
        task.add_done_callback(_pending.discard)

    async def _cancel_rows(self, rows: list[int]):
        for attempt in range(CANCEL_TRIES):
            try:
                await self.backend.handle.cancel_rows.remote(self.id, rows, pin=self.replica)
                return
            except BackPressureError:
                await asyncio.sleep(0.05 * 2**attempt)
            except RayActorError:
                return  # the replica died: its rows with it
            except Exception as e:  # noqa: BLE001 -- the rows run on to their end: logged, nothing lost
                log.warning("rows %s of a request could not be stopped on replica %s: %r", rows, self.replica, e)
                return
        log.warning("rows %s of a request could not be stopped on replica %s: its queue stayed full", rows,
                    self.replica)


class RemoteHandle:
    """One row of a :class:`RemoteCall`, read as a :class:`~slotinfer.Handle` is."""

    def __init__(self, call: RemoteCall, index: int, ids: list[int]):
        self.call, self.index, self.ids = call, index, ids
        self._events: asyncio.Queue = asyncio.Queue()
        self._result: Completion | None = None
        self._error: BaseException | None = None
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._done = False

    def _event(self, ev):
        if not self._done:
            self._tokens.append(ev.token)
            self._text.append(ev.text)
            self._events.put_nowait(ev)

    def _end(self, result: Completion | None = None, error: BaseException | None = None):
        if self._done:
            return
        self._done = True
        self._result, self._error = result, error
        self._events.put_nowait(None)

    def cancel(self) -> bool:
        """Ends the row here with what came so far, and on its replica at the engine's next step."""
        if self._done:
            return False
        self._end()
        self.call.row_cancelled(self.index)
        return True

    def done(self) -> bool:
        return self._done

    def result(self) -> Completion:
        if self._error is not None:
            raise self._error
        if self._result is None:  # cancelled here: what came so far
            return Completion(list(self._tokens), "".join(self._text), "cancelled", prompt_tokens=len(self.ids))
        return self._result

    async def __aiter__(self):
        while True:
            ev = await self._events.get()
            if ev is None:
                return
            yield ev


class RemoteJob:
    """A prefill job (classify, score, embed) on a replica: awaited for its results, cancellable."""

    def __init__(self, handle, method: str, *args):
        self.handle, self.method, self.args = handle, method, args
        self._response = None
        self.cancelled = False

    def __await__(self):
        return self._run().__await__()

    async def _run(self):
        self._response = getattr(self.handle, self.method).remote(*self.args)
        try:
            return await self._response
        except RayActorError:
            raise replica_gone("while it ran this job") from None

    def cancel(self):
        self.cancelled = True
        if self._response is not None:
            self._response.cancel()


def _summed(stats: list[dict]) -> dict:
    """Numbers added up key by key (nested dicts too); other values: the first's."""
    out: dict = {}
    for s in stats:
        for k, v in s.items():
            if isinstance(v, dict):
                out[k] = _summed([out.get(k) or {}, v])
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(out.get(k, 0), (int, float)):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out
