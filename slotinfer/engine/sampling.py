"""Token selection for a whole batch at once: ``[b, vocab] -> [b]``, each row with its own parameters.

Every parameter is an array with one entry per row, so a step samples all slots in
one fused graph with no per-row Python.  :func:`select` is the one way from logits to a
token (penalize -> adjust -> mask -> sample or argmax -> logprobs): the Encoder's first
token, the Decoder's compiled step and the reference path (``Model.generate``) all call it.  Randomness is counter-based: the noise of
row ``i`` at generation step ``t`` is a hash of ``(seed_i, t, token)``, so a seeded
request draws the same tokens whichever batch, slot or step of the engine it runs
in, and the single-sequence reference path (a batch of one) draws the same too.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .._compile import ThreadCompiled
from ..cpu import fastmath
from ..request import SAMPLING, check_value
from .structured import apply_mask

_M1, _M2, _GOLD = 0x7FEB352D, 0x846CA68B, 0x9E3779B9


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, checked on construction by :mod:`slotinfer.request`'s table."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        for name in SAMPLING:  # the request table's rules; numpy scalars become Python numbers
            object.__setattr__(self, name, check_value(name, getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _mix(x):
    x = x ^ (x >> 16)
    x = x * mx.array(_M1, dtype=mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(_M2, dtype=mx.uint32)
    return x ^ (x >> 16)


def gumbel_noise(seeds, steps, vocab: int):
    """Gumbel(0, 1) noise [b, vocab], a pure function of each row's (seed, step) and the token id."""
    row = _mix(_mix(seeds.astype(mx.uint32)) ^ (steps.astype(mx.uint32) * mx.array(_GOLD, dtype=mx.uint32)))
    return gumbel_of(_mix(row[:, None] + mx.arange(vocab, dtype=mx.uint32)[None]))


def gumbel_of(bits):
    """Gumbel(0, 1) noise from uint32 ``bits``, always finite.

    23 bits, centred in their cells, give u in [2**-24, 1 - 2**-24], never 0 or 1 in float32:
    an infinite noise would turn a token masked to -inf into NaN, and NaN wins argmax.
    """
    u = (bits >> 9).astype(mx.float32) * (1.0 / (1 << 23)) + (1.0 / (1 << 24))
    return -mx.log(-mx.log(u))


def penalize(logits, seen, penalty):
    """Repetition penalty over tokens already seen (prompt and output): divide positive logits, multiply negative."""
    p = penalty[:, None]
    hit = mx.where(logits > 0, logits / p, logits * p)
    return mx.where(seen, hit, logits)


