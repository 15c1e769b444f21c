"""Request schemas of the OpenAI-compatible API: JSON bodies in, validated requests out.

Each parser takes the decoded JSON body and returns a dataclass, or raises an
:class:`~slotinfer.serve.errors.APIError` (400) that names the parameter at fault.
Every field a body may carry is listed here: honoured, refused by name when set (the engine
cannot honour it), or accepted as changing nothing here (``user``, ``service_tier``...).
Any other field is a 400 naming it, with the close match (``max_tokns``: did you mean
``max_tokens``?), as the library refuses an unknown keyword.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field

from .. import request
from ..errors import InvalidRequestError
from ..request import short, some
from .errors import bad_param

MAX_N = 64  # choices per request: each is a slot's worth of work
MAX_TOP_LOGPROBS = 20  # as OpenAI's API
MAX_TOOLS = 128  # as OpenAI's API
MAX_ARGUMENT_DEPTH = 64  # levels an earlier call's arguments may nest: the prompt's renderers recurse on them
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI's API

# The fields each endpoint takes (docs/serve.md): OpenAI's, then slotinfer's extensions (vLLM's among them).
_NOTHING_HERE = ("user", "service_tier", "store", "metadata", "prompt_cache_key", "safety_identifier")
_CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar")
_SHARED = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stream_options",
           "stop", "seed", "frequency_penalty", "presence_penalty", "logit_bias", *_NOTHING_HERE, *_CONSTRAINTS,
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "skip_special_tokens", "stop_token_ids", "cache_salt")
COMPLETION_FIELDS = ("prompt", *_SHARED, "logprobs", "echo", "suffix", "best_of")
CHAT_FIELDS = ("messages", *_SHARED, "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
               "functions", "function_call")
CLASSIFY_FIELDS = ("model", "input", "labels", "prefix", "label_prefix", "user")


def check_fields(body: dict, fields: tuple, endpoint: str):
    """400 naming the first field of ``body`` that ``endpoint`` does not take (with the close match)."""
    for name in body:
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise bad_param(name, f"{endpoint} takes no parameter {short(name)}{hint}; docs/serve.md lists "
                                  f"those it takes")


@dataclass
class GenerateRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    model: str | None
    prompts: list  # completions: strings or id lists; chat: one list of messages
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # or max_completion_tokens, as the client named it
    logprobs: bool = False
    top_logprobs: int = 0
    params: dict = field(default_factory=dict)  # for Inferencer.submit
    tools: list | None = None  # chat: the tools offered (OpenAI's objects); None: no tool calls parsed
    tool_choice: str | None = None  # "auto", "required", or the one function's name that must be called
    parallel_tool_calls: bool = True
    constrained_by: str | None = None  # the field that constrains the output (response_format...), if one does


@dataclass(frozen=True)
class ClassifyLimits:
    """What one /v1/classify request may ask (docs/serve.md): inputs, labels, and the tokens it runs
    (prefix, inputs, and for every input each multi-token label's tokens after its first)."""

    inputs: int = 2048
    labels: int = 256
    tokens: int = 65536


@dataclass
class ClassifyRequest:
    model: str | None
    inputs: list[str]
    labels: list[str]
    prefix: str | None
    label_prefix: str


def _get(body, name, kinds, what, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad_param(name, f"'{name}' must be {what}, got {short(value)}")
    return value


def _int(body, name, lo, hi, default=None):
    value = _get(body, name, (int,), f"an integer in [{lo}, {hi}]", default)
    if value is not None and not lo <= value <= hi:
        raise bad_param(name, f"'{name}' must be an integer in [{lo}, {hi}], got {short(value)}")
    return value


def _bool(body, name, default=False):
    return _get(body, name, (bool,), "true or false", default)


def _passed_on(body, params: dict):
    """The parameters Inferencer.submit takes as they are, checked by its own table
    (:mod:`slotinfer.request`) and refused here by name; the vocabulary bounds wait for submit."""
    for name in (*request.SAMPLING, "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "cache_salt"):
        if body.get(name) is None:
            continue
        params[name] = _checked(name, body[name])
        if name == "stop":
            params[name] = list(params[name])
    params.setdefault("temperature", 1.0)  # OpenAI's default


def _checked(name, value, key=None):
    try:
        return request.check_value(name, value)
    except InvalidRequestError as e:
        key = key or name
        raise bad_param(key, str(e) if key == name else f"'{key}': {e}") from None


def _library(name, value, key=None):
    """``value`` checked by the library's own table, where it has the parameter ``name``."""
    return _checked(name, value, key) if name in request.PARAMS else value


def _penalties(body, params: dict):
    """OpenAI's presence and frequency penalties, and ``logit_bias`` (token ids as strings, as JSON keys are)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            params[name] = _library(name, body[name])
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise bad_param("logit_bias", f"'logit_bias' must be an object of token id: bias, got {short(bias)}")
        params["logit_bias"] = _library("logit_bias", bias)  # keys: a token id's decimal text, as JSON has it


# vLLM's structured_outputs keys -> the library's parameters; guided_X is the older spelling of each
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _constraint(body) -> tuple[str, str, object] | None:
    """(field, library parameter, value) of the one constraint on the output, if any: ``response_format``,
    vLLM's ``structured_outputs`` or its older ``guided_*`` fields.  Two are a 400 naming the second."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise bad_param("response_format", "'response_format' must be {'type': 'text'}, {'type': "
                                               "'json_object'} or {'type': 'json_schema', 'json_schema': {...}}, "
                                               f"got {short(fmt)}")
        if fmt["type"] == "json_object":
            found.append(("response_format", "json_schema", {"type": "object"}))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_param("response_format", "'response_format.json_schema' must be an object with a 'schema' "
                                                   f"(a JSON Schema object), got {short(spec)}")
            found.append(("response_format", "json_schema", spec.get("schema", {"type": "object"})))
    outs = _get(body, "structured_outputs", (dict,), "an object", {})
    for key, value in outs.items():
        if key == "json_object":
            if value is True:
                found.append(("structured_outputs.json_object", "json_schema", {"type": "object"}))
            continue
        if key not in _STRUCTURED:
            raise bad_param(f"structured_outputs.{key}", f"'structured_outputs' takes json, regex, choice, grammar "
                                                         f"or json_object, not {short(key)}")
        if value is not None:
            found.append((f"structured_outputs.{key}", _STRUCTURED[key], value))
    found += [(f"guided_{k}", p, body[f"guided_{k}"]) for k, p in _STRUCTURED.items()
              if body.get(f"guided_{k}") is not None]
    if len(found) > 1:
        raise bad_param(found[1][0], f"'{found[0][0]}' and '{found[1][0]}' both constrain the output; give one")
    if not found:
        return None
    where, name, value = found[0]
    kinds = {"json_schema": ((dict, str), "a JSON Schema (an object, or its JSON text)"), "regex": ((str,), "a string"),
             "grammar": ((str,), "a Lark grammar (a string)"), "choice": ((list,), "a list of strings")}[name]
    if not isinstance(value, kinds[0]) or name == "choice" and not (value and all(isinstance(c, str) for c in value)):
        raise bad_param(where, f"'{where}' must be {kinds[1]}, got {short(value)}")
    return where, name, value


def _common(body, chat: bool, prompts) -> GenerateRequest:
    model = _get(body, "model", (str,), "a string")
    req = GenerateRequest(chat=chat, model=model, prompts=prompts)
    req.n = _int(body, "n", 1, MAX_N, 1)
    req.stream = _bool(body, "stream")
    opts = _get(body, "stream_options", (dict,), "an object", {})
    if opts and not req.stream:
        raise bad_param("stream_options", "'stream_options' is only allowed with stream: true")
    req.include_usage = _get(opts, "include_usage", (bool,), "true or false", False)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if body.get(key) is not None:
        req.max_tokens, req.max_tokens_param = _checked("max_tokens", body[key], key), key
    _passed_on(body, req.params)
    _penalties(body, req.params)
    constraint = _constraint(body)
    if constraint:
        req.params[constraint[1]] = _library(constraint[1], constraint[2], constraint[0])
        req.constrained_by = constraint[0]
    return req


def parse_completion(body: dict) -> GenerateRequest:
    check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad_param("prompt", "'prompt' must be a string, a list of strings, a list of token ids, or a list of "
                                  f"lists of token ids; got {short(prompt)}")
    if any(not p for p in prompts):
        raise bad_param("prompt", "'prompt' must not be empty")
    for name in ("echo", "suffix"):
        if body.get(name):
            raise bad_param(name, f"'{name}' is not supported by this server")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise bad_param("best_of", "'best_of' is not supported by this server (leave it out, or equal to n)")
    req = _common(body, False, prompts)
    top = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None:
        req.logprobs, req.top_logprobs = True, top
    return req


def parse_chat(body: dict) -> GenerateRequest:
    check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got "
                                    f"{short(messages)}")
    req = _common(body, True, [[_message(m, i) for i, m in enumerate(messages)]])
    req.logprobs = _bool(body, "logprobs")
    req.top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if req.top_logprobs and not req.logprobs:
        raise bad_param("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    _tools(body, req)
    return req


def _tools(body, req: GenerateRequest):
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` onto ``req``: the tools to offer (none with
    ``tool_choice: "none"``) and whether a call is forced, which no other constraint may share."""
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise bad_param(name, f"'{name}' is OpenAI's retired form of tool calling; send 'tools' and "
                                  f"'tool_choice' instead (docs/tool-calling.md)")
    req.parallel_tool_calls = _bool(body, "parallel_tool_calls", True)
    tools = _get(body, "tools", (list,), "a list of {'type': 'function', 'function': {...}} objects")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_param("tool_choice", f"'tool_choice' {short(choice)} needs 'tools' to choose from")
        return
    if len(tools) > MAX_TOOLS:
        raise bad_param("tools", f"'tools' lists {len(tools)} tools; at most {MAX_TOOLS} are taken")
    checked = [_tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bad_param("tools", f"'tools' names the function {twice[0]!r} more than once")
    if choice in (None, "auto", "required"):
        req.tool_choice = choice or "auto"
    elif choice == "none":
        return
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        req.tool_choice = choice["function"]["name"]
        if req.tool_choice not in names:
            raise bad_param("tool_choice", f"'tool_choice' names the function {short(req.tool_choice)}, which 'tools' "
                                           f"does not list (it lists {some(names)})")
    else:
        raise bad_param("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', "
                                       f"'function': {{'name': ...}}}}, got {short(choice)}")
    if req.tool_choice != "auto" and req.constrained_by:
        raise bad_param(req.constrained_by, f"'tool_choice' {short(choice)} constrains the output to a tool call "
                                            f"already; leave out '{req.constrained_by}', or set tool_choice to 'auto'")
    if req.tool_choice != "auto":
        for i, t in enumerate(checked):
            _check_forced(t["function"], i, req.tool_choice, choice)
    req.tools = checked


def _check_forced(fn: dict, i: int, forced: str, choice):
    """A forced call's arguments are a JSON object: a function that may be forced (every one with
    "required", else the one named) must not declare its parameters as anything else."""
    kind = fn.get("parameters", {}).get("type", "object")
    others = {"string", "number", "integer", "boolean", "array", "null"}  # JSON Schema's (other names: 400 at compile)
    if forced not in ("required", fn["name"]) or (kind not in others if isinstance(kind, str) else
                                                  not isinstance(kind, list) or "object" in kind):
        return
    where = f"tools[{i}].function.parameters"
    raise bad_param(where, f"{where} has type {short(kind)}, but a call's arguments are a JSON object: with "
                           f"'tool_choice' {short(choice)} the call is forced, so give the function "
                           f"{{'type': 'object', 'properties': {{...}}}} parameters")


def _tool(t, i) -> dict:
    where = f"tools[{i}]"
    fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
    if not isinstance(fn, dict):
        raise bad_param(where, f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                               f"{{...}}}}}}, got {short(t)}")
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise bad_param(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                                                  f"'-', got {short(name)}")
    out = {"name": name}
    if fn.get("description") is not None:
        out["description"] = _get(fn, "description", (str,), "a string")
    if fn.get("parameters") is not None:
        if not isinstance(fn["parameters"], dict):
            raise bad_param(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON Schema "
                                                            f"object, got {short(fn['parameters'])}")
        out["parameters"] = fn["parameters"]
    return {"type": "function", "function": out}


def _message(m, i) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_param(where, f"{where} must be an object with a string 'role', got {short(m)}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_param(f"{where}.content", f"{where}.content: only text parts "
                                                    f"({{'type': 'text', 'text': ...}}) are supported, got {short(part)}")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise bad_param(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    out = {k: v for k, v in m.items() if k not in ("content",)}
    out["content"] = content or ""
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _message_calls(m["tool_calls"], where)
    return out


def _message_calls(calls, where) -> list:
    """An assistant turn's earlier calls, as OpenAI sends them (arguments as JSON text)."""
    if not isinstance(calls, list):
        raise bad_param(f"{where}.tool_calls", f"{where}.tool_calls must be a list of calls, got {short(calls)}")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_param(at, f"{at} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                                f"'arguments': '{{...}}'}}}}, got {short(c)}")
        args = fn.get("arguments", "{}")
        value, deep = None, False
        try:
            value = json.loads(args) if isinstance(args, str) else args
            deep = _depth(value) > MAX_ARGUMENT_DEPTH
        except ValueError:
            pass
        except RecursionError:
            deep = True
        if deep:
            raise bad_param(f"{at}.function.arguments", f"{at}.function.arguments nests deeper than "
                                                        f"{MAX_ARGUMENT_DEPTH} levels; flatten the call's arguments")
        if not isinstance(value, dict):
            raise bad_param(f"{at}.function.arguments", f"{at}.function.arguments must be a JSON object (as text), "
                                                        f"got {short(args)}")
        out.append({**c, "function": {**fn, "arguments": args}})
    return out


def _depth(value) -> int:
    """How deep a JSON value nests (counted up to one past MAX_ARGUMENT_DEPTH), without recursion."""
    most, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            most = max(most, d)
            if d <= MAX_ARGUMENT_DEPTH:
                todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return most


def parse_classify(body: dict, limits: ClassifyLimits) -> ClassifyRequest:
    check_fields(body, CLASSIFY_FIELDS, "/v1/classify")
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) and t for t in inputs):
        raise bad_param("input", f"'input' must be a non-empty string or list of non-empty strings, got {short(inputs)}")
    if len(inputs) > limits.inputs:
        raise bad_param("input", f"'input' has {len(inputs)} texts; this server classifies at most {limits.inputs} "
                                 f"per request: split them over several requests")
    labels = _get(body, "labels", (list,), "a list of strings")
    if labels is None:
        raise bad_param("labels", "'labels' is required: the classes to choose from")
    if not labels or not all(isinstance(x, str) and x for x in labels):
        raise bad_param("labels", f"'labels' must be a non-empty list of non-empty strings, got {short(labels)}")
    if len(labels) > limits.labels:
        raise bad_param("labels", f"'labels' has {len(labels)} labels; this server scores at most {limits.labels} "
                                  f"per request")
    return ClassifyRequest(model=_get(body, "model", (str,), "a string"), inputs=inputs, labels=labels,
                           prefix=_get(body, "prefix", (str,), "a string"),
                           label_prefix=_get(body, "label_prefix", (str,), "a string", ""))


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

