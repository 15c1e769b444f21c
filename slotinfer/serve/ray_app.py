"""The Ray Serve application: replicas of one Inferencer each, behind an ingress that speaks the
same routes as ``slotinfer serve`` (it runs the same shell, :func:`~slotinfer.serve.app.shell_app`,
over a :class:`~slotinfer.serve.remote.RemoteBackend`).

    >>> from ray import serve
    >>> import slotinfer.ray
    >>> serve.run(slotinfer.ray.serve_app("path/to/model", replicas=2), route_prefix="/")

Per model, one deployment of :class:`Replica` (its request router: :class:`~slotinfer.serve.routing.PrefixRouter`
unless ``routing`` says otherwise); one :class:`Ingress` deployment in front of them all.
The ingress loads each model's tokenizer and chat template (not its weights): it renders, encodes
and decodes there, and routes on the prompt's token ids.  See docs/scale-out.md.
"""

from __future__ import annotations

import asyncio
import json

from ray import serve
from ray.serve.config import RequestRouterConfig

import slotinfer

from ..errors import InvalidRequestError, ModelNotFoundError
from ..loading import hub
from .app import default_name, shell_app
from .backend import LocalBackend, warm_up
from .remote import RemoteBackend

ROUTERS = {"prefix": "slotinfer.serve.routing:PrefixRouter",
           "round_robin": "slotinfer.serve.routing:RoundRobinRouter",
           "pow2": "slotinfer.serve.routing:Pow2Router"}  # Serve's own (power of two choices by queue length), pinning
DEFAULT_MAX_LEN = 2048
HOLD_MAX_S = 0.5  # the longest a replica holds a row's tokens to send more at once (stream_interval > 1)
# How long a replica holds a streamed row's tokens after the first, to send what came meanwhile in one
# message.  Each message costs CPU in the replica, the ingress and Serve's proxy: on the 2-core machine,
# held 50 ms a single stream ran at 0.94x one server's tokens/s and 8 at 0.84x, sent at once 0.79x and
# 0.78x (benchmarks/bench_ray_serve.py --part overhead; docs/scale-out.md).  Ray Serve LLM holds 50 ms
# by default too (its stream_batching_interval_ms).
STREAM_HOLD_MS = 50.0
STATS_PERIOD_S = 1.0  # how often each replica reports its queue depth and free K/V blocks to the routers


