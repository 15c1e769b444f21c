"""Speculation in the engine's step: which rows draft, the verify step over rows as positions, and
reading it back.

:class:`~slotinfer.engine.engine.Engine` takes these steps from :class:`SpeculativeSteps` (they
use its items, slot table, rows and counters); the drafts come from :mod:`slotinfer.spec`, and
:mod:`slotinfer.engine.verify` runs the step on the device and fixes each slot's state after it.
With ``speculative=None`` none of them runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .item_processor import Item, State, owned_by_request
from .structured import words
from .verify import Verifier, accepted, fix_rows, group_masks
from ..errors import EngineError
from ..spec import CostModel, Drafter

SPECULATIVE = (None, "ngram")  # what ``speculative`` takes: off, or drafts from n-grams (and forced tokens)
# The gate's constants on the 2-core CPU (docs/speculative.md).  VERIFY_MS: ms a verify step of 1..16
# positions, one slot of SmolLM2-135M Q4_1 at 256 tokens (benchmarks/bench_spec.py --calibrate, quiet;
# benchmarks/spec_replay.py times its replay by it; eight runs with the current product loops gave
# medians within 5% of 1..8 and 9..16 as here).  A ninth position costs 1.5x the eighth (past 8 the step
# pads its rows to a bucket: 12), so nobody drafts past 8; up to there the gate prices a step by the
# table, not a line through it.  POSITION_COST: the line past the table.
VERIFY_MS = (8.71, 10.04, 10.76, 13.22, 15.19, 18.66, 20.45, 23.09, 36.10, 36.44, 35.78, 34.11, 43.03, 41.59,
             41.80, 43.24)
BANDWIDTH_ROWS = 8
STEP_COSTS = tuple(round(t / VERIFY_MS[0], 3) for t in VERIFY_MS[:BANDWIDTH_ROWS])  # in one-row steps
POSITION_COST = 0.15
# A step whose previous one is read back first loses the overlap of the host's work (reading tokens,
# drafting, building the step) with the device's: 0.05 of a one-row step on that CPU (the same
# calibration).  A row makes steps wait only while drafts come often enough to pay for it.
SYNC_COST = 0.05


@dataclass
class _Group:
    """One running item's part in a speculative step: its rows ``start .. start + len(drafts)``."""

    slot: int
    item: Item
    first: bool
    decoded: bool
    start: int
    drafts: list


@dataclass
class _Verified:
    """A decode step over rows as positions (:mod:`slotinfer.verify`) in flight.

    ``slots`` stacks each slot's input token (and with logprobs the Encoder's first token's
    logprob), ``rows`` each row's sampled token (and its logprob); ``extra`` holds the top-n ids
    and values of the rows, then of the first tokens.  ``sampled``, ``seen`` and ``counts`` stay on
    the device for :func:`~slotinfer.verify.fix_rows`.
    """

    slots: mx.array
    rows: mx.array
    groups: list[_Group]
    top_n: int
    extra: list
    sampled: mx.array
    seen: object
    counts: object




