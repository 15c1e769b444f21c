"""Tiny random checkpoints written by Hugging Face transformers itself, for parity tests.

Each builder makes a small model of one family with transformers' own config and
model classes, gives it non-trivial random weights, and saves it with
``save_pretrained`` -- so the folder holds exactly the keys and tensor names the
installed transformers writes (``rope_parameters``, ``layer_types``, ...).  The
tokenizer files come from slotinfer's tiny model of the same family, whose
vocabulary fits in the config's ``vocab_size``.

Imported only by ``tests/test_parity_transformers.py``, after torch and
transformers are known to be importable.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from slotinfer.testing import make_tiny_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Small dimensions shared by every family (hidden 64, 4 heads, 2 kv heads).
DIMS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512)
GEMMA_WINDOW = 8  # prompts are longer than this, so sliding layers really drop keys


@dataclass
class Case:
    """One checkpoint to compare: how to build it and how to save it."""

    name: str
    tokenizer_family: str  # the slotinfer.testing family whose tokenizer files are copied
    build: str  # name of the builder function below
    dtype: str = "float32"  # stored dtype
    max_shard_size: str | None = None
    save_original_format: bool = True
    classic: bool = False  # rewrite config.json with the keys checkpoints had before rope_parameters


CASES = [
    Case("llama3", "llama", "build_llama3"),
    Case("qwen2", "qwen2", "build_qwen2"),
    Case("qwen3", "qwen3", "build_qwen3"),
    Case("qwen3-bf16-sharded", "qwen3", "build_qwen3", dtype="bfloat16", max_shard_size="100KB"),
    Case("gemma2", "gemma2", "build_gemma2"),
    Case("gemma3_text", "gemma3_text", "build_gemma3_text"),
    Case("gemma3", "gemma3", "build_gemma3"),
    Case("gemma3-new-names", "gemma3", "build_gemma3", save_original_format=False),
    # The same models as older checkpoints spell them; transformers converts these keys on load.
    Case("llama3-classic", "llama", "build_llama3", classic=True),
    Case("gemma2-classic", "gemma2", "build_gemma2", classic=True),
    Case("gemma3_text-classic", "gemma3_text", "build_gemma3_text", classic=True),
]

# classic configs of Gemma 3 give the layer kinds as a period instead of layer_types
CLASSIC_GEMMA3_PATTERN = 3


# -- weights ------------------------------------------------------------------

@torch.no_grad()
def randomize(model: torch.nn.Module, *, gemma: bool, seed: int) -> None:
    """Redraw every parameter so that each part of the model visibly shapes the output.

    transformers' own init (std 0.02, norms at their default) gives near-uniform
    logits and near-uniform attention; greedy tokens would then hinge on noise.
    Here: linear layers ~ N(0, gain^2 / fan_in) with larger gains for q/k (peaky
    attention, so the window and rope matter) and o/down (layers outweigh the
    embedding); norms drawn around their default (1 for Llama/Qwen, 0 for Gemma,
    which scales by 1 + w) so a missing or doubled offset changes the result.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std + mean)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            qk = name.endswith(("q_norm.weight", "k_norm.weight"))
            final = name.endswith("model.norm.weight") or name.endswith("language_model.norm.weight")
            if gemma:
                # scale 1 + w: about 2 for q/k norms, about 3 for the final norm (logits large
                # enough for Gemma 2's final soft-cap to bite), about 1 otherwise
                normal(p, 0.2, 1.0 if qk else 2.0 if final else 0.0)
            else:
                normal(p, 0.1, 2.0 if qk else 1.0)
        elif name.endswith("embed_tokens.weight"):
            # Gemma multiplies embeddings by sqrt(hidden): keep the product near 0.5.
            normal(p, 0.5 / math.sqrt(p.shape[1]) if gemma else 0.5)
        elif name.endswith(".bias"):
            normal(p, 0.2)
        elif p.ndim == 2:
            gain = 2.0 if (".q_proj." in name or ".k_proj." in name) else \
                3.0 if (".o_proj." in name or ".down_proj." in name) else 1.0
            normal(p, gain / math.sqrt(p.shape[1]))
        else:  # vision tower convolutions, positional tables, ...
            normal(p, 0.02)


# -- configs --------------------------------------------------------------------

def _common(vocab: int, gen: dict, layers: int) -> dict:
    eos = gen["eos_token_id"]
    return dict(DIMS, vocab_size=vocab, num_hidden_layers=layers, bos_token_id=gen.get("bos_token_id"),
                eos_token_id=eos, pad_token_id=gen.get("pad_token_id"), attention_dropout=0.0)


def build_llama3(vocab: int, gen: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **_common(vocab, gen, 4), head_dim=16, hidden_act="silu", rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        # original_max_position_embeddings 16 puts the blend band (wavelengths 4..16) and the
        # slowed band (> 16) among head_dim 16's frequencies, so scaling changes most of them.
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    )
    return LlamaForCausalLM(cfg), False


