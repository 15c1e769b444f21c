"""The Family records: what they say is what the parser, the GGUF mapping and the test builders do."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, strategies as st

import slotinfer
from slotinfer.errors import UnsupportedModelError
from slotinfer.models import SUPPORTED_MODEL_TYPES, expected_shapes, parse_config
from slotinfer.models.families import FAMILIES, GGUF_ARCHITECTURES, by_gguf_arch, decoder_family, family
from slotinfer.models.gguf_config import architecture, config_dict
from slotinfer.testing import FAMILIES as TEST_FAMILIES
from slotinfer.testing import make_tiny_model

# What the published checkpoints of each decoder are (transformers' modelling code and the
# families' papers), stated here apart from the records: q/k norm, Gemma-style norms and
# embedding scale, attention soft-capping read, q/k/v biases without any key, the transformers class.
PUBLISHED = {
    "llama": dict(qk_norm=False, gemma=False, attn_softcap=False, qkv_bias=False, cls="LlamaForCausalLM"),
    "qwen2": dict(qk_norm=False, gemma=False, attn_softcap=False, qkv_bias=True, cls="Qwen2ForCausalLM"),
    "qwen3": dict(qk_norm=True, gemma=False, attn_softcap=False, qkv_bias=False, cls="Qwen3ForCausalLM"),
    "gemma2": dict(qk_norm=False, gemma=True, attn_softcap=True, qkv_bias=False, cls="Gemma2ForCausalLM"),
    "gemma3_text": dict(qk_norm=True, gemma=True, attn_softcap=False, qkv_bias=False, cls="Gemma3ForCausalLM"),
}

# The smallest config.json each decoder runs from: the defaults are the family's.
MINIMAL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 12, "num_attention_heads": 4,
           "vocab_size": 256}


def tensors(folder):
    """name -> (dtype, shape) over every safetensors file of a folder, read by hand."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        header.pop("__metadata__", None)
        out |= {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()}
    return out


def test_one_record_per_supported_model_type():
    assert tuple(FAMILIES) == SUPPORTED_MODEL_TYPES == TEST_FAMILIES
    assert set(PUBLISHED) | {"gemma3"} == set(FAMILIES)
    assert all(family(mt).model_type == mt for mt in FAMILIES)
    assert family(["llama"]) is None and family(None) is None and family("gpt2") is None


def test_the_wrapper_runs_the_gemma3_text_decoder():
    assert family("gemma3").decoder == "gemma3_text"
    assert decoder_family("gemma3") is family("gemma3_text")
    assert all(decoder_family(mt) is family(mt) for mt in PUBLISHED)


@pytest.mark.parametrize("mt", list(PUBLISHED))
def test_records_say_what_published_checkpoints_are(mt):
    fam, known = family(mt), PUBLISHED[mt]
    assert fam.architecture == known["cls"]
    assert fam.qk_norm == known["qk_norm"]
    assert fam.qkv_bias == known["qkv_bias"]
    assert fam.attn_softcap == known["attn_softcap"]
    assert (fam.norm_offset, fam.sandwich_norms, fam.embed_scale) == ((1.0, True, True) if known["gemma"]
                                                                     else (0.0, False, False))


@pytest.mark.parametrize("mt", list(FAMILIES))
def test_the_tiny_model_of_a_family_parses_to_its_record(tmp_path, mt):
    folder = make_tiny_model(mt, tmp_path / mt)
    raw = json.loads((folder / "config.json").read_text())
    cfg = parse_config(raw)
    fam, dec = family(mt), decoder_family(mt)
    assert raw["model_type"] == cfg.model_type == mt and raw["architectures"] == [fam.architecture]
    known = PUBLISHED[dec.model_type]
    assert cfg.qk_norm == known["qk_norm"]
    assert cfg.attn_bias == known["qkv_bias"]  # the tiny configs say attention_bias: false where they say it
    assert (cfg.attn_softcap is not None) == known["attn_softcap"]
    assert cfg.norm_offset == (1.0 if known["gemma"] else 0.0)
    assert cfg.sandwich_norms == known["gemma"]
    assert cfg.embed_scale == (pytest.approx(cfg.hidden_size ** 0.5) if known["gemma"] else None)
    assert cfg.activation == ("gelu_tanh" if known["gemma"] else "silu")
    assert bool(cfg.sliding_layers) == known["gemma"]
    assert (cfg.local_rope is not None) == (dec.model_type == "gemma3_text")


