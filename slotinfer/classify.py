"""Classification: prefill only, scored at each prompt's last real token.

``classify(model, prompts, ...)`` runs every prompt through the decoder once and
returns, per prompt, the next token (greedy or sampled), optionally the full-vocab
logits at its last real token, and optionally a distribution over a label set.
Where the time goes, and what is done about it:

* **Batching by a token budget.** Prompts are sorted by length (longest first) and
  cut into batches whose *padded* size (rows x longest row) stays within
  ``token_budget``; short prompts travel many to a batch, long ones few.  Sorting
  keeps the padding small; right padding plus a causal mask means a real token never
  sees a pad.  A prompt longer than the budget runs alone.
* **The LM head only where it is needed.** Hidden states of the last real token of
  each row are gathered first; the head (the largest matmul of a short prompt) is
  applied to those rows only, never to ``[N, L, vocab]``; and with a label set of
  single-token labels, only the label rows of the head are computed.
* **A shared prefix is encoded once.** ``prefix`` (an instruction) runs through the
  model once into a K/V cache; every batch attends to that K/V (broadcast over its
  rows) plus its own tokens, with rope positions starting after the prefix.

Semantics (chosen so that every path computes the same numbers):

* **Prompt ids.**  Without ``prefix``, a prompt is tokenized as
  :meth:`Model.encode_prompt` does (BOS added as the tokenizer says); a list of ids
  is used as given.  With ``prefix``, the ids are ``prefix_ids + sentence_ids``:
  the prefix text is tokenized *with* special tokens (so the BOS, if the model uses
  one, comes once, in front of the prefix) and each sentence *without* them; a
  prefix or sentence given as a list of ids is used as given.  This is not always
  the tokenization of the concatenated string (a tokenizer may merge across the
  boundary), but it is what sharing the prefix's K/V computes, and
  ``share_prefix=False`` (recompute the prefix in every row) uses exactly the same
  ids, so the two agree to float tolerance.
* **Labels.**  A label is scored as the text that *follows* the prompt: its ids
  are ``tokenizer.encode(label_prefix + label, add_special_tokens=False)``.  No
  space is added by default (``label_prefix=""``); with a prompt ending in
  ``"Answer:"``, pass ``label_prefix=" "`` to score the usual ``" yes"`` tokens.
  The score of a label is its exact sequence log-probability
  ``sum_j log p(t_j | prompt, t_<j)``, normalized over the label set
  (log-softmax over the labels' sequence log-probs); ``.scores`` maps each label
  to that value, ``.label`` is the chosen label, ``.token`` its first token id.
* **What exactness costs.**  The full-vocab normalizer at the prompt's last
  position is the same for every label, so it cancels in the normalization: a set
  of single-token labels needs only the label rows of the head at one position.
  A multi-token label's later tokens are predicted from label-specific contexts
  whose normalizers do not cancel: for those, the label tokens are run after the
  prompt (a second, short forward attending to the prompt's K/V) and the full
  head is applied at each of those positions (only there).
* **Choosing.**  Without labels, ``.token`` is the argmax of the logits
  (``temperature=0``) or a seeded draw with the usual ``top_k``/``top_p``/
  ``min_p`` filters (:func:`slotinfer.engine.sampling.sample`); prompt ``i`` draws with
  seed ``seed + i``, exactly as ``model.generate(ids_i, seed=seed + i,
  max_tokens=1)`` would.  With labels the choice is restricted to the label set:
  the same rule applied to the ``[labels]`` scores.

Per-prompt problems (empty, too long for the context, ids outside the vocabulary)
come back as ``ClassifyResult.error``; the other prompts still complete.  Problems
of the whole request (bad labels, bad sampling parameters, a bad prefix) raise
:class:`~slotinfer.errors.InvalidRequestError`.

Why one module: scoring a label set (one- and multi-token labels) and batching over the shared
prefix are one algorithm.
"""

from __future__ import annotations

import random
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from . import request
from .engine.encoder import FAR, SegmentView, SharedPrefix, forward, last_hidden, plan_batches
from .errors import InvalidRequestError, PromptTooLongError
from .prefill_jobs import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, UnitJob, check_budget, default_token_budget  # noqa: F401
from .engine.sampling import SamplingParams, logsumexp_compiled, sample
from .types import ClassifyResult