class Replica:
    """One Inferencer over ``model``; ``engine``: the Inferencer's keyword arguments."""

    def __init__(self, model: str, engine: dict, stream_interval: int = 1, stream_hold_ms: float = STREAM_HOLD_MS):
        self.stream_interval = stream_interval
        self.hold_s = stream_hold_ms / 1000.0
        loaded = slotinfer.load(model)
        engine = {"max_len": min(DEFAULT_MAX_LEN, loaded.context_length), **engine}  # as slotinfer serve's
        self.inf = slotinfer.Inferencer(loaded, **engine)
        warm_up(self.inf)
        self.backend = LocalBackend(self.inf)
        ctx = serve.get_replica_context()
        self.id = str(getattr(ctx.replica_id, "unique_id", ctx.replica_id))
        self._calls: dict[str, list] = {}  # a streaming call's id -> its rows' handles, while it runs
        self.rows_cancelled = 0  # rows stopped before their end: their caller cancelled them, or went away

    def info(self, pin: str | None = None) -> dict:
        """What the ingress needs to know of the replicas (they are alike), with this one's id and stats;
        ``pin``: a replica's id, to ask that one (the routers honour it)."""
        b = self.backend
        return {"max_len": b.max_len, "slots": b.slots, "max_queue": b.max_queue, "block_tokens": b.block_tokens,
                "replica": self.id, "stats": self.inf.stats(),
                "calls": len(self._calls), "rows_cancelled": self.rows_cancelled}

    async def generate(self, rows: list, route=None, blocks: int = 0, call: str | None = None):
        """A request's rows (``[(prompt ids, params)]``, taken whole or refused whole), streamed:
        ("accepted", replica) first, or ("error", exception) alone when the rows were refused; then
        lists of items, in order: ("event", row, StreamEvent) per token, ("done", row, Completion) or
        ("error", row, exception) per row, and ("stats", replica, stats) last.  Each list holds what
        came since the last one was sent: the first token goes at once; after it a list is held
        for the replica's ``stream_hold_ms`` from its first item, so that what comes meanwhile
        goes in one message (fewer messages for as many tokens: less CPU in the replica, the
        ingress and Serve's proxy), and with ``stream_interval`` N > 1 also until it holds N tokens a
        row (at most HOLD_MAX_S); a row's end is sent at once.  ``route``
        and ``blocks`` are the router's (the first prompt's block hashes, the blocks the rows
        need); ``call``: a name the caller gives the call, for :meth:`cancel_rows`.  Closing the stream (the caller cancelled it, or went away) cancels
        the rows still running: Serve raises CancelledError here at the ``yield``."""
        try:
            handles = await self.backend.submit(rows)
        except Exception as e:  # noqa: BLE001 -- the caller answers it (QueueFull: 429; a bad row: 400)
            yield ("error", e)
            return
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i, h):
            async for ev in h:
                events.put_nowait(("event", i, ev))
            try:
                events.put_nowait(("done", i, h.result()))
            except Exception as e:  # noqa: BLE001 -- the row's own failure, the caller's to report
                events.put_nowait(("error", i, e))

        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        if call is not None:
            self._calls[call] = handles
        try:
            yield ("accepted", self.id)
            left, batch, first, since = len(handles), [], True, 0.0
            while left:
                try:
                    if batch:  # held for more tokens: until its deadline
                        wait = since + self._hold(batch, left) - asyncio.get_running_loop().time()
                        batch.append(await asyncio.wait_for(events.get(), max(wait, 0.0)))
                    else:
                        batch.append(await events.get())
                        since = asyncio.get_running_loop().time()
                except asyncio.TimeoutError:
                    pass
                else:
                    while not events.empty():
                        batch.append(events.get_nowait())
                    ended = sum(item[0] != "event" for item in batch)
                    if not (first or ended) and asyncio.get_running_loop().time() < since + self._hold(batch, left):
                        continue  # held for more
                    left -= ended
                if not left:
                    batch.append(("stats", self.id, self.inf.stats()))
                yield batch
                batch, first = [], False
        finally:
            self._calls.pop(call, None)
            # the caller went away (or the rows ended: a no-op then): free their slots at the next step
            self.rows_cancelled += sum(_stop(h) for h in handles)
            for p in pumps:
                p.cancel()

    def _hold(self, batch: list, left: int) -> float:
        """How long after its first item ``batch`` is held: ``stream_hold_ms``, or HOLD_MAX_S while it
        has fewer than ``stream_interval`` tokens for each of the ``left`` rows."""
        if self.stream_interval > 1 and len(batch) < self.stream_interval * left:
            return max(self.hold_s, HOLD_MAX_S)
        return self.hold_s

    async def cancel_rows(self, call: str, rows: list[int], pin: str | None = None) -> int:
        """Stop rows ``rows`` (indices) of the streaming call named ``call``, the call's other rows running
        on: each ends at the engine's next step, with what it made so far.  ``pin``: this replica's id,
        which the routers send the call to.  Returns how many were still running here (0 on a replica
        that never ran that call: one the router fell back to, its pinned replica gone)."""
        handles = self._calls.get(call) or []
        stopped = sum(_stop(handles[i]) for i in rows if 0 <= i < len(handles))
        self.rows_cancelled += stopped
        return stopped

    async def submit_job(self, kind: str, rows, kw: dict):
        submit = {"classify": self.backend.submit_classify, "score": self.backend.submit_score,
                  "embed": self.backend.submit_embed}[kind]
        job = await asyncio.to_thread(submit, rows, **kw)
        try:
            return await job
        finally:
            job.cancel()  # a no-op for a job that ended; else it stops before its next unit of work

    def record_routing_stats(self) -> dict:
        s = self.inf.stats()
        return {"waiting": s["waiting"], "running": s["active_slots"], "blocks_free": s.get("blocks_free", -1),
                "slots": self.backend.slots}

    def check_health(self):
        if self.inf.closed:
            raise RuntimeError("the Inferencer is closed")

    def __del__(self):
        inf = getattr(self, "inf", None)
        if inf is not None:
            inf.close(drain=False)


