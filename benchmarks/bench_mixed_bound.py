"""What bounds the mixed workload's continuous / static ratio: a cost model, measured and replayed.

``slotinfer bench --mixed`` runs both schedules end to end (minutes).  This script measures the
two quantities that decide them and replays the seeded workload's schedules on them:

- the decode step's time at ``--slots`` slots for attention spans 64 .. 1024 (a step computes
  every slot over the longest live row, so its time depends on the span, not on how many rows
  are live);
- the prompts' prefill alone (every request with ``max_tokens=1``), the same work in both modes.

``schedules.schedule_spans`` gives each schedule's span step by step; summing the step
times at those spans predicts each mode's decode time, and the prefill is added to both.  Then
it prints the ratio the measured costs predict, and what it would be if the prefill were free,
if it ran at ``--peak-gflops`` (the machine's FMA peak: its FLOPs counted from the config), if
every decode step were twice as fast, and if a step's time did not grow with its span.

    python benchmarks/bench_mixed_bound.py --model ~/.cache/slotinfer/demo-qwen3 --peak-gflops 176
    python benchmarks/bench_mixed_bound.py --model ~/.cache/slotinfer/demo-qwen3 --requests 512
"""

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import slotinfer  # first: installs the BLAS before mlx.core loads
import mlx.core as mx
from slotinfer.cli.bench import MIXED_MAX_LEN as MAX_LEN
from slotinfer.cli.bench import mixed_inferencer, mixed_requests
from slotinfer.kv import KV_BLOCK_SIZE as SPAN_BUCKET  # a decode step's span is rounded up to whole blocks
from slotinfer.cli.demo import demo_model_path
from slotinfer.engine.engine import Engine

from schedules import diluted_ratio, schedule_spans, schedule_steps  # benchmarks/, beside this script


def prefill_alone_s(model, slots: int, prompts) -> float:
    """Wall time of the prompts' prefill alone: every request with ``max_tokens=1`` on a fresh
    :func:`~slotinfer.cli.bench.mixed_inferencer`."""
    with mixed_inferencer(model, slots) as inf:
        t0 = time.perf_counter()
        [h.result() for h in [inf.submit(p, max_tokens=1, ignore_eos=True) for p in prompts]]
        return time.perf_counter() - t0


def step_times(model, slots: int, spans, rounds: int, steps: int) -> dict:
    """Median decode step time (s) at each span, the spans alternated round by round."""
    eng = Engine(model, slots=slots, max_len=MAX_LEN)
    for s in range(slots):
        eng.table.admit(s, MAX_LEN)  # each slot's blocks, as admission reserves them
    times = {s: [] for s in spans}
    for r in range(rounds + 1):
        for span in spans:
            pos = np.full(slots, span - 1, dtype=np.int32)
            for _ in range(steps):
                t = time.perf_counter()
                nxt, _ = eng.decoder.step(eng.tokens, list(range(slots)), pos, span, eng.rows)
                mx.eval(nxt)
                if r:  # round 0 compiles each span's step
                    times[span].append(time.perf_counter() - t)
    return {s: statistics.median(ts) for s, ts in times.items()}


def prefill_flops(cfg, prompt_lens) -> float:
    """Products of a prefill: the linear layers per token, causal attention per prompt, and the
    LM head at each prompt's last position (norms and elementwise work left out)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_token = 2 * cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)
    attn = lambda n: 2 * 2 * cfg.num_layers * q * n * (n + 1) / 2  # noqa: E731  (QK and PV)
    return sum(per_token * n + attn(n) + 2 * h * cfg.vocab_size for n in prompt_lens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="model folder (default: the demo model)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps per span per round")
    ap.add_argument("--peak-gflops", type=float, help="the machine's FMA peak, for the prefill bound")
    args = ap.parse_args()

    model = slotinfer.load(args.model or demo_model_path())
    reqs, prompts = mixed_requests(model, args.requests)  # the workload of slotinfer bench --mixed
    print(f"model: {model}\n{args.requests} requests, {args.slots} slots")

    spans = list(range(SPAN_BUCKET, MAX_LEN, 3 * SPAN_BUCKET)) + [MAX_LEN]
    cost = step_times(model, args.slots, spans, args.rounds, args.steps)
    print("decode step, ms at span: " + ", ".join(f"{s}: {t * 1e3:.1f}" for s, t in cost.items()))
    xs, ys = list(cost), list(cost.values())

    def step_s(span):
        return float(np.interp(min(-(-span // SPAN_BUCKET) * SPAN_BUCKET, MAX_LEN), xs, ys))

    pf = prefill_alone_s(model, args.slots, prompts)
    flops = prefill_flops(model.config, [p for p, _ in reqs])
    ntok = sum(p for p, _ in reqs)
    print(f"prefill alone: {pf:.1f} s for {ntok} prompt tokens ({ntok / pf:.0f} tokens/s; "
          f"{flops / 1e12:.2f} TFLOP of products, {flops / pf / 1e9:.0f} GFLOP/s)")

    sched = schedule_spans(reqs, args.slots)
    dec = {m: sum(step_s(s) for s in sp) for m, sp in sched.items()}
    flat = {m: len(sp) * ys[0] for m, sp in sched.items()}
    c, s = dec["continuous"], dec["static"]
    print(f"schedules: continuous {len(sched['continuous'])} steps, static {len(sched['static'])} "
          f"({len(sched['static']) / len(sched['continuous']):.2f}x); mean span {statistics.mean(sched['continuous']):.0f} "
          f"against {statistics.mean(sched['static']):.0f}")
    print(f"predicted decode: continuous {c:.1f} s, static {s:.1f} s ({s / c:.2f}x)")

    assert {m: len(sp) for m, sp in sched.items()} == schedule_steps([g for _, g in reqs], args.slots)

    def ratio(c, s, p):  # the shared prefill p dilutes the decode ratio s / c
        return diluted_ratio(s / c, p / (c + p))

    rows = [("as measured", ratio(c, s, pf)), ("prefill free", ratio(c, s, 0.0))]
    if args.peak_gflops:
        rows.append((f"prefill at {args.peak_gflops:.0f} GFLOP/s", ratio(c, s, flops / args.peak_gflops / 1e9)))
    rows += [("decode steps 2x faster", ratio(c / 2, s / 2, pf)),
             ("steps flat in span", ratio(flat["continuous"], flat["static"], pf)),
             ("steps flat in span, prefill free", ratio(flat["continuous"], flat["static"], 0.0))]
    print("continuous / static throughput:")
    for name, r in rows:
        print(f"  {name:<36} {r:.2f}x")


if __name__ == "__main__":
    main()