__all__ = ["classify", "ClassifyJob", "default_token_budget", "encode_labels", "LabelSet"]

# Padded tokens per forward.  On CPU, bigger batches are no faster (docs/classify.md: budgets
# 256, 512 and 1024 within 3%) and hold more memory; a GPU wants many more rows to fill it.
_HEAD_CHUNK = 64  # rows per full-vocab head call when scoring multi-token labels


# -- labels -------------------------------------------------------------------------

@dataclass(frozen=True)
class LabelSet:
    """Labels with their token ids; ``first`` are the distinct first tokens."""

    names: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]

    @property
    def first(self) -> list[int]:
        return sorted({t[0] for t in self.ids})

    @property
    def multi(self) -> list[int]:
        """Indices of the labels with two tokens or more."""
        return [i for i, t in enumerate(self.ids) if len(t) > 1]

    @property
    def longest(self) -> int:
        return max(len(t) for t in self.ids)


def encode_labels(model, labels, label_prefix: str = "") -> LabelSet:
    """Validate and tokenize a label set (see the module docstring for the rules)."""
    if isinstance(labels, str) or not isinstance(labels, Sequence) or not len(labels):
        raise InvalidRequestError("labels must be a non-empty list of strings, e.g. labels=['positive', 'negative']")
    if not isinstance(label_prefix, str):
        raise InvalidRequestError(f"label_prefix must be a str, got {type(label_prefix).__name__}")
    names, ids, seen, by_ids = [], [], set(), {}
    for label in labels:
        if not isinstance(label, str):
            raise InvalidRequestError(f"every label must be a str, got {label!r} ({type(label).__name__})")
        if label in seen:
            raise InvalidRequestError(f"duplicate label {label!r}: each label may appear once")
        seen.add(label)
        toks = tuple(model.tokenizer.encode(label_prefix + label, add_special_tokens=False))
        if not toks:
            raise InvalidRequestError(
                f"label {label!r} tokenizes to no tokens (with label_prefix {label_prefix!r}); give it visible text")
        bad = [t for t in toks if not 0 <= t < model.config.vocab_size]
        if bad:
            raise InvalidRequestError(f"label {label!r} tokenizes to ids {bad} outside the model's vocabulary")
        if toks in by_ids:
            raise InvalidRequestError(
                f"labels {by_ids[toks]!r} and {label!r} tokenize to the same ids {list(toks)}; they cannot be told apart")
        by_ids[toks] = label
        names.append(label)
        ids.append(toks)
    return LabelSet(tuple(names), tuple(ids))


# -- the run --------------------------------------------------------------------------

def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _encode_prefix(model, prefix) -> list[int]:
    if isinstance(prefix, str) and not prefix:
        raise InvalidRequestError("prefix is empty; pass prefix=None for no prefix")
    return model.encode_prompt(prefix, what="prefix")


def _encode_sentence(model, prompt, prefixed: bool) -> list[int]:
    # Behind a prefix the sentence carries no BOS: the prefix has it, once.
    return model.encode_prompt(prompt, add_special_tokens=not prefixed)


# The shared prefixes of recent classify calls, per model: an instruction that every call of an
# offline job (or every /v1/classify request) repeats is computed once, not once per call.
_PREFIXES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PREFIXES_LOCK = threading.Lock()
PREFIXES_KEPT = 8  # prefixes kept per model, least recently used dropped first
PREFIX_BYTES_KEPT = 256 << 20  # and at most this many bytes of their K/V


def _shared_prefix(model, ids: list[int]) -> SharedPrefix:
    key = tuple(ids)
    with _PREFIXES_LOCK:
        kept = _PREFIXES.setdefault(model, OrderedDict())
        if key in kept:
            kept.move_to_end(key)
            return kept[key]
    prefix = SharedPrefix(model.net, ids, 0)
    with _PREFIXES_LOCK:
        kept[key] = prefix
        while len(kept) > PREFIXES_KEPT or sum(p.nbytes for p in kept.values()) > PREFIX_BYTES_KEPT:
            kept.popitem(last=False)
            if not kept:
                break
    return prefix


def _row(values, dtype=mx.float32):
    return mx.array(values, dtype=dtype)


