"""slotinfer runs each family exactly like Hugging Face transformers.

For every case of ``tests/parity_fixtures.py`` transformers builds a tiny random
model, saves it with ``save_pretrained`` (so config.json carries whatever keys
the installed transformers writes), and both libraries load that folder:

1. last-position logits of a 24-token prompt (longer than Gemma's 8-token
   window) agree to 1e-4 (float32 on both sides, eager attention in torch);
2. 16 greedy tokens agree exactly (``generate(do_sample=False)`` against
   ``Model.generate(..., ignore_eos=True)``), which also checks the decode path
   with its KV cache and sliding windows past the prompt.

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
from slotinfer.cache import SequenceCache  # noqa: E402

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
