"""A greedy stream's inter-token gaps while a large classification runs beside it.

Runs in one process, on SmolLM2-135M-Instruct (or ``--model``), each but ``classify`` a
``--tokens``-token greedy stream through an :class:`~slotinfer.Inferencer`:

* ``alone``: the stream only;
* ``classify`` (not in the default ``--runs``): ``model.classify`` alone, no stream, for its own throughput;
* ``thread``: ``model.classify`` of ``--inputs`` sentences against ``--labels`` labels on a thread
  of its own, with an MLX stream of its own, started with the stream (how /v1/classify ran
  before: an executor thread beside the engine's worker);
* ``worker``: the same classification through ``Inferencer.submit_classify``: the worker runs
  one unit of it (at most ``prefill_tokens`` padded tokens) between two decode steps.

It prints, per run, the stream's total time, its largest and median gap between two tokens,
and the classification's own time.  Labels are distinct random 2-4 word phrases (~20 bytes
each, multi-token, as in a request of 3,000 labels in ~60 KB).

    PYTHONPATH=. python benchmarks/bench_classify_beside.py --labels 3000 --tokens 150
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

import slotinfer  # first: installs the BLAS before mlx.core loads
import mlx.core as mx
from slotinfer import default_model

WORDS = ("good bad food day nice movie slow quick bright dark river stone cloud paper music light green "
         "small large quiet loud early late warm cold open closed happy tired").split()


def labels_of(n: int, rng: random.Random) -> list[str]:
    out: set[str] = set()
    while len(out) < n:
        out.add(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4))))
    return sorted(out)


def stream(inf, tokens: int) -> tuple[float, list[float]]:
    """(total seconds, gaps between consecutive tokens) of one greedy stream."""
    times: list[float] = []
    t0 = time.perf_counter()
    h = inf.submit("Tell me a long story about a river.", max_tokens=tokens, ignore_eos=True, temperature=0,
                   on_token=lambda ev: times.append(time.perf_counter()))
    h.result()
    return time.perf_counter() - t0, [b - a for a, b in zip(times, times[1:])]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--labels", type=int, default=3000)
    ap.add_argument("--inputs", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--runs", default="alone,thread,worker",
                    help="which runs, comma-separated, of alone, classify, thread, worker "
                         "(a tree without Inferencer.submit_classify: alone,classify,thread)")
    args = ap.parse_args(argv)
    model = slotinfer.load(args.model or default_model.path())
    rng = random.Random(0)
    labels = labels_of(args.labels, rng)
    inputs = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(args.inputs)]
    kw = dict(labels=labels, label_prefix=" ", prefix="Topic of the sentence: ", token_budget=args.prefill_tokens)
    print(f"{args.labels} labels ({sum(len(s) for s in labels)} bytes), {args.inputs} input(s), "
          f"a {args.tokens}-token greedy stream, prefill_tokens {args.prefill_tokens}, device {mx.default_device()}")
    rows, runs = [], args.runs.split(",")
    with slotinfer.Inferencer(model, slots=4, max_len=512, prefill_tokens=args.prefill_tokens) as inf:
        stream(inf, 8)  # warm up
        if "alone" in runs:
            total, gaps = stream(inf, args.tokens)
            rows.append(("alone", total, gaps, None))

        took = {}

        def beside():
            s = mx.new_stream(mx.default_device())
            t0 = time.perf_counter()
            with mx.stream(s):
                model.classify(inputs, **kw)
                mx.synchronize(s)
            took["s"] = time.perf_counter() - t0

        if "classify" in runs:
            t0 = time.perf_counter()
            model.classify(inputs, **kw)
            rows.append(("classify", None, None, time.perf_counter() - t0))

        if "thread" in runs:
            t = threading.Thread(target=beside)
            t.start()
            total, gaps = stream(inf, args.tokens)
            t.join()
            rows.append(("thread", total, gaps, took["s"]))

        if "worker" in runs:
            t0 = time.perf_counter()
            h = inf.submit_classify(inputs, **kw, on_result=lambda i, r: took.update(w=time.perf_counter()))
            total, gaps = stream(inf, args.tokens)
            h.result()
            rows.append(("worker", total, gaps, took["w"] - t0))
    print(f"{'run':8} {'stream s':>9} {'max gap s':>10} {'median gap s':>13} {'classify s':>11}")
    for name, total, gaps, cls in rows:
        stream_cols = (f"{'-':>9} {'-':>10} {'-':>13}" if total is None else
                       f"{total:9.1f} {max(gaps):10.2f} {statistics.median(gaps):13.3f}")
        print(f"{name:8} {stream_cols} {'-' if cls is None else f'{cls:.1f}':>11}")


if __name__ == "__main__":
    main()
