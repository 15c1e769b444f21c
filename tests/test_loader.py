"""Loading checkpoints in published layouts, and the errors bad folders get."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import slotinfer
from slotinfer.cache import SequenceCache
from slotinfer.errors import (ConfigError, InvalidRequestError, ModelNotFoundError, PromptTooLongError,
                              TokenizerError, UnsupportedModelError, WeightError)
from slotinfer.testing import FAMILIES

IDS = [5, 17, 42, 99, 7, 130, 64, 8, 21, 300, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # > Gemma's window


def last_logits(model, ids=IDS):
    h = model.net(mx.array([ids]), SequenceCache(model.config.num_layers))
    return np.array(model.net.head(h[:, -1]).astype(mx.float32))[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_load_to_the_same_model(model_dir, family):
    base = last_logits(slotinfer.load(model_dir(family)))
    assert np.isfinite(base).all() and base.std() > 0
    new_keys = last_logits(slotinfer.load(model_dir(family, config_style="new")))
    np.testing.assert_array_equal(new_keys, base)  # classic and current config keys: one model
    shards = last_logits(slotinfer.load(model_dir(family, shards=3)))
    np.testing.assert_array_equal(shards, base)
    half = slotinfer.load(model_dir(family, dtype="bfloat16"))
    assert half.dtype == mx.float32  # the CPU policy upcasts once at load
    np.testing.assert_allclose(last_logits(half), base, atol=0.15 * np.abs(base).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_mlx_quantized_layout(model_dir, family):
    base = last_logits(slotinfer.load(model_dir(family)))
    q8 = slotinfer.load(model_dir(family, quantize={"bits": 8, "group_size": 32}))
    assert q8.dtype == mx.float32
    got = last_logits(q8)
    assert np.corrcoef(got, base)[0, 1] > 0.9  # 8-bit is a close approximation
    down = ("language_model." if family == "gemma3" else "") + "model.layers.0.mlp.down_proj"
    mixed = {"bits": 4, "group_size": 32, "overrides": {down: {"bits": 8, "group_size": 32}}}
    q4 = slotinfer.load(model_dir(family, quantize=mixed))
    assert np.corrcoef(last_logits(q4), base)[0, 1] > 0.4  # 4-bit: coarse, but far from unrelated (~0)
    assert q4.generate(IDS, max_tokens=4).finish_reason in ("stop", "length")


def test_quantized_weights_dequantize_as_written(model_dir):
    path = model_dir("qwen3", quantize={"bits": 4, "group_size": 32})
    raw = mx.load(str(path / "model.safetensors"))
    w = mx.dequantize(raw["model.layers.1.mlp.down_proj.weight"], raw["model.layers.1.mlp.down_proj.scales"],
                      raw["model.layers.1.mlp.down_proj.biases"], group_size=32, bits=4)
    m = slotinfer.load(path)
    np.testing.assert_array_equal(np.array(m.net.model.layers[1].mlp.down_proj.weight), np.array(w))


def test_dtype_override(model_dir):
    m = slotinfer.load(model_dir("llama"), dtype="bfloat16")
    assert m.dtype == mx.bfloat16
    assert len(m.generate("hello", max_tokens=3).tokens) >= 1
    with pytest.raises(InvalidRequestError):
        slotinfer.load(model_dir("llama"), dtype="int7")


def test_eos_ids_merge_generation_config(models):
    m = models["llama"]
    tok = m.tokenizer
    assert {tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")} <= m.eos_ids
    g = models["gemma3"]
    assert g.tokenizer.token_to_id("<end_of_turn>") in g.eos_ids


def test_bos_is_added_once_through_chat_template(models):
    for fam in ("llama", "gemma3_text"):
        m = models[fam]
        ids = m.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
        assert ids.count(m.tokenizer.bos_id) == 1 and ids[0] == m.tokenizer.bos_id
        assert m.encode_prompt(m.apply_chat_template([{"role": "user", "content": "hi"}])) == ids


# -- errors -------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path, model_dir):
    dst = tmp_path / "m"
    shutil.copytree(model_dir("qwen3"), dst)
    return dst


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_folder_and_files(tmp_path, folder):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        slotinfer.load(tmp_path / "nope")
    (folder / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        slotinfer.load(folder)


def test_unsupported_model_type_lists_supported(folder):
    edit_config(folder, model_type="mamba")
    with pytest.raises(UnsupportedModelError, match="llama, qwen2, qwen3"):
        slotinfer.load(folder)


def test_malformed_config(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        slotinfer.load(folder)


def test_config_missing_key(folder):
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hidden_size"):
        slotinfer.load(folder)


def test_missing_and_misshapen_tensors_are_named(folder):
    path = folder / "model.safetensors"
    w = mx.load(str(path))
    del w["model.layers.1.self_attn.k_proj.weight"]
    mx.save_safetensors(str(path), w)
    with pytest.raises(WeightError, match="model.layers.1.self_attn.k_proj.weight"):
        slotinfer.load(folder)
    w["model.layers.1.self_attn.k_proj.weight"] = mx.zeros((3, 3))
    mx.save_safetensors(str(path), w)
    with pytest.raises(WeightError, match=r"k_proj.weight has shape \(3, 3\)"):
        slotinfer.load(folder)


def test_truncated_safetensors(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match="truncated"):
        slotinfer.load(folder)


def test_tokenizer_bigger_than_vocab(folder):
    edit_config(folder, vocab_size=64)
    w = mx.load(str(folder / "model.safetensors"))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"][:64]
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    with pytest.raises(TokenizerError, match="vocab_size"):
        slotinfer.load(folder)


def test_bad_requests(models):
    m = models["qwen3"]
    for kw, word in [(dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
                     (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
                     (dict(max_tokens=0), "max_tokens"), (dict(seed=-1), "seed"), (dict(stop=[""]), "stop")]:
        with pytest.raises(InvalidRequestError, match=word):
            m.generate("hi", **kw)
    with pytest.raises(InvalidRequestError, match="empty"):
        m.generate("")
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        m.generate([1, 2, 10**7])
    with pytest.raises(PromptTooLongError, match="context"):
        m.generate([5] * (m.context_length + 1))
