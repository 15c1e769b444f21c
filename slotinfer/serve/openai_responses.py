"""OpenAI's Responses API (``POST /v1/responses``), stateless: its bodies onto the chat machinery.

A request's ``instructions`` and ``input`` items become chat messages (``function_call`` items an
assistant turn's ``tool_calls``, ``function_call_output`` items ``tool`` turns), its flat function
tools the chat ``tools``, ``text.format`` the output's JSON schema: the same validated
:class:`~slotinfer.serve.schemas.GenerateRequest` a chat completion makes, run the same way.  The
reply comes back as output items (``reasoning``, ``message``, ``function_call``), whole or as the
typed event stream the openai SDK reads.  Nothing is stored: ``previous_response_id`` is refused,
and a client resends the conversation (Codex does).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..request import short
from .blocks import CALL, REASONING, Blocks, ReplyParts, whole
from .errors import bad_param
from .schemas import (GenerateRequest, _bool, _checked, _get, _library, _passed_on, _penalties, _tools,
                      check_fields, extensions, template_kwargs)
from .tolerated import EXTRA

_EXTRA = tuple(f for f in EXTRA if f != "json_schema")  # the output's schema has its own field here
# Responses' own fields that change nothing here (stateless, text only), then the extensions the chat
# endpoint takes (docs/serve.md lists them all).
IGNORED = ("store", "include", "metadata", "client_metadata", "user", "service_tier", "truncation", "prompt_cache_key",
           "prompt_cache_retention", "safety_identifier", "max_tool_calls", "stream_options", "reasoning",
           "background", "top_logprobs", "context_management")
# Tools OpenAI's servers run themselves: there is no such server here, so they are not offered to the model.
HOSTED = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
          "file_search", "code_interpreter", "image_generation", "mcp", "tool_search")
FIELDS = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
          "max_output_tokens", "temperature", "top_p", "stream", "previous_response_id", "conversation", "prompt",
          *IGNORED, "top_k", "min_p", "repetition_penalty", "seed", "stop", "frequency_penalty", "presence_penalty",
          "logit_bias", "ignore_eos", "skip_special_tokens", "stop_token_ids", "cache_salt", *_EXTRA)


@dataclass
class ResponsesRequest(GenerateRequest):
    repeated: dict = field(default_factory=dict)  # the request's fields a Response object repeats
    namespaces: dict = field(default_factory=dict)  # function name -> the namespace tool it came in


def parse(body: dict) -> ResponsesRequest:
    check_fields(body, FIELDS, "/v1/responses")
    for name, why in (("previous_response_id", "this server stores no responses: send the whole conversation "
                                               "in 'input' (with store: false)"),
                      ("conversation", "this server stores no conversations: send the whole conversation in "
                                       "'input'"),
                      ("prompt", "this server stores no prompt templates: send 'instructions' and 'input'")):
        if body.get(name) is not None:
            raise bad_param(name, f"'{name}' is not supported: {why}")
    if body.get("background"):
        raise bad_param("background", "'background' is not supported: this server answers while the client waits")
    messages = _messages(body)
    req = ResponsesRequest(chat=True, model=_get(body, "model", (str,), "a string"), prompts=[messages])
    req.stream = _bool(body, "stream")
    req.include_usage = True
    limit = body.get("max_output_tokens", body.get("n_predict"))
    if limit is not None:
        key = "max_output_tokens" if body.get("max_output_tokens") is not None else "n_predict"
        req.max_tokens, req.max_tokens_param = _checked("max_tokens", limit, key), key
    extensions(body, req.params)
    _passed_on(body, req.params)
    _penalties(body, req.params)
    _text_format(body, req)
    tools = _get(body, "tools", (list,), "a list of {'type': 'function', 'name': ..., 'parameters': {...}} objects")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    offered = []
    for i, t in enumerate(tools or []):
        offered += _tool(t, i, req.namespaces)
    _tools({"tools": offered or None, "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls")},
           req)
    req.template_kwargs = template_kwargs(body)
    req.repeated = {"instructions": body.get("instructions"), "tools": tools or [],
                "tool_choice": body.get("tool_choice", "auto"), "parallel_tool_calls": req.parallel_tool_calls,
                "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
                "store": bool(body.get("store", False)), "text": body.get("text") or {"format": {"type": "text"}},
                "reasoning": body.get("reasoning"), "previous_response_id": None, "truncation": "disabled"}
    return req


def _text_format(body, req):
    text = _get(body, "text", (dict,), "an object: {'format': {...}}", {})
    fmt = text.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_param("text.format", "'text.format' must be {'type': 'text'}, {'type': 'json_object'} or "
                                       f"{{'type': 'json_schema', 'name': ..., 'schema': {{...}}}}, got {short(fmt)}")
    if fmt["type"] == "text":
        return
    schema = {"type": "object"} if fmt["type"] == "json_object" else fmt.get("schema")
    if not isinstance(schema, (dict, str)):
        raise bad_param("text.format.schema", "'text.format.schema' must be a JSON Schema object, got "
                                              f"{short(schema)}")
    req.params["json_schema"] = _library("json_schema", schema, "text.format")
    req.constrained_by = "text.format"


def _tool(t, i, namespaces: dict) -> list[dict]:
    """A Responses tool in the chat shape: a function tool ({"type": "function", "name", "parameters"}),
    each function of a namespace tool, or none for a tool OpenAI's servers run (:data:`HOSTED`)."""
    where = f"tools[{i}]"
    kind = t.get("type", "function") if isinstance(t, dict) else None
    if kind in HOSTED:
        return []
    if kind == "namespace" and isinstance(t.get("tools"), list):
        out = []
        for j, inner in enumerate(t["tools"]):
            out += _tool(inner, f"{i}].tools[{j}", namespaces)
            if out and isinstance(t.get("name"), str):
                namespaces[out[-1]["function"]["name"]] = t["name"]
        return out
    if kind != "function":
        raise bad_param(f"{where}.type", f"{where}: function and namespace tools are supported here (and OpenAI's "
                                         f"hosted tools are not offered), not {short(kind if kind is not None else t)}")
    if "function" in t:  # the chat shape, sent here by mistake or by a client that speaks both
        return [t]
    return [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                              if t.get(k) is not None}}]


