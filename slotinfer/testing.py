"""Tiny random models in the exact folder layouts of published checkpoints.

No model hub is needed to test slotinfer: :func:`make_tiny_model` writes a complete
Hugging Face-style folder (``config.json``, safetensors weights, ``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json``)
for each supported family, optionally sharded and/or in the MLX-quantized layout.

The tokenizers are trained (deterministically, in a few milliseconds) on
``slotinfer/data/corpus.txt``: byte-level BPE for Llama 3 and Qwen, byte-fallback
BPE with ``▁`` spaces and ``<0xNN>`` byte tokens for Gemma.  They are cached per
family in the process.

Weights are drawn tensor by tensor (uniform, scaled to the standard deviations below)
from ``numpy.random.default_rng((seed, crc32(name)))``, so a tensor's values depend
only on the seed and its unprefixed name: the same seed gives the same weights sharded
or not, in either config style, quantized or not, Gemma 3 wrapped or not.  Files are
written one tensor at a time into reused buffers, so a Qwen3-0.6B-shaped folder
(``overrides=``) takes seconds and little memory.

    >>> from slotinfer.testing import make_tiny_model
    >>> folder = make_tiny_model("qwen3", tmp / "qwen3", quantize={"bits": 4, "group_size": 32})

Why one module: it writes a checkpoint of every family in every layout users hold (safetensors
dense and quantized, with tokenizer and template), and the builders share their fixtures.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["FAMILIES", "make_tiny_model", "tokenizer_files", "DEFAULT_DIMS"]

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text", "gemma3", "gemma2")

_DATA = Path(__file__).resolve().parent / "data"

DEFAULT_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}

_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

# Initial scales (see _draw; values are uniform with these standard deviations):
# linear weights std gain / sqrt(fan_in) with gain LINEAR_GAIN, QK_GAIN (q/k) or OUT_GAIN
# (o_proj, down_proj); embeddings std EMBED_STD (Gemma: EMBED_STD / sqrt(hidden), as
# Gemma multiplies them by sqrt(hidden)); norm weights mean 1 (q/k norms QK_NORM_SCALE)
# with std NORM_STD -- Gemma stores w for a scale of 1 + w, so its means are 0 (q/k
# norms QK_NORM_SCALE - 1); biases std BIAS_STD.  Greedy decoding of these random
# models wanders over many tokens instead of repeating one.
LINEAR_GAIN = 1.0
QK_GAIN = 2.0  # q_proj and k_proj: peaky attention, so outputs depend on the context
QK_NORM_SCALE = 2.0  # effective scale of q_norm/k_norm (same reason)
OUT_GAIN = 4.0  # o_proj and down_proj: layers must outweigh the (tied) embedding
EMBED_STD = 0.3
NORM_STD = 0.1
BIAS_STD = 0.1


# -- tokenizers -------------------------------------------------------------

def _tokenizer_kind(family: str) -> str:
    return {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3", "gemma3": "gemma3", "gemma2": "gemma2"}[family]


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


def tokenizer_files(family: str) -> dict[str, str]:
    """The tokenizer files (name -> text) ``make_tiny_model`` writes for ``family``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    text, facts = _tokenizer_bundle(_tokenizer_kind(family))
    return {
        "tokenizer.json": text,
        "tokenizer_config.json": json.dumps(facts["tokenizer_config"], indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(facts["special_tokens_map"], indent=2, ensure_ascii=False),
    }


# -- configs ----------------------------------------------------------------

def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _text_config(family: str, style: str, dims: dict, facts: dict, torch_dtype: str) -> dict:
    """config.json of the decoder (the ``text_config`` for the Gemma 3 wrapper)."""
    mt = "gemma3_text" if family == "gemma3" else family
    n = dims["num_hidden_layers"]
    dtype_key = {"torch_dtype": torch_dtype} if style == "classic" else {"dtype": torch_dtype}
    base = {
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "num_hidden_layers": n,
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_key_value_heads"],
        "max_position_embeddings": dims["max_position_embeddings"],
        "vocab_size": dims["vocab_size"],
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if mt == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", **base,
            "head_dim": dims.get("head_dim", 16), "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-5,
            "bos_token_id": facts["bos"], "eos_token_id": facts["eos_config"],
            "tie_word_embeddings": False,
        }
        if style == "classic":
            cfg.update(rope_theta=500000.0, rope_scaling=rope)
        else:
            cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0,
                                      **{k: v for k, v in rope.items() if k != "rope_type"}}
    elif mt in ("qwen2", "qwen3"):
        cfg = {
            "architectures": ["Qwen2ForCausalLM" if mt == "qwen2" else "Qwen3ForCausalLM"],
            "model_type": mt, **base,
            "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "bos_token_id": facts["bos"], "eos_token_id": facts["eos_config"],
            "tie_word_embeddings": True, "use_sliding_window": False,
            "sliding_window": 32768 if mt == "qwen2" else None, "max_window_layers": n,
        }
        if mt == "qwen3":
            cfg.update(head_dim=dims.get("head_dim", 32), attention_bias=False)
        elif "head_dim" in dims:
            cfg["head_dim"] = dims["head_dim"]
        if style == "classic":
            cfg.update(rope_theta=1000000.0, rope_scaling=None)
        else:
            cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
            cfg["layer_types"] = ["full_attention"] * n
    else:  # gemma2 / gemma3_text
        cfg = {
            "architectures": ["Gemma2ForCausalLM" if mt == "gemma2" else "Gemma3ForCausalLM"],
            "model_type": mt, **base,
            "head_dim": dims.get("head_dim", 32), "hidden_activation": "gelu_pytorch_tanh",
            "attention_bias": False, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 24,
            "sliding_window": 16,
            "bos_token_id": facts["bos"], "eos_token_id": facts["eos_config"], "pad_token_id": facts["pad"],
        }
        if mt == "gemma2":
            cfg.update(hidden_act="gelu_pytorch_tanh", final_logit_softcapping=30.0,
                       attn_logit_softcapping=50.0, cache_implementation="hybrid")
            sliding = [i % 2 == 0 for i in range(n)]
            if style == "classic":
                cfg["rope_theta"] = 10000.0
            else:
                cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        else:
            pattern = 3
            cfg.update(final_logit_softcapping=None, attn_logit_softcapping=None)
            sliding = [(i + 1) % pattern != 0 for i in range(n)]
            if style == "classic":
                cfg.update(rope_theta=1000000.0, rope_local_base_freq=10000.0,
                           rope_scaling={"rope_type": "linear", "factor": 8.0},
                           sliding_window_pattern=pattern)
            else:
                cfg["rope_parameters"] = {
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                }
        if style == "new":
            cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    if family != "gemma3":
        cfg.update(dtype_key)
        cfg["transformers_version"] = "4.44.0" if style == "classic" else "4.57.0"
    return cfg


