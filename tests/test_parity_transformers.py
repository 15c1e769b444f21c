"""slotinfer runs each family exactly like Hugging Face transformers.

For every case of ``tests/parity_fixtures.py`` transformers builds a tiny random
model, saves it with ``save_pretrained`` (so config.json carries whatever keys
the installed transformers writes), and both libraries load that folder:

1. last-position logits of a 24-token prompt (longer than Gemma's 8-token
   window) agree to 1e-4 (float32 on both sides, eager attention in torch);
2. 16 greedy tokens agree exactly (``generate(do_sample=False)`` against
   ``Model.generate(..., ignore_eos=True)``), which also checks the decode path
   with its KV cache and sliding windows past the prompt.

GGUF files in K-quant and I-quant types, and mixed as llama.cpp's Q4_K_M, written by
``tests/gguf_fixtures.py`` from slotinfer's tiny models, are read by both (transformers
dequantizes them with gguf itself): last-position logits and greedy tokens agree.

The real SmolLM2-135M-Instruct GGUF (when its wheel is installed) is read by both:
transformers dequantizes it itself (``from_pretrained(dir, gguf_file=...)``, float32), and
prompt ids, chat rendering, last-position logits and greedy tokens (text and chat prompts,
stopping at ``<|im_end|>``) agree on ``Model.generate``, ``batch_generate`` and the
Inferencer.

Skipped when torch or transformers (>= 5) is not installed (``pip install -e .[parity]``).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")  # rope_parameters, save_original_format

import mlx.core as mx  # noqa: E402

import slotinfer  # noqa: E402
from slotinfer.kv.views import SequenceCache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper module sits beside this file
from parity_fixtures import CASES, GEMMA_WINDOW, load_reference, write_checkpoint  # noqa: E402

PROMPT_LEN = 24
NEW_TOKENS = 16
ATOL = 1e-4  # float32 on both sides; bf16 weights are upcast exactly, so the same bound holds

assert PROMPT_LEN > 2 * GEMMA_WINDOW


def _prompt(vocab_size: int, seed: int) -> list[int]:
    # Ordinary tokens only (ids past the specials and below the tokenizer's size).
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, min(vocab_size, 500), size=PROMPT_LEN)]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # Tiny matmuls: extra threads only contend with MLX's (seconds per generate() on a busy machine).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok_root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity-tokenizers")


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def pair(request, tmp_path_factory, tok_root):
    """(case, transformers model, slotinfer model) for one checkpoint folder."""
    case = request.param
    folder = tmp_path_factory.mktemp(case.name)
    write_checkpoint(case, folder, tok_root)
    with torch.no_grad():
        ref = load_reference(folder)
    ours = slotinfer.load(folder, dtype="float32")  # the CPU default; explicit so a GPU run compares f32 too
    return case, ref, ours


def test_folder_is_what_transformers_writes(pair):
    """The case really covers the new-style keys and the requested layout."""
    case, ref, ours = pair
    folder = ours.path
    raw = json.loads((folder / "config.json").read_text())
    text = raw.get("text_config", raw)
    if case.classic:
        assert "rope_parameters" not in text and "layer_types" not in text and "rope_theta" in text
    else:
        assert "rope_parameters" in text, sorted(text)
    if case.max_shard_size:
        assert (folder / "model.safetensors.index.json").exists()
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    ref_text = ref.config.get_text_config()
    assert ours.config.vocab_size == ref_text.vocab_size
    assert ours.config.num_layers == ref_text.num_hidden_layers
    if getattr(ref_text, "layer_types", None):  # transformers' reading of the layer kinds, classic keys included
        ours_kinds = [ours.config.is_sliding(i) for i in range(ours.config.num_layers)]
        assert ours_kinds == [t == "sliding_attention" for t in ref_text.layer_types]


def test_last_logits_match(pair):
    case, ref, ours = pair
    ids = _prompt(ours.tokenizer.vocab_size, seed=1)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1].to(torch.float32).numpy()
    h = ours.net(mx.array([ids]), SequenceCache(ours.config.num_layers))
    got = np.array(ours.net.head(h[:, -1]).astype(mx.float32))[0]
    assert got.shape == want.shape
    assert np.std(want) > 0.1, "degenerate reference logits: the weights do not exercise the model"
    err = np.abs(got - want)
    assert err.max() <= ATOL, (
        f"{case.name}: max |logit diff| {err.max():.3g} at id {int(err.argmax())} "
        f"(logit scale {np.abs(want).max():.3g}); "
        f"argmax ours {int(got.argmax())} vs transformers {int(want.argmax())}"
    )


def test_greedy_tokens_match(pair):
    case, ref, ours = pair
    ids = _prompt(ours.tokenizer.vocab_size, seed=2)
    gen_cfg = copy.deepcopy(ref.generation_config)
    gen_cfg.eos_token_id = None  # generate the full 16 tokens, as ignore_eos does
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           do_sample=False, max_new_tokens=NEW_TOKENS, generation_config=gen_cfg)
    want = out[0, len(ids):].tolist()
    got = ours.generate(ids, max_tokens=NEW_TOKENS, ignore_eos=True).tokens
    assert len(want) == NEW_TOKENS
    assert got == want, f"{case.name}: slotinfer {got} vs transformers {want}"


# -- K-quant and I-quant GGUF files, read by transformers itself -------------------------------

# sizes whose GGUF transformers reads as the same model: rows of 320 values (not whole super-blocks, so a
# Q4_K_M mix falls back to Q5_0/Q8_0 there) and its own defaults where it ignores the metadata (Qwen 3's
# head size 128, Gemma's attention scale of 256 = the head size; no Llama 3 rope scaling)
K_FAMILIES = {"llama": {"rope_scaling": None}, "qwen2": {}, "qwen3": {"head_dim": 128},
              "gemma2": {"head_dim": 256}, "gemma3_text": {"head_dim": 256}}
K_CASES = [(f, "Q4_K_M") for f in K_FAMILIES] + [("llama", q) for q in (
    "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ2_XXS", "IQ1_M")]


@pytest.fixture(scope="module")
def k_root(tmp_path_factory):
    return tmp_path_factory.mktemp("parity-kquant")


@pytest.mark.parametrize("family,qtype", K_CASES, ids=lambda v: v)
def test_k_quant_gguf_matches_transformers(k_root, family, qtype):
    from transformers import AutoModelForCausalLM

    from gguf_fixtures import K_QUANT_DIMS, llama_cpp_q4_k_m, twin, write_gguf

    dims = dict(K_QUANT_DIMS, **K_FAMILIES[family])
    if qtype == "Q4_K_M":
        dims.update(hidden_size=320, num_attention_heads=5, num_key_value_heads=1)
    tw = k_root / f"{family}-{qtype}"
    path = write_gguf(twin(family, tw, dims=dims), k_root / f"{family}-{qtype}.gguf",
                      llama_cpp_q4_k_m if qtype == "Q4_K_M" else qtype)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(k_root, gguf_file=path.name, dtype=torch.float32).eval()
    ours = slotinfer.load(path, dtype="float32")
    ids = _prompt(ours.tokenizer.vocab_size, seed=3)[:12]
    x = torch.tensor([ids])
    with torch.no_grad():
        want = ref(x).logits[0, -1].numpy()
        out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8,
                           eos_token_id=None)
    h = ours.net(mx.array([ids]), SequenceCache(ours.config.num_layers))
    got = np.array(ours.net.head(h[:, -1]).astype(mx.float32))[0]
    assert np.abs(got - want).max() <= ATOL, (np.abs(got - want).max(), np.abs(want).max())
    assert ours.generate(ids, max_tokens=8, ignore_eos=True).tokens == out[0, len(ids):].tolist()


# -- SmolLM2-135M-Instruct: one real GGUF, read by transformers itself ----------------------

SMOL_TEXTS = ["The capital of France is", "In 2024, there were 12345 cats and 3 dogs in the"]
SMOL_CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
              [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
               {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
               {"role": "user", "content": "Name a fruit."}]]
SMOL_NEW = 32  # text prompts run to the limit; the chat answers end at <|im_end|> before it
SMOL_ATOL = 5e-4  # both dequantize the Q4_1 blocks to float32 exactly; the rest is float32 summation order


@pytest.fixture(scope="module")
def smol():
    """transformers' and slotinfer's reading of the SmolLM2 GGUF, and the reference's answers."""
    from slotinfer import default_model

    path = default_model.path()
    if path is None:
        pytest.skip(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ref.eval()
    ref_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = slotinfer.load(path, dtype="float32")
    chats = [ref_tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in SMOL_CHATS]
    prompts = SMOL_TEXTS + chats
    ids = [ref_tok(p)["input_ids"] for p in prompts]
    greedy, logits = [], []
    with torch.no_grad():
        for p in ids:
            x = torch.tensor([p])
            logits.append(ref(x).logits[0, -1].numpy())
            out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=SMOL_NEW)
            greedy.append(out[0, len(p):].tolist())
    eos = ref.generation_config.eos_token_id
    assert all(g[-1] == eos for g in greedy[len(SMOL_TEXTS):]), "a chat answer did not end within SMOL_NEW tokens"
    return dict(ref=ref, ref_tok=ref_tok, ours=ours, prompts=prompts, chats=chats, ids=ids, greedy=greedy,
                logits=logits)


