"""Scoring and embeddings against the references users compare with.

* The real SmolLM2-135M-Instruct GGUF, read by transformers itself (float32): the server's ``echo``
  log-probs of a small multiple-choice task equal transformers' log-softmax, token by token and summed
  per item (within 1e-4: see TOKEN_ATOL).
* lm-evaluation-harness: its ``local-completions`` model scores the same task through the real server
  (``tokenizer_backend=remote``: the server's /tokenize and /tokenizer_info) with the accuracy of its
  ``hf`` model on the same checkpoint, item by item.
* sentence-transformers on a tiny random Qwen 3 embedding model in Qwen3-Embedding's layout
  (last-token pooling, read from its files): cosine >= 0.9999 with ``Model.embed`` and /v1/embeddings.

Skipped where torch, transformers, lm-eval or sentence-transformers is not installed
(``pip install -e .[parity]``) or the SmolLM2 wheel is absent.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", minversion="5.0")

import httpx  # noqa: E402

import slotinfer  # noqa: E402
from slotinfer.serve import build_app  # noqa: E402
from slotinfer.serve.background import serving  # noqa: E402
from slotinfer.testing.embedding import make_tiny_embedding_model  # noqa: E402

NAME = "smollm2"
# slotinfer's float32 log-probs of SmolLM2 are within 4.1e-5 of transformers' per token and per item
# (transformers' float32 is within 2.2e-5 of its own float64, slotinfer's within 3e-5): the log-softmax's
# normalizer is summed in blocks (slotinfer.engine.sampling.logsumexp); MLX's own sum over the 49,152
# logits was 2.4e-4 off.
TOKEN_ATOL, ITEM_ATOL = 1e-4, 1e-4

# A small multiple-choice task: (question, choices, answer index).
MC = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("What colour is the sky on a clear day?", ["green", "blue", "red", "yellow"], 1),
    ("How many legs does a dog have?", ["two", "six", "four", "eight"], 2),
    ("What is 2 plus 2?", ["three", "five", "six", "four"], 3),
    ("Which animal says meow?", ["cat", "cow", "dog", "duck"], 0),
    ("What do bees make?", ["milk", "honey", "silk", "wool"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("What is frozen water called?", ["steam", "sand", "glass", "ice"], 3),
    ("What is the opposite of hot?", ["cold", "warm", "big", "fast"], 0),
    ("Which season comes after winter?", ["autumn", "spring", "summer", "night"], 1),
    ("What is the capital of Japan?", ["Beijing", "Seoul", "Tokyo", "Bangkok"], 2),
    ("How many days are in a week?", ["five", "ten", "six", "seven"], 3),
    ("Which fruit is yellow and long?", ["banana", "apple", "grape", "cherry"], 0),
    ("What do you use to write on paper?", ["spoon", "pen", "shoe", "cup"], 1),
    ("Where do fish live?", ["trees", "deserts", "water", "clouds"], 2),
    ("What is the largest ocean on Earth?", ["Atlantic", "Indian", "Arctic", "Pacific"], 3),
    ("What gas do plants take in?", ["carbon dioxide", "helium", "neon", "argon"], 0),
    ("Which is the fastest land animal?", ["turtle", "cheetah", "snail", "sloth"], 1),
    ("What is the capital of Italy?", ["Paris", "Lisbon", "Rome", "Vienna"], 2),
    ("How many hours are in a day?", ["twelve", "ten", "thirty", "twenty-four"], 3),
]
TASK_YAML = """task: slotinfer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder):
    """The task as lm-eval reads it from local files: a YAML beside a JSON-lines dataset (no hub)."""
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC))
    (folder / "slotinfer_mc.yaml").write_text(TASK_YAML.format(data=data))
    return folder


def items(tokenizer):
    """(context ids, continuation ids) of every (question, choice), split as lm-eval splits them."""
    out = []
    for q, choices, _ in MC:
        ctx = tokenizer.encode(f"Question: {q}\nAnswer:", add_special_tokens=False)
        for c in choices:
            out.append((ctx, tokenizer.encode(f" {c}", add_special_tokens=False)))
    return out


@pytest.fixture(scope="module")
def smol():
    from slotinfer import default_model

    path = default_model.path()
    if path is None:
        pytest.skip(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours = slotinfer.load(path, dtype="float32")
    with slotinfer.Inferencer(ours, slots=8, max_len=512, max_queue=64) as inf:
        with serving(build_app(inf, served_model_name=NAME)) as url:
            yield dict(ref=ref, tok=tok, ours=ours, url=url)
    torch.set_num_threads(before)


def test_echo_logprobs_equal_transformers(smol):
    ref, ours = smol["ref"], smol["ours"]
    pairs = items(ours.tokenizer)
    prompts = [ctx + cont for ctx, cont in pairs]
    body = httpx.post(smol["url"] + "/v1/completions", timeout=600, json={
        "model": NAME, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}).json()
    worst_token = worst_item = 0.0
    with torch.no_grad():
        for (ctx, cont), ids, choice in zip(pairs, prompts, body["choices"]):
            z = torch.log_softmax(ref(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
            want = np.array([z[j - 1, ids[j]] for j in range(1, len(ids))])
            got = np.array(choice["logprobs"]["token_logprobs"][1:])
            assert choice["logprobs"]["token_logprobs"][0] is None
            worst_token = max(worst_token, float(np.abs(got - want).max()))
            n = len(ctx) - 1  # the continuation's log-likelihood, as lm-eval sums it
            worst_item = max(worst_item, abs(got[n:].sum() - want[n:].sum()))
    assert worst_token <= TOKEN_ATOL and worst_item <= ITEM_ATOL, (worst_token, worst_item)


def test_lm_eval_local_completions_scores_as_its_hf_model(smol, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm-eval's api extra, which its API models need
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(write_task(tmp_path)))

    def run(model, **kw):
        out = lm_eval.simple_evaluate(model=model, tasks=["slotinfer_mc"], task_manager=tasks, log_samples=True,
                                      **kw)
        samples = sorted(out["samples"]["slotinfer_mc"], key=lambda s: s["doc_id"])
        return out["results"]["slotinfer_mc"]["acc,none"], [[float(r[0]) for r in s["filtered_resps"]] for s in samples]

    acc, lls = run("local-completions", batch_size=8, model_args=(
        f"base_url={smol['url']}/v1/completions,model={NAME},tokenizer_backend=remote,num_concurrent=1,max_retries=1"))
    ref_acc, ref_lls = run(HFLM(pretrained=smol["ref"], tokenizer=smol["tok"], batch_size=8))
    assert acc == ref_acc
    assert [int(np.argmax(x)) for x in lls] == [int(np.argmax(x)) for x in ref_lls]  # the same choice, item by item
    np.testing.assert_allclose(lls, ref_lls, atol=ITEM_ATOL)


def test_embeddings_equal_sentence_transformers(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    folder = make_tiny_embedding_model(tmp_path / "qwen3-emb")  # last-token pooling, as Qwen3-Embedding
    texts = ["a cat sat on the mat", "dogs", "Instruct: find it\nQuery: where is the cat?", "the dog ran far away " * 3]
    want = st.SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=4)
    model = slotinfer.load(folder)
    got = model.embed(texts)
    cos = (got * want).sum(1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999, cos
    with slotinfer.Inferencer(model, slots=2, max_len=128) as inf:
        with serving(build_app(inf)) as url:
            data = httpx.post(url + "/v1/embeddings", json={"input": texts}, timeout=120).json()["data"]
    served = np.array([d["embedding"] for d in data])
    assert ((served * want).sum(1) / np.linalg.norm(want, axis=1)).min() >= 0.9999
