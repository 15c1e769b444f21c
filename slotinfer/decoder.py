"""The Decoder: one compiled step for every slot at once.

Embed each slot's latest token, write its K/V at the slot's length, attend over
the live columns only, LM head, sample ``[b, vocab] -> [b]`` with each row's own
parameters.  The sampled tokens stay on the device and are the next step's input;
the host copies them once per step, one step behind (see ``engine.py``).
"""

from __future__ import annotations

import mlx.core as mx

from . import settings
from ._compile import ThreadCompiled
from .sampling import logprobs_of, penalize, sample
from .slots import DecodeView, SlotTable

SPAN_BUCKET = 64  # attention spans are rounded up to this, so a few compiled shapes serve every length
COMPILE = settings.compile_steps()  # SLOTINFER_COMPILE=0: eager steps, for debugging


class Decoder:
    """The slot table's decode step, compiled once per (span bucket, sampling mode)."""

    def __init__(self, net, table: SlotTable):
        self.net, self.table = net, table
        self._compiled = {}

    @property
    def variants(self) -> int:
        """How many step variants exist: bounded by the configuration (span buckets x sampling
        modes x the few logprob counts of :func:`~slotinfer.sampling.top_n_computed`), never by
        what requests ask for."""
        return len(self._compiled)

    def step(self, tokens, positions, span: int, rows: "RowParams", *, top_n: int = -1):
        """Run one step; returns ``(next_tokens [b], logprob outputs)``, all lazy.

        ``positions`` [b] int32: where each slot's input token goes (trash column when idle).
        """
        t = self.table
        # Never past max_len: the trash column holds what idle rows and padding wrote, which in a
        # sliding-window layer can be NaN (a fully masked row), and 0 * NaN would reach live rows.
        span = min(-(-span // SPAN_BUCKET) * SPAN_BUCKET, t.max_len)
        key = (span, rows.all_greedy, rows.use_sort, rows.seen is not None, top_n)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = ThreadCompiled(self._make(*key), enabled=COMPILE)
        seen = rows.seen if rows.seen is not None else mx.zeros((1,), dtype=mx.bool_)
        out = fn(tokens, t.keys, t.values, positions, rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                 rows.seeds, rows.steps, rows.penalty, seen)
        nxt, t.keys, t.values, seen, extra = out[0], out[1], out[2], out[3], out[4:]
        if rows.seen is not None:
            rows.seen = seen
        return nxt, extra

    def _make(self, span, greedy, use_sort, use_penalty, top_n):
        net, table = self.net, self.table

        def step(tokens, keys, values, positions, temperature, top_k, top_p, min_p, seeds, steps, penalty, seen):
            b = tokens.shape[0]
            index = table.flat_index(mx.arange(b), positions[:, None])
            view = DecodeView(keys, values, index, positions, span)
            logits = net.head(net(tokens[:, None], view)[:, 0])
            raw = logits
            if use_penalty:
                r = mx.arange(b)
                seen[r, tokens] = seen[r, tokens] | (positions < table.max_len)  # idle rows keep theirs
                logits = penalize(logits, seen, penalty)
            if greedy:
                nxt = mx.argmax(logits, axis=-1).astype(mx.int32)
            else:
                nxt = sample(logits, temperature, top_k, top_p, min_p, seeds, steps, use_sort=use_sort)
            extra = []
            if top_n >= 0:  # -1: no logprobs; 0: the chosen token's; n: also the top n
                chosen, ids, vals = logprobs_of(raw, nxt, top_n)
                extra = [chosen] + ([ids, vals] if top_n > 0 else [])
            return [nxt, view.keys, view.values, seen, *extra]

        return step


class RowParams:
    """Per-slot sampling parameters as [b] device arrays, rebuilt when slot occupancy changes."""

    def __init__(self, slots: int, vocab: int):
        self.slots, self.vocab = slots, vocab
        self.seen = None  # [b, vocab] bool, allocated once some request asks for a repetition penalty
        self.set([None] * slots)

    def set(self, params_by_row):
        """``params_by_row[i]`` is (SamplingParams, seed) of the item in slot i, or None."""
        def col(f, dt, default):
            return mx.array([f(p) if p else default for p in params_by_row], dtype=dt)

        self.temperature = col(lambda p: p[0].temperature, mx.float32, 0.0)
        self.top_k = col(lambda p: p[0].top_k, mx.int32, 0)
        self.top_p = col(lambda p: p[0].top_p, mx.float32, 1.0)
        self.min_p = col(lambda p: p[0].min_p, mx.float32, 0.0)
        self.penalty = col(lambda p: p[0].repetition_penalty, mx.float32, 1.0)
        self.seeds = col(lambda p: p[1], mx.uint32, 0)
        live = [p for p in params_by_row if p]
        self.all_greedy = all(p[0].temperature == 0 for p in live)
        self.use_sort = any(p[0].top_k > 0 or p[0].top_p < 1 for p in live if p[0].temperature > 0)
        if self.seen is None and any(p[0].repetition_penalty != 1.0 for p in live):
            self.seen = mx.zeros((self.slots, self.vocab), dtype=mx.bool_)
        self.steps = mx.zeros((self.slots,), dtype=mx.uint32)

    def take(self, rows: list[int]):
        """The parameters of ``rows`` only (for the Encoder's first token)."""
        idx = mx.array(rows)
        sub = RowParams.__new__(RowParams)
        for name in ("temperature", "top_k", "top_p", "min_p", "penalty", "seeds"):
            setattr(sub, name, getattr(self, name)[idx])
        sub.seen = None if self.seen is None else self.seen[idx]
        sub.use_sort, sub.all_greedy = self.use_sort, self.all_greedy
        return sub

    def reset_seen(self, rows: list[int], prompts: list[list[int]]):
        """Start the repetition-penalty history of newly admitted rows with their prompts."""
        if self.seen is None:
            return
        self.seen[mx.array(rows)] = False
        rr = [r for r, p in zip(rows, prompts) for _ in p]
        ii = [t for p in prompts for t in p]
        self.seen[mx.array(rr), mx.array(ii)] = True
