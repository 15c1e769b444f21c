"""Loading checkpoints in published layouts, and the errors bad folders get."""

import json
import re
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest

import slotinfer
from slotinfer.kv.views import SequenceCache
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


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_without_weights_the_text_side_is_the_models(models, model_dir, family):
    """``weights=False`` (what the Ray Serve ingress loads): the same config, tokenizer, chat template
    and EOS ids, and no network."""
    full, text = models[family], slotinfer.load(model_dir(family), weights=False)
    assert not text.has_weights and text.config == full.config and text.eos_ids == full.eos_ids
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <b>there</b>"}]
    assert text.apply_chat_template(msgs) == full.apply_chat_template(msgs)
    assert text.encode_prompt(text.apply_chat_template(msgs)) == full.encode_prompt(full.apply_chat_template(msgs))
    ids = full.encode_prompt("a cat sat on the mat")
    assert text.tokenizer.decode(ids) == full.tokenizer.decode(ids)
    # running it is a typed error that says how to get a model that runs
    for run in (lambda: text.generate("hi", max_tokens=2), lambda: text.batch_generate(["hi"], max_tokens=2),
                lambda: text.classify(["hi"]), lambda: slotinfer.Inferencer(text, slots=1)):
        with pytest.raises(slotinfer.InvalidRequestError, match="weights=False"):
            run()


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


@pytest.mark.parametrize("rel", ["nope.gguf", "sub/nope.GGUF", "no-dir/model-Q4_1.gguf"])
def test_a_gguf_path_that_does_not_exist_is_called_a_missing_file(tmp_path, monkeypatch, rel):
    """Not a "folder holding config.json", nor a hub repo: the file is missing, and the error says from where."""
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    for spec in (rel, tmp_path / rel):
        with pytest.raises(ModelNotFoundError) as e:
            slotinfer.load(spec)
        msg = str(e.value)
        assert msg.startswith(f"the GGUF file {str(spec)!r} does not exist (there is no ") and "config.json" not in msg
        assert "hub" not in msg.lower() and str(tmp_path) in msg, msg


def test_file_given_as_folder(folder):
    with pytest.raises(ModelNotFoundError, match="is a file, not a folder; pass the folder holding config.json"):
        slotinfer.load(folder / "config.json")


@pytest.mark.parametrize("path", [None, 5, b"models/x", ["models/x"]])
def test_path_of_the_wrong_type(path):
    with pytest.raises(InvalidRequestError, match="path of a model folder"):
        slotinfer.load(path)


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


NO_OFFSETS = b'{"a": {"dtype": "F32", "shape": [1]}}'
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"ab" * 32 + b"\nsize 470980\n"


@pytest.mark.parametrize("content, phrase", [
    (LFS_POINTER, "git-lfs pointer file.*git lfs pull"),
    (b"<!DOCTYPE html><html><body>Not Found</body></html>", "not a safetensors file"),
    (np.random.default_rng(0).bytes(1000), "not a safetensors file"),
    (struct.pack("<Q", 5) + b"[1,2]", "not a safetensors file"),
    (struct.pack("<Q", 2**62) + b"{}", "not a safetensors file"),
    (struct.pack("<Q", len(NO_OFFSETS)) + NO_OFFSETS, "'a' has no valid 'data_offsets'"),
], ids=["lfs-pointer", "html", "random", "list-header", "huge-header", "no-offsets"])
def test_not_a_safetensors_file(folder, content, phrase):
    (folder / "model.safetensors").write_bytes(content)
    with pytest.raises(WeightError, match=phrase) as e:
        slotinfer.load(folder)
    assert "model.safetensors" in str(e.value) and ("re-download" in str(e.value) or "git lfs pull" in str(e.value))


@pytest.mark.parametrize("name, error", [("config.json", ConfigError), ("generation_config.json", ConfigError),
                                         ("model.safetensors", WeightError)])
def test_file_that_is_a_directory(folder, name, error):
    (folder / name).unlink()
    (folder / name).mkdir()
    with pytest.raises(error, match=f"{name} is a directory, not a"):
        slotinfer.load(folder)


@pytest.mark.parametrize("changes, phrase", [
    (dict(max_position_embeddings="abc"), "'max_position_embeddings' must be int, got 'abc'"),
    (dict(rms_norm_eps="x"), "'rms_norm_eps' must be float, got 'x'"),
    (dict(num_key_value_heads="two"), "'num_key_value_heads' must be int"),
    (dict(rope_theta="fast"), "'rope_theta' must be float"),
    (dict(rope_scaling={"rope_type": "llama3"}), "rope type 'llama3' .* needs a 'factor'"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "big"}), "'factor' must be float"),
    (dict(rope_scaling="linear"), "'rope_scaling' must be an object"),
    (dict(rope_parameters="linear"), "'rope_parameters' must be an object"),
    (dict(quantization=4), "'quantization' must be an object"),
])
def test_bad_config_values(folder, changes, phrase):
    edit_config(folder, **changes)
    with pytest.raises(ConfigError, match=phrase):
        slotinfer.load(folder)


@pytest.mark.parametrize("content, phrase", [
    ("[1]", "generation_config.json must hold a JSON object"),
    ('{"eos_token_id": ["a"]}', "'eos_token_id' must be a token id or a list of token ids, got \\['a'\\]"),
    ('{"eos_token_id": "2"}', "'eos_token_id' must be"),
])
def test_bad_generation_config(folder, content, phrase):
    (folder / "generation_config.json").write_text(content)
    with pytest.raises(ConfigError, match=phrase):
        slotinfer.load(folder)


@pytest.mark.parametrize("index, phrase", [
    ("[1]", "has no 'weight_map' object"),
    ("{not json", "not valid JSON"),
    ('{"weight_map": {"model.norm.weight": 5}}', "must map tensor names to shard file names, got 5"),
])
def test_bad_shard_index(folder, index, phrase):
    (folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(WeightError, match=phrase) as e:
        slotinfer.load(folder)
    assert "model.safetensors.index.json" in str(e.value)


# -- quantized checkpoints whose tensors and settings disagree ------------------------

QPROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def qfolder(tmp_path, model_dir):
    dst = tmp_path / "q"
    shutil.copytree(model_dir("qwen3", quantize={"bits": 4, "group_size": 32}), dst)
    return dst


@pytest.mark.parametrize("kind, change", [
    ("biases", lambda t: t[:, :1]),  # mx.dequantize would broadcast it: wrong weights, no error
    ("scales", lambda t: t[:, :1]),
    ("scales", lambda t: t[:3]),
    ("weight", lambda t: t[:, :4]),
], ids=["biases-columns", "scales-columns", "scales-rows", "packed-columns"])
def test_quantized_tensor_shapes_are_checked(qfolder, kind, change):
    path = qfolder / "model.safetensors"
    w = mx.load(str(path))
    name = f"{QPROJ}.{kind}"
    good = tuple(w[name].shape)
    w[name] = change(w[name])
    mx.save_safetensors(str(path), w)
    msg = f"tensor {name} has shape {tuple(w[name].shape)}, expected {good}"
    with pytest.raises(WeightError, match=re.escape(msg) + ".*bits=4, group_size=32"):
        slotinfer.load(qfolder)


def test_quantized_weight_must_be_packed(qfolder):
    path = qfolder / "model.safetensors"
    w = mx.load(str(path))
    w[f"{QPROJ}.weight"] = w[f"{QPROJ}.weight"].astype(mx.float32)
    mx.save_safetensors(str(path), w)
    with pytest.raises(WeightError, match=f"{QPROJ}.weight is .*float32.*packed uint32"):
        slotinfer.load(qfolder)


@pytest.mark.parametrize("change, error, phrase", [
    ({"bits": 8}, WeightError, "bits=8, group_size=32"),
    ({"bits": 3}, WeightError, "bits=3, group_size=32"),
    ({"group_size": 64}, WeightError, "bits=4, group_size=64"),
    ({"group_size": 128}, ConfigError, "cannot be quantized with bits=4, group_size=128"),
    ({"group_size": "abc"}, ConfigError, "quantization group_size 'abc' .*supports 32, 64, 128"),
    ({"bits": 7}, ConfigError, "quantization bits 7 .*supports 2, 3, 4, 5, 6, 8"),
])
def test_quantization_settings_must_fit_the_tensors(qfolder, change, error, phrase):
    cfg = json.loads((qfolder / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        cfg[key].update(change)
    (qfolder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(error, match=phrase) as e:
        slotinfer.load(qfolder)
    assert "model." in str(e.value)  # names the module


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


def test_text_with_lone_surrogates_is_an_invalid_request(models):
    """What Python makes of undecodable argv/stdin bytes ('h\\udcffi') is rejected wherever text is encoded."""
    m = models["llama"]
    bad = "h\udcffi"
    calls = [lambda: m.generate(bad, max_tokens=1), lambda: m.encode_prompt(bad),
             lambda: m.apply_chat_template([{"role": "user", "content": bad}], tokenize=True),
             lambda: m.classify(["fine"], labels=["ok", bad]), lambda: m.classify(["fine"], prefix=bad)]
    for call in calls:
        with pytest.raises(InvalidRequestError, match="not valid Unicode.*lone surrogate.*valid UTF-8"):
            call()
    # batch APIs: the bad prompt gets its own typed error, the others still run
    results = m.batch_generate(["hi", bad], max_tokens=1)
    assert results[0].finish_reason != "error"
    assert results[1].finish_reason == "error" and isinstance(results[1].error, InvalidRequestError)
    results = m.classify(["hi", bad])
    assert results[0].error is None and results[0].token is not None
    assert isinstance(results[1].error, InvalidRequestError) and "not valid Unicode" in str(results[1].error)
