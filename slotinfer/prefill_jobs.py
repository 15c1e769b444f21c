"""Prefill-only jobs beside the engine: prompt log-probs (scoring) and embeddings.

Both run as :func:`slotinfer.classify.classify` does: prompts are sorted by length and cut
into batches of at most ``token_budget`` padded tokens (:func:`~slotinfer.engine.encoder.plan_batches`),
each batch is one forward (:func:`~slotinfer.engine.encoder.forward` through a
:class:`~slotinfer.engine.encoder.SegmentView`), and a job is a sequence of such units run by
:meth:`PrefillJob.advance`.  Run back to back they are :func:`score` and
:func:`slotinfer.embed.embed`; an :class:`~slotinfer.Inferencer`'s worker runs one unit between
two engine steps (:meth:`~slotinfer.Inferencer.submit_score`,
:meth:`~slotinfer.Inferencer.submit_embed`), so a running stream waits at most one unit per
token.  While a unit computes, the one before it is read back.

**Prompt log-probs** (:class:`ScoreJob`): for a prompt of ids ``t_0 .. t_{n-1}``,
``logprobs[j] = log p(t_j | t_<j)`` for ``j >= 1`` (``None`` for ``t_0``, which nothing
predicts), from the full-vocabulary log-softmax at position ``j - 1`` of one forward, in
float32; with ``top_logprobs=k`` also the ``k`` most likely tokens at each position.  Rows
are right-padded and causal, so a row's real tokens never see its padding or another row:
its values are those of the prompt run alone, whatever else shares the batch (to float
rounding; tests/test_scoring.py checks it as a property).  This is what OpenAI's
``echo: true`` with ``logprobs`` returns, and what lm-evaluation-harness scores with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from .engine.encoder import SegmentView, forward, plan_batches
from .engine.sampling import logsumexp_compiled
from .errors import InvalidRequestError

__all__ = ["UnitJob", "PrefillJob", "ScoreJob", "PromptScores", "score", "MAX_TOP_LOGPROBS", "default_token_budget"]

MAX_TOP_LOGPROBS = 20
CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET = 512, 4096
_HEAD_ROWS = 256  # positions per full-vocabulary head call: bounds the [rows, vocab] logits held at once


@dataclass
class PromptScores:
    """A prompt's log-probs: ``logprobs[j] = log p(tokens[j] | tokens[:j])`` (``None`` for the first);
    ``top_logprobs[j]``: the ``k`` most likely ``(token, logprob)`` at position ``j``, best first
    (``None`` for the first, and everywhere when ``top_logprobs=0``)."""

    tokens: list[int]
    logprobs: list = field(default_factory=list)
    top_logprobs: list | None = None
    error: Exception | None = None

    @property
    def total(self) -> float:
        """Sum of the log-probs after the first token: the log-likelihood of the rest given ``tokens[0]``."""
        return float(sum(x for x in self.logprobs[1:]))


def default_token_budget() -> int:
    """Padded tokens per forward when none is given: small on CPU, large on a GPU."""
    return CPU_TOKEN_BUDGET if mx.default_device() == mx.cpu else GPU_TOKEN_BUDGET


def check_budget(token_budget) -> int:
    """``token_budget`` as given (padded tokens per forward), or the default for None."""
    if token_budget is None:
        return default_token_budget()
    if not isinstance(token_budget, int) or isinstance(token_budget, bool) or token_budget < 1:
        raise InvalidRequestError(f"token_budget must be an int >= 1 (padded tokens per forward), got {token_budget!r}")
    return token_budget


def _prompt_list(prompts, what: str) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)):
        raise InvalidRequestError(f"{what} must be a list (of strings or lists of token ids), not a single one; "
                                  f"wrap it in a list")
    if not isinstance(prompts, (list, tuple)):
        raise InvalidRequestError(f"{what} must be a list of strings or lists of token ids, got "
                                  f"{type(prompts).__name__}")
    return list(prompts)


class UnitJob:
    """A request over a list of prompts, run as units of work (each a forward of at most a token
    budget): :meth:`advance` queues one, :meth:`run` all of them back to back, and an
    :class:`~slotinfer.Inferencer`'s worker one between two engine steps.  ``results`` fills in
    input order, each result handed to ``on_result(index, result)`` as it is in.  A subclass sets
    ``_work`` (a generator yielding once a unit, None: nothing to run)."""

    def __init__(self, n: int, on_result: Callable | None):
        self.on_result = on_result
        self.results: list = [None] * n
        self._work = None

    def advance(self) -> bool:
        """Queue the next unit (and read back the one before it); True once every result is in :attr:`results`."""
        if self._work is None:
            return True
        try:
            next(self._work)
            return False
        except StopIteration:
            self._work = None
            return True

    def run(self) -> list:
        """Every unit back to back; the results in input order."""
        while not self.advance():
            pass
        return self.results

    def _give(self, i, result):
        self.results[i] = result
        if self.on_result is not None:
            self.on_result(i, result)

    @staticmethod
    def _plan(rows: dict, budget: int) -> list[list]:
        """The keys of ``rows`` (key -> its token ids) cut into batches of at most ``budget`` padded
        tokens, longest first (:func:`~slotinfer.engine.encoder.plan_batches`)."""
        keys = list(rows)
        return [[keys[j] for j in b] for b in plan_batches([len(rows[k]) for k in keys], budget)]


class PrefillJob(UnitJob):
    """A list of prompts as units of prefill work, each a batch of at most ``token_budget`` padded tokens.

    A subclass gives :meth:`_encode` (a prompt -> its ids, raising for a bad one), :meth:`_unit`
    (a batch's rows -> lazy arrays) and :meth:`_collect` (those arrays read back -> one result per
    row), and :meth:`_failed` (the result of a prompt that failed alone).  The constructor
    tokenizes every prompt on the calling thread; no forward runs before the first :meth:`advance`.
    """

    def __init__(self, model, prompts, *, token_budget=None, on_result: Callable | None = None, what="prompts"):
        self.model, self.net = model, model.net
        self.budget = check_budget(token_budget)
        prompts = _prompt_list(prompts, what)
        super().__init__(len(prompts), on_result)
        self._ids: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            try:
                self._ids[i] = self._encode(p)
            except Exception as e:  # noqa: BLE001 - a bad prompt fails alone
                self._give(i, self._failed(e))
        self._batches = self._plan(self._ids, self.budget)
        self._work = self._units() if self._ids else None

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the prompts that run (those that failed alone not counted)."""
        return sum(map(len, self._ids.values()))

    def _units(self):
        before = None
        for batch in self._batches:
            rows = [self._ids[i] for i in batch]
            out = self._unit(rows)
            mx.async_eval(list(out.values()))  # computes while the batch before it is read back
            if before is not None:
                self._finish(*before)
            before = (batch, rows, out)
            yield
        if before is not None:
            self._finish(*before)

    def _forward(self, rows):
        return forward(self.net, rows, SegmentView(self.model.config.num_layers, len(rows)), 0)

    def _finish(self, batch, rows, out):
        got = {k: np.array(v) for k, v in out.items()}
        for r, (i, ids) in enumerate(zip(batch, rows)):
            self._give(i, self._collect(got, r, ids))

    # -- what a subclass gives --------------------------------------------------------

    def _encode(self, prompt) -> list[int]:
        return self.model.encode_prompt(prompt)

    def _unit(self, rows: list[list[int]]) -> dict:
        raise NotImplementedError

    def _collect(self, got: dict, row: int, ids: list[int]):
        raise NotImplementedError

    def _failed(self, error: Exception):
        raise NotImplementedError


