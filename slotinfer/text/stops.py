"""When a row ends, and the text it ends with: one rule for the engine's rows
(:meth:`slotinfer.engine.item_processor.ItemProcessor.accept`) and the reference path (``Model.generate``).

A row ends on a token of its ``enders`` (EOS, stop token ids), when its constraint is complete, when a
stop string appears in its text, or at ``max_tokens``; its final text is flushed from the detokenizer
and cut at the earliest stop string.
"""

from __future__ import annotations


def find_stop(text: str, stops) -> int | None:
    """Index where the earliest stop string begins in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def longest(stops) -> int:
    """The longest stop string's length (0: none)."""
    return max((len(s) for s in stops), default=0)


def after_token(token: int, text: str, *, detok, enders, constraint, stops, checked: int, count: int,
                max_tokens: int) -> tuple[str, str | None]:
    """``text`` with the ``count``-th generated ``token`` appended, and why the row ends there ("stop",
    "length") or None.  A stop string is looked for from ``checked`` on (text before it was
    looked at already); an ender's text is not added."""
    if token in enders:
        if constraint is not None:
            constraint.end()  # "stop" only where the output satisfies the constraint
        return text, "stop"
    text += detok.add(token)
    if constraint is not None and constraint.advance(token):
        return text, "stop"  # the output is complete
    if stops and find_stop(text[checked:], stops) is not None:
        return text, "stop"
    if count >= max_tokens:
        return text, "length"
    return text, None


def final_text(text: str, reason: str, *, detok, stops) -> tuple[str, str]:
    """An ended row's text (the detokenizer flushed, cut at the earliest stop string) and its reason."""
    text += detok.flush()
    cut = find_stop(text, stops) if stops else None
    if cut is not None:
        return text[:cut], "stop"
    return text, reason
