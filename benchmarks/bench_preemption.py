"""What preemption costs: requests whose outputs outgrow a tight K/V pool, against a pool that holds
them all.

``--requests`` prompts of ``--prompt-tokens`` random tokens and ``--max-tokens`` new tokens each
(``ignore_eos``) are submitted at once to an engine of as many slots.  The tight pool holds every
prompt's blocks at admission and ``--spare`` blocks more, so as outputs cross block boundaries the
newest requests are preempted and later recomputed; the ample pool holds every request whole.  The
two alternate ``--rounds`` times in one process; printed: wall time, generated tokens/s,
preemptions, and whether every output equals the ample pool's.

    python benchmarks/bench_preemption.py                       # SmolLM2-135M-Instruct
    python benchmarks/bench_preemption.py --requests 16 --prompt-tokens 200 --max-tokens 128 --spare 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model
from slotinfer.engine.engine import Engine
from slotinfer.kv import KV_BLOCK_SIZE, block_bytes


def run(model, prompts, max_tokens: int, blocks: int):
    eng = Engine(model, slots=len(prompts), max_len=max(map(len, prompts)) + max_tokens,
                 kv_cache_bytes=(blocks + 2) * _block_bytes(model), prefix_cache_bytes=0)  # 2 reserved
    items = [eng.make_item(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
    t0 = time.perf_counter()
    for it in items:
        eng.add(it)
    eng.run_until_done()
    wall = time.perf_counter() - t0
    return wall, [it.handle.result(0).tokens for it in items], eng.counters.get("preempted", 0)


def _block_bytes(model) -> int:
    c = model.config
    return block_bytes(num_layers=c.num_layers, kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=model.dtype,
                       block_size=KV_BLOCK_SIZE)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spare", type=int, default=4, help="blocks the tight pool holds beyond the prompts'")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    model = slotinfer.load(a.model or default_model.path())
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(a.prompt_tokens)] for _ in range(a.requests)]
    per = lambda n: -(-n // KV_BLOCK_SIZE)  # noqa: E731
    tight = a.requests * per(a.prompt_tokens + 1) + a.spare
    ample = a.requests * per(a.prompt_tokens + a.max_tokens)
    run(model, prompts[:2], 4, ample)  # compile outside the timing
    walls = {"tight": [], "ample": []}
    same, preempted = True, 0
    for _ in range(a.rounds):
        wall, want, _ = run(model, prompts, a.max_tokens, ample)
        walls["ample"].append(wall)
        wall, got, preempted = run(model, prompts, a.max_tokens, tight)
        walls["tight"].append(wall)
        same = same and got == want
    n = a.requests * a.max_tokens
    print(f"model: {model}; {a.requests} requests of {a.prompt_tokens} prompt tokens and {a.max_tokens} new")
    print("| pool | blocks | wall s (median) | generated tokens/s | preempted |")
    print("|---|---:|---:|---:|---:|")
    for name, blocks in (("ample", ample), ("tight", tight)):
        w = statistics.median(walls[name])
        print(f"| {name} | {blocks} | {w:.1f} | {n / w:.1f} | {preempted if name == 'tight' else 0} |")
    print(f"tight / ample throughput: {statistics.median(walls['ample']) / statistics.median(walls['tight']):.2f}x; "
          f"outputs equal: {same}")


if __name__ == "__main__":
    main()
