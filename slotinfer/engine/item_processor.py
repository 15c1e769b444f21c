"""The ItemProcessor: the host side of the loop, and the one owner of a request's lifecycle.

It owns every request's record (:class:`Item`), the one FIFO of waiting items (the
Inferencer only hands requests over to it, between threads) and the free-slot list.
Each step it takes the tokens the device produced, appends them, streams text,
finishes items (EOS / stop token / stop string / max_tokens / cancellation) and frees
their slots; the :class:`~slotinfer.engine.scheduler.Scheduler` decides which waiting items
take them, and which running one gives its blocks back when the pool runs short.

An item's :class:`State` changes only through :meth:`ItemProcessor.move`, along
:data:`TRANSITIONS`: waiting -> prefilling -> decoding -> finished, and cancelled or
failed from any state that has not ended.  A preempted item (:meth:`ItemProcessor.preempt`:
the K/V pool ran short) goes from its slot back to the front of the FIFO, to be recomputed.
"""

from __future__ import annotations

import enum
import functools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import EngineError
from ..handle import Handle, StreamEvent
from ..text.stops import after_token, final_text, longest
from .sampling import SamplingParams
from ..kv.slot_table import SlotTable
from ..types import Completion


class State(enum.Enum):
    WAITING = "waiting"  # submitted, no slot yet
    PREFILLING = "prefilling"  # in a slot, its prompt being encoded (maybe over several chunks)
    DECODING = "decoding"  # its first token issued; one more each decode step
    FINISHED = "finished"  # stop / length: a Completion
    CANCELLED = "cancelled"  # a Completion with finish_reason "cancelled"
    FAILED = "failed"  # an error (its own, or the engine's)

    @property
    def ended(self) -> bool:
        return self in (State.FINISHED, State.CANCELLED, State.FAILED)


_END = {State.CANCELLED, State.FAILED}
TRANSITIONS: dict[State, frozenset[State]] = {
    State.WAITING: frozenset({State.PREFILLING, *_END}),
    State.PREFILLING: frozenset({State.DECODING, State.WAITING, *_END}),  # waiting again: preempted
    State.DECODING: frozenset({State.FINISHED, State.WAITING, *_END}),
    State.FINISHED: frozenset(), State.CANCELLED: frozenset(), State.FAILED: frozenset(),
}


@dataclass(eq=False)
class Item:
    """One request and its progress."""

    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    stops: tuple[str, ...]
    enders: frozenset[int]
    handle: Handle
    detok: object
    top_logprobs: int = -1  # -1: none; 0: the chosen token's; n: also the top n
    on_token: object = None
    queued: bool = False  # given to the ItemProcessor (ItemProcessor.add)
    slot: int = -1
    prefilled: int = 0  # tokens of ``feed`` whose K/V its slot holds
    feed: list[int] = None  # what its slot prefills: the prompt, and after a preemption also the tokens generated
    salt: str | None = None  # the prefix cache's tenant: only requests with the same salt share blocks
    cached: int = 0  # prompt tokens whose K/V came from the prefix cache
    presence: float = 0.0  # presence and frequency penalties, logit_bias: the step's logit adjustments
    frequency: float = 0.0
    logit_bias: dict | None = None
    constraint: object = None  # a structured.Constraint: the tokens it may take next, advanced by each accepted
    draft: object = None  # its spec.Row while the engine speculates: its tokens, indexed for drafting
    issued: int = 0  # tokens asked of the device so far (the Encoder's first, then one per decode step)
    state: State = State.WAITING  # changed only by ItemProcessor.move
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""  # all decoded text
    emitted: int = 0  # how much of ``text`` has been streamed
    t_submit: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first: float = 0.0


    def __post_init__(self):
        if self.feed is None:
            self.feed = self.prompt

    @property
    def reserved(self) -> int:
        """Tokens whose K/V its slot may come to hold: the prompt and every token but the last."""
        return len(self.prompt) + self.max_tokens - 1

    @property
    def admission_tokens(self) -> int:
        """Tokens its slot holds from admission on: what it prefills, and the first decode step's write."""
        return min(len(self.feed) + 1, self.reserved)

    @property
    def adjusts(self) -> bool:
        return bool(self.presence or self.frequency or self.logit_bias)

    @property
    def in_step(self) -> bool:
        """Whether the host has every token issued for it: a constrained item needs that before its
        next step (its mask depends on them)."""
        return self.constraint is None or len(self.tokens) == self.issued


