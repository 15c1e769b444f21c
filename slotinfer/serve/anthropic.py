"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) onto the chat machinery.

``system`` and the content blocks of ``messages`` become chat messages (``tool_use`` blocks an
assistant turn's ``tool_calls``, ``tool_result`` blocks ``tool`` turns, ``thinking`` blocks its
``reasoning_content``), ``tools`` with their ``input_schema`` the chat ``tools``: the same validated
:class:`~slotinfer.serve.schemas.GenerateRequest` a chat completion makes, run the same way.  The
reply comes back as content blocks (``thinking``, ``text``, ``tool_use``) with Anthropic's
``stop_reason``, whole or as its event stream, and errors in Anthropic's error shape.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..request import short
from .blocks import CALL, REASONING, Blocks, ReplyParts, whole
from .errors import APIError, bad_param
from .schemas import (GenerateRequest, _bool, _checked, _get, _library, _passed_on, _tools, check_fields,
                      extensions, template_kwargs)
from .tolerated import EXTRA

_EXTRA = tuple(f for f in EXTRA if f != "json_schema")  # the output's schema has its own field here
# Anthropic's fields that change nothing here, then the extensions the chat endpoint takes (docs/serve.md).
IGNORED = ("metadata", "service_tier", "container", "context_management", "inference_geo", "mcp_servers",
           "cache_control", "diagnostics", "speed", "user_profile_id", "workspace_id")
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_format", "output_config",
                *IGNORED, "chat_template_kwargs", "enable_thinking")
FIELDS = ("model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
          "tools", "tool_choice", "thinking", "output_format", "output_config", *IGNORED,
          "min_p", "repetition_penalty", "seed", "frequency_penalty", "presence_penalty", "ignore_eos",
          "skip_special_tokens", "stop_token_ids", "cache_salt", *_EXTRA)

# Anthropic's error types by status (docs.anthropic.com: errors)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: APIError) -> dict:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``; the message
    starts with the field at fault, as Anthropic's do (``max_tokens: ...``)."""
    message = err.message
    if err.param and not message.startswith(err.param):
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": message}}


@dataclass
class MessagesRequest(GenerateRequest):
    stops: tuple = ()  # stop_sequences, to tell which one ended the reply


def parse(body: dict, *, counting: bool = False) -> MessagesRequest:
    """A /v1/messages body (``counting``: a /v1/messages/count_tokens body, which has no max_tokens)."""
    check_fields(body, COUNT_FIELDS if counting else FIELDS,
                 "/v1/messages/count_tokens" if counting else "/v1/messages")
    if body.get("mcp_servers"):
        raise bad_param("mcp_servers", "'mcp_servers' is not supported: this server calls no tools itself; give "
                                       "them as 'tools' and run the calls in the client")
    req = MessagesRequest(chat=True, model=_get(body, "model", (str,), "a string"), prompts=[_messages(body)])
    if not counting:
        key = "max_tokens" if body.get("max_tokens") is not None or body.get("n_predict") is None else "n_predict"
        if body.get(key) is None:
            raise bad_param("max_tokens", "'max_tokens' is required: the most tokens the reply may take")
        req.max_tokens, req.max_tokens_param = _checked("max_tokens", body[key], key), key
        req.stream, req.include_usage = _bool(body, "stream"), True
        stops = _get(body, "stop_sequences", (list,), "a list of strings", [])
        if stops:
            req.params["stop"] = list(_checked("stop", stops, "stop_sequences"))
            req.stops = tuple(req.params["stop"])
        extensions(body, req.params)
        _passed_on({k: v for k, v in body.items() if k != "stop"}, req.params)
        for name in ("presence_penalty", "frequency_penalty"):
            if body.get(name) not in (None, 0, 0.0):
                req.params[name] = _library(name, body[name])
    _output_format(body, req)
    tools = _get(body, "tools", (list,), "a list of {'name', 'description', 'input_schema'} objects")
    choice = _get(body, "tool_choice", (dict,), "an object: {'type': 'auto' | 'any' | 'tool' | 'none'}")
    parallel = not (choice or {}).get("disable_parallel_tool_use", False)
    _tools({"tools": [_tool(t, i) for i, t in enumerate(tools or [])] or None, "tool_choice": _choice(choice),
            "parallel_tool_calls": parallel}, req)
    req.template_kwargs = template_kwargs(body)
    thinking = _get(body, "thinking", (dict,), "an object: {'type': 'enabled' | 'disabled', ...}")
    if thinking is not None and thinking.get("type") in ("enabled", "disabled", "adaptive"):
        req.template_kwargs.setdefault("enable_thinking", thinking["type"] != "disabled")
    return req


