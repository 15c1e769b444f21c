"""Prefill on the CPU policy: the softmax's elementwise work, how a prefill's attention sums, and
prefill calls evaluated layer by layer.

Three comparisons, each with its variants alternated in one process (this machine's noise allows
nothing else), medians printed with their ratio:

* ``--graphs``: the own exp's two polynomial forms (``fastmath.exp(x, estrin=...)``) inside the
  graphs that use it, compiled: a softmax over a prefill's scores and over a decode step's, and
  the MLP activation ``silu(g) * u``; ``mx.exp``'s softmax beside them.
* the prefill forward of the model (default: the demo model, ``slotinfer demo`` builds it) for
  prompts of ``--shapes`` (rows x tokens): attention in tiles of queries whose row sums come with
  the value products (``models/tiled_attention.py``, the default from a key span of 128) against
  the whole softmax everywhere.
* ``--by-layer``: whole prefills through the engine (``max_tokens=1``), each call evaluated layer
  by layer (the CPU policy from 256 tokens on, ``device.prefill_by_layer``) against one lazy
  graph: median seconds and peak memory over the weights and K/V table.  ``--first on|off`` runs
  one prefill only, the first of a fresh process, which faults its working memory in.

    python benchmarks/bench_prefill.py
    python benchmarks/bench_prefill.py --by-layer --shapes 32x32 --model ~/.cache/slotinfer/bench/qwen3-0.6b-shape
    python benchmarks/bench_prefill.py --graphs
    python benchmarks/bench_prefill.py --model ~/.cache/slotinfer/demo-qwen3 --shapes 1x512,16x32
"""

import argparse
import random
import statistics
import time

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx
from slotinfer.cli.demo import demo_model_path
from slotinfer.device import prefill_by_layer
from slotinfer.engine.engine import Engine
from slotinfer.cpu import fastmath
from slotinfer.models import transformer as T
from slotinfer.kv.slot_table import PrefillView


def alternate(variants: dict, rounds: int) -> dict:
    """Median seconds of each zero-argument callable, run in turns (order flipped every round)."""
    names = list(variants)
    times = {k: [] for k in names}
    for r in range(rounds + 2):
        for k in names if r % 2 else names[::-1]:
            t = time.perf_counter()
            mx.eval(variants[k]())
            if r >= 2:  # two warm-up rounds: compilation, first-touch pages
                times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def graphs(rounds: int):
    def softmax(estrin):
        def f(x):
            e = fastmath.exp(x - mx.max(x, axis=-1, keepdims=True), estrin=estrin)
            return e / mx.sum(e, axis=-1, keepdims=True)
        return mx.compile(f)

    def act(estrin):
        return mx.compile(lambda g, u: g / (1.0 + fastmath.exp(-g, estrin=estrin)) * u)

    mx_softmax = mx.compile(lambda x: mx.softmax(x, axis=-1, precise=True))
    cases = [("softmax, prefill 8 x 512 x 512", [(1, 4, 2, 512, 512)], softmax, mx_softmax),
             ("softmax, 16 x 8 x 32 x 32", [(16, 4, 2, 32, 32)], softmax, mx_softmax),
             ("softmax, decode 16 x 8 x 1024", [(16, 4, 2, 1, 1024)], softmax, mx_softmax),
             ("silu(g) * u, 16 x 32 x 1536", [(16, 32, 1536)] * 2, act, None)]
    print(f"{'graph':<34} {'Horner ms':>10} {'Estrin ms':>10} {'mx.exp ms':>10}")
    for name, shapes, make, reference in cases:
        args = [mx.random.normal(s) * 4 for s in shapes]
        mx.eval(args)
        fns = {"horner": make(False), "estrin": make(True)}
        if reference is not None:
            fns["mx"] = reference
        t = alternate({k: (lambda f=f: f(*args)) for k, f in fns.items()}, rounds)
        ref = f"{t['mx'] * 1e3:10.2f}" if "mx" in t else f"{'-':>10}"
        print(f"{name:<34} {t['horner'] * 1e3:10.2f} {t['estrin'] * 1e3:10.2f} {ref}")


