"""Tokens/s against concurrency: the figure in docs/batching.md, as a table and an SVG plot.

The workload of ``slotinfer bench`` (prompts of 32 tokens, exactly 64 generated tokens each,
one Inferencer with as many slots as sequences) at each count of concurrent sequences; the
median of ``--repeats`` runs of each point, the points interleaved repeat by repeat so a
machine that drifts moves them alike.  Aggregate tokens/s counts every generated token over
the wall time (prefill included); decode-only leaves out the time to the last first token.

    python benchmarks/bench_concurrency.py                          # writes docs/concurrency.svg
    python benchmarks/bench_concurrency.py --slots 1,4,16 --repeats 1 --plot /tmp/c.svg
"""

import argparse
import statistics
from pathlib import Path

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer.cli.bench import bench_model_path, engine_tokens_per_s, slot_counts
from slotinfer._svg import svg_plot

DOCS = Path(__file__).resolve().parent.parent / "docs"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder (default: the random Qwen3-0.6B-shaped model of slotinfer bench)")
    ap.add_argument("--slots", type=slot_counts, default="1,2,4,8,16,32")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plot", type=Path, default=DOCS / "concurrency.svg")
    args = ap.parse_args()

    model = slotinfer.load(args.model or bench_model_path())
    print(f"model: {model}\nBLAS: {slotinfer.BLAS.name} {slotinfer.BLAS.version}, threads {slotinfer.BLAS.threads}")
    runs = {s: [] for s in args.slots}
    for _ in range(args.repeats):
        for s in args.slots:
            runs[s].append(engine_tokens_per_s(model, s, args.prompt_tokens, args.gen_tokens))
    agg = [statistics.median(r["tokens_per_s"] for r in runs[s]) for s in args.slots]
    dec = [statistics.median(r["decode_tokens_per_s"] for r in runs[s]) for s in args.slots]
    print(f"median of {args.repeats}\n| sequences | tokens/s | decode-only tokens/s |\n|---:|---:|---:|")
    for s, a, d in zip(args.slots, agg, dec):
        print(f"| {s} | {a:.1f} | {d:.1f} |")
    name = Path(args.model).name if args.model else "Qwen3-0.6B shape, f32 on CPU"
    args.plot.write_text(svg_plot(args.slots, {"decode only": dec, "end to end": agg},
                                  f"slotinfer: tokens/s against concurrency ({name})",
                                  "concurrent sequences (slots)", "tokens/s"))
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
