"""Prefill-only routes: ``/v1/completions`` with ``echo`` (prompt log-probs, for scoring) and
``/v1/embeddings``.

Both hand a job to the Inferencer (:meth:`~slotinfer.Inferencer.submit_score`,
:meth:`~slotinfer.Inferencer.submit_embed`), whose worker runs it one token-budgeted batch
between two engine steps, as it runs ``/v1/classify``: a stream on another route waits at most
one batch per token.  A client that leaves cancels its job before the next batch.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..embed import to_base64
from ..errors import Cancelled, InvalidRequestError, PromptTooLongError
from ..request import short
from .backend import check_fits
from .errors import APIError, bad_param, cut_short
from .http import EventStream, disconnected
from .metrics import Timer
from .responses import DONE, Shaper, finish_reason, usage
from .schemas import ClassifyLimits, check_fields

EMBEDDING_FIELDS = ("model", "input", "encoding_format", "dimensions", "user", "pooling", "normalize")


# -- running a job beside the engine -----------------------------------------------------

async def run_job(server, request: Request, submit, endpoint: str, extra=()):
    """Submit a prefill job (``submit()``, on a thread: it tokenizes) and wait for its results, or for
    the client to leave; ``extra``: awaitables (a completion's rows) to wait for with it.  Returns the
    job's results and ``extra``'s, or a Response (499: the client left; 503: the server shut down)."""
    bound = server.engine.max_queue  # jobs wait in their own line, as long as the engine's (0: unbounded)
    pending = getattr(server, "_prefill_pending", 0)
    if bound and pending >= bound:
        raise APIError(429, f"{bound} scoring or embedding requests are already waiting; retry later",
                       type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(server.retry_after)})
    server._prefill_pending = pending + 1
    try:
        handle = await asyncio.to_thread(submit)
    except BaseException:
        server._prefill_pending -= 1
        raise
    job = asyncio.ensure_future(handle)
    job.add_done_callback(lambda f: _job_done(server, f))
    rest = asyncio.ensure_future(asyncio.gather(*extra))
    everything = asyncio.gather(job, rest)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait([everything, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        handle.cancel()  # a no-op for a job that ended; else it stops before its next unit of work
    if not everything.done():  # the client went away: no one reads an answer
        everything.cancel()
        server.metrics.outcome(endpoint, "cancelled")
        return Response(status_code=499)
    try:
        return everything.result()
    except Cancelled:  # the server ended it: shutting down
        server.metrics.outcome(endpoint, "cancelled")
        return cut_short().response()


def _job_done(server, job):
    server._prefill_pending -= 1
    if not job.cancelled():
        job.exception()  # read, so that a job whose client left logs nothing


# -- echo ---------------------------------------------------------------------------------

async def echo_completion(server, request: Request, req, t0: float):
    """``/v1/completions`` with ``echo: true``: each choice's text is its prompt then its completion
    (none with ``max_tokens: 0``); with ``logprobs``, the prompt's log-probs (``null`` for its first
    token) come first, from one batched prefill (:class:`~slotinfer.prefill_jobs.ScoreJob`), then
    the completion's as the engine gives them.  Streamed, each choice's first chunk is its prompt."""
    endpoint, handles, streaming = "completions", [], False
    try:
        if req.max_tokens != 0:  # scoring alone takes no slot
            check_fits(server.engine, req)
        server._force_call(req)
        prompts = await asyncio.to_thread(server._encode, req)
        await asyncio.to_thread(server._compile, req)
        prompt_tokens = sum(map(len, prompts))
        if req.max_tokens != 0:
            handles, prompt_tokens = await server._submit(req, prompts)
        rows = [] if req.stream else [server._drain(h, Timer(server.metrics, t0)) for h in handles]
        if req.logprobs:
            def submit():
                return server.engine.submit_score(prompts, top_logprobs=req.top_logprobs)

            got = await run_job(server, request, submit, endpoint, rows)
            if isinstance(got, Response):
                return got
            scores, results = got
        else:
            scores, results = [None] * len(prompts), await asyncio.gather(*rows)
        for i, s in enumerate(scores):
            if s is not None and s.error is not None:
                raise APIError(400, f"prompt[{i}]: {s.error}", param="prompt")
        if req.stream:  # the prompts first, then the completions' chunks as they come
            streaming = True
            return EventStream(_echo_stream(server, req, prompts, scores, handles, t0, prompt_tokens), handles)
    except Exception as e:
        return server._refuse(endpoint, e)
    finally:
        if not streaming:
            for h in handles:
                h.cancel()  # a no-op for those that ended
    if any(c.finish_reason == "cancelled" for c in results):  # the server ended it: shutting down
        server.metrics.outcome(endpoint, "cancelled")
        return cut_short().response()
    server.metrics.prompt_tokens.inc(prompt_tokens)
    server.metrics.outcome(endpoint, "ok")
    shaper = Shaper(False, server.name, server.token_text)
    choices = []
    for k in range(len(prompts) * req.n):
        p, c = k // req.n, results[k] if results else None
        text = _prompt_text(server, req, prompts, p)
        choice = {"index": k, "text": text + (c.text if c else ""), "finish_reason": "length",
                  "logprobs": _echo_logprobs(shaper, scores[p], text, c, req) if req.logprobs else None}
        if c is not None:
            choice["finish_reason"] = finish_reason(c.finish_reason)
        choices.append(choice)
    generated = sum(len(c.tokens) for c in results)
    return JSONResponse({**shaper._head(False), "choices": choices,
                         "usage": usage(prompt_tokens, generated, sum(c.cached_tokens for c in results[::req.n]))})


def _echo_logprobs(shaper: Shaper, scores, prompt_text: str, c, req) -> dict:
    """OpenAI's legacy logprobs object over the prompt's tokens, then the completion's."""
    tokens = [shaper.token_text(t) for t in scores.tokens]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    tops = None
    if req.top_logprobs:
        tops = [None if top is None else _top_dict(shaper, top) for top in scores.top_logprobs]
    out = {"tokens": tokens, "token_logprobs": list(scores.logprobs), "top_logprobs": tops, "text_offset": offsets}
    if c is not None and c.tokens:
        more = shaper.logprobs(c.tokens, c.logprobs, c.top_logprobs if req.top_logprobs else None)
        out["tokens"] += more["tokens"]
        out["token_logprobs"] += more["token_logprobs"]
        out["text_offset"] += [len(prompt_text) + o for o in more["text_offset"]]
        if tops is not None:
            out["top_logprobs"] += more["top_logprobs"] or [{} for _ in c.tokens]
    return out


