"""The Engine: schedule -> run -> postprocess, one step at a time.

Both the threaded :class:`~slotinfer.Inferencer` and ``Model.batch_generate`` drive
it.  A step admits waiting items into free slots, prefills one budgeted chunk of
new prompts (Encoder), issues one fused decode step for every running slot
(Decoder), and only then reads back the *previous* step's tokens: the host's
bookkeeping of step t overlaps the device's work on step t+1, and each step costs
exactly one device-to-host copy.  The exception is a step with constrained rows
(:mod:`slotinfer.engine.structured`): their masks need the previous step's tokens, so it reads
that step back first.

Why one module: the step's phases (admit, prefill, decode, process) share the slot table's
state, and the pipelined step reads in order only when they sit together.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import device, request
from .decoder import Decoder, RowParams, spread
from .encoder import Encoder
from ..errors import EngineError, GrammarError, PromptTooLongError
from ..handle import Handle
from ..kv import BLOCK_SIZE, PrefixCache
from .item_processor import Item, ItemProcessor, State, owned_by_request
from .sampling import SamplingParams, top_n_computed
from ..kv.slot_table import SlotTable
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


class Engine:
    def __init__(self, model, *, slots: int, max_len: int, prefill_tokens: int = 512,
                 prefix_cache_bytes: int | None = None, prefix_block_size: int = BLOCK_SIZE, kv_dtype=None,
                 kv_cache_bytes: int | None = None):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
        if not isinstance(prefix_block_size, int) or prefix_block_size < 1:
            raise ValueError(f"prefix_block_size must be an int >= 1, got {prefix_block_size!r}")
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
                               dtype=device.kv_dtype(model.dtype, override=kv_dtype))
        self.encoder = Encoder(model.net, self.table, max(1, prefill_tokens))
        self.decoder = Decoder(model.net, self.table)
        self.items = ItemProcessor(self.table)
        self.prefix_cache = _prefix_cache(model, self.table.keys[0].dtype, prefix_cache_bytes, prefix_block_size)
        if self.prefix_cache is not None:
            self.items.on_release = self._cache_what_it_holds
        self.rows = RowParams(slots, model.config.vocab_size)
        self.tokens = mx.zeros((slots,), dtype=mx.int32)  # each slot's latest token, on the device
        self.gen = np.zeros(slots, dtype=np.uint32)  # sampling step of each slot's next token
        self._pending: _Issued | None = None
        mx.eval(self.tokens, self.rows.temperature, self.rows.top_k, self.rows.top_p, self.rows.min_p,
                self.rows.penalty, self.rows.seeds, self.rows.steps)
        self.counters = dict(steps=0, decode_tokens=0, prefill_tokens=0, prefill_s=0.0, step_s=0.0,
                             occupancy=0, submitted=0, preempted=0)
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
        if len(ids) + budget > self.max_len:
            e = PromptTooLongError(
                f"the prompt has {len(ids)} tokens and max_tokens is {p['max_tokens']}: "
                f"{len(ids) + p['max_tokens']} > the engine's max_len {self.max_len}; shorten the prompt, lower "
                f"max_tokens (to at most {max(self.max_len - len(ids), 0)}) or raise max_len")
            e.param = "max_tokens"
            raise e
        room = self.table.capacity_tokens
        if len(ids) + budget - 1 > room:
            e = PromptTooLongError(
                f"the prompt has {len(ids)} tokens and max_tokens is {p['max_tokens']}: their K/V need "
                f"{len(ids) + budget - 1} tokens and the engine's whole K/V pool holds {room} "
                f"(kv_cache_bytes={self.table.num_blocks * self.table.block_nbytes}); shorten the prompt, lower "
                f"max_tokens (to at most {max(room + 1 - len(ids), 0)}) or raise kv_cache_bytes")
            e.param = "max_tokens"
            raise e
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

    def add(self, item: Item):
        self.items.add(item)

    def waiting_for_slots(self) -> int:
        """Items added that no free slot (or not enough free K/V blocks) awaits: the engine's backlog."""
        return max(0, -self.items.room())

    def in_flight(self) -> list[Item]:
        """What the engine holds that has not ended: waiting, then in slots."""
        return self.items.in_flight()

    def room(self) -> int:
        """Requests the engine could admit now without queueing them."""
        return self.items.room()

    @property
    def busy(self) -> bool:
        return self.items.busy or self._pending is not None

    # -- the loop ---------------------------------------------------------------

    def step(self):
        """One iteration: admit, prefill a chunk, issue a decode step, process the previous one."""
        t0 = time.perf_counter()
        self.items.reap_cancelled()
        admitted = self.items.admit()
        if admitted:
            self._occupancy_changed(admitted)
            self._reuse(admitted)
        firsts = self._prefill()
        if self._pending is not None and self._needs_previous(firsts):
            previous, self._pending = self._pending, None  # constrained rows need its tokens for their masks
            self._process(previous)
        issued = self._decode(firsts)
        previous, self._pending = self._pending, issued
        if previous is not None:
            self._process(previous)
        self.counters["step_s"] += time.perf_counter() - t0

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

    # -- the prefix cache ---------------------------------------------------------

    def _reuse(self, admitted):
        """Newly admitted items start from the longest cached prefix of what they prefill (their
        prompt, and a resumed item's tokens): its K/V is copied into their slot, and the Encoder
        prefills only the rest (at least the last token, whose logits give the next one)."""
        cache = self.prefix_cache
        if cache is None:
            return
        for it in admitted:
            blocks = cache.match(it.feed, it.salt, limit=len(it.feed) - 1)
            if blocks:
                self.table.write(it.slot, mx.concatenate([b.keys for b in blocks], axis=2),
                                 mx.concatenate([b.values for b in blocks], axis=2))
                it.prefilled = len(blocks) * cache.block_size
                if it.feed is it.prompt:  # its first admission: what the usage reports
                    it.cached = it.prefilled
                self.table.lengths[it.slot] = it.prefilled

    def _cache(self, item: Item, tokens):
        """Copy the full blocks of ``tokens`` (what ``item``'s slot holds from position 0) that the
        cache lacks."""
        slot = item.slot
        new = self.prefix_cache.insert(tokens, item.salt, lambda a, b: self.table.read(slot, a, b))
        if new:  # copied now, before the slot is written again
            mx.async_eval([a for b in new for a in (b.keys, b.values)])

    def _cache_what_it_holds(self, item: Item):
        """An item leaves its slot: its prompt and what it generated enter the cache, as far as
        the slot holds their K/V (a generated token's is written by the step that reads it)."""
        held = min(int(self.table.lengths[item.slot]), len(item.prompt) + len(item.tokens))
        if held >= self.prefix_cache.block_size:
            self._cache(item, (item.prompt + item.tokens)[:held])

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
            if self.prefix_cache is not None:  # chunk by chunk: a request admitted meanwhile hits what is in
                self._cache(it, it.feed[: it.prefilled])
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

    def _decode(self, firsts) -> _Issued | None:
        """Issue one decode step for the running items that still need tokens.

        An item whose in-flight steps already cover its ``max_tokens`` gets no more
        (its row idles), and when no item needs one, no step runs: the Encoder's
        first tokens then travel to the host on their own.
        """
        if not self.items.running():
            return None
        needed = self._make_room(firsts)
        running = self.items.running()
        if not needed and not firsts:
            masking = [it.constraint for it in running if it.constraint is not None and it.in_step]
            if masking and self._pending is None:
                wait_for_any(masking, 0.05)  # only masks are awaited: wait for them instead of spinning
            return None
        first_set, needed_set = {id(it) for it in firsts}, {id(it) for it in needed}
        top_n = self._top_n(running)
        fx = self._first_extra if firsts else None
        tokens_in = self.tokens
        if needed:
            live = sorted(it.slot for it in needed)
            positions = self.table.lengths
            self.rows.steps = mx.array(self.gen)
            nxt, extra = self.decoder.step(tokens_in, live, positions, int(positions[live].max()) + 1, self.rows,
                                           top_n=top_n, masks=self._masks(needed))
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

    def _make_room(self, firsts: list[Item]) -> list[Item]:
        """Give each row the decode step computes the block its token is written to; returns those
        items (running, short of ``max_tokens``, with every token issued for them on the host).

        When the free blocks fall short, the step in flight is read back first (the items it
        finishes give theirs back); then the newest request in a slot is preempted (back to the
        front of the FIFO, recomputed when blocks are free again), and again, until the rest fit.
        The oldest always fits alone (``make_item`` refuses what does not), so it always progresses.
        """
        table = self.table
        while True:
            needed = [it for it in self.items.running() if it.issued < it.max_tokens and it.in_step
                      and (it.constraint is None or it.constraint.ready())]  # a mask still computing: sits out
            slots = [it.slot for it in needed]
            tokens = [int(table.lengths[s]) + 1 for s in slots]
            if not table.short(slots, tokens):
                table.hold(slots, tokens)
                return needed
            if self._pending is not None:
                previous, self._pending = self._pending, None
                self._process(previous)
                continue
            victim = max((it for it in self.items.by_slot if it is not None), key=lambda it: it.id)
            if victim in firsts:
                firsts.remove(victim)  # its first token, not yet read, is computed again on its return
            self.items.preempt(victim)
            self.counters["preempted"] += 1

    def _top_n(self, items) -> int:
        """The top logprobs a step computes for ``items``: -1 (none), 0 (the chosen token's) or a
        fixed count covering every row's ask (each row is cut to its own on the host)."""
        return top_n_computed(max((it.top_logprobs for it in items), default=-1), self.model.config.vocab_size)

    def _process(self, issued: _Issued):
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
        weights = sum(v.nbytes for _, v in _leaves(self.model.net.parameters()))
        cache = self.prefix_cache
        return {
            "slots": self.slots, "max_len": self.max_len,
            "kv_cache_bytes": self.table.nbytes, "kv_bytes_per_slot": self.table.nbytes // self.slots,
            **self.table.stats(),
            "prefix_cache_bytes": cache.nbytes if cache else 0,
            "prefix_cache_budget_bytes": cache.budget_bytes if cache else 0,
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
            "prefix_cache": self.prefix_cache.stats() if self.prefix_cache else None,
        }


def _prefix_cache(model, dtype, budget: int | None, block_size: int) -> PrefixCache | None:
    """The engine's prefix cache: ``budget`` bytes (None: the device's default; 0: none) in blocks of
    ``block_size`` tokens."""
    if budget is None:
        budget = device.prefix_cache_bytes()
    if budget == 0:
        return None
    cfg = model.config
    return PrefixCache(num_layers=cfg.num_layers, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       dtype=dtype, budget_bytes=budget, block_size=block_size)


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix, tree