def prefill(model_path, shapes, rounds: int):
    model = slotinfer.load(model_path)
    width = max(L for _, L in shapes)
    engine = Engine(model, slots=max(n for n, _ in shapes), max_len=width + 1)
    for s in range(engine.slots):
        engine.table.admit(s, width)  # each slot's blocks, as admission reserves them
    rng = random.Random(0)
    vocab = model.tokenizer.vocab_size
    by_product = T._SUM_BY_PRODUCT
    print(f"model: {model}")
    print(f"{'prompts':>10} {'tiled ms':>19} {'softmax ms':>11} {'ratio':>7} {'prompt tok/s':>13}")
    for n, L in shapes:
        tokens = mx.array([[rng.randrange(3, vocab) for _ in range(L)] for _ in range(n)])

        def forward(threshold):
            def run():
                T._SUM_BY_PRODUCT = threshold
                view = PrefillView(engine.table, list(range(n)), [0] * n, [L] * n, L, L, True)
                return model.net(tokens, view)
            return run

        t = alternate({"product": forward(by_product), "softmax": forward(1 << 30)}, rounds)
        T._SUM_BY_PRODUCT = by_product
        print(f"{n:>4} x {L:<4} {t['product'] * 1e3:19.1f} {t['softmax'] * 1e3:11.1f} "
              f"{t['softmax'] / t['product']:7.3f} {n * L / t['product']:13.0f}")


def by_layer(model_path, shapes, rounds: int, first: str | None):
    """Engine prefills with each call evaluated layer by layer (the policy's threshold) or not (0)."""
    model = slotinfer.load(model_path)
    vocab = model.tokenizer.vocab_size
    policy = prefill_by_layer() or 1
    print(f"model: {model}; layer by layer from {policy} tokens")

    def run(n, L, threshold, seed):
        engine = Engine(model, slots=n, max_len=L + 16, prefill_tokens=n * L)
        engine.encoder.by_layer = threshold
        rng = random.Random(seed)
        for _ in range(n):
            engine.add(engine.make_item([rng.randrange(3, vocab) for _ in range(L)], max_tokens=1,
                                        ignore_eos=True))
        mx.eval(engine.table.keys, engine.table.values)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        engine.run_until_done()
        return time.perf_counter() - t, (mx.get_peak_memory() - base) / 1e6

    if first is not None:
        n, L = shapes[0]
        s, peak = run(n, L, policy if first == "on" else 0, 0)
        print(f"{n} x {L}, layer by layer {first}, first prefill of this process: {s:.2f} s, peak +{peak:.0f} MB")
        return
    print(f"{'prompts':>10} {'by layer s':>11} {'peak MB':>8} {'one graph s':>12} {'peak MB':>8} {'ratio':>6}")
    for n, L in shapes:
        got = {"on": [], "off": []}
        for r in range(rounds + 1):
            for k in ("on", "off") if r % 2 else ("off", "on"):
                s, peak = run(n, L, policy if k == "on" else 0, r)
                if r:  # round 0 warms up: first-touch pages
                    got[k].append((s, peak))
        on, off = (statistics.median(s for s, _ in got[k]) for k in ("on", "off"))
        print(f"{n:>4} x {L:<4} {on:11.3f} {max(p for _, p in got['on']):8.0f} {off:12.3f} "
              f"{max(p for _, p in got['off']):8.0f} {off / on:6.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphs", action="store_true", help="the exp's polynomial forms in their graphs")
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--shapes", default="1x512,1x264,2x200,16x32", help="prompts as ROWSxTOKENS,...")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--by-layer", action="store_true", help="prefill calls evaluated layer by layer or not")
    ap.add_argument("--first", choices=("on", "off"), help="with --by-layer: one prefill, a fresh process's first")
    args = ap.parse_args()
    if args.graphs:
        graphs(args.rounds)
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.by_layer:
        by_layer(args.model or demo_model_path(), shapes, args.rounds, args.first)
        return
    prefill(args.model or demo_model_path(), shapes, args.rounds)


if __name__ == "__main__":
    main()