def test_smollm2_prompt_ids_and_chat_template(smol):
    ours = smol["ours"]
    assert [ours.apply_chat_template(c) for c in SMOL_CHATS] == smol["chats"]
    for prompt, want in zip(smol["prompts"], smol["ids"]):
        assert ours.tokenizer.encode(prompt) == want, prompt
    assert ours.eos_ids == {smol["ref"].generation_config.eos_token_id}


def test_smollm2_last_logits(smol):
    ours = smol["ours"]
    engine = ours.classify(smol["prompts"], return_logits=True)  # the slot engine's prefill, batched
    for k, (ids, want) in enumerate(zip(smol["ids"], smol["logits"])):
        h = ours.net(mx.array([ids]), SequenceCache(ours.config.num_layers))
        alone = np.array(ours.net.head(h[:, -1]).astype(mx.float32))[0]
        for got in (alone, np.asarray(engine[k].logits)):
            err = np.abs(got - want)
            assert err.max() <= SMOL_ATOL, f"prompt {k}: max |logit diff| {err.max():.3g} (scale {np.abs(want).max():.3g})"


def test_smollm2_greedy_generate(smol):
    for prompt, want in zip(smol["prompts"], smol["greedy"]):
        assert smol["ours"].generate(prompt, max_tokens=SMOL_NEW).tokens == want, prompt


