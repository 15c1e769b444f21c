"""The Decoder: one compiled step for the slot table's live rows.

A step computes the slots that need a token and no others: the live slots, padded to
a row bucket (:func:`row_bucket`) with idle slots whose writes go to the pool's TRASH
block.  It embeds each row's latest token, writes its K/V at the slot's length in its
blocks, attends over the blocks of the live rows only (``paged_attend`` through their block
tables, cut to the widest row's block count), LM head, samples ``[n, vocab] -> [n]`` with each
row's own parameters, and puts the tokens back in the ``[b]`` array of every slot's
latest token, which stays on the device as the next step's input; the host copies it
once per step, one step behind (see ``engine.py``).  So one request on a 32-slot table
costs what it costs on a 1-slot table, and the compiled variants stay bounded by the
configuration: row buckets x block counts (up to ``max_len``'s) x sampling modes.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from .. import settings
from .._compile import ThreadCompiled
from .sampling import adjust, logprobs_of, penalize, sample
from ..kv import ZERO, PagedDecodeView, write_index
from ..kv.slot_table import SlotTable
from .structured import apply_mask

def row_buckets(slots: int) -> list[int]:
    """The row counts a step may compute: 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and
    1.5x them), capped by ``slots``; a step pads its live rows up to the next one, so it
    computes at most 1.5x the rows it needs."""
    out, p = set(), 1
    while p < slots:
        out.update(b for b in (p, p + p // 2) if 0 < b < slots)
        p *= 2
    return sorted(out | {slots})


@functools.lru_cache(maxsize=64)
def _buckets(slots: int) -> tuple[int, ...]:  # asked every decode step: computed once per table size
    return tuple(row_buckets(slots))


def row_bucket(n: int, slots: int) -> int:
    """The smallest row count of :func:`row_buckets` that holds ``n`` live rows."""
    return next(b for b in _buckets(slots) if b >= n)


def step_rows(live, slots: int):
    """Slots a step computes for the ``live`` ones (sorted), and whether they are ``0..n-1``.

    Live slots are padded with the lowest idle slots to a row bucket.  The item processor gives
    out the lowest free slot first, so the rows usually are a prefix of the table, which the
    step reads as a slice; otherwise it gathers them.
    """
    n = row_bucket(len(live), slots)
    taken = set(live)
    pad = [s for s in range(slots) if s not in taken][: n - len(live)]
    rows = sorted([*live, *pad])
    return rows, rows[-1] == n - 1
COMPILE = settings.compile_steps()  # SLOTINFER_COMPILE=0: eager steps, for debugging


class Decoder:
    """The slot table's decode step, compiled once per (row bucket, row layout, block count, sampling mode)."""

    def __init__(self, net, table: SlotTable):
        self.net, self.table = net, table
        self._compiled = {}

    @property
    def variants(self) -> int:
        """How many step variants exist: bounded by the configuration (row buckets x 2 row layouts x
        block counts x sampling modes x the few logprob counts of
        :func:`~slotinfer.engine.sampling.top_n_computed`), never by what requests ask for."""
        return len(self._compiled)

    def step(self, tokens, live, positions, span: int, rows: "RowParams", *, top_n: int = -1, masks=None):
        """Run one step for the ``live`` slots (sorted); returns ``(tokens [b], logprob outputs [b, ...])``,
        all lazy.

        ``tokens`` [b] is every slot's latest token; the result is the same array with the live
        slots' next tokens in.  ``positions`` [b] (host) is where each slot's input token goes
        (read for the live slots only); ``span`` the positions the widest live row attends to.
        Logprob outputs are [b, ...] too; other slots' entries are meaningless.  ``masks`` (host,
        [b, words] int32, or None) is each slot's bitmask of the tokens it may take
        (:mod:`slotinfer.engine.structured`); a free row's is all ones.

        Attention reads each row's blocks through its block table
        (:class:`~slotinfer.kv.PagedDecodeView`), cut to the blocks the widest row holds: a step
        costs what the live rows and lengths need, not the pool's size.  Idle rows padding the
        step read ZERO blocks only and write to TRASH.
        """
        t = self.table
        bs = t.block_size
        nblk = min(-(-span // bs), t.max_blocks)  # ZERO blocks past a row's own add exact zeros
        picked, prefix = step_rows(live, t.slots)
        picked_np = np.asarray(picked)
        is_live = np.isin(picked_np, live)
        pos = np.where(is_live, positions[picked_np], -1).astype(np.int32)  # padding writes to TRASH
        tables = np.where(is_live[:, None], t.pool.tables[picked_np, :nblk], ZERO).astype(np.int32)
        blocks, offsets = t.locate(picked_np, pos)
        view_pos = np.where(is_live, pos, nblk * bs - 1).astype(np.int32)  # a padding row sees ZERO blocks only
        key = (len(picked), prefix, nblk, rows.all_greedy, rows.use_sort, rows.seen is not None,
               rows.counts is not None, masks is not None, top_n)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = ThreadCompiled(self._make(*key), enabled=COMPILE)
        none = mx.zeros((1,), dtype=mx.bool_)  # what a step that does not read an input gets for it
        seen = rows.seen if rows.seen is not None else none
        mask = mx.array(masks[picked]) if masks is not None else none
        adjusting = [rows.counts, rows.bias, rows.presence, rows.frequency] if rows.counts is not None else [none] * 4
        out = fn(tokens, mx.array(picked, dtype=mx.int32), t.keys, t.values, mx.array(view_pos), mx.array(is_live),
                 mx.array(blocks), mx.array(offsets), mx.array(tables), rows.temperature, rows.top_k, rows.top_p,
                 rows.min_p, rows.seeds, rows.steps, rows.penalty, seen, mask, *adjusting)
        nxt, t.keys, t.values, seen, counts, extra = out[0], out[1], out[2], out[3], out[4], out[5:]
        if rows.seen is not None:
            rows.seen = seen
        if rows.counts is not None:
            rows.counts = counts
        return nxt, extra

    def _make(self, n, prefix, nblk, greedy, use_sort, use_penalty, use_adjust, masked, top_n):
        net, table = self.net, self.table
        slots = table.slots
        geometry = dict(kv_heads=table.kv_heads, block_size=table.block_size, head_dim=table.head_dim,
                        num_blocks=table.num_blocks)

        def step(tokens, picked, keys, values, positions, is_live, blocks, offsets, tables, temperature, top_k, top_p,
                 min_p, seeds, steps, penalty, seen, mask, counts, bias, presence, frequency):
            def mine(a):  # the step's rows of a [b, ...] per-slot array
                return a[:n] if prefix else a[picked]

            tok = mine(tokens)
            index = write_index(blocks[:, None], offsets[:, None], **geometry)
            view = PagedDecodeView(keys, values, index, positions, tables, positions)
            logits = net.head(net(tok[:, None], view)[:, 0])
            raw = logits
            if use_penalty:
                r = mx.arange(n)
                mine_seen = mine(seen)
                mine_seen[r, tok] = mine_seen[r, tok] | is_live  # padding rows keep theirs
                logits = penalize(logits, mine_seen, mine(penalty))
                seen = mx.put_along_axis(seen, mx.broadcast_to(picked[:, None], mine_seen.shape), mine_seen, axis=0)
            if use_adjust:  # the input token is the row's latest generated one: count it, then penalize
                r = mx.arange(n)
                mine_counts = mine(counts)
                mine_counts[r, tok] = mine_counts[r, tok] + is_live
                logits = adjust(logits, mine(bias), mine_counts, mine(presence), mine(frequency))
                counts = mx.put_along_axis(counts, mx.broadcast_to(picked[:, None], mine_counts.shape), mine_counts,
                                           axis=0)
            if masked:
                logits = apply_mask(logits, mask)
            if greedy:
                nxt = mx.argmax(logits, axis=-1).astype(mx.int32)
            else:
                nxt = sample(logits, mine(temperature), mine(top_k), mine(top_p), mine(min_p), mine(seeds),
                             mine(steps), use_sort=use_sort)
            # Padding rows put back what their slot held (a padding slot may appear more than once).
            out = mx.put_along_axis(tokens, picked, mx.where(is_live, nxt, tok), axis=0)
            extra = []
            if top_n >= 0:  # -1: no logprobs; 0: the chosen token's; n: also the top n
                chosen, ids, vals = logprobs_of(raw, nxt, top_n)
                extra = [spread(a, picked, slots) for a in [chosen] + ([ids, vals] if top_n > 0 else [])]
            return [out, view.keys, view.values, seen, counts, *extra]

        return step


def spread(a, picked, slots: int):
    """``a`` [n, ...], rows of a step or of the Encoder, placed at their slots ``picked`` [n] in a
    [slots, ...] array (other slots: 0)."""
    out = mx.zeros((slots, *a.shape[1:]), dtype=a.dtype)
    out[picked] = a
    return out


class RowParams:
    """Per-slot sampling parameters as [b] device arrays, rebuilt when slot occupancy changes.

    The [b, vocab] arrays exist only while some request needs them: ``seen`` (repetition
    penalty), and ``counts`` with ``bias`` (presence and frequency penalties, logit_bias).
    """

    def __init__(self, slots: int, vocab: int):
        self.slots, self.vocab = slots, vocab
        self.seen = None  # [b, vocab] bool, allocated once some request asks for a repetition penalty
        self.counts = self.bias = None  # [b, vocab] float32, while some request adjusts logits
        self.set([None] * slots)

    def set(self, items):
        """``items[i]`` is the item in slot i (its ``params``, ``seed`` and logit adjustments), or None."""
        def col(f, dt, default):
            return mx.array([f(it) if it else default for it in items], dtype=dt)

        self.temperature = col(lambda it: it.params.temperature, mx.float32, 0.0)
        self.top_k = col(lambda it: it.params.top_k, mx.int32, 0)
        self.top_p = col(lambda it: it.params.top_p, mx.float32, 1.0)
        self.min_p = col(lambda it: it.params.min_p, mx.float32, 0.0)
        self.penalty = col(lambda it: it.params.repetition_penalty, mx.float32, 1.0)
        self.seeds = col(lambda it: it.seed, mx.uint32, 0)
        live = [it for it in items if it]
        self.all_greedy = all(it.params.temperature == 0 for it in live)
        self.use_sort = any(it.params.top_k > 0 or it.params.top_p < 1 for it in live if it.params.temperature > 0)
        if self.seen is None and any(it.params.repetition_penalty != 1.0 for it in live):
            self.seen = mx.zeros((self.slots, self.vocab), dtype=mx.bool_)
        self.steps = mx.zeros((self.slots,), dtype=mx.uint32)
        self._adjustments(items, live)

    def _adjustments(self, items, live):
        if not any(it.adjusts for it in live):
            self.counts = self.bias = None  # free again: the step no longer reads them
            self.presence = self.frequency = None
            return
        if self.counts is None:
            self.counts = mx.zeros((self.slots, self.vocab), dtype=mx.float32)
        self.presence = mx.array([it.presence if it else 0.0 for it in items], dtype=mx.float32)
        self.frequency = mx.array([it.frequency if it else 0.0 for it in items], dtype=mx.float32)
        bias = np.zeros((self.slots, self.vocab), dtype=np.float32)
        for s, it in enumerate(items):
            if it and it.logit_bias:
                bias[s, list(it.logit_bias)] = list(it.logit_bias.values())
        self.bias = mx.array(bias)

    def take(self, rows: list[int]):
        """The parameters of ``rows`` only (for the Encoder's first token)."""
        idx = mx.array(rows)
        sub = RowParams.__new__(RowParams)
        for name in ("temperature", "top_k", "top_p", "min_p", "penalty", "seeds"):
            setattr(sub, name, getattr(self, name)[idx])
        sub.seen = None if self.seen is None else self.seen[idx]
        for name in ("counts", "bias", "presence", "frequency"):
            a = getattr(self, name)
            setattr(sub, name, None if a is None else a[idx])
        sub.use_sort, sub.all_greedy = self.use_sort, self.all_greedy
        return sub

    def reset_seen(self, rows: list[int], prompts: list[list[int]], generated: list[list[int]] | None = None):
        """Start the histories of newly admitted rows: what they prefill (``prompts``) for the
        repetition penalty, and the tokens they ``generated`` before (none, unless a preempted row
        is resumed) for the presence and frequency penalties."""
        if self.counts is not None:
            self.counts[mx.array(rows)] = 0.0
            again = [(r, g) for r, g in zip(rows, generated or ()) if g]
            if again:
                counts = np.zeros((len(again), self.vocab), dtype=np.float32)
                for i, (_, g) in enumerate(again):
                    counts[i] = np.bincount(g, minlength=self.vocab)
                self.counts[mx.array([r for r, _ in again])] = mx.array(counts)
        if self.seen is None:
            return
        self.seen[mx.array(rows)] = False
        rr = [r for r, p in zip(rows, prompts) for _ in p]
        ii = [t for p in prompts for t in p]
        self.seen[mx.array(rr), mx.array(ii)] = True