_VISION_CONFIG = {
    "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 64, "patch_size": 16,
    "layer_norm_eps": 1e-6, "vision_use_head": False,
}


def _full_config(family: str, style: str, dims: dict, facts: dict, torch_dtype: str,
                 overrides: Mapping[str, Any]) -> dict:
    text = _text_config(family, style, dims, facts, torch_dtype)
    if family != "gemma3":
        text.update(copy.deepcopy(dict(overrides)))
        return text
    ids = facts["ids"]
    top = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "image_token_index": ids["<image_soft_token>"],
        "mm_tokens_per_image": 4,
        "eos_token_id": facts["eos_config"],
        "initializer_range": 0.02,
        "text_config": text,
        "vision_config": dict(_VISION_CONFIG),
        ("torch_dtype" if style == "classic" else "dtype"): torch_dtype,
        "transformers_version": "4.50.0" if style == "classic" else "4.57.0",
    }
    text["eos_token_id"] = facts["eos_config"][0]
    for key, value in overrides.items():
        if key in top and key not in text:
            top[key] = copy.deepcopy(value)
        else:
            text[key] = copy.deepcopy(value)
    return top


# -- weights ----------------------------------------------------------------

class _Tensor:
    """One tensor to write: HF name, shape, and how to draw it."""

    __slots__ = ("name", "shape", "kind", "fan_in", "gain", "seed_name")

    def __init__(self, name, shape, kind, *, fan_in=None, gain=LINEAR_GAIN, seed_name=None):
        self.name = name
        self.shape = tuple(int(s) for s in shape)
        self.kind = kind  # embed | linear | bias | norm | gemma_norm | vision
        self.fan_in = fan_in if fan_in is not None else self.shape[-1]
        self.gain = gain
        self.seed_name = seed_name or name


