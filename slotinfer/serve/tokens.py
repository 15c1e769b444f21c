"""``/tokenize``, ``/detokenize`` and ``/tokenizer_info``: the model's own tokenizer over HTTP, in the
shapes llama.cpp's server and vLLM's take, on the same routes.

* ``POST /tokenize``: llama.cpp's ``{"content", "add_special" (false), "with_pieces" (false)}``, or
  vLLM's ``{"prompt", "add_special_tokens" (true), "return_token_strs"}`` or ``{"messages",
  "add_generation_prompt" (true), "add_special_tokens" (false)}``: chat messages rendered with the
  model's chat template.  The answer has both shapes' fields: ``tokens`` (with ``with_pieces``:
  ``[{"id", "piece"}]``), ``count`` and ``max_model_len`` (``token_strs`` when asked).
* ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"content", "prompt"}`` (llama.cpp's and vLLM's
  name for the same text).
* ``GET /tokenizer_info``: vLLM's (the special tokens and the chat template), which
  lm-evaluation-harness reads to tokenize through the server (``tokenizer_backend=remote``).
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..errors import InvalidRequestError, TokenizerError
from ..request import short
from .errors import APIError, bad_param
from .schemas import _message, check_fields

TOKENIZE_FIELDS = ("model", "content", "add_special", "with_pieces", "prompt", "add_special_tokens",
                   "return_token_strs", "messages", "add_generation_prompt", "continue_final_message",
                   "chat_template_kwargs")
DETOKENIZE_FIELDS = ("model", "tokens")
MAX_TOKENIZE_CHARS = 4 << 20  # text per /tokenize request (the body limit bounds it too)


def _flag(body, name, default):
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_param(name, f"'{name}' must be true or false, got {short(value)}")
    return value


def _ids_of(server, body: dict) -> list[int]:
    """The ids the body asks for (on a thread: a long text takes a while)."""
    model = server.model
    given = [k for k in ("content", "prompt", "messages") if k in body]
    if len(given) != 1:
        raise bad_param("content", "/tokenize takes one of 'content' (llama.cpp), 'prompt' or 'messages' (vLLM); "
                                   f"got {'none' if not given else ', '.join(given)}")
    key = given[0]
    if key == "messages":
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_param("messages", f"'messages' must be a non-empty list of {{'role', 'content'}} objects, got "
                                        f"{short(messages)}")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_param("chat_template_kwargs", f"'chat_template_kwargs' must be an object, got {short(kwargs)}")
        msgs = [_message(m, i) for i, m in enumerate(messages)]
        gen = _flag(body, "add_generation_prompt", True) and not _flag(body, "continue_final_message", False)
        try:
            text = model.apply_chat_template(msgs, add_generation_prompt=gen, **kwargs)
        except (InvalidRequestError, TokenizerError) as e:
            raise bad_param("messages", str(e)) from None
        return model.tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))
    text = body[key]
    if not isinstance(text, str):
        raise bad_param(key, f"'{key}' must be a string, got {short(text)}")
    if len(text) > MAX_TOKENIZE_CHARS:
        raise bad_param(key, f"'{key}' has {len(text)} characters; /tokenize takes at most {MAX_TOKENIZE_CHARS}")
    special = _flag(body, "add_special", False) if key == "content" else _flag(body, "add_special_tokens", True)
    try:
        return model.tokenizer.encode(text, add_special_tokens=special)
    except (InvalidRequestError, TokenizerError) as e:
        raise bad_param(key, str(e)) from None


async def tokenize(server, request: Request):
    try:
        server._authorize(request)
        body = await server._json(request)
        check_fields(body, TOKENIZE_FIELDS, "/tokenize")
        server._check_model(body.get("model"))
        pieces, strs = _flag(body, "with_pieces", False), _flag(body, "return_token_strs", False)
        ids = await asyncio.to_thread(_ids_of, server, body)
    except Exception as e:
        return server._refuse("tokenize", e)
    server.metrics.outcome("tokenize", "ok")
    out = {"tokens": [{"id": t, "piece": server.token_text(t)[0]} for t in ids] if pieces else ids,
           "count": len(ids), "max_model_len": server.engine.max_len}
    if strs:
        out["token_strs"] = [server.model.tokenizer.id_to_token(t) for t in ids]
    return JSONResponse(out)


async def detokenize(server, request: Request):
    try:
        server._authorize(request)
        body = await server._json(request)
        check_fields(body, DETOKENIZE_FIELDS, "/detokenize")
        server._check_model(body.get("model"))
        ids = body.get("tokens")
        vocab = server.model.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad_param("tokens", f"'tokens' must be a list of token ids (integers), got {short(ids)}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_param("tokens", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        text = await asyncio.to_thread(server.model.tokenizer.decode, ids)
    except Exception as e:
        return server._refuse("detokenize", e)
    server.metrics.outcome("detokenize", "ok")
    return JSONResponse({"content": text, "prompt": text})


async def tokenizer_info(server, request: Request):
    try:
        server._authorize(request)
    except APIError as e:
        return e.response()
    tok = server.model.tokenizer
    return JSONResponse({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                         "eos_token": tok.eos_token, "pad_token": tok.pad_token, "unk_token": tok.unk_token,
                         "chat_template": tok.chat_template, "model_max_length": server.engine.max_len,
                         "add_bos_token": tok.bos_id is not None and tok.encode("a")[:1] == [tok.bos_id]})