class ScoreJob(PrefillJob):
    """Prompt log-probs of every prompt (see the module docstring); results are :class:`PromptScores`."""

    def __init__(self, model, prompts, *, top_logprobs: int = 0, token_budget=None, on_result=None):
        if (not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool)
                or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
        self.k = top_logprobs
        super().__init__(model, prompts, token_budget=token_budget, on_result=on_result)

    def _failed(self, error):
        return PromptScores(tokens=[], error=error)

    def _unit(self, rows):
        h = self._forward(rows)  # [B, width, hidden]
        width = h.shape[1]
        flat, target = [], []
        for r, ids in enumerate(rows):
            flat.extend(r * width + j for j in range(len(ids) - 1))
            target.extend(ids[1:])
        if not flat:  # one-token prompts only: nothing to predict
            return {"none": mx.zeros((0,))}
        hs = h.reshape(len(rows) * width, -1)[mx.array(flat)]
        tgt = mx.array(target)
        picked, top_ids, top_lps = [], [], []
        for c in range(0, len(flat), _HEAD_ROWS):
            logits = self.net.head(hs[c:c + _HEAD_ROWS]).astype(mx.float32)
            lse = logsumexp_compiled(logits)
            picked.append(mx.take_along_axis(logits, tgt[c:c + _HEAD_ROWS, None], axis=-1)[:, 0] - lse[:, 0])
            if self.k:
                best = mx.argpartition(-logits, self.k - 1, axis=-1)[:, :self.k]
                top_ids.append(best)
                top_lps.append(mx.take_along_axis(logits, best, axis=-1) - lse)
        out = {"logprobs": mx.concatenate(picked)}
        if self.k:
            out["top_ids"] = mx.concatenate(top_ids).astype(mx.int32)
            out["top_lps"] = mx.concatenate(top_lps)
        return out

    def _collect(self, got, row, ids):
        # rows are concatenated in order: this row's positions start after the earlier rows' own
        start = self._offsets(row)
        n = len(ids) - 1
        if not n:
            return PromptScores(tokens=list(ids), logprobs=[None], top_logprobs=[None] if self.k else None)
        lps = [None] + [float(x) for x in got["logprobs"][start:start + n]]
        tops = None
        if self.k:
            tops = [None]
            for ti, tl in zip(got["top_ids"][start:start + n], got["top_lps"][start:start + n]):
                order = np.argsort(-tl, kind="stable")
                tops.append([(int(ti[o]), float(tl[o])) for o in order])
        return PromptScores(tokens=list(ids), logprobs=lps, top_logprobs=tops)

    def _finish(self, batch, rows, out):
        self._starts = np.concatenate([[0], np.cumsum([len(r) - 1 for r in rows])])
        super()._finish(batch, rows, out)

    def _offsets(self, row: int) -> int:
        return int(self._starts[row])


def score(model, prompts, *, top_logprobs: int = 0, token_budget: int | None = None,
          on_result: Callable | None = None) -> list[PromptScores]:
    """Log-probs of every prompt token given the ones before it, from one batched prefill; results
    (:class:`PromptScores`) in input order.

        >>> s = score(model, ["The capital of France is Paris"], top_logprobs=2)[0]
        >>> s.tokens, s.logprobs[:3], s.top_logprobs[1]   # logprobs[0] is None
        >>> s.total                                        # log p(tokens[1:] | tokens[0])

    ``prompts``: strings (tokenized as :meth:`Model.encode_prompt` does, BOS as the tokenizer says)
    or lists of token ids, used as given.  A bad prompt (empty, too long, ids outside the vocabulary)
    gets its own ``.error``; the others complete.
    """
    return ScoreJob(model, prompts, top_logprobs=top_logprobs, token_budget=token_budget, on_result=on_result).run()
