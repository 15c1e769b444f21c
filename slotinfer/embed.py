"""Embeddings from a decoder: the final hidden state pooled over each text, L2-normalized.

    >>> vecs = model.embed(["a cat sat", "the dog ran"])          # np.ndarray [2, hidden], unit rows
    >>> vecs @ vecs.T                                            # cosine similarities
    >>> model.embed(["a cat sat"], pooling="mean", dimensions=256)

A text runs through the decoder once (prefill only, no head): right-padded batches of at most
``token_budget`` padded tokens, causal, exactly as :mod:`slotinfer.prefill_jobs` runs them, so an
:class:`~slotinfer.Inferencer` runs them a unit at a time between engine steps
(:meth:`~slotinfer.Inferencer.embed`).  The vector of a text is, in float32:

* ``pooling="last"``: the final hidden state (after the final norm) at its last token, as
  Qwen3-Embedding and other decoder embedding models are trained;
* ``pooling="mean"``: the mean of the final hidden states over its tokens;

then, with ``dimensions=d``, its first ``d`` values (Matryoshka truncation), then divided by its
L2 norm (``normalize=True``, the default).

**Which pooling.**  ``pooling=None`` (the default) reads what the checkpoint folder says in
sentence-transformers' layout, as Qwen3-Embedding publishes it: ``modules.json`` names a
``Pooling`` module whose ``config.json`` sets ``pooling_mode`` (``"lasttoken"``, ``"mean"``) or the
older ``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens`` flags.  A folder without them
(a GGUF file, a plain decoder) pools the last token.  Texts are tokenized as the tokenizer says
(:meth:`Model.encode_prompt`): Qwen3-Embedding's ``tokenizer.json`` appends ``<|endoftext|>``,
whose state is then the last one; a query instruction is part of the text you pass.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import InvalidRequestError
from .prefill_jobs import PrefillJob

__all__ = ["embed", "EmbedJob", "EmbedResult", "pooling_of", "POOLINGS", "to_base64"]

POOLINGS = ("last", "mean")
_ST_MODES = {"lasttoken": "last", "mean": "mean", "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


class EmbedResult:
    """One text's embedding (``vector``: float32 [dimensions]) or its ``error``; ``prompt_tokens`` it ran."""

    __slots__ = ("vector", "prompt_tokens", "error")

    def __init__(self, vector=None, prompt_tokens: int = 0, error: Exception | None = None):
        self.vector, self.prompt_tokens, self.error = vector, prompt_tokens, error

    def __repr__(self):
        what = f"error={self.error!r}" if self.error is not None else f"dims={len(self.vector)}"
        return f"EmbedResult({what}, prompt_tokens={self.prompt_tokens})"


def pooling_of(model) -> str:
    """The pooling a checkpoint folder declares in sentence-transformers' files ("last" or "mean");
    "last" where it declares none."""
    folder = Path(model.path)
    if not folder.is_dir():
        return "last"
    try:
        modules = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return "last"
    for m in modules if isinstance(modules, list) else []:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
            try:
                cfg = json.loads((folder / str(m.get("path", "")) / "config.json").read_text())
            except (OSError, ValueError):
                return "last"
            mode = cfg.get("pooling_mode")
            if isinstance(mode, list) and len(mode) == 1:
                mode = mode[0]
            if isinstance(mode, str) and mode in _ST_MODES:
                return _ST_MODES[mode]
            for key in ("pooling_mode_lasttoken", "pooling_mode_mean_tokens"):
                if cfg.get(key) is True:
                    return _ST_MODES[key]
    return "last"


def _check(model, pooling, normalize, dimensions) -> tuple[str, bool, int | None]:
    if pooling is None:
        pooling = pooling_of(model)
    if pooling not in POOLINGS:
        raise InvalidRequestError(f"pooling must be one of {', '.join(map(repr, POOLINGS))} (or None: the "
                                  f"checkpoint's own), got {pooling!r}")
    if not isinstance(normalize, bool):
        raise InvalidRequestError(f"normalize must be True or False, got {normalize!r}")
    hidden = model.config.hidden_size
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                   or not 1 <= dimensions <= hidden):
        raise InvalidRequestError(f"dimensions must be an int in [1, {hidden}] (this model's hidden size), "
                                  f"got {dimensions!r}")
    return pooling, normalize, dimensions


class EmbedJob(PrefillJob):
    """The embeddings of every text as units of prefill work; results are :class:`EmbedResult`."""

    def __init__(self, model, texts, *, pooling: str | None = None, normalize: bool = True,
                 dimensions: int | None = None, token_budget=None, on_result=None):
        self.pooling, self.normalize, self.dimensions = _check(model, pooling, normalize, dimensions)
        super().__init__(model, texts, token_budget=token_budget, on_result=on_result, what="texts")

    def _failed(self, error):
        return EmbedResult(error=error)

    def _unit(self, rows):
        h = self._forward(rows).astype(mx.float32)  # [B, width, hidden]
        lens = mx.array([len(r) for r in rows])
        if self.pooling == "last":
            v = h[mx.arange(len(rows)), lens - 1]
        else:
            real = (mx.arange(h.shape[1])[None] < lens[:, None]).astype(mx.float32)
            v = (h * real[..., None]).sum(axis=1) / lens[:, None].astype(mx.float32)
        if self.dimensions is not None:
            v = v[:, :self.dimensions]
        if self.normalize:
            v = v / mx.maximum(mx.linalg.norm(v, axis=-1, keepdims=True), 1e-12)
        return {"vectors": v}

    def _collect(self, got, row, ids):
        return EmbedResult(vector=got["vectors"][row].astype(np.float32, copy=True), prompt_tokens=len(ids))


def embed(model, texts, *, pooling: str | None = None, normalize: bool = True, dimensions: int | None = None,
          token_budget: int | None = None) -> np.ndarray:
    """The embedding of each text: float32 ``[len(texts), dimensions or hidden]``, rows in input order.

        >>> v = embed(model, ["a cat sat", "the dog ran"])
        >>> float(v[0] @ v[1])                                  # cosine similarity (unit rows)

    ``texts``: strings or lists of token ids.  ``pooling``: "last", "mean", or None (the
    checkpoint's own, see the module docstring).  ``dimensions``: keep the first ``d`` values,
    then normalize.  Raises :class:`InvalidRequestError` naming the first text that cannot run
    (empty, longer than the context, ids outside the vocabulary).
    """
    job = EmbedJob(model, texts, pooling=pooling, normalize=normalize, dimensions=dimensions,
                   token_budget=token_budget)
    return stack(job.run(), model.config.hidden_size if dimensions is None else dimensions)


def stack(results: list[EmbedResult], width: int) -> np.ndarray:
    """The vectors of ``results`` as one array; the first failed text's error raised, naming it."""
    for i, r in enumerate(results):
        if r.error is not None:
            err = InvalidRequestError(f"texts[{i}]: {r.error}")
            err.index = i
            raise err from None
    return np.stack([r.vector for r in results]) if results else np.zeros((0, width), np.float32)


def to_base64(vector: np.ndarray) -> str:
    """OpenAI's ``encoding_format: "base64"``: the little-endian float32 bytes, base64-encoded."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
