"""Reasoning split out of a reply: what a thinking model writes inside ``<think>...</think>``.

A chat template that thinks (Qwen 3's) lets the model open its reply with a ``<think>`` block; some
templates open it in the generation prompt themselves, and ``enable_thinking=False`` pre-fills an
empty one.  :func:`mode` tells from the template and the rendered prompt where a reply starts, and
:class:`ReasoningSplitter` splits the reply, delta by delta, into reasoning and answer: any split of
a reply gives the same two texts as the whole.

    >>> split("<think>\\nPlan it.\\n</think>\\n\\nDone.", MAYBE)
    ('Plan it.', 'Done.')
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
INSIDE, MAYBE = "inside", "maybe"  # the prompt opened a block / the reply may open one at its start


def thinks(template: str | None) -> bool:
    """Whether a chat template knows reasoning blocks (it writes or strips ``</think>``)."""
    return bool(template) and CLOSE in template


def mode(template: str | None, prompt: str) -> str | None:
    """Where a reply to ``prompt`` starts: :data:`INSIDE` a block the prompt left open, free to open
    one (:data:`MAYBE`), or None where the template does not think (the reply is all answer)."""
    if not thinks(template):
        return None
    return INSIDE if prompt.rfind(OPEN) > prompt.rfind(CLOSE) else MAYBE


def split(text: str, start: str | None) -> tuple[str, str]:
    """(reasoning, answer) of a whole reply."""
    s = ReasoningSplitter(start)
    a, b = s.feed(text)
    c, d = s.finish()
    return a + c, b + d


class ReasoningSplitter:
    """Splits one reply into reasoning and answer as its text arrives.

    :meth:`feed` returns the (reasoning, answer) text known so far, :meth:`finish` the rest.  Text
    that may still be the start of ``<think>`` or ``</think>`` is held back until it is known; the
    reasoning is stripped of whitespace at its two ends and the answer of the blank lines after
    ``</think>``.  A reply that ends inside its block is all reasoning; one that does not open a
    block (where it may) is all answer, untouched."""

    def __init__(self, start: str | None):
        self._state = {INSIDE: "reasoning", MAYBE: "start"}.get(start, "answer")
        self._pending, self._space, self._begun = "", "", False

    @property
    def thinking(self) -> bool:
        """Whether the text so far ends inside the reasoning block."""
        return self._state == "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        thought = answer = ""
        while True:
            if self._state == "start":
                head = self._pending.lstrip()
                if not head or OPEN.startswith(head) and head != OPEN:
                    return thought, answer  # may yet open a block
                if head.startswith(OPEN):
                    self._state, self._pending = "reasoning", head[len(OPEN):]
                else:
                    self._state = "answer"
            elif self._state == "reasoning":
                k = self._pending.find(CLOSE)
                if k < 0:
                    cut = len(self._pending) - _partial_suffix(self._pending, CLOSE)
                    thought += self._reason(self._pending[:cut])
                    self._pending = self._pending[cut:]
                    return thought, answer
                thought += self._reason(self._pending[:k])
                self._state, self._pending = "after", self._pending[k + len(CLOSE):]
            elif self._state == "after":
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return thought, answer
                self._state = "answer"
            else:
                answer, self._pending = answer + self._pending, ""
                return thought, answer

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        if self._state == "reasoning":
            return self._reason(rest), ""
        if self._state == "start":
            return "", rest
        return "", rest if self._state == "answer" else ""

    def _reason(self, text: str) -> str:
        """``text`` of the reasoning, whitespace at the ends of the whole held until more follows."""
        if not self._begun:
            text = text.lstrip()
        core = text.rstrip()
        if not core:
            self._space += text
            return ""
        out, self._space, self._begun = self._space + core, text[len(core):], True
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
