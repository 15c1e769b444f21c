"""The errors slotinfer raises.

Every error is a :class:`SlotinferError`; each also derives from the built-in
exception a caller would naturally catch (``FileNotFoundError``, ``ValueError``,
...), so ``except ValueError`` keeps working.  Messages say what was wrong and
how to fix it.
"""

from __future__ import annotations


class SlotinferError(Exception):
    """Base class of every error slotinfer raises."""


# -- loading ---------------------------------------------------------------

class ModelLoadError(SlotinferError):
    """A model folder could not be loaded."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model folder, or a file it must contain, does not exist."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """``config.json`` names an architecture slotinfer does not implement."""


class ConfigError(ModelLoadError, ValueError):
    """``config.json`` (or another JSON file of the folder) is malformed."""


class WeightError(ModelLoadError, ValueError):
    """A tensor is missing, unexpected, of the wrong shape, or unreadable."""


class TokenizerError(ModelLoadError, ValueError):
    """The tokenizer files are missing, malformed, or do not fit the model."""


# -- settings --------------------------------------------------------------

class SettingError(SlotinferError, ValueError):
    """A ``SLOTINFER_*`` environment variable holds a value it cannot take."""


# -- requests --------------------------------------------------------------

class InvalidRequestError(SlotinferError, ValueError):
    """A prompt or its parameters are invalid (empty prompt, bad sampling value...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's or engine's context.

    Raised by the engine's check it carries its numbers: ``prompt_tokens``, ``max_tokens`` (as asked),
    ``limit`` (tokens) and ``setting`` (the engine setting that sets it: ``max_len`` or
    ``kv_cache_bytes``), ``need`` (the tokens the request needs there), ``most`` (the largest ``max_tokens`` that fits; None when the prompt alone
    does not) and ``param`` (``max_tokens``, or ``prompt`` when the prompt alone does not fit).
    :meth:`describe` words the message for a caller who spells ``max_tokens`` otherwise.
    """

    def __init__(self, message: str = "", *, prompt_tokens: int | None = None, max_tokens: int | None = None,
                 limit: int | None = None, setting: str | None = None, need: int | None = None,
                 most: int | None = None, param: str | None = None, pool_bytes: int | None = None):
        self.prompt_tokens, self.max_tokens, self.limit, self.setting = prompt_tokens, max_tokens, limit, setting
        self.need, self.most, self.pool_bytes = need, most, pool_bytes
        if param is not None:
            self.param = param
        super().__init__(message or self.describe())

    def describe(self, key: str = "max_tokens") -> str:
        """The message, naming the caller's own key for ``max_tokens`` (a server's client may send
        ``max_completion_tokens``)."""
        if self.prompt_tokens is None:
            return str(self.args[0]) if self.args else ""
        n, limit, setting = self.prompt_tokens, self.limit, self.setting
        what = (f"{self.need} > the engine's max_len {limit}" if setting == "max_len" else
                f"their K/V need {self.need} tokens and the engine's whole K/V pool holds {limit} "
                f"(kv_cache_bytes={self.pool_bytes})" if setting == "kv_cache_bytes" else f"{self.need} > {limit}")
        head = f"the prompt has {n} tokens and {key} is {self.max_tokens}: {what}"
        if self.most is None:
            return (f"{head}, and the prompt alone leaves no room for one token: shorten the prompt to at most "
                    f"{self.most_prompt} tokens or raise {setting}")
        return f"{head}; shorten the prompt, lower {key} (to at most {self.most}) or raise {setting}"

    @property
    def most_prompt(self) -> int:
        """The longest prompt that fits with one token to generate."""
        return self.limit - 1 if self.setting == "max_len" else self.limit


class TemplateError(InvalidRequestError):
    """A chat or prompt template ran past its time or size limit (the message names the variable
    that raises it), or nested too deeply."""


class GrammarError(InvalidRequestError):
    """A JSON schema, regex, choice list or grammar that does not compile, or that takes longer to
    compile than ``SLOTINFER_GRAMMAR_SECONDS`` allows (``param`` names which)."""


# -- engine ----------------------------------------------------------------

class QueueFull(SlotinferError):
    """The admission queue is full and the caller asked not to block."""


class GrammarBusy(QueueFull):
    """Too many constraints are compiling or waiting to compile at once: retry in a few seconds."""


class EngineClosed(SlotinferError, RuntimeError):
    """The Inferencer was closed; it takes no more requests."""


class Cancelled(SlotinferError):
    """The request was cancelled before it finished."""


class OutOfMemoryError(SlotinferError, MemoryError):
    """What the engine would reserve (its K/V slot table) does not fit in the memory available."""


class EngineError(SlotinferError, RuntimeError):
    """The engine failed while running a request (the message carries the cause)."""
