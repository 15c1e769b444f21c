"""A reply as a sequence of blocks (reasoning, text, tool calls), whole or as it streams.

The Responses and Messages APIs both shape a reply as a list of typed blocks (Responses' output
items, Anthropic's content blocks), streamed as open / delta / close events.  :class:`ReplyParts`
splits the text of one row into those parts (reasoning first, then the answer parsed for tool calls
in the model's format) and :class:`Blocks` turns the parts into events; each API supplies the shapes.
"""

from __future__ import annotations

from ..text.reasoning import ReasoningSplitter
from ..text.tools import StreamParser, ToolCall

REASONING, TEXT, CALL = "reasoning", "text", "call"


class ReplyParts:
    """One row's text, delta by delta, as ``(kind, value)`` parts: reasoning text, answer text, and
    :class:`~slotinfer.text.tools.ToolCall` s (with ``tool_format``); any split gives the same parts joined."""

    def __init__(self, tool_format: str | None, reasoning: str | None):
        self._split = ReasoningSplitter(reasoning) if reasoning else None
        self._calls = StreamParser(tool_format) if tool_format else None
        self.thought_tokens = 0  # tokens fed while inside the reasoning block

    def feed(self, text: str) -> list[tuple[str, object]]:
        if self._split is not None and self._split.thinking:
            self.thought_tokens += 1
        thought, text = self._split.feed(text) if self._split else ("", text)
        return self._parts(thought, text, self._calls.feed(text) if self._calls and text else None)

    def finish(self) -> list[tuple[str, object]]:
        thought, text = self._split.finish() if self._split else ("", "")
        if self._calls is None:
            return self._parts(thought, text, None)
        return self._parts(thought, "", (self._calls.feed(text) if text else []) + self._calls.finish())

    @staticmethod
    def _parts(thought: str, text: str, calls: list | None) -> list:
        out = [(REASONING, thought)] if thought else []
        if calls is None:
            return out + ([(TEXT, text)] if text else [])
        return out + [(CALL, p) if isinstance(p, ToolCall) else (TEXT, p) for p in calls if p]


class Blocks:
    """Parts into an API's stream of block events: a part of another kind than the open block closes
    it and opens one of its own; a tool call is a block of its own.  Subclasses shape the events
    (``_open``, ``_delta``, ``_close``, each returning a list) and read the finished blocks in
    ``self.done``: ``(kind, value)`` with the whole text, or the ToolCall."""

    def __init__(self):
        self.done: list[tuple[str, object]] = []
        self._kind, self._text = None, ""

    def events(self, parts) -> list:
        out = []
        for kind, value in parts:
            if kind != self._kind or kind == CALL:
                out += self.close_open()
                self._kind, self._text = kind, ""
                out += self._open(kind, value)
            if kind == CALL:
                self.done.append((CALL, value))
                out += self._close(CALL, value)
                self._kind = None
            else:
                self._text += value
                out += self._delta(kind, value)
        return out

    def close_open(self) -> list:
        """The events that end the open text or reasoning block, if one is open."""
        if self._kind is None:
            return []
        kind, text, self._kind = self._kind, self._text, None
        self.done.append((kind, text))
        return self._close(kind, text)

    def _open(self, kind, value) -> list:
        raise NotImplementedError

    def _delta(self, kind, text) -> list:
        raise NotImplementedError

    def _close(self, kind, value) -> list:
        raise NotImplementedError


def whole(tool_format: str | None, reasoning: str | None, text: str) -> list[tuple[str, object]]:
    """The blocks of a whole reply, adjacent parts of one kind merged."""
    p = ReplyParts(tool_format, reasoning)
    out: list[tuple[str, object]] = []
    for kind, value in p.feed(text) + p.finish():
        if out and kind == out[-1][0] and kind != CALL:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out
