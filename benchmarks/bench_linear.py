"""Linear-layer throughput against the number of rows (slots) in a decode step.

Products ``x @ w.T`` over the MLP weights of a Qwen3-0.6B-shaped model (28 x gate|up
[6144, 1024] and 28 x down [1024, 3072], ~1.06 GB of float32, so every call reads its
weight from memory), as a decode step issues them.  Prints GFLOP/s and the rate at which
weights are read: small row counts are bound by memory, large ones by the kernel.

    python benchmarks/bench_linear.py
    SLOTINFER_OWN_GEMM=0 python benchmarks/bench_linear.py   # the plain library, for comparison
    python benchmarks/bench_linear.py --compare-own --rows 1,8,32 --layers 8   # both, side by side

``--compare-own`` alternates the shim's own loops and the plain library pass by pass in one
process and prints the median of each and their ratio (what keeping the loops buys).
"""

import argparse
import statistics
import time

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx
from slotinfer.cpu.blas import set_own_products


def one_pass(weights, xs, n):
    t = time.perf_counter()
    for i, w in enumerate(weights):
        mx.eval(xs[0 if i < n else 1] @ w.T)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,48,64")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=4, help="passes per row count; the best is printed")
    ap.add_argument("--compare-own", action="store_true", help="own loops vs the plain library, alternated")
    args = ap.parse_args()
    n = args.layers
    weights = [mx.random.normal((6144, 1024)) * 0.02 for _ in range(n)]
    weights += [mx.random.normal((1024, 3072)) * 0.02 for _ in range(n)]
    mx.eval(weights)
    flops_per_row = 2 * sum(w.size for w in weights)
    nbytes = 4 * sum(w.size for w in weights)
    if args.compare_own:
        return compare_own(weights, n, [int(r) for r in args.rows.split(",")], args.repeats)
    print(f"{len(weights)} weights, {nbytes / 1e9:.2f} GB; best of {args.repeats}")
    print(f"{'rows':>4} {'ms':>8} {'GFLOP/s':>8} {'weight GB/s':>12}")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [mx.random.normal((m, 1024)), mx.random.normal((m, 3072))]
        mx.eval(xs)
        best = min(one_pass(weights, xs, n) for _ in range(args.repeats))
        print(f"{m:>4} {best * 1e3:>8.1f} {m * flops_per_row / best / 1e9:>8.1f} {nbytes / best / 1e9:>12.1f}",
              flush=True)


def compare_own(weights, n, rows, repeats):
    if not set_own_products(True):
        print("the BLAS is not reached through slotinfer's shim: nothing to compare")
        return
    print(f"{len(weights)} weights; ms per pass, median of {repeats} alternated passes")
    print(f"{'rows':>4} {'own loops':>10} {'library':>10} {'library / own':>14}")
    for m in rows:
        xs = [mx.random.normal((m, 1024)), mx.random.normal((m, 3072))]
        mx.eval(xs)
        times = {True: [], False: []}
        for r in range(repeats + 1):
            for own in (True, False) if r % 2 == 0 else (False, True):
                set_own_products(own)
                t = one_pass(weights, xs, n)
                if r:  # the first round warms both up
                    times[own].append(t)
        own, lib = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(f"{m:>4} {own:>10.1f} {lib:>10.1f} {lib / own:>14.2f}", flush=True)
    set_own_products(True)


if __name__ == "__main__":
    main()
