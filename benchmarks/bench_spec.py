"""Speculative decoding on SmolLM2-135M-Instruct Q4_1: the verify step's cost, and decode tokens/s
with speculation on against off, side by side.

    python benchmarks/bench_spec.py                 # calibration, then the workloads
    python benchmarks/bench_spec.py --calibrate     # the verify step's cost only
    python benchmarks/bench_spec.py --calibrate-rows 4                  # ... with 4 slots sharing the drafts
    python benchmarks/bench_spec.py --skip-calibration --only "4 rows" --budgets 4,8,12,16

**Calibration.**  One slot at a context of 256 tokens verifies ``n - 1`` drafted tokens (``n`` rows
as positions) for ``n`` = 1..16; ``c(n) = (t(n) / t(1) - 1) / (n - 1)`` is an extra verified
position's cost as a fraction of a one-row step (the gate's ``position_cost``).

**Workloads** (``benchmarks/data/spec_prompts.jsonl``, chat-rendered, greedy, ``--gen`` tokens):
single stream on copy-heavy prompts, 4 live rows on copy-heavy prompts, 32 live rows on
copy-heavy prompts, single stream on prompts with nothing to copy, and single-stream JSON rewrites
constrained by their documents' shape.  Each workload keeps one engine per mode (its compiled
steps warmed by a first round that is not counted) and a fresh drafter each run (the suffix pool
would otherwise draft from the previous round's identical output).  Each round runs every mode
(off, then on with each ``--budgets`` entry as the most positions a step verifies), starting one
mode further on than the round before; the figure is the median over rounds of each round's
on/off ratio, as the machine is shared.  Every run's outputs are checked equal between the modes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import slotinfer  # noqa: E402,F401  before MLX: slotinfer swaps in its BLAS
import mlx.core as mx  # noqa: E402
from slotinfer import default_model  # noqa: E402
from slotinfer.engine.engine import BANDWIDTH_ROWS, POSITION_COST, STEP_COSTS, SYNC_COST, Engine  # noqa: E402
from slotinfer.engine.decoder import row_bucket  # noqa: E402
from slotinfer.engine.verify import EXACT_ROWS  # noqa: E402
from slotinfer.spec import CostModel, Drafter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_acceptance import shape  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "spec_prompts.jsonl"


def calibrate(model, repeats=30, context=256):
    eng = Engine(model, slots=1, max_len=context + 64, speculative="ngram", draft_tokens=16)
    item = eng.make_item(list(range(10, 10 + context)), max_tokens=40, ignore_eos=True)
    eng.add(item)
    for _ in range(3):
        eng.step()
    L = int(eng.table.lengths[0])
    eng.table.grow([0], [L + 17])
    times = {}
    for n in range(1, 17):
        groups = [(0, [100 + i for i in range(n - 1)])]
        for _ in range(3):
            mx.eval(eng.verifier.step(eng.tokens, groups, eng.gen, eng.rows)[0])
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval(eng.verifier.step(eng.tokens, groups, eng.gen, eng.rows)[0])
            ts.append(time.perf_counter() - t)
        times[n] = statistics.median(ts)
    base = times[1]
    cs = {n: (times[n] / base - 1) / (n - 1) for n in times if n > 1}
    return times, cs


class _Never:
    """A draft source that never drafts, with its gate open: every step is read back first."""

    name, prior = "never", (50.0, 1.0)

    def propose(self, row, k):
        return []


def calibrate_sync(model, rounds=7, steps=48, context=256):
    """One row at ``context`` tokens decoding ``steps`` tokens, its steps pipelined (speculation off)
    against each read back before the next is issued (speculation on, a gate open, no draft ever):
    the median over alternated rounds of the ms a step of each, and the gate's ``sync_cost``."""
    engines = {False: Engine(model, slots=1, max_len=context + steps + 8),
               True: Engine(model, slots=1, max_len=context + steps + 8, speculative="ngram", sync_cost=0.0)}
    per = {False: [], True: []}
    for r in range(rounds + 1):
        for waits in ((False, True) if r % 2 else (True, False)):
            eng = engines[waits]
            if waits:
                eng.drafter = Drafter(sources=[_Never()], cost=CostModel(position_cost=POSITION_COST,
                                                                         bandwidth_rows=BANDWIDTH_ROWS))
            item = eng.make_item(list(range(10, 10 + context)), max_tokens=steps, ignore_eos=True)
            eng.add(item)
            while not item.handle.done():  # the prompt, then its first token
                eng.step()
                if len(item.tokens) >= 1:
                    break
            t, n = time.perf_counter(), len(item.tokens)
            eng.run_until_done()
            if r:
                per[waits].append((time.perf_counter() - t) / (len(item.tokens) - n))
    pipelined, waited = statistics.median(per[False]), statistics.median(per[True])
    return pipelined, waited, waited / pipelined - 1


