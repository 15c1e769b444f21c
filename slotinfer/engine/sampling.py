"""Token selection for a whole batch at once: ``[b, vocab] -> [b]``, each row with its own parameters.

Every parameter is an array with one entry per row, so a step samples all slots in
one fused graph with no per-row Python.  Randomness is counter-based: the noise of
row ``i`` at generation step ``t`` is a hash of ``(seed_i, t, token)``, so a seeded
request draws the same tokens whichever batch, slot or step of the engine it runs
in, and the single-sequence reference path (a batch of one) draws the same too.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..request import SAMPLING, check_value

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


def logprobs_of(logits, tokens, top_n: int = 0):
    """Log-probability of the chosen tokens [b] and, if ``top_n``, the top-n (ids, logprobs) per row."""
    lp = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    if not top_n:
        return chosen, None, None
    ids = mx.argpartition(-lp, top_n - 1, axis=-1)[:, :top_n]
    vals = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
