"""Speculation replayed: the engine's drafter and gate over a real model's greedy outputs, each step
timed by a table of measured step costs, against the same outputs without speculation and against
a gate that knew which draft tokens would hold.

    python benchmarks/spec_replay.py                          # the engine's settings
    python benchmarks/spec_replay.py --max-n 4 --min-n 2      # prompt lookup from 4-grams to 2-grams
    python benchmarks/spec_replay.py --budget 8 --keep /tmp/spec_outputs.json

Each prompt of ``benchmarks/data/spec_prompts.jsonl`` that ``bench_spec.py`` runs is generated
greedily on the engine (``--gen`` tokens, one at a time, speculation off; ``--keep FILE`` holds the
outputs between runs).  The replay then walks each output as the engine would: every step, each
live row is asked for a draft by a :class:`~slotinfer.spec.Drafter` with the engine's constants
(``--budget`` positions a step), a verified draft keeps its right prefix plus the model's own
next token, and the step costs ``costs[P - 1]`` ms for its ``P`` positions (rows plus verified
draft tokens), plus ``--sync-ms`` when some row may draft (the step before is read back first).
Without speculation a step of ``n`` live rows costs ``costs[n - 1]``.  The default costs are a
``bench_spec.py --calibrate`` run on the 2-core AMD EPYC (docs/speculative.md).

Workloads: ``bench_spec.py``'s single stream of copy-heavy prompts (8), the other 24 copy-heavy
prompts one at a time, the 4 prompts with nothing to copy, and its 4 live rows (one copy-heavy
prompt of each kind, together).  ``oracle`` drafts exactly what prompt lookup or the suffix pool
would have drafted right, handing out positions while output tokens per ms rise: the ceiling of
any gate over these sources at these costs.

The figures are a model of the engine, not a measurement of it: ``bench_spec.py`` measures the
engine itself (on this machine it gives a few percent less than the model for the single stream).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import slotinfer  # noqa: E402,F401  before MLX: slotinfer swaps in its BLAS
from slotinfer import default_model  # noqa: E402
from slotinfer.engine.engine import BANDWIDTH_ROWS, POSITION_COST, STEP_COSTS, SYNC_COST, Engine  # noqa: E402
from slotinfer.engine.speculation import VERIFY_MS  # noqa: E402
from slotinfer.spec import CostModel, Drafter, PromptLookup  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "spec_prompts.jsonl"
COSTS = VERIFY_MS  # ms a verify step of 1..16 positions: the calibration the engine's gate is priced by
SYNC_MS = 0.59  # 9.31 against 8.72 ms a one-row step read back first (the same run)


def workloads(model, gen: int, keep: str | None):
    """{name: [(prompt ids, output ids)]}, as bench_spec.py's sets (output: its first token on)."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    copy = [r for r in rows if r["set"] == "copy"]
    open_ = [r for r in rows if r["set"] == "open"][:4]
    by_kind: dict[str, list] = {}
    for r in copy:
        by_kind.setdefault(r["kind"], []).append(r)
    two_each = [r for rs in by_kind.values() for r in rs[:2]]
    others = [r for r in copy if r not in two_each]
    one_each = [rs[0] for rs in by_kind.values()]
    wanted = copy + open_
    saved = json.loads(Path(keep).read_text()) if keep and Path(keep).is_file() else None
    if saved and saved["gen"] == gen and saved["messages"] == [r["messages"] for r in wanted]:
        pairs = [tuple(p) for p in saved["pairs"]]
    else:
        ids = [model.encode_prompt(model.chat_prompt(messages=r["messages"])) for r in wanted]
        engine = Engine(model, slots=1, max_len=max(map(len, ids)) + gen + 8, prefill_tokens=512)
        items = [engine.make_item(p, max_tokens=gen) for p in ids]
        for it in items:
            engine.add(it)
        engine.run_until_done()
        pairs = [(list(p), list(it.handle.result(0).tokens)) for p, it in zip(ids, items)]
        if keep:
            Path(keep).write_text(json.dumps({"gen": gen, "messages": [r["messages"] for r in wanted], "pairs": pairs}))
    of = {id(r): pair for r, pair in zip(wanted, pairs)}
    return {
        "copy, 1 stream (bench_spec's 8)": ([of[id(r)] for r in two_each], 1),
        "copy, the other 24, 1 stream": ([of[id(r)] for r in others], 1),
        "open, 1 stream (4)": ([of[id(r)] for r in open_], 1),
        "copy, 4 live rows": ([of[id(r)] for r in one_each], 4),
    }


def cost_of(costs, positions: int) -> float:
    return costs[min(positions, len(costs)) - 1]


def without(pairs, slots: int, costs) -> float:
    """ms to decode ``pairs`` (each output after its first token) one token a step, ``slots`` at once."""
    if slots == 1:
        return sum((len(out) - 1) * costs[0] for _, out in pairs)
    left, ms = sorted(len(out) - 1 for _, out in pairs), 0.0
    done = 0
    for i, n in enumerate(left):
        ms += (n - done) * cost_of(costs, len(left) - i)
        done = n
    return ms


def _rows(drafter, pairs):
    """``drafter`` and a drafting row for each (prompt, output), holding the output's first token (the
    prefill's): ``[row, output, tokens taken]``."""
    rows = []
    for prompt, out in pairs:
        row = drafter.row(prompt)
        drafter.append(row, out[:1])
        rows.append([row, out, 1])
    return drafter, rows