def _messages(body) -> list[dict]:
    """``instructions`` and ``input`` as chat messages."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_param("input", f"'input' must be a non-empty string or list of items, got {short(items)}")
    instructions = _get(body, "instructions", (str,), "a string")
    out = [{"role": "system", "content": instructions}] if instructions else []
    thought = None  # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_param(where, f"{where} must be an object (a message or a function call item), got {short(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_param(f"{where}.role", f"{where}.role must be 'user', 'assistant', 'system' or "
                                                 f"'developer', got {short(role)}")
            role = "system" if role == "developer" else role
            m = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and thought:
                m["reasoning_content"], thought = thought, None
            if role == "system" and out and out[-1]["role"] == "system" and len(out) == 1:
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + m["content"]}
                continue
            out.append(m)
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(args, str):
                raise bad_param(where, f"{where} (a function_call) needs 'name' and 'arguments' (JSON text), got "
                                       f"{short(item)}")
            try:
                ok = isinstance(json.loads(args), dict)
            except ValueError:
                ok = False
            if not ok:
                raise bad_param(f"{where}.arguments", f"{where}.arguments must be a JSON object (as text), got "
                                                      f"{short(args)}")
            call = {"id": str(item.get("call_id") or item.get("id") or f"call_{i}"), "type": "function",
                    "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":  # the calls of the turn whose text came just before
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                m = {"role": "assistant", "content": "", "tool_calls": [call]}
                if thought:
                    m["reasoning_content"], thought = thought, None
                out.append(m)
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            texts = [p.get("text", "") for p in (item.get("content") or []) + (item.get("summary") or [])
                     if isinstance(p, dict) and isinstance(p.get("text"), str)]
            thought = "\n".join(texts) or None
        else:
            raise bad_param(f"{where}.type", f"{where}.type {short(kind)} is not supported here: send messages, "
                                             f"function_call and function_call_output items (item_reference needs "
                                             f"stored responses, which this server does not keep)")
    return out


def _text(content, where) -> str:
    """A message's content: a string, or its text parts (input_text, output_text, text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(where, f"{where} must be a string or a list of input_text parts, got {short(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text", "refusal") \
                or not isinstance(part.get("text", part.get("refusal")), str):
            raise bad_param(f"{where}[{j}]", f"{where}[{j}]: only text parts ({{'type': 'input_text', 'text': ...}}) "
                                             f"are supported, got {short(part)}")
        texts.append(part.get("text", part.get("refusal")))
    return "".join(texts)


