"""The Encoder: prefills newly admitted prompts into their slots.

Several prompts go through in one padded forward (causal + padding mask), each
written into its own slot's rows and nowhere else.  Prompts longer than the token
budget arrive in chunks, one chunk per engine step, so running slots keep decoding
meanwhile.  Logits are computed only at the last real token of rows whose prompt
is complete: never ``[n, L, vocab]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from . import device
from .models.transformer import layer_by_layer
from .sampling import logprobs_of, penalize, sample
from .slots import PrefillView, SlotTable


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

    def plan(self, pending) -> list[tuple[object, Chunk]]:
        """Pick items (FIFO) and their next chunks so the padded call stays within the token budget."""
        picked, width = [], 0
        for item in pending:
            left = len(item.prompt) - item.prefilled
            size = min(left, self.budget)
            w = max(width, size)
            if picked and w * (len(picked) + 1) > self.budget:
                break
            width = w
            start = item.prefilled
            picked.append((item, Chunk(item.slot, start, item.prompt[start:start + size], start + size == len(item.prompt))))
        return picked

    def run(self, chunks: list[Chunk], rows_params, *, top_n: int = -1):
        """Prefill ``chunks``; returns the first sampled token (and logprobs) of each completed row, lazily.

        ``rows_params`` holds [m] sampling arrays for the rows with ``last=True``, in order.
        """
        width = max(len(c.tokens) for c in chunks)
        tokens = mx.array([c.tokens + [0] * (width - len(c.tokens)) for c in chunks])
        rows = mx.array([c.slot for c in chunks])
        starts = mx.array([c.start for c in chunks])
        lens = mx.array([len(c.tokens) for c in chunks])
        fresh = all(c.start == 0 for c in chunks)
        span = max(c.start + len(c.tokens) for c in chunks)
        view = PrefillView(self.table, rows, starts, lens, width, span, fresh)
        h = self.net(tokens, view, layer_by_layer(self.table, len(chunks) * width, self.by_layer))
        done = [i for i, c in enumerate(chunks) if c.last]
        if not done:
            return None
        idx = mx.array(done)
        last = h[idx, mx.array([len(chunks[i].tokens) - 1 for i in done])]  # [m, hidden]
        logits = self.net.head(last)
        p = rows_params
        raw = logits
        if p.seen is not None:
            logits = penalize(logits, p.seen, p.penalty)
        first = sample(logits, p.temperature, p.top_k, p.top_p, p.min_p, p.seeds,
                       mx.zeros(len(done), dtype=mx.uint32), use_sort=p.use_sort)
        extra = list(logprobs_of(raw, first, top_n)) if top_n >= 0 else []
        return first, [e for e in extra if e is not None]
