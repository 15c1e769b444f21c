"""How much of a real model's greedy output the draft sources would have drafted right.

Generates each prompt of ``benchmarks/data/spec_prompts.jsonl`` greedily (``--gen`` tokens), then
replays the output as speculative decoding would see it: at each verify pass a source proposes
``k`` tokens from the row's state, the pass takes the right prefix of the draft plus the model's
own next token, and the row advances by that many.  Per prompt set and ``k``:

* ``accept``: accepted / drafted tokens;
* ``tok/pass``: output tokens per verify pass (1.0 = no speculation);
* ``drafted``: share of passes that carried a draft;
* ``model x``: the cost model's speed-up, output tokens / sum over passes of ``1 + c k``
  (``slotinfer.spec.gate``, ``c = --position-cost``): an estimate, not a measured rate.

Sources: ``lookup`` (the row's own prompt and output), ``pool`` (a suffix pool shared by the set's
rows, one salt, the rows run one after another), ``lookup+pool`` (lookup first), each drafting
whenever it has something; ``gated`` is the :class:`~slotinfer.spec.Drafter` with its per-row gate
and cost model, one row at a time; ``oracle`` drafts exactly the right prefix of lookup+pool's
draft, the ceiling of any gate over these sources.  Then the JSON rewrites once more, each
constrained by a schema of its document's shape (keys, order, types), with forced tokens first.
Then the host cost of a call on a context of thousands of tokens.

    python benchmarks/spec_acceptance.py                  # SmolLM2-135M-Instruct, 128 tokens
    python benchmarks/spec_acceptance.py --gen 64 --ks 4
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model
from slotinfer.spec import CostModel, Drafter, ForcedTokens, PromptLookup, SuffixPool

DATA = Path(__file__).resolve().parent / "data" / "spec_prompts.jsonl"


def generate(model, rows, gen, keep=None):
    """(prompt ids, greedy output ids) per row; ``keep``: a JSON file that holds them between runs."""
    if keep and Path(keep).is_file():
        saved = json.loads(Path(keep).read_text())
        if saved["gen"] == gen and saved["messages"] == [r["messages"] for r in rows]:
            return [tuple(p) for p in saved["pairs"]]
    prompts = [model.chat_prompt(messages=r["messages"]) for r in rows]
    t = time.perf_counter()
    outs = model.batch_generate(prompts, max_tokens=gen, temperature=0.0)
    print(f"generated {len(rows)} prompts x {gen} tokens in {time.perf_counter() - t:.1f} s")
    pairs = [(model.encode_prompt(p), o.tokens) for p, o in zip(prompts, outs)]
    if keep:
        Path(keep).write_text(json.dumps({"gen": gen, "messages": [r["messages"] for r in rows], "pairs": pairs}))
    return pairs


def replay(pairs, k, source, cost, max_n=4, min_n=2, pool_n=3):
    """Totals over one set: tokens, passes, drafted, accepted, passes with a draft, modelled cost."""
    lookup, pool = PromptLookup(max_n=max_n, min_n=min_n), SuffixPool(n=pool_n)
    totals = defaultdict(float)
    for prompt, out in pairs:
        drafter = Drafter(sources=[lookup, pool], lookup=lookup, pool=pool, cost=cost)
        row = drafter.row(prompt)
        pos = 0
        while pos < len(out):
            if source == "gated":
                draft = drafter.step([row])[0][:k]
            elif source in ("lookup+pool", "oracle"):
                draft = lookup.propose(row, k) or pool.propose(row, k)
            else:
                draft = (lookup if source == "lookup" else pool).propose(row, k)
            right = 0
            while right < len(draft) and pos + right < len(out) and draft[right] == out[pos + right]:
                right += 1
            if source == "oracle":  # a gate that knew: the right prefix alone, nothing when it is empty
                draft = draft[:right]
            drafter.append(row, out[pos:pos + right + 1])
            pos += right + 1
            totals["passes"] += 1
            totals["drafted"] += len(draft)
            totals["accepted"] += right
            totals["with"] += bool(draft)
            totals["cost"] += cost.step_cost(1 + len(draft))
        drafter.finish(row)
        totals["tokens"] += len(out)
    return totals


def shape(value):
    """A JSON schema that fixes a document's keys, their order and the types of its values."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: shape(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, list):
        return {"type": "array", "items": shape(value[0]) if value else {}}
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, (int, float)):
        return {"type": "number"}
    return {"type": "string"}


