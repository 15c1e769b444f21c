"""Where the memory of a preemption flood goes: RSS before and after 12 requests (200-token prompts,
100 new tokens each) outgrow a pool of 29 blocks, preempting each other, with the prefix cache at
its default cap or off.  After the flood the pool is idle: its arrays are cut back to the idle size
plus the cached blocks, so what stays above idle is the cache (the flood's full blocks, bounded by
``prefix_cache_bytes``), and nothing with the cache off.

    python benchmarks/bench_preemption_rss.py            # the default cap
    python benchmarks/bench_preemption_rss.py --prefix-cache-bytes 0
"""

from __future__ import annotations

import argparse
import json
import random

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model
from slotinfer.engine.engine import Engine
from slotinfer.kv import KV_BLOCK_SIZE, block_bytes

import mlx.core as mx


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-cache-bytes", type=int, default=None)
    a = ap.parse_args()
    model = slotinfer.load(default_model.path())
    c = model.config
    each = block_bytes(num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=mx.float32,
                       block_size=KV_BLOCK_SIZE)
    n, prompt, new = 12, 200, 100
    e = Engine(model, slots=n, max_len=prompt + new + 8, kv_cache_bytes=(2 * n + 3 + 2) * each,
               prefix_cache_bytes=a.prefix_cache_bytes)
    rng = random.Random(0)
    vocab = c.vocab_size
    e.add(e.make_item([rng.randrange(3, vocab) for _ in range(prompt)], max_tokens=4, ignore_eos=True))
    e.run_until_done()  # the step variants compiled, the pool idle
    idle = rss()
    for _ in range(n):
        e.add(e.make_item([rng.randrange(3, vocab) for _ in range(prompt)], max_tokens=new, ignore_eos=True))
    e.run_until_done()
    after, m = rss(), e.memory()
    print(json.dumps({"prefix_cache_bytes": a.prefix_cache_bytes, "preempted": e.counters["preempted"],
                      "idle_rss_mib": idle >> 20, "after_rss_mib": after >> 20,
                      "kv_allocated_mib": m["kv_allocated_bytes"] >> 20, "cached_mib": m["prefix_cache_bytes"] >> 20}))


if __name__ == "__main__":
    main()
