"""Request routers for the Ray Serve application: Ray Serve's own extension point
(:class:`ray.serve.request_router.RequestRouter`), set in the replicas' deployment through
``RequestRouterConfig(request_router_class=...)``; the router runs inside each caller's handle.

:class:`PrefixRouter` sends a request whose prompt starts as an earlier one did to the replica
that served the earlier one, whose prefix cache holds its K/V.  A prompt is named by the chained
hashes of its first full blocks (:func:`prefix_hashes`, the hashing the prefix cache registers
blocks under, salted by ``cache_salt``), which the caller passes as the ``route`` keyword of the
replica's ``generate``.  The router remembers which replica each hash went to (bounded, least
recently used first out); a request goes to the replica of its longest remembered hash unless that
replica is busy (every slot taken, or short of free K/V blocks) while another has room, and
otherwise to the least loaded.  Load is what this router has sent and not seen end, with the
queue depth and free blocks each replica reports (``record_routing_stats``).

:class:`RoundRobinRouter` takes the replicas in turn (a plain balancer, for comparison);
:class:`Pow2Router` is Serve's own power of two choices (the shorter queue of two).

Each of them sends a call whose ``pin`` keyword names a replica (its id, as the replica's
``generate`` reported it) to that replica: the ingress reaches the replica that runs a request
again that way, to stop some of its rows (``cancel_rows``).  A pinned replica that is gone takes no
call; the call goes to another, where it finds nothing of its own to do.
"""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict

from ray.serve._private.request_router import (
    PowerOfTwoChoicesRequestRouter,  # Serve's default; not public in 2.60
)
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from ..kv.block_pool import chain_hash

MAX_BLOCKS = 64  # the first blocks of a prompt that name it: a prefix longer than this routes as its start
MAX_ENTRIES = 200_000  # hashes remembered


def prefix_hashes(ids, block_tokens: int, salt: str | None, most: int = MAX_BLOCKS) -> list[int]:
    """The chained hash of each full block of ``ids`` (at most ``most``), as the prefix cache chains them."""
    out, parent = [], None
    for start in range(0, min(len(ids) // block_tokens, most) * block_tokens, block_tokens):
        parent = chain_hash(parent, tuple(ids[start:start + block_tokens]), salt)
        out.append(parent)
    return out


def _pin(pending_request: PendingRequest | None):
    return pending_request.kwargs.get("pin") if pending_request is not None else None


def pinned(candidates: list[RunningReplica], pending_request: PendingRequest | None) -> list[list[RunningReplica]] | None:
    """The choice for a call pinned to one replica (its ``pin`` keyword, a replica's id): that replica,
    or any while it is not among the candidates (gone); None for a call not pinned."""
    pin = _pin(pending_request)
    if pin is None:
        return None
    mine = [r for r in candidates if r.replica_id.unique_id == pin]
    return [mine] if mine else [candidates]


class PrefixRouter(RequestRouter):
    """Prefix affinity with a least-loaded fallback (see the module's text)."""

    def initialize_state(self, max_entries: int = MAX_ENTRIES):
        self._owner: OrderedDict[int, object] = OrderedDict()  # chain hash -> replica id
        self._max_entries = max_entries
        self.hits = self.misses = self.fallbacks = 0  # routing decisions, for tests and benchmarks

    def _load(self, r: RunningReplica) -> tuple:
        stats = r.routing_stats or {}
        sent = self.replica_queue_len_cache.get(r.replica_id) or 0
        return sent + stats.get("waiting", 0), -stats.get("blocks_free", 0)

    def _busy(self, r: RunningReplica, blocks: int) -> bool:
        stats = r.routing_stats or {}
        sent = self.replica_queue_len_cache.get(r.replica_id) or 0
        return sent >= stats.get("slots", r.max_ongoing_requests) or 0 <= stats.get("blocks_free", blocks) < blocks

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pin = pinned(candidate_replicas, pending_request)
        if pin is not None:
            return pin
        ranked = sorted(candidate_replicas, key=lambda r: (self._load(r), random.random()))
        kw = pending_request.kwargs if pending_request is not None else {}
        hashes, blocks = kw.get("route") or (), kw.get("blocks", 0)
        by_id = {r.replica_id: r for r in candidate_replicas}
        preferred = next((by_id[self._owner[h]] for h in reversed(hashes) if self._owner.get(h) in by_id), None)
        if preferred is None:
            if hashes:
                self.misses += 1
            return [ranked[:1], ranked[1:]] if len(ranked) > 1 else [ranked]
        if self._busy(preferred, blocks) and ranked[0] is not preferred and not self._busy(ranked[0], blocks):
            self.fallbacks += 1
            return [ranked[:1], [r for r in ranked[1:] if r is not preferred], [preferred]]
        self.hits += 1
        rest = [r for r in ranked if r is not preferred]
        return [[preferred], rest] if rest else [[preferred]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        for h in pending_request.kwargs.get("route") or ():
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
        while len(self._owner) > self._max_entries:
            self._owner.popitem(last=False)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        for h in [h for h, r in self._owner.items() if r == replica_id]:  # its cache went with it
            del self._owner[h]


class RoundRobinRouter(RequestRouter):
    """Each replica in turn, blind to prompts and load."""

    def initialize_state(self):
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pin = pinned(candidate_replicas, pending_request)
        if pin is not None:
            return pin
        ordered = sorted(candidate_replicas, key=lambda r: str(r.replica_id))
        i = next(self._turn) % len(ordered)
        return [ordered[i:i + 1], ordered[i + 1:] + ordered[:i]]


class Pow2Router(PowerOfTwoChoicesRequestRouter):
    """Serve's default router (two replicas drawn at random, the shorter queue taken; requests served in
    the order they came), with pinned calls sent to their replica.

    Serve's router hands the replica a routing task found to the first request waiting, whichever
    request the task was routing: a replica found for a pinned call goes to that call alone, and one
    found for another request to the first waiting request that is not pinned."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pin = pinned(candidate_replicas, pending_request) if candidate_replicas else None
        if pin is not None:
            return pin
        return await super().choose_replicas(candidate_replicas, pending_request)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None):
        exact = self._get_pending_request_matching_internal_request_id(request_metadata)
        if exact is not None and _pin(exact) is not None:
            return RequestRouter._fulfill_next_pending_request(self, replica, request_metadata)
        waiting = self._pending_requests_to_fulfill
        while waiting and waiting[0].future.done():
            waiting.popleft()
        first = next((pr for pr in waiting if not pr.future.done() and _pin(pr) is None), None)
        if first is not None:
            waiting.remove(first)
            self._cancel_routing_task_for_pending_request(first)
            self._record_queue_wait_time(first)
            first.future.set_result(replica)
            self._remove_pending_request_from_indices(first)
