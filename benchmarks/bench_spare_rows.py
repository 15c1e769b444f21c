"""Decode tokens/s with the few-row products leaving a core free or not, side by side in one process.

A product node of its own (the LM head; every product of a step that is not fused) of at most
``set_spare_rows`` rows runs on one thread fewer than the kernels have, so that the engine's
thread can build the next step beside it (docs/quantized-cpu.md).  This runs the default model's
decode through the engine at each setting in turn, ``--rounds`` rounds that alternate the order,
and prints each setting's median decode tokens/s and its ratio to the first setting's, round by
round.  Compare on a quiet machine: on a busy one, the setting with more threads gets a larger
share of the CPU.

    python benchmarks/bench_spare_rows.py
    python benchmarks/bench_spare_rows.py --spare 4,0 --slots 1,4 --rounds 8
"""

import argparse
import statistics

import slotinfer  # noqa: F401  first: the BLAS before mlx.core
from slotinfer import default_model
from slotinfer.cli.bench import engine_tokens_per_s
from slotinfer.cpu import qkernel


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spare", default="4,0", help="spare-rows settings, comma-separated (the first is the base)")
    ap.add_argument("--slots", default="1", help="sequences decoding together, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=128)
    args = ap.parse_args()
    model, why = default_model.load()
    if model is None:
        raise SystemExit(f"the default model is not installed: {why}")
    module = qkernel.load()
    if module is None:
        raise SystemExit(f"the quantized kernels are {qkernel.status()}")
    settings = [int(s) for s in args.spare.split(",")]
    for slots in (int(s) for s in args.slots.split(",")):
        rates = {s: [] for s in settings}
        for r in range(args.rounds + 1):
            for s in settings[r % len(settings):] + settings[:r % len(settings)]:
                module.set_spare_rows(s)
                rate = engine_tokens_per_s(model, slots, args.prompt_tokens, args.gen_tokens)["decode_tokens_per_s"]
                if r:  # the first round compiles the steps
                    rates[s].append(rate)
        module.set_spare_rows(4)
        base = rates[settings[0]]
        for s in settings:
            ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(rates[s], base))
            print(f"{slots} sequence(s), spare rows {s}: {statistics.median(rates[s]):6.1f} decode tok/s, "
                  f"against spare rows {settings[0]}: {ratios}", flush=True)


if __name__ == "__main__":
    main()
