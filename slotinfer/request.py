"""The parameters of a generation request: one table, and the check of a request against it.

Every entry point checks its parameters here — ``Inferencer.submit`` (through
:meth:`Engine.make_item`), ``Model.generate``, ``batch_generate``, ``classify``,
``serve_queue``, the HTTP server's schemas and ``slotinfer generate`` — so a value
is refused (or accepted) the same way wherever it comes from.  A refused value is
an :class:`~slotinfer.errors.InvalidRequestError` that names the parameter (its
``param`` attribute holds the name) and says what would be accepted.

Values are normalised: numpy scalars become Python numbers, ``stop`` a tuple of
strings, ``stop_token_ids`` a frozenset.  Every bound is one the decode step can
hold (``top_k`` fits the vocabulary, ``seed`` a uint32, floats a float32), so a
request that passes cannot fail the step that it shares with others.

    >>> from slotinfer import request
    >>> request.check({"temperature": 0.7, "top_k": 40}, vocab=32000)["top_k"]
    40
"""

from __future__ import annotations

import asyncio
import difflib
import itertools
import json
import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequestError

VOCAB = "vocab"  # an upper bound that is the model's vocabulary size
MAX_INT = 2**31 - 1  # the decode step holds counts as int32
MAX_STOPS = 64  # each stop string is searched for after every token
MAX_SALT = 256
MAX_GRAMMAR = 1 << 20  # characters of a JSON schema, regex or grammar; compiling is bounded in time too
MAX_CHOICES = 4096
MAX_BIAS = 1024  # token ids one logit_bias may name (OpenAI's API allows 300)
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar")  # at most one per request
# a logit_bias key as JSON carries a token id: "5", not " 5", "+5", "05" or full-width digits
_TOKEN_ID_TEXT = re.compile(r"0|[1-9][0-9]{0,10}")


@dataclass(frozen=True)
class Param:
    """One request parameter: its kind, the values it takes, its default and what it means."""

    name: str
    kind: str  # int, float, bool, seed, stop, token_ids, salt, schema, grammar, choice, bias, callback, loop, timeout
    default: object
    meaning: str
    lo: float | None = None
    hi: float | str | None = None  # a number, or VOCAB
    lo_open: bool = False
    hi_open: bool = False


TABLE = (
    Param("max_tokens", "int", 256, "the most tokens to generate (fewer where the context ends first)", 1, MAX_INT),
    Param("temperature", "float", 0.0, "0 is greedy; above 0 a seeded draw, flatter as it grows", 0.0, 1e6),
    Param("top_k", "int", 0, "draw among the k likeliest tokens only (0 disables it)", 0, VOCAB),
    Param("top_p", "float", 1.0, "draw within the smallest set of tokens holding this probability mass "
                                 "(1 disables it)", 1e-6, 1.0),
    Param("min_p", "float", 0.0, "drop tokens below this fraction of the likeliest one's probability "
                                 "(0 disables it)", 0.0, 1.0, hi_open=True),
    Param("repetition_penalty", "float", 1.0, "divide the logits of tokens already seen (> 1 discourages "
                                              "repeats; 1 disables it)", 1e-6, 1e6),
    Param("seed", "seed", None, "the seed of the draw (None: a random one, reported on the completion)",
          0, 2**32 - 1),
    Param("presence_penalty", "float", 0.0, "subtract this from the logits of tokens generated so far (> 0 "
                                            "discourages repeats; 0 disables it)", -2.0, 2.0),
    Param("frequency_penalty", "float", 0.0, "subtract this times each token's count so far in the output from "
                                             "its logit (0 disables it)", -2.0, 2.0),
    Param("logit_bias", "bias", None, f"a dict of up to {MAX_BIAS} token id: bias in [-100, 100], added to "
                                      "those tokens' logits (-100 in effect bans a token)", -100.0, 100.0),
    Param("json_schema", "schema", None, "the output is JSON valid against this schema (a dict, or its JSON "
                                         "text); {\"type\": \"object\"} asks for any JSON object"),
    Param("regex", "grammar", None, "the output matches this regular expression in full"),
    Param("choice", "choice", None, f"the output is exactly one of these strings (a list of 1 to {MAX_CHOICES})"),
    Param("grammar", "grammar", None, "the output follows this Lark grammar (llguidance's dialect, where "
                                      "%json {...} embeds a JSON schema)"),
    Param("stop", "stop", None, f"a string, or a list of up to {MAX_STOPS}, that ends the text (left out of it)"),
    Param("stop_token_ids", "token_ids", (), "token ids that end generation (kept in the tokens)", 0, VOCAB,
          hi_open=True),
    Param("ignore_eos", "bool", False, "go on past the model's end-of-sequence tokens"),
    Param("skip_special_tokens", "bool", True, "leave special tokens such as <|im_end|> out of the text"),
    Param("logprobs", "bool", False, "report each generated token's log-probability"),
    Param("top_logprobs", "int", 0, "also report the n likeliest alternatives of each token", 0, VOCAB),
    Param("cache_salt", "salt", None, "requests share cached prompt K/V only with requests of the same salt "
                                      "(None: the shared default); a string of up to 256 characters"),
    Param("on_token", "callback", None, "a callable run with each StreamEvent, on the worker thread"),
    Param("loop", "loop", None, "the asyncio event loop that awaits the handle (async streaming)"),
    Param("block", "bool", True, "with a full admission queue: wait for room (True) or raise QueueFull"),
    Param("timeout", "timeout", None, "the most seconds to wait for room in a full admission queue (None: no "
                                      "limit)", 0.0, 1e9),
)
PARAMS = {p.name: p for p in TABLE}