def calibrate_rows(model, live=4, most=16, repeats=20, context=256):
    """A step of ``live`` slots at ``context`` tokens each verifying ``P - live`` drafted tokens in all
    (handed out one per slot in turn), for ``P`` = ``live`` .. ``most``: ms, and cost against ``P = live``."""
    eng = Engine(model, slots=live, max_len=context + 64, speculative="ngram", draft_tokens=8)
    for s in range(live):
        eng.add(eng.make_item(list(range(10 + s, 10 + s + context)), max_tokens=40, ignore_eos=True))
    while len(eng.items.running()) < live:
        eng.step()
    for s in range(live):
        eng.table.grow([s], [int(eng.table.lengths[s]) + most])
    plans = {}
    for total in range(live, most + 1):
        ks = [(total - live) // live + (s < (total - live) % live) for s in range(live)]
        plans[total] = [(s, [100 + i for i in range(k)]) for s, k in enumerate(ks)]
        for _ in range(3):
            mx.eval(eng.verifier.step(eng.tokens, plans[total], eng.gen, eng.rows)[0])
    samples = {total: [] for total in plans}
    for _ in range(repeats):  # rounds over every P in turn: load that comes and goes hits them alike
        for total, groups in plans.items():
            t = time.perf_counter()
            mx.eval(eng.verifier.step(eng.tokens, groups, eng.gen, eng.rows)[0])
            samples[total].append(time.perf_counter() - t)
    times = {total: statistics.median(ts) for total, ts in samples.items()}
    return times


def load_sets(model, gen):
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    copy = [r for r in rows if r["set"] == "copy"]
    open_ = [r for r in rows if r["set"] == "open"]
    by_kind = {}
    for r in copy:
        by_kind.setdefault(r["kind"], []).append(r)
    two_each = [r for rs in by_kind.values() for r in rs[:2]]
    one_each = [rs[0] for rs in by_kind.values()]

    def render(rs, **params):
        return [(model.encode_prompt(model.chat_prompt(messages=r["messages"])), dict(max_tokens=gen, **params))
                for r in rs]

    json_rows = [r for r in copy if r["kind"] == "json-rewrite"][:4]
    constrained = [(model.encode_prompt(model.chat_prompt(messages=r["messages"])),
                    dict(max_tokens=gen, json_schema=json.dumps(shape(json.loads(
                        r["messages"][-1]["content"].split("\n\n", 1)[1])))))
                   for r in json_rows]
    return {
        "copy, 1 stream": (1, render(two_each)),
        "copy, 4 rows": (4, render(one_each)),  # as many prompts as slots: all live at once
        "copy, 32 rows": (32, render(copy)),
        "open, 1 stream": (1, render(open_[:4])),
        "JSON constrained, 1 stream": (1, constrained),
    }


def run(engine, reqs, draft_tokens, position_cost, bandwidth_rows, sync_cost=SYNC_COST, line=False):
    """``line``: the gate's cost is the line of ``position_cost``, not the engine's table of steps."""
    if engine.speculative:
        engine.drafter = Drafter(cost=CostModel(position_cost=position_cost, max_k=draft_tokens,
                                                bandwidth_rows=bandwidth_rows, sync_cost=sync_cost,
                                                step_costs=() if line else STEP_COSTS))
    for k in ("steps", "spec_passes", "spec_drafted", "spec_accepted", "decode_tokens"):
        engine.counters[k] = 0
    items = [engine.make_item(ids, **params) for ids, params in reqs]
    t0 = time.perf_counter()
    for it in items:
        engine.add(it)
    engine.run_until_done()
    wall = time.perf_counter() - t0
    outs = [it.handle.result(0) for it in items]
    slots = engine.slots
    if slots == 1:  # one at a time: each request's own decode time
        tokens = sum(len(o.tokens) - 1 for o in outs)
        seconds = sum((len(o.tokens) - 1) / o.metrics["decode_tokens_per_s"] for o in outs
                      if o.metrics["decode_tokens_per_s"])
    else:  # as many prompts as slots, all live at once: decode from the last first token on
        tokens = sum(len(o.tokens) for o in outs) - len(outs)
        seconds = wall - max(o.metrics["time_to_first_token_s"] for o in outs)
    c = dict(engine.counters)
    return tokens / seconds, [o.tokens for o in outs], c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate", action="store_true", help="the verify step's cost only")
    ap.add_argument("--rounds", type=int, default=3, help="counted rounds (after one warm-up round)")
    ap.add_argument("--gen", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--position-cost", type=float, default=POSITION_COST)
    ap.add_argument("--bandwidth-rows", type=int, default=BANDWIDTH_ROWS,
                    help="positions per step (rows and drafts) past which nobody drafts")
    ap.add_argument("--sync-cost", type=float, default=SYNC_COST,
                    help="what a step read back first loses, as a fraction of a one-row step (the gate's sync_cost)")
    ap.add_argument("--sync-costs", help="comma-separated sync costs to run side by side in each round, each against off")
    ap.add_argument("--only", help="run the workloads whose name contains this")
    ap.add_argument("--skip-calibration", action="store_true", help="the workloads only")
    ap.add_argument("--budgets", help="comma-separated positions-per-step budgets (bandwidth_rows) to run "
                                      "side by side in each round, each against off; a budget ending in L "
                                      "(4L) prices steps by the line of --position-cost, not the engine's table")
    ap.add_argument("--calibrate-rows", type=int, metavar="LIVE",
                    help="the verify step's cost with LIVE slots and drafts shared among them, then stop")
    args = ap.parse_args()
    model, why = default_model.load()
    if model is None:
        sys.exit(f"the default model is not installed: {why}")
    if args.calibrate_rows:
        times = calibrate_rows(model, args.calibrate_rows)
        base = times[args.calibrate_rows]
        print(f"verify step, {args.calibrate_rows} slots at 256 tokens: positions, row bucket, ms, cost against "
              f"{args.calibrate_rows} positions")
        for n, t in times.items():
            rows = n if n <= EXACT_ROWS else row_bucket(n, args.calibrate_rows * 9)
            print(f"  {n:>2} {rows:>3} {t * 1e3:7.2f}  {t / base:.2f}")
        return
    times, cs = calibrate(model) if not args.skip_calibration else ({}, {0: 0.0})
    print("verify step, 1 slot at 256 tokens: rows, ms, c(n)")
    for n, t in times.items():
        print(f"  {n:>2} {t * 1e3:7.2f}  {cs.get(n, 0.0):.3f}")
    if not args.skip_calibration:
        pipelined, waited, sync = calibrate_sync(model)
        print(f"one row at 256 tokens: {pipelined * 1e3:.2f} ms a step pipelined, {waited * 1e3:.2f} ms read back "
              f"first: sync_cost {sync:.3f}", flush=True)
    print(f"median c over 2..16 rows: {statistics.median(cs.values()):.3f}", flush=True)
    if args.calibrate:
        return
    sets = load_sets(model, args.gen)
    print(f"\n{args.rounds} counted rounds, gen {args.gen}, draft_tokens {args.draft_tokens}, "
          f"position_cost {args.position_cost}, bandwidth_rows {args.bandwidth_rows}, sync_cost {args.sync_cost}")
    print(f"{'workload':<28} {'off tok/s':>9} {'on tok/s':>9} {'ratio':>6} {'accept':>6} {'tok/pass':>8} "
          f"{'steps off/on':>12}")
    budgets = [(int(b.rstrip("L")), b.endswith("L")) for b in args.budgets.split(",")] if args.budgets \
        else [(args.bandwidth_rows, False)]
    syncs = [float(x) for x in args.sync_costs.split(",")] if args.sync_costs else [args.sync_cost]
    variants = [(b, line, x) for b, line in budgets for x in syncs]  # each against off
    for name, (slots, reqs) in sets.items():
        if args.only and args.only not in name:
            continue
        max_len = max(len(ids) for ids, _ in reqs) + args.gen + 8
        engines = {m: Engine(model, slots=slots, max_len=max_len, prefill_tokens=512,
                             speculative="ngram" if m else None, draft_tokens=args.draft_tokens,
                             position_cost=args.position_cost) for m in (False, True)}
        modes = [None, *variants]  # None: off; else on, with (most positions a step, line, sync cost)
        ratios = {v: [] for v in variants}
        rates = {m: [] for m in modes}
        steps, stats = {}, {}
        for r in range(args.rounds + 1):
            got = {}
            for m in modes[r % len(modes):] + modes[:r % len(modes)]:  # each round starts one further on
                budget, line, sync = m or (1, False, 0.0)
                rate, outs, c = run(engines[m is not None], reqs, args.draft_tokens, args.position_cost, budget, sync,
                                    line)
                got[m] = (rate, outs)
                steps[m], stats[m] = c["steps"], c
            if any(got[m][1] != got[None][1] for m in variants):
                sys.exit(f"{name}: outputs differ with speculation on")
            if r == 0:
                continue  # warm-up: compiled steps
            for m in modes:
                rates[m].append(got[m][0])
            for v in variants:
                ratios[v].append(got[v][0] / got[None][0])
        for v in variants:
            st = stats[v]
            acc = st["spec_accepted"] / st["spec_drafted"] if st["spec_drafted"] else 0.0
            per = (st["spec_accepted"] + st["spec_passes"]) / st["spec_passes"] if st["spec_passes"] else 1.0
            label = (name + (f", budget {v[0]}" + (" line" if v[1] else "") if len(budgets) > 1 else "")
                     + (f", sync {v[2]}" if len(syncs) > 1 else ""))
            print(f"{label:<28} {statistics.median(rates[None]):9.1f} {statistics.median(rates[v]):9.1f} "
                  f"{statistics.median(ratios[v]):6.2f} {acc:6.2f} {per:8.2f} {steps[None]:>5}/{steps[v]:<6} "
                  f"ratios {', '.join(f'{x:.2f}' for x in ratios[v])}", flush=True)


if __name__ == "__main__":
    main()
