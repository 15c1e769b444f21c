"""``slotinfer bench``: throughput of the slot engine on SmolLM2-135M-Instruct (the default
model, :mod:`slotinfer.default_model`), or with ``--random-shape`` on a Qwen3-0.6B-shaped model.

Workload (mirrors the peers' figures in DESIGN.md): prompts of 32 tokens, exactly 64
generated tokens each (``ignore_eos``), at 1, 8 and 32 slots.  The Qwen3-0.6B shape has
random weights, so it is built locally once and cached; its shape, not its words, sets the
speed.  Without the default model installed, bench runs that shape and says so.

Why one module: each workload (engine, max-len sweep, mixed arrivals, soak) is a few dozen lines
sharing the model building and the output format.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import statistics
import sys
import time
from pathlib import Path

import slotinfer

from .. import default_model
from ..engine.engine import Engine
from .bench_common import CACHE, alternating_order, bench_model_path


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
    from .common import positive_int

    p.add_argument("--model", help="model folder, GGUF file or hub id (org/name) (default: SmolLM2-135M-Instruct "
                                   "when installed, else the random Qwen3-0.6B shape)")
    p.add_argument("--random-shape", action="store_true",
                   help="a random-weight Qwen3-0.6B-shaped checkpoint (built once) instead of the default model")
    p.add_argument("--slots", type=slot_counts, default="1,8,32", help="comma-separated slot counts")
    p.add_argument("--prompt-tokens", type=positive_int, default=32)
    p.add_argument("--gen-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per point; the median is printed")
    p.add_argument("--dtype", help="compute dtype override (default: the device policy)")
    from .common import add_speculative_flags
    add_speculative_flags(p)
    p.add_argument("--max-len-sweep", action="store_true", help="decode step time vs max_len 512..8192")
    p.add_argument("--mixed", action="store_true", help="continuous vs static batching on mixed lengths")
    p.add_argument("--mixed-slots", type=positive_int, default=16, help="slots (and static batch size) for --mixed")
    p.add_argument("--mixed-requests", type=positive_int, default=128, help="requests for --mixed")
    p.add_argument("--mixed-rounds", type=positive_int, default=2,
                   help="runs of each mode for --mixed, alternating continuous/static then static/continuous")
    p.add_argument("--soak", type=positive_int, nargs="?", const=SOAK_REQUESTS, metavar="N",
                   help=f"N mixed requests (valid, invalid, cancelled, raising callbacks, any top_logprobs; "
                        f"default {SOAK_REQUESTS}) through one Inferencer on a tiny random model, printing "
                        f"RSS and the compiled step variants every N/10 requests")
    p.add_argument("--serve", action="store_true", help="concurrent streaming clients through the HTTP server "
                                                        "against the in-process Inferencer (docs/serve.md)")
    from .bench_serve import add_arguments as add_serve_arguments
    add_serve_arguments(p)


def prompts_of(model, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = model.tokenizer.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def step_until_idle(engine) -> list[tuple[float, float]]:
    """Step ``engine`` (a :class:`slotinfer.engine.engine.Engine`) until it is idle: each step's wall and
    process CPU seconds."""
    times = []
    while engine.busy:
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        times.append((time.perf_counter() - t, time.process_time() - c))
    return times


def engine_tokens_per_s(model, slots: int, prompt_tokens: int, gen_tokens: int, *, max_len=None, **engine) -> dict:
    """Run ``slots`` requests to completion on an Inferencer (``engine``: more of its arguments);
    aggregate and decode-only tokens/s."""
    prompts = prompts_of(model, slots, prompt_tokens, seed=slots)
    with slotinfer.Inferencer(model, slots=slots, max_len=max_len or prompt_tokens + gen_tokens + 8,
                              prefill_tokens=max(512, prompt_tokens * slots), **engine) as inf:
        warm = prompts_of(model, 1, prompt_tokens, seed=-slots)[0]  # a prompt of its own: no prefix cache hit later
        inf.generate(warm, max_tokens=4, ignore_eos=True)  # compile the step outside the timing
        t0 = time.perf_counter()
        handles = [inf.submit(p, max_tokens=gen_tokens, ignore_eos=True) for p in prompts]
        results = [h.result() for h in handles]
        wall = time.perf_counter() - t0
        st = inf.stats()
    n = sum(len(r.tokens) for r in results)
    first = max(r.metrics["time_to_first_token_s"] for r in results)
    return {"tokens_per_s": n / wall, "decode_tokens_per_s": (n - slots) / max(wall - first, 1e-9), "wall_s": wall,
            "spec_drafted": st["spec_drafted"], "spec_accepted": st["spec_accepted"]}


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


def bench_model(args):
    """``--model``, ``--random-shape``, else the default model when it loads here, else the shape."""
    if args.model or args.random_shape:
        return slotinfer.load(args.model or bench_model_path(), dtype=args.dtype)
    model, why = default_model.load(dtype=args.dtype)
    if model is None:
        print(f"{why}: benchmarking the random Qwen3-0.6B shape instead", flush=True)
        model = slotinfer.load(bench_model_path(), dtype=args.dtype)
    return model


SOAK_REQUESTS = 100_000
SOAK_RAISED = (ValueError, KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit, MemoryError,
               StopIteration)
SOAK_INVALID = (dict(temperature=-1.0), dict(top_logprobs=-1), dict(unknown_keyword=1), dict(stop=5),
                dict(max_tokens=0), dict(top_p=0.0), dict(on_token="print"))


def rss_mib() -> float:
    """This process's resident memory now (Linux), else its peak, in MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def soak_model_path() -> Path:
    path = CACHE / "bench" / "tiny-qwen3"
    if not (path / "config.json").exists():
        from ..testing import make_tiny_model
        make_tiny_model("qwen3", path)
    return path


