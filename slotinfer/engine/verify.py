"""Speculative decoding inside the batched decode step: rows as positions.

A speculating slot with ``k`` drafted tokens contributes ``k + 1`` rows to a decode step.  Row
``j`` of its group feeds ``x_j`` (``x_0`` the slot's latest token, on the device; ``x_j = d_j``
from the host) at position ``L + j`` (``L`` the slot's length), through the slot's own block
table, and writes its K/V there.  Every layer scatters all rows' K/V before attention reads the
pool (:class:`~slotinfer.kv.PagedDecodeView`), and each row's mask is by its own position, so
row ``j`` attends to what rows ``< j`` wrote in this same step: it computes exactly what a
one-token step at that position computes.  Slots that do not speculate ride along as groups of
one row.

Every row samples through :func:`~slotinfer.sampling.select` with its slot's parameters, the
sampling step ``gen + j`` (seeded noise is keyed by (seed, step, token)), the penalties over the
slot's history plus its group's inputs ``x_0 .. x_j``, and its own grammar mask.  The host reads
the ``[rows]`` tokens back once and accepts a draft while the sampled token equals it
(:func:`accepted`); rejection is a length update (``Engine``).  The slot's state on the device
(its latest token, seen tokens, counts) is then taken from the row its group ended on
(:func:`fix_rows`), so it holds accepted tokens only.

The host reads a verify step back before it builds the next one (the drafts come from its tokens),
so its products take every core at any row count (:func:`~slotinfer.cpu.qlayers.all_cores`).

The compiled variants are bounded by the configuration: every row count up to :data:`EXACT_ROWS`,
then row buckets up to ``slots x (max draft + 1)``, x block counts x sampling modes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .._compile import ThreadCompiled
from ..cpu.qlayers import all_cores
from .decoder import COMPILE, row_bucket
from ..kv import ZERO, PagedDecodeView, write_index
from .sampling import RowParams, select
from ..kv.slot_table import SlotTable


# Up to this many rows a verify step computes its rows exactly, unpadded: its cost grows by about a
# row's share of the step for each (the products take up to 8 rows straight from each decoded block),
# where padding 5 positions to 6 rows or 7 to 8 would cost a row more.
EXACT_ROWS = 8


def accepted(sampled, drafts) -> int:
    """How many of ``drafts`` a group accepts: while the token sampled at each position equals the
    draft token that follows it.  The group's new tokens are ``sampled[:accepted + 1]``."""
    a = 0
    while a < len(drafts) and int(sampled[a]) == int(drafts[a]):
        a += 1
    return a


