"""Text <-> token ids for a Hugging Face model folder.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` read from ``tokenizer.json`` and
adds what the folder's other files say: the BOS/EOS/PAD tokens
(``tokenizer_config.json``, ``special_tokens_map.json``, the ``eos_token_id`` of
``generation_config.json``/``config.json``) and the chat template
(``chat_template.jinja``, else ``tokenizer_config.json``, else ``chat_template.json``).

BOS is added exactly as the ``tokenizer.json`` post-processor says (Llama 3 and
Gemma add one, Qwen none), and never twice: a text that already starts with the
BOS token string (a rendered chat template usually does) keeps a single BOS.

:class:`StreamingDetokenizer` turns a stream of ids into text deltas that never
end inside a UTF-8 sequence; joined (plus :meth:`~StreamingDetokenizer.flush`)
they equal :meth:`Tokenizer.decode` of all the ids.

Why one module: special tokens, the chat template and the streaming detokenizer all read the
same tokenizer files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

from .._files import read_json
from ..errors import ConfigError, InvalidRequestError, ModelNotFoundError, TokenizerError

__all__ = ["Tokenizer", "StreamingDetokenizer"]

_REPLACEMENT = "\ufffd"
# Characters past which encode lets other threads run meanwhile: tokenizers' encode holds the GIL
# (seconds for a few MB, every thread of a server stalled), its encode_batch releases it.
_LONG_TEXT = 1 << 16
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _read_optional_object(path: Path) -> dict:
    """A JSON object file that a checkpoint may lack ({} then)."""
    if not path.is_file():
        return {}
    value = read_json(path, error=TokenizerError)
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return value


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config / special_tokens_map: a string,
    an AddedToken dict (``{"content": ...}``), or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def declared_eos_ids(folder: Path) -> list[int]:
    """The EOS ids a model folder declares: ``eos_token_id`` of generation_config.json and
    config.json (and their ``text_config``), each a token id or a list of them.  The one place
    they are read; any other value is a :class:`ConfigError` naming the file."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.exists():
            continue
        data = read_json(path, error=ConfigError)
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a JSON object; restore it from the checkpoint")
        text = data.get("text_config")
        for where, source in ((name, data), (f"{name} text_config", text if isinstance(text, dict) else {})):
            val = source.get("eos_token_id")
            vals = val if isinstance(val, list) else [] if val is None else [val]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
                raise ConfigError(f"{where}: 'eos_token_id' must be a token id or a list of token ids, got {val!r}")
            ids += vals
    return ids


def _check_unicode(text: str) -> None:
    """Raise InvalidRequestError if ``text`` holds lone surrogates (what Python makes of undecodable bytes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"the text is not valid Unicode: it contains lone surrogates ({text[e.start:e.end]!r} at position "
            f"{e.start}), typically from bytes that were not valid UTF-8 (undecodable command-line or stdin input); "
            "pass valid UTF-8 text"
        ) from None


def _contains_type(node: Any, type_name: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence) has a part of this type."""
    if isinstance(node, Mapping):
        if node.get("type") == type_name:
            return True
        return any(_contains_type(v, type_name) for v in node.values() if isinstance(v, (Mapping, list)))
    if isinstance(node, list):
        return any(_contains_type(v, type_name) for v in node)
    return False