def _tensor_plan(family: str, cfg: dict) -> list[_Tensor]:
    text = cfg["text_config"] if family == "gemma3" else cfg
    prefix = "language_model." if family == "gemma3" else ""
    mt = text["model_type"]
    gemma = mt in ("gemma2", "gemma3_text")
    H = int(text["hidden_size"])
    inter = int(text["intermediate_size"])
    nh = int(text["num_attention_heads"])
    nkv = int(text.get("num_key_value_heads") or nh)
    hd = int(text.get("head_dim") or H // nh)
    V = int(text["vocab_size"])
    tied = bool(text.get("tie_word_embeddings", gemma))
    norm = "gemma_norm" if gemma else "norm"
    attn_bias = mt == "qwen2" or bool(text.get("attention_bias"))
    o_bias = mt == "llama" and bool(text.get("attention_bias"))
    mlp_bias = bool(text.get("mlp_bias"))

    plan: list[_Tensor] = []

    def add(name, shape, kind, **kw):
        plan.append(_Tensor(prefix + name, shape, kind, seed_name=name, **kw))

    add("model.embed_tokens.weight", (V, H), "embed")
    for i in range(int(text["num_hidden_layers"])):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", (H,), norm)
        add(p + "self_attn.q_proj.weight", (nh * hd, H), "linear", gain=QK_GAIN)
        add(p + "self_attn.k_proj.weight", (nkv * hd, H), "linear", gain=QK_GAIN)
        add(p + "self_attn.v_proj.weight", (nkv * hd, H), "linear")
        add(p + "self_attn.o_proj.weight", (H, nh * hd), "linear", gain=OUT_GAIN)
        if attn_bias:
            add(p + "self_attn.q_proj.bias", (nh * hd,), "bias")
            add(p + "self_attn.k_proj.bias", (nkv * hd,), "bias")
            add(p + "self_attn.v_proj.bias", (nkv * hd,), "bias")
        if o_bias:
            add(p + "self_attn.o_proj.bias", (H,), "bias")
        if mt in ("qwen3", "gemma3_text"):
            add(p + "self_attn.q_norm.weight", (hd,), norm, gain=QK_NORM_SCALE)
            add(p + "self_attn.k_norm.weight", (hd,), norm, gain=QK_NORM_SCALE)
        add(p + "post_attention_layernorm.weight", (H,), norm)
        if gemma:
            add(p + "pre_feedforward_layernorm.weight", (H,), norm)
            add(p + "post_feedforward_layernorm.weight", (H,), norm)
        add(p + "mlp.gate_proj.weight", (inter, H), "linear")
        add(p + "mlp.up_proj.weight", (inter, H), "linear")
        add(p + "mlp.down_proj.weight", (H, inter), "linear", gain=OUT_GAIN)
        if mlp_bias:
            add(p + "mlp.gate_proj.bias", (inter,), "bias")
            add(p + "mlp.up_proj.bias", (inter,), "bias")
            add(p + "mlp.down_proj.bias", (H,), "bias")
    add("model.norm.weight", (H,), norm)
    if not tied:
        add("lm_head.weight", (V, H), "linear")
    if family == "gemma3":
        vc = cfg["vision_config"]
        vh, ps = int(vc["hidden_size"]), int(vc["patch_size"])
        plan.append(_Tensor("vision_tower.vision_model.embeddings.patch_embedding.weight",
                            (vh, 3, ps, ps), "vision", fan_in=3 * ps * ps))
        plan.append(_Tensor("multi_modal_projector.mm_input_projection_weight", (vh, H), "vision", fan_in=vh))
    return plan


class _Scratch:
    """Reused flat buffers: fresh multi-hundred-MB arrays cost more in page faults
    than drawing the numbers, so every tensor is drawn into the same memory."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, shape, dtype) -> np.ndarray:
        n = int(np.prod(shape, dtype=np.int64))
        buf = self._bufs.get(key)
        if buf is None or buf.dtype != dtype or buf.size < n:
            buf = np.empty(max(n, 1), dtype=dtype)
            self._bufs[key] = buf
        return buf[:n].reshape(shape)


def _draw(t: _Tensor, seed: int, gemma_embed: bool, scratch: _Scratch | None = None) -> np.ndarray:
    """The float32 values of one tensor (deterministic in seed and name).

    Uniform draws (five times faster than normal ones) scaled to the wanted std."""
    rng = np.random.default_rng((int(seed), zlib.crc32(t.seed_name.encode("utf-8"))))
    x = (scratch or _Scratch()).get("f32", t.shape, np.float32)
    rng.random(dtype=np.float32, out=x)
    if t.kind == "embed":
        # Gemma multiplies embeddings by sqrt(hidden_size): store them that much smaller.
        std, mean = (EMBED_STD / math.sqrt(t.shape[1]) if gemma_embed else EMBED_STD), 0.0
    elif t.kind in ("linear", "vision"):
        std, mean = t.gain / math.sqrt(t.fan_in), 0.0
    elif t.kind == "bias":
        std, mean = BIAS_STD, 0.0
    elif t.kind == "norm":
        std, mean = NORM_STD, t.gain
    elif t.kind == "gemma_norm":
        std, mean = NORM_STD, t.gain - 1.0
    else:
        raise AssertionError(t.kind)
    half_width = std * math.sqrt(3.0)  # U(-a, a) has std a / sqrt(3)
    x *= np.float32(2.0 * half_width)
    x += np.float32(mean - half_width)
    return x


def _to_bf16_bits(x: np.ndarray, scratch: _Scratch | None = None) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even."""
    scratch = scratch or _Scratch()
    u = x.view(np.uint32)
    b = scratch.get("u32", x.shape, np.uint32)
    np.right_shift(u, np.uint32(16), out=b)
    b &= np.uint32(1)
    b += np.uint32(0x7FFF)
    b += u
    b >>= np.uint32(16)
    out = scratch.get("u16", x.shape, np.uint16)
    np.copyto(out, b, casting="unsafe")
    return out


def _mx_to_numpy(a, tag: str) -> np.ndarray:
    import mlx.core as mx

    if tag == "BF16":
        return np.array(a.view(mx.uint16))
    return np.array(a)


class _Group:
    """Tensors that are produced together (a quantized weight and its scales/biases).

    ``produce(scratch)`` runs numpy only (on a helper thread); ``finish(arrays)``, when
    set, runs on the calling thread (MLX work: MLX streams belong to their thread)."""

    def __init__(self, entries: list[tuple[str, str, tuple[int, ...]]], produce: Callable[["_Scratch"], dict],
                 finish: Callable[[dict], dict] | None = None):
        self.entries = entries
        self.produce = produce
        self.finish = finish

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(tag, shape) for _, tag, shape in self.entries)


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}


