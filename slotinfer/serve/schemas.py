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
from dataclasses import dataclass, field

from .. import request
from ..errors import InvalidRequestError
from ..request import short
from .errors import bad_param

MAX_N = 64  # choices per request: each is a slot's worth of work
MAX_TOP_LOGPROBS = 20  # as OpenAI's API

# The fields each endpoint takes (docs/serve.md): OpenAI's, then slotinfer's extensions.
_NOTHING_HERE = ("user", "service_tier", "store", "metadata", "parallel_tool_calls", "prompt_cache_key",
                 "safety_identifier")
_SHARED = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream", "stream_options",
           "stop", "seed", "frequency_penalty", "presence_penalty", "logit_bias", *_NOTHING_HERE,
           "top_k", "min_p", "repetition_penalty", "ignore_eos", "skip_special_tokens", "stop_token_ids", "cache_salt")
COMPLETION_FIELDS = ("prompt", *_SHARED, "logprobs", "echo", "suffix", "best_of")
CHAT_FIELDS = ("messages", *_SHARED, "logprobs", "top_logprobs", "response_format",
               "tools", "tool_choice", "functions", "function_call")
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


def _refused(body):
    """Parameters this server does not implement, refused by name rather than ignored."""
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise bad_param(name, f"'{name}' is not supported by this server (only 0); use repetition_penalty "
                                  f"(> 1 discourages repeats) instead")
    if body.get("logit_bias"):
        raise bad_param("logit_bias", "'logit_bias' is not supported by this server")
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad_param(name, f"'{name}' (tool calling) is not supported by this server")
    for name in ("tool_choice", "function_call"):  # with no tools, "auto" is "none"
        if body.get(name) not in (None, "none", "auto"):
            raise bad_param(name, f"'{name}' (tool calling) is not supported by this server (only 'none')")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in (None, "text")):
        raise bad_param("response_format", "only response_format {'type': 'text'} is supported by this server")


def _common(body, chat: bool, prompts) -> GenerateRequest:
    _refused(body)
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
    return req


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
    return out


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

