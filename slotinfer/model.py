"""``Model``: a loaded checkpoint, with the library's functions over it as methods.

A :class:`~slotinfer.checkpoint.Checkpoint` is what the engine runs; each method here is one
line over a function that takes the model: :func:`slotinfer.engine.reference.generate`,
:func:`slotinfer.batch.batch_generate`, :func:`slotinfer.classify.classify`,
:func:`slotinfer.embed.embed` and :func:`slotinfer.prefill_jobs.score`.
"""

from __future__ import annotations

import functools

from .batch import batch_generate
from .checkpoint import Checkpoint
from .classify import classify
from .embed import embed
from .engine.reference import generate
from .engine.structured import Grammars
from .prefill_jobs import score
from .types import Completion


class Model(Checkpoint):
    """A decoder checkpoint ready to run; get one with :func:`slotinfer.load`.

        >>> model = slotinfer.load("path/to/folder")
        >>> out = model.generate("Once upon a time", max_tokens=32)
        >>> out.text, out.finish_reason
    """

    @functools.cached_property
    def grammars(self):
        """The model's structured-output compiler (:mod:`slotinfer.engine.structured`), built on first use."""
        return Grammars(self.tokenizer, self.config.vocab_size, self.eos_ids)

    # -- the reference path ----------------------------------------------------

    def generate(self, prompt, **params) -> Completion:
        """Generate for one prompt, alone: the simple path the batched engine is tested against.

        ``params``: ``max_tokens`` (256), ``temperature`` (0: greedy), ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos``
        and ``skip_special_tokens`` (True: the text leaves out special tokens such as
        ``<|im_end|>``); :mod:`slotinfer.request` has the table of their values and defaults.

            >>> model.generate("Hello", max_tokens=16, temperature=0.7, seed=1).text
        """
        return generate(self, prompt, **params)

    def chat(self, messages, **params) -> Completion:
        """:meth:`generate` for chat ``messages``, rendered with the model's own chat template.

            >>> model.chat([{"role": "user", "content": "Hi!"}], max_tokens=32).text
        """
        return self.generate(self.chat_prompt(messages=messages), **params)

    # -- on the slot engine and the prefill jobs ----------------------------------

    def batch_generate(self, prompts, **params) -> list:
        """Generate for every prompt on the slot engine; results (``BatchResult``) in input order.

        Takes the parameters of :meth:`generate` plus ``slots`` and ``prefill_tokens``.
        A bad prompt gets its own ``.error``; the others still complete.

            >>> for r in model.batch_generate(["Hi", "Bonjour"], max_tokens=16):
            ...     print(r.finish_reason, r.text, r.error)
        """
        return batch_generate(self, prompts, **params)

    def classify(self, prompts, **kw) -> list:
        """Prefill-only classification: a token (and optional logits) at each prompt's last token,
        or the best of ``labels`` with normalized log-probability ``scores``.  See
        :func:`slotinfer.classify.classify` for every option.

            >>> r = model.classify(["Goal!"], labels=["sport", "news"], prefix="Topic: ")[0]
            >>> r.label, r.scores
        """
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
        return embed(self, texts, pooling=pooling, normalize=normalize, dimensions=dimensions,
                     token_budget=token_budget)

    def score(self, prompts, *, top_logprobs: int = 0, token_budget: int | None = None) -> list:
        """Log-probs of each prompt token given the ones before it (``None`` for the first), and the
        ``top_logprobs`` most likely tokens at each position, from one batched prefill: what
        ``echo`` with ``logprobs`` returns.  See :func:`slotinfer.prefill_jobs.score`.

            >>> s = model.score(["The capital of France is Paris"])[0]
            >>> s.logprobs[-1], s.total
        """
        return score(self, prompts, top_logprobs=top_logprobs, token_budget=token_budget)
