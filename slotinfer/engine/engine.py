"""The Engine: schedule -> run -> postprocess, one step at a time.

Both the threaded :class:`~slotinfer.Inferencer` and ``Model.batch_generate`` drive
it.  A step admits waiting items into free slots, prefills one budgeted chunk of
new prompts (Encoder), issues one fused decode step for every running slot
(Decoder), and only then reads back the *previous* step's tokens: the host's
bookkeeping of step t overlaps the device's work on step t+1, and each step costs
exactly one device-to-host copy.  The exception is a step with constrained rows
(:mod:`slotinfer.engine.structured`): their masks need the previous step's tokens, so it reads
that step back first.

The step's phases (admit, prefill, decode, process) share the slot table's state and sit here,
in order; its speculative parts (who drafts, the verify step, reading it back) are
:mod:`slotinfer.engine.speculation`'s.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .. import device, request
from ..errors import EngineError, GrammarError, PromptTooLongError
from ..handle import Handle
from ..kv import KV_BLOCK_SIZE
from ..kv.slot_table import SlotTable
from .decoder import Decoder
from .encoder import Encoder
from .item_processor import Item, ItemProcessor, State, owned_by_request
from .sampling import RowParams, SamplingParams, spread, top_n_computed
from .scheduler import Scheduler
from .speculation import BANDWIDTH_ROWS, POSITION_COST, SPECULATIVE, STEP_COSTS, SYNC_COST, SpeculativeSteps, _Verified
from .structured import wait_for_any, words

_ids = itertools.count(1)


@dataclass(frozen=True)
class _Row:
    """One running item's part in a decode step in flight."""

    slot: int
    item: Item
    first: bool  # its Encoder token travels back with this step
    decoded: bool  # the step computed a token for it


@dataclass
class _Issued:
    """A decode step in flight: what it computed and for whom.

    ``packed`` stacks, in this order, each slot's input token (for a row just prefilled:
    the Encoder's first token), the step's output token, and with logprobs their
    logprobs (output's, then input's), so the host copies the step once.  ``extra`` holds
    top-n ids and values: the output's, then the input's.
    """

    packed: mx.array
    rows: list[_Row]
    top_n: int
    extra: list

    def to_host(self) -> "_OnHost":
        """The one device-to-host copy of the step."""
        host = np.array(self.packed)
        tops = [np.array(a) for a in self.extra] if self.top_n > 0 else None
        lp = self.top_n >= 0
        return _OnHost(first=host[0], token=host[1], logprob=host[2] if lp else None,
                       first_logprob=host[3] if lp else None, top=tops[0:2] if tops else None,
                       first_top=tops[2:4] if tops else None)


@dataclass
class _OnHost:
    """A step's results on the host, ``[b]`` arrays indexed by slot."""

    first: np.ndarray  # the token each slot fed in: the Encoder's first for rows that carry it
    token: np.ndarray  # the token the step produced
    logprob: np.ndarray | None
    first_logprob: np.ndarray | None
    top: list | None  # [ids, values], each [b, n]
    first_top: list | None

    def accepted(self, slot: int, first: bool):
        """(token, logprob or None, top-n pairs or None) of ``slot``'s first or decoded token."""
        token, lp, top = (self.first, self.first_logprob, self.first_top) if first else \
            (self.token, self.logprob, self.top)
        return (int(token[slot]), None if lp is None else float(lp[slot]),
                None if top is None else list(zip(top[0][slot].tolist(), top[1][slot].tolist())))


