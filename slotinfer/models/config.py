"""``config.json`` -> :class:`ModelConfig`: the named switches that tell families apart.

Checkpoints come with two generations of keys: the classic ones (``rope_theta``,
``rope_scaling``, ``rope_local_base_freq``, ``sliding_window_pattern``) and the ones
current transformers writes (``rope_parameters``, ``layer_types``).  Both are read;
reading only one kind would silently run the wrong model.  GGUF files reach the same
rules: :mod:`slotinfer.models.gguf_config` maps their metadata onto these keys.
Which keys a family reads and its defaults come from its record in
:mod:`slotinfer.models.families`; nothing here names a family.

Why one module: the ``ModelConfig`` switches, the checks on every value read into them and
the tensors they imply sit together, so what a config means is read in one file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError, UnsupportedModelError
from .families import FAMILIES, Family, family, sliding_layers

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class Rope:
    """How positions rotate q/k in one kind of layer."""

    theta: float
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: Rope  # full-attention layers
    # -- family switches ------------------------------------------------------
    attn_bias: bool = False  # q/k/v projections carry biases (Qwen 2)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen 3, Gemma 3)
    norm_offset: float = 0.0  # Gemma norms scale by (1 + w)
    sandwich_norms: bool = False  # Gemma: norms before *and* after attention and MLP
    embed_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden)
    attn_scale: float = 0.0  # softmax scale; 0 -> head_dim ** -0.5
    activation: str = "silu"  # silu | gelu_tanh
    attn_softcap: float | None = None  # Gemma 2
    final_softcap: float | None = None  # Gemma 2
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = field(default_factory=tuple)
    local_rope: Rope | None = None  # rope of sliding layers, when it differs
    quantization: dict | None = None

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def rope_for(self, layer: int) -> Rope:
        if self.is_sliding(layer) and self.local_rope is not None:
            return self.local_rope
        return self.rope


MAX_LAYERS = 4096  # far beyond any released decoder; a larger count is a damaged or hostile config
_INT_MAX = 2**31 - 1  # sizes and positions meet int32 arrays on the device
_FLOAT_MAX = 1e30  # float settings (bases, scales, caps) stay far inside float32, or products of them overflow


def _need(cfg: dict, key: str, kind=int, low=1, high=None):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"config.json has no {key!r}; it is required for model_type {cfg.get('model_type')!r}")
    return _as(cfg[key], key, kind, low, high)


def _as(value, key: str, kind, low=None, high=None, within: str = ""):
    """``value`` as ``kind`` (int or float), finite, within [low, high]; for floats ``low=0`` means
    positive (a zero eps, base or scale is as broken as a negative one); every float stays
    within 1e-30..1e30 of zero and every int below 2**31.  ``within`` names the object holding ``key``, for messages."""
    at = f", in {within}" if within else ""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (kind is int and value != int(value)):
        what = "a whole number" if kind is int else "a finite number"
        raise ConfigError(f"config.json: {key!r} must be {kind.__name__}, got {value!r} (it takes {what}{at}); "
                          "restore it from the checkpoint")
    value = kind(value)
    if high is None:
        high = _FLOAT_MAX if kind is float else _INT_MAX
    if kind is float and low == 0:
        low = 1 / _FLOAT_MAX
    too_low = low is not None and value < low
    if too_low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ConfigError(f"config.json: {key!r} must be {bound}, got {value!r}{at}; restore it from the checkpoint")
    return value


def _opt(cfg: dict, key: str, default, kind=int, low=None, high=None, within: str = ""):
    """An optional key: ``default`` when absent or null, else its value as ``kind`` (see :func:`_as`)."""
    return default if cfg.get(key) is None else _as(cfg[key], key, kind, low, high, within)


def _flag(cfg: dict, key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config.json: {key!r} must be true or false, got {value!r}")
    return value


def _rope_object(params, what: str):
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f'config.json: {what} must be an object like {{"rope_type": "linear", "factor": 2.0}}, '
                          f"got {params!r}")


def _rope(params: dict | None, theta: float | None, where: str) -> Rope:
    _rope_object(params, f"the rope settings of {where}")
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = params.get("rope_theta", theta)
    if theta is None:
        raise ConfigError(f"config.json: no rope_theta for {where} (looked in rope_parameters and rope_theta)")
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: rope type {kind!r} ({where}) is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "llama3" and params.get("factor") is None:
        raise ConfigError(f"config.json: rope type 'llama3' ({where}) needs a 'factor' (8.0 for Llama 3.1)")
    theta = _as(theta, "rope_theta", float, 0, within=where)
    rope = Rope(theta=theta, type=kind, factor=_opt(params, "factor", 1.0, float, 0, within=where))
    if kind == "llama3":
        rope = Rope(
            theta=theta, type=kind, factor=rope.factor,
            low_freq_factor=_opt(params, "low_freq_factor", 1.0, float, 0, within=where),
            high_freq_factor=_opt(params, "high_freq_factor", 4.0, float, 0, within=where),
            original_max_position_embeddings=_opt(params, "original_max_position_embeddings", 8192, int, 1,
                                                  within=where),
        )
        if rope.high_freq_factor <= rope.low_freq_factor:
            raise ConfigError(f"config.json: rope 'high_freq_factor' ({rope.high_freq_factor}) must be greater than "
                              f"'low_freq_factor' ({rope.low_freq_factor}) ({where}); Llama 3.1 uses 4.0 and 1.0")
    return rope


def _layer_kinds(cfg: dict, n: int, default: tuple[bool, ...]) -> tuple[bool, ...]:
    """Per layer: True where the layer uses sliding-window attention."""
    if cfg.get("layer_types") is not None:
        kinds = cfg["layer_types"]
        if not isinstance(kinds, list):
            raise ConfigError(f"config.json: 'layer_types' must be a list of 'sliding_attention' or "
                              f"'full_attention', one per layer; got {kinds!r}")
        if len(kinds) != n:
            raise ConfigError(f"config.json: layer_types has {len(kinds)} entries for {n} layers")
        unknown = [k for k in kinds if k not in ("sliding_attention", "full_attention")]
        if unknown:
            raise ConfigError(f"config.json: unknown layer_types {unknown[:3]!r}; each entry is "
                              "'sliding_attention' or 'full_attention'")
        return tuple(k == "sliding_attention" for k in kinds)
    return default


def parse_config(raw: dict) -> ModelConfig:
    """Build the :class:`ModelConfig` of a Hugging Face ``config.json`` dict."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    model_type = raw.get("model_type")
    fam = family(model_type)
    if fam is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not fam.decoder:
        return _parse(raw, fam, raw)
    # a wrapper (multimodal): the decoder is its text part
    if not isinstance(raw.get("text_config"), dict):
        raise ConfigError(f"config.json: model_type {model_type!r} needs a 'text_config' object")
    cfg = {**raw["text_config"], "model_type": fam.decoder}
    cfg.setdefault("quantization", raw.get("quantization"))
    try:
        return _parse(cfg, FAMILIES[fam.decoder], raw)
    except (ConfigError, UnsupportedModelError) as e:
        raise type(e)(f"{e} (in its 'text_config')") from None


