"""GGUF metadata -> the ``config.json`` keys :func:`~slotinfer.models.config.parse_config` reads.

llama.cpp's GGUF files carry the config as ``general.architecture`` plus ``<arch>.*``
keys, and name tensors its own way (``blk.N.attn_q``).  The format's rules live here
(the two key tables below); what differs per family (the converter's q/k permutation
and norm shift, renamed tensors, the fixed rules llama.cpp applies where a file says
nothing: Gemma's sliding-window period, Gemma 3's local rope base, the 27B sizes'
attention scale) is read from the family's record in :mod:`slotinfer.models.families`.  The
result is an ordinary config dict, so the family switches themselves stay in ``config.py``.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError, UnsupportedModelError
from .config import MAX_LAYERS
from .families import GGUF_ARCHITECTURES, Family, by_gguf_arch, sliding_layers

# config.json key <- "<arch>.<suffix>", value kind, required
_KEYS = (
    ("num_hidden_layers", "block_count", int, True),
    ("hidden_size", "embedding_length", int, True),
    ("intermediate_size", "feed_forward_length", int, True),
    ("num_attention_heads", "attention.head_count", int, True),
    ("num_key_value_heads", "attention.head_count_kv", int, False),
    ("head_dim", "attention.key_length", int, False),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon", float, True),
    ("max_position_embeddings", "context_length", int, True),
    ("rope_theta", "rope.freq_base", float, False),
    ("sliding_window", "attention.sliding_window", int, False),
    ("attn_logit_softcapping", "attn_logit_softcapping", float, False),
    ("final_logit_softcapping", "final_logit_softcapping", float, False),
    ("rope_local_base_freq", "rope.freq_base_swa", float, False),
)

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def architecture(meta: dict, source: str) -> tuple[str, Family]:
    """``general.architecture`` and the family whose decoder runs it (a value that is no string, such as
    an array, is as unsupported as an unknown name)."""
    name = meta.get("general.architecture")
    fam = by_gguf_arch(name)
    if fam is None:
        raise UnsupportedModelError(
            f"{source}: general.architecture = {name!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)} (convert the model's safetensors release instead, or use llama.cpp)"
        )
    return name, fam


def module_name(fam: Family, gguf_module: str) -> str | None:
    """The checkpoint's module path of a GGUF tensor's base name (``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``)."""
    if gguf_module in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_module]
    parts = gguf_module.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        own = fam.gguf_tensors.get(parts[2]) or _LAYER_TENSORS.get(parts[2])
        if own is not None:
            return f"model.layers.{parts[1]}.{own}"
    return None


def gguf_module(fam: Family, module: str) -> str:
    """The GGUF base name of a checkpoint module (the inverse of :func:`module_name`), for messages."""
    names = {v: k for k, v in {**_LAYER_TENSORS, **fam.gguf_tensors}.items()}
    top = {v: k for k, v in GLOBAL_TENSORS.items()}
    parts = module.split(".", 3)
    if module in top:
        return top[module]
    if len(parts) == 4 and parts[3] in names:
        return f"blk.{parts[2]}.{names[parts[3]]}"
    return module


def config_dict(meta: dict, name: str, fam: Family, *, vocab_rows: int, tied: bool, source: str,
                rope_factors=None) -> dict:
    """The config.json dict of a GGUF's metadata (``vocab_rows``: the embedding's row count;
    ``rope_factors``: the ``rope_freqs`` tensor, when the file has one)."""
    def key(suffix):
        return f"{name}.{suffix}"

    cfg = {"model_type": fam.model_type, "vocab_size": vocab_rows, "tie_word_embeddings": tied}
    for hf, suffix, kind, required in _KEYS:
        if key(suffix) in meta:
            cfg[hf] = _scalar(meta[key(suffix)], key(suffix), kind, source)
        elif required:
            raise ConfigError(f"{source}: metadata key {key(suffix)!r} is missing; the file is incomplete, "
                              "re-convert it with llama.cpp's convert_hf_to_gguf.py")
    if not 1 <= cfg["num_hidden_layers"] <= MAX_LAYERS:
        raise ConfigError(f"{source}: metadata key {key('block_count')!r} = {cfg['num_hidden_layers']} is not a "
                          f"layer count (1 to {MAX_LAYERS}); the file is damaged, re-convert it")
    if key("vocab_size") in meta and _scalar(meta[key("vocab_size")], key("vocab_size"), int, source) != vocab_rows:
        raise ConfigError(f"{source}: {key('vocab_size')} = {meta[key('vocab_size')]} but token_embd has "
                          f"{vocab_rows} rows; the file is inconsistent, re-convert it")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // max(cfg["num_attention_heads"], 1)
    for suffix in ("attention.value_length", "rope.dimension_count"):
        if key(suffix) in meta and _scalar(meta[key(suffix)], key(suffix), int, source) != head_dim:
            raise UnsupportedModelError(
                f"{source}: {key(suffix)} = {meta[key(suffix)]} differs from the head size {head_dim}; "
                "slotinfer runs only models whose values and rotary dims span the whole head")
    cfg.setdefault("rope_theta", 10000.0)  # llama.cpp's default when a file leaves it out
    if not cfg["rope_theta"] > 0:
        raise ConfigError(f"{source}: metadata key {key('rope.freq_base')!r} (rope_theta) must be positive, got "
                          f"{cfg['rope_theta']!r}; the file is damaged, re-convert it")
    cfg["rope_scaling"] = _rope_scaling(meta, key, source)
    if rope_factors is not None:
        if cfg["rope_scaling"] is not None or not fam.gguf_rope_freqs:
            raise UnsupportedModelError(f"{source}: tensor rope_freqs.weight (per-frequency rope factors) is only "
                                        "read as Llama 3's rope scaling, in a llama file without other scaling")
        cfg["rope_scaling"] = llama3_scaling(rope_factors, cfg["rope_theta"], head_dim, source)
    _family_rules(cfg, meta, key, fam, head_dim, source)
    return cfg


def _family_rules(cfg: dict, meta: dict, key, fam: Family, head_dim: int, source: str) -> None:
    """The config.json keys a family needs that the converter does not write (llama.cpp's fixed rules)."""
    if fam.sliding_period and "sliding_window" not in cfg:
        raise ConfigError(f"{source}: metadata key {key('attention.sliding_window')!r} is missing; "
                          f"{fam.model_type} needs it")
    if fam.activation == "gelu_tanh":
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
    if fam.query_pre_attn_scalar:
        _attn_scalar(cfg, meta, key, fam, head_dim, source)
    if fam.sliding_period:
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention"
                              for s in _sliding(cfg["num_hidden_layers"], meta, key, fam, source)]
    if fam.local_rope_base is not None:
        cfg.setdefault("rope_local_base_freq", fam.local_rope_base)