def build_qwen2(vocab: int, gen: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**_common(vocab, gen, 4), hidden_act="silu", rms_norm_eps=1e-6,
                      tie_word_embeddings=True, use_sliding_window=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return Qwen2ForCausalLM(cfg), False


def build_qwen3(vocab: int, gen: dict):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**_common(vocab, gen, 4), head_dim=32,  # != 64 / 4
                      hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=True,
                      attention_bias=False, use_sliding_window=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return Qwen3ForCausalLM(cfg), False


def build_gemma2(vocab: int, gen: dict):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(**_common(vocab, gen, 4), head_dim=16, hidden_activation="gelu_pytorch_tanh",
                       rms_norm_eps=1e-6, query_pre_attn_scalar=24,  # != head_dim
                       sliding_window=GEMMA_WINDOW, final_logit_softcapping=5.0,
                       attn_logit_softcapping=4.0,  # low caps, so capping bites on these weights
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       tie_word_embeddings=True)
    return Gemma2ForCausalLM(cfg), True


def _gemma3_text_config(vocab: int, gen: dict):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_common(vocab, gen, 6), head_dim=32, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW,
        # Not the 5-local-1-global default (nor any period): layer_types must be read as written.
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
    )


def build_gemma3_text(vocab: int, gen: dict):
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM(_gemma3_text_config(vocab, gen)), True


def build_gemma3(vocab: int, gen: dict):
    """The multimodal wrapper with a minimal vision tower; only its text part is compared."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = _gemma3_text_config(vocab, gen)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=32, patch_size=8,
                                vision_use_head=False)
    # image ids: three ids inside the vocabulary the tokenizer does not produce from text
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                       boi_token_index=vocab - 3, eoi_token_index=vocab - 2, image_token_index=vocab - 1,
                       tie_word_embeddings=True)
    cfg.eos_token_id = gen["eos_token_id"]
    cfg.bos_token_id = gen.get("bos_token_id")
    cfg.pad_token_id = gen.get("pad_token_id")
    return Gemma3ForConditionalGeneration(cfg), True


# -- folders ----------------------------------------------------------------------

def tokenizer_source(family: str, root: Path) -> Path:
    """slotinfer's tiny model of ``family`` (written once under ``root``)."""
    folder = root / f"tok-{family}"
    if not (folder / "config.json").exists():
        make_tiny_model(family, folder)
    return folder


def write_checkpoint(case: Case, folder: Path, tok_root: Path, seed: int = 0) -> Path:
    """Build ``case`` with transformers and save it, tokenizer included, into ``folder``."""
    src = tokenizer_source(case.tokenizer_family, tok_root)
    tiny_cfg = json.loads((src / "config.json").read_text())
    vocab = int(tiny_cfg.get("text_config", tiny_cfg)["vocab_size"])
    gen = json.loads((src / "generation_config.json").read_text())

    torch.manual_seed(seed)
    model, gemma = globals()[case.build](vocab, gen)
    randomize(model, gemma=gemma, seed=seed)
    model.eval()
    if case.dtype != "float32":
        model = model.to(getattr(torch, case.dtype))
    kwargs = {"save_original_format": case.save_original_format}
    if case.max_shard_size:
        kwargs["max_shard_size"] = case.max_shard_size
    model.save_pretrained(folder, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, folder / name)
    if case.classic:
        to_classic(folder)
    return folder


def to_classic(folder: Path) -> None:
    """Rewrite ``folder/config.json`` in the pre-``rope_parameters`` style: ``rope_theta`` and
    ``rope_scaling`` (Gemma 3: ``rope_local_base_freq`` and ``sliding_window_pattern``),
    no ``layer_types``, ``torch_dtype`` for ``dtype``."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    text = raw.get("text_config", raw)
    rope = text.pop("rope_parameters")
    if "full_attention" in rope:  # Gemma 3
        full, local = dict(rope["full_attention"]), rope["sliding_attention"]
        text["rope_theta"] = full.pop("rope_theta")
        text["rope_local_base_freq"] = local["rope_theta"]
        text["sliding_window_pattern"] = CLASSIC_GEMMA3_PATTERN
        text.pop("_sliding_window_pattern", None)
    else:
        full = dict(rope)
        text["rope_theta"] = full.pop("rope_theta")
    text["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
    text.pop("layer_types", None)
    for d in (raw, text):
        if "dtype" in d:
            d["torch_dtype"] = d.pop("dtype")
    path.write_text(json.dumps(raw, indent=2) + "\n")


def load_reference(folder: Path):
    """The checkpoint in transformers, computing in float32 with eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma3ForConditionalGeneration

    cfg = AutoConfig.from_pretrained(folder)
    cls = Gemma3ForConditionalGeneration if cfg.model_type == "gemma3" else AutoModelForCausalLM
    model = cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model