def constrained(model, rows, gen, keep=None):
    """The JSON rewrites again, each constrained by its document's shape: (prompt, output, schema)."""
    rows = [r for r in rows if r["kind"] == "json-rewrite"]
    schemas = [json.dumps(shape(json.loads(r["messages"][-1]["content"].split("\n\n", 1)[1]))) for r in rows]
    if keep and Path(keep).is_file():
        saved = json.loads(Path(keep).read_text())
        if saved.get("json") and saved["json"]["schemas"] == schemas and saved["gen"] == gen:
            return [tuple(t) for t in saved["json"]["triples"]]
    t = time.perf_counter()
    triples = []
    for r, schema in zip(rows, schemas):
        prompt = model.chat_prompt(messages=r["messages"])
        out = model.generate(prompt, max_tokens=gen, temperature=0.0, json_schema=schema)
        triples.append((model.encode_prompt(prompt), out.tokens, schema))
    print(f"generated {len(rows)} constrained prompts in {time.perf_counter() - t:.1f} s")
    if keep:
        saved = json.loads(Path(keep).read_text())
        saved["json"] = {"schemas": schemas, "triples": triples}
        Path(keep).write_text(json.dumps(saved))
    return triples


def replay_constrained(model, triples, k, which, cost):
    """``replay`` for constrained rows: the matcher follows the output; sources by ``which``."""
    totals = defaultdict(float)
    pool = SuffixPool()
    for prompt, out, schema in triples:
        matcher = model.grammars.constraint({"json_schema": schema}).matcher
        lookup = PromptLookup()
        sources = {"forced": [ForcedTokens()], "forced+lookup+pool": [ForcedTokens(), lookup, pool],
                   "gated": [ForcedTokens(), lookup, pool]}[which]
        drafter = Drafter(sources=sources, lookup=lookup, pool=pool, cost=cost)
        row = drafter.row(prompt, matcher=matcher)
        pos = 0
        while pos < len(out):
            if which == "gated":
                draft = drafter.step([row])[0][:k]
            else:
                found = drafter.propose(row, k)
                draft = found[1] if found else []
            right = 0
            while right < len(draft) and pos + right < len(out) and draft[right] == out[pos + right]:
                right += 1
            taken = out[pos:pos + right + 1]
            drafter.append(row, taken)
            for tok in taken:
                if not matcher.is_stopped():
                    matcher.consume_token(tok)
            pos += right + 1
            totals["passes"] += 1
            totals["drafted"] += len(draft)
            totals["accepted"] += right
            totals["with"] += bool(draft)
            totals["cost"] += cost.step_cost(1 + len(draft))
        drafter.finish(row)
        totals["tokens"] += len(out)
    return totals


def row_text(t):
    accept = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
    return (f"{accept:7.2f} {t['tokens'] / t['passes']:9.2f} {t['with'] / t['passes']:8.2f} "
            f"{t['tokens'] / t['cost']:8.2f}")