class Verifier:
    """The decode step over rows as positions, compiled once per (row bucket, block count, sampling
    mode); ``max_rows`` is the most rows a step may have (``slots x (max draft + 1)``)."""

    def __init__(self, net, table: SlotTable, max_rows: int):
        self.net, self.table, self.max_rows = net, table, max_rows
        self._compiled = {}

    @property
    def variants(self) -> int:
        return len(self._compiled)

    def step(self, tokens, groups, gen, rows: RowParams, *, top_n: int = -1, masks=None):
        """Run one step for ``groups``: ``[(slot, drafts)]``, each live slot once, ``drafts`` a list
        of token ids (empty: the slot does not speculate).  ``gen`` [b] (host) is each slot's
        sampling step; ``masks`` (host, ``[rows, words]`` int32 in the groups' row order, or None).

        Returns ``(sampled [n], row_seen, row_counts, logprob outputs [n, ...])``, lazy, with ``n``
        the row bucket: the groups' rows first, in order, then padding.  ``row_seen`` /
        ``row_counts`` (or None) are each row's penalty state including its group's inputs up to
        it, for :func:`fix_rows`.
        """
        t = self.table
        bs = t.block_size
        live_n = sum(1 + len(d) for _, d in groups)
        n = live_n if live_n <= EXACT_ROWS else row_bucket(live_n, self.max_rows)
        row_slot = np.zeros(n, dtype=np.int32)
        draft_in = np.zeros(n, dtype=np.int32)
        is_first = np.zeros(n, dtype=bool)
        pos = np.full(n, -1, dtype=np.int32)
        steps = np.zeros(n, dtype=np.uint32)
        group_of = np.full(n, -1, dtype=np.int32)
        j_of = np.zeros(n, dtype=np.int32)
        r = 0
        for g, (slot, drafts) in enumerate(groups):
            k = len(drafts)
            sl = slice(r, r + k + 1)
            row_slot[sl] = slot
            draft_in[r + 1:r + k + 1] = drafts
            is_first[r] = True
            pos[sl] = t.lengths[slot] + np.arange(k + 1)
            steps[sl] = gen[slot] + np.arange(k + 1, dtype=np.uint32)
            group_of[sl] = g
            j_of[sl] = np.arange(k + 1)
            r += k + 1
        is_live = pos >= 0
        span = int(pos.max()) + 1
        nblk = min(-(-span // bs), t.max_blocks)
        tables = np.where(is_live[:, None], t.pool.tables[row_slot, :nblk], ZERO).astype(np.int32)
        blocks, offsets = t.locate(row_slot, pos)
        view_pos = np.where(is_live, pos, nblk * bs - 1).astype(np.int32)
        use_penalty, use_adjust = rows.seen is not None, rows.counts is not None
        key = (n, nblk, rows.all_greedy, rows.use_sort, use_penalty, use_adjust, masks is not None, top_n)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = ThreadCompiled(self._make(*key), enabled=COMPILE)
        none = mx.zeros((1,), dtype=mx.bool_)
        if use_penalty or use_adjust:  # each row's group inputs up to it: rows of its group at j' <= j
            same = (group_of[:, None] == group_of[None, :]) & (j_of[None, :] <= j_of[:, None]) & is_live[:, None]
            upto = mx.array(same.astype(np.float32))
        else:
            upto = none
        mask = none
        if masks is not None:
            full = np.full((n, masks.shape[1]), -1, dtype=np.int32)
            full[:len(masks)] = masks
            mask = mx.array(full)
        adjusting = [rows.counts, rows.bias, rows.presence, rows.frequency] if use_adjust else [none] * 4
        out = fn(tokens, mx.array(row_slot), mx.array(draft_in), mx.array(is_first), t.keys, t.values,
                 mx.array(view_pos), mx.array(blocks), mx.array(offsets), mx.array(tables), upto, rows.temperature,
                 rows.top_k, rows.top_p, rows.min_p, rows.seeds, mx.array(steps), rows.penalty,
                 rows.seen if use_penalty else none, mask, *adjusting)
        sampled, t.keys, t.values, row_seen, row_counts, extra = out[0], out[1], out[2], out[3], out[4], out[5:]
        return sampled, row_seen if use_penalty else None, row_counts if use_adjust else None, extra

    def _make(self, n, nblk, greedy, use_sort, use_penalty, use_adjust, masked, top_n):
        net, table = self.net, self.table
        geometry = dict(kv_heads=table.kv_heads, block_size=table.block_size, head_dim=table.row,
                        num_blocks=table.num_blocks)

        def step(tokens, row_slot, draft_in, is_first, keys, values, positions, blocks, offsets, tables, upto,
                 temperature, top_k, top_p, min_p, seeds, steps, penalty, seen, mask, counts, bias, presence,
                 frequency):
            def mine(a):
                return a[row_slot]

            inp = mx.where(is_first, tokens[row_slot], draft_in)
            index = write_index(blocks[:, None], offsets[:, None], **geometry)
            view = PagedDecodeView(keys, values, index, positions, tables, positions)
            with all_cores():  # the host waits for this step: no next step is built beside it
                logits = net.head(net(inp[:, None], view)[:, 0])
            row_seen = row_counts = mx.zeros((1,), dtype=mx.bool_)
            if use_penalty or use_adjust:
                vocab = (seen if use_penalty else counts).shape[1]
                onehot = (mx.arange(vocab, dtype=mx.int32)[None] == inp[:, None]).astype(mx.float32)
                added = upto @ onehot  # [n, vocab]: small whole counts, exact in float32
                if use_penalty:
                    row_seen = mine(seen) | (added > 0)
                if use_adjust:
                    row_counts = mine(counts) + added
            sampled, chosen = select(
                logits, temperature=mine(temperature), top_k=mine(top_k), top_p=mine(top_p), min_p=mine(min_p),
                seeds=mine(seeds), steps=steps, penalty=mine(penalty) if use_penalty else None,
                seen=row_seen if use_penalty else None, counts=row_counts if use_adjust else None,
                bias=mine(bias) if use_adjust else None, presence=mine(presence) if use_adjust else None,
                frequency=mine(frequency) if use_adjust else None, mask=mask if masked else None, greedy=greedy,
                use_sort=use_sort, top_n=top_n)
            return [sampled, view.keys, view.values, row_seen, row_counts, *chosen]

        return step


def fix_rows(tokens, rows: RowParams, slots: list[int], final: list[int], sampled, row_seen, row_counts):
    """Each of ``slots`` takes its state from the row its group ended on (``final``): its next input
    token (what that row sampled) and its penalty state (its history and the accepted inputs)."""
    if not slots:
        return tokens
    s, f = mx.array(slots), mx.array(final)
    tokens[s] = sampled[f]
    if row_seen is not None and rows.seen is not None:
        rows.seen[s] = row_seen[f]
    if row_counts is not None and rows.counts is not None:
        rows.counts[s] = row_counts[f]
    return tokens


def group_masks(groups, constraints, words: int) -> np.ndarray | None:
    """The ``[rows, words]`` bitmasks of ``groups`` (row order), or None when none is constrained:
    a constrained row ``j`` gets its matcher's mask after the group's drafts ``d_1 .. d_j``
    (consumed, then rolled back), every other row all ones."""
    if not any(c is not None for c in constraints):
        return None
    n = sum(1 + len(d) for _, d in groups)
    masks = np.full((n, words), -1, dtype=np.int32)
    r = 0
    for (_, drafts), c in zip(groups, constraints):
        if c is not None:
            c.fill_along(drafts, masks, r)
        r += 1 + len(drafts)
    return masks