class _Classifier:
    def __init__(self, model, *, labels: LabelSet | None, return_logits: bool, params: SamplingParams,
                 budget: int, base_seed: int, prefix_ids: list[int], share: bool):
        self.model, self.net = model, model.net
        self.budget = budget  # label tokens per continuation forward, as prompt tokens per batch
        self.layers = model.config.num_layers
        self.labels = labels
        self.return_logits = return_logits
        self.params = params
        self.base_seed = base_seed
        self.prefix_ids = prefix_ids
        # Batches are queued whole (no eval per layer): the next batch's graph is built while this
        # one computes (async_eval in classify), which an eval per layer would stop, ~3% of
        # throughput on the 2-core CPU (docs/classify.md); the token budget bounds the memory.
        self.by_layer = 0
        self.prefix = _shared_prefix(model, prefix_ids) if share and prefix_ids else None
        self.P = len(self.prefix) if self.prefix is not None else 0
        if labels is not None:
            self.first = labels.first
            col = {t: j for j, t in enumerate(self.first)}
            self.first_col = mx.array([col[t[0]] for t in labels.ids])
            self.first_ids = mx.array(self.first)

    # one batch -> its units of work, then its lazy outputs
    def units(self, rows: list[list[int]], indices: list[int]):
        """Yield the lazy arrays of each unit of this batch's work, in order (the prompts' forward,
        then its label continuations ``budget`` tokens at a time); return the batch's lazy outputs."""
        B = len(rows)
        lens = np.array([len(r) for r in rows])
        multi = self.labels.multi if self.labels is not None else []
        past = [self.prefix.segment()] if self.prefix is not None else []
        ctx = SegmentView(self.layers, B, offset=self.P, past=past, keep=bool(multi))
        h = forward(self.net, rows, ctx, self.by_layer)
        last = last_hidden(h, lens)  # [B, hidden]: the only positions the head sees
        out = {}
        full = None
        if self.return_logits or self.labels is None:
            full = self.net.head(last).astype(mx.float32)  # [B, vocab]
            if self.return_logits:
                out["logits"] = full
        seeds = _row([(self.base_seed + i) % 2**32 for i in indices], mx.uint32)
        if self.labels is None:
            out["token"] = self._choose(full, seeds)
            return out
        if full is not None:
            z0 = full[:, self.first_ids]
        else:
            z0 = self.net.head_rows(last, self.first_ids).astype(mx.float32)  # [B, distinct first tokens]
        seq = z0[:, self.first_col]  # [B, labels]: log p(t_0) up to the shared normalizer
        if multi:
            yield [seq, *(a for kv in ctx.kept for a in kv)]
            for part in self._continuations(ctx.kept, lens, multi):
                seq = seq + part  # a (row, label) gets its sum from one part, zeros from the others
                yield [seq]
        scores = seq - mx.logsumexp(seq, axis=-1, keepdims=True)
        choice = self._choose(scores, seeds)
        out["scores"] = scores
        out["choice"] = choice
        return out

    def _continuations(self, kept, lens: np.ndarray, multi: list[int]):
        """[B, labels] sums of log p(t_j | prompt, t_<j) over j >= 1 (zero for one-token labels), in
        parts of at most ``budget`` padded label tokens: (prompt, label) pairs, longest continuation
        first, are cut in slices as prompts are cut in batches (so a slice pads little), each one
        forward and its share of the sums."""
        labels, net = self.labels, self.net
        B, Lp = len(lens), kept[0][0].shape[2]
        nl = len(labels.ids)
        bidx_all = np.tile(np.arange(B), len(multi))  # pair r continues prompt bidx[r]
        lab_all = np.repeat(np.array(multi), B)  # ... with label lab[r]
        for part in plan_batches([len(labels.ids[k]) - 1 for k in lab_all], self.budget):
            bidx, lab = bidx_all[part], lab_all[part]
            n = len(bidx)
            own = np.arange(Lp)[None] + self.P
            own = np.where(np.arange(Lp)[None] < lens[bidx][:, None], own, FAR)  # hide the prompt's padding
            past_pos = own if not self.P else np.concatenate([np.broadcast_to(np.arange(self.P), (n, self.P)), own], 1)
            past = ([self.prefix.segment()] if self.prefix is not None else []) + [(kept, mx.array(bidx))]
            ctx = SegmentView(self.layers, n, offset=mx.array(self.P + lens[bidx]), past=past,
                               past_pos=mx.array(past_pos))
            conts = [list(labels.ids[lab[r]][:-1]) for r in range(n)]
            width = max(map(len, conts))
            h = forward(net, conts, ctx, self.by_layer)  # [n, width, hidden]
            flat, target, owner = [], [], []
            for r in range(n):
                ids = labels.ids[lab[r]]
                for j in range(len(ids) - 1):
                    flat.append(r * width + j)
                    target.append(ids[j + 1])
                    owner.append(int(bidx[r] * nl + lab[r]))
            hs = h.reshape(n * width, -1)[mx.array(flat)]
            tgt = mx.array(target)
            lps = []
            for c in range(0, len(flat), _HEAD_CHUNK):  # the full head, only at label positions, in chunks
                logits = net.head(hs[c:c + _HEAD_CHUNK]).astype(mx.float32)
                picked = mx.take_along_axis(logits, tgt[c:c + _HEAD_CHUNK, None], axis=-1)[:, 0]
                lps.append(picked - logsumexp_compiled(logits)[:, 0])
            total = mx.zeros((B * nl,), dtype=mx.float32).at[mx.array(owner)].add(mx.concatenate(lps))
            yield total.reshape(B, nl)

    def _choose(self, logits, seeds):
        p = self.params
        if p.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        n = logits.shape[0]
        return sample(logits, _row([p.temperature] * n), _row([p.top_k] * n, mx.int32), _row([p.top_p] * n),
                      _row([p.min_p] * n), seeds, mx.zeros((n,), dtype=mx.uint32),
                      use_sort=p.top_k > 0 or p.top_p < 1)

    def collect(self, out: dict, indices: list[int], lengths: list[int]) -> list[ClassifyResult]:
        got = {k: np.array(v) for k, v in out.items()}
        results = []
        for row, i in enumerate(indices):
            r = ClassifyResult(token=None, prompt_tokens=lengths[row])
            if "logits" in got:
                r.logits = got["logits"][row].astype(np.float32, copy=True)
            if self.labels is None:
                r.token = int(got["token"][row])
            else:
                c = int(got["choice"][row])
                r.label = self.labels.names[c]
                r.token = self.labels.ids[c][0]
                r.scores = {name: float(s) for name, s in zip(self.labels.names, got["scores"][row])}
            results.append(r)
        return results


