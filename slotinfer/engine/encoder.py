"""The Encoder: prefill, for the engine's slots and for classify alike.

One mechanism serves both.  Prompts go through in right-padded batches whose padded
size (rows x widest row) stays within a token budget (:func:`fits`), by one forward
(:func:`forward`) that evaluates layer by layer from the device's threshold on, and
the head sees only each row's last real token (:func:`last_hidden`): never
``[n, L, vocab]``.  What differs is the attention context the rows run through:

* the engine's :class:`~slotinfer.kv.slot_table.PrefillView` writes each row's K/V into its
  slot's blocks; prompts longer than the budget arrive in chunks, one per engine step, so
  running slots keep decoding meanwhile (:class:`Encoder`);
* classify's :class:`SegmentView` attends to K/V computed before (a
  :class:`SharedPrefix`, computed once and reused by every batch; a prompt's own K/V
  kept for its labels' continuations) followed by the rows' own K/V.  Its batches are
  the sorted lengths cut by the same rule (:func:`plan_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from .. import device
from ..kv.slot_table import PrefillView, SlotTable
from ..kv.views import window_mask
from ..models.transformer import layer_by_layer
from .sampling import select

FAR = 1 << 30  # key position of a past column that must stay invisible (padding of an earlier segment)


# -- batching -------------------------------------------------------------------------

def fits(width: int, rows: int, budget: int) -> bool:
    """Whether ``rows`` right-padded rows of ``width`` tokens may share one forward (one row always may)."""
    return rows <= 1 or width * rows <= budget


def plan_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped into batches, longest first, each at most ``budget`` padded tokens.

    Sorted lengths make each batch's rows nearly equal, so little is padded; a row
    longer than the budget forms a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches, cur = [], []
    for i in order:
        if cur and not fits(lengths[cur[0]], len(cur) + 1, budget):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


# -- the forward ------------------------------------------------------------------------

def forward(net, rows: list[list[int]], ctx, by_layer: int, kv=None):
    """Final hidden states [n, widest, hidden] of ``rows`` (right-padded with 0) through ``ctx``.

    From ``by_layer`` tokens (rows x widest) on (> 0), each layer is evaluated before the
    next is queued (:func:`~slotinfer.models.transformer.layer_by_layer`), with the K/V
    writes of ``kv`` (the slot table) when given.
    """
    width = max(len(r) for r in rows)
    tokens = mx.array([r + [0] * (width - len(r)) for r in rows])
    n = len(rows) * width
    if kv is not None:
        after = layer_by_layer(kv, n, by_layer)
    else:
        after = (lambda i, h: mx.eval(h)) if 0 < by_layer <= n else None
    return net(tokens, ctx, after)


def last_hidden(h, lens: Sequence[int], rows: Sequence[int] | None = None):
    """Hidden state [m, hidden] at the last real token of each row (``rows``: which, default all)."""
    rows = range(len(lens)) if rows is None else rows
    return h[mx.array(list(rows)), mx.array([int(lens[i]) - 1 for i in rows])]


# -- the engine's prefill -----------------------------------------------------------------

@dataclass
class Chunk:
    """One row of a prefill call: ``tokens`` go into ``slot`` starting at column ``start``."""

    slot: int
    start: int
    tokens: list[int]
    last: bool  # the prompt is complete after this chunk


class Encoder:
    def __init__(self, net, table: SlotTable, budget: int):
        self.net, self.table, self.budget = net, table, budget
        self.by_layer = device.prefill_by_layer()  # calls of this many tokens on go layer by layer (0: never)
        self.micro = device.prefill_micro_batch()  # the most tokens one forward computes (0: the budget)

    def plan(self, pending) -> list[tuple[object, Chunk]]:
        """Pick items (FIFO) and their next chunks so the padded call stays within the token budget."""
        picked, width = [], 0
        for item in pending:
            feed = item.feed
            left = len(feed) - item.prefilled
            size = min(left, self.budget)
            w = max(width, size)
            if picked and not fits(w, len(picked) + 1, self.budget):
                break
            width = w
            start = item.prefilled
            picked.append((item, Chunk(item.slot, start, feed[start:start + size], start + size == len(feed))))
        return picked

    def _forward(self, chunks: list[Chunk]):
        """Final hidden states of one forward over ``chunks``, their K/V written to their slots."""
        width = max(len(c.tokens) for c in chunks)
        lens = [len(c.tokens) for c in chunks]
        fresh = all(c.start == 0 for c in chunks)
        span = max(c.start + len(c.tokens) for c in chunks)
        view = PrefillView(self.table, [c.slot for c in chunks], [c.start for c in chunks], lens, width, span, fresh)
        return forward(self.net, [c.tokens for c in chunks], view, self.by_layer, self.table)

    def run(self, chunks: list[Chunk], rows_params, *, top_n: int = -1, mask=None, steps=None):
        """Prefill ``chunks``; returns the first sampled token (and logprobs) of each completed row, lazily.

        The chunks go through in forwards of at most :func:`~slotinfer.device.prefill_micro_batch`
        tokens (:func:`micro_calls`), whatever the budget that planned them.

        ``rows_params`` holds [m] sampling arrays for the rows with ``last=True``, in order, and
        ``mask`` (or None) their [m, words] bitmasks of allowed tokens.  ``steps`` ([m] uint32, None:
        zeros) is the sampling step of each row's token: the count of tokens it generated before (a
        preempted request recomputed resumes at its own).
        """
        done = [i for i, c in enumerate(chunks) if c.last]
        last = {}  # chunk index -> hidden state at its last token, for the rows that complete
        for call in micro_calls(chunks, self.micro):
            h = self._forward([c for _, c in call])
            ends = [j for j, (i, c) in enumerate(call) if c.last]
            if ends:
                got = last_hidden(h, [len(c.tokens) for _, c in call], ends)
                if len(call) < len(chunks):
                    mx.eval(got)  # the call's activations go before the next one's are made
                last.update((call[j][0], got[n]) for n, j in enumerate(ends))
        if not done:
            return None
        logits = self.net.head(mx.stack([last[i] for i in done]))
        p = rows_params
        first, extra = select(
            logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seeds=p.seeds,
            steps=mx.zeros(len(done), dtype=mx.uint32) if steps is None else steps, penalty=p.penalty, seen=p.seen,
            counts=p.counts, bias=p.bias, presence=p.presence, frequency=p.frequency, mask=mask,
            use_sort=p.use_sort, top_n=top_n)
        return first, extra


def micro_calls(chunks: list[Chunk], cap: int) -> list[list[tuple[int, Chunk]]]:
    """``chunks`` as forwards of at most ``cap`` padded tokens each (0: one forward), in an order
    that computes each row's tokens in turn: a chunk longer than ``cap`` goes in pieces of
    ``cap`` tokens, rows side by side while they fit.  Each entry is (index in ``chunks``, the
    piece); a piece is ``last`` when its chunk is and it ends the chunk."""
    width = max(len(c.tokens) for c in chunks)
    if cap <= 0 or fits(width, len(chunks), cap):
        return [list(enumerate(chunks))]
    pieces = []  # by round: the r-th piece of each chunk that has one
    for i, c in enumerate(chunks):
        for r, at in enumerate(range(0, len(c.tokens), cap)):
            if r == len(pieces):
                pieces.append([])
            end = min(len(c.tokens), at + cap)
            pieces[r].append((i, Chunk(c.slot, c.start + at, c.tokens[at:end], c.last and end == len(c.tokens))))
    calls = []
    for round_ in pieces:
        cur, w = [], 0
        for i, p in round_:
            if cur and not fits(max(w, len(p.tokens)), len(cur) + 1, cap):
                calls.append(cur)
                cur, w = [], 0
            cur.append((i, p))
            w = max(w, len(p.tokens))
        calls.append(cur)
    return calls


# -- classify's prefill: rows after K/V computed before -------------------------------------

class SegmentView:
    """Attention context of rows that follow K/V computed before (see the protocol in ``models/transformer.py``).

    ``B`` right-padded rows of ``L`` new tokens each attend to ``past`` K/V (earlier
    segments: a shared prefix, a prompt's own K/V) followed by their own K/V.

    * ``offset``: rope position of each row's first new token (int, or [B] array).
    * ``past``: list of segments ``(kv, index)``; ``kv[layer] = (k, v)`` with a batch
      dimension of 1 (broadcast to every row) or of its own rows, gathered with
      ``index`` [B] when given.  Segments are concatenated in order.
    * ``past_pos``: key position of every past column, ``[1 or B, S_past]``; a column
      a row must not see (its padding) holds :data:`FAR`, so causality hides it.
      ``None`` means the past is exactly positions ``0 .. offset-1`` for every row.
    * ``keep``: remember this forward's own K/V per layer in ``kept``.
    """

    def __init__(self, num_layers: int, batch: int, *, offset=0, past=(), past_pos=None, keep=False):
        self.B = batch
        self.offset = offset
        self.past = list(past)
        self.past_pos = past_pos
        self.kept = [None] * num_layers if keep else None
        self._masks = {}

    def update(self, layer, k, v):
        if self.kept is not None:
            self.kept[layer] = (k, v)
        if not self.past:
            return k, v
        ks, vs = [], []
        for kv, index in self.past:
            pk, pv = kv[layer]
            if index is not None:
                pk, pv = pk[index], pv[index]
            if pk.shape[0] != self.B:
                pk = mx.broadcast_to(pk, (self.B,) + pk.shape[1:])
                pv = mx.broadcast_to(pv, (self.B,) + pv.shape[1:])
            ks.append(pk)
            vs.append(pv)
        return mx.concatenate(ks + [k], axis=2), mx.concatenate(vs + [v], axis=2)

    def mask(self, layer, L, window):
        key = (L, window)
        if key not in self._masks:
            self._masks[key] = self._build(L, window)
        return self._masks[key]

    def _build(self, L, window):
        uniform = isinstance(self.offset, int) and self.past_pos is None
        if uniform:
            total = self.offset + L
            if window is None or total <= window:
                return None if L == 1 else "causal"  # bottom-right aligned: exactly what is needed
            q_pos = mx.arange(self.offset, total)[None]
            k_pos = mx.arange(total)[None]
        else:
            off = self.offset if isinstance(self.offset, int) else self.offset[:, None]
            q_pos = off + mx.arange(L)[None]  # [1 or B, L]
            rows = max(q_pos.shape[0], 1 if self.past_pos is None else self.past_pos.shape[0])
            q_pos = mx.broadcast_to(q_pos, (rows, L))
            past = self.past_pos if self.past_pos is not None else mx.arange(self.offset)[None]
            k_pos = mx.concatenate([mx.broadcast_to(past, (rows, past.shape[1])), q_pos], axis=1)
        return window_mask(q_pos, k_pos, window)[:, None]  # [rows, 1, L, S]


class SharedPrefix:
    """K/V of a prefix (an instruction) computed once; every batch after it attends to them.

    ``kv[layer] = (k, v)`` with a batch dimension of 1, broadcast to the rows of each
    batch; rows after it start at rope position ``len(ids)``.
    """

    def __init__(self, net, ids: list[int], by_layer: int):
        self.ids = list(ids)
        view = SegmentView(net.config.num_layers, 1, keep=True)
        forward(net, [self.ids], view, by_layer)
        self.kv = view.kept
        mx.eval(self.kv)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)

    def segment(self):
        """The ``past`` segment of a :class:`SegmentView`."""
        return self.kv, None
