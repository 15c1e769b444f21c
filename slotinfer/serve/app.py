"""The ASGI app: OpenAI-compatible routes over one :class:`~slotinfer.Inferencer`.

HTTP is a thin shell over the Inferencer's own machinery: a request becomes one
``submit`` per choice (never blocking: a full admission queue is a 429 at once), its
tokens arrive through the handle's asyncio stream, and a client that goes away
cancels its handles, which frees their slots at the engine's next step.

Why one module: every route reads the one ``_Server`` (the Inferencer, the metrics, the
limits and the shutdown flag) and refuses a request one way.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..text import reasoning
from ..text import tools
from ..cpu import allocator
from ..errors import Cancelled, GrammarError, InvalidRequestError, PromptTooLongError
from ..request import CONSTRAINTS, short
from . import anthropic, openai_responses
from .errors import APIError, cut_short, from_exception
from .backend import LocalBackend, check_fits
from .http import EventStream, check_key, disconnected, read_json
from .metrics import Metrics, Timer
from .responses import Shaper, TokenText, usage
from .schemas import ClassifyLimits, GenerateRequest, parse_chat, parse_classify, parse_completion
from .scoring import echo_completion, routes as scoring_routes

KEEPALIVE_SECONDS = 5.0  # a stream silent this long gets its dialect's keep-alive event
DEFAULT_MAX_TOKENS = 16  # /v1/completions, as OpenAI's; chat defaults to what the slot has room for
_TRIM_AFTER_CHARS = 1 << 20  # a prompt this long takes hundreds of MB to tokenize, given back after it


def build_app(inferencer, *, served_model_name: str | None = None, api_key: str | None = None,
              max_body_bytes: int = 8 << 20, read_timeout: float = 30.0, retry_after: int = 1,
              classify_limits: ClassifyLimits = ClassifyLimits()) -> Starlette:
    """The ASGI app serving ``inferencer`` (started; closing it stays the caller's).

        >>> inf = slotinfer.Inferencer(slotinfer.load("path/to/model"), slots=32, max_queue=64)
        >>> app = slotinfer.serve.build_app(inf, served_model_name="my-model", api_key="sk-...")
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)

    ``api_key`` (when set) is required as ``Authorization: Bearer KEY`` on ``/v1/*``;
    bodies over ``max_body_bytes`` get 413, and bodies not received within ``read_timeout`` seconds
    408; ``retry_after`` is the Retry-After of a 429; a /v1/classify request past ``classify_limits``
    (inputs, labels, tokens) gets 400.
    """
    return shell_app(LocalBackend(inferencer), inferencer.model,
                     served_model_name or default_name(inferencer.model.path), api_key=api_key,
                     max_body_bytes=max_body_bytes, read_timeout=read_timeout, retry_after=retry_after,
                     classify_limits=classify_limits)


def shell_app(backend, model, name: str, *, api_key: str | None = None, max_body_bytes: int = 8 << 20,
              read_timeout: float = 30.0, retry_after: int = 1, classify_limits: ClassifyLimits = ClassifyLimits(),
              served: tuple[str, ...] = ()) -> Starlette:
    """The routes over any backend (:mod:`slotinfer.serve.backend`): ``model`` encodes, renders and
    decodes here, ``backend`` runs the requests (in this process, or on replicas elsewhere).
    ``served``: every name the whole service answers to, for the message of a 404."""
    server = _Server(backend, model, name, api_key, max_body_bytes, read_timeout, retry_after, classify_limits,
                     served or (name,))
    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_page, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model_page, methods=["GET"]),  # a served name may be org/name
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/classify", server.classify, methods=["POST"]),
        *scoring_routes(server),
        Route("/v1/responses", server.responses, methods=["POST"]),
        Route("/v1/messages", server.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.slotinfer = server
    return app


# llama.cpp's type names at the end of a GGUF file's name: .Q4_1, -Q8_0, -q4_k_m, .IQ4_XS, .F16, -bf16, .fp32
_QUANT_SUFFIX = re.compile(r"[._-](?:[IT]?Q\d+(?:_[A-Z0-9]+)*|B?FP?\d+|MXFP4)$", re.IGNORECASE)


def default_name(path: Path) -> str:
    """A model's name in the API when none is given: a folder's name; a GGUF file's name without
    ``.gguf`` and its quantization suffix; ``org/name`` for a hub id's snapshot folder."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return _QUANT_SUFFIX.sub("", path.stem) or path.stem
    repo = path.parent.parent.name  # the Hugging Face cache: models--org--name/snapshots/<revision>
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo[len("models--"):].replace("--", "/")
    return path.name


async def _http_error(request, exc: HTTPException):
    code = "not_found" if exc.status_code == 404 else None
    return APIError(exc.status_code, f"{request.method} {short(request.url.path, 200)}: {exc.detail}",
                    code=code).response()


async def _internal_error(request, exc: Exception):
    return from_exception(exc).response()


class _Server:
    def __init__(self, backend, model, name: str, api_key, max_body_bytes: int, read_timeout: float,
                 retry_after: int, classify_limits: ClassifyLimits, served: tuple[str, ...]):
        self.engine, self.model, self.name, self.served = backend, model, name, served
        self.api_key, self.max_body, self.retry_after = api_key, max_body_bytes, retry_after
        self.read_timeout = read_timeout
        self.metrics = Metrics(backend)
        self.created = int(time.time())
        self.token_text = TokenText(self.model.tokenizer)
        self.tool_format = tools.format_of(self.model)  # the format its tool calls are parsed in
        self._classify_pending = 0  # classifications submitted to the Inferencer that have not ended
        self.classify_limits = classify_limits

    # -- plain pages ----------------------------------------------------------------

    async def health(self, request: Request):
        if self.engine.closed:
            return JSONResponse({"status": "closed"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.name})

    async def metrics_page(self, request: Request):
        body, kind = self.metrics.exposition()
        return Response(body, media_type=kind)

    async def models(self, request: Request):
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_page(self, request: Request):
        """``GET /v1/models/{name}``, as the openai client's ``models.retrieve`` asks: the served model, else 404."""
        try:
            self._authorize(request)
            self._check_model(request.path_params["name"])
        except APIError as e:
            return e.response()
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "slotinfer",
                "max_model_len": self.engine.max_len}

    # -- generation -----------------------------------------------------------------

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool):
        return await self._run(request, "chat" if chat else "completions", parse_chat if chat else parse_completion,
                               lambda req, _: Shaper(chat, self.name, self.token_text,
                                                     self.tool_format if req.tools else None,
                                                     reasoning=req.reasoning,
                                                     stop_repeats=bool(req.tools) and req.tool_choice == "required"
                                                     and req.parallel_tool_calls))

    async def _run(self, request: Request, endpoint: str, parse, shaper_of, shape=None):
        """A generation request of any dialect: ``parse`` (body -> GenerateRequest) and ``shaper_of``
        (request, prompt tokens -> its shaper) are the dialect's; submitting, streaming and cancelling are one.
        ``shape`` gives an error's body in the dialect's own shape (OpenAI's when None)."""
        t0 = time.perf_counter()
        req = None
        try:
            self._authorize(request)
            req = parse(await self._json(request))
            self._check_model(req.model)
            if req.echo:
                return await echo_completion(self, request, req, t0)
            check_fits(self.engine, req)
            self._force_call(req)
            prompts = await asyncio.to_thread(self._encode, req)  # seconds for a prompt of megabytes
            await asyncio.to_thread(self._compile, req)  # seconds for a hard schema
            handles, prompt_tokens = await self._submit(req, prompts)
        except Exception as e:
            return self._refuse(endpoint, e, shape, req)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        shaper = shaper_of(req, prompt_tokens)
        if req.stream:
            return EventStream(self._stream(req, handles, shaper, t0, prompt_tokens, endpoint), handles)
        return await self._complete(request, req, handles, shaper, t0, prompt_tokens, endpoint, shape)

    async def responses(self, request: Request):
        return await self._run(request, "responses", openai_responses.parse,
                               lambda req, _: openai_responses.Shaper(req, self.name, self.tool_format, self._count))

    async def messages(self, request: Request):
        return await self._run(request, "messages", anthropic.parse,
                               lambda req, n: anthropic.Shaper(req, self.name, self.tool_format, n,
                                                               self.model.tokenizer.decode),
                               shape=anthropic.error_body)

    async def count_tokens(self, request: Request):
        """Anthropic's count_tokens: the prompt's length as /v1/messages would render it, nothing generated."""
        try:
            self._authorize(request)
            req = anthropic.parse(await self._json(request), counting=True)
            self._check_model(req.model)
            [ids] = await asyncio.to_thread(self._encode, req)
        except Exception as e:
            return self._refuse("count_tokens", e, anthropic.error_body)
        return JSONResponse({"input_tokens": len(ids)})

    def _count(self, text: str) -> int:
        """The number of tokens ``text`` takes (no BOS)."""
        return len(self.model.tokenizer.encode(text, add_special_tokens=False))

    def _force_call(self, req: GenerateRequest):
        """``tool_choice`` "required" or a named function: the output constrained to a call in the
        model's format, its arguments following the function's parameter schema."""
        if req.tools and req.tool_choice != "auto":
            name = None if req.tool_choice == "required" else req.tool_choice
            req.params["grammar"] = tools.forced_grammar(req.tools, self.tool_format, name=name,
                                                         parallel=req.parallel_tool_calls and name is None)

    def _compile(self, req: GenerateRequest):
        """A constrained request's grammar compiled on a worker thread (bounded by SLOTINFER_GRAMMAR_SECONDS),
        so that submit finds it compiled and the event loop never waits on a compile; a bad one is a 400
        naming the field the client sent."""
        kinds = [k for k in CONSTRAINTS if req.params.get(k) is not None]
        if not kinds:
            return
        try:
            self.model.grammars.constraint({kinds[0]: req.params[kinds[0]]})
        except InvalidRequestError as e:
            if req.tools and req.tool_choice != "auto":
                raise APIError(400, f"a function's parameters in 'tools' do not compile into the grammar that forces "
                                    f"the call: {e}", param="tools") from None
            raise APIError(400, str(e), param=req.constrained_by or getattr(e, "param", None)) from None

    def _check_fits(self, req: GenerateRequest):
        check_fits(self.engine, req)

    def _encode(self, req: GenerateRequest) -> list[list[int]]:
        """The token ids of each prompt (chat messages rendered with the model's template), on a worker
        thread: the event loop goes on serving every other request meanwhile."""
        model, param = self.model, "messages" if req.chat else "prompt"
        texts = []
        try:
            for p in req.prompts:
                texts.append(tools.render(model, p, req.tools, **req.template_kwargs) if req.chat else p)
            if req.chat:  # where the reply starts: inside a reasoning block the prompt opened, or free to open one
                req.reasoning = reasoning.mode(model.tokenizer.chat_template, texts[0])
            return [model.encode_prompt(t) for t in texts]
        except InvalidRequestError as e:  # the prompt itself: too long, empty, ids outside the vocabulary
            raise APIError(400, str(e), param=param,
                           code="context_length_exceeded" if isinstance(e, PromptTooLongError) else None) from None
        finally:
            if any(isinstance(t, str) and len(t) > _TRIM_AFTER_CHARS for t in texts):
                allocator.release_free_memory()  # what tokenizing megabytes took goes back to the system

    async def _submit(self, req: GenerateRequest, prompts: list[list[int]]):
        """One handle per choice (prompt-major, as OpenAI numbers them); all or none are submitted."""
        rows = []
        for ids in prompts:
            room = min(self.engine.max_len, self.model.context_length) - len(ids)
            max_tokens = req.max_tokens or (max(room, 1) if req.chat else DEFAULT_MAX_TOKENS)
            for j in range(req.n):
                params = dict(req.params, max_tokens=max_tokens, logprobs=req.logprobs, top_logprobs=req.top_logprobs)
                if "seed" in params:  # n rows of one seeded request: distinct, reproducible draws
                    params["seed"] = (params["seed"] + j) % 2**32
                rows.append((ids, params))
        return await self.engine.submit(rows), sum(map(len, prompts))

    async def _complete(self, request, req, handles, shaper, t0, prompt_tokens, endpoint, shape=None):
        rows = [asyncio.ensure_future(self._drain(h, Timer(self.metrics, t0), shaper, i))
                for i, h in enumerate(handles)]
        everything = asyncio.gather(*rows)
        everything.add_done_callback(_retrieved)  # cancelled when the client leaves: no one else reads it
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait([everything, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            for h in handles:
                h.cancel()  # a no-op for those that ended
        if not everything.done():  # the client went away: its rows are cancelled, no one reads an answer
            everything.cancel()
            self.metrics.outcome(endpoint, "cancelled")
            return Response(status_code=499)
        try:
            results = everything.result()
        except Exception as e:
            return self._refuse(endpoint, _named(req, e), shape, req)
        if any(c.finish_reason == "cancelled" and i not in _repeated(shaper) for i, c in enumerate(results)):
            # the server ended it: shutting down
            self.metrics.outcome(endpoint, "cancelled")
            return cut_short().response(shape)
        self.metrics.outcome(endpoint, "ok")
        used = usage(prompt_tokens, sum(len(c.tokens) for c in results), _cached(req, results))
        return JSONResponse(shaper.completion([(i, c, req.logprobs) for i, c in enumerate(results)], used))

    async def _drain(self, handle, timer, shaper=None, i: int = 0):
        async for ev in handle:
            timer.tick()
            if shaper is not None and _watch(shaper, i, ev.text):  # a forced reply repeated a call: it ends here
                handle.cancel()
        return handle.result()

    async def _stream(self, req, handles, shaper, t0, prompt_tokens, endpoint):
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i, handle):
            timer = Timer(self.metrics, t0)
            async for ev in handle:
                timer.tick()
                if i in _repeated(shaper):  # stopped at a repeated call: what it wrote after is not read
                    continue
                if _watch(shaper, i, ev.text):
                    handle.cancel()
                events.put_nowait((i, ev))
            events.put_nowait((i, None))

        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
        outcome, generated = "cancelled", 0
        try:
            for chunk in shaper.opening(len(handles)):
                yield chunk
            left, failed, ready = len(handles), None, []
            while left:
                if ready and events.empty():  # the chunks of the events that came together: one write
                    yield "".join(ready)
                    ready = []
                i, ev = await self._next(events, shaper)
                if i is None:  # nothing for a while (a long prompt's prefill): tell the client the stream lives
                    ready += shaper.keepalive()
                    continue
                if ev is not None:  # a chunk per token, even one whose text waits for more bytes
                    ready += shaper.text_chunks(i, ev.text, logprobs=shaper.event_logprobs(ev))
                    continue
                left -= 1
                try:
                    c = handles[i].result()
                except Exception as e:  # this request's rows failed; the stream says so and ends
                    failed = from_exception(_named(req, e))
                    break
                if c.finish_reason == "cancelled" and i not in _repeated(shaper):  # the server ended it (shutting down)
                    failed = cut_short()
                    break
                generated += len(c.tokens)
                ready += shaper.end_chunks(i, c.finish_reason)
            if ready:
                yield "".join(ready)
            if failed is not None:
                outcome = "cancelled" if failed.code == "shutting_down" else "error"
                for chunk in shaper.failure(failed):
                    yield chunk
            else:
                outcome = "ok"
                results = [h.result() for h in handles]
                used = usage(prompt_tokens, generated, _cached(req, results)) if req.include_usage else None
                for chunk in shaper.closing(used, results):
                    yield chunk
        finally:
            for h in handles:
                h.cancel()  # the client left (or a row failed): free the slots at the next step
            for p in pumps:
                p.cancel()
            self.metrics.outcome(endpoint, outcome)

    @staticmethod
    async def _next(events: asyncio.Queue, shaper):
        """The next (row, event), or (None, None) after KEEPALIVE_SECONDS without one where the dialect has
        keep-alive events (Anthropic's ping: agents give up on a stream silent for a minute or two)."""
        if not shaper.keepalive():
            return await events.get()
        try:
            return await asyncio.wait_for(events.get(), KEEPALIVE_SECONDS)
        except asyncio.TimeoutError:
            return None, None

    # -- classification -------------------------------------------------------------

    async def classify(self, request: Request):
        handle = None
        try:
            self._authorize(request)
            req = parse_classify(await self._json(request), self.classify_limits)
            self._check_model(req.model)
            bound = self.engine.max_queue  # classify waits in its own line, as long as the engine's (0: unbounded)
            if bound and self._classify_pending >= bound:
                raise APIError(429, f"{bound} classification requests are already waiting; retry later",
                               type="rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": str(self.retry_after)})
            self._classify_pending += 1
            try:  # tokenizing thousands of inputs or labels takes a while: off the event loop
                handle = await asyncio.to_thread(self._submit_classify, req)
            except BaseException:
                self._classify_pending -= 1
                raise
            job = asyncio.ensure_future(handle)  # the Inferencer's worker runs it between decode steps
            job.add_done_callback(self._classify_done)
            gone = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait([job, gone], return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                handle.cancel()  # a no-op for a job that ended; else it stops before its next unit of work
            if not job.done():  # the client went away: no one reads an answer
                self.metrics.outcome("classify", "cancelled")
                return Response(status_code=499)
            try:
                results = job.result()
            except Cancelled:  # the server ended it: shutting down
                self.metrics.outcome("classify", "cancelled")
                return cut_short().response()
            for i, r in enumerate(results):
                if r.error is not None:
                    raise APIError(400, f"input[{i}]: {r.error}", param="input")
        except Exception as e:
            return self._refuse("classify", e)
        self.metrics.outcome("classify", "ok")
        tokens = sum(r.prompt_tokens for r in results)
        self.metrics.prompt_tokens.inc(tokens)
        return JSONResponse({"object": "list", "model": self.name,
                             "data": [{"index": i, "label": r.label, "scores": r.scores} for i, r in enumerate(results)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _classify_done(self, job):
        self._classify_pending -= 1
        if not job.cancelled():
            job.exception()  # read, so that a job whose client left logs nothing

    def _submit_classify(self, req):
        """On a thread of its own: tokenize, check the request's size, and hand the job to the Inferencer,
        whose worker runs it a unit at a time between decode steps."""
        prefix, rows = self._classify_tokens(req)
        return self.engine.submit_classify(rows, labels=req.labels, prefix=prefix, label_prefix=req.label_prefix)

    def _classify_tokens(self, req) -> tuple[list[int] | None, list]:
        """The prefix's and each input's ids, as Model.classify takes them (a sentence behind a prefix
        carries no BOS), and a 400 when the request would run more tokens than its limit allows."""
        from ..classify import encode_labels

        model, most = self.model, self.classify_limits.tokens
        try:
            label_ids = encode_labels(model, req.labels, req.label_prefix).ids
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="labels") from None
        try:
            prefix = None if req.prefix is None else model.encode_prompt(req.prefix, what="prefix")
        except InvalidRequestError as e:
            raise APIError(400, str(e), param="prefix") from None
        rows = []
        for text in req.inputs:
            try:
                rows.append(model.encode_prompt(text, add_special_tokens=prefix is None))
            except InvalidRequestError:  # a bad input: Model.classify reports it in its row, as input[i]
                rows.append(text)
        parts = {"prefix": len(prefix or ()), "input": sum(len(r) for r in rows if not isinstance(r, str)),
                 "labels": len(rows) * sum(len(ids) - 1 for ids in label_ids)}
        total = sum(parts.values())
        if total > most:
            param = max(parts, key=parts.get)
            raise APIError(400, f"this classify runs {total} tokens ({parts['input']} of input, {parts['prefix']} of "
                                f"prefix, {parts['labels']} of labels after their first token, for every input); this "
                                f"server runs at most {most} per request: send fewer or shorter inputs, or fewer "
                                f"multi-token labels", param=param)
        return prefix, rows

    # -- the shell --------------------------------------------------------------------

    def end_requests(self):
        """End every request now, each with its answer (a 503, or a stream's error event and ``[DONE]``):
        the server is shutting down and its grace period ran out.  Closes the Inferencer without draining
        and stops each classify before its next unit of work."""
        self.engine.end_requests()

    def _refuse(self, endpoint: str, e: BaseException, shape=None, req: GenerateRequest | None = None) -> Response:
        """The error response in the dialect's ``shape``, naming the request's keys as its client spelled them."""
        keys = {} if req is None else dict(max_tokens_key=req.max_tokens_param,
                                           prompt_key="messages" if req.chat else "prompt")
        err = from_exception(e, retry_after=self.retry_after, **keys)
        self.metrics.outcome(endpoint, {400: "invalid", 401: "unauthorized", 404: "invalid", 408: "invalid",
                                        413: "invalid", 429: "rejected"}.get(err.status, "error"))
        return err.response(shape)

    def _authorize(self, request: Request):
        check_key(request, self.api_key)

    def _check_model(self, name):
        if name is not None and name != self.name:
            serves = f"{self.name!r}" if len(self.served) == 1 else ", ".join(map(repr, self.served))
            raise APIError(404, f"the model {short(name)} does not exist; this server serves {serves}",
                           param="model", code="model_not_found")

    async def _json(self, request: Request) -> dict:
        return await read_json(request, self.max_body, self.read_timeout)


def _retrieved(future: asyncio.Future):
    """Mark ``future``'s outcome as read: a gather cancelled with its client ends holding a CancelledError
    that asyncio would otherwise log, with a traceback, as never retrieved."""
    if not future.cancelled():
        future.exception()


def _cached(req, results) -> int:
    """Prompt tokens served from the prefix cache, counted once per prompt as usage counts the prompt
    (the first of its ``n`` choices; results are prompt-major)."""
    return sum(c.cached_tokens for c in results[:: req.n])


def _named(req: GenerateRequest, e: BaseException) -> BaseException:
    """A constraint's error (a matcher that failed mid-output) names the field the client sent."""
    if isinstance(e, GrammarError):
        e.param = "tools" if req.tools and req.tool_choice != "auto" else req.constrained_by or e.param
    return e


def _repeated(shaper) -> set:
    """The choices a dialect's shaper stopped at a repeated forced call (chat's does; the others stop none)."""
    return getattr(shaper, "repeated", set())


def _watch(shaper, index: int, text: str) -> bool:
    """Whether choice ``index`` repeated a forced call with ``text`` (see :meth:`Shaper.watch`)."""
    watch = getattr(shaper, "watch", None)
    return watch is not None and watch(index, text)