def classify(model, prompts, *, return_logits: bool = False, labels=None, label_prefix: str = "",
             prefix=None, share_prefix: bool = True, token_budget: int | None = None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int | None = None,
             on_result: Callable[[int, ClassifyResult], None] | None = None) -> list[ClassifyResult]:
    """Classify every prompt with one prefill pass; results (:class:`ClassifyResult`) in input order.

        >>> rs = classify(model, ["great film", "dull film"], prefix="Review: ", labels=["good", "bad"],
        ...               label_prefix=" ")
        >>> rs[0].label, rs[0].scores
        >>> classify(model, ["2 + 2 ="], return_logits=True)[0].logits.shape   # (vocab,)

    ``prompts``: strings or lists of token ids.  ``prefix``: text (or ids) put in front
    of every prompt and encoded once (``share_prefix=False`` recomputes it per row, for
    checking).  ``labels``: restrict the answer to these continuations and score them
    exactly (``label_prefix`` is prepended to each label's text before tokenizing).
    ``token_budget``: padded tokens per forward (None: :func:`default_token_budget`).  ``on_result(index, result)`` is called
    as each prompt finishes (batches finish longest prompts first), e.g. to stream
    results to a file.  See the module docstring for the exact semantics.

    Interrupted (``KeyboardInterrupt``), it first hands ``on_result`` the batches whose work is
    already queued whole, so that a resumed job repeats as little as possible.
    """
    job = ClassifyJob(model, prompts, return_logits=return_logits, labels=labels, label_prefix=label_prefix,
                      prefix=prefix, share_prefix=share_prefix, token_budget=token_budget, temperature=temperature,
                      top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, on_result=on_result)
    try:
        while not job.advance():
            pass
    except KeyboardInterrupt:
        job.finish_queued()
        raise
    return job.results


