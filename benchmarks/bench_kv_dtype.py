"""K/V kept in float16 against float32 on CPU: decode speed and greedy agreement, side by side.

Speed: 32 requests at once on 32 slots (prompts of ``--prompt-tokens`` random tokens, 128
generated each), decode tokens/s, the two dtypes alternated, median of ``--repeats``.
Agreement: 16 chat prompts, 64 greedy tokens each, on 16 slots: how many come out identical
to float32 K/V, and where the first differs.

    python benchmarks/bench_kv_dtype.py                       # SmolLM2-135M-Instruct
    python benchmarks/bench_kv_dtype.py --model PATH --prompt-tokens 1024
"""

from __future__ import annotations

import argparse
import statistics

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model
from slotinfer.cli.bench import engine_tokens_per_s

PROMPTS = ["The capital of France is", "Write a Python function that reverses a string.",
           "Once upon a time, in a small village,", "What are the three laws of thermodynamics?",
           "Translate to French: The cat sleeps on the sofa.", "List five fruits and their colours.",
           "At what temperature does water boil?", "Summarize the history of the Roman Empire.",
           "Explain what a hash table is.", "Give me a recipe for pancakes.", "Why is the sky blue?",
           "Write a haiku about autumn.", "What is 17 times 23?", "Name the planets of the solar system.",
           "How do vaccines work?", "Describe the water cycle."]


def agreement(model, dtype) -> list[list[int]]:
    with slotinfer.Inferencer(model, slots=16, max_len=512, kv_dtype=dtype, prefix_cache_bytes=0) as inf:
        hs = [inf.submit(messages=[{"role": "user", "content": p}], max_tokens=64, ignore_eos=True) for p in PROMPTS]
        return [h.result().tokens for h in hs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = slotinfer.load(args.model or default_model.path())
    print(f"model: {model}\nBLAS: {slotinfer.BLAS.name} {slotinfer.BLAS.version}")
    speed = {"float32": [], "float16": []}
    for r in range(args.repeats):
        for dt in (["float32", "float16"] if r % 2 == 0 else ["float16", "float32"]):
            run = engine_tokens_per_s(model, 32, args.prompt_tokens, 128, kv_dtype=dt)
            speed[dt].append(run["decode_tokens_per_s"])
    f32, f16 = (statistics.median(speed[d]) for d in ("float32", "float16"))
    print(f"32 rows, {args.prompt_tokens}-token prompts, 128 generated: decode tokens/s float32 K/V {f32:.1f}, "
          f"float16 K/V {f16:.1f} ({f16 / f32:.2f}x), median of {args.repeats}")
    ref, half = agreement(model, "float32"), agreement(model, "float16")
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ref, half)]
    same = sum(f is None for f in firsts)
    print(f"greedy agreement over {len(PROMPTS)} prompts x 64 tokens: {same} identical; first difference at "
          f"{[f for f in firsts if f is not None] or 'none'}")


if __name__ == "__main__":
    main()