def _stop(handle) -> bool:
    """Cancel a row's handle; True when that stopped it (it ran, and had not been cancelled before)."""
    return not handle.cancel_requested and handle.cancel()


class Ingress:
    """The HTTP side: one shell per model (``replicas``: name -> its replicas' handle), and a dispatcher
    that hands each request to the shell of the model its body names."""

    async def __init__(self, replicas: dict, paths: dict, shell: dict):
        apps = {}
        names = tuple(replicas)
        for name, handle in replicas.items():
            model = await asyncio.to_thread(slotinfer.load, paths[name], weights=False)  # templates, tokenizer
            info = await handle.info.remote()
            apps[name] = shell_app(RemoteBackend(handle, info), model, name, served=names, **shell)
        self._dispatcher = Dispatcher(apps)

    def __serve_build_asgi_app__(self):
        return self._dispatcher


class Dispatcher:
    """An ASGI app over several shells: ``/v1/models`` lists every model; ``/v1/models/NAME`` and a
    request whose JSON body names a model go to that model's shell; the rest (and a model no shell
    serves, which it answers with its 404) to the first."""

    def __init__(self, apps: dict):
        self.apps = apps
        self.first = next(iter(apps.values()))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or len(self.apps) == 1:
            return await self.first(scope, receive, send)
        path = scope["path"]
        if path == "/v1/models" and scope["method"] == "GET":
            return await self._models(scope, receive, send)
        if path.startswith("/v1/models/"):
            app = self.apps.get(path[len("/v1/models/"):], self.first)
            return await app(scope, receive, send)
        if scope["method"] != "POST":
            return await self.first(scope, receive, send)
        limit = self.first.state.slotinfer.max_body
        chunks, more, size = [], True, 0
        while more and size <= limit:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        app = self.first
        if not more:
            try:
                app = self.apps.get(json.loads(b"".join(chunks)).get("model"), self.first)
            except (ValueError, AttributeError, TypeError):
                pass  # not a JSON object: the shell says what is wrong with it
        body = [b"".join(chunks)]

        async def replay():
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": more}
            return await receive()

        return await app(scope, replay, send)

    async def _models(self, scope, receive, send):
        from starlette.requests import Request
        from starlette.responses import JSONResponse

        from .errors import APIError

        server = self.first.state.slotinfer
        try:
            server._authorize(Request(scope, receive))
        except APIError as e:
            return await e.response()(scope, receive, send)
        cards = [app.state.slotinfer._model_card() for app in self.apps.values()]
        return await JSONResponse({"object": "list", "data": cards})(scope, receive, send)