@pytest.mark.parametrize("mt, tied, theta, local, sliding", [
    ("llama", False, 10000.0, None, ()),
    ("qwen2", False, 10000.0, None, ()),
    ("qwen3", False, 10000.0, None, ()),
    # Gemma 2 alternates from a sliding first layer; Gemma 3 slides five layers in six, with rope bases
    # of 1e6 (global) and 1e4 (local)
    ("gemma2", True, 10000.0, None, (True, False) * 6),
    ("gemma3_text", True, 1e6, 10000.0, (True,) * 5 + (False,) + (True,) * 5 + (False,)),
])
def test_family_defaults_where_config_json_is_silent(mt, tied, theta, local, sliding):
    raw = {**MINIMAL, "model_type": mt}
    if sliding:
        raw["sliding_window"] = 16
    cfg = parse_config(raw)
    assert cfg.tie_word_embeddings == tied
    assert cfg.rope.theta == theta
    assert (cfg.local_rope and cfg.local_rope.theta) == local
    assert cfg.sliding_layers == sliding
    assert (cfg.attn_bias, cfg.o_bias, cfg.mlp_bias) == (mt == "qwen2", False, False)


def test_attention_bias_reaches_o_proj_only_in_llama():
    for mt, o_bias in (("llama", True), ("qwen3", False)):
        cfg = parse_config({**MINIMAL, "model_type": mt, "attention_bias": True})
        assert (cfg.attn_bias, cfg.o_bias) == (True, o_bias)


# -- GGUF ----------------------------------------------------------------------

def _meta(arch: str, n: int, **extra) -> dict:
    meta = {"general.architecture": arch, f"{arch}.block_count": n, f"{arch}.embedding_length": 64,
            f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.context_length": 2048,
            f"{arch}.attention.sliding_window": 16}
    return meta | {f"{arch}.{k}": v for k, v in extra.items()}


def _from_gguf(meta: dict):
    name, fam = architecture(meta, "m.gguf")
    return parse_config(config_dict(meta, name, fam, vocab_rows=256, tied=True, source="m.gguf"))


def test_every_gguf_architecture_is_a_decoder_family():
    assert set(GGUF_ARCHITECTURES) == {"llama", "qwen2", "qwen3", "gemma2", "gemma3"}
    for name, fam in GGUF_ARCHITECTURES.items():
        assert by_gguf_arch(name) is fam and not fam.decoder and fam.gguf_arch == name
        assert _from_gguf(_meta(name, 4)).model_type == fam.model_type
    assert by_gguf_arch("gemma3").model_type == "gemma3_text"
    # only llama.cpp's llama files hold permuted q/k rows; only Gemma's norms are stored shifted
    assert {n for n, f in GGUF_ARCHITECTURES.items() if f.permuted_qk} == {"llama"}
    assert {n for n, f in GGUF_ARCHITECTURES.items() if f.norm_offset} == {"gemma2", "gemma3"}


@pytest.mark.parametrize("value", [["llama"], ("llama",), np.array(["llama"]), 3, None, b"llama", "phi3"])
def test_a_general_architecture_that_is_no_supported_name_is_refused(value):
    with pytest.raises(UnsupportedModelError, match="general.architecture"):
        architecture({"general.architecture": value}, "m.gguf")


@given(n=st.integers(1, 40), period=st.integers(1, 8))
def test_the_sliding_rule_is_one_rule(n, period):
    """config.json's pattern (Gemma 3), llama.cpp's period (GGUF) and the formulas each states agree."""
    stated = tuple((i + 1) % period != 0 for i in range(n))
    assert stated == tuple(i % period < period - 1 for i in range(n))
    from_json = parse_config({**MINIMAL, "model_type": "gemma3_text", "num_hidden_layers": n,
                              "sliding_window": 16, "sliding_window_pattern": period}).sliding_layers
    from_gguf = _from_gguf(_meta("gemma3", n, **{"attention.sliding_window_pattern": period})).sliding_layers
    assert from_json == from_gguf == stated


