"""The reference path: one prompt generated alone, token by token, on a checkpoint.

The batched engine is tested against it; it decodes through pool blocks of the engine's size,
so alone equals batched (``Model.generate`` is this function).
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np

from .. import device, request
from ..kv import KV_BLOCK_SIZE, PagedSequenceCache
from ..models.transformer import layer_by_layer
from ..text.stops import after_token, final_text
from ..types import Completion
from .sampling import SamplingParams, select
from .structured import words


def generate(model, prompt, **params) -> Completion:
    """Generate for one prompt, alone: the simple path the batched engine is tested against.

    ``params``: ``max_tokens`` (256), ``temperature`` (0: greedy), ``top_k``, ``top_p``,
    ``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``
    and ``skip_special_tokens`` (True: the text leaves out special tokens such as
    ``<|im_end|>``); :mod:`slotinfer.request` has the table of their values and defaults.

        >>> model.generate("Hello", max_tokens=16, temperature=0.7, seed=1).text
    """
    c = request.check(params, model.config.vocab_size, names=request.GENERATE, what="Model.generate")
    ids = model.encode_prompt(prompt)
    params = SamplingParams(*(c[k] for k in request.SAMPLING))
    constraint = model.grammars.constraint(c)
    stops = c["stop"]
    seed = params.seed if params.seed is not None else random.getrandbits(32)
    enders = c["stop_token_ids"] | (frozenset() if c["ignore_eos"] else model.eos_ids)
    budget = min(c["max_tokens"], model.context_length - len(ids))
    vocab = model.config.vocab_size

    # Decode reads K/V through pool blocks of the engine's size, as the engine's steps do: P.V
    # sums block by block, so "alone" equals "batched" only through the same blocks.
    cache = PagedSequenceCache(model.config.num_layers, KV_BLOCK_SIZE)
    h = model.net(mx.array([ids]), cache, layer_by_layer(cache, len(ids), device.prefill_by_layer()))
    cache.advance(len(ids))
    seen = mx.zeros((1, vocab), dtype=mx.bool_)
    seen[0, mx.array(ids)] = True
    counts = mx.zeros((1, vocab), dtype=mx.float32)
    bias = mx.zeros((1, vocab), dtype=mx.float32)
    if c["logit_bias"]:
        bias[0, mx.array(list(c["logit_bias"]))] = mx.array(list(c["logit_bias"].values()), dtype=mx.float32)
    row = lambda v, dt=mx.float32: mx.array([v], dtype=dt)  # noqa: E731
    penalized = params.repetition_penalty != 1.0
    p = dict(temperature=row(params.temperature), top_k=row(params.top_k, mx.int32), top_p=row(params.top_p),
             min_p=row(params.min_p), seeds=row(seed, mx.uint32), penalty=row(params.repetition_penalty),
             bias=bias, presence=row(c["presence_penalty"]), frequency=row(c["frequency_penalty"]))
    mask = np.full((1, words(vocab)), -1, dtype=np.int32)
    detok = model.tokenizer.detokenizer(skip_special_tokens=c["skip_special_tokens"])
    out, text, reason = [], "", None
    while reason is None:
        if constraint is not None:
            constraint.fill(mask, 0)
        tok = select(model.net.head(h[:, -1, :]), steps=row(len(out), mx.uint32), seen=seen if penalized else None,
                     counts=counts, mask=mx.array(mask) if constraint is not None else None, **p)[0].item()
        out.append(tok)
        text, reason = after_token(tok, text, detok=detok, enders=enders, constraint=constraint, stops=stops,
                                   checked=0, count=len(out), max_tokens=budget)
        if reason is None:
            seen[0, tok] = True
            counts[0, tok] += 1
            h = model.net(mx.array([[tok]]), cache)
            cache.advance(1)
    text, reason = final_text(text, reason, detok=detok, stops=stops)
    return Completion(out, text, reason, prompt_tokens=len(ids), seed=seed)
