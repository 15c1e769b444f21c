"""One mapping from what goes wrong to an OpenAI-style error response.

Every error the server returns has the body ``{"error": {"message", "type", "param",
"code"}}`` and the status an OpenAI client expects (400 -> ``openai.BadRequestError``,
401 -> ``AuthenticationError``, 404 -> ``NotFoundError``, 429 -> ``RateLimitError``,
500 -> ``InternalServerError``).  slotinfer's typed errors map here and nowhere else.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ..errors import (EngineClosed, EngineError, InvalidRequestError, PromptTooLongError, QueueFull,
                      TokenizerError)
from ..request import short


# What an error may echo of a request is bounded: messages quote values through request.short, and any
# message past MAX_MESSAGE characters (an exception's text quoting what a client sent) keeps its start
# and its end, where the advice is.
MAX_MESSAGE, MAX_PARAM = 500, 100


def _capped(text: str, most: int) -> str:
    if len(text) <= most:
        return text
    tail = most // 4
    return text[:most - tail - 5] + " ... " + text[-tail:]


class APIError(Exception):
    """An error to answer with: HTTP status, message, and the OpenAI body's type/param/code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        message, param = _capped(message, MAX_MESSAGE), None if param is None else _capped(param, MAX_PARAM)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_param(param: str, message: str) -> APIError:
    """400 naming the parameter at fault."""
    return APIError(400, message, param=param)


def cut_short() -> APIError:
    """503 for a request the server ended before it finished: it was shutting down."""
    return APIError(503, "the server shut down before this request finished; send it again once the server is back "
                         "(or to another instance)", type="server_error", code="shutting_down")


def from_exception(e: BaseException, *, retry_after: int = 1, max_tokens_key: str = "max_tokens",
                   prompt_key: str = "prompt") -> APIError:
    """The response for an exception raised while taking or running a request.  ``max_tokens_key``
    and ``prompt_key``: how the client spelled them (``max_completion_tokens``; ``messages``), for
    the engine's errors that name them."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PromptTooLongError):
        param = getattr(e, "param", None)
        param = {"max_tokens": max_tokens_key, "prompt": prompt_key}.get(param, param)
        return APIError(400, e.describe(max_tokens_key), param=param, code="context_length_exceeded")
    if isinstance(e, (InvalidRequestError, TokenizerError)):  # request.check names the parameter in .param
        return APIError(400, str(e), param=getattr(e, "param", None))
    if isinstance(e, QueueFull):  # the library's advice (block=True) is no HTTP client's: say what one can do
        return APIError(429, f"the server is at capacity: every slot is busy and its admission queue is full; retry "
                             f"after the Retry-After header's {retry_after} s, or have the server started with a "
                             f"larger --max-queue", type="rate_limit_error", code="rate_limit_exceeded",
                        headers={"Retry-After": str(retry_after)})
    if isinstance(e, EngineClosed):
        return APIError(503, "the server is shutting down and takes no new requests", type="server_error",
                        code="shutting_down")
    if isinstance(e, EngineError):
        return APIError(500, str(e), type="server_error", code="engine_error")
    return APIError(500, f"internal error: {type(e).__name__}: {short(str(e), 200)}", type="server_error",
                    code="internal_error")