def _attn_scalar(cfg: dict, meta: dict, key, fam: Family, head_dim: int, source: str) -> None:
    if key("attention.scale") in meta:
        scale = _scalar(meta[key("attention.scale")], key("attention.scale"), float, source)
        if not 0 < scale < 1e6:
            raise ConfigError(f"{source}: metadata key {key('attention.scale')!r} must be a positive number, got "
                              f"{scale!r}; the file is damaged, re-convert it")
        cfg["query_pre_attn_scalar"] = 1.0 / (scale * scale)
    elif cfg["num_hidden_layers"] == fam.gguf_hidden_scale_layers:
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] / max(cfg["num_attention_heads"], 1)
    else:
        cfg["query_pre_attn_scalar"] = head_dim


def _sliding(n: int, meta: dict, key, fam: Family, source: str) -> tuple[bool, ...]:
    """Per layer, whether it slides: the file's per-layer pattern or period, else the family's period."""
    pattern = meta.get(key("attention.sliding_window_pattern"))
    if isinstance(pattern, (list, tuple)) or getattr(pattern, "ndim", 0) == 1:
        sliding = tuple(bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern))
        if len(sliding) != n:
            raise ConfigError(f"{source}: {key('attention.sliding_window_pattern')} has {len(sliding)} entries "
                              f"for {n} layers")
        return sliding
    period = fam.sliding_period if pattern is None else _scalar(pattern, key("attention.sliding_window_pattern"),
                                                                 int, source)
    return sliding_layers(n, period)


def llama3_scaling(factors, theta: float, head_dim: int, source: str) -> dict:
    """Llama 3's rope_scaling parameters recovered from llama.cpp's ``rope_freqs`` factors, and checked:
    they must give back every factor, or the file is refused.

    The factors are 1 for short wavelengths, ``factor`` for long ones and ``1 / ((1 - s) / factor + s)``
    between, with ``s = (orig / wavelength - low) / (high - low)`` linear in 1 / wavelength: two
    blended frequencies fix its slope and offset, hence ``orig`` and ``high`` for ``low = 1``.
    """
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    refuse = UnsupportedModelError(
        f"{source}: tensor rope_freqs.weight does not hold Llama 3's rope scaling for {head_dim // 2} frequencies "
        "(slotinfer reads no other per-frequency rope factors); load the model's safetensors release instead")
    if f.shape != wavelen.shape or not np.isfinite(f).all() or f.min() < 1.0:
        raise refuse
    factor = float(f.max())
    blend = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if factor == 1.0 or blend.sum() < 2:
        raise refuse
    s = (1 / f[blend] - 1 / factor) / (1 - 1 / factor)
    try:
        slope, offset = np.polyfit(1 / wavelen[blend], s, 1)
    except (np.linalg.LinAlgError, ValueError):
        raise refuse from None
    if offset >= 0 or slope <= 0:
        raise refuse
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": round(1 - 1 / offset, 6), "original_max_position_embeddings": round(-slope / offset)}
    orig, high = params["original_max_position_embeddings"], params["high_freq_factor"]
    smooth = np.clip((orig / wavelen - 1.0) / (high - 1.0), 0.0, 1.0)
    if not np.allclose(1 / ((1 - smooth) / factor + smooth), f, rtol=1e-5, atol=0):
        raise refuse
    return params


def _rope_scaling(meta: dict, key, source: str) -> dict | None:
    kind = meta.get(key("rope.scaling.type"), "none")
    if kind in ("none", None):
        return None
    if kind != "linear":
        raise UnsupportedModelError(f"{source}: {key('rope.scaling.type')} = {kind!r} is not supported "
                                    "(supported: none, linear)")
    if key("rope.scaling.factor") not in meta:
        raise ConfigError(f"{source}: {key('rope.scaling.type')} is 'linear' but {key('rope.scaling.factor')} "
                          "is missing")
    return {"rope_type": "linear", "factor": _scalar(meta[key("rope.scaling.factor")], key("rope.scaling.factor"),
                                                     float, source)}


def _scalar(value, name: str, kind, source: str):
    """A metadata number (MLX hands them over as 0-d arrays) as ``kind``."""
    if hasattr(value, "ndim") and value.ndim == 0:
        # a float32 stands for the decimal the converter wrote (1e-05, not 9.999999747378752e-06)
        value = float(str(np.float32(value.item()))) if str(value.dtype).endswith("float32") else value.item()
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (kind is int and (value != int(value) or value < 0)):
        raise ConfigError(f"{source}: metadata key {name!r} must be a {'whole ' if kind is int else ''}number, "
                          f"got {value!r}; the file is damaged or written by a converter slotinfer does not know")
    return kind(value)
