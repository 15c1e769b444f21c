"""Ray Data throughput: the same job on 1 and 2 actors, back to back, on one local cluster.

Model: a random-weight model of SmolLM2-135M's shape (Llama, 30 layers of 576, f32 on
CPU), built once under ``~/.cache/slotinfer/bench``, or ``--model``.  Workloads (``--task``): ``classify`` labels ``--rows`` short reviews (positive /
negative / neutral behind a shared instruction); ``generate`` completes ``--gen-rows``
chat prompts with ``--max-tokens`` greedy tokens each (EOS ignored).  Each run is the whole job as a
user meets it: actors started, the model loaded in each, every row through
``map_batches`` and back to the driver.  Runs alternate 1, 2, 2, 1, ... actors so a
drift of a shared machine falls on both; the figures are medians over ``--repeats``
runs of each, with the ratio of the medians and the rows each actor handled (the
proof that the scheduler spread the work).

    python benchmarks/bench_ray.py                          # SmolLM2-135M, both tasks
    python benchmarks/bench_ray.py --task classify --rows 512 --repeats 3
    python benchmarks/bench_ray.py --model PATH --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import time

REVIEWS = ["the food was cold and the waiter ignored us", "a lovely evening, we will come back",
           "it was fine, nothing special", "the film dragged on for far too long",
           "best concert I have been to in years", "the hotel room was clean but small",
           "delivery took three weeks and the box was damaged", "friendly staff and fair prices"]
INSTRUCTION = ("Classify the sentiment of the review as positive, negative or neutral.\nReview: ")
TOPICS = ["a lighthouse", "autumn rain", "a lost key", "the first train", "a quiet library", "a red kite"]


# SmolLM2-135M's decoder (Llama architecture), with the test tokenizer's vocabulary padded to SmolLM2's
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048}


def smollm2_shape():
    from pathlib import Path

    from slotinfer.testing import make_tiny_model

    path = Path(os.environ.get("SLOTINFER_CACHE", Path.home() / ".cache" / "slotinfer")) / "bench" / "ray-smollm2-shape"
    if not (path / "config.json").exists():
        make_tiny_model("llama", path, overrides=SMOLLM2_135M)
    return path


def rows(task: str, n: int) -> list[dict]:
    if task == "classify":
        return [{"id": i, "text": f"{REVIEWS[i % len(REVIEWS)]} (visit {i})"} for i in range(n)]
    return [{"id": i, "text": f"Write one sentence about {TOPICS[i % len(TOPICS)]}, number {i}."} for i in range(n)]


def job(ds, task: str, model: str, actors: int, args, batch_size: int | None = None):
    import slotinfer.ray as sr

    if task == "classify":
        cls, kw, batch = sr.Classifier, {"labels": ["positive", "negative", "neutral"], "prefix": INSTRUCTION,
                                         "suffix": "\nSentiment:", "label_prefix": " "}, args.batch_size
    else:
        cls, kw, batch = sr.Generator, {"chat": True, "max_tokens": args.max_tokens, "slots": args.slots,
                                        "max_len": 256, "ignore_eos": True}, args.slots
    out = ds.map_batches(cls, fn_constructor_kwargs={"model": model, "worker_column": "worker", **kw},
                         batch_size=batch_size or batch, batch_format="pyarrow", **sr.actor_options(actors))
    start = time.perf_counter()
    got = out.take_all()
    wall = time.perf_counter() - start
    errors = sum(r["error"] is not None for r in got)
    if errors:
        raise SystemExit(f"{errors} rows failed, e.g. {next(r['error'] for r in got if r['error'])}")
    tokens = sum(len(r["tokens"]) for r in got) if task == "generate" else 0
    return wall, sorted(collections.Counter(r["worker"] for r in got).values(), reverse=True), tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: a random model of SmolLM2-135M's shape, built once)")
    ap.add_argument("--task", choices=["classify", "generate", "both"], default="both")
    ap.add_argument("--rows", type=int, default=256, help="reviews to classify (default 256)")
    ap.add_argument("--gen-rows", type=int, default=32, help="prompts to complete (default 32)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--slots", type=int, default=4, help="Generator slots per actor, and its batch size (default 4)")
    ap.add_argument("--batch-size", type=int, default=16, help="Classifier rows per call (default 16)")
    ap.add_argument("--blocks", type=int, default=16, help="blocks the rows are cut into (default 16)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each actor count (default 2)")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)

    import ray

    import slotinfer

    model = args.model or str(smollm2_shape())
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": os.path.basename(model),
              "blas": str(slotinfer.BLAS), "ray": ray.__version__, "tasks": {}}
    order = [1, 2, 2, 1] * ((args.repeats + 1) // 2)
    for task in (["classify", "generate"] if args.task == "both" else [args.task]):
        n = args.rows if task == "classify" else args.gen_rows
        ds = ray.data.from_items(rows(task, n), override_num_blocks=args.blocks).materialize()
        # what a job costs before its rows: the actors started, the model loaded in each, one or two rows
        start = {a: job(ds.limit(a), task, model, a, args, batch_size=1)[0] for a in (1, 2)}
        print(f"{task:>8}  start-up (a job of 1 or 2 rows): 1 actor {start[1]:.2f} s, 2 actors {start[2]:.2f} s", flush=True)
        runs = {1: [], 2: []}
        for actors in order[:2 * args.repeats]:
            wall, spread, tokens = job(ds, task, model, actors, args)
            runs[actors].append(wall)
            net = max(wall - start[actors], 1e-9)
            print(f"{task:>8}  {actors} actor(s)  {wall:7.2f} s  {n / wall:6.1f} rows/s ({n / net:6.1f} past start-up)"
                  + (f"  {tokens / net:6.1f} tokens/s past start-up" if tokens else "")
                  + f"  rows per actor {spread}", flush=True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        net = {k: max(med[k] - start[k], 1e-9) for k in med}
        report["tasks"][task] = {"rows": n, "runs_s": runs, "median_s": med, "startup_s": start,
                                 "ratio_2_over_1": med[1] / med[2], "ratio_past_startup": net[1] / net[2]}
        print(f"{task:>8}  median 1 actor {med[1]:.2f} s, 2 actors {med[2]:.2f} s: 2 actors run at "
              f"{med[1] / med[2]:.2f}x the speed of 1 ({net[1] / net[2]:.2f}x past start-up)", flush=True)
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
