"""Single-sequence decode tokens/s on a Qwen3-0.6B-shaped model, with and without the CPU fast path.

"fast path": the optimized BLAS slotinfer loads before mlx.core, and float32 compute.
"as stored": MLX's reference BLAS (SLOTINFER_BLAS=none) and bf16 weights as published,
which is what a user gets from MLX on Linux without a device policy.  Each
configuration runs in its own process, since the BLAS is chosen per process.

    python benchmarks/bench_single.py [--tokens 32] [--repeats 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

CONFIGS = {
    "fast path (optimized BLAS, f32)": ({}, None),
    "optimized BLAS, bf16 as stored": ({}, "bfloat16"),
    "reference BLAS, f32": ({"SLOTINFER_BLAS": "none"}, None),
    "reference BLAS, bf16 as stored": ({"SLOTINFER_BLAS": "none"}, "bfloat16"),
}

CHILD = """
import json, sys, time
import slotinfer
from slotinfer.cli.bench import bench_model_path
m = slotinfer.load(bench_model_path(), dtype={dtype!r})
m.generate([5, 6, 7, 8], max_tokens=2, ignore_eos=True)  # warm up
out = []
for _ in range({repeats}):
    t = time.perf_counter()
    c = m.generate(list(range(3, 35)), max_tokens={tokens}, ignore_eos=True)
    out.append(len(c.tokens) / (time.perf_counter() - t))
print(json.dumps({{"tps": out, "blas": slotinfer.BLAS.name}}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", help="run configurations whose name contains this")
    args = ap.parse_args()
    results = {}
    for name, (env, dtype) in CONFIGS.items():
        if args.only and args.only not in name:
            continue
        tokens = args.tokens if "reference" not in name else max(4, args.tokens // 8)
        code = CHILD.format(dtype=dtype, repeats=args.repeats, tokens=tokens)
        proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name}: failed\n{proc.stderr[-2000:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        results[name] = statistics.median(r["tps"])
        print(f"{name:<34} {results[name]:8.2f} tokens/s  (BLAS {r['blas']})", flush=True)
    base = results.get("reference BLAS, bf16 as stored")
    fast = results.get("fast path (optimized BLAS, f32)")
    if base and fast:
        print(f"fast path / as stored: {fast / base:.1f}x")


if __name__ == "__main__":
    main()