def _right(draft, out, n: int) -> int:
    """How many of ``draft``'s first tokens equal the output's from position ``n`` on."""
    a = 0
    while a < len(draft) and out[n + a] == draft[a]:
        a += 1
    return a


def replay(pairs, slots: int, make_drafter, costs, sync_ms: float) -> tuple[float, dict]:
    """(ms, counts) of the engine's drafting over ``pairs``, ``slots`` of them live at once."""
    total, counts = 0.0, {"steps": 0, "drafted": 0, "accepted": 0}
    for start in range(0, len(pairs), slots):
        drafter, rows = _rows(make_drafter(), pairs[start:start + slots])
        while live := [r for r in rows if r[2] < len(r[1])]:
            wait = not drafter.cost.compute_bound(len(live)) and any(drafter.may_draft(r[0]) for r in live)
            drafts = drafter.step([r[0] for r in live], len(live), [len(out) - n - 1 for _, out, n in live])
            if not wait:  # the step is pipelined: its rows' drafts are scored in the shadow only
                for r in live:
                    drafter.withdraw(r[0])
                drafts = [[] for _ in live]
            total += cost_of(costs, len(live) + sum(map(len, drafts))) + (sync_ms if wait else 0.0)
            counts["steps"] += 1
            for r, draft in zip(live, drafts):
                row, out, n = r
                a = _right(draft, out, n)
                drafter.append(row, out[n:n + a + 1])
                r[2] = n + a + 1
                counts["drafted"] += len(draft)
                counts["accepted"] += a
        for row, _, _ in rows:
            drafter.finish(row)
    return total, counts


def oracle(pairs, slots: int, make_drafter, costs, budget: int) -> float:
    """ms with each row drafting exactly the right prefix of its sources' best draft."""
    total = 0.0
    for start in range(0, len(pairs), slots):
        drafter, rows = _rows(make_drafter(), pairs[start:start + slots])
        while live := [r for r in rows if r[2] < len(r[1])]:
            right = []
            for row, out, n in live:
                best = 0
                for source in drafter.sources:
                    if source.name not in row.acceptance:
                        continue
                    draft = source.propose(row, min(drafter.cost.max_k, len(out) - n - 1))
                    best = max(best, _right(draft, out, n))
                right.append(best)
            ks, positions = [0] * len(live), len(live)
            while positions < budget:
                i = max(range(len(live)), key=lambda j: right[j] - ks[j])
                tokens = len(live) + sum(ks)
                if right[i] <= ks[i] or (tokens + 1) / cost_of(costs, positions + 1) <= tokens / cost_of(costs, positions):
                    break
                ks[i] += 1
                positions += 1
            total += cost_of(costs, positions)
            for r, k in zip(live, ks):
                row, out, n = r
                drafter.append(row, out[n:n + k + 1])
                r[2] = n + k + 1
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gen", type=int, default=96, help="tokens generated per prompt (bench_spec.py's default)")
    ap.add_argument("--keep", help="a JSON file that holds the generated outputs between runs")
    ap.add_argument("--budget", type=int, default=BANDWIDTH_ROWS, help="positions a step (the gate's bandwidth_rows)")
    ap.add_argument("--position-cost", type=float, default=POSITION_COST)
    ap.add_argument("--sync-cost", type=float, default=SYNC_COST)
    ap.add_argument("--max-n", type=int, default=PromptLookup().max_n)
    ap.add_argument("--min-n", type=int, default=PromptLookup().min_n)
    ap.add_argument("--costs", help="comma-separated ms of a step of 1, 2, ... positions (default: the module's)")
    ap.add_argument("--line", action="store_true", help="the gate's cost as the line of --position-cost, not the "
                    "engine's table of measured steps")
    ap.add_argument("--sync-ms", type=float, default=SYNC_MS, help="what reading the step before back first adds")
    args = ap.parse_args()
    costs = tuple(float(x) for x in args.costs.split(",")) if args.costs else COSTS
    model, why = default_model.load()
    if model is None:
        sys.exit(f"the default model is not installed: {why}")

    def make():
        return Drafter(lookup=PromptLookup(max_n=args.max_n, min_n=args.min_n),
                       cost=CostModel(position_cost=args.position_cost, max_k=8, bandwidth_rows=args.budget,
                                      sync_cost=args.sync_cost, step_costs=() if args.line else STEP_COSTS))

    gate = f"the line of position_cost {args.position_cost}" if args.line else "the engine's table of steps"
    print(f"lookup n {args.max_n}..{args.min_n}, budget {args.budget} positions, gate cost {gate}, "
          f"sync_cost {args.sync_cost}; step costs {costs[:8]} ms ..., read-back +{args.sync_ms} ms")
    print(f"{'workload':<34} {'gate':>6} {'oracle':>7} {'steps off/on':>13} {'accept':>7}")
    for name, (pairs, slots) in workloads(model, args.gen, args.keep).items():
        off = without(pairs, slots, costs)
        on, c = replay(pairs, slots, make, costs, args.sync_ms)
        best = oracle(pairs, slots, make, costs, max(args.budget, 8))
        steps_off = sum(len(out) - 1 for _, out in pairs) if slots == 1 else max(len(out) - 1 for _, out in pairs)
        accept = c["accepted"] / c["drafted"] if c["drafted"] else 0.0
        print(f"{name:<34} {off / on:5.2f}x {off / best:6.2f}x {steps_off:>6}/{c['steps']:<6} {accept:7.2f}")


if __name__ == "__main__":
    main()