def _prompt_text(server, req, prompts, p: int) -> str:
    """The prompt as echoed: as the client sent it, or its ids decoded."""
    return req.prompts[p] if isinstance(req.prompts[p], str) else server.model.tokenizer.decode(prompts[p])


async def _echo_stream(server, req, prompts, scores, handles, t0, prompt_tokens):
    """A first chunk per choice with its prompt (and the prompt's log-probs), then the completions'
    chunks as /v1/completions streams them (or, with ``max_tokens: 0``, the end)."""
    shaper = Shaper(False, server.name, server.token_text)
    server.metrics.prompt_tokens.inc(prompt_tokens)
    for k in range(len(prompts) * req.n):
        p = k // req.n
        text = _prompt_text(server, req, prompts, p)
        lp = _echo_logprobs(shaper, scores[p], text, None, req) if req.logprobs else None
        yield shaper.chunk(k, text, logprobs=lp, finish=None if handles else "length")
    if handles:
        async for chunk in server._stream(req, handles, shaper, t0, prompt_tokens, "completions"):
            yield chunk
        return
    server.metrics.outcome("completions", "ok")
    if req.include_usage:
        yield shaper.usage_chunk(usage(prompt_tokens, 0))
    yield DONE


def _top_dict(shaper: Shaper, top) -> dict:
    """``{text: logprob}``, best first; two tokens of the same text (parts of one character, say) keep
    the better's value, so that the first value is always the position's best."""
    out = {}
    for t, v in top:
        out.setdefault(shaper.token_text(t), v)
    return out


# -- embeddings -------------------------------------------------------------------------------

