"""``batch_generate``: many prompts through one Engine, results in input order.

It sits above the Engine (and the Model it is given): neither imports this module, and the
Model reaches it only when ``Model.batch_generate`` is called.
"""

from __future__ import annotations

from . import request
from .engine.engine import Engine
from .errors import InvalidRequestError
from .types import BatchResult


def batch_generate(model, prompts, *, slots: int = 32, prefill_tokens: int = 512,
                   prefix_cache_bytes: int | None = None, kv_cache_bytes: int | None = None,
                   speculative: str | None = None, draft_tokens: int = 8, **params):
    """Generate for many prompts on the slot engine; one bad prompt gets its own error.

    Prompts that start alike share the K/V of what they have in common through the engine's
    prefix cache (``prefix_cache_bytes``: its cap on cached blocks nobody holds; None: the device's default; 0: off).
    ``kv_cache_bytes`` sizes the engine's K/V pool (None: ``slots`` of the longest prompt and
    ``max_tokens``, at most a quarter of the memory); prompts wait for its blocks.
    ``speculative`` ("ngram") verifies drafts of up to ``draft_tokens`` tokens in the batched step
    (docs/speculative.md); the output is the same.
    """
    prompts = list(prompts)
    try:  # a parameter's own error comes first: every prompt ends with it
        max_tokens = request.check(params, model.config.vocab_size)["max_tokens"]
    except InvalidRequestError as e:
        return [BatchResult([], "", "error", e) for _ in prompts]
    results: list = [None] * len(prompts)
    encoded = {}
    for i, p in enumerate(prompts):
        try:
            encoded[i] = model.encode_prompt(p)
        except Exception as e:
            results[i] = BatchResult([], "", "error", e)
    if encoded:
        max_len = max(len(ids) + min(max_tokens, model.context_length - len(ids)) for ids in encoded.values())
        engine = Engine(model, slots=min(slots, len(encoded)), max_len=max(max_len, 2), prefill_tokens=prefill_tokens,
                        prefix_cache_bytes=prefix_cache_bytes, kv_cache_bytes=kv_cache_bytes,
                        speculative=speculative, draft_tokens=draft_tokens)
        handles = {}
        for i, ids in encoded.items():
            try:
                item = engine.make_item(ids, **params)
            except Exception as e:
                results[i] = BatchResult([], "", "error", e)
                continue
            engine.add(item)
            handles[i] = item.handle
        engine.run_until_done()  # a device failure ends every prompt still running with the cause
        for i, h in handles.items():
            try:
                c = h.result(0)
                results[i] = BatchResult(c.tokens, c.text, c.finish_reason)
            except Exception as e:
                results[i] = BatchResult([], "", "error", e)
    return results