SAMPLING = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")  # SamplingParams' order
ADJUST = ("presence_penalty", "frequency_penalty", "logit_bias")  # per-row logit changes of the decode step
GENERATE = (*SAMPLING, *ADJUST, *CONSTRAINTS, "max_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens")
ENGINE = (*GENERATE, "logprobs", "top_logprobs", "cache_salt", "on_token", "loop")  # Engine.make_item, batch_generate
SUBMIT = (*ENGINE, "block", "timeout")


def check(params: Mapping, vocab: int | None = None, *, names=ENGINE, what: str = "request") -> dict:
    """Every parameter of ``names``, checked and normalised, defaults filled in.

    ``params`` may hold only names of ``names`` (anything else is refused, with the
    close match suggested).  ``vocab`` bounds the token-id parameters; None checks
    everything else (for values set before a model is loaded).
    """
    check_names(params, names, what)
    out = {name: check_value(name, params.get(name, PARAMS[name].default), vocab) for name in names}
    given = [k for k in CONSTRAINTS if out.get(k) is not None]
    if len(given) > 1:
        raise _bad(given[1], f"a request takes at most one of {', '.join(CONSTRAINTS)}; got {' and '.join(given)}")
    return out


def check_names(params, names=ENGINE, what: str = "request"):
    """Refuse anything but a mapping whose keys are all parameter names of ``names``."""
    if not isinstance(params, Mapping):
        raise _bad(None, f"the {what} parameters must be a dict of name: value, got {short(params)}")
    odd = [k for k in params if not isinstance(k, str)]
    if odd:
        raise _bad(None, f"{what} parameter names must be strings, got {some(odd)}")
    unknown = [k for k in params if k not in names]
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        word = "parameter" if len(unknown) == 1 else "parameters"
        raise _bad(unknown[0], f"unknown {what} {word} {some(unknown)}{hint}; the {what} parameters are "
                               f"{', '.join(names)}")


def check_value(name: str, value, vocab: int | None = None):
    """``value`` as parameter ``name`` takes it (normalised), or an InvalidRequestError naming ``name``."""
    p = PARAMS[name]
    hi = (vocab if vocab is not None else MAX_INT) if p.hi == VOCAB else p.hi
    if p.kind == "int" or p.kind == "seed" and value is not None:
        return _int(p, value, hi)
    if p.kind == "seed" or p.kind == "timeout" and value is None:
        return None
    if p.kind in ("float", "timeout"):
        return _float(p, value, hi)
    if p.kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise _bad(name, f"{name} must be True or False, got {short(value)}")
        return bool(value)
    if p.kind == "stop":
        return _stop(value)
    if p.kind == "token_ids":
        return _token_ids(value, hi)
    if p.kind == "schema":
        return _schema(value)
    if p.kind == "grammar":
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_GRAMMAR):
            raise _bad(name, f"{name} must be None or a non-empty string of at most {MAX_GRAMMAR:,} characters "
                             f"({p.meaning}), got {short(value)}")
        return value
    if p.kind == "choice":
        return _choice(value)
    if p.kind == "bias":
        return _bias(p, value, vocab if vocab is not None else MAX_INT)
    if p.kind == "salt":
        if value is not None and (not isinstance(value, str) or len(value) > MAX_SALT):
            raise _bad(name, f"cache_salt must be None or a string of at most {MAX_SALT} characters, got "
                             f"{short(value)}")
        return value
    if p.kind == "callback":
        if value is not None and not callable(value):
            raise _bad(name, f"on_token must be a callable taking a StreamEvent, or None; got {short(value)}")
        return value
    if p.kind == "loop":
        if value is not None and (not isinstance(value, asyncio.AbstractEventLoop) or value.is_closed()):
            raise _bad(name, f"loop must be an open asyncio event loop (asyncio.get_running_loop()), or None; "
                             f"got {short(value)}")
        return value
    raise AssertionError(f"unknown kind {p.kind!r} of {name}")


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int(p: Param, value, hi):
    if not _is_int(value) or not p.lo <= value <= hi:
        none = "None or " if p.kind == "seed" else ""
        raise _bad(p.name, f"{p.name} must be {none}an int in [{p.lo}, {hi}] ({p.meaning}), got {short(value)}")
    return int(value)


