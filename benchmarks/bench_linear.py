"""Linear-layer throughput against the number of rows (slots) in a decode step.

Products ``x @ w.T`` over the MLP weights of a Qwen3-0.6B-shaped model (28 x gate|up
[6144, 1024] and 28 x down [1024, 3072], ~1.06 GB of float32, so every call reads its
weight from memory), as a decode step issues them.  Prints GFLOP/s and the rate at which
weights are read: small row counts are bound by memory, large ones by the kernel.

    python benchmarks/bench_linear.py
    SLOTINFER_OWN_GEMM=0 python benchmarks/bench_linear.py   # the plain library, for comparison
"""

import argparse
import time

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,48,64")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=4, help="passes per row count; the best is printed")
    args = ap.parse_args()
    n = args.layers
    weights = [mx.random.normal((6144, 1024)) * 0.02 for _ in range(n)]
    weights += [mx.random.normal((1024, 3072)) * 0.02 for _ in range(n)]
    mx.eval(weights)
    flops_per_row = 2 * sum(w.size for w in weights)
    nbytes = 4 * sum(w.size for w in weights)
    print(f"{len(weights)} weights, {nbytes / 1e9:.2f} GB; best of {args.repeats}")
    print(f"{'rows':>4} {'ms':>8} {'GFLOP/s':>8} {'weight GB/s':>12}")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = [mx.random.normal((m, 1024)), mx.random.normal((m, 3072))]
        mx.eval(xs)
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            for i, w in enumerate(weights):
                mx.eval(xs[0 if i < n else 1] @ w.T)
            best = min(best, time.perf_counter() - t)
        print(f"{m:>4} {best * 1e3:>8.1f} {m * flops_per_row / best / 1e9:>8.1f} {nbytes / best / 1e9:>12.1f}",
              flush=True)


if __name__ == "__main__":
    main()
