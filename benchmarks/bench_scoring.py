"""Embeddings and echo scoring through the server, side by side with /v1/classify on the same model.

One process, one server (uvicorn on 127.0.0.1 over an Inferencer) on SmolLM2-135M-Instruct (or
``--model``); each measurement is repeated ``--repeats`` times, the runs of each pair interleaved,
and the best of each kept:

* ``embeddings``: ``--inputs`` texts of ``--tokens`` tokens in one POST /v1/embeddings: sequences/s;
* ``classify``: the same texts in one POST /v1/classify with two one-token labels (prefill only, the
  head at two rows of the last position): sequences/s, the prefill rate embeddings are held against;
* ``echo``: the multiple-choice task of tests/test_parity_scoring.py (20 questions x 4 choices = 80
  items, each question + choice) as lm-eval sends it with ``batch_size=8``: POSTs of 8 id lists with
  ``echo``, ``logprobs: 1`` and ``max_tokens: 0`` (scoring alone) or ``1`` (lm-eval's own body, which
  also generates a token per item): items/s;
* ``classify-task``: the same task through /v1/classify, one request per question with its 4 choices as
  labels (``label_prefix: " "``): items/s (a question's 4 items share its prompt's forward).

    PYTHONPATH=. python benchmarks/bench_scoring.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model
from slotinfer.serve import build_app
from slotinfer.serve.background import serving

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def texts_of(model, n: int, tokens: int) -> list[str]:
    """``n`` distinct texts of exactly ``tokens`` tokens each (BOS included, if the tokenizer adds one)."""
    words = "good bad food day nice movie slow quick bright dark river stone cloud paper music light".split()
    out = []
    for i in range(n):
        text, k = "", i
        while len(model.encode_prompt(text or "a")) < tokens:
            text += (" " if text else "") + words[k % len(words)]
            k = k * 7 + 3
        while len(model.encode_prompt(text)) > tokens:
            text = text[:-1]
        out.append(text)
    return out


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    import httpx

    from test_parity_scoring import MC, items  # the local task

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = slotinfer.load(args.model or default_model.path())
    texts = texts_of(model, args.inputs, args.tokens)
    pairs = items(model.tokenizer)
    prompts = [c + d for c, d in pairs]
    with slotinfer.Inferencer(model, slots=8, max_len=512, max_queue=64) as inf, \
            serving(build_app(inf, served_model_name="m")) as url, httpx.Client(base_url=url, timeout=600) as http:
        def post(path, body):
            r = http.post(path, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        embed = lambda: post("/v1/embeddings", {"input": texts})  # noqa: E731
        classify = lambda: post("/v1/classify", {"input": texts, "labels": ["yes", "no"], "label_prefix": " "})  # noqa: E731

        def echo(max_tokens):
            for i in range(0, len(prompts), 8):
                post("/v1/completions", {"prompt": prompts[i:i + 8], "echo": True, "logprobs": 1,
                                         "max_tokens": max_tokens, "temperature": 0})

        def classify_task():
            for q, choices, _ in MC:
                post("/v1/classify", {"input": [f"Question: {q}\nAnswer:"], "labels": choices, "label_prefix": " "})

        for f in (embed, classify, lambda: echo(0), classify_task):  # warm: compile, caches
            f()
        t = {k: [] for k in ("embeddings", "classify", "echo0", "echo1", "classify-task")}
        for _ in range(args.repeats):
            t["embeddings"].append(best(embed, 1))
            t["classify"].append(best(classify, 1))
            t["echo0"].append(best(lambda: echo(0), 1))
            t["echo1"].append(best(lambda: echo(1), 1))
            t["classify-task"].append(best(classify_task, 1))
    t = {k: min(v) for k, v in t.items()}
    n = len(texts)
    print(f"model {model.path.name}, {n} inputs of {args.tokens} tokens, task of {len(prompts)} items "
          f"({sum(map(len, prompts))} tokens); best of {args.repeats}")
    e, c = n / t["embeddings"], n / t["classify"]
    print(f"embeddings     {e:8.1f} sequences/s")
    print(f"classify       {c:8.1f} sequences/s   embeddings / classify = {e / c:.2f}x")
    ct = len(prompts) / t["classify-task"]
    for k, what in (("echo0", "echo, max_tokens 0"), ("echo1", "echo, max_tokens 1 (lm-eval)")):
        r = len(prompts) / t[k]
        print(f"{what:28s} {r:8.1f} items/s   / classify = {r / ct:.2f}x")
    print(f"{'classify (4 labels each)':28s} {ct:8.1f} items/s")


if __name__ == "__main__":
    main()
