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
``SLOTINFER_GRAMMAR_SECONDS`` and vetted first in a child process (``grammar_compile``): a
constraint that does not compile, not in time, crashes the compiler, or leaves no first token
is a :class:`~slotinfer.errors.GrammarError` naming the parameter, never an unconstrained
answer.  A matcher that fails later, mid-output, ends its request with a GrammarError too: a
reply that ends "stop" always satisfies its constraint.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import os
import threading
from collections import OrderedDict

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

from .. import json_numbers, settings
from ._grammar_worker import build_tokenizer, compile_checked
from ..errors import EngineError, GrammarError
from .grammar_compile import COMPILER, first_lines, on_big_stack
from ..request import CONSTRAINTS

# Compact JSON: no free whitespace, so a model cannot spend its tokens on blank runs.
JSON_OPTIONS = {"whitespace_flexible": False}
LIMITS: dict = {}  # llguidance.LLParserLimits settings for every matcher (its defaults where unset)
_COMPILED = 64  # grammars kept compiled per model (a matcher is copied from one per request)


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


def _lower_priority():
    """The mask thread yields the cores to the decode step's threads (Linux: per-thread niceness)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


# One thread computes every row's next mask, at a lower priority, beside the engine thread (llguidance
# releases the GIL): a row whose mask is not ready sits out a step, and the others do not wait for it.
def _new_masker():
    global _masker
    _masker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="slotinfer-mask",
                                                    initializer=_lower_priority)


_new_masker()
os.register_at_fork(after_in_child=_new_masker)  # a forked process has none of its parent's threads


class Constraint:
    """One request's matcher, advanced by each token the request accepts.

    Its next mask is computed off the engine thread as soon as the token before it is taken
    (:meth:`ready` says when it is there); a row with a costly constraint then sits out steps
    instead of slowing every row's.  A matcher that fails (llguidance then allows only the end
    token) raises a GrammarError naming the constraint, from :meth:`advance` or :meth:`end`: the
    request ends with it, never "stop".
    """

    def __init__(self, matcher: llguidance.LLMatcher, kind: str, width: int):
        self.matcher, self.kind = matcher, kind
        self.error: GrammarError | None = None
        self._mask = np.zeros((1, width), dtype=np.int32)
        self._job = _masker.submit(self._compute)

    def _compute(self):
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._mask, 0)
        if self.matcher.is_error():
            self.error = self.error or failure(self.kind, self.matcher)

    def ready(self) -> bool:
        """Whether the next mask is computed (a step may take this row)."""
        return self._job.done()

    def wait(self):
        """Block until the next mask is computed: until the next :meth:`advance`, the matcher is then
        the caller's alone (the mask thread borrows it while it computes)."""
        self._job.result()

    def fill(self, bitmask: np.ndarray, row: int):
        """Write the tokens allowed next into ``bitmask[row]`` (waiting for them if need be).  A matcher
        that failed leaves the row free (its token is never used) and fails the request at that token."""
        self.wait()
        bitmask[row] = -1 if self.error is not None else self._mask[0]

    def fill_along(self, drafts, bitmask: np.ndarray, row: int):
        """:meth:`fill` ``bitmask[row]``, then ``bitmask[row + j]`` with the tokens allowed after the
        drafts ``d_1 .. d_j`` (a speculating row's verify step masks each position with its own), the
        matcher left as it was.  The drafts were checked against the grammar when drafted."""
        self.fill(bitmask, row)
        took = 0
        try:
            for j, token in enumerate(drafts, 1):
                if not self.matcher.consume_token(int(token)):
                    raise EngineError(f"draft token {token} is not allowed by the request's {self.kind}: a bug in "
                                      f"slotinfer's drafting, please report it")
                took += 1
                llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row + j)
        finally:
            if took:
                self.matcher.rollback(took)

    def advance(self, token: int) -> bool:
        """Take ``token``; True when the output is complete (nothing but an end token may follow)."""
        self.wait()
        if self.error is not None:
            raise self.error
        if not self.matcher.consume_token(token):
            raise failure(self.kind, self.matcher, f"token {token} is not allowed there")
        if self.matcher.is_stopped():
            return True
        self._job = _masker.submit(self._compute)
        return False

    def end(self):
        """An end token came: raise unless the output is complete."""
        self.wait()
        if self.error is not None:
            raise self.error
        if not self.allows_end():
            raise failure(self.kind, self.matcher, "the output ended before it was complete")

    def allows_end(self) -> bool:
        return self.matcher.is_accepting() and not self.matcher.is_error()


def wait_for_any(constraints, seconds: float):
    """Block until one of ``constraints``' masks is ready, or ``seconds`` pass (an engine with nothing
    else to run waits here instead of spinning)."""
    concurrent.futures.wait([c._job for c in constraints], timeout=seconds,
                            return_when=concurrent.futures.FIRST_COMPLETED)


def failure(kind: str, matcher, fallback: str = "it failed") -> GrammarError:
    e = GrammarError(f"the {kind} failed mid-output, so the output cannot satisfy it: "
                     f"{first_lines(matcher.get_error(), 300) or fallback}; simplify the {kind}")
    e.param = kind
    return e


class Grammars:
    """A model's llguidance tokenizer (built on first use) and its recently compiled grammars."""

    def __init__(self, tokenizer, vocab: int, eos_ids):
        self._source, self.vocab, self._eos = tokenizer, vocab, sorted(eos_ids)
        self._lock = threading.Lock()
        self._compiled: OrderedDict = OrderedDict()

    def _tokenizer_source(self):
        return self._source.backend.to_str(), self.vocab, self._eos

    @functools.cached_property
    def _key(self) -> str:
        """Names this tokenizer in the compile children (which build it once each)."""
        text, vocab, eos = self._tokenizer_source()
        return hashlib.sha256(f"{vocab} {eos} {text}".encode()).hexdigest()

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # cached_property alone lets two threads build it at once
            if "_built" not in self.__dict__:
                self._built = build_tokenizer(llguidance, *self._tokenizer_source())
            return self._built

    def constraint(self, params: dict) -> Constraint | None:
        """The constraint a checked request asks for, or None; raises GrammarError (GrammarBusy
        when too many compile at once)."""
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
        matcher = template.deep_copy()
        if matcher.is_error():  # never expected: a template is cached only healthy, with its first mask
            raise failure(kind, matcher)
        return Constraint(matcher, kind, words(self.vocab))

    def _compile(self, kind: str, value) -> llguidance.LLMatcher:
        if kind == "json_schema":
            value = json_numbers.bounded_text(value)
        text = COMPILER.vet(self._key, self._tokenizer_source, kind, value, JSON_OPTIONS, LIMITS,
                            settings.grammar_seconds())
        tokenizer = self.tokenizer
        matcher, error = on_big_stack(compile_checked, llguidance, tokenizer, text,
                                      llguidance.LLParserLimits(**LIMITS))
        if error is not None:
            e = GrammarError(f"the {kind} is not valid: {first_lines(error)}")
            e.param = kind
            raise e
        return matcher
