"""The tiny models' tokenizers: trained deterministically on ``slotinfer/data/corpus.txt``
(byte-level BPE for Llama 3 and Qwen, byte-fallback BPE for Gemma), with each family's
special tokens, tokenizer_config.json and chat template."""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path


_DATA = Path(__file__).resolve().parent.parent / "data"


def _corpus_lines() -> list[str]:
    return (_DATA / "corpus.txt").read_text(encoding="utf-8").splitlines(keepends=True)


# Pre-tokenization regex of the byte-level vocabularies: words with their leading
# space, runs of up to three digits, punctuation runs, newlines, other whitespace.
_SPLIT_PATTERN = r" ?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_BYTE_LEVEL_SPECIALS = {
    "llama3": [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
               ("<|end_header_id|>", True), ("<|eot_id|>", True)],
    "qwen2": [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)],
    "qwen3": [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
              ("<think>", False), ("</think>", False)],
}
_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_GEMMA3_EXTRA = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def _byte_level_tokenizer(kind: str) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama3")))
    if kind != "llama3":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus_lines(), trainer)
    specials = _BYTE_LEVEL_SPECIALS[kind]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s, sp in specials if sp])
    plain = [AddedToken(s, special=False, normalized=False) for s, sp in specials if not sp]
    if plain:
        tok.add_tokens(plain)
    byte_level = processors.ByteLevel(trim_offsets=False, add_prefix_space=False, use_regex=False)
    if kind == "llama3":
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence([
            byte_level,
            processors.TemplateProcessing(single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos} $B:1",
                                          special_tokens=[(bos, tok.token_to_id(bos))]),
        ])
    else:
        tok.post_processor = byte_level
    return tok.to_str()


def _gemma_tokenizer(kind: str) -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    learner = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    # Characters seen only once stay out of the vocabulary (they, and whatever the
    # corpus lacks, are spelled with <0xNN> byte tokens).  Filtering here rather than
    # with the trainer's limit_alphabet keeps training deterministic.
    lines = _corpus_lines()
    counts = Counter(ch for line in lines for ch in line)
    rare = {ch for ch, n in counts.items() if n < 2}
    lines = ["".join(ch for ch in line if ch not in rare) for line in lines]
    trainer = trainers.BpeTrainer(vocab_size=256, min_frequency=2, show_progress=False)
    learner.train_from_iterator(lines, trainer)
    data = json.loads(learner.to_str())

    # Gemma's id layout: special tokens first, then the 256 byte tokens, then pieces.
    specials = list(_GEMMA_SPECIALS)
    vocab: dict[str, int] = {}
    for s in specials:
        vocab[s] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    if kind == "gemma3":
        for s in _GEMMA3_EXTRA:
            vocab[s] = len(vocab)
        specials += _GEMMA3_EXTRA
    data["model"]["vocab"] = vocab
    data["added_tokens"] = [
        {"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for s in specials
    ]
    tok = Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A:0", pair="<bos> $A:0 <bos> $B:1", special_tokens=[("<bos>", vocab["<bos>"])])
    return tok.to_str()


@functools.lru_cache(maxsize=None)
def _tokenizer_json(kind: str) -> str:
    if kind.startswith("gemma"):
        return _gemma_tokenizer(kind)
    return _byte_level_tokenizer(kind)


def _template(name: str) -> str:
    return (_DATA / f"chat_template_{name}.jinja").read_text(encoding="utf-8")


def _added(tok_json: dict) -> dict[str, int]:
    return {t["content"]: t["id"] for t in tok_json["added_tokens"]}


def _added_tokens_decoder(tok_json: dict) -> dict[str, dict]:
    return {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in tok_json["added_tokens"]
    }


def _token_entry(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


@functools.lru_cache(maxsize=None)
def _tokenizer_bundle(kind: str) -> tuple[str, dict]:
    """(tokenizer.json text, facts) for a tokenizer kind; facts holds the ids and the
    tokenizer_config / special_tokens_map / generation_config contents."""
    text = _tokenizer_json(kind)
    tj = json.loads(text)
    ids = _added(tj)
    size = max(max(tj["model"]["vocab"].values()), max(ids.values())) + 1
    if kind == "llama3":
        bos, eos, eot = ids["<|begin_of_text|>"], ids["<|end_of_text|>"], ids["<|eot_id|>"]
        tcfg = {
            "added_tokens_decoder": _added_tokens_decoder(tj),
            "bos_token": "<|begin_of_text|>",
            "chat_template": _template("llama3"),
            "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        smap = {"bos_token": _token_entry("<|begin_of_text|>"), "eos_token": _token_entry("<|eot_id|>")}
        facts = {"bos": bos, "eos_config": [eos, eot], "eos_generation": [eos, eot], "pad": None}
    elif kind in ("qwen2", "qwen3"):
        eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
        tcfg = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": _added_tokens_decoder(tj),
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": _template(kind),
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 32768,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
        smap = {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                "eos_token": _token_entry("<|im_end|>"), "pad_token": _token_entry("<|endoftext|>")}
        facts = {"bos": eot, "eos_config": im_end, "eos_generation": im_end, "pad": eot}
    else:  # gemma2 / gemma3
        bos, eos, pad, eot = ids["<bos>"], ids["<eos>"], ids["<pad>"], ids["<end_of_turn>"]
        tcfg = {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": _added_tokens_decoder(tj),
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
            "bos_token": "<bos>",
            "chat_template": _template("gemma"),
            "clean_up_tokenization_spaces": False,
            "eos_token": "<eos>",
            "model_max_length": 1000000000000000019884624838656,
            "pad_token": "<pad>",
            "sp_model_kwargs": {},
            "spaces_between_special_tokens": False,
            "tokenizer_class": "GemmaTokenizer",
            "unk_token": "<unk>",
            "use_default_system_prompt": False,
        }
        smap = {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
                "bos_token": _token_entry("<bos>"), "eos_token": _token_entry("<eos>"),
                "pad_token": _token_entry("<pad>"), "unk_token": _token_entry("<unk>")}
        if kind == "gemma3":
            facts = {"bos": bos, "eos_config": [eos, eot], "eos_generation": [eos, eot], "pad": pad}
        else:
            facts = {"bos": bos, "eos_config": eos, "eos_generation": eos, "pad": pad}
    facts.update(size=size, tokenizer_config=tcfg, special_tokens_map=smap, ids=ids)
    return text, facts