def _pick_template(value: Any, source: str) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` (use "default")."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default")
        if chosen is None and named:
            chosen = next(iter(named.values()))
        if isinstance(chosen, str):
            return chosen
    raise TokenizerError(f"{source}: 'chat_template' must be a string or a list of named templates")


# -- chat template rendering ------------------------------------------------

_JINJA_ENV = None


def _jinja_env():
    """The sandbox of chat templates (see :mod:`slotinfer.text.templates`), built once."""
    global _JINJA_ENV
    if _JINJA_ENV is None:
        from jinja2.ext import loopcontrols

        from .templates import sandboxed_environment

        _JINJA_ENV = sandboxed_environment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    return _JINJA_ENV


# -- the tokenizer ----------------------------------------------------------

class Tokenizer:
    """The tokenizer of one model folder.  Build it with :meth:`from_folder`."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        byte_fallback: bool = False,
        source: str = "tokenizer",
    ):
        self._tok = tokenizer
        self._source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.chat_template = chat_template
        self._compiled_template = None

        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

        # What the post-processor puts in front of a text.
        with_special = tokenizer.encode("a", add_special_tokens=True).ids
        plain = tokenizer.encode("a", add_special_tokens=False).ids
        prefix: list[int] = []
        if plain and len(with_special) > len(plain):
            for i in range(len(with_special) - len(plain) + 1):
                if with_special[i:i + len(plain)] == plain:
                    prefix = with_special[:i]
                    break

        bos_id = self.token_to_id(bos_token) if bos_token is not None else None
        if bos_id is None and len(prefix) == 1:
            bos_id = prefix[0]
            self.bos_token = self.id_to_token(bos_id)
        self.bos_id: int | None = bos_id
        self._adds_bos = bos_id is not None and bool(prefix) and prefix[0] == bos_id

        eos: set[int] = set()
        if eos_token is not None:
            eid = self.token_to_id(eos_token)
            if eid is not None:
                eos.add(eid)
        eos.update(i for i in extra_eos_ids if 0 <= i < self.vocab_size)
        self.eos_ids: set[int] = eos
        self.eos_id: int | None = self.token_to_id(eos_token) if eos_token is not None else (min(eos) if eos else None)
        self.pad_id: int | None = self.token_to_id(pad_token) if pad_token is not None else None

        # Ids of <0xNN> byte tokens when the decoder reassembles them (byte fallback).
        self._byte_ids: frozenset[int] = frozenset()
        if byte_fallback:
            vocab = tokenizer.get_vocab(with_added_tokens=False)
            self._byte_ids = frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))
        self._special_ids: frozenset[int] = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        )

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        """Read the tokenizer files of a Hugging Face model folder."""
        folder = Path(path)
        if not folder.is_dir():
            raise ModelNotFoundError(f"model folder {folder} does not exist (or is not a directory)")
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(
                f"{tj} is missing: slotinfer needs the fast-tokenizer file tokenizer.json; "
                "copy it from the original checkpoint (or convert the slow tokenizer with "
                "transformers: AutoTokenizer.from_pretrained(...).save_pretrained(folder))"
            )
        raw = read_json(tj, error=TokenizerError)
        if not isinstance(raw, dict) or "model" not in raw:
            raise TokenizerError(f"{tj} is not a tokenizers file (no 'model' section); re-download it")
        try:
            tok = tokenizers.Tokenizer.from_str(json.dumps(raw))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise TokenizerError(
                f"{tj} could not be loaded by tokenizers {tokenizers.__version__}: {e}; "
                "re-download it, or upgrade the tokenizers package if the file is newer"
            ) from None

        cfg_path = folder / "tokenizer_config.json"
        config = _read_optional_object(cfg_path)
        special_map = _read_optional_object(folder / "special_tokens_map.json")

        def special(name: str) -> str | None:
            value = _token_content(config.get(name))
            if value is None:
                value = _token_content(special_map.get(name))
            return value

        template: str | None = None
        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():
            try:
                template = jinja_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"cannot read {jinja_path}: {e}") from None
        if template is None:
            template = _pick_template(config.get("chat_template"), str(cfg_path))
        if template is None:
            ct_json = folder / "chat_template.json"
            if ct_json.is_file():
                data = read_json(ct_json, error=TokenizerError)
                if isinstance(data, dict):
                    template = _pick_template(data.get("chat_template"), str(ct_json))

        # End-of-sequence ids the model folder declares (e.g. Llama 3's <|eot_id|> and
        # <|end_of_text|>, Gemma 3's <eos> and <end_of_turn>).
        extra_eos = declared_eos_ids(folder)

        model = raw.get("model") or {}
        byte_fallback = bool(model.get("byte_fallback")) and _contains_type(raw.get("decoder"), "ByteFallback")

        return cls(
            tok,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            chat_template=template,
            extra_eos_ids=extra_eos,
            byte_fallback=byte_fallback,
            source=str(folder),
        )

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], source: str) -> "Tokenizer":
        """The tokenizer a GGUF file's metadata describes (:mod:`slotinfer.text.gguf_tokenizer` rebuilds it)."""
        from .gguf_tokenizer import build

        return cls(**build(dict(metadata), source))

    # -- encoding / decoding --------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor's BOS
        is added unless ``text`` already starts with the BOS token."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a str, got {type(text).__name__}")
        try:
            if len(text) > _LONG_TEXT:
                ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            else:
                ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # tokenizers' answer to lone surrogates: "TextInputSequence must be str"
            _check_unicode(text)
            raise
        if (add_special_tokens and self._adds_bos and len(ids) >= 2
                and ids[0] == self.bos_id and ids[1] == self.bos_id
                and self.bos_token is not None and text.startswith(self.bos_token)):
            ids = ids[1:]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``.  Ids outside the vocabulary (e.g. in the padded rows of the
        embedding) decode to nothing."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        try:
            return self._tok.token_to_id(token)
        except UnicodeEncodeError:  # lone surrogates: no token is spelled so
            return None

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def is_byte_token(self, token_id: int) -> bool:
        return token_id in self._byte_ids

    def detokenizer(self, *, skip_special_tokens: bool = False) -> "StreamingDetokenizer":
        """A fresh incremental decoder for one generated sequence."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # -- chat templates ---------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **extra: Any,
    ) -> str | list[int]:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the model's
        chat template; ``tokenize=True`` returns the ids (BOS once)."""
        if self.chat_template is None:
            raise TokenizerError(
                f"{self._source} has no chat template (looked for chat_template.jinja, the "
                "'chat_template' key of tokenizer_config.json, and chat_template.json); "
                "pass a plain prompt instead, or add a template to the folder"
            )
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise InvalidRequestError(f"messages[{i}] must be a dict with a 'role' (and usually a 'content')")
        template = self._template()
        context = dict(extra)
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(self, name)
            if value is not None:
                context.setdefault(name, value)
        import jinja2

        from .templates import render

        try:
            text = render(template, context)
        except InvalidRequestError:  # raise_exception, and TemplateError past a limit
            raise
        except jinja2.UndefinedError as e:
            raise InvalidRequestError(
                f"the chat template needs something these messages (or keyword arguments) lack: {e}"
            ) from None
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template of {self._source} failed to render: {e}") from None
        except (TypeError, KeyError, AttributeError, ValueError, IndexError, ArithmeticError) as e:
            raise InvalidRequestError(f"the chat template could not render these messages: {e!r}") from None
        if tokenize:
            return self.encode(text, add_special_tokens=True)
        return text

    def _template(self):
        if self._compiled_template is None:
            import jinja2

            from .templates import compile_template

            try:
                self._compiled_template = compile_template(_jinja_env(), self.chat_template)
            except (jinja2.TemplateError, InvalidRequestError) as e:  # InvalidRequestError: nested too deeply
                raise TokenizerError(
                    f"the chat template of {self._source} is not valid Jinja: {e}; fix chat_template.jinja "
                    "or the 'chat_template' key of tokenizer_config.json"
                ) from None
        return self._compiled_template

    def __repr__(self) -> str:
        return (f"Tokenizer({self._source!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_ids={sorted(self.eos_ids)}, chat_template={'yes' if self.chat_template else 'no'})")


class StreamingDetokenizer:
    """Incremental decoding of one sequence of generated ids.

    ``add(id)`` returns the text that became final with this id (possibly ``""``);
    it never ends inside a multi-byte character.  ``flush()`` returns what is left.
    ``"".join(deltas) + flush()`` equals ``tokenizer.decode(ids)``.

    How: the pending ids (plus a few already-emitted context ids) are decoded as a
    window; the new suffix is emitted unless the window text ends in U+FFFD (an
    unfinished UTF-8 sequence) or, for byte-fallback vocabularies, in a ``<0xNN>``
    token (a later byte could still turn the whole byte run into U+FFFDs).  After an
    emission the window shrinks to its shortest cleanly-decoding tail, so each step
    decodes a handful of ids.
    """

    _MAX_CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = []
        self._window_text = ""  # decode(self._window) already emitted
        self._last_real: int | None = None  # last id that decodes to something
        self.text = ""
        self.token_ids: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        token_id = int(token_id)
        self.token_ids.append(token_id)
        self._window.append(token_id)
        tok = self._tokenizer
        # Ids that decode to nothing (skipped specials, ids past the vocabulary) do not
        # end a run of byte tokens.
        if not (self._skip and token_id in tok._special_ids) and 0 <= token_id < tok.vocab_size:
            self._last_real = token_id
        if self._last_real is not None and self._last_real in tok._byte_ids:
            return ""
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT):
            return ""
        # decode(window) extends decode(context) for the supported decoders; were it
        # not to, emitting past the context's length is still the best we can do.
        delta = text[len(self._window_text):]
        self.text += delta
        self._reanchor(text)
        return delta

    def _reanchor(self, text: str) -> None:
        window = self._window
        for k in range(1, min(self._MAX_CONTEXT, len(window)) + 1):
            tail = window[-k:]
            tail_text = text if k == len(window) else self._decode(tail)
            if tail_text and _REPLACEMENT not in tail_text and text.endswith(tail_text):
                self._window = tail
                self._window_text = tail_text
                return
        self._window = []
        self._window_text = ""

    def flush(self) -> str:
        """The text still held back (an unfinished character decodes to U+FFFD)."""
        if not self._window:
            return ""
        text = self._decode(self._window)
        delta = text[len(self._window_text):]
        self.text += delta
        self._window = []
        self._window_text = ""
        self._last_real = None
        return delta

    def reset(self) -> None:
        self._window = []
        self._window_text = ""
        self._last_real = None
        self.text = ""
        self.token_ids = []
