"""Tool calling: the tools into the prompt, the calls out of the text, and the grammar that forces a call.

Two output formats cover the families slotinfer loads (docs/tool-calling.md):

- ``"hermes"``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call,
  anywhere in the reply (Qwen 2 and 3, SmolLM2, and every model whose template has no tool section);
- ``"llama3"``: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``; several calls separated by ``;``), as Llama 3.1 and later answer.

A template that renders ``tools`` itself gets them as they are; one that does not (SmolLM2's, Gemma's)
gets them as a system message in the ``<tool_call>`` format, and the tool turns of the conversation as
plain text it can render.

    >>> parse('Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "hermes")[1][0].arguments
    '{"x": 1}'
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field

HERMES, LLAMA3 = "hermes", "llama3"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    """One call the model made: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# -- which format, and the prompt -------------------------------------------------------


@functools.lru_cache(maxsize=32)
def template_tools(source: str | None) -> str | None:
    """The format of a chat template's own tool section (None: the template renders no ``tools``)."""
    if not source:
        return None
    import jinja2
    from jinja2 import meta

    try:
        names = meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        return None
    if "tools" not in names:
        return None
    return LLAMA3 if "<|start_header_id|>" in source else HERMES


def format_of(model) -> str:
    """The tool-call format ``model`` answers in (its template's, else the fallback's ``hermes``)."""
    return template_tools(model.tokenizer.chat_template) or HERMES


def render(model, messages: list[dict], tools: list[dict] | None) -> str:
    """The prompt of a chat with ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``
    objects; None or empty: none offered), through the model's own template where it has a tool section.

    Assistant turns may carry ``tool_calls`` (arguments as JSON strings, as OpenAI sends them: templates
    get them decoded) and ``tool`` turns answer them."""
    messages = [_for_template(m) for m in messages]
    if template_tools(model.tokenizer.chat_template) is None:
        messages = _without_tool_turns(messages, tools)
        return model.apply_chat_template(messages, add_generation_prompt=True)
    if tools:
        return model.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    return model.apply_chat_template(messages, add_generation_prompt=True)


def _for_template(m: dict) -> dict:
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        fn = dict(c["function"])
        if isinstance(fn.get("arguments"), str):
            fn["arguments"] = json.loads(fn["arguments"])  # checked by the server's schemas
        out.append({**c, "function": fn})
    return {**m, "tool_calls": out}