def usage_of(used: dict, reasoning_tokens: int = 0) -> dict:
    """OpenAI's chat usage in the Responses shape."""
    return {"input_tokens": used["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": used["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": used["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": used["total_tokens"]}


class Shaper(Blocks):
    """The Response of one request: whole (:meth:`completion`) or as its typed event stream."""

    def __init__(self, req: ResponsesRequest, model: str, tool_format: str | None, count_tokens):
        super().__init__()
        self.req, self.model, self.tool_format = req, model, tool_format if req.tools else None
        self.count_tokens = count_tokens  # text -> its number of tokens (reasoning_tokens of a whole reply)
        self.id, self.created = "resp_" + uuid.uuid4().hex, int(time.time())
        self._seq, self._items, self._parts = 0, [], None

    def _response(self, status: str, output: list, usage=None, reason=None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": {"reason": reason} if reason else None, "model": self.model,
                "output": output, "usage": usage, **self.req.repeated}

    def _item(self, kind, value, status="completed") -> dict:
        if kind == REASONING:
            return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                    "content": [{"type": "reasoning_text", "text": value}], "status": status}
        if kind == CALL:
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": value.id, "name": value.name,
                    "arguments": value.arguments, "status": status}
            if value.name in self.req.namespaces:
                item["namespace"] = self.req.namespaces[value.name]
            return item
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": value, "annotations": [], "logprobs": []}]}

    # -- whole -----------------------------------------------------------------------

    def completion(self, rows, used: dict) -> dict:
        [(_, c, _)] = rows
        blocks = whole(self.tool_format, self.req.reasoning, c.text)
        thought = "".join(v for k, v in blocks if k == REASONING)
        output = [self._item(k, v) for k, v in blocks]
        cut = c.finish_reason == "length"
        return self._response("incomplete" if cut else "completed", output,
                              usage_of(used, self.count_tokens(thought) if thought else 0),
                              "max_output_tokens" if cut else None)

    # -- streamed ----------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> str:
        self._seq += 1
        body = {"type": kind, "sequence_number": self._seq - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def opening(self, n: int) -> list[str]:
        self._parts = ReplyParts(self.tool_format, self.req.reasoning)
        head = self._response("in_progress", [])
        return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]

    def event_logprobs(self, ev):
        return None

    def keepalive(self) -> list[str]:
        return [": keep-alive\n\n"]  # an SSE comment: clients skip it, their idle timers restart

    def text_chunks(self, index: int, text: str, logprobs=None) -> list[str]:
        return self.events(self._parts.feed(text))

    def end_chunks(self, index: int, reason: str) -> list[str]:
        return self.events(self._parts.finish()) + self.close_open()

    def closing(self, used: dict, results) -> list[str]:
        cut = results[0].finish_reason == "length"
        final = self._response("incomplete" if cut else "completed", self._items,
                               usage_of(used, self._parts.thought_tokens), "max_output_tokens" if cut else None)
        return [self._event("response.incomplete" if cut else "response.completed", response=final)]

    def failure(self, error) -> list[str]:
        failed = {**self._response("failed", self._items), "error": {"code": error.code or error.type,
                                                                    "message": error.message}}
        return [self._event("response.failed", response=failed)]

    def _open(self, kind, value) -> list[str]:
        at = len(self._items)
        item = self._item(kind, "" if kind != CALL else value, "in_progress")
        if kind == CALL:
            item["arguments"] = ""
        elif kind == REASONING:
            item["content"] = []
        else:
            item["content"] = []
        self._open_item = item
        out = [self._event("response.output_item.added", output_index=at, item=item)]
        if kind != CALL:
            part = {"type": "reasoning_text", "text": ""} if kind == REASONING else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=at,
                                   content_index=0, part=part))
        return out

    def _delta(self, kind, text) -> list[str]:
        item, at = self._open_item, len(self._items)
        if kind == REASONING:
            return [self._event("response.reasoning_text.delta", item_id=item["id"], output_index=at,
                                content_index=0, delta=text)]
        return [self._event("response.output_text.delta", item_id=item["id"], output_index=at, content_index=0,
                            delta=text, logprobs=[])]

    def _close(self, kind, value) -> list[str]:
        item, at = self._open_item, len(self._items)
        done = {**self._item(kind, value), "id": item["id"]}
        self._items.append(done)
        if kind == CALL:
            return [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                                delta=value.arguments),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                name=value.name, arguments=value.arguments),
                    self._event("response.output_item.done", output_index=at, item=done)]
        part = done["content"][0]
        text_done = (self._event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                 content_index=0, text=value) if kind == REASONING else
                     self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                 text=value, logprobs=[]))
        return [text_done,
                self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=at, item=done)]

