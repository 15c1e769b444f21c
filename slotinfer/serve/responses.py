"""Response bodies in OpenAI's shapes: whole completions, stream chunks, logprobs, usage."""

from __future__ import annotations

import json
import time
import uuid

from ..token_text import TokenText
from ..tools import RepeatWatch, StreamParser, ToolCall, first_repeat, parse

__all__ = ["Shaper", "TokenText", "usage", "finish_reason", "sse", "DONE"]


class Shaper:
    """Builds the bodies of one request (one id, one ``created``), completion or chat."""

    def __init__(self, chat: bool, model: str, token_text: TokenText, tool_format: str | None = None, *,
                 stop_repeats: bool = False):
        self.chat, self.model = chat, model
        self.tool_format = tool_format  # chat with tools: replies are parsed for calls in this format
        self._parsers: dict[int, StreamParser] = {}
        self._calls: dict[int, int] = {}  # tool calls streamed so far, per choice
        # a forced reply with parallel calls ends at its first call that repeats an earlier one (dropped)
        self.stop_repeats = stop_repeats
        self._watches: dict[int, RepeatWatch] = {}
        self.repeated: set[int] = set()  # choices whose reply repeated a call: the server stops their rows
        self._streamed: dict[int, list] = {}  # the calls streamed so far, per choice; None once one repeated
        self.token_text = lambda t: token_text(t)[0]
        self.token_bytes = lambda t: list(token_text(t)[1])
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # -- whole responses ----------------------------------------------------------

    def completion(self, rows, usage: dict) -> dict:
        """``rows``: (index, Completion, with_logprobs) in choice order."""
        choices = []
        for index, c, lp in rows:
            choice = {"index": index, "finish_reason": finish_reason(c.finish_reason),
                      "logprobs": self.logprobs(c.tokens, c.logprobs, c.top_logprobs) if lp else None}
            if self.chat and self.tool_format:
                content, calls = parse(c.text, self.tool_format)
                repeat = first_repeat(calls) if self.stop_repeats else None
                if repeat is not None:  # stopped at the repeat: the calls before it, nothing after
                    content, calls = None, calls[:repeat]
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = [call.openai() for call in calls]
                    if c.finish_reason != "length" or repeat is not None:  # a reply cut short says so
                        choice["finish_reason"] = "tool_calls"
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = c.text
            choices.append(choice)
        return {**self._head(False), "choices": choices, "usage": usage}

    # -- stream chunks ------------------------------------------------------------

    def chunk(self, index: int, text: str, *, first: bool = False, logprobs=None, finish: str | None = None) -> str:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason(finish) if finish else None}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": text} if first else ({"content": text} if text or
                                                                                     not finish else {})
        else:
            choice["text"] = text
        return sse({**self._head(True), "choices": [choice]})

    def text_chunks(self, index: int, text: str, logprobs=None) -> list[str]:
        """The chunks of one streamed token's text: with tools, its content (held back while it may
        start a call) then each call it completes."""
        if not self.tool_format:
            return [self.chunk(index, text, logprobs=logprobs)]
        parts = self._parser(index).feed(text)
        return [self.chunk(index, "".join(p for p in parts if isinstance(p, str)), logprobs=logprobs),
                *self._call_chunks(index, parts)]

    def watch(self, index: int, text: str) -> bool:
        """Whether choice ``index``'s reply, with ``text`` added, repeated a call (with ``stop_repeats``):
        its row is to be stopped, and nothing it writes after ``text`` is read."""
        if not self.stop_repeats or index in self.repeated:
            return index in self.repeated
        if self._watches.setdefault(index, RepeatWatch(self.tool_format)).feed(text):
            self.repeated.add(index)
        return index in self.repeated

    def end_chunks(self, index: int, reason: str) -> list[str]:
        """The last chunks of a choice: with tools, what was held back, then the finish reason."""
        out = []
        if index in self.repeated:
            reason = "tool_calls"
        if self.tool_format:
            parser = self._parser(index)
            parts = parser.finish()
            text = "".join(p for p in parts if isinstance(p, str))
            out = ([self.chunk(index, text)] if text else []) + self._call_chunks(index, parts)
            reason = "tool_calls" if parser.calls and reason != "length" else reason
        return [*out, self.chunk(index, "", finish=reason)]

    def _parser(self, index: int) -> StreamParser:
        if index not in self._parsers:
            self._parsers[index] = StreamParser(self.tool_format)
        return self._parsers[index]

    def _call_chunks(self, index: int, parts: list) -> list[str]:
        """OpenAI's tool-call deltas: the call's index, id and name, then its arguments."""
        out = []
        for call in parts:
            if isinstance(call, ToolCall):
                if self.stop_repeats:  # the first repeat and whatever follows it are dropped
                    seen = self._streamed.setdefault(index, [])
                    if seen and seen[-1] is None or first_repeat([*seen, call]) is not None:
                        seen.append(None)
                        continue
                    seen.append(call)
                k = self._calls[index] = self._calls.get(index, -1) + 1
                head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
                out += [self._delta(index, {"tool_calls": [head]}),
                        self._delta(index, {"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})]
        return out

    def _delta(self, index: int, delta: dict) -> str:
        return sse({**self._head(True), "choices": [{"index": index, "delta": delta, "logprobs": None,
                                                     "finish_reason": None}]})

    def usage_chunk(self, usage: dict) -> str:
        return sse({**self._head(True), "choices": [], "usage": usage})

    # -- logprobs -----------------------------------------------------------------

    def logprobs(self, tokens, logprobs, tops) -> dict:
        """Per-token log-probabilities in the chat (``content``) or completions format."""
        tops = tops or [None] * len(tokens)
        if self.chat:
            return {"content": [self._chat_entry(t, lp, top) for t, lp, top in zip(tokens, logprobs, tops)]}
        texts = [self.token_text(t) for t in tokens]
        offsets, at = [], 0
        for s in texts:
            offsets.append(at)
            at += len(s)
        return {"tokens": texts, "token_logprobs": list(logprobs), "text_offset": offsets,
                "top_logprobs": [{self.token_text(i): v for i, v in top} for top in tops] if tops[0] is not None
                else None}

    def _chat_entry(self, token, logprob, top) -> dict:
        return {"token": self.token_text(token), "logprob": logprob, "bytes": self.token_bytes(token),
                "top_logprobs": [{"token": self.token_text(i), "logprob": v, "bytes": self.token_bytes(i)}
                                 for i, v in (top or [])]}

    def event_logprobs(self, ev) -> dict | None:
        """The logprobs of one streamed token, in this endpoint's format (None when not asked)."""
        if ev.logprob is None:
            return None
        return self.logprobs([ev.token], [ev.logprob], [ev.top_logprobs] if ev.top_logprobs is not None else None)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens whose K/V came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str) -> str:
    """OpenAI knows "stop", "length" and "tool_calls"; a cancelled row (the server shutting down) reads as "stop"."""
    return reason if reason in ("length", "tool_calls") else "stop"


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
