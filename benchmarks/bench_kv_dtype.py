"""K/V kept in float16 or q8_0 against float32 on CPU: bytes, decode speed and greedy agreement, side by side.

Bytes: a token's K/V in every layer, as the pool counts them.
Speed: ``--rows`` requests at once (prompts of ``--prompt-tokens`` random tokens, ``--new`` generated
each), decode tokens/s; then ``--long-rows`` requests of ``--long-tokens``-token prompts (decode over
long contexts, where reading K/V dominates a step); each dtype alternated with float32, median of
``--repeats``.
Agreement: the 12 conformance prompts of the real-model tests (tests/cpu/test_qkernel.py: 10 texts
and 2 chats, 32 greedy tokens each) and 16 chat prompts of 64 greedy tokens, on 16 slots: how many
come out identical to float32 K/V, and where the first difference falls.

    python benchmarks/bench_kv_dtype.py                                  # q8_0, SmolLM2-135M-Instruct
    python benchmarks/bench_kv_dtype.py --kv-dtype float16,q8_0 --repeats 5
    python benchmarks/bench_kv_dtype.py --model PATH --long-tokens 0     # skip the long contexts
"""

from __future__ import annotations

import argparse
import os
import statistics

import slotinfer  # first: installs the BLAS before mlx.core
from slotinfer import default_model
from slotinfer.cli.bench import engine_tokens_per_s

CHATS = ["The capital of France is", "Write a Python function that reverses a string.",
         "Once upon a time, in a small village,", "What are the three laws of thermodynamics?",
         "Translate to French: The cat sleeps on the sofa.", "List five fruits and their colours.",
         "At what temperature does water boil?", "Summarize the history of the Roman Empire.",
         "Explain what a hash table is.", "Give me a recipe for pancakes.", "Why is the sky blue?",
         "Write a haiku about autumn.", "What is 17 times 23?", "Name the planets of the solar system.",
         "How do vaccines work?", "Describe the water cycle."]
# the real-model conformance prompts (tests/cpu/test_qkernel.py), 32 new tokens each
CONFORMANCE = ["The capital of France is", "In 2024, there were 12345 cats and 3 dogs in the",
               "def fibonacci(n):", "The three primary colors are", "Water boils at",
               "Once upon a time, in a small village,", "The largest planet in our solar system is",
               "To make a cup of tea, first", "1, 2, 3, 4, 5,", "Photosynthesis is the process by which"]
CONFORMANCE_CHATS = ["What is the capital of France?", "Name a fruit."]


def token_bytes(model, dtype) -> int:
    with slotinfer.Inferencer(model, slots=1, max_len=128, kv_dtype=dtype, start=False) as inf:
        return inf.engine.table.stats()["token_bytes"]


def agreement(model, dtype) -> list[list[int]]:
    chat = lambda p: model.apply_chat_template([{"role": "user", "content": p}])  # noqa: E731
    prompts = ([(p, 32) for p in CONFORMANCE] + [(chat(p), 32) for p in CONFORMANCE_CHATS]
               + [(chat(p), 64) for p in CHATS])
    with slotinfer.Inferencer(model, slots=16, max_len=512, kv_dtype=dtype, prefix_cache_bytes=0) as inf:
        hs = [inf.submit(p, max_tokens=n, ignore_eos=True) for p, n in prompts]
        return [h.result().tokens for h in hs]


def side_by_side(model, dtypes, repeats, rows, prompt, new) -> dict:
    speed = {d: [] for d in dtypes}
    for r in range(repeats):
        for dt in (dtypes if r % 2 == 0 else dtypes[::-1]):
            run = engine_tokens_per_s(model, rows, prompt, new, kv_dtype=dt, prefix_cache_bytes=0)
            speed[dt].append(run["decode_tokens_per_s"])
    return {d: statistics.median(v) for d, v in speed.items()}


def load() -> str:
    return "load average " + " / ".join(f"{x:.1f}" for x in os.getloadavg())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--kv-dtype", default="q8_0", help="the K/V dtypes set against float32, comma-separated "
                                                       "(float16, bfloat16, q8_0)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--long-rows", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=2048, help="0: skip the long contexts")
    ap.add_argument("--long-new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-agreement", action="store_true")
    args = ap.parse_args()
    model = slotinfer.load(args.model or default_model.path())
    others = [d for d in args.kv_dtype.split(",") if d and d != "float32"]
    dtypes = ["float32", *others]
    print(f"model: {model}\nBLAS: {slotinfer.BLAS.name} {slotinfer.BLAS.version}\n{load()}", flush=True)
    f32 = token_bytes(model, "float32")
    for d in others:
        b = token_bytes(model, d)
        print(f"K/V bytes a token, every layer: float32 {f32}, {d} {b} ({b / f32:.3f}x)", flush=True)
    runs = [(args.rows, args.prompt_tokens, args.new)]
    if args.long_tokens:
        runs.append((args.long_rows, args.long_tokens, args.long_new))
    for rows, prompt, new in runs:
        got = side_by_side(model, dtypes, args.repeats, rows, prompt, new)
        line = ", ".join(f"{d} K/V {got[d]:.1f} ({got[d] / got['float32']:.2f}x)" for d in others)
        print(f"{rows} rows, {prompt}-token prompts, {new} generated: decode tokens/s float32 K/V "
              f"{got['float32']:.1f}, {line}, median of {args.repeats}, alternated; {load()}", flush=True)
    if args.no_agreement:
        return
    ref = agreement(model, "float32")
    for d in others:
        got = agreement(model, d)
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ref, got)]
        conf, chats = firsts[:12], firsts[12:]
        print(f"greedy agreement with float32 K/V, {d}: conformance prompts {sum(f is None for f in conf)}/12 "
              f"identical (32 tokens; first differences at {[f for f in conf if f is not None] or 'none'}); "
              f"chat prompts {sum(f is None for f in chats)}/16 (64 tokens; first differences at "
              f"{[f for f in chats if f is not None] or 'none'})", flush=True)


if __name__ == "__main__":
    main()
