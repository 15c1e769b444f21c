"""``slotinfer demo``: the main job on an embedded default model.

Builds (once, cached) a small random-weight model with :mod:`slotinfer.testing` —
no hub is needed — then generates for a handful of prompts through the Inferencer
and classifies a handful of sentences, printing results and tokens/s.  The text is
gibberish (the weights are random); the machinery, the speed and the API are real.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import slotinfer

CACHE = Path(os.environ.get("SLOTINFER_CACHE", Path.home() / ".cache" / "slotinfer"))
DEMO_DIMS = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64)
PROMPTS = [
    "Write a haiku about the sea.",
    "Explain continuous batching in one sentence.",
    "What is the capital of France?",
    "List three prime numbers.",
    "Translate 'good morning' into German.",
    "Tell me a joke about computers.",
]
SENTENCES = ["The striker scored twice in the final.", "Parliament passed the budget bill.",
             "The new GPU doubles training throughput.", "Mix flour, eggs and milk into a batter."]
LABELS = ["sport", "politics", "technology", "cooking"]


def demo_model_path() -> Path:
    path = CACHE / "demo-qwen3"
    if not (path / "config.json").exists():
        from .testing import make_tiny_model
        print(f"building the demo model once in {path} ...")
        make_tiny_model("qwen3", path, overrides=DEMO_DIMS)
    return path


def run(model_path=None) -> int:
    info = slotinfer.BLAS
    print(f"BLAS: {info.name}{' (optimized)' if info.optimized else ' (reference: slow; see slotinfer info)'}")
    model = slotinfer.load(model_path or demo_model_path())
    print(model)
    chats = [model.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]

    with slotinfer.Inferencer(model, slots=8, max_len=256) as inf:
        t0 = time.perf_counter()
        handles = [inf.submit(c, max_tokens=32, temperature=0.8, seed=i) for i, c in enumerate(chats)]
        results = [h.result() for h in handles]
        wall = time.perf_counter() - t0
        stats = inf.stats()
    for prompt, r in zip(PROMPTS, results):
        print(f"\n> {prompt}\n  [{r.finish_reason}, {len(r.tokens)} tokens] {r.text[:120]!r}")
    n = sum(len(r.tokens) for r in results)
    print(f"\ngenerated {n} tokens for {len(PROMPTS)} prompts in {wall:.2f} s: {n / wall:.1f} tokens/s "
          f"(mean slot occupancy {stats['mean_occupancy']:.1f})")

    if hasattr(model, "classify"):
        t0 = time.perf_counter()
        labelled = model.classify(SENTENCES, labels=LABELS, prefix="Classify the domain of the sentence: ")
        dt = time.perf_counter() - t0
        print()
        for s, r in zip(SENTENCES, labelled):
            print(f"  {r.label:>10}  {s}")
        print(f"classified {len(SENTENCES)} sentences in {dt:.2f} s ({len(SENTENCES) / dt:.1f} sentences/s)")
    return 0