def test_smollm2_greedy_batch_generate(smol):
    got = smol["ours"].batch_generate(smol["prompts"], max_tokens=SMOL_NEW)
    assert [r.tokens for r in got] == smol["greedy"]


def test_smollm2_greedy_inferencer(smol):
    with slotinfer.Inferencer(smol["ours"], slots=3, max_len=256) as inf:  # fewer slots than prompts: refills
        handles = [inf.submit(p, max_tokens=SMOL_NEW) for p in smol["prompts"]]
        assert [h.result().tokens for h in handles] == smol["greedy"]


@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q6_K"])
def test_smollm2_k_quants_match_transformers(smol, tmp_path, recipe):
    """The real model re-encoded as llama.cpp's Q4_K_M and Q6_K files lay it out (its rows of 576 fall
    back to Q5_0/Q8_0), read by both: the same greedy tokens on every prompt, in float32 and on the CPU's
    own kernels (which read the Q4_K, Q6_K and Q5_0 blocks as stored), alone and batched."""
    from transformers import AutoModelForCausalLM

    from gguf_fixtures import T, llama_cpp_q4_k_m, requantize
    from slotinfer import default_model

    def q6_k(name, w):
        return T.F32 if w.ndim != 2 else T.Q6_K if w.shape[1] % 256 == 0 else T.Q8_0

    def q4_k_m(name, w):
        return llama_cpp_q4_k_m(name, w, tied=True)

    path = requantize(default_model.path(), tmp_path / f"smollm2-{recipe}.gguf", q4_k_m if recipe == "Q4_K_M" else q6_k)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    want = []
    for ids in smol["ids"]:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=SMOL_NEW)
        want.append(out[0, len(ids):].tolist())
    for ours in (slotinfer.load(path, dtype="float32"), slotinfer.load(path)):  # float32; the device's policy
        assert [ours.generate(ids, max_tokens=SMOL_NEW).tokens for ids in smol["ids"]] == want
        assert [r.tokens for r in ours.batch_generate(smol["ids"], max_tokens=SMOL_NEW)] == want


def test_smollm2_chat_answers_end_at_the_end_of_turn(smol):
    """Both stop each chat answer at <|im_end|> after the same tokens, and the text is the reference's."""
    ours = smol["ours"]
    for chat, want in zip(SMOL_CHATS, smol["greedy"][len(SMOL_TEXTS):]):
        got = ours.generate(ours.apply_chat_template(chat), max_tokens=SMOL_NEW)
        assert (got.tokens, got.finish_reason) == (want, "stop")
        assert got.text == smol["ref_tok"].decode(want, skip_special_tokens=True)