@given(n=st.integers(1, 40))
def test_each_family_default_period_is_the_same_in_both_formats(n):
    gemma2 = tuple(i % 2 == 0 for i in range(n))  # transformers' Gemma 2 default
    gemma3 = tuple((i + 1) % 6 != 0 for i in range(n))  # Gemma 3's sliding_window_pattern default, 6
    for mt, arch, stated in (("gemma2", "gemma2", gemma2), ("gemma3_text", "gemma3", gemma3)):
        from_json = parse_config({**MINIMAL, "model_type": mt, "num_hidden_layers": n,
                                  "sliding_window": 16}).sliding_layers
        assert from_json == _from_gguf(_meta(arch, n)).sliding_layers == stated


@pytest.mark.parametrize("arch, n, scalar", [("gemma2", 46, 16), ("gemma3", 62, 16), ("gemma2", 62, 32),
                                             ("gemma3", 46, 32), ("gemma3", 26, 32)])
def test_a_gemma_gguf_without_attention_scale_takes_llama_cpps_rule(arch, n, scalar):
    """llama.cpp scales the 27B sizes (Gemma 2: 46 layers, Gemma 3: 62) by hidden / heads = 64 / 4,
    every other size by the head size (32 here); an attention.scale in the file wins over both."""
    meta = _meta(arch, n, **{"attention.key_length": 32})
    assert _from_gguf(meta).scale == pytest.approx(scalar ** -0.5)
    assert _from_gguf(meta | {f"{arch}.attention.scale": 0.125}).scale == pytest.approx(0.125)


# -- the test builders ----------------------------------------------------------

OPTIONS = {
    "plain": {},
    "quantized": {"quantize": {"bits": 4, "group_size": 32}},
    "shards": {"shards": 2},
    "new": {"config_style": "new"},
    "float16": {"dtype": "float16"},
    "biases": {"overrides": {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}},
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("mt", list(FAMILIES))
def test_the_written_tensors_are_the_ones_the_config_asks_for(tmp_path, mt, option):
    folder = make_tiny_model(mt, tmp_path / mt, **OPTIONS[option])
    raw = json.loads((folder / "config.json").read_text())
    cfg = parse_config(raw)
    have = tensors(folder)
    prefix = "language_model." if family(mt).decoder else ""
    if prefix:
        assert {k for k in have if not k.startswith(prefix)} == {
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "multi_modal_projector.mm_input_projection_weight"}
    dense = {k[len(prefix):]: shape for k, (_, shape) in have.items() if k.startswith(prefix)}
    quant = raw.get("quantization")
    for name, shape in expected_shapes(cfg).items():
        if quant and name.endswith(".weight") and len(shape) == 2:
            out, inp = shape
            groups = (out, inp // quant["group_size"])
            assert (dense.pop(name), dense.pop(name[:-6] + "scales"), dense.pop(name[:-6] + "biases")) == (
                (out, inp * quant["bits"] // 32), groups, groups)
        else:
            assert dense.pop(name) == shape
    assert dense == {}
    if option == "biases":
        has_bias = any(k.endswith("q_proj.bias") for k in have)
        assert has_bias == decoder_family(mt).bias_keys
    slotinfer.load(folder)  # the loader takes exactly these


@pytest.mark.parametrize("mt", list(FAMILIES))
@pytest.mark.parametrize("layers", [1, 5, 9])
def test_classic_and_new_config_keys_parse_alike(tmp_path, mt, layers):
    over = {"num_hidden_layers": layers}
    classic = json.loads((make_tiny_model(mt, tmp_path / "c", overrides=over) / "config.json").read_text())
    new = json.loads((make_tiny_model(mt, tmp_path / "n", overrides=over, config_style="new")
                      / "config.json").read_text())
    text = new.get("text_config", new)
    assert "rope_parameters" in text and "rope_theta" not in text and "rope_scaling" not in text
    assert parse_config(classic) == parse_config(new)
