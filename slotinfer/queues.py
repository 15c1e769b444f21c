"""``serve_queue``: requests read from one queue, their completions put on another.

A request is a prompt, a :class:`QueuedRequest` (``slotinfer.Request``) or a dict with ``prompt``
and parameters; each completion carries the request's id (see :meth:`Inferencer.serve_queue`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from . import request
from .errors import InvalidRequestError
from .types import Completion


@dataclass
class QueuedRequest:
    """A request for :meth:`Inferencer.serve_queue` (``slotinfer.Request``): a prompt, its parameters and your id."""

    prompt: object
    params: dict = field(default_factory=dict)
    id: object = None


def serve_queue(inferencer, in_q, out_q, *, sentinel=None):
    """Submit what ``in_q`` holds to ``inferencer`` until ``sentinel``, each completion put on ``out_q``
    (see :meth:`Inferencer.serve_queue`)."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    count = 0

    def forward():
        sent, total = 0, None
        while total is None or sent < total:
            c = done.get()
            if isinstance(c, _Total):
                total = c.n
                continue
            out_q.put(c)
            sent += 1
        out_q.put(sentinel)

    forwarder = threading.Thread(target=forward, name="slotinfer-serve-queue", daemon=True)
    forwarder.start()
    try:
        while (req := in_q.get()) is not sentinel:
            rid = _request_id(req, count)
            count += 1
            try:
                prompt, params = _request_parts(req)
                handle = inferencer.submit(prompt, **params)
            except Exception as e:  # a malformed or invalid request ends as its own error completion
                done.put(_failed(rid, e))
                continue
            handle._future.add_done_callback(lambda f, rid=rid: done.put(_outcome(rid, f)))
    finally:
        done.put(_Total(count))
        forwarder.join()


@dataclass(frozen=True)
class _Total:
    n: int


def _request_id(req, position: int):
    """The id a completion carries: the request's own, else its position in ``in_q`` (0-based)."""
    if isinstance(req, QueuedRequest):
        rid = req.id
    else:
        rid = req.get("id") if isinstance(req, dict) else None
    return position if rid is None else rid


def _request_parts(req) -> tuple[object, dict]:
    if isinstance(req, QueuedRequest):
        if not isinstance(req.params, Mapping):
            raise InvalidRequestError(f"QueuedRequest.params must be a dict of parameters (or left out), "
                                      f"got {request.short(req.params)}")
        prompt, params = req.prompt, dict(req.params)
    elif isinstance(req, dict):
        if "prompt" not in req:
            raise InvalidRequestError(f"a request dict needs a 'prompt' key (and optionally 'id' and parameters); "
                                      f"got keys {request.some(list(req))}")
        prompt, params = req["prompt"], {k: v for k, v in req.items() if k not in ("prompt", "id")}
    else:
        return req, {}
    request.check_names(params, (*request.SUBMIT, "messages"))  # before they become keywords of submit
    return prompt, params


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
