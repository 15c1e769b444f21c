"""``Model``: a loaded decoder with its tokenizer, and the single-sequence reference path."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import device, request
from .errors import InvalidRequestError, PromptTooLongError
from .kv import KV_BLOCK_SIZE, PagedSequenceCache
from .models import ModelConfig, Transformer
from .models.transformer import layer_by_layer
from .engine.sampling import SamplingParams, adjust, penalize, sample
from .text.stops import find_stop
from .engine.structured import apply_mask, words
from .types import Completion


class Model:
    """A decoder checkpoint ready to run; get one with :func:`slotinfer.load`.

        >>> model = slotinfer.load("path/to/folder")
        >>> out = model.generate("Once upon a time", max_tokens=32)
        >>> out.text, out.finish_reason
    """

    def __init__(self, net: Transformer, config: ModelConfig, tokenizer, *, eos_ids, dtype, path: Path):
        self.net = net
        self.config = config
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.dtype = dtype
        self.path = path

    def __repr__(self):
        c = self.config
        return (f"Model({self.path.name!r}, {c.model_type}, layers={c.num_layers}, hidden={c.hidden_size}, "
                f"vocab={c.vocab_size}, dtype={self.dtype})")

    @functools.cached_property
    def grammars(self):
        """The model's structured-output compiler (:mod:`slotinfer.engine.structured`), built on first use."""
        from .engine.structured import Grammars

        return Grammars(self.tokenizer, self.config.vocab_size, self.eos_ids)

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    # -- prompts ---------------------------------------------------------------

    def encode_prompt(self, prompt, *, add_special_tokens: bool = True, what: str = "prompt") -> list[int]:
        """A string is tokenized by the model's own rules; a list of ids is used exactly as given.

        ``add_special_tokens=False`` leaves out BOS (for text that follows a prefix);
        ``what`` names the input in error messages.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"the {what} is empty; give at least one character or token id")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{what} token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        else:
            raise InvalidRequestError(f"a {what} must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError(f"the {what} is empty (it tokenizes to no tokens)")
        if len(ids) >= self.context_length:
            raise PromptTooLongError(
                f"the {what} has {len(ids)} tokens; the model's context is {self.context_length}: shorten the {what}"
            )
        return ids

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tokenize: bool = False, **extra):
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the checkpoint's own chat template."""
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **extra
        )

    def chat_prompt(self, prompt=None, messages=None):
        """The prompt of a request given as ``prompt`` or as chat ``messages`` (exactly one of them):
        messages are rendered with the model's chat template, with the generation prompt."""
        if messages is None:
            if prompt is None:
                raise InvalidRequestError("give a prompt, or messages=[{'role': 'user', 'content': ...}]")
            return prompt
        if prompt is not None:
            raise InvalidRequestError("give a prompt or messages, not both")
        return self.apply_chat_template(messages, add_generation_prompt=True)

    def chat(self, messages, **params) -> Completion:
        """:meth:`generate` for chat ``messages``, rendered with the model's own chat template.

            >>> model.chat([{"role": "user", "content": "Hi!"}], max_tokens=32).text
        """
        return self.generate(self.chat_prompt(messages=messages), **params)

    # -- batch APIs on the slot engine ------------------------------------------

    def batch_generate(self, prompts, **params) -> list:
        """Generate for every prompt on the slot engine; results (``BatchResult``) in input order.

        Takes the parameters of :meth:`generate` plus ``slots`` and ``prefill_tokens``.
        A bad prompt gets its own ``.error``; the others still complete.

            >>> for r in model.batch_generate(["Hi", "Bonjour"], max_tokens=16):
            ...     print(r.finish_reason, r.text, r.error)
        """
        from .batch import batch_generate  # above the engine, which sits above the model

        return batch_generate(self, prompts, **params)

    def classify(self, prompts, **kw) -> list:
        """Prefill-only classification: a token (and optional logits) at each prompt's last token,
        or the best of ``labels`` with normalized log-probability ``scores``.  See
        :func:`slotinfer.classify.classify` for every option.

            >>> r = model.classify(["Goal!"], labels=["sport", "news"], prefix="Topic: ")[0]
            >>> r.label, r.scores
        """
        from .classify import classify

        return classify(self, prompts, **kw)

    def embed(self, texts, *, pooling: str | None = None, normalize: bool = True, dimensions: int | None = None,
              token_budget: int | None = None):
        """Embeddings of ``texts`` (strings or lists of token ids): float32 ``[len(texts), dimensions or
        hidden]``, one prefill each, pooled at the last token (or the mean: ``pooling="mean"``; None: what
        the checkpoint's sentence-transformers files say), L2-normalized.  See :mod:`slotinfer.embed`.

            >>> v = model.embed(["a cat sat", "the dog ran"])
            >>> float(v[0] @ v[1])                    # cosine similarity
            >>> model.embed(["a cat sat"], dimensions=64).shape   # (1, 64), renormalized
        """
        from .embed import embed

        return embed(self, texts, pooling=pooling, normalize=normalize, dimensions=dimensions,
                     token_budget=token_budget)

    def score(self, prompts, *, top_logprobs: int = 0, token_budget: int | None = None) -> list:
        """Log-probs of each prompt token given the ones before it (``None`` for the first), and the
        ``top_logprobs`` most likely tokens at each position, from one batched prefill: what
        ``echo`` with ``logprobs`` returns.  See :func:`slotinfer.prefill_jobs.score`.

            >>> s = model.score(["The capital of France is Paris"])[0]
            >>> s.logprobs[-1], s.total
        """
        from .prefill_jobs import score

        return score(self, prompts, top_logprobs=top_logprobs, token_budget=token_budget)

    # -- the reference path ----------------------------------------------------

    def generate(self, prompt, **params) -> Completion:
        """Generate for one prompt, alone: the simple path the batched engine is tested against.

        ``params``: ``max_tokens`` (256), ``temperature`` (0: greedy), ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``
        and ``skip_special_tokens`` (True: the text leaves out special tokens such as
        ``<|im_end|>``); :mod:`slotinfer.request` has the table of their values and defaults.

            >>> model.generate("Hello", max_tokens=16, temperature=0.7, seed=1).text
        """
        c = request.check(params, self.config.vocab_size, names=request.GENERATE, what="Model.generate")
        ids = self.encode_prompt(prompt)
        params = SamplingParams(*(c[k] for k in request.SAMPLING))
        constraint = self.grammars.constraint(c)
        stops = c["stop"]
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        enders = c["stop_token_ids"] | (frozenset() if c["ignore_eos"] else self.eos_ids)
        budget = min(c["max_tokens"], self.context_length - len(ids))
        vocab = self.config.vocab_size

        # Decode reads K/V through pool blocks of the engine's size, as the engine's steps do: P.V
        # sums block by block, so "alone" equals "batched" only through the same blocks.
        cache = PagedSequenceCache(self.config.num_layers, KV_BLOCK_SIZE)
        h = self.net(mx.array([ids]), cache, layer_by_layer(cache, len(ids), device.prefill_by_layer()))
        cache.advance(len(ids))
        seen = mx.zeros((1, vocab), dtype=mx.bool_)
        seen[0, mx.array(ids)] = True
        counts = mx.zeros((1, vocab), dtype=mx.float32)
        bias = mx.zeros((1, vocab), dtype=mx.float32)
        if c["logit_bias"]:
            bias[0, mx.array(list(c["logit_bias"]))] = mx.array(list(c["logit_bias"].values()), dtype=mx.float32)
        row = lambda v, dt=mx.float32: mx.array([v], dtype=dt)  # noqa: E731
        p = dict(temperature=row(params.temperature), top_k=row(params.top_k, mx.int32), top_p=row(params.top_p),
                 min_p=row(params.min_p), seeds=row(seed, mx.uint32))
        mask = np.full((1, words(vocab)), -1, dtype=np.int32)
        detok = self.tokenizer.detokenizer(skip_special_tokens=c["skip_special_tokens"])
        out, text, reason = [], "", "length"
        for step in range(budget):
            logits = self.net.head(h[:, -1, :])
            if params.repetition_penalty != 1.0:
                logits = penalize(logits, seen, row(params.repetition_penalty))
            logits = adjust(logits, bias, counts, row(c["presence_penalty"]), row(c["frequency_penalty"]))
            if constraint is not None:
                constraint.fill(mask, 0)
                logits = apply_mask(logits, mx.array(mask))
            tok = sample(logits, steps=row(step, mx.uint32), **p).item()
            out.append(tok)
            if tok in enders:
                reason = "stop"
                break
            text += detok.add(tok)
            if constraint is not None and constraint.advance(tok):
                reason = "stop"
                break
            if find_stop(text, stops) is not None:
                break
            if step + 1 < budget:
                seen[0, tok] = True
                counts[0, tok] += 1
                h = self.net(mx.array([[tok]]), cache)
                cache.advance(1)
        text += detok.flush()
        cut = find_stop(text, stops)
        if cut is not None:
            text, reason = text[:cut], "stop"
        return Completion(out, text, reason, prompt_tokens=len(ids), seed=seed)