def _nbytes(tag: str, shape) -> int:
    return _ITEMSIZE[tag] * int(np.prod(shape, dtype=np.int64))


def _groups(plan: list[_Tensor], seed: int, tag: str, gemma: bool,
            quant: dict | None) -> tuple[list[_Group], dict]:
    """Write groups, and the quantization entries for config.json."""
    groups: list[_Group] = []
    per_layer: dict[str, dict] = {}

    def store(x: np.ndarray, scratch: _Scratch) -> np.ndarray:
        if tag == "F32":
            return x
        if tag == "F16":
            out = scratch.get("f16", x.shape, np.float16)
            np.copyto(out, x, casting="same_kind")
            return out
        return _to_bf16_bits(x, scratch)

    for t in plan:
        quantized = False
        if quant is not None and t.kind in ("embed", "linear"):
            module = t.name[: -len(".weight")]
            q = quant["overrides"].get(module, {})
            bits = int(q.get("bits", quant["bits"]))
            gsize = int(q.get("group_size", quant["group_size"]))
            if t.shape[-1] % gsize == 0 and (t.shape[-1] * bits) % 32 == 0:
                quantized = True
                if module in quant["overrides"]:
                    per_layer[module] = {"group_size": gsize, "bits": bits}
        if not quantized:
            groups.append(_Group([(t.name, tag, t.shape)],
                                 functools.partial(lambda t, scratch: {t.name: store(_draw(t, seed, gemma, scratch), scratch)}, t)))
            continue
        out, inp = t.shape
        base = t.name[: -len(".weight")]
        entries = [
            (base + ".weight", "U32", (out, inp * bits // 32)),
            (base + ".scales", tag, (out, inp // gsize)),
            (base + ".biases", tag, (out, inp // gsize)),
        ]

        def produce(scratch, t=t):
            return {"w": _draw(t, seed, gemma, scratch)}

        def finish(arrays, bits=bits, gsize=gsize, base=base):
            import mlx.core as mx

            w = mx.array(arrays["w"])
            if tag != "F32":
                w = w.astype(mx.float16 if tag == "F16" else mx.bfloat16)
            wq, scales, biases = mx.quantize(w, group_size=gsize, bits=bits)
            mx.eval(wq, scales, biases)
            return {base + ".weight": np.array(wq),
                    base + ".scales": _mx_to_numpy(scales, tag),
                    base + ".biases": _mx_to_numpy(biases, tag)}

        groups.append(_Group(entries, produce, finish))
    if quant is not None:
        modules = {t.name[: -len(".weight")] for t in plan if t.kind in ("embed", "linear")}
        unknown = set(quant["overrides"]) - modules
        if unknown:
            raise ValueError(f"quantize overrides name no quantizable module: {sorted(unknown)} "
                             f"(module paths look like {sorted(modules)[0]!r})")
    return groups, per_layer


def _write_safetensors(path: Path, groups: list[_Group]) -> int:
    """Write one safetensors file, one group at a time; returns the data size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for g in groups:
        for name, tag, shape in g.entries:
            n = _nbytes(tag, shape)
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    # Draw the next group on a helper thread while this one is written (numpy and file
    # writes release the GIL); two scratch sets alternate between them.
    scratches = (_Scratch(), _Scratch())
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as pool:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        pending = pool.submit(groups[0].produce, scratches[0]) if groups else None
        for k, g in enumerate(groups):
            arrays = pending.result()
            if g.finish is not None:
                arrays = g.finish(arrays)
            if k + 1 < len(groups):
                pending = pool.submit(groups[k + 1].produce, scratches[(k + 1) % 2])
            for name, tag, shape in g.entries:
                a = np.ascontiguousarray(arrays[name])
                if a.nbytes != _nbytes(tag, shape):
                    raise AssertionError(f"{name}: produced {a.shape} {a.dtype}, planned {shape} {tag}")
                f.write(memoryview(a).cast("B"))
            del arrays
    return offset


def _split_shards(groups: list[_Group], shards: int) -> list[list[_Group]]:
    total = sum(g.nbytes for g in groups)
    target = total / shards
    out: list[list[_Group]] = [[]]
    acc = 0
    for i, g in enumerate(groups):
        left_groups = len(groups) - i
        left_shards = shards - len(out)
        if out[-1] and left_shards > 0 and (acc >= target * len(out) or left_groups <= left_shards):
            out.append([])
        out[-1].append(g)
        acc += g.nbytes
    return out


# -- the entry point --------------------------------------------------------

def make_tiny_model(
    family: str,
    path: str | os.PathLike,
    *,
    quantize: Mapping[str, Any] | None = None,
    shards: int = 1,
    dtype: str = "float32",
    seed: int = 0,
    config_style: str = "classic",
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write a random model of ``family`` in Hugging Face layout to ``path``; return it.

    ``quantize={"bits": 4, "group_size": 32, "overrides": {module_path: {...}}}`` writes
    the MLX-quantized layout; ``shards>1`` splits the weights with an index file;
    ``dtype`` is the stored float dtype; ``config_style`` "classic" or "new" chooses
    the generation of config keys; ``overrides`` merges into the (text) config.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if config_style not in ("classic", "new"):
        raise ValueError(f"config_style must be 'classic' or 'new', got {config_style!r}")
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    overrides = dict(overrides or {})
    quant = None
    if quantize is not None:
        quant = {"bits": int(quantize.get("bits", 4)), "group_size": int(quantize.get("group_size", 64)),
                 "overrides": dict(quantize.get("overrides") or {})}
        unknown = set(quantize) - {"bits", "group_size", "overrides"}
        if unknown:
            raise ValueError(f"unknown quantize keys {sorted(unknown)}")

    tok_text, facts = _tokenizer_bundle(_tokenizer_kind(family))
    gemma = family.startswith("gemma")
    dims = dict(DEFAULT_DIMS)
    if gemma:
        dims["num_hidden_layers"] = 6
    dims["vocab_size"] = _round_up(facts["size"], 64)
    for key in list(dims) + ["head_dim"]:
        if key in overrides:
            dims[key] = overrides[key]
    if int(dims["vocab_size"]) < facts["size"]:
        raise ValueError(f"vocab_size {dims['vocab_size']} is smaller than the tokenizer ({facts['size']} tokens)")

    cfg = _full_config(family, config_style, dims, facts, dtype, overrides)
    plan = _tensor_plan(family, cfg)
    tag = _DTYPES[dtype]
    groups, per_layer = _groups(plan, seed, tag, gemma, quant)
    if quant is not None:
        qcfg = {"group_size": quant["group_size"], "bits": quant["bits"], **per_layer}
        cfg["quantization"] = qcfg
        cfg["quantization_config"] = copy.deepcopy(qcfg)

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in list(folder.glob("model*.safetensors")) + [folder / "model.safetensors.index.json"]:
        if stale.exists():
            stale.unlink()

    if shards > len(groups):
        raise ValueError(f"shards={shards} but the model has only {len(groups)} tensors")
    if shards == 1:
        _write_safetensors(folder / "model.safetensors", groups)
    else:
        weight_map: dict[str, str] = {}
        total = 0
        parts = _split_shards(groups, shards)
        for k, part in enumerate(parts, 1):
            fname = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
            total += _write_safetensors(folder / fname, part)
            for g in part:
                for name, _, _ in g.entries:
                    weight_map[name] = fname
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": facts["bos"], "eos_token_id": facts["eos_generation"]}
    if facts["pad"] is not None:
        gen["pad_token_id"] = facts["pad"]
    if gemma:
        gen["cache_implementation"] = "hybrid"
    gen["transformers_version"] = cfg.get("transformers_version", "4.50.0")
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name, text in tokenizer_files(family).items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder
