"""The engine side over Ray Serve replicas: :class:`RemoteBackend` gives the HTTP shell (the same
routes ``slotinfer serve`` runs) handles whose tokens come from a replica's Inferencer.

A row is one streaming call of the replica's ``generate``; its first item says the replica took it
(or why not: a full queue is the shell's 429).  A call whose replica died before taking it is sent
again, to another replica; a row under way when its replica dies ends with an error the shell
turns into a stream's error event (or a 503), never a silent cut.
"""

from __future__ import annotations

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from ..errors import QueueFull
from ..types import Completion
from .errors import APIError
from .routing import prefix_hashes

TRIES = 3  # replicas a row that no replica took is offered to


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
        self._stats = {info["replica"]: info["stats"]}  # each replica's stats, as its last row reported them

    def stats(self) -> dict:
        """The replicas' stats, summed (each as its last finished row reported it)."""
        return {**_summed(list(self._stats.values())), "block_tokens": self.block_tokens}

    async def submit(self, rows: list[tuple[list[int], dict]]) -> list:
        handles = []
        try:
            for ids, params in rows:
                h = RemoteHandle(self, ids, params)
                await h.start()
                handles.append(h)
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    def submit_classify(self, rows, **kw):
        return RemoteJob(self.handle, "submit_job", "classify", rows, kw)

    def submit_score(self, prompts, **kw):
        return RemoteJob(self.handle, "submit_job", "score", prompts, kw)

    def submit_embed(self, rows, **kw):
        return RemoteJob(self.handle, "submit_job", "embed", rows, kw)

    def end_requests(self):
        self.closed = True


class RemoteHandle:
    """One row on a replica, read as a :class:`~slotinfer.Handle` is."""

    def __init__(self, backend: RemoteBackend, ids: list[int], params: dict):
        self.backend, self.ids, self.params = backend, ids, params
        self.route = prefix_hashes(ids, backend.block_tokens, params.get("cache_salt"))
        need = len(ids) + (params.get("max_tokens") or 0)
        self.blocks = -(-need // backend.block_tokens)
        self._gen = None
        self._result: Completion | None = None
        self._error: BaseException | None = None
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._cancelled = self._done = False

    async def start(self):
        """Until a replica takes the row: one that dies first is replaced by another; a refusal raises."""
        for _ in range(TRIES):
            gen = self.backend.handle.options(stream=True).generate.remote(self.ids, self.params, route=self.route,
                                                                           blocks=self.blocks)
            try:
                kind, payload = await gen.__anext__()
            except RayActorError:
                continue  # died before it took the row: nothing ran, another replica takes it
            except BackPressureError:
                raise QueueFull("every replica is at capacity") from None
            except StopAsyncIteration:
                continue
            except BaseException:  # the caller went away while waiting: the row is not left running
                gen.cancel()
                raise
            if kind == "error":
                raise payload
            self._gen = gen
            return
        raise replica_gone("before it took this request, as did the replicas tried after it")

    def cancel(self) -> bool:
        if self._done or self._cancelled:
            return False
        self._cancelled = True
        if self._gen is not None:
            self._gen.cancel()
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
        try:
            async for kind, payload in self._gen:
                if kind == "event":
                    self._tokens.append(payload.token)
                    self._text.append(payload.text)
                    yield payload
                elif kind == "done":
                    self._result, (replica, stats) = payload
                    self.backend._stats[replica] = stats
                elif kind == "error":
                    self._error = payload
        except RequestCancelledError:  # cancel() here: the row ends with what came so far
            if not self._cancelled:
                raise
        except RayActorError:
            if not self._cancelled:
                self._error = replica_gone(f"while it ran, after {len(self._tokens)} tokens")
        finally:
            self._done = True


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