def _choice(choice):
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise bad_param("tool_choice", f"'tool_choice' must be {{'type': 'auto'}}, {{'type': 'any'}}, {{'type': 'none'}} "
                                   f"or {{'type': 'tool', 'name': ...}}, got {short(choice)}")


def _output_format(body, req):
    """Structured outputs: ``output_format`` (and its later home, ``output_config.format``) json_schema."""
    fmt, where = body.get("output_format"), "output_format"
    config = _get(body, "output_config", (dict,), "an object", {})
    if config.get("format") is not None:
        fmt, where = config["format"], "output_config.format"
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_param(where, f"'{where}' must be {{'type': 'json_schema', 'schema': {{...}}}}, got {short(fmt)}")
    req.params["json_schema"] = _library("json_schema", fmt["schema"], where)
    req.constrained_by = where


def _tool(t, i) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in (None, "custom"):
            raise bad_param(f"{where}.type", f"{where}: only client tools ({{'name', 'input_schema'}}) are supported "
                                             f"here, not the server tool {short(kind)}")
        raise bad_param(where, f"{where} must be {{'name': ..., 'description': ..., 'input_schema': {{...}}}}, got "
                               f"{short(t)}")
    fn = {"name": t.get("name"), "parameters": t["input_schema"]}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _messages(body) -> list[dict]:
    """``system`` and ``messages`` as chat messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got "
                                    f"{short(messages)}")
    system = body.get("system")
    out = []
    if system is not None:
        text = system if isinstance(system, str) else _texts(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad_param(f"{where}.role", f"{where} must be an object with 'role' 'user' or 'assistant' (or "
                                             f"'system', mid-conversation), got {short(m)}")
        content = m.get("content")
        if m["role"] == "system":  # a system turn mid-conversation (Claude Code sends them)
            out.append({"role": "system", "content": content if isinstance(content, str) else
                        _texts(content, f"{where}.content")})
            continue
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad_param(f"{where}.content", f"{where}.content must be a string or a list of content blocks, got "
                                                f"{short(content)}")
        out += (_assistant if m["role"] == "assistant" else _user)(content, f"{where}.content")
    return out


def _assistant(blocks, where) -> list[dict]:
    text, calls, thought = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
            calls.append({"id": str(b.get("id", f"toolu_{j}")), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}),
                                                                                  ensure_ascii=False)}})
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thought.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        else:
            raise bad_param(f"{where}[{j}]", f"{where}[{j}]: an assistant turn takes text, tool_use and thinking "
                                             f"blocks, got {short(b)}")
    m = {"role": "assistant", "content": "".join(text)}
    if calls:
        m["tool_calls"] = calls
    if thought:
        m["reasoning_content"] = "\n".join(thought)
    return [m]


def _user(blocks, where) -> list[dict]:
    """A user turn: its tool results as ``tool`` turns (first, as they answer the calls before), then its text."""
    results, text = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
            content = b.get("content", "")
            body = content if isinstance(content, str) else _texts(content, f"{where}[{j}].content")
            if b.get("is_error"):
                body = f"Error: {body}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": body})
        else:
            raise bad_param(f"{where}[{j}]", f"{where}[{j}]: a user turn takes text and tool_result blocks (no "
                                             f"images or documents here), got {short(b)}")
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _texts(blocks, where) -> str:
    if not isinstance(blocks, list):
        raise bad_param(where, f"{where} must be a string or a list of text blocks, got {short(blocks)}")
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad_param(f"{where}[{j}]", f"{where}[{j}] must be a text block ({{'type': 'text', 'text': ...}}), "
                                             f"got {short(b)}")
        out.append(b["text"])
    return "\n\n".join(out) if where == "system" else "".join(out)


class Shaper(Blocks):
    """The Message of one request: whole (:meth:`completion`) or as its event stream."""

    def __init__(self, req: MessagesRequest, model: str, tool_format: str | None, prompt_tokens: int, decode):
        super().__init__()
        self.req, self.model, self.tool_format = req, model, tool_format if req.tools else None
        self.prompt_tokens, self.decode = prompt_tokens, decode  # decode: ids -> text, to tell the stop sequence
        self.id = "msg_" + uuid.uuid4().hex
        self._parts, self._index = None, -1

    def _stop(self, c, calls: bool) -> tuple[str, str | None]:
        if c.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if self.req.stops:
            rest = self.decode(c.tokens)[len(c.text):]
            hit = next((s for s in self.req.stops if rest.startswith(s)), None)
            if hit is not None:
                return "stop_sequence", hit
        return "end_turn", None

    def _usage(self, used: dict) -> dict:
        cached = used["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": used["prompt_tokens"] - cached, "output_tokens": used["completion_tokens"],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    @staticmethod
    def _block(kind, value) -> dict:
        if kind == REASONING:
            return {"type": "thinking", "thinking": value, "signature": ""}
        if kind == CALL:
            return {"type": "tool_use", "id": "toolu_" + value.id.removeprefix("call_"), "name": value.name,
                    "input": json.loads(value.arguments)}
        return {"type": "text", "text": value}

    def _message(self, content, stop, usage) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    # -- whole -----------------------------------------------------------------------

    def completion(self, rows, used: dict) -> dict:
        [(_, c, _)] = rows
        blocks = whole(self.tool_format, self.req.reasoning, c.text)
        return self._message([self._block(k, v) for k, v in blocks],
                             self._stop(c, any(k == CALL for k, _ in blocks)), self._usage(used))

    # -- streamed ----------------------------------------------------------------------

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def opening(self, n: int) -> list[str]:
        self._parts = ReplyParts(self.tool_format, self.req.reasoning)
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}
        return [self._event("message_start", message=self._message([], (None, None), usage)), self._event("ping")]

    def event_logprobs(self, ev):
        return None

    def keepalive(self) -> list[str]:
        return [self._event("ping")]

    def text_chunks(self, index: int, text: str, logprobs=None) -> list[str]:
        return self.events(self._parts.feed(text))

    def end_chunks(self, index: int, reason: str) -> list[str]:
        return self.events(self._parts.finish()) + self.close_open()

    def closing(self, used: dict, results) -> list[str]:
        stop = self._stop(results[0], any(k == CALL for k, _ in self.done))
        return [self._event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                            usage=self._usage(used)),
                self._event("message_stop")]

    def failure(self, error) -> list[str]:
        return [self._event("error", error=error_body(error)["error"])]

    def _open(self, kind, value) -> list[str]:
        self._index += 1
        block = self._block(kind, value)
        if kind == REASONING:
            block["thinking"] = ""
        elif kind == CALL:
            block["input"] = {}
        else:
            block["text"] = ""
        return [self._event("content_block_start", index=self._index, content_block=block)]

    def _delta(self, kind, text) -> list[str]:
        delta = {"type": "thinking_delta", "thinking": text} if kind == REASONING else {"type": "text_delta",
                                                                                          "text": text}
        return [self._event("content_block_delta", index=self._index, delta=delta)]

    def _close(self, kind, value) -> list[str]:
        out = []
        if kind == CALL:
            out.append(self._event("content_block_delta", index=self._index,
                                   delta={"type": "input_json_delta", "partial_json": value.arguments}))
        elif kind == REASONING:
            out.append(self._event("content_block_delta", index=self._index,
                                   delta={"type": "signature_delta", "signature": ""}))
        return out + [self._event("content_block_stop", index=self._index)]
