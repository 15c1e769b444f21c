"""Decode attention per layer: one stream against the batch split over concurrent CPU streams.

One decode step's attention for ``--slots`` slots of a Qwen3-0.6B-shaped layer (16 query
heads, 8 K/V heads, head_dim 128) over a slot table of capacity 2049, at several live spans,
through ``slotinfer.models.transformer.attend`` and ``attend_split`` (the CPU policy's
``device.attention_split()`` parts).  Prints the median time per layer of each and the ratio.

    python benchmarks/bench_attention.py
    python benchmarks/bench_attention.py --slots 16 --spans 256,2048
"""

import argparse
import statistics
import time

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx
from slotinfer import device
from slotinfer.cpu.ops import cpu_ops
from slotinfer.models.transformer import attend, attend_split


def median_ms(fn, args, n=20):
    for _ in range(3):
        mx.eval(fn(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--spans", default="128,512,1024")
    args = ap.parse_args()
    split = max(2, device.attention_split())
    b, heads, kv_heads, dim, capacity = args.slots, 16, 8, 128, 2049
    keys = mx.random.normal((b, kv_heads, capacity, dim))
    values = mx.random.normal((b, kv_heads, capacity, dim))
    q = mx.random.normal((b, heads, 1, dim))
    mx.eval(keys, values, q)
    print(f"{b} slots, {split} streams; ms per layer (median of 20)")
    print(f"{'span':>6} {'one stream':>11} {'split':>8} {'ratio':>6}")
    ops = cpu_ops()
    for span in [int(s) for s in args.spans.split(",")]:
        mask = (mx.arange(span)[None] < mx.random.randint(span // 2, span + 1, (b,))[:, None])[:, None, None]
        whole = mx.compile(lambda q, k, v, m: attend(q, k[:, :, :span], v[:, :, :span], 0.088, m, None, ops))
        parts = mx.compile(lambda q, k, v, m: attend_split(q, k[:, :, :span], v[:, :, :span], 0.088, m, None,
                                                           ops, split))
        one, many = median_ms(whole, (q, keys, values, mask)), median_ms(parts, (q, keys, values, mask))
        print(f"{span:>6} {one:>11.2f} {many:>8.2f} {one / many:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
