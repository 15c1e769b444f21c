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

The package: this module holds the configs and the entry point; :mod:`.tokenizers` trains
the tokenizers and renders their files, :mod:`.weights` draws and writes the tensors.
"""


from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping


from .tokenizers import _tokenizer_bundle, _tokenizer_kind
from .weights import _groups, _split_shards, _tensor_plan, _write_safetensors

__all__ = ["FAMILIES", "make_tiny_model", "tokenizer_files", "DEFAULT_DIMS"]

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text", "gemma3", "gemma2")

DEFAULT_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}

_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


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
