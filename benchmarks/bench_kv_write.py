"""A decode step's K/V writes: a scatter of rows against one flat put_along_axis.

Each layer's new keys and values (``[slots, 8, 1, 128]``, the Qwen3-0.6B shape) go into a
slot table of ``--capacity`` columns at each slot's own position, for ``--layers`` layers
(K and V: twice as many writes), compiled as in the decode step.  Two forms:

- rows: the layer viewed as ``[slots * heads * capacity, head_dim]`` and written with one
  advanced index per (slot, head) row, ``flat[index] = new`` (MLX's ``Scatter``);
- flat: the layer viewed as one dimension and written with ``put_along_axis`` at one offset
  per element (``slotinfer.kv.slot_table``: what the engine uses).

Prints the median time per step's writes of each, alternated, and checks they agree.

    python benchmarks/bench_kv_write.py
    python benchmarks/bench_kv_write.py --slots 8 --capacity 2049 --layers 4
"""

import argparse
import statistics
import time

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx
from slotinfer.kv.slot_table import scatter


def rows_form(cache, rows_index, new):
    b, h, cap, d = cache.shape
    flat = cache.reshape(b * h * cap, d)
    flat[rows_index] = new
    return flat.reshape(b, h, cap, d)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--capacity", type=int, default=105)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    b, h, d, cap = args.slots, 8, 128, args.capacity

    def rows(caches, pos, new):
        base = (mx.arange(b)[:, None] * h + mx.arange(h)[None]) * cap
        index = base[:, :, None] + pos[:, None, None]
        return [rows_form(c, index, new * (i + 1)) for i, c in enumerate(caches)]

    def flat(caches, pos, new):
        index = (((mx.arange(b)[:, None] * h + mx.arange(h)[None]) * cap + pos[:, None])[..., None] * d
                 + mx.arange(d)).reshape(-1)  # one offset per element, as write_index gives for the pool
        return [scatter(c, index, new * (i + 1)) for i, c in enumerate(caches)]

    forms = {"rows": mx.compile(rows), "flat": mx.compile(flat)}
    pos = mx.array([(7 * i) % (cap - 1) for i in range(b)], dtype=mx.int32)
    new = mx.random.normal((b, h, 1, d))
    caches = [mx.zeros((b, h, cap, d)) for _ in range(2 * args.layers)]
    mx.eval(caches, pos, new)
    a = forms["rows"](caches, pos, new)
    mx.eval(a)
    same = all(mx.array_equal(x, y).item() for x, y in zip(a, forms["flat"](caches, pos, new)))
    del a
    times = {k: [] for k in forms}
    for r in range(args.rounds):
        for name in (("rows", "flat") if r % 2 else ("flat", "rows")):
            t = time.perf_counter()
            caches = forms[name](caches, pos, new)  # each output replaces its input: written in place
            mx.eval(caches)
            times[name].append(time.perf_counter() - t)
    r_ms, f_ms = (statistics.median(times[k]) * 1e3 for k in ("rows", "flat"))
    print(f"{2 * args.layers} writes of [{b}, {h}, 1, {d}] into capacity {cap}: rows {r_ms:.2f} ms, "
          f"flat {f_ms:.2f} ms, {r_ms / f_ms:.2f}x; same result: {same}")


if __name__ == "__main__":
    main()
