"""A GGUF file's tokenizer metadata -> a ``tokenizers.Tokenizer`` and the special tokens around it.

llama.cpp stores the vocabulary instead of a ``tokenizer.json``: ``tokenizer.ggml.model``
(``gpt2``: byte-level BPE with its merges; ``llama``: a SentencePiece vocabulary with
scores and byte tokens), the token types (control tokens are special, user-defined ones
are matched whole), a named pre-tokenizer (``tokenizer.ggml.pre``), the special ids and
add-BOS/EOS flags.  Each part is rebuilt here as the model's own ``tokenizer.json``
spells it, so the result goes through the same :class:`~slotinfer.text.tokenizer.Tokenizer`
and streaming detokenizer as a Hugging Face folder.  A pre-tokenizer not in
:data:`PRE_TOKENIZERS` is refused: a wrong split gives wrong ids without any error.
"""

from __future__ import annotations

from dataclasses import dataclass

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from ..errors import TokenizerError

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# End-of-turn markers of the chat templates in use; the first one the template writes and the
# vocabulary holds also ends generation (a GGUF's eos id is often the end of text instead).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>", "<|END_OF_TURN_TOKEN|>")


@dataclass(frozen=True)
class Pre:
    """How a byte-level vocabulary splits text before BPE (its ``tokenizer.json``'s pre-tokenizer)."""

    split: str | None = None  # regex, isolated; None: GPT-2's own regex inside ByteLevel
    digits: bool = False  # every digit on its own first (SmolLM)
    nfc: bool = False
    ignore_merges: bool = False  # a word that is a whole token stays one (Llama 3)


_GPT2 = Pre()
_LLAMA3 = Pre(split=_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = Pre(split=_QWEN2_SPLIT, nfc=True)
PRE_TOKENIZERS = {"default": _GPT2, "gpt-2": _GPT2, "gpt2": _GPT2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                  "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3, "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
                  "smollm": Pre(digits=True)}


def build(meta: dict, source: str) -> dict:
    """The keyword arguments of :class:`~slotinfer.text.tokenizer.Tokenizer` for a GGUF's metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not isinstance(tokens, list) or not tokens:
        missing = "tokenizer.ggml.model" if kind is None else "tokenizer.ggml.tokens"
        raise TokenizerError(f"{source}: metadata key {missing!r} is missing; the file carries no tokenizer, "
                             "re-convert it with llama.cpp's convert_hf_to_gguf.py")
    types = _numbers(meta.get("tokenizer.ggml.token_type"), len(tokens), "tokenizer.ggml.token_type", source)
    if kind == "gpt2":
        tok = _byte_level(meta, tokens, source)
    elif kind == "llama":
        tok = _sentencepiece(meta, tokens, source)
    else:
        raise TokenizerError(f"{source}: tokenizer.ggml.model = {kind!r} is not supported (supported: gpt2, llama)")
    types = types or [1] * len(tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

    ids = {name: _token_id(meta, f"tokenizer.ggml.{key}", len(tokens), source)
           for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                             ("unk", "unknown_token_id"), ("eot", "eot_token_id"), ("eom", "eom_token_id"))}
    add_bos = bool(_flag(meta, "tokenizer.ggml.add_bos_token", kind == "llama", source)) and ids["bos"] is not None
    add_eos = bool(_flag(meta, "tokenizer.ggml.add_eos_token", False, source)) and ids["eos"] is not None
    pieces = ([f"{tokens[ids['bos']]}:0"] if add_bos else []) + ["$A:0"] + ([f"{tokens[ids['eos']]}:0"] if add_eos else [])
    post = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
    if add_bos or add_eos:
        specials = {tokens[ids[k]]: ids[k] for k, on in (("bos", add_bos), ("eos", add_eos)) if on}
        post.append(processors.TemplateProcessing(single=" ".join(pieces), special_tokens=list(specials.items())))
    if post:
        tok.post_processor = processors.Sequence(post)

    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: tokenizer.chat_template must be a string, got {type(template).__name__}")
    extra = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]
    turn_end = next((t for t in _END_OF_TURN if template and t in template and tok.token_to_id(t) is not None), None)
    if turn_end is not None:
        extra.append(tok.token_to_id(turn_end))

    def name(k):
        return tokens[ids[k]] if ids[k] is not None else None

    return dict(tokenizer=tok, bos_token=name("bos"), eos_token=name("eos"), pad_token=name("pad"),
                unk_token=name("unk"), chat_template=template, extra_eos_ids=extra,
                byte_fallback=kind == "llama", source=source)


def _byte_level(meta: dict, tokens: list, source: str) -> tokenizers.Tokenizer:
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise TokenizerError(f"{source}: tokenizer.ggml.pre = {pre_name!r} is a pre-tokenizer slotinfer does not "
                             f"know (known: {', '.join(PRE_TOKENIZERS)}); text would be split wrongly, so the "
                             "file is refused: load the model's Hugging Face folder (tokenizer.json) instead")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise TokenizerError(f"{source}: metadata key 'tokenizer.ggml.merges' is missing; a gpt2 tokenizer needs "
                             "its merges, re-convert the file")
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerError(f"{source}: tokenizer.ggml.merges holds {m!r}, not a pair 'a b'; the file is damaged")
        pairs.append((a, b))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    steps = [pre_tokenizers.Digits(individual_digits=True)] if pre.digits else []
    if pre.split is not None:
        steps += [pre_tokenizers.Split(Regex(pre.split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    else:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(meta: dict, tokens: list, source: str) -> tokenizers.Tokenizer:
    """SentencePiece BPE as llama.cpp runs it: merge the adjacent pair whose joined piece scores best."""
    scores = _numbers(meta.get("tokenizer.ggml.scores"), len(tokens), "tokenizer.ggml.scores", source)
    if scores is None:
        raise TokenizerError(f"{source}: metadata key 'tokenizer.ggml.scores' is missing; a llama tokenizer needs "
                             "its scores, re-convert the file")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[pid], pid, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens), source)
    model = models.BPE(vocab, [(m[4], m[5]) for m in merges], unk_token=tokens[unk] if unk is not None else None,
                       fuse_unk=True, byte_fallback=True)
    tok = tokenizers.Tokenizer(model)
    prefix = bool(_flag(meta, "tokenizer.ggml.add_space_prefix", True, source))
    norm = [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + norm)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


def _numbers(value, n: int, key: str, source: str) -> list | None:
    if value is None:
        return None
    value = _plain(value)
    if not isinstance(value, list) or len(value) != n:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise TokenizerError(f"{source}: {key} must list one number per token ({n}), got {got}; the file is damaged")
    return value


def _flag(meta: dict, key: str, default: bool, source: str) -> bool:
    value = _plain(meta.get(key, default))
    if not isinstance(value, (bool, int)):
        raise TokenizerError(f"{source}: {key} must be a boolean, got {value!r}")
    return bool(value)


def _token_id(meta: dict, key: str, n: int, source: str) -> int | None:
    value = _plain(meta.get(key))
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n:
        raise TokenizerError(f"{source}: {key} = {value!r} is not a token id of its {n}-token vocabulary; "
                             "the file is damaged, re-convert it")
    return value