def _parse(cfg: dict, fam: Family, raw: dict) -> ModelConfig:
    mt = fam.model_type
    for key in ("rope_scaling", "rope_parameters"):
        _rope_object(cfg.get(key), repr(key))

    hidden = _need(cfg, "hidden_size")
    heads = _need(cfg, "num_attention_heads")
    layers = _need(cfg, "num_hidden_layers", high=MAX_LAYERS)
    head_dim = _opt(cfg, "head_dim", None, int, 1) or hidden // heads
    if head_dim < 1 or head_dim % 2:
        raise ConfigError(f"config.json: the head size ('head_dim', or 'hidden_size' / 'num_attention_heads') is "
                          f"{head_dim}; rotary embeddings need an even size of at least 2")
    common = dict(
        model_type=raw["model_type"],
        hidden_size=hidden,
        intermediate_size=_need(cfg, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_opt(cfg, "num_key_value_heads", heads, int, 1, heads),
        head_dim=head_dim,
        vocab_size=_need(cfg, "vocab_size"),
        rms_norm_eps=_opt(cfg, "rms_norm_eps", 1e-6, float, 0, 1),
        max_position_embeddings=_opt(cfg, "max_position_embeddings", 131072, int, 1),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", fam.tie_word_embeddings),
        quantization=raw.get("quantization"),
    )
    if common["num_heads"] % common["num_kv_heads"]:
        raise ConfigError(f"config.json: {heads} attention heads is not a multiple of {common['num_kv_heads']} kv heads "
                          "('num_attention_heads', 'num_key_value_heads')")
    switches = {}
    if fam.sliding_period:
        switches["sliding_window"] = _need(cfg, "sliding_window")
    if fam.activation == "gelu_tanh":
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if not isinstance(act, str) or act not in ("gelu_pytorch_tanh", "gelu"):
            raise UnsupportedModelError(f"config.json: activation {act!r} ('hidden_activation') is not supported "
                                        f"for {mt}")
    if fam.query_pre_attn_scalar:
        switches["attn_scale"] = _opt(cfg, "query_pre_attn_scalar", head_dim, float, 0) ** -0.5
    if fam.sliding_period:
        period = _opt(cfg, "sliding_window_pattern", fam.sliding_period, int, 1) if fam.sliding_pattern_key \
            else fam.sliding_period
        switches["sliding_layers"] = _layer_kinds(cfg, layers, sliding_layers(layers, period))
    rope, local = _ropes(cfg, fam)
    if fam.bias_keys or fam.qkv_bias:
        # Qwen 2's attention_bias is not read: its q/k/v biases are fixed
        switches["attn_bias"] = fam.qkv_bias or _flag(cfg, "attention_bias", False)
        switches["o_bias"] = fam.o_bias and _flag(cfg, "attention_bias", False)
        switches["mlp_bias"] = fam.bias_keys and _flag(cfg, "mlp_bias", False)
    if fam.attn_softcap:
        switches["attn_softcap"] = _opt(cfg, "attn_logit_softcapping", None, float, 0)
    if fam.final_softcap:
        switches["final_softcap"] = _opt(cfg, "final_logit_softcapping", None, float, 0)
    return ModelConfig(
        **common, rope=rope, local_rope=local, **switches,
        qk_norm=fam.qk_norm,
        norm_offset=fam.norm_offset,
        sandwich_norms=fam.sandwich_norms,
        embed_scale=math.sqrt(hidden) if fam.embed_scale else None,
        activation=fam.activation,
    )


def _ropes(cfg: dict, fam: Family) -> tuple[Rope, Rope | None]:
    """The rope of full-attention layers, and that of sliding layers where the family gives them their own."""
    params = cfg.get("rope_parameters")
    if fam.local_rope_base is None:
        if params and "full_attention" in params:
            params = params["full_attention"]
        if fam.rope_scaling and not params:
            return _rope(cfg.get("rope_scaling"), cfg.get("rope_theta", fam.rope_theta), "'rope_scaling'"), None
        return _rope(params or None, cfg.get("rope_theta", fam.rope_theta), "'rope_parameters'"), None
    if params and "full_attention" in params:
        return (_rope(params["full_attention"], None, "'rope_parameters' of full_attention layers"),
                _rope(params.get("sliding_attention"), fam.local_rope_base,
                      "'rope_parameters' of sliding_attention layers"))
    return (_rope(cfg.get("rope_scaling"), cfg.get("rope_theta", fam.rope_theta),
                  "'rope_scaling' of full_attention layers"),
            Rope(theta=_opt(cfg, "rope_local_base_freq", fam.local_rope_base, float, 0)))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Every tensor a checkpoint of this config holds, with its dense shape, in the order of the decoder's
    modules (embedding, each layer from its input norm to its MLP, final norm, head)."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_layers):
        layer = {
            "input_layernorm.weight": (H,),
            "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H),
            "self_attn.v_proj.weight": (kv, H), "self_attn.o_proj.weight": (H, q),
        }
        if cfg.attn_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if cfg.o_bias:
            layer["self_attn.o_proj.bias"] = (H,)
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
        layer["post_attention_layernorm.weight"] = (H,)
        if cfg.sandwich_norms:
            layer |= {"pre_feedforward_layernorm.weight": (H,), "post_feedforward_layernorm.weight": (H,)}
        layer |= {"mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
        if cfg.mlp_bias:
            layer |= {"mlp.gate_proj.bias": (I,), "mlp.up_proj.bias": (I,), "mlp.down_proj.bias": (H,)}
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer.items()}
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes
