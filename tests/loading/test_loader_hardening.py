"""Hostile model folders: the loader never follows a file out of the folder, never sizes anything by a
config it has not checked against the tensors, never blocks on a file that is not one, and refuses
values that would load as garbage, each with a typed error that names the key or the file."""

import json
import os
import resource
import shutil
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import slotinfer
from slotinfer.kv.views import SequenceCache
from slotinfer.errors import ConfigError, ModelLoadError, SlotinferError, WeightError
from slotinfer.testing import FAMILIES, make_tiny_model

SECRET = "SLOTINFER_TEST_SECRET=hunter2-do-not-log"
GiB = 2**30


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """source(family) -> a pristine tiny model folder, written once; copy it before changing it."""
    root = tmp_path_factory.mktemp("pristine")
    made = {}

    def get(family="llama", **kw):
        key = (family, repr(sorted(kw.items())))
        if key not in made:
            made[key] = make_tiny_model(family, root / f"{family}-{len(made)}", **kw)
        return made[key]

    return get


@pytest.fixture
def folder(source, tmp_path):
    """A fresh copy of the tiny Llama, to break."""
    return Path(shutil.copytree(source("llama"), tmp_path / "m"))


def copy_of(source, tmp_path, family, **kw) -> Path:
    return Path(shutil.copytree(source(family, **kw), tmp_path / family))


def edit_config(folder: Path, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_tensors(folder: Path, edit):
    path = folder / "model.safetensors"
    weights = dict(mx.load(str(path)))
    edit(weights)
    mx.save_safetensors(str(path), weights)


def write_index(folder: Path, shard: str):
    names = mx.load(str(next(folder.glob("*.safetensors")))).keys()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))


def logits(model):
    h = model.net(mx.array([[5, 17, 42, 99, 7]]), SequenceCache(model.config.num_layers))
    return np.array(model.net.head(h[:, -1]).astype(mx.float32))[0]


def secret_file(tmp_path) -> Path:
    f = tmp_path / "secret.txt"
    f.write_text(SECRET + "\n" * 100)
    return f


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


# -- shard names stay inside the folder ----------------------------------------------------------------

@pytest.mark.parametrize("name", ["../secret.txt", "ABSOLUTE", "sub/../../secret.txt", "/proc/self/environ"])
def test_index_names_outside_the_folder_are_refused_without_echoing_them(folder, tmp_path, name, monkeypatch):
    secret_file(tmp_path)
    monkeypatch.setenv("SLOTINFER_TEST_SECRET", "hunter2-do-not-log")  # what /proc/self/environ would show
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    write_index(folder, str(tmp_path / "secret.txt") if name == "ABSOLUTE" else name)
    with pytest.raises(WeightError, match="not a file inside the model folder") as e:
        slotinfer.load(folder)
    assert "hunter2" not in str(e.value)


def test_index_naming_another_folders_weights_is_refused(source, tmp_path):
    other = copy_of(source, tmp_path, "llama")
    mine = Path(shutil.copytree(other, tmp_path / "mine"))
    (mine / "model.safetensors").unlink()
    write_index(other, "../llama/model.safetensors")  # written from other's names
    shutil.move(other / "model.safetensors.index.json", mine / "model.safetensors.index.json")
    with pytest.raises(WeightError, match=r"model.safetensors.index.json names the shard '\.\./llama/"):
        slotinfer.load(mine)


def test_a_symlink_out_of_the_folder_is_refused(source, tmp_path):
    other = copy_of(source, tmp_path, "llama")
    mine = Path(shutil.copytree(other, tmp_path / "mine"))
    (mine / "model.safetensors").unlink()
    (mine / "model.safetensors").symlink_to(other / "model.safetensors")
    with pytest.raises(WeightError, match="leads outside the model folder"):
        slotinfer.load(mine)
    (mine / "model.safetensors").unlink()
    (mine / "model.safetensors").symlink_to(secret_file(tmp_path))
    with pytest.raises(WeightError, match="leads outside the model folder") as e:
        slotinfer.load(mine)
    assert "hunter2" not in str(e.value)


def test_symlinks_inside_the_folder_and_into_the_hub_repos_blobs_load(source, tmp_path):
    pristine = source("llama")
    base = logits(slotinfer.load(pristine))
    inside = Path(shutil.copytree(pristine, tmp_path / "inside"))
    (inside / "weights").mkdir()
    (inside / "model.safetensors").rename(inside / "weights" / "w.safetensors")
    (inside / "model.safetensors").symlink_to("weights/w.safetensors")
    np.testing.assert_array_equal(logits(slotinfer.load(inside)), base)

    # huggingface_hub's cache: snapshots/<commit>/<file> -> ../../blobs/<hash>, the blobs in the repo's folder
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in pristine.iterdir():
        shutil.copy(f, blobs / f"hash-{f.name}")
        (snap / f.name).symlink_to(Path("../../blobs") / f"hash-{f.name}")
    np.testing.assert_array_equal(logits(slotinfer.load(snap)), base)
    sub = snap / "text"  # a model in a folder of the snapshot links to the same blobs
    sub.mkdir()
    for f in pristine.iterdir():
        (sub / f.name).symlink_to(Path("../../../blobs") / f"hash-{f.name}")
    np.testing.assert_array_equal(logits(slotinfer.load(sub)), base)
    shutil.rmtree(sub)

    # ...but not into the blobs of another repo of the same cache
    other = tmp_path / "hub" / "models--org--other" / "blobs"
    other.mkdir(parents=True)
    shutil.move(blobs / "hash-model.safetensors", other / "w")
    (snap / "model.safetensors").unlink()
    (snap / "model.safetensors").symlink_to(other / "w")
    with pytest.raises(WeightError, match="leads outside the model folder"):
        slotinfer.load(snap)


def test_files_that_are_not_weights_are_refused_without_echoing_them(folder, tmp_path):
    (folder / "model.safetensors").write_text(SECRET)
    with pytest.raises(WeightError, match="not a safetensors file") as e:
        slotinfer.load(folder)
    assert "hunter2" not in str(e.value) and "SLOTINFER" not in str(e.value)
    gguf = tmp_path / "model.gguf"
    gguf.write_text(SECRET * 2)
    with pytest.raises(ModelLoadError) as e:
        slotinfer.load(gguf)
    assert "SLOTINFER" not in str(e.value) and "hunter2" not in str(e.value)


# -- only regular files are read, and JSON only up to a size --------------------------------------------

def load_in_thread(path, fifo: Path):
    """load(path) with a deadline; a reader blocked on the FIFO is released by writing to it."""
    got = {}

    def run():
        try:
            got["model"] = slotinfer.load(path)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"{}")
        os.close(fd)
        t.join(60)
        pytest.fail(f"load blocked on the FIFO {fifo.name}")
    return got


@pytest.mark.parametrize("name, error", [("config.json", ConfigError), ("generation_config.json", ConfigError),
                                         ("model.safetensors", WeightError), ("tokenizer.json", SlotinferError),
                                         ("tokenizer_config.json", SlotinferError),
                                         ("model.safetensors.index.json", WeightError)])
def test_a_fifo_in_place_of_a_file_is_refused_not_read(folder, name, error):
    if os.path.lexists(folder / name):
        (folder / name).unlink()
    os.mkfifo(folder / name)
    got = load_in_thread(folder, folder / name)
    assert isinstance(got.get("error"), error), got
    assert "not a regular file" in str(got["error"]) and name in str(got["error"])


def test_a_fifo_named_as_a_gguf_is_refused(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    got = load_in_thread(fifo, fifo)
    assert isinstance(got.get("error"), ModelLoadError), got
    assert "not a regular file" in str(got["error"])


def test_a_device_in_place_of_config_json_is_refused(folder):
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("/dev/zero")  # read to its end, it never ends
    with pytest.raises(ConfigError, match="not a regular file"):
        slotinfer.load(folder)


def test_an_oversized_json_file_is_refused_before_it_is_read(folder):
    with open(folder / "generation_config.json", "r+b") as f:
        f.truncate(300 * 2**20)  # sparse: costs no disk, and would cost 300 MB to read
    before = maxrss()
    with pytest.raises(ConfigError, match=r"generation_config.json is 314572800 bytes, more than the"):
        slotinfer.load(folder)
    assert maxrss() - before < 100 * 2**20


# -- the config is checked against the tensors before anything is sized by it ---------------------------

@pytest.mark.parametrize("changes, key", [
    (dict(num_hidden_layers=10**7), "num_hidden_layers"),
    (dict(num_hidden_layers=5), "num_hidden_layers"),
    (dict(hidden_size=2**40, head_dim=None), "hidden_size"),
    (dict(hidden_size=2**20), "hidden_size"),
    (dict(vocab_size=2**40), "vocab_size"),
    (dict(intermediate_size=2**36), "intermediate_size"),
    (dict(num_attention_heads=2**20, num_key_value_heads=2**20), "num_attention_heads"),
])
def test_a_config_that_lies_about_sizes_fails_before_allocating(folder, changes, key):
    edit_config(folder, **changes)
    mx.reset_peak_memory()
    before = maxrss()
    with pytest.raises((ConfigError, WeightError), match=key):
        slotinfer.load(folder)
    assert maxrss() - before < GiB // 4 and mx.get_peak_memory() < GiB // 4


def test_a_safetensors_header_that_lies_about_a_shape_is_refused(folder):
    raw = (folder / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["shape"] = [2**40]
    text = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(WeightError, match="model.norm.weight.*spans 256 bytes"):
        slotinfer.load(folder)


# -- raw errors become typed ones that name the key or the file -------------------------------------------

@pytest.mark.parametrize("family, changes, key", [
    ("llama", dict(num_attention_heads=0), "num_attention_heads"),
    ("llama", dict(num_key_value_heads=0), "num_key_value_heads"),
    ("llama", dict(num_key_value_heads=3), "num_key_value_heads"),
    ("llama", dict(rms_norm_eps=0), "rms_norm_eps"),
    ("llama", dict(rms_norm_eps=-1e-5), "rms_norm_eps"),
    ("llama", dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    ("llama", dict(max_position_embeddings=0), "max_position_embeddings"),
    ("llama", dict(max_position_embeddings=-5), "max_position_embeddings"),
    ("llama", dict(hidden_size=64.7), "hidden_size"),
    ("llama", dict(hidden_size=True), "hidden_size"),
    ("llama", dict(rope_theta=-1.0), "rope_theta"),
    ("llama", dict(rope_theta=float("inf")), "rope_theta"),
    ("llama", dict(tie_word_embeddings="no"), "tie_word_embeddings"),
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                 "high_freq_factor": 4.0}), "high_freq_factor"),
    ("gemma3_text", dict(layer_types=[1, 2, 3, 4, 5, 6]), "layer_types"),
    ("gemma3_text", dict(layer_types=[["full_attention"]] * 6), "layer_types"),
    ("gemma3_text", dict(layer_types="sliding_attention"), "layer_types"),
    ("gemma3_text", dict(query_pre_attn_scalar="abc"), "query_pre_attn_scalar"),
    ("gemma3_text", dict(query_pre_attn_scalar=0), "query_pre_attn_scalar"),
    ("gemma3_text", dict(sliding_window=0), "sliding_window"),
    ("gemma3_text", dict(sliding_window=-16), "sliding_window"),
    ("gemma3_text", dict(sliding_window_pattern=0), "sliding_window_pattern"),
    ("gemma3_text", dict(hidden_activation=["gelu"]), "hidden_activation"),
    ("gemma2", dict(attn_logit_softcapping=-50.0), "attn_logit_softcapping"),
])
def test_bad_values_are_typed_errors_naming_the_key(source, tmp_path, family, changes, key):
    path = copy_of(source, tmp_path, family)
    edit_config(path, **changes)
    with pytest.raises(ConfigError if key != "hidden_activation" else SlotinferError, match=key):
        slotinfer.load(path)


def test_whole_numbers_written_as_floats_still_load(source, tmp_path):
    path = copy_of(source, tmp_path, "llama")
    edit_config(path, hidden_size=64.0, num_hidden_layers=4.0)
    np.testing.assert_array_equal(logits(slotinfer.load(path)), logits(slotinfer.load(source("llama"))))


def test_a_symlink_loop_is_a_typed_error_naming_the_file(folder):
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to("model.safetensors")
    with pytest.raises(WeightError, match="model.safetensors is a symlink loop"):
        slotinfer.load(folder)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_shard_is_a_typed_error_naming_the_file(folder):
    (folder / "model.safetensors").chmod(0)
    with pytest.raises(WeightError, match="model.safetensors: permission denied"):
        slotinfer.load(folder)


# -- weights that would load as garbage ------------------------------------------------------------------

@pytest.mark.parametrize("name, dtype", [("model.norm.weight", mx.int32),
                                         ("model.layers.0.input_layernorm.weight", mx.uint8),
                                         ("model.layers.1.mlp.up_proj.weight", mx.int8),
                                         ("model.embed_tokens.weight", mx.int32)])
def test_integer_weights_where_floats_are_needed_are_refused(folder, name, dtype):
    edit_tensors(folder, lambda w: w.__setitem__(name, (w[name] * 10).astype(dtype)))
    with pytest.raises(WeightError, match=f"tensor {name} is {dtype}".replace("mlx.core.", "")):
        slotinfer.load(folder)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(folder, value, monkeypatch):
    name = "model.layers.2.self_attn.k_proj.weight"

    def poison(w):
        a = np.array(w[name])
        a[3, 5] = value
        w[name] = mx.array(a)

    edit_tensors(folder, poison)
    with pytest.raises(WeightError, match=f"tensor {name} holds NaN or Inf"):
        slotinfer.load(folder)
    monkeypatch.setenv("SLOTINFER_CHECK_FINITE", "0")  # the user's way past the scan
    assert slotinfer.load(folder).config.num_layers == 4


def test_non_finite_quantization_scales_are_refused(source, tmp_path):
    path = copy_of(source, tmp_path, "qwen3", quantize={"bits": 8, "group_size": 32})
    name = "model.layers.1.mlp.down_proj.scales"

    def poison(w):
        a = np.array(w[name])
        a[0, 0] = np.nan
        w[name] = mx.array(a)

    edit_tensors(path, poison)
    with pytest.raises(WeightError, match=f"tensor {name} holds NaN or Inf"):
        slotinfer.load(path)


# -- what a folder holds is data, never code ----------------------------------------------------------------

def test_pickles_and_modeling_code_in_the_folder_never_run(folder, tmp_path):
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    (folder / "modeling_llama.py").write_text(code)
    (folder / "configuration_llama.py").write_text(code)

    class Bomb:
        def __reduce__(self):
            return (exec, (code,))

    import pickle
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"model.norm.weight": Bomb()}))
    edit_config(folder, auto_map={"AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"})
    model = slotinfer.load(folder)
    assert np.isfinite(logits(model)).all()
    assert not marker.exists()


# -- GGUF metadata gets the same checks ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_twin(tmp_path_factory):
    from gguf_fixtures import twin

    return twin("llama", tmp_path_factory.mktemp("gguf") / "llama")


@pytest.mark.parametrize("key, value, phrase", [
    ("llama.attention.layer_norm_rms_epsilon", 0.0, "rms_norm_eps"),
    ("llama.context_length", 0, "max_position_embeddings"),
    ("llama.attention.head_count", 0, "num_attention_heads"),
    ("llama.block_count", 10**7, "block_count"),
    ("llama.embedding_length", 2**31, "hidden_size"),
    ("llama.rope.freq_base", -1.0, "rope_theta"),
])
def test_gguf_metadata_is_checked_like_config_json(gguf_twin, tmp_path, key, value, phrase):
    from gguf_fixtures import write_gguf

    path = write_gguf(gguf_twin, tmp_path / "bad.gguf", meta_edits={key: value})
    mx.reset_peak_memory()
    with pytest.raises((ConfigError, WeightError), match=phrase):
        slotinfer.load(path)
    assert mx.get_peak_memory() < GiB // 4


def test_gguf_non_finite_weights_are_refused(gguf_twin, tmp_path):
    from gguf_fixtures import write_gguf

    def poison(plan):
        out = []
        for name, w, kind in plan:
            if name == "blk.1.ffn_up.weight":
                w = w.copy()
                w[2, 3] = np.inf
            out.append((name, w, kind))
        return out

    path = write_gguf(gguf_twin, tmp_path / "inf.gguf", tensor_edits=poison)
    # named as the file names it (the GGUF reader checks each tensor as it reads), or as the model does
    with pytest.raises(WeightError, match=r"(blk\.1\.ffn_up\.weight \(F32\)|model\.layers\.1\.mlp\.up_proj\.weight) "
                                          r"holds NaN or Inf"):
        slotinfer.load(path)


# -- any value of any config key: a working model or a typed error naming the key -------------------------------

VALUES = st.one_of(
    st.none(), st.booleans(),
    st.integers(-3, 70), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-100, 100), st.floats(1e-12, 1e-3),
    st.text(max_size=6), st.sampled_from(["full_attention", "sliding_attention", "llama3", "linear", "gelu"]),
    st.lists(st.one_of(st.integers(-2, 8), st.text(max_size=3), st.sampled_from(["sliding_attention",
                                                                                    "full_attention"])), max_size=7),
    st.dictionaries(st.sampled_from(["rope_type", "factor", "type"]), st.one_of(st.floats(), st.text(max_size=6)),
                    max_size=2),
)
EXTRA_KEYS = ["head_dim", "layer_types", "sliding_window_pattern", "query_pre_attn_scalar", "rope_parameters",
              "quantization", "attention_bias", "mlp_bias", "rope_local_base_freq", "final_logit_softcapping"]


@pytest.mark.parametrize("family", FAMILIES)
def test_any_config_value_loads_a_working_model_or_names_the_key(source, tmp_path, family):
    path = copy_of(source, tmp_path, family)
    pristine = json.loads((path / "config.json").read_text())

    @settings(max_examples=max(settings().max_examples, 30))
    @given(key=st.sampled_from(sorted(pristine) + EXTRA_KEYS), value=VALUES, drop=st.booleans())
    def check(key, value, drop):
        cfg = dict(pristine)
        if drop:
            cfg.pop(key, None)
        else:
            cfg[key] = value
        (path / "config.json").write_text(json.dumps(cfg))
        mx.reset_peak_memory()
        before = maxrss()
        try:
            model = slotinfer.load(path)
        except SlotinferError as e:
            assert key in str(e), (key, value, str(e))
        else:
            assert np.isfinite(logits(model)).all(), (key, value)
            assert model.generate([5, 17, 42], max_tokens=2).finish_reason in ("stop", "length")
        assert maxrss() - before < GiB and mx.get_peak_memory() < GiB, (key, value)

    check()