def host_cost(pairs, k=8, length=4096):
    """Microseconds a call of each source takes on a row of ``length`` tokens of real text."""
    tokens = [t for prompt, out in pairs for t in prompt + out]
    tokens = (tokens * (length // max(len(tokens), 1) + 1))[:length]
    lookup, pool = PromptLookup(), SuffixPool()
    t = time.perf_counter()
    drafter = Drafter(sources=[lookup, pool], lookup=lookup, pool=pool)
    row = drafter.row(tokens[: length // 2])
    admit = time.perf_counter() - t
    calls, spent = defaultdict(int), defaultdict(float)
    for tok in tokens[length // 2:]:
        for name, fn in (("lookup.propose", lambda: lookup.propose(row, k)),
                         ("pool.propose", lambda: pool.propose(row, k)),
                         ("drafter.step", lambda: drafter.step([row])),
                         ("drafter.append", lambda: drafter.append(row, [tok]))):
            t = time.perf_counter()
            fn()
            spent[name] += time.perf_counter() - t
            calls[name] += 1
    print(f"\nhost cost on a row of {length // 2}..{length} tokens (k={k}): admitting {length // 2} tokens "
          f"{admit * 1e3:.1f} ms; pool of {len(pool)} entries (~{pool.nbytes() / 2**20:.1f} MiB)")
    for name in spent:
        print(f"  {name:16s} {spent[name] / calls[name] * 1e6:7.1f} us a call")


PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "city", "tags"], "additionalProperties": False}


def forced_cost(model):
    """Forced tokens along one JSON document of a 4-field schema: their share and a call's cost."""
    drafter = Drafter()
    row = drafter.row([0], matcher=model.grammars.constraint({"json_schema": json.dumps(PERSON)}).matcher)
    doc = json.dumps({"name": "Alice Smith", "age": 31, "city": "Paris", "tags": ["a", "bb"]}, separators=(",", ":"))
    tokens = model.tokenizer.encode(doc, add_special_tokens=False)
    forced, spent, drafted, same = drafter.sources[0], 0.0, 0, 0
    for i, tok in enumerate(tokens):
        t = time.perf_counter()
        draft = forced.propose(row, 8)
        spent += time.perf_counter() - t
        drafted += bool(draft)
        same += bool(draft) and draft == tokens[i:i + len(draft)]
        row.matcher.consume_token(tok)
    print(f"  forced.propose   {spent / len(tokens) * 1e6:7.1f} us a call; along {doc} ({len(tokens)} tokens) "
          f"{drafted} positions have forced tokens, {same} of them the document's own tokenization")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--keep", default=None, help="a JSON file to keep the generations in between runs")
    ap.add_argument("--max-n", type=int, default=PromptLookup().max_n)
    ap.add_argument("--min-n", type=int, default=PromptLookup().min_n)
    ap.add_argument("--pool-n", type=int, default=SuffixPool().n)
    ap.add_argument("--position-cost", type=float, default=CostModel().position_cost)
    args = ap.parse_args()
    model = slotinfer.load(args.model or default_model.path())
    sizes = {"max_n": args.max_n, "min_n": args.min_n, "pool_n": args.pool_n}
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    pairs = generate(model, rows, args.gen, args.keep)
    sets = defaultdict(list)
    for r, pair in zip(rows, pairs):
        sets[r["set"]].append(pair)
        if r["kind"] != r["set"]:
            sets[f"  {r['set']}:{r['kind']}"].append(pair)
    ks = [int(k) for k in args.ks.split(",")]
    print(f"\nc = {args.position_cost} (cost of a verified position, a fraction of a one-row step)")
    print(f"{'set':24s} {'source':12s} {'k':>2s} {'accept':>7s} {'tok/pass':>9s} {'drafted':>8s} {'model x':>8s}")
    for name in sorted(sets, key=lambda s: (s.strip().split(":")[0], s.startswith(" "), s)):
        for source in ("lookup", "pool", "lookup+pool", "gated", "oracle"):
            if name.startswith(" ") and source in ("lookup", "pool"):
                continue
            for k in ks:
                cost = CostModel(position_cost=args.position_cost, max_k=k)
                t = replay(sets[name], k, source, cost, **sizes)
                print(f"{name:24s} {source:12s} {k:2d} {row_text(t)}")
    triples = constrained(model, rows, args.gen, args.keep)
    print(f"\nthe JSON rewrites constrained by their documents' shape ({sum(len(t[1]) for t in triples)} tokens)")
    for which in ("forced", "forced+lookup+pool", "gated"):
        for k in ks:
            t = replay_constrained(model, triples, k, which, CostModel(position_cost=args.position_cost, max_k=k))
            print(f"{'json (constrained)':24s} {which:18s} {k:2d} {row_text(t)}")
    host_cost(pairs)
    forced_cost(model)


if __name__ == "__main__":
    main()
