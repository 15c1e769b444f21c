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


# -- requests --------------------------------------------------------------

class InvalidRequestError(SlotinferError, ValueError):
    """A prompt or its parameters are invalid (empty prompt, bad sampling value...)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's or engine's context."""


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
