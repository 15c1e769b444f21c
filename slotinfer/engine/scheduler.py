"""The scheduler: who gets a slot and K/V blocks, and who gives them back.

One owner for the three memory decisions of a step, as nano-vllm's ``Scheduler`` and vLLM's
``schedule()`` keep them:

- **admission** (:meth:`Scheduler.admit`): waiting items go FIFO into free slots while the pool's
  free blocks (cached ones included) hold what they prefill; each starts from the longest cached
  prefix of it, shared by reference.  The first that does not fit waits, and those behind it with
  it: a long request is never overtaken for ever by short ones;
- **growth** (:meth:`Scheduler.grow_or_preempt`): each row a decode step computes gets the block its
  token is written to;
- **preemption**: when the free blocks fall short, the newest request in a slot goes back to the
  front of the queue, to be recomputed (from its cached blocks, while nothing has evicted them).

The :class:`~slotinfer.engine.item_processor.ItemProcessor` keeps each request's record, its state moves
and its slot; the :class:`~slotinfer.kv.slot_table.SlotTable` keeps the blocks.  The scheduler decides.
"""

from __future__ import annotations

from .item_processor import Item, ItemProcessor
from ..kv.slot_table import SlotTable


class Scheduler:
    def __init__(self, items: ItemProcessor, table: SlotTable, counters: dict):
        self.items, self.table, self.counters = items, table, counters

    def fits(self, item: Item) -> bool:
        """Whether the free blocks hold what ``item`` prefills now, its cached prefix shared."""
        return self.table.can_admit(item.admission_tokens, item.feed, item.salt)

    def room(self) -> int:
        """Items the engine could admit now (free slots not already promised to waiting items); negative:
        the backlog.  While the first waiting item waits for K/V blocks, every waiting item is backlog."""
        items = self.items
        if items.waiting and items.free and not self.fits(items.waiting[0]):
            return -len(items.waiting)
        return len(items.free) - len(items.waiting)

    def admit(self) -> list[Item]:
        """Move waiting items (FIFO) into free slots while they fit (:attr:`Item.admission_tokens`;
        later blocks are taken as decoding reaches them); returns the newly admitted, each holding its
        cached prefix (``prefilled``) and the blocks of the rest."""
        items, admitted = self.items, []
        while items.free and items.waiting:
            item = items.waiting[0]
            if item.handle.cancel_requested:
                items.waiting.popleft()
                items.finish(item, "cancelled")
                continue
            if not self.fits(item):
                break
            slot = items.place(items.waiting.popleft())
            item.prefilled = self.table.admit(slot, item.admission_tokens, item.feed, item.salt)
            if item.feed is item.prompt:  # its first admission: what the usage reports
                item.cached = item.prefilled
            admitted.append(item)
        return admitted

    def decoding(self) -> list[Item]:
        """The running items a decode step computes a token for: short of ``max_tokens``, and (a
        constrained one) with every token issued for it on the host."""
        return [it for it in self.items.running() if it.issued < it.max_tokens and it.in_step
                and (it.constraint is None or it.constraint.ready())]  # a mask still computing: sits out

    def grow_or_preempt(self, firsts: list[Item], step_in_flight: bool, extra: dict | None = None) -> list[Item] | None:
        """Give each row of :meth:`decoding` the block its token is written to; returns those items.

        When the free blocks fall short and a step is in flight, returns None: read it back first
        (the items it finishes give their blocks back) and ask again.  Otherwise the newest request
        in a slot is preempted, and again, until the rest fit; the oldest always fits alone
        (``Engine.make_item`` refuses what does not), so it always progresses.  A preempted item
        leaves ``firsts`` (its first token, not yet read, is computed again on its return).

        ``extra``: draft tokens each item (by id) verifies this step, whose positions need blocks
        too.  They are the first thing given up: when the blocks fall short, ``extra`` is emptied
        before anything else.
        """
        table = self.table
        while True:
            needed = self.decoding()
            slots = [it.slot for it in needed]
            tokens = [int(table.lengths[it.slot]) + 1 + len(extra.get(id(it), ())) if extra else
                      int(table.lengths[it.slot]) + 1 for it in needed]
            if not table.blocks_missing(slots, tokens):
                table.grow(slots, tokens)
                return needed
            if extra:
                extra.clear()
                continue
            if step_in_flight:
                return None
            victim = max((it for it in self.items.by_slot if it is not None), key=lambda it: it.id)
            if victim in firsts:
                firsts.remove(victim)
            self.items.preempt(victim)
            self.counters["preempted"] += 1
