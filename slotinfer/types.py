"""Results handed back to callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    """One finished generation.

    ``tokens`` are the generated ids (the terminating EOS / stop token included);
    ``text`` is their text without the terminating token or stop string.
    ``finish_reason`` is ``"stop"`` (EOS, stop token or stop string), ``"length"``
    (``max_tokens`` or the context ran out) or ``"cancelled"``.
    """

    tokens: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those whose K/V came from the prefix cache
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    seed: int | None = None
    metrics: dict = field(default_factory=dict)
    error: Exception | None = None  # set (with finish_reason "error") only where a queue hands back failures
    request_id: object = None


@dataclass
class BatchResult:
    """One prompt's outcome in :meth:`Model.batch_generate`; ``error`` is set instead of raising
    (with ``finish_reason == "error"``)."""

    tokens: list[int]
    text: str
    finish_reason: str
    error: Exception | None = None


@dataclass
class ClassifyResult:
    """One prompt's outcome in :meth:`Model.classify`."""

    token: int | None
    logits: object = None  # numpy [vocab] when return_logits=True
    label: str | None = None
    scores: dict[str, float] | None = None
    error: Exception | None = None
    prompt_tokens: int = 0  # tokens the prompt ran as (prefix included)