class SpeculativeSteps:
    """The speculative parts of the engine's step (a mixin of :class:`~slotinfer.engine.engine.Engine`)."""

    def _speculate(self, speculative, *, draft_tokens: int, position_cost: float, bandwidth_rows: int,
                   sync_cost: float, step_costs: tuple):
        """Set up the drafter and the verify step (none when ``speculative`` is None)."""
        self.speculative = speculative
        self.drafter = Drafter(cost=CostModel(position_cost=position_cost, max_k=draft_tokens,
                                              bandwidth_rows=bandwidth_rows, sync_cost=sync_cost,
                                              step_costs=step_costs)) if speculative else None
        self.verifier = Verifier(self.model.net, self.table, self.slots * (draft_tokens + 1)) if speculative else None

    def _may_draft(self) -> bool:
        """Whether some running row could verify a draft this step (its gate is open for a source, its
        drafts come often enough to pay for the wait, and the step is not compute-bound): only then
        is the step in flight read back first."""
        d = self.drafter
        if d is None:
            return False
        running = self.items.running()
        return not d.cost.compute_bound(len(running)) and any(
            it.draft is not None and d.may_draft(it.draft) for it in running)

    def _sync_draft(self, item: Item):
        """``item``'s drafting row holds its prompt and every token the host has of it."""
        row = item.draft
        if row is None:
            row = item.draft = self.drafter.row(item.prompt, salt=item.salt,
                                                matcher=item.constraint.matcher if item.constraint else None)
        have = len(row.tokens) - len(item.prompt)
        if len(item.tokens) > have:
            self.drafter.append(row, item.tokens[have:])

    def _leave_draft(self, item: Item, ended: bool):
        """``item`` ended, or was preempted: its drafting row takes the tokens it had left to take
        (the suffix pool learns them), ends, and is dropped.  A preempted item's row is rebuilt from
        its prompt and tokens when it decodes again; its gate then learns afresh from shadow drafts."""
        row, item.draft = item.draft, None
        if row is None:
            return
        have = len(row.tokens) - len(item.prompt)
        if not ended:
            self.drafter.withdraw(row)  # a draft given this step is not verified: it left its slot first
        if len(item.tokens) > have:
            self.drafter.append(row, item.tokens[have:])
        self.drafter.finish(row)

    def _drafts(self, firsts) -> dict:
        """This step's drafts, ``{id(item): [tokens]}``: only rows whose tokens are all on the host,
        at most their tokens left less one and their table's room.  Rows with a token in flight are
        asked too, so shut gates still learn from their shadow drafts, but never verify one."""
        d = self.drafter
        if d is None:
            return {}
        fresh = {id(it) for it in firsts}
        cands = [it for it in self.scheduler.decoding() if id(it) not in fresh]
        for it in cands:
            self._sync_draft(it)
        if not cands or d.cost.compute_bound(len(cands) + len(firsts)):
            return {}
        limits = [min(it.max_tokens - it.issued - 1, self.max_len - int(self.table.lengths[it.slot]) - 1)
                  for it in cands]
        out = {}
        for it, draft in zip(cands, d.step([it.draft for it in cands], len(cands) + len(firsts), limits)):
            if not draft:
                continue
            if len(it.tokens) != it.issued:
                d.withdraw(it.draft)
            else:
                out[id(it)] = draft
        return out

    def _verify(self, firsts, needed, drafts) -> _Verified:
        """Issue one step over rows as positions (:mod:`slotinfer.verify`)."""
        needed = sorted(needed, key=lambda it: it.slot)
        running = self.items.running()
        top_n = self._top_n(running)
        fx = self._first_extra if firsts else None
        groups = [(it.slot, drafts.get(id(it), [])) for it in needed]
        masks = group_masks(groups, [it.constraint for it in needed], words(self.model.config.vocab_size))
        sampled, seen, counts, extra = self.verifier.step(self.tokens, groups, self.gen, self.rows, top_n=top_n,
                                                          masks=masks)
        slots = [self.tokens.astype(mx.float32)]
        rows = [sampled.astype(mx.float32)]
        if top_n >= 0:
            slots.append(fx[0] if fx else mx.zeros((self.slots,)))
            rows.append(extra[0])
        first_set = {id(it) for it in firsts}
        start, at = 0, {}
        for it, (_, d) in zip(needed, groups):
            at[id(it)] = start
            start += 1 + len(d)
        out_groups = [_Group(it.slot, it, id(it) in first_set, id(it) in at, at.get(id(it), -1),
                             drafts.get(id(it), [])) for it in running]
        v = _Verified(mx.stack(slots), mx.stack(rows), out_groups, top_n, [], sampled, seen, counts)
        if top_n > 0:
            v.extra = [*extra[1:], *(fx[1:] if fx else [mx.zeros((self.slots, extra[1].shape[1]), dtype=extra[1].dtype),
                                                         mx.zeros((self.slots, extra[2].shape[1]))])]
        mx.async_eval(v.slots, v.rows, *v.extra, *(a for a in (seen, counts) if a is not None))
        c = self.counters
        for it in needed:
            self.table.lengths[it.slot] += 1
            self.gen[it.slot] += 1
            it.issued += 1
            if drafts.get(id(it)):
                c["spec_passes"] += 1
                c["spec_drafted"] += len(drafts[id(it)])
        c["steps"] += 1
        c["occupancy"] += len(needed)
        return v

    def _process_verified(self, v: _Verified):
        slot_host, row_host = np.array(v.slots), np.array(v.rows)
        tops = [np.array(a) for a in v.extra] if v.top_n > 0 else None
        lp = v.top_n >= 0
        fix_slots, fix_rows_ = [], []
        for g in v.groups:
            item = g.item
            if item.state is not State.DECODING or item.slot != g.slot:
                continue
            try:
                if g.first and self.items.accept(
                        item, int(slot_host[0][g.slot]), float(slot_host[1][g.slot]) if lp else None,
                        list(zip(tops[2][g.slot].tolist(), tops[3][g.slot].tolist())) if tops else None):
                    continue
                if not g.decoded:
                    continue
                k = len(g.drafts)
                sampled = row_host[0][g.start:g.start + k + 1].astype(np.int64)
                a = accepted(sampled, g.drafts)
                self.table.lengths[g.slot] += a  # rejection is a length update
                self.gen[g.slot] += a
                item.issued += a
                self.counters["spec_accepted"] += a
                done = False
                for j in range(a + 1):
                    r = g.start + j
                    self.counters["decode_tokens"] += 1
                    if self.items.accept(item, int(sampled[j]), float(row_host[1][r]) if lp else None,
                                         list(zip(tops[0][r].tolist(), tops[1][r].tolist())) if tops else None):
                        done = True
                        break
                if not done:
                    fix_slots.append(g.slot)
                    fix_rows_.append(g.start + a)
                    if k:
                        self.table.trim(g.slot)  # blocks taken for rejected positions go back
            except BaseException as e:
                if not owned_by_request(e):
                    raise
                self.items.finish(item, "error", EngineError(
                    f"request {item.id} failed while its token was processed: {type(e).__name__} ({e!r})"))
        self.tokens = fix_rows(self.tokens, self.rows, fix_slots, fix_rows_, v.sampled, v.seen, v.counts)
