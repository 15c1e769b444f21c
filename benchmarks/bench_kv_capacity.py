"""Requests served at once within a fixed K/V budget: the block pool against a contiguous slot table.

A contiguous table reserves ``max_len + 1`` tokens of K/V per slot whatever a request holds, so a
budget of ``--budget`` bytes holds ``budget // ((max_len + 1) * bytes_per_token)`` slots (the
previous design's formula, exact).  The block pool admits a request when its free blocks hold
its prompt, and gives it a block more as its output crosses each block boundary, preempting the newest request
when none is free: here ``--requests`` prompts of ``--min``..``--max``
random tokens (uniform) and ``--max-tokens`` each are submitted at once to an engine of
``--slots`` slots and a pool of ``--budget`` bytes, and the requests holding a slot are counted
after each step until all have ended (only the admissions are of interest: ``--steps`` bounds the
run, as decoding them all on a CPU takes minutes).

    python benchmarks/bench_kv_capacity.py                       # SmolLM2-135M, 1 GiB, prompts 200-2,000
"""

from __future__ import annotations

import argparse
import random
import statistics

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model
from slotinfer.cli.common import byte_size
from slotinfer.engine.engine import Engine


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--budget", type=byte_size, default=1 << 30)
    ap.add_argument("--min", type=int, default=200)
    ap.add_argument("--max", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    model = slotinfer.load(args.model or default_model.path())
    max_len = args.max + args.max_tokens
    eng = Engine(model, slots=args.slots, max_len=max_len, kv_cache_bytes=args.budget, prefix_cache_bytes=0)
    per_token = eng.table.block_nbytes // eng.table.block_size
    contiguous = args.budget // ((max_len + 1) * per_token)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    lens = [rng.randint(args.min, args.max) for _ in range(args.requests)]
    for n in lens:
        eng.add(eng.make_item([rng.randrange(3, vocab) for _ in range(n)], max_tokens=args.max_tokens,
                              ignore_eos=True))
    held = []
    for _ in range(args.steps):
        eng.step()
        held.append(eng.stats()["active_slots"])
    s = eng.stats()
    print(f"model: {model}; budget {args.budget / 2**30:.2f} GiB, {per_token} bytes a token; "
          f"{args.requests} prompts of {args.min}-{args.max} tokens (mean {statistics.mean(lens):.0f}), "
          f"max_tokens {args.max_tokens}")
    print("| design | requests held at once |")
    print("|---|---:|")
    print(f"| contiguous slots x max_len ({max_len + 1} tokens a slot) | {contiguous} |")
    print(f"| block pool ({s['blocks']} blocks of {s['block_tokens']} tokens; {s['blocks_used']} used; "
          f"{s.get('preempted', 0)} preempted in {args.steps} steps) | {max(held)} |")
    print(f"ratio: {max(held) / contiguous:.2f}x")


if __name__ == "__main__":
    main()
