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

Each family's config keys, architecture name and tokenizer come from its record in
:mod:`slotinfer.models.families`; the tensors are the ones the loader expects of the
config (:func:`slotinfer.models.config.expected_shapes`).

The package: this module holds the configs and the entry point; :mod:`.tokenizers` trains
the tokenizers and renders their files, :mod:`.weights` draws and writes the tensors.
"""


from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping


from ..models.config import parse_config
from ..models.families import FAMILIES as _RECORDS
from ..models.families import Family, decoder_family, sliding_layers
from .tokenizers import _tokenizer_bundle
from .weights import _groups, _split_shards, _tensor_plan, _write_safetensors

__all__ = ["FAMILIES", "make_tiny_model", "tokenizer_files", "DEFAULT_DIMS"]

FAMILIES = tuple(_RECORDS)  # every supported model_type; each family's facts are its record in models.families

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
    text, facts = _tokenizer_bundle(_RECORDS[family].tokenizer)
    return {
        "tokenizer.json": text,
        "tokenizer_config.json": json.dumps(facts["tokenizer_config"], indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(facts["special_tokens_map"], indent=2, ensure_ascii=False),
    }


# -- configs ----------------------------------------------------------------

def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


_FILLED = ("bos_token_id", "eos_token_id", "pad_token_id", "max_window_layers")  # example keys the builder fills in


def _text_config(fam: Family, style: str, dims: dict, facts: dict, torch_dtype: str, wrapped: bool) -> dict:
    """config.json of the decoder (the ``text_config`` of a wrapper): the sizes in ``dims`` and the family's
    example keys, in the classic or the new generation of keys."""
    n = dims["num_hidden_layers"]
    cfg = {
        "architectures": [fam.architecture], "model_type": fam.model_type,
        **{k: dims[k] for k in (*DEFAULT_DIMS, "vocab_size")},
        "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True,
    }
    filled = dict(zip(_FILLED, (facts["bos"], facts["eos_config"], facts["pad"], n)))
    for key, value in fam.example.items():
        if key not in cfg:
            cfg[key] = filled[key] if key in filled else copy.deepcopy(value)
    if "head_dim" in dims:
        cfg["head_dim"] = dims["head_dim"]
    if style == "new":
        _new_style_keys(cfg, fam)
    if not wrapped:
        cfg["torch_dtype" if style == "classic" else "dtype"] = torch_dtype
        cfg["transformers_version"] = "4.44.0" if style == "classic" else "4.57.0"
    return cfg


def _new_style_keys(cfg: dict, fam: Family) -> None:
    """Classic rope and sliding keys -> the ones current transformers writes (``rope_parameters`` and, where
    the config has a sliding window, ``layer_types``)."""
    scaling = cfg.pop("rope_scaling", None) or {}
    full = {"rope_type": scaling.get("rope_type", "default"), "rope_theta": cfg.pop("rope_theta"),
            **{k: v for k, v in scaling.items() if k != "rope_type"}}
    local = cfg.pop("rope_local_base_freq", None)
    cfg["rope_parameters"] = full if local is None else {
        "full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    period = cfg.pop("sliding_window_pattern", fam.sliding_period)
    if "sliding_window" in cfg:
        n = cfg["num_hidden_layers"]
        sliding = sliding_layers(n, period) if fam.sliding_period else (False,) * n
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]


_VISION_CONFIG = {
    "model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 64, "patch_size": 16,
    "layer_norm_eps": 1e-6, "vision_use_head": False,
}


def _full_config(fam: Family, style: str, dims: dict, facts: dict, torch_dtype: str,
                 overrides: Mapping[str, Any]) -> dict:
    text = _text_config(decoder_family(fam.model_type), style, dims, facts, torch_dtype, bool(fam.decoder))
    if not fam.decoder:
        text.update(copy.deepcopy(dict(overrides)))
        return text
    # the wrapper (Gemma 3's multimodal checkpoints): a vision tower around the decoder
    ids = facts["ids"]
    top = {
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
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
    the generation of config keys; ``overrides`` merges into the (text) config.  The
    tensors written are the ones slotinfer's loader expects of the resulting config, so
    an override it cannot parse raises its ConfigError here.
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

    fam = _RECORDS[family]
    decoder = decoder_family(family)
    tok_text, facts = _tokenizer_bundle(fam.tokenizer)
    dims = {k: decoder.example.get(k, v) for k, v in DEFAULT_DIMS.items()}
    dims["vocab_size"] = _round_up(facts["size"], 64)
    for key in list(dims) + ["head_dim"]:
        if key in overrides:
            dims[key] = overrides[key]
    if int(dims["vocab_size"]) < facts["size"]:
        raise ValueError(f"vocab_size {dims['vocab_size']} is smaller than the tokenizer ({facts['size']} tokens)")

    cfg = _full_config(fam, config_style, dims, facts, dtype, overrides)
    model = parse_config(cfg)
    plan = _tensor_plan(model, cfg)
    tag = _DTYPES[dtype]
    groups, per_layer = _groups(plan, seed, tag, model.embed_scale is not None, quant)
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
    if model.sliding_layers:  # transformers' cache for a mix of sliding and global layers
        gen["cache_implementation"] = "hybrid"
    gen["transformers_version"] = cfg.get("transformers_version", "4.50.0")
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name, text in tokenizer_files(family).items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder
