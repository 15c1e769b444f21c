"""Every supported family's facts, one :class:`Family` record each.

A family's rules are needed in three places, which all read them from here rather than
restating them:

- :mod:`slotinfer.models.config` turns a ``config.json`` into a ``ModelConfig`` with the
  switches and defaults of its family's record;
- :mod:`slotinfer.models.gguf_config` finds the record by llama.cpp's
  ``general.architecture`` and undoes that converter's changes by its fields;
- :mod:`slotinfer.testing` writes a tiny model of the family from its ``example``
  config, ``architecture`` and ``tokenizer``.

Adding a family means adding its record here (and its tests); a family that needs a
switch the decoder does not have yet needs that switch in ``ModelConfig`` too.

    >>> family("qwen3").qk_norm
    True
    >>> by_gguf_arch("gemma3").model_type
    'gemma3_text'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


def _frozen(d: dict | None = None) -> Mapping:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Family:
    # -- names --------------------------------------------------------------
    model_type: str  # config.json's model_type: the key every checkpoint carries
    architecture: str  # transformers' class in config.json's "architectures" (what the test builders write)
    decoder: str = ""  # a wrapper's decoder (its text_config's model_type); "" where the family is the decoder
    gguf_arch: str = ""  # llama.cpp's general.architecture for this decoder; "" where llama.cpp has none for it

    # -- attention ------------------------------------------------------------
    # q/k/v always carry biases: Qwen 2's checkpoints have them and no config key says so
    qkv_bias: bool = False
    # attention_bias and mlp_bias are read from config.json (Gemma's published configs carry
    # attention_bias: false, and its checkpoints have no biases, so the key is not read for Gemma)
    bias_keys: bool = False
    o_bias: bool = False  # attention_bias gives o_proj a bias too (Llama; Qwen's o_proj never has one here)
    qk_norm: bool = False  # RMSNorm over each head of q and k: Qwen 3 and Gemma 3 have it, Gemma 2 does not
    # the softmax scale is query_pre_attn_scalar ** -0.5 (Gemma), not head_dim ** -0.5
    query_pre_attn_scalar: bool = False
    attn_softcap: bool = False  # attn_logit_softcapping is read: Gemma 2 caps attention logits, Gemma 3 dropped it

    # -- norms, embeddings, MLP, head -----------------------------------------
    # Gemma's norms scale by (1 + w); llama.cpp's converter stores 1 + w, so a GGUF's norms are shifted by this
    norm_offset: float = 0.0
    sandwich_norms: bool = False  # Gemma normalizes before *and* after attention and MLP
    embed_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden_size)
    activation: str = "silu"  # silu | gelu_tanh; a gelu_tanh family's config.json names it and is checked
    final_softcap: bool = False  # final_logit_softcapping is read (Gemma 2, and Gemma 3 where it is set)
    tie_word_embeddings: bool = False  # the default when config.json leaves tie_word_embeddings out

    # -- positions --------------------------------------------------------------
    rope_theta: float = 10000.0  # the default when config.json has no rope_theta
    # a classic rope_scaling is read (Gemma 2's published configs have none, so it is not read for Gemma 2)
    rope_scaling: bool = True
    # Sliding-window layers: 0 none; n: every n-th layer is global, the others slide.  config.json's
    # default layer_types and llama.cpp's fixed rule are this one rule (see sliding_layers).
    sliding_period: int = 0
    sliding_pattern_key: bool = False  # a classic sliding_window_pattern overrides the period (Gemma 3)
    # sliding layers rotate with their own base (Gemma 3: 10000, global layers 1e6); None: one rope for all
    local_rope_base: float | None = None

    # -- llama.cpp's GGUF -------------------------------------------------------
    permuted_qk: bool = False  # the converter interleaved the q/k rows of each head (Llama only)
    gguf_rope_freqs: bool = False  # a rope_freqs tensor holds Llama 3's rope scaling
    gguf_tensors: Mapping[str, str] = field(default_factory=_frozen)  # per-layer names unlike llama's
    # llama.cpp scales attention by hidden / heads (not head_dim) for the size with this many layers when
    # the file gives no attention.scale (the 27B sizes: Gemma 2's 46 layers, Gemma 3's 62), as their
    # published configs' query_pre_attn_scalar does
    gguf_hidden_scale_layers: int = 0

    # -- test models (slotinfer.testing) -----------------------------------------
    tokenizer: str = ""  # which locally trained tokenizer the family's tiny models get
    # the family's own config.json keys as its published checkpoints write them (classic style, tiny
    # sizes; *_token_id and max_window_layers are filled in by the builder)
    example: Mapping = field(default_factory=_frozen)


def sliding_layers(n: int, period: int) -> tuple[bool, ...]:
    """Per layer, whether it slides: every ``period``-th layer is global (``period`` 0: all slide).

    config.json's defaults (Gemma 2's ``i % 2 == 0``, Gemma 3's ``(i + 1) % pattern != 0``) and llama.cpp's
    (``i % period < period - 1``) are all this rule."""
    return tuple(period == 0 or (i + 1) % period != 0 for i in range(n))


_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}

_GEMMA = dict(
    query_pre_attn_scalar=True, norm_offset=1.0, sandwich_norms=True, embed_scale=True, activation="gelu_tanh",
    final_softcap=True, tie_word_embeddings=True, gguf_tensors=_frozen(_GEMMA_NORMS),
)
_GEMMA_EXAMPLE = {
    "num_hidden_layers": 6, "head_dim": 32, "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 24, "sliding_window": 16,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}
_QWEN_EXAMPLE = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "bos_token_id": None, "eos_token_id": None,
    "tie_word_embeddings": True, "use_sliding_window": False,
}

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family(
        "llama", "LlamaForCausalLM", gguf_arch="llama", bias_keys=True, o_bias=True,
        permuted_qk=True, gguf_rope_freqs=True, tokenizer="llama3",
        example=_frozen({
            "head_dim": 16, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
            "rms_norm_eps": 1e-5, "bos_token_id": None, "eos_token_id": None, "tie_word_embeddings": False,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        }),
    ),
    Family(
        "qwen2", "Qwen2ForCausalLM", gguf_arch="qwen2", qkv_bias=True, bias_keys=True, tokenizer="qwen2",
        example=_frozen({**_QWEN_EXAMPLE, "sliding_window": 32768, "max_window_layers": None,
                         "rope_theta": 1000000.0, "rope_scaling": None}),
    ),
    Family(
        "qwen3", "Qwen3ForCausalLM", gguf_arch="qwen3", bias_keys=True, qk_norm=True, tokenizer="qwen3",
        example=_frozen({**_QWEN_EXAMPLE, "sliding_window": None, "max_window_layers": None, "head_dim": 32,
                         "attention_bias": False, "rope_theta": 1000000.0, "rope_scaling": None}),
    ),
    Family(
        "gemma3_text", "Gemma3ForCausalLM", gguf_arch="gemma3", qk_norm=True, **_GEMMA,
        rope_theta=1_000_000.0, sliding_period=6, sliding_pattern_key=True, local_rope_base=10000.0,
        gguf_hidden_scale_layers=62, tokenizer="gemma3",
        example=_frozen({
            **_GEMMA_EXAMPLE, "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3,
        }),
    ),
    # the multimodal wrapper: its decoder is gemma3_text, under text_config and language_model.
    Family("gemma3", "Gemma3ForConditionalGeneration", decoder="gemma3_text", tokenizer="gemma3"),
    Family(
        "gemma2", "Gemma2ForCausalLM", gguf_arch="gemma2", attn_softcap=True, **_GEMMA,
        rope_scaling=False, sliding_period=2, gguf_hidden_scale_layers=46, tokenizer="gemma2",
        example=_frozen({
            **_GEMMA_EXAMPLE, "hidden_act": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0, "cache_implementation": "hybrid", "rope_theta": 10000.0,
        }),
    ),
)}

GGUF_ARCHITECTURES: dict[str, Family] = {f.gguf_arch: f for f in FAMILIES.values() if f.gguf_arch}


def family(model_type) -> Family | None:
    """The record of a config.json ``model_type``; None when it is not supported."""
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def decoder_family(model_type) -> Family | None:
    """The record of the decoder that runs ``model_type`` (a wrapper's decoder, or the family itself)."""
    f = family(model_type)
    return FAMILIES[f.decoder] if f is not None and f.decoder else f


def by_gguf_arch(name) -> Family | None:
    """The decoder family of a GGUF's ``general.architecture``; None when it is not supported."""
    return GGUF_ARCHITECTURES.get(name) if isinstance(name, str) else None