def raising_callback(exc_type, after: int):
    """An ``on_token`` callback that raises ``exc_type`` at the ``after``-th token, and at each one after."""
    seen = [0]

    def on_token(ev):
        seen[0] += 1
        if seen[0] >= after:
            raise exc_type("raised by a soak callback")

    return on_token


def soak_request(rng: random.Random, vocab: int) -> tuple[str, list[int], dict]:
    """One request of the soak's mix: (kind, prompt ids, parameters); kind is valid, invalid,
    cancel or raise."""
    kind = rng.choice(("valid", "valid", "invalid", "cancel", "raise"))
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 12))]
    params = dict(max_tokens=rng.randint(1, 8), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.5:
        params.update(temperature=0.8, top_k=rng.choice((0, 5)), top_p=rng.choice((1.0, 0.9)),
                      seed=rng.randrange(2**32))
    if rng.random() < 0.5:
        params["top_logprobs"] = rng.randint(0, vocab)
    elif rng.random() < 0.3:
        params["logprobs"] = True
    if rng.random() < 0.2:
        params["stop"] = ["ab"]
    if rng.random() < 0.1:
        params["repetition_penalty"] = 1.1
    if kind == "invalid":
        params.update(rng.choice(SOAK_INVALID))
    elif kind == "raise":
        params["on_token"] = raising_callback(rng.choice(SOAK_RAISED), rng.randint(1, 3))
    return kind, prompt, params


def soak(model, n: int, *, slots: int = 4, window: int = 32, seed: int = 0, out=print) -> list[tuple[int, float, int]]:
    """Run ``n`` :func:`soak_request` s through one Inferencer, at most ``window`` in flight;
    print and return (requests, RSS MiB, compiled step variants) every ``n // 10`` requests.

    Every accepted request must end exactly once (a result, or EngineError for a raising
    callback); a request that ends otherwise stops the soak with an AssertionError.
    """
    from ..errors import EngineError

    rng = random.Random(seed)
    vocab = model.config.vocab_size
    every = max(1, n // 10)
    counts: collections.Counter = collections.Counter()
    pending: collections.deque = collections.deque()
    rows, cancel_next = [], None

    def settle(kind, h):
        try:
            counts[h.result(timeout=600).finish_reason] += 1
        except EngineError:
            assert kind == "raise", f"a {kind} request failed"
            counts["error"] += 1

    with slotinfer.Inferencer(model, slots=slots, max_len=64, max_queue=window) as inf:
        for i in range(1, n + 1):
            if cancel_next is not None:  # cancelled a request later, wherever it got to
                cancel_next.cancel()
                cancel_next = None
            kind, prompt, params = soak_request(rng, vocab)
            try:
                h = inf.submit(prompt, **params)
            except (ValueError, TypeError):
                assert kind == "invalid", f"a {kind} request was refused"
                counts["invalid"] += 1
            else:
                assert kind != "invalid", f"an invalid request was accepted: {params}"
                if kind == "cancel":
                    if rng.random() < 0.5:
                        h.cancel()
                    else:
                        cancel_next = h
                pending.append((kind, h))
            while len(pending) > window:
                settle(*pending.popleft())
            if i % every == 0 or i == n:
                row = (i, rss_mib(), inf.engine.decoder.variants)
                rows.append(row)
                out(f"{i:>8} requests  RSS {row[1]:8.1f} MiB  compiled step variants {row[2]}", flush=True)
        while pending:
            settle(*pending.popleft())
        stats = inf.stats()
    out("ended: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) +
        f"; submitted {stats['submitted']}, refused {stats['refused']}, finished {stats['finished']}")
    if len(rows) > 2:
        out(f"RSS after warm-up (at {rows[1][0]} requests) to the end: {rows[-1][1] - rows[1][1]:+.1f} MiB")
    return rows


def run(args) -> int:
    if args.soak:
        model = slotinfer.load(args.model or soak_model_path(), dtype=args.dtype)
        print(f"soak: {args.soak} mixed requests through one Inferencer on {model}", flush=True)
        soak(model, args.soak)
        return 0
    if args.serve:
        from .bench_serve import run as run_serve
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
    spec = dict(speculative=args.speculative, draft_tokens=args.draft_tokens) if args.speculative else {}
    print(f"{'slots':>5} {'tokens/s':>10} {'decode tokens/s':>16}" + (f" {'drafted':>8} {'accepted':>8}" if spec else ""))
    for slots in args.slots:
        runs = [engine_tokens_per_s(model, slots, args.prompt_tokens, args.gen_tokens, **spec)
                for _ in range(args.repeats)]
        agg = statistics.median(r["tokens_per_s"] for r in runs)
        dec = statistics.median(r["decode_tokens_per_s"] for r in runs)
        drafts = f" {runs[-1]['spec_drafted']:>8} {runs[-1]['spec_accepted']:>8}" if spec else ""
        print(f"{slots:>5} {agg:>10.1f} {dec:>16.1f}{drafts}", flush=True)
    return 0
