"""Structured output: a request's JSON schema, regex, choice list or grammar, as token masks.

llguidance compiles the constraint against the model's own tokenizer and keeps one
matcher per request.  The host advances the matcher by each token the request
accepts and fills the request's row of a ``[rows, ceil(vocab / 32)]`` bitmask; the
decode step (and the Encoder, for the first token) sets every token outside the mask
to -inf just before it samples, so constrained and free rows share one step.

A matcher needs a row's previous token before it can give the next mask, and the
pipelined engine reads tokens one step late.  So a step that has constrained rows
first reads back the step before it (``Engine.step``): constrained rows advance every
step, and the device idles for the host's bookkeeping on those steps only.

Compiling happens at submit, on the caller's thread, bounded by
``SLOTINFER_GRAMMAR_SECONDS``: a constraint that does not compile, or not in time,
is a :class:`~slotinfer.errors.GrammarError` naming the parameter, never an
unconstrained answer.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

from . import settings
from .errors import EngineError, GrammarError
from .request import CONSTRAINTS

# Compact JSON: no free whitespace, so a model cannot spend its tokens on blank runs.
JSON_OPTIONS = {"whitespace_flexible": False}
_COMPILED = 64  # grammars kept compiled per model (a matcher is copied from one per request)
_compilers = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="slotinfer-grammar")


def words(vocab: int) -> int:
    """Width of a token bitmask row: 32 tokens a word."""
    return (vocab + 31) // 32


def allowed(mask, vocab: int):
    """``mask`` [n, words] int32 bitmask -> [n, vocab] bool, on the device."""
    bits = mx.right_shift(mask[:, :, None], mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab].astype(mx.bool_)


def apply_mask(logits, mask):
    """Logits with every token outside ``mask`` (a bitmask per row) at -inf."""
    return mx.where(allowed(mask, logits.shape[-1]), logits, -mx.inf)


def grammar_text(kind: str, value) -> str:
    """llguidance's grammar for a checked request value (``request.check``'s normal form)."""
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(value)
    raise AssertionError(kind)


class Constraint:
    """One request's matcher, advanced by each token the request accepts."""

    def __init__(self, matcher: llguidance.LLMatcher, kind: str):
        self.matcher, self.kind = matcher, kind

    def fill(self, bitmask: np.ndarray, row: int):
        """Write the tokens allowed next into ``bitmask[row]``."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)

    def advance(self, token: int) -> bool:
        """Take ``token``; True when the output is complete (nothing but an end token may follow)."""
        if not self.matcher.consume_token(token):
            raise EngineError(f"token {token} broke the request's {self.kind}: "
                              f"{self.matcher.get_error() or 'not allowed there'}")
        return self.matcher.is_stopped()

    def allows_end(self) -> bool:
        return self.matcher.is_accepting()


class Grammars:
    """A model's llguidance tokenizer (built on first use) and its recently compiled grammars."""

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self._source, self.vocab, self._eos = tokenizer, vocab, sorted(eos_ids)
        self._lock = threading.Lock()
        self._compiled: OrderedDict = OrderedDict()

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # cached_property alone lets two threads build it at once
            if "_built" not in self.__dict__:
                self._built = llguidance.LLTokenizer(self._source.backend.to_str(), n_vocab=self.vocab,
                                                     eos_token=self._eos)
            return self._built

    def constraint(self, params: dict) -> Constraint | None:
        """The constraint a checked request asks for, or None; raises GrammarError."""
        given = [k for k in CONSTRAINTS if params.get(k) is not None]
        if not given:
            return None
        kind = given[0]
        key = (kind, params[kind])
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
        if template is None:
            template = self._compile(kind, params[kind])
            with self._lock:
                self._compiled[key] = template
                while len(self._compiled) > _COMPILED:
                    self._compiled.popitem(last=False)
        return Constraint(template.deep_copy(), kind)

    def _compile(self, kind: str, value) -> llguidance.LLMatcher:
        seconds = settings.grammar_seconds()
        tokenizer = self.tokenizer
        try:
            text = grammar_text(kind, value)
        except ValueError as e:
            raise _error(kind, f"the {kind} could not be read: {e}") from None
        job = _compilers.submit(llguidance.LLMatcher, tokenizer, text, log_level=0)
        try:  # the matcher is built without the GIL; past the bound the request is refused
            matcher = job.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            raise _error(kind, f"the {kind} took longer than {seconds:g} s to compile; simplify it, or raise "
                               "SLOTINFER_GRAMMAR_SECONDS") from None
        if matcher.is_error():
            raise _error(kind, f"the {kind} is not valid: {_first_lines(matcher.get_error())}")
        return matcher


def _first_lines(text: str, limit: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _error(kind: str, message: str) -> GrammarError:
    e = GrammarError(message)
    e.param = kind
    return e