class Engine(SpeculativeSteps):
    def __init__(self, model, *, slots: int, max_len: int, prefill_tokens: int = 512,
                 prefix_cache_bytes: int | None = None, kv_dtype=None, kv_cache_bytes: int | None = None,
                 block_size: int = KV_BLOCK_SIZE, speculative: str | None = None, draft_tokens: int = 8,
                 position_cost: float = POSITION_COST, bandwidth_rows: int = BANDWIDTH_ROWS,
                 sync_cost: float = SYNC_COST, step_costs: tuple = STEP_COSTS):
        model.net  # a checkpoint loaded without weights says so here, before any memory is sized
        if speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE}, got {speculative!r}")
        if not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool) or not 1 <= draft_tokens <= 32:
            raise ValueError(f"draft_tokens must be an int in 1..32, got {draft_tokens!r}")
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if prefix_cache_bytes is not None and (not isinstance(prefix_cache_bytes, int)
                                               or isinstance(prefix_cache_bytes, bool) or prefix_cache_bytes < 0):
            raise ValueError(f"prefix_cache_bytes must be an int >= 0 (0: no prefix cache; None: the device's "
                             f"default), got {prefix_cache_bytes!r}")
        if kv_cache_bytes is not None and (not isinstance(kv_cache_bytes, int) or isinstance(kv_cache_bytes, bool)
                                           or kv_cache_bytes < 1):
            raise ValueError(f"kv_cache_bytes must be an int >= 1 (None: the default, slots x max_len tokens at "
                             f"most a quarter of the memory), got {kv_cache_bytes!r}")
        self.model, self.slots, self.max_len = model, slots, max_len
        self.table = SlotTable(model.config, slots=slots, max_len=max_len, kv_cache_bytes=kv_cache_bytes,
                               dtype=device.kv_dtype(model.dtype, override=kv_dtype), block_size=block_size,
                               prefix_cache_bytes=device.prefix_cache_bytes() if prefix_cache_bytes is None
                               else prefix_cache_bytes)
        self.encoder = Encoder(model.net, self.table, max(1, prefill_tokens))
        self.decoder = Decoder(model.net, self.table)
        self._speculate(speculative, draft_tokens=draft_tokens, position_cost=position_cost,
                        bandwidth_rows=bandwidth_rows, sync_cost=sync_cost, step_costs=step_costs)
        self.items = ItemProcessor(self.table)
        if speculative:
            self.items.on_leave = self._leave_draft
        self.rows = RowParams(slots, model.config.vocab_size)
        self.tokens = mx.zeros((slots,), dtype=mx.int32)  # each slot's latest token, on the device
        self.gen = np.zeros(slots, dtype=np.uint32)  # sampling step of each slot's next token
        self._pending: _Issued | None = None
        self._first_extra: list = []  # the logprob outputs of the Encoder's first tokens, [b] / [b, n], for _decode
        mx.eval(self.tokens, self.rows.temperature, self.rows.top_k, self.rows.top_p, self.rows.min_p,
                self.rows.penalty, self.rows.seeds, self.rows.steps)
        self.counters = dict(steps=0, decode_tokens=0, prefill_tokens=0, prefill_s=0.0, step_s=0.0,
                             occupancy=0, submitted=0, preempted=0, spec_passes=0, spec_drafted=0, spec_accepted=0)
        self.scheduler = Scheduler(self.items, self.table, self.counters)
        self._t0 = time.perf_counter()

    # -- requests -------------------------------------------------------------

    def make_item(self, prompt, **params) -> Item:
        """Check a request (raising a typed error) and make its record.

        ``params`` are those of :data:`slotinfer.request.ENGINE` (see the table in
        :mod:`slotinfer.request`); a parameter's own error comes before the prompt's.
        """
        model = self.model
        vocab = model.config.vocab_size
        p = request.check(params, vocab)
        ids = model.encode_prompt(prompt)
        budget = min(p["max_tokens"], model.context_length - len(ids))
        self._check_room(len(ids), p["max_tokens"], budget)
        sampling = SamplingParams(*(p[k] for k in request.SAMPLING))
        constraint = model.grammars.constraint(p)  # compiled here, on the caller's thread: a bad one is refused
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(32)
        top = p["top_logprobs"]
        self.counters["submitted"] += 1
        rid = next(_ids)
        item = Item(
            id=rid, prompt=ids, params=sampling, seed=seed, max_tokens=budget, stops=p["stop"],
            enders=p["stop_token_ids"] | (frozenset() if p["ignore_eos"] else model.eos_ids),
            handle=Handle(rid, p["loop"]),
            detok=model.tokenizer.detokenizer(skip_special_tokens=p["skip_special_tokens"]),
            top_logprobs=top if (p["logprobs"] or top) else -1, on_token=p["on_token"], salt=p["cache_salt"],
            presence=p["presence_penalty"], frequency=p["frequency_penalty"], logit_bias=p["logit_bias"],
            constraint=constraint,
        )
        self.items.watch(item)  # its handle's cancel() reaches the item processor, wherever the item is
        return item

    def _check_room(self, n: int, asked: int, budget: int):
        """Refuse a request whose prompt of ``n`` tokens and ``budget`` (``max_tokens`` as ``asked``,
        cut to the model's context) overflow a slot (``max_len`` tokens) or the whole K/V pool (the
        prompt and every token but the last hold K/V): one rule, which the server words for its
        client too."""
        room = self.table.capacity_tokens
        for over, need, limit, setting, most in (
                (n + budget > self.max_len, n + asked, self.max_len, "max_len", self.max_len - n),  # quotes what was asked
                (n + budget - 1 > room, n + budget - 1, room, "kv_cache_bytes", room + 1 - n)):
            if over:
                e = PromptTooLongError(prompt_tokens=n, max_tokens=asked, limit=limit, setting=setting, need=need,
                                       most=most if most >= 1 else None,
                                       param="max_tokens" if most >= 1 else "prompt",
                                       pool_bytes=self.table.budget_bytes)
                raise e

    def add(self, item: Item):
        self.items.add(item)

    def waiting_for_slots(self) -> int:
        """Items added that no free slot (or not enough free K/V blocks) awaits: the engine's backlog."""
        return max(0, -self.scheduler.room())

    def in_flight(self) -> list[Item]:
        """What the engine holds that has not ended: waiting, then in slots."""
        return self.items.in_flight()

    def room(self) -> int:
        """Requests the engine could admit now without queueing them."""
        return self.scheduler.room()

    @property
    def busy(self) -> bool:
        return self.items.busy or self._pending is not None

    # -- the loop ---------------------------------------------------------------

    def step(self):
        """One iteration: schedule (admit), run (prefill a chunk, issue a decode step), process the
        previous step's tokens."""
        t0 = time.perf_counter()
        self._schedule()
        firsts = self._prefill()
        if self._read_first(firsts):
            self._process_pending()
        issued = self._decode(firsts, self._drafts(firsts))
        previous, self._pending = self._pending, issued
        if previous is not None:
            self._process(previous)
        self.counters["step_s"] += time.perf_counter() - t0

    def _schedule(self):
        """Cancelled items end; waiting ones are admitted into free slots, their sampling rows set."""
        self.items.reap_cancelled()
        admitted = self.scheduler.admit()
        if admitted:
            self._occupancy_changed(admitted)

    def _read_first(self, firsts) -> bool:
        """Whether the step in flight is read back before the next is issued: constrained rows need its
        tokens for their masks, drafts what to draft from, and a speculative step's lengths are known
        once read."""
        return self._pending is not None and (isinstance(self._pending, _Verified) or self._needs_previous(firsts)
                                              or self._may_draft())

    def _process_pending(self):
        previous, self._pending = self._pending, None
        self._process(previous)

    def step_or_fail(self):
        """One :meth:`step`; if the device step fails, the items in flight end with the cause
        (:meth:`fail_all`) and the engine goes on serving."""
        try:
            self.step()
        except Exception as e:
            self.fail_all(e)

    def run_until_done(self):
        while self.busy:
            self.step_or_fail()

    def _needs_previous(self, firsts) -> bool:
        """Whether a constrained running item waits for the step in flight (one whose first token
        comes from this step's prefill waits for the next step instead)."""
        fresh = {id(it) for it in firsts}
        return any(not it.in_step and it.issued < it.max_tokens and id(it) not in fresh
                   for it in self.items.running())

    def _masks(self, items) -> np.ndarray | None:
        """The [b, words] bitmask of ``items``' slots: each constrained one's allowed tokens, all
        ones elsewhere; None when none is constrained."""
        constrained = [it for it in items if it.constraint is not None]
        if not constrained:
            return None
        masks = np.full((self.slots, words(self.model.config.vocab_size)), -1, dtype=np.int32)
        for it in constrained:
            it.constraint.fill(masks, it.slot)
        return masks

    def _occupancy_changed(self, admitted):
        self.rows.set(self.items.by_slot)
        self.rows.reset_seen([it.slot for it in admitted], [it.feed for it in admitted],
                             [it.tokens for it in admitted])

    def _prefill(self) -> list[Item]:
        plan = self.encoder.plan(self.items.prefilling())
        if not plan:
            return []
        t0 = time.perf_counter()
        done = [it for it, c in plan if c.last]
        top_n = self._top_n([*self.items.running(), *done])
        masks = self._masks(done)
        resumed = any(len(it.tokens) for it in done)
        out = self.encoder.run([c for _, c in plan], self.rows.take([it.slot for it in done]) if done else None,
                               top_n=top_n, mask=mx.array(masks[[it.slot for it in done]]) if masks is not None
                               else None,
                               steps=mx.array([len(it.tokens) for it in done], dtype=mx.uint32) if resumed else None)
        for it, c in plan:
            it.prefilled += len(c.tokens)
            self.table.lengths[it.slot] += len(c.tokens)
            self.counters["prefill_tokens"] += len(c.tokens)
            # chunk by chunk into the prefix cache: a request admitted meanwhile shares what is in
            self.table.register(it.slot, it.feed[: it.prefilled], it.salt)
        if done:
            first, extra = out
            slots = mx.array([it.slot for it in done])
            self.tokens[slots] = first
            self._first_extra = [spread(e, slots, self.slots) for e in extra]
            for it in done:
                self.items.prefilled(it)
                it.issued = self.gen[it.slot] = len(it.tokens) + 1  # more than 0 tokens: a resumed item
        # A fresh prefill attends to its own K/V, so the tokens do not depend on the cache
        # writes: evaluated here, or a batch that never decodes (max_tokens=1) would leave
        # them lazy and chain every later batch's graph onto them.
        mx.async_eval(self.tokens, *self.table.keys, *self.table.values)
        self.counters["prefill_s"] += time.perf_counter() - t0
        return done

    def _decode(self, firsts, drafts=None) -> _Issued | _Verified | None:
        """Issue one decode step for the running items that still need tokens.

        An item whose in-flight steps already cover its ``max_tokens`` gets no more
        (its row idles), and when no item needs one, no step runs: the Encoder's
        first tokens then travel to the host on their own.
        """
        if not self.items.running():
            return None
        drafts = drafts or {}
        given = dict(drafts)
        while (needed := self.scheduler.grow_or_preempt(firsts, self._pending is not None, drafts)) is None:
            self._process_pending()  # the items it finishes give their blocks back
        if len(drafts) < len(given):  # no blocks for them: given up first
            for it in self.items.running():
                if id(it) in given and id(it) not in drafts:
                    self.drafter.withdraw(it.draft)
        running = self.items.running()
        if not needed and not firsts:
            masking = [it.constraint for it in running if it.constraint is not None and it.in_step]
            if masking and self._pending is None:
                wait_for_any(masking, 0.05)  # only masks are awaited: wait for them instead of spinning
            return None
        needed_ids = {id(it) for it in needed}
        if any(k in needed_ids for k in drafts):
            return self._verify(firsts, needed, drafts)
        first_set, needed_set = {id(it) for it in firsts}, {id(it) for it in needed}
        top_n = self._top_n(running)
        fx = self._first_extra if firsts else None
        tokens_in = self.tokens
        if needed:
            live = sorted(it.slot for it in needed)
            positions = self.table.lengths
            self.rows.steps = mx.array(self.gen)
            # a step the next one reads back first (it may draft from its tokens) has no host work beside it
            nxt, extra = self.decoder.step(tokens_in, live, positions, int(positions[live].max()) + 1, self.rows,
                                           top_n=top_n, masks=self._masks(needed), waited=self._may_draft())
            self.tokens = nxt
        else:
            nxt, extra = tokens_in, list(fx)  # placeholders of the right shapes; no row reads them
        # Ids are exact in float32 (< 2**24), so tokens and logprobs travel in one array.
        packed = [tokens_in.astype(mx.float32), nxt.astype(mx.float32)]
        if top_n >= 0:
            packed += [extra[0], fx[0] if fx else mx.zeros((self.slots,))]
        rows = [_Row(it.slot, it, id(it) in first_set, id(it) in needed_set) for it in running]
        issued = _Issued(mx.stack(packed), rows, top_n, [])
        if top_n > 0:
            issued.extra = [*extra[1:], *(fx[1:] if fx else extra[1:])]
        mx.async_eval(issued.packed, self.tokens)
        for it in needed:
            self.table.lengths[it.slot] += 1
            self.gen[it.slot] += 1
            it.issued += 1
        if needed:
            self.counters["steps"] += 1
            self.counters["occupancy"] += len(needed)
        return issued

    def _top_n(self, items) -> int:
        """The top logprobs a step computes for ``items``: -1 (none), 0 (the chosen token's) or a
        fixed count covering every row's ask (each row is cut to its own on the host)."""
        return top_n_computed(max((it.top_logprobs for it in items), default=-1), self.model.config.vocab_size)

    def _process(self, issued: _Issued | _Verified):
        if isinstance(issued, _Verified):
            self._process_verified(issued)
            return
        host = issued.to_host()
        for row in issued.rows:
            item = row.item
            if item.state is not State.DECODING or item.slot != row.slot:
                continue  # finished (or cancelled) while this step was in flight
            try:
                self._accept_row(host, row)
            except BaseException as e:  # what one request carries (its stops, text, consumers) fails it alone
                if not owned_by_request(e):
                    raise
                self.items.finish(item, "error", e if isinstance(e, GrammarError) else EngineError(
                    f"request {item.id} failed while its token was processed: {type(e).__name__} ({e!r})"))

    def _accept_row(self, host: "_OnHost", row: _Row):
        if row.first and self.items.accept(row.item, *host.accepted(row.slot, first=True)):
            return
        if row.decoded:
            self.counters["decode_tokens"] += 1
            self.items.accept(row.item, *host.accepted(row.slot, first=False))

    def fail_all(self, error: BaseException):
        """The device step itself failed: end every item in flight with the cause."""
        self.fail(self.items.in_flight(), EngineError(f"the engine failed: {error!r}"))
        self._pending = None

    def fail(self, items, error: BaseException):
        """End ``items`` (made here: in flight, or never added) with ``error``, through the item
        processor like every other end."""
        for item in items:
            self.items.finish(item, "error", error)

    # -- reporting --------------------------------------------------------------

    def memory(self) -> dict:
        """Bytes: ``kv_cache_bytes`` is the K/V pool's budget (the parameter, in whole blocks) and
        ``kv_allocated_bytes`` what its arrays hold now; ``prefix_cache_bytes`` is the cached blocks
        no request holds (inside the pool) and ``prefix_cache_budget_bytes`` their cap."""
        weights = sum(v.nbytes for _, v in tree_flatten(self.model.net.parameters()))
        table = self.table
        cache = table.cache_stats()
        return {
            "slots": self.slots, "max_len": self.max_len,
            "kv_cache_bytes": table.budget_bytes, "kv_allocated_bytes": table.allocated_bytes,
            **table.stats(),
            "prefix_cache_bytes": cache["bytes"] if cache else 0,
            "prefix_cache_budget_bytes": table.cache_budget_bytes if cache else 0,
            "weights_bytes": weights, "peak_bytes": mx.get_peak_memory(),
        }

    def stats(self) -> dict:
        c = self.counters
        return {
            **c,
            "finished": self.items.finished,
            "waiting": len(self.items.waiting),
            "active_slots": sum(it is not None for it in self.items.by_slot),
            **self.table.stats(),
            "mean_occupancy": c["occupancy"] / c["steps"] if c["steps"] else 0.0,
            "decode_tokens_per_s": c["decode_tokens"] / c["step_s"] if c["step_s"] else 0.0,
            "prefill_tokens_per_s": c["prefill_tokens"] / c["prefill_s"] if c["prefill_s"] else 0.0,
            "peak_memory_bytes": mx.get_peak_memory(),
            "uptime_s": time.perf_counter() - self._t0,
            "prefix_cache": self.table.cache_stats(),
            "speculative": self.speculative,
            "spec_acceptance": c["spec_accepted"] / c["spec_drafted"] if c["spec_drafted"] else 0.0,
            "spec_tokens_per_pass": (c["spec_accepted"] + c["spec_passes"]) / c["spec_passes"]
            if c["spec_passes"] else 0.0,
        }