def serve_app(model, *, replicas: int | None = None, autoscale: tuple[int, int] | None = None,
              routing: str = "prefix", slots: int = 32, max_queue: int = 64, max_len: int | None = None,
              engine: dict | None = None, num_cpus: float = 1.0, num_gpus: float = 0, replica_options: dict | None = None,
              api_key: str | None = None, ingress_replicas: int = 1, ingress_cpus: float = 0.5, stream_interval: int = 1,
              stream_hold_ms: float = STREAM_HOLD_MS, **shell):
    """A Ray Serve application of slotinfer replicas, for ``serve.run`` (or a Serve config file's
    ``import_path``).

    ``model``: a model's path or hub id, or ``{name: path}`` for several models in one application
    (``/v1/models`` lists them all; a request's ``model`` picks one).  ``replicas=N`` replicas of each
    model, or ``autoscale=(MIN, MAX)``: Serve adds replicas while each has more than ``slots`` requests
    and takes them away while idle.  ``routing``: "prefix" (requests whose prompts start alike go to the
    replica that holds that start), "pow2" (Serve's default: the shorter queue of two), "round_robin".
    ``slots``, ``max_queue``, ``max_len`` and ``engine`` (more Inferencer arguments) configure each
    replica's Inferencer; ``num_cpus``/``num_gpus``: what each replica asks Ray for, and
    ``replica_options`` more of its Ray actor options (``runtime_env``, ``resources``).
    ``stream_hold_ms``: how long a replica holds a streamed row's tokens after the first, to send
    those that come meanwhile in one message (default 50; 0: each as it comes), and
    ``stream_interval=N``: also until it holds N of them (at most 0.5 s); both trade smoother streams
    for less CPU per token in the replica, the ingress and Serve's proxy.  The rest
    (``api_key``, ``max_body_bytes``, ``read_timeout``, ``retry_after``) configure the routes, as
    :func:`~slotinfer.serve.build_app`'s.
    """
    paths = model if isinstance(model, dict) else {default_name(hub_path(model)): model}
    if not paths:
        raise InvalidRequestError("serve_app needs at least one model")
    for name, path in paths.items():
        hub_path(path)
    if (replicas is None) == (autoscale is None):
        raise InvalidRequestError("give the number of replicas (replicas=N) or the autoscaling bounds "
                                  "(autoscale=(MIN, MAX)), one of the two")
    if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1):
        raise InvalidRequestError(f"replicas must be an int >= 1, got {replicas!r}")
    if autoscale is not None:
        lo, hi = autoscale
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise InvalidRequestError(f"autoscale must be (MIN, MAX) with 1 <= MIN <= MAX, got {autoscale!r}")
    if not isinstance(stream_interval, int) or isinstance(stream_interval, bool) or stream_interval < 1:
        raise InvalidRequestError(f"stream_interval must be an int >= 1 (tokens a message), got {stream_interval!r}")
    if isinstance(stream_hold_ms, bool) or not isinstance(stream_hold_ms, (int, float)) or not 0 <= stream_hold_ms <= 10_000:
        raise InvalidRequestError(f"stream_hold_ms must be a number of milliseconds from 0 to 10000, got {stream_hold_ms!r}")
    if routing not in ROUTERS:
        raise InvalidRequestError(f"routing must be one of {sorted(ROUTERS)}, got {routing!r}")
    engine = dict(engine or {}, slots=slots, max_queue=max_queue)
    if max_len is not None:
        engine["max_len"] = max_len
    router = RequestRouterConfig(request_routing_stats_period_s=STATS_PERIOD_S,
                                 **({"request_router_class": ROUTERS[routing]} if ROUTERS[routing] else {}))
    # Serve queues a request only past what the Inferencer's own queue holds: the replica refuses first (429)
    scale = {"num_replicas": replicas} if replicas else {
        "autoscaling_config": {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                               "target_ongoing_requests": slots}}
    bound = {}
    for name, path in paths.items():
        deployment = serve.deployment(Replica, name=f"slotinfer-{_dns(name)}",
                                      max_ongoing_requests=slots + max_queue + 1, max_queued_requests=max_queue or -1,
                                      ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus,
                                                         **(replica_options or {})},
                                      request_router_config=router, health_check_period_s=2, **scale)
        bound[name] = deployment.bind(path, engine, stream_interval, float(stream_hold_ms))
    ingress = serve.deployment(serve.ingress()(Ingress), name="slotinfer-ingress", num_replicas=ingress_replicas,
                               max_ongoing_requests=10_000, ray_actor_options={"num_cpus": ingress_cpus})
    return ingress.bind(bound, paths, dict(shell, api_key=api_key))


def hub_path(path):
    """``path`` resolved (a hub id through the cache); a clear error at once when it names no model."""
    from pathlib import Path

    if not isinstance(path, (str, Path)):
        raise InvalidRequestError(f"a model is a path or a hub id (a str), got {path!r}")
    local = Path(hub.local_path(path)).expanduser()
    if not local.exists():
        raise ModelNotFoundError(f"no model at {str(path)!r}: pass a model folder, a GGUF file or a hub id")
    return local


def _dns(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)


def build(args: dict):
    """The application builder a Serve config file names (``import_path: slotinfer.serve.ray_app:build``):
    its ``args`` are :func:`serve_app`'s keywords (``autoscale`` as a list ``[MIN, MAX]``)."""
    args = dict(args)
    if "model" not in args:
        raise InvalidRequestError("the application's args need 'model': a path, a hub id, or {name: path}")
    if args.get("autoscale") is not None:
        args["autoscale"] = tuple(args["autoscale"])
    return serve_app(args.pop("model"), **args)