def _float(p: Param, value, hi):
    x = None
    if _is_int(value) or isinstance(value, (float, np.floating)):
        try:
            x = float(value)
        except OverflowError:
            pass
    low_ok = x is not None and (x > p.lo if p.lo_open else x >= p.lo)
    if x is None or not math.isfinite(x) or not low_ok or not (x < hi if p.hi_open else x <= hi):
        span = f"{'(' if p.lo_open else '['}{p.lo:g}, {hi:g}{')' if p.hi_open else ']'}"
        raise _bad(p.name, f"{p.name} must be a number in {span} ({p.meaning}), got {short(value)}")
    return x


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = None
    if isinstance(value, str):
        stops = (value,)
    elif not isinstance(value, (bytes, bytearray, Mapping)):
        try:
            stops = tuple(itertools.islice(value, MAX_STOPS + 1))
        except TypeError:
            pass
    if stops is None or not 0 < len(stops) <= MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", f"stop must be a non-empty string or a list of 1 to {MAX_STOPS} of them, "
                           f"got {short(value)}")
    return tuple(str(s) for s in stops)


def _token_ids(value, hi) -> frozenset[int]:
    ids = None
    if not isinstance(value, (str, bytes, bytearray, Mapping)):
        try:
            ids = tuple(value)
        except TypeError:
            pass
    if ids is None or not all(_is_int(t) and 0 <= t < hi for t in ids):
        raise _bad("stop_token_ids", f"stop_token_ids must be a list of token ids in [0, {hi}), got {short(value)}")
    return frozenset(int(t) for t in ids)


def _schema(value):
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > MAX_GRAMMAR:
            raise _bad("json_schema", f"json_schema must be at most {MAX_GRAMMAR:,} characters of JSON, got "
                                      f"{len(value):,}")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            raise _bad("json_schema", f"json_schema is not valid JSON text: {str(e)[:160]}") from None
    if isinstance(value, bool):  # a JSON schema may be true (anything) or false (nothing)
        raise _bad("json_schema", "json_schema must be a schema object such as {\"type\": \"object\"}, got "
                                  f"{value!r}")
    if not isinstance(value, Mapping):
        raise _bad("json_schema", f"json_schema must be a JSON schema object (a dict or its JSON text), got "
                                  f"{short(value)}")
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError) as e:
        raise _bad("json_schema", f"json_schema must hold JSON values only: {str(e)[:160]}") from None
    if len(text) > MAX_GRAMMAR:
        raise _bad("json_schema", f"json_schema must be at most {MAX_GRAMMAR:,} characters of JSON, got "
                                  f"{len(text):,}")
    return text  # canonical text: what the grammar compiler reads and its cache is keyed by


def _choice(value):
    if value is None:
        return None
    items = None
    if not isinstance(value, (str, bytes, bytearray, Mapping)):
        try:
            items = tuple(itertools.islice(value, MAX_CHOICES + 1))
        except TypeError:
            pass
    if items is None or not 0 < len(items) <= MAX_CHOICES or not all(isinstance(c, str) and c for c in items) \
            or sum(map(len, items)) > MAX_GRAMMAR:
        raise _bad("choice", f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings (the output is "
                             f"exactly one of them), got {short(value)}")
    return tuple(items)


def _bias(p: Param, value, vocab: int):
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) > MAX_BIAS:
        raise _bad("logit_bias", f"logit_bias must be a dict of at most {MAX_BIAS} token id: bias, got "
                                 f"{short(value)}")
    out = {}
    for k, v in value.items():
        tid = int(k) if isinstance(k, str) and _TOKEN_ID_TEXT.fullmatch(k) else k
        if not _is_int(tid) or not 0 <= tid < vocab:
            raise _bad("logit_bias", f"logit_bias keys must be token ids in [0, {vocab}) (ints, or their "
                                     f"decimal text such as \"5\": no sign, spaces or leading zeros), got {short(k)}")
        try:
            out[int(tid)] = _float(p, v, p.hi)
        except InvalidRequestError:
            raise _bad("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {short(v)} for "
                                     f"token {tid}") from None
    return out


def _bad(name, message: str) -> InvalidRequestError:
    e = InvalidRequestError(message)
    e.param = name
    return e


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlong = 40


def short(value, limit: int = 80) -> str:
    """A repr of ``value`` of at most ``limit`` characters, safe for any object."""
    try:
        text = _repr.repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails (an int too long for str()...) still reads as a type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def some(items, n: int = 3) -> str:
    """The first ``n`` of ``items`` (short reprs), then how many more."""
    shown = ", ".join(short(x, 40) for x in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")