class ItemProcessor:
    def __init__(self, table: SlotTable):
        self.table = table  # its lengths and new_batch_idx follow the slots given and freed here
        self.waiting: deque[Item] = deque()
        self.free = list(range(table.slots))
        self.by_slot: list[Item | None] = [None] * table.slots
        self.finished = 0
        # Cancellations arrive here (from any thread) instead of being found by scanning every
        # waiting item each step, which would cost a step O(queue) in an offline job of millions.
        self.cancelled: queue.SimpleQueue = queue.SimpleQueue()
        # Called with (item, ended) when an item leaves its slot for good (ended: finished, stopped,
        # cancelled, failed) or for the queue (preempted): what the engine keeps per request beside
        # the slot (a speculating row's drafting state) goes with it.
        self.on_leave = None

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(self.by_slot)

    def prefilling(self) -> list[Item]:
        """The items whose prompt is still to encode, in admission order."""
        return [self.by_slot[s] for s in self.table.new_slots()]

    def prefilled(self, item: Item):
        """``item``'s prompt is cached: it decodes from the next step on."""
        self.table.prompt_in(item.slot)
        self.move(item, State.DECODING)

    def running(self) -> list[Item]:
        return [it for it in self.by_slot if it is not None and it.state is State.DECODING]

    def move(self, item: Item, to: State):
        """The one place an item's state changes, along :data:`TRANSITIONS`."""
        if to not in TRANSITIONS[item.state]:
            raise EngineError(f"request {item.id} cannot go from {item.state.value} to {to.value}: "
                              "a bug in slotinfer's lifecycle, please report it")
        item.state = to

    def in_flight(self) -> list[Item]:
        """Every item the engine holds that has not ended: waiting, then those in slots."""
        return [*self.waiting, *filter(None, self.by_slot)]

    def watch(self, item: Item):
        """Hear of ``item``'s cancellation, from any thread, from the moment it is made."""
        item.handle._on_cancel = functools.partial(self.cancelled.put, item)

    def add(self, item: Item):
        item.queued = True
        self.waiting.append(item)
        if item.handle.cancel_requested:  # cancelled before it got here
            self.cancelled.put(item)

    def place(self, item: Item) -> int:
        """``item`` (taken off the queue) goes into the first free slot: prefilling from now on.
        Returns the slot."""
        item.slot = self.free.pop(0)
        self.move(item, State.PREFILLING)
        item.t_admit = time.perf_counter()
        self.by_slot[item.slot] = item
        return item.slot

    def preempt(self, item: Item):
        """Take ``item`` out of its slot and put it first in the FIFO: its blocks go back to the pool,
        and when it is admitted again its slot recomputes the K/V of its prompt and of the tokens it
        has (its ``feed``), then goes on decoding.  Nothing it streamed is sent again."""
        self._keep(item)  # what it held stays cached: its recompute may start from there
        self._free_slot(item)
        item.slot, item.prefilled = -1, 0
        item.feed = item.prompt + item.tokens
        item.issued = len(item.tokens)
        self.move(item, State.WAITING)
        self.waiting.appendleft(item)
        if self.on_leave is not None:
            self.on_leave(item, False)

    def _keep(self, item: Item):
        """``item`` leaves its slot: its prompt and what it generated stay in the prefix cache, as far
        as the slot holds their K/V (a generated token's is written by the step that reads it)."""
        written = min(int(self.table.lengths[item.slot]), len(item.prompt) + len(item.tokens))
        if self.table.caching and written:
            self.table.keep(item.slot, (item.prompt + item.tokens)[:written], item.salt)

    def _free_slot(self, item: Item):
        self.by_slot[item.slot] = None
        self.table.release(item.slot)
        self.free.append(item.slot)
        self.free.sort()

    def reap_cancelled(self):
        """End the cancelled items queued (a no-op for one that ended meanwhile).

        One cancelled before :meth:`add` is passed over: :meth:`add` hears of it again.
        """
        while not self.cancelled.empty():
            item = self.cancelled.get()
            if item.queued:
                self.finish(item, "cancelled")

    def accept(self, item: Item, token: int, logprob=None, top=None) -> bool:
        """Append one generated token; returns True when the item finished."""
        if item.state is not State.DECODING:
            return True
        if not item.tokens:
            item.t_first = time.perf_counter()
        item.tokens.append(token)
        if logprob is not None:
            item.logprobs.append(logprob)
        if top is not None:
            item.top.append(top[: item.top_logprobs])  # the step computed at least as many as any row asked for
        item.text, reason = after_token(token, item.text, detok=item.detok, enders=item.enders,
                                        constraint=item.constraint, stops=item.stops,
                                        checked=max(0, item.emitted - longest(item.stops)), count=len(item.tokens),
                                        max_tokens=item.max_tokens)
        if reason is not None:
            item.text, reason = final_text(item.text, reason, detok=item.detok, stops=item.stops)
            if self._emit(item, token, len(item.text)):
                self.finish(item, reason)
            return True
        hold = longest(item.stops) - 1 if item.stops else 0  # text that may still become a stop string
        return not self._emit(item, token, len(item.text) - hold)

    def _emit(self, item, token, upto) -> bool:
        """Stream text up to ``upto``; False (and the item failed) if the consumer raised."""
        upto = max(upto, item.emitted)
        asked = item.top_logprobs  # a step computes logprobs for every row when any row asks: pass on only the asked
        ev = StreamEvent(token, item.text[item.emitted:upto], item.logprobs[-1] if asked >= 0 and item.logprobs else None,
                         item.top[-1] if asked > 0 and item.top else None)
        item.emitted = upto
        try:
            if item.on_token is not None:
                item.on_token(ev)
            item.handle._push(ev)
        except BaseException as e:  # a consumer's bug, whatever it raises, fails its own request, never the worker
            if not owned_by_request(e):
                raise
            self.finish(item, "error", EngineError(
                f"the on_token callback of request {item.id} raised {type(e).__name__} ({e!r}); the request "
                f"ended there and the others go on: make the callback return normally"))
            return False
        return True

    def finish(self, item: Item, reason: str, error: BaseException | None = None):
        """End ``item`` exactly once and free its slot."""
        if item.state.ended:
            return
        if item.state is State.WAITING and item.queued:  # one never added is in no queue: nothing to search
            try:
                self.waiting.remove(item)
            except ValueError:
                pass  # admit() took it off the queue and found it cancelled
        if item.slot >= 0 and self.by_slot[item.slot] is item:
            if error is None and reason != "error":
                self._keep(item)
            self._free_slot(item)
        self.move(item, State.FAILED if error is not None or reason == "error" else
                  State.CANCELLED if reason == "cancelled" else State.FINISHED)
        self.finished += 1
        if self.on_leave is not None:
            self.on_leave(item, True)
        if error is not None:
            item.handle._finish(error=error)
            return
        now = time.perf_counter()
        decode_s = now - item.t_first if item.t_first else 0.0
        metrics = {
            "queue_wait_s": (item.t_admit or now) - item.t_submit,
            "time_to_first_token_s": (item.t_first - item.t_submit) if item.t_first else None,
            "decode_tokens_per_s": (len(item.tokens) - 1) / decode_s if decode_s > 0 and len(item.tokens) > 1 else None,
        }
        item.handle._finish(Completion(
            tokens=list(item.tokens), text=item.text if reason != "cancelled" else item.text[: item.emitted],
            finish_reason=reason, prompt_tokens=len(item.prompt), cached_tokens=item.cached,
            logprobs=list(item.logprobs) if item.top_logprobs >= 0 else None,
            top_logprobs=list(item.top) if item.top_logprobs > 0 else None,
            seed=item.seed, metrics=metrics,
        ))


def owned_by_request(e: BaseException) -> bool:
    """Whether ``e``, raised by what one request carries, ends that request alone.

    Anything does, ``BaseException`` included (a callback's ``SystemExit`` or
    ``asyncio.CancelledError`` means nothing to the worker), except a ``KeyboardInterrupt``
    on the main thread: there it may be the user's Ctrl-C (``batch_generate`` runs there),
    which must stop the program, not one request.  Signals never reach the worker thread.
    """
    return not (isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread())
