"""``slotinfer bench``: throughput of the slot engine on SmolLM2-135M-Instruct (the default
model, :mod:`slotinfer.default_model`), or with ``--random-shape`` on a Qwen3-0.6B-shaped model.

Workload (mirrors the peers' figures in DESIGN.md): prompts of 32 tokens, exactly 64
generated tokens each (``ignore_eos``), at 1, 8 and 32 slots.  The Qwen3-0.6B shape has
random weights, so it is built locally once and cached; its shape, not its words, sets the
speed.  Without the default model installed, bench runs that shape and says so.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import slotinfer

from . import default_model, settings
from .engine import Engine

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936)
CACHE = settings.cache_dir()


def slot_counts(text: str) -> list[int]:
    """argparse ``type`` of ``--slots``: comma-separated ints >= 1."""
    try:
        counts = [int(s) for s in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1 like 1,8,32, got {text!r}")
    return counts


def add_arguments(p):
    from .cli import positive_int

    p.add_argument("--model", help="model folder, GGUF file or hub id (org/name) (default: SmolLM2-135M-Instruct "
                                   "when installed, else the random Qwen3-0.6B shape)")
    p.add_argument("--random-shape", action="store_true",
                   help="a random-weight Qwen3-0.6B-shaped checkpoint (built once) instead of the default model")
    p.add_argument("--slots", type=slot_counts, default="1,8,32", help="comma-separated slot counts")
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument("--gen-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per point; the median is printed")
    p.add_argument("--dtype", help="compute dtype override (default: the device policy)")
    p.add_argument("--max-len-sweep", action="store_true", help="decode step time vs max_len 512..8192")
    p.add_argument("--mixed", action="store_true", help="continuous vs static batching on mixed lengths")
    p.add_argument("--mixed-slots", type=positive_int, default=16, help="slots (and static batch size) for --mixed")
    p.add_argument("--mixed-requests", type=positive_int, default=128, help="requests for --mixed")
    p.add_argument("--mixed-rounds", type=positive_int, default=2,
                   help="runs of each mode for --mixed, alternating continuous/static then static/continuous")
    p.add_argument("--serve", action="store_true", help="concurrent streaming clients through the HTTP server "
                                                        "against the in-process Inferencer (docs/serve.md)")
    from .serve.bench import add_arguments as add_serve_arguments
    add_serve_arguments(p)


def bench_model_path() -> Path:
    path = CACHE / "bench" / "qwen3-0.6b-shape"
    if not (path / "config.json").exists():
        from .testing import make_tiny_model
        print(f"building a random Qwen3-0.6B-shaped checkpoint (bf16, as published) in {path} ...", flush=True)
        make_tiny_model("qwen3", path, overrides=QWEN3_06B, dtype="bfloat16")
    return path


def prompts_of(model, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = model.tokenizer.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def engine_tokens_per_s(model, slots: int, prompt_tokens: int, gen_tokens: int, *, max_len=None) -> dict:
    """Run ``slots`` requests to completion on an Inferencer; aggregate and decode-only tokens/s."""
    prompts = prompts_of(model, slots, prompt_tokens, seed=slots)
    with slotinfer.Inferencer(model, slots=slots, max_len=max_len or prompt_tokens + gen_tokens + 8,
                              prefill_tokens=max(512, prompt_tokens * slots)) as inf:
        inf.generate(prompts[0], max_tokens=4, ignore_eos=True)  # compile the step outside the timing
        t0 = time.perf_counter()
        handles = [inf.submit(p, max_tokens=gen_tokens, ignore_eos=True) for p in prompts]
        results = [h.result() for h in handles]
        wall = time.perf_counter() - t0
    n = sum(len(r.tokens) for r in results)
    first = max(r.metrics["time_to_first_token_s"] for r in results)
    return {"tokens_per_s": n / wall, "decode_tokens_per_s": (n - slots) / max(wall - first, 1e-9), "wall_s": wall}


def step_time_vs_max_len(model, slots=8, live=128, lens=(512, 2048, 8192)) -> dict:
    """Median decode step time at fixed live lengths, for growing cache capacity."""
    out = {}
    for max_len in lens:
        prompts = prompts_of(model, slots, live)
        eng = Engine(model, slots=slots, max_len=max_len, prefill_tokens=live * slots)
        for p in prompts:
            eng.add(eng.make_item(p, max_tokens=40, ignore_eos=True))
        times = []
        while eng.busy:
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        out[max_len] = statistics.median(times[5:-2]) * 1e3
    return out


def mixed_workload(model, slots=16, n=128, seed=0, rounds=2):
    """Prompt and output lengths drawn from 16..512: continuous admission vs static batches.

    Returns tokens/s of each mode and their ratio, each mode's decode steps and mean live
    rows per step, and each mode's wall time.  Each mode runs ``rounds`` times in
    :func:`alternating_order`; its wall time is the mean of its runs.  What bounds the
    ratio (the schedules' step counts, the prefill both modes share) is worked out by
    ``benchmarks/bench_mixed_bound.py``.
    """
    reqs, prompts = mixed_requests(model, n, seed)
    gens = [g for _, g in reqs]
    total = sum(gens)
    res = {}
    runs = {"continuous": [], "static": []}
    for mode in alternating_order(rounds):
        with mixed_inferencer(model, slots) as inf:
            t0 = time.perf_counter()
            if mode == "continuous":
                hs = [inf.submit(p, max_tokens=g, ignore_eos=True) for p, g in zip(prompts, gens)]
                [h.result() for h in hs]
            else:
                for i in range(0, n, slots):
                    hs = [inf.submit(p, max_tokens=g, ignore_eos=True)
                          for p, g in zip(prompts[i:i + slots], gens[i:i + slots])]
                    [h.result() for h in hs]
            runs[mode].append(time.perf_counter() - t0)
            st = inf.stats()
            res[f"{mode}_steps"], res[f"{mode}_rows"] = st["steps"], st["mean_occupancy"]
    for mode, walls in runs.items():
        res[f"{mode}_runs"] = walls
        res[f"{mode}_s"] = statistics.mean(walls)
        res[mode] = total / res[f"{mode}_s"]
    res["ratio"] = res["continuous"] / res["static"]
    return res


def alternating_order(rounds: int) -> list[str]:
    """The modes' run order: continuous, static, then static, continuous, and so on.  Over an
    even number of rounds both modes sit at the same mean position, so a machine that speeds
    up or slows down steadily during the runs moves both means alike (a mode run last alone
    read 1.37x and 1.71x on the same 512 requests, one order then the other)."""
    pair = ("continuous", "static")
    return [m for r in range(rounds) for m in (pair if r % 2 == 0 else pair[::-1])]


MIXED_MAX_LEN = 1100  # a prompt and its output, each up to 512 tokens, fit with room


def mixed_requests(model, n: int, seed: int = 0) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """The mixed workload: ``n`` (prompt tokens, output tokens) pairs, each uniform in 16..512,
    and random prompts of those lengths."""
    rng = random.Random(seed)
    reqs = [(rng.randint(16, 512), rng.randint(16, 512)) for _ in range(n)]
    vocab = model.tokenizer.vocab_size
    return reqs, [[rng.randrange(3, vocab) for _ in range(p)] for p, _ in reqs]


def mixed_inferencer(model, slots: int):
    """The engine every part of the mixed workload runs on: the prefill alone and each mode."""
    return slotinfer.Inferencer(model, slots=slots, max_len=MIXED_MAX_LEN, prefill_tokens=512)


def prefill_alone_s(model, slots: int, prompts) -> float:
    """Wall time of the prompts' prefill alone: every request with ``max_tokens=1`` on a fresh
    :func:`mixed_inferencer`."""
    with mixed_inferencer(model, slots) as inf:
        t0 = time.perf_counter()
        [h.result() for h in [inf.submit(p, max_tokens=1, ignore_eos=True) for p in prompts]]
        return time.perf_counter() - t0


def bench_model(args):
    """``--model``, ``--random-shape``, else the default model when it loads here, else the shape."""
    if args.model or args.random_shape:
        return slotinfer.load(args.model or bench_model_path(), dtype=args.dtype)
    model, why = default_model.load(dtype=args.dtype)
    if model is None:
        print(f"{why}: benchmarking the random Qwen3-0.6B shape instead", flush=True)
        model = slotinfer.load(bench_model_path(), dtype=args.dtype)
    return model


def run(args) -> int:
    if args.serve:
        from .serve.bench import run as run_serve
        return run_serve(args)
    model = bench_model(args)
    print(f"model: {model}\nBLAS: {slotinfer.BLAS.name}  compute dtype: {model.dtype}")
    if args.max_len_sweep:
        for max_len, ms in step_time_vs_max_len(model).items():
            print(f"max_len {max_len:>5}: decode step {ms:7.1f} ms (8 slots, ~128 live tokens)")
        return 0
    if args.mixed:
        r = mixed_workload(model, slots=args.mixed_slots, n=args.mixed_requests, rounds=args.mixed_rounds)
        print(f"mixed lengths, {args.mixed_requests} requests, {args.mixed_slots} slots: "
              f"continuous {r['continuous']:.1f} tok/s, static {r['static']:.1f} tok/s, "
              f"ratio {r['ratio']:.2f}x")
        print("  wall s in run order: " + ", ".join(
            f"{m} {r[m + '_runs'][i // 2]:.1f}" for i, m in enumerate(alternating_order(args.mixed_rounds))))
        for mode in ("continuous", "static"):
            print(f"  {mode:>10}: {r[mode + '_steps']} decode steps, {r[mode + '_rows']:.1f} live rows per step")
        return 0
    print(f"prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated each; median of {args.repeats}")
    print(f"{'slots':>5} {'tokens/s':>10} {'decode tokens/s':>16}")
    for slots in args.slots:
        runs = [engine_tokens_per_s(model, slots, args.prompt_tokens, args.gen_tokens) for _ in range(args.repeats)]
        agg = statistics.median(r["tokens_per_s"] for r in runs)
        dec = statistics.median(r["decode_tokens_per_s"] for r in runs)
        print(f"{slots:>5} {agg:>10.1f} {dec:>16.1f}", flush=True)
    return 0
