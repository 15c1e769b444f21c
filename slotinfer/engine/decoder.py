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

import contextlib
import functools

import mlx.core as mx
import numpy as np

from .. import settings
from .._compile import ThreadCompiled
from ..cpu.qlayers import all_cores
from ..kv import ZERO, PagedDecodeView, write_index
from ..kv.slot_table import SlotTable
from .sampling import RowParams, select, spread

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
        :func:`~slotinfer.engine.sampling.top_n_computed` x whether the host waits for the step),
        never by what requests ask for."""
        return len(self._compiled)

    def step(self, tokens, live, positions, span: int, rows: RowParams, *, top_n: int = -1, masks=None,
             waited: bool = False):
        """Run one step for the ``live`` slots (sorted); returns ``(tokens [b], logprob outputs [b, ...])``,
        all lazy.

        ``tokens`` [b] is every slot's latest token; the result is the same array with the live
        slots' next tokens in.  ``positions`` [b] (host) is where each slot's input token goes
        (read for the live slots only); ``span`` the positions the widest live row attends to.
        Logprob outputs are [b, ...] too; other slots' entries are meaningless.  ``masks`` (host,
        [b, words] int32, or None) is each slot's bitmask of the tokens it may take
        (:mod:`slotinfer.engine.structured`); a free row's is all ones.  ``waited``: the host reads
        this step back before it builds the next (speculation), so its products take every core
        (:func:`~slotinfer.cpu.qlayers.all_cores`).

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
               rows.counts is not None, masks is not None, top_n, waited)
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

    def _make(self, n, prefix, nblk, greedy, use_sort, use_penalty, use_adjust, masked, top_n, waited):
        net, table = self.net, self.table
        slots = table.slots
        geometry = dict(kv_heads=table.kv_heads, block_size=table.block_size, head_dim=table.row,
                        num_blocks=table.num_blocks)

        def step(tokens, picked, keys, values, positions, is_live, blocks, offsets, tables, temperature, top_k, top_p,
                 min_p, seeds, steps, penalty, seen, mask, counts, bias, presence, frequency):
            def mine(a):  # the step's rows of a [b, ...] per-slot array
                return a[:n] if prefix else a[picked]

            tok = mine(tokens)
            index = write_index(blocks[:, None], offsets[:, None], **geometry)
            view = PagedDecodeView(keys, values, index, positions, tables, positions)
            with all_cores() if waited else contextlib.nullcontext():
                logits = net.head(net(tok[:, None], view)[:, 0])
            if use_penalty:  # the input token is the row's latest: it joins what the row has seen
                r = mx.arange(n)
                mine_seen = mine(seen)
                mine_seen[r, tok] = mine_seen[r, tok] | is_live  # padding rows keep theirs
                seen = mx.put_along_axis(seen, mx.broadcast_to(picked[:, None], mine_seen.shape), mine_seen, axis=0)
            if use_adjust:  # and it is counted
                r = mx.arange(n)
                mine_counts = mine(counts)
                mine_counts[r, tok] = mine_counts[r, tok] + is_live
                counts = mx.put_along_axis(counts, mx.broadcast_to(picked[:, None], mine_counts.shape), mine_counts,
                                           axis=0)
            nxt, chosen = select(
                logits, temperature=mine(temperature), top_k=mine(top_k), top_p=mine(top_p), min_p=mine(min_p),
                seeds=mine(seeds), steps=mine(steps), penalty=mine(penalty) if use_penalty else None,
                seen=mine_seen if use_penalty else None, counts=mine_counts if use_adjust else None,
                bias=mine(bias) if use_adjust else None, presence=mine(presence) if use_adjust else None,
                frequency=mine(frequency) if use_adjust else None, mask=mask if masked else None, greedy=greedy,
                use_sort=use_sort, top_n=top_n)
            # Padding rows put back what their slot held (a padding slot may appear more than once).
            out = mx.put_along_axis(tokens, picked, mx.where(is_live, nxt, tok), axis=0)
            extra = [spread(a, picked, slots) for a in chosen]
            return [out, view.keys, view.values, seen, counts, *extra]

        return step
