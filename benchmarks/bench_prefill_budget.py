"""A prefill budget's cost: ``rows`` prompts of ``tokens`` tokens plus ``new`` generated tokens each,
under each prefill budget, wall time and the process's peak RSS.

The workload of ``slotinfer bench --slots 8 --prompt-tokens 2048 --gen-tokens 64`` (which sets the
budget to prompt x slots, 16,384) run under other budgets too: the budget decides how much prompt
one engine step takes in, and a larger one should never be slower nor hold more memory.  Each run
is a fresh process (peak RSS is the process's own), on an Inferencer whose step is compiled by one
short request first; ``--checkouts`` alternates checkouts of slotinfer (their code imported
through ``PYTHONPATH``), run by run, so their figures are side by side.

    python benchmarks/bench_prefill_budget.py
    python benchmarks/bench_prefill_budget.py --budgets 512,16384 --checkouts /work/main,.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def one(rows: int, tokens: int, new: int, budget: int) -> dict:
    import slotinfer
    from slotinfer import default_model
    from slotinfer.cli.bench import prompts_of

    model = slotinfer.load(default_model.path())
    prompts = prompts_of(model, rows, tokens, seed=rows)
    with slotinfer.Inferencer(model, slots=rows, max_len=tokens + new + 8, prefill_tokens=budget,
                              prefix_cache_bytes=0) as inf:
        inf.generate(prompts_of(model, 1, 32, seed=-1)[0], max_tokens=4, ignore_eos=True)
        t0 = time.perf_counter()
        handles = [inf.submit(p, max_tokens=new, ignore_eos=True) for p in prompts]
        for h in handles:
            h.result()
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--budgets", default="512,2048,4096,16384")
    ap.add_argument("--checkouts", default=".", help="slotinfer checkouts, comma-separated")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.rows, args.tokens, args.new, args.one)))
        return
    checkouts = [os.path.abspath(c) for c in args.checkouts.split(",")]
    print(f"{args.rows} x {args.tokens} prompt tokens + {args.new} new each")
    print(f"{'checkout':>28} {'budget':>7} {'wall s':>8} {'maxrss MiB':>10}")
    for r in range(args.rounds):
        for budget in map(int, args.budgets.split(",")):
            for c in checkouts if r % 2 == 0 else checkouts[::-1]:
                out = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--tokens", str(args.tokens),
                                      "--new", str(args.new), "--one", str(budget)], capture_output=True, text=True,
                                     env={**os.environ, "PYTHONPATH": c}, check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{c[-28:]:>28} {budget:7d} {got['wall_s']:8.1f} {got['maxrss_mib']:10.0f}", flush=True)


if __name__ == "__main__":
    main()
