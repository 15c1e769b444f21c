"""Response bodies in OpenAI's shapes: whole completions, stream chunks, logprobs, usage."""

from __future__ import annotations

import json
import time
import uuid


class Shaper:
    """Builds the bodies of one request (one id, one ``created``), completion or chat."""

    def __init__(self, chat: bool, model: str, token_text):
        self.chat, self.model, self.token_text = chat, model, token_text
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
            if self.chat:
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
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": self.token_text(i), "logprob": v,
                                  "bytes": list(self.token_text(i).encode("utf-8"))} for i, v in (top or [])]}

    def event_logprobs(self, ev) -> dict | None:
        """The logprobs of one streamed token, in this endpoint's format (None when not asked)."""
        if ev.logprob is None:
            return None
        return self.logprobs([ev.token], [ev.logprob], [ev.top_logprobs] if ev.top_logprobs is not None else None)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(reason: str) -> str:
    """OpenAI knows "stop" and "length"; a cancelled row (the server shutting down) reads as "stop"."""
    return "length" if reason == "length" else "stop"


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