class ClassifyJob(UnitJob):
    """One :func:`classify` call as units of work, each at most ``token_budget`` padded tokens (a batch
    of prompts, or a share of a batch's multi-token label continuations), run by :meth:`advance`.

    :func:`classify` runs the units back to back; an :class:`~slotinfer.Inferencer`'s worker runs
    one between two engine steps, so a classification shares the engine's thread and budget with
    decoding.  Both run the same units, so their results are the same.  The constructor checks the
    request and tokenizes every prompt (raising :class:`InvalidRequestError` for the whole request's
    problems); no forward runs before the first :meth:`advance`.
    """

    def __init__(self, model, prompts, *, return_logits: bool = False, labels=None, label_prefix: str = "",
                 prefix=None, share_prefix: bool = True, token_budget: int | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None, on_result: Callable[[int, ClassifyResult], None] | None = None):
        p = request.check(dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed),
                          model.config.vocab_size, names=request.SAMPLING, what="classify")
        params = SamplingParams(*(p[k] for k in request.SAMPLING))
        token_budget = check_budget(token_budget)
        if isinstance(prompts, str) or _is_ids(prompts) and prompts:
            raise InvalidRequestError("prompts must be a list of prompts (strings or lists of token ids), "
                                      "not a single prompt; wrap it in a list")
        prompts = list(prompts)
        label_set = encode_labels(model, labels, label_prefix) if labels is not None else None
        prefix_ids = _encode_prefix(model, prefix) if prefix is not None else []
        share = bool(share_prefix) and bool(prefix_ids)
        extra = label_set.longest - 1 if label_set is not None else 0
        super().__init__(len(prompts), on_result)
        own: dict[int, list[int]] = {}  # the tokens each row runs (after the shared prefix when sharing)
        for i, p in enumerate(prompts):
            try:
                ids = _encode_sentence(model, p, prefixed=prefix is not None)
                total = len(prefix_ids) + len(ids)
                if total + extra >= model.context_length:
                    what = f"{len(prefix_ids)} prefix + {len(ids)} prompt tokens" if prefix_ids else f"{len(ids)} tokens"
                    more = f" plus {extra} label tokens" if extra else ""
                    raise PromptTooLongError(
                        f"the prompt has {what}{more}; the model's context is {model.context_length}: shorten it")
                own[i] = ids if share else prefix_ids + ids
            except Exception as e:  # noqa: BLE001 - a bad prompt fails alone
                self._give(i, ClassifyResult(token=None, error=e))
        self._own, self._lengths = own, {i: len(prefix_ids) + len(ids) if share else len(ids) for i, ids in own.items()}
        self._batches = self._plan(own, token_budget)
        self._ready: list[tuple[list[int], dict]] = []  # batches whose every unit is queued, in order
        self._new_runner = lambda: _Classifier(
            model, labels=label_set, return_logits=return_logits, params=params, budget=token_budget,
            base_seed=params.seed if params.seed is not None else random.getrandbits(32), prefix_ids=prefix_ids,
            share=share)
        self._work = self._units() if own else None

    def finish_queued(self):
        """Wait for the batches whose work is queued whole and hand their results on (interrupted, say)."""
        while self._ready:
            self._finish(*self._ready[0])
            self._ready.pop(0)

    def _units(self):
        self._runner = runner = self._new_runner()  # the shared prefix is computed here, in the first unit
        before = None  # the arrays of the unit queued last
        for batch in self._batches:
            work, out = runner.units([self._own[i] for i in batch], batch), None
            while out is None:
                try:
                    arrays = next(work)
                except StopIteration as stop:
                    out = stop.value
                    arrays = list(out.values())
                mx.async_eval(arrays)  # computes while the one before it is read back (or a decode step runs)
                earlier = len(self._ready)
                if out is not None:  # queued whole: interrupted, it is finished before the interrupt goes on
                    self._ready.append((batch, out))
                for _ in range(earlier):
                    self._finish(*self._ready[0])
                    self._ready.pop(0)
                if not earlier and before is not None:
                    mx.eval(before)
                before = arrays
                yield
        self.finish_queued()

    def _finish(self, batch: list[int], out: dict):
        lengths = [self._lengths[i] for i in batch]
        for i, r in zip(batch, self._runner.collect(out, batch, lengths)):
            if self.results[i] is None:  # interrupted, a batch is finished again: each result is given once
                self._give(i, r)