def adjust(logits, bias, counts, presence, frequency):
    """``logit_bias`` ([b, vocab] added), then the presence and frequency penalties over ``counts``
    [b, vocab], how often each token was generated so far: ``- frequency * count - presence * (count > 0)``."""
    return logits + bias - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def filter_logits(x, top_k, top_p, min_p, *, use_sort: bool):
    """Mask to -inf what top-k, top-p and min-p exclude, per row (a value of 0 / 1 / 0 disables each)."""
    if use_sort:
        desc = -mx.sort(-x, axis=-1)
        vocab = x.shape[-1]
        kth = mx.take_along_axis(desc, (mx.clip(top_k, 1, vocab) - 1)[:, None].astype(mx.int32), axis=-1)
        x = mx.where((top_k[:, None] > 0) & (x < kth), -mx.inf, x)
        probs = mx.softmax(mx.where((top_k[:, None] > 0) & (desc < kth), -mx.inf, desc), axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs  # mass strictly ahead of each sorted token
        keep = before < top_p[:, None]
        cutoff = mx.min(mx.where(keep, desc, mx.inf), axis=-1, keepdims=True)
        x = mx.where((top_p[:, None] < 1) & (x < cutoff), -mx.inf, x)
    probs = mx.softmax(x, axis=-1)
    floor = min_p[:, None] * mx.max(probs, axis=-1, keepdims=True)
    return mx.where((min_p[:, None] > 0) & (probs < floor), -mx.inf, x)


def sample(logits, temperature, top_k, top_p, min_p, seeds, steps, *, use_sort: bool = True):
    """Choose one token per row: greedy where ``temperature == 0``, else a seeded draw.

    ``logits`` is [b, vocab] (already penalized); every other argument is [b].
    """
    logits = logits.astype(mx.float32)
    greedy = mx.argmax(logits, axis=-1)
    t = mx.where(temperature > 0, temperature, 1.0)[:, None]
    x = filter_logits(logits / t, top_k, top_p, min_p, use_sort=use_sort)
    drawn = mx.argmax(x + gumbel_noise(seeds, steps, logits.shape[-1]), axis=-1)
    return mx.where(temperature > 0, drawn, greedy).astype(mx.int32)


TOP_LOGPROBS_STEP = 20  # the most OpenAI's API lets a request ask for


def top_n_computed(asked: int, vocab: int) -> int:
    """How many top logprobs a step computes when its rows ask for at most ``asked``.

    Each count is a compiled variant of the decode step, so the step computes one of a few
    fixed counts (20, then x4 up to the vocabulary) and each row keeps its own on the host:
    whatever numbers clients send, a model compiles at most ``3 + log4(vocab / 20)``
    logprob variants.  ``asked`` of -1 (no logprobs) and 0 (the chosen token's only) stay.
    """
    if asked <= 0:
        return asked
    n = TOP_LOGPROBS_STEP
    while n < asked:
        n *= 4
    return min(n, vocab)


SUM_BLOCK = 128  # logsumexp's partial sums: each of at most this many terms


def logsumexp(x, keepdims: bool = False):
    """``log(sum(exp(x)))`` over the last axis, as ``mx.logsumexp`` but within 2e-6 of float64 over a
    whole vocabulary.

    ``mx.logsumexp`` (and ``mx.sum``) adds a row's terms into one float32 accumulator per SIMD lane:
    over 49,152 logits its rounding reaches 2.4e-4 of the sum, so every log-prob is off by as much.
    Here each block of :data:`SUM_BLOCK` terms is summed first and the block sums after, and ``exp``
    is :func:`slotinfer.cpu.fastmath.exp` (error under 1e-7, where MLX's CPU ``exp`` has 4e-6, and
    fused where compiled: :data:`logsumexp_compiled`).  Row by row as before, so a row's value does not
    depend on the rows beside it.  Rows of -inf give -inf.
    """
    m = mx.max(x, axis=-1, keepdims=True)
    m = mx.where(m == -mx.inf, mx.zeros_like(m), m)  # a row of -inf: exp(x - 0) = 0, log 0 = -inf
    e = fastmath.exp(x - m)
    pad = -x.shape[-1] % SUM_BLOCK
    if pad:
        e = mx.pad(e, [(0, 0)] * (e.ndim - 1) + [(0, pad)])
    s = e.reshape(*e.shape[:-1], -1, SUM_BLOCK).sum(axis=-1).sum(axis=-1, keepdims=True)
    out = m + mx.log(s)
    return out if keepdims else out.squeeze(-1)


@ThreadCompiled
def logsumexp_compiled(x):
    """:func:`logsumexp` (``keepdims``) as one compiled function, for eager callers (scoring, classify):
    fused, several times faster than ``mx.logsumexp`` on CPU."""
    return logsumexp(x, keepdims=True)


def logprobs_of(logits, tokens, top_n: int = 0):
    """Log-probability of the chosen tokens [b] and, if ``top_n``, the top-n (ids, logprobs) per row."""
    lp = logits.astype(mx.float32) - logsumexp(logits.astype(mx.float32), keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    if not top_n:
        return chosen, None, None
    ids = mx.argpartition(-lp, top_n - 1, axis=-1)[:, :top_n]
    vals = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def select(logits, *, temperature, top_k, top_p, min_p, seeds, steps, penalty=None, seen=None, counts=None, bias=None,
           presence=None, frequency=None, mask=None, greedy: bool = False, use_sort: bool = True, top_n: int = -1):
    """The tokens ``[n]`` chosen from ``logits`` ``[n, vocab]``, and their logprob outputs.

    Each row's own parameters are ``[n]`` arrays.  In order: the repetition ``penalty`` over the
    tokens ``seen`` (``[n, vocab]`` bool; None: none), then ``logit_bias`` and the presence and
    frequency penalties over ``counts`` (None: none), then ``mask`` (``[n, words]`` bitmasks of
    the allowed tokens, :mod:`slotinfer.engine.structured`; None: all), then argmax where ``greedy`` (every
    row greedy) or a seeded draw (greedy rows still take the argmax).  The logprob outputs
    (``top_n``: -1 none, 0 the chosen token's, n also the top n (ids, logprobs)) are those of the
    model's own distribution, before any adjustment: a list of 0, 1 or 3 arrays.
    """
    raw = logits
    if seen is not None:
        logits = penalize(logits, seen, penalty)
    if counts is not None:
        logits = adjust(logits, bias, counts, presence, frequency)
    if mask is not None:
        logits = apply_mask(logits, mask)
    if greedy:
        tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    else:
        tokens = sample(logits, temperature, top_k, top_p, min_p, seeds, steps, use_sort=use_sort)
    if top_n < 0:
        return tokens, []
    chosen, ids, vals = logprobs_of(raw, tokens, top_n)
    return tokens, [chosen] + ([ids, vals] if top_n > 0 else [])


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