def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_embeddings(body: dict, limits: ClassifyLimits, hidden: int) -> dict:
    """A /v1/embeddings body checked: its inputs (strings or id lists), and the options."""
    check_fields(body, EMBEDDING_FIELDS, "/v1/embeddings")
    raw = body.get("input")
    if isinstance(raw, str) or _is_ids(raw):
        inputs = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) or _is_ids(x) for x in raw):
        inputs = list(raw)
    else:
        raise bad_param("input", "'input' must be a string, a list of strings, a list of token ids, or a list of "
                                 f"lists of token ids (none empty); got {short(raw)}")
    for i, x in enumerate(inputs):
        if isinstance(x, str) and not x:
            raise bad_param("input", f"input[{i}] is an empty string; every input needs at least one character")
    if len(inputs) > limits.inputs:
        raise bad_param("input", f"'input' has {len(inputs)} inputs; this server embeds at most {limits.inputs} "
                                 f"per request: split them over several requests")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_param("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {short(fmt)}")
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or isinstance(dims, bool) or not 1 <= dims <= hidden):
        raise bad_param("dimensions", f"'dimensions' must be an integer in [1, {hidden}] (the model's size), "
                                      f"got {short(dims)}")
    pooling = body.get("pooling")
    if pooling is not None and pooling not in ("last", "mean"):
        raise bad_param("pooling", f"'pooling' must be 'last' or 'mean' (or left out: the model's own), "
                                   f"got {short(pooling)}")
    normalize = body.get("normalize", True)
    if not isinstance(normalize, bool):
        raise bad_param("normalize", f"'normalize' must be true or false, got {short(normalize)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", f"'model' must be a string, got {short(model)}")
    return dict(model=model, inputs=inputs, encoding_format=fmt, dimensions=dims, pooling=pooling,
                normalize=normalize)


def _embed_rows(server, req: dict) -> list[list[int]]:
    """Each input's ids (on a thread), and a 400 naming the input that cannot run or the request past
    the server's token limit."""
    rows = []
    for i, x in enumerate(req["inputs"]):
        try:
            rows.append(server.model.encode_prompt(x, what=f"input[{i}]"))
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="input",
                           code="context_length_exceeded" if isinstance(e, PromptTooLongError) else None) from None
    total, most = sum(map(len, rows)), server.classify_limits.tokens
    if total > most:
        raise bad_param("input", f"'input' has {total} tokens in all; this server embeds at most {most} per "
                                 f"request: send fewer or shorter inputs")
    return rows


async def embeddings(server, request: Request):
    """``POST /v1/embeddings`` in OpenAI's shape."""
    try:
        server._authorize(request)
        req = parse_embeddings(await server._json(request), server.classify_limits, server.model.config.hidden_size)
        server._check_model(req["model"])
        rows = await asyncio.to_thread(_embed_rows, server, req)
        got = await run_job(server, request, lambda: server.engine.submit_embed(
            rows, pooling=req["pooling"], normalize=req["normalize"], dimensions=req["dimensions"]), "embeddings")
        if isinstance(got, Response):
            return got
        results, _ = got
    except Exception as e:
        return server._refuse("embeddings", e)
    server.metrics.outcome("embeddings", "ok")
    tokens = sum(r.prompt_tokens for r in results)
    server.metrics.prompt_tokens.inc(tokens)
    b64 = req["encoding_format"] == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": to_base64(r.vector) if b64 else [float(x) for x in r.vector]} for i, r in enumerate(results)]
    return JSONResponse({"object": "list", "data": data, "model": server.name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def routes(server) -> list[Route]:
    """The prefill-only and tokenizer routes of ``server`` (echo rides on /v1/completions)."""
    from . import tokens

    def bind(fn):
        async def endpoint(request):
            return await fn(server, request)
        return endpoint

    return [Route("/v1/embeddings", bind(embeddings), methods=["POST"]),
            Route("/tokenize", bind(tokens.tokenize), methods=["POST"]),
            Route("/detokenize", bind(tokens.detokenize), methods=["POST"]),
            Route("/tokenizer_info", bind(tokens.tokenizer_info), methods=["GET"])]