FALLBACK_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def _without_tool_turns(messages: list[dict], tools) -> list[dict]:
    """The conversation as a template without a tool section renders it: the tools in the system
    message, calls as ``<tool_call>`` text of their assistant turn, results as a user turn of
    ``<tool_response>`` blocks (consecutive results in one turn)."""
    out: list[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f"{_OPEN}\n{json.dumps(_call_body(c), ensure_ascii=False)}\n{_CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    for m in out:
        m.pop("_results", None)
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = FALLBACK_PREAMBLE.format(tools=listed)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{preamble}".lstrip("\n")}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def _call_body(call: dict) -> dict:
    fn = call["function"]
    return {"name": fn["name"], "arguments": fn.get("arguments", {})}


# -- the calls out of the text ----------------------------------------------------------


def parse(text: str, fmt: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole reply: the text outside the calls (None when only whitespace)
    and each well-formed call; a block that does not parse stays in the content."""
    p = StreamParser(fmt)
    parts = p.feed(text) + p.finish()
    content = "".join(x for x in parts if isinstance(x, str))
    return content or None, [x for x in parts if isinstance(x, ToolCall)]


class StreamParser:
    """Splits a reply, delta by delta, into content text and tool calls: :meth:`feed` gives what is
    known so far (strings and :class:`ToolCall`\\ s, in order), :meth:`finish` the rest.  Text that may
    be the start of a call is held back until it is known not to be, so any split of a reply gives the
    same content and calls as the whole.  Content is stripped of whitespace at its two ends."""

    def __init__(self, fmt: str):
        if fmt not in (HERMES, LLAMA3):
            raise ValueError(f"unknown tool-call format {fmt!r}; choose {HERMES!r} or {LLAMA3!r}")
        self.fmt, self.calls = fmt, 0
        self._pending, self._inside, self._mode = "", False, None  # llama3: None (undecided), "json", "text"
        self._started, self._space = False, ""

    def feed(self, text: str) -> list:
        self._pending += text
        return self._hermes() if self.fmt == HERMES else self._llama()

    def finish(self) -> list:
        rest, self._pending = self._pending, ""
        if self.fmt == LLAMA3:
            found = _llama_calls(rest) if self._mode != "text" else None
            return self._found(found[0]) + self._content(found[1]) if found else self._content(rest)
        if self._inside:  # the reply ended inside a block: a call if its JSON is whole
            call = _hermes_call(rest[:len(rest) - _partial_suffix(rest, _CLOSE)])
            return self._found([call]) if call else self._content(_OPEN + rest)
        return self._content(rest)

    def _hermes(self) -> list:
        out = []
        while True:
            if self._inside:
                k = self._pending.find(_CLOSE)
                if k < 0:
                    return out
                body, self._pending, self._inside = self._pending[:k], self._pending[k + len(_CLOSE):], False
                call = _hermes_call(body)
                out += self._found([call]) if call else self._content(_OPEN + body + _CLOSE)
            else:
                k = self._pending.find(_OPEN)
                if k < 0:
                    cut = len(self._pending) - _partial_suffix(self._pending, _OPEN)
                    sure, self._pending = self._pending[:cut], self._pending[cut:]
                    return out + self._content(sure)
                out += self._content(self._pending[:k])
                self._pending, self._inside = self._pending[k + len(_OPEN):], True

    def _llama(self) -> list:
        if self._mode is None:
            head = self._pending.lstrip()
            if not head or _PYTHON_TAG.startswith(head):
                return []
            self._mode = "json" if head.startswith(("{", _PYTHON_TAG)) else "text"
        if self._mode == "json":
            return []
        sure, self._pending = self._pending, ""
        return self._content(sure)

    def _found(self, calls: list[ToolCall]) -> list:
        self.calls += len(calls)
        return list(calls)

    def _content(self, text: str) -> list:
        """``text`` as content, whitespace at the ends of the whole held until more content follows."""
        if not self._started:
            text = text.lstrip()
        core = text.rstrip()
        if not core:
            self._space += text
            return []
        out, self._space, self._started = self._space + core, text[len(core):], True
        return [out]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _hermes_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _call(obj, ("arguments", "parameters"))


def _llama_calls(text: str) -> tuple[list[ToolCall], str] | None:
    """The calls of a Llama 3.1 JSON reply and what follows them: nothing, or a call cut short (text
    from a ``{`` on); None unless the reply is calls."""
    text = text.strip().removeprefix(_PYTHON_TAG)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";" and calls):
            at += 1
        if at == len(text):
            return (calls, "") if calls else None
        try:
            obj, end = decoder.raw_decode(text, at)
        except ValueError:
            obj = end = None
        call = _call(obj, ("parameters", "arguments")) if obj is not None else None
        if call is None:
            return (calls, text[at:]) if calls and text[at] == "{" else None
        calls.append(call)
        at = end


def _call(obj, keys) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # arguments given as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def first_repeat(calls: list[ToolCall]) -> int | None:
    """The index of the first call that repeats an earlier one exactly (its name, and arguments equal as
    JSON values), if any."""
    seen = set()
    for i, c in enumerate(calls):
        if _same(c) in seen:
            return i
        seen.add(_same(c))
    return None


def _same(call: ToolCall) -> tuple[str, str]:
    return call.name, json.dumps(json.loads(call.arguments), sort_keys=True)


class RepeatWatch:
    """A forced reply watched as it streams: :meth:`feed` returns True once a call repeats an earlier
    one exactly.  A small model made to call, with parallel calls allowed, may write the same call
    until ``max_tokens``; the server stops such a reply at the repeat and drops it.

    Each call is seen once, as its text completes (a ``</tool_call>``, or a Llama reply's closing brace):
    the work is linear in the reply."""

    def __init__(self, fmt: str):
        self._parser = StreamParser(fmt) if fmt == HERMES else None
        self._seen: set[tuple[str, str]] = set()
        self._obj: list[str] = []  # llama3: the JSON object being written, its depth and string state
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> bool:
        calls = self._llama(text) if self._parser is None else self._parser.feed(text)
        for c in calls:
            if isinstance(c, ToolCall):
                if _same(c) in self._seen:
                    return True
                self._seen.add(_same(c))
        return False

    def _llama(self, text: str) -> list[ToolCall]:
        """The calls whose closing brace ``text`` holds (the forced Llama reply: objects joined by "; ")."""
        out = []
        for ch in text:
            if not self._depth:
                if ch == "{":
                    self._obj, self._depth = ["{"], 1
                continue
            self._obj.append(ch)
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if not self._depth:
                    found = _llama_calls("".join(self._obj))
                    out += found[0] if found else []
        return out


# -- the grammar that forces a call -----------------------------------------------------


def forced_grammar(tools: list[dict], fmt: str, *, name: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) whose every sentence is a call in ``fmt`` of one of
    ``tools`` (only ``name`` where given), its arguments valid against the function's ``parameters``;
    with ``parallel``, ``<tool_call>`` blocks may follow one another."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    key = "arguments" if fmt == HERMES else "parameters"
    rules = []
    for i, fn in enumerate(fns):
        params = dict(fn.get("parameters") or {})
        if isinstance(params.get("type", []), list):  # arguments are an object (not null, nor an enum's number)
            params["type"] = "object"
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
                  "required": ["name", key], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        rules.append(f"fn{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    body = "body: " + " | ".join(f"fn{i}" for i in range(len(fns)))
    if fmt == HERMES:
        head = ['start: call ("\\n" call)*' if parallel else "start: call",
                f'call: "{_OPEN}\\n" body "\\n{_CLOSE}"']
    else:
        head = ['start: body ("; " body)*' if parallel else "start: body"]
    return "\n".join([*head, body, *rules]) + "\n"
