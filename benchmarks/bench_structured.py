"""Structured output's cost: constrained rows against free rows in the same engine, side by side.

Each point runs ``--rows`` requests of ``--gen`` tokens at once (prompts of 32 random tokens,
prefix cache off), the points alternated, medians of ``--repeats``:

* ``free``: no constraint;
* ``json``: every row constrained by a JSON schema that cannot end within ``--gen`` tokens (an
  object holding a long list of short strings), so every row runs its full length;
* ``mixed``: half the rows free, half constrained: the free rows' own tokens/s beside the
  constrained rows' (a step with constrained rows first reads back the step in flight);
* ``1 free`` / ``1 json``: a lone request.

Then the host's side: the time to fill the masks of ``--rows`` matchers (one step's worth), and
the compile time of a few schemas, regexes and grammars.

    python benchmarks/bench_structured.py                    # SmolLM2-135M-Instruct, 32 rows
    python benchmarks/bench_structured.py --model PATH --rows 8 --gen 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model
from slotinfer.cli.bench import prompts_of
from slotinfer.engine.structured import Grammars, words

ENDLESS = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 40},
                                                      "minItems": 10_000}}, "required": ["notes"]}
COMPILED = {
    "json: person (3 fields)": {"json_schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "email": {"type": "string", "format": "email"}},
        "required": ["name", "age"]}},
    "json: order (nested, enums, 12 fields)": {"json_schema": {
        "type": "object", "required": ["id", "items", "status"],
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
                       "status": {"enum": ["new", "paid", "shipped", "returned"]},
                       "customer": {"type": "object", "properties": {
                           "name": {"type": "string"}, "vip": {"type": "boolean"},
                           "address": {"type": "object", "properties": {
                               "street": {"type": "string"}, "city": {"type": "string"},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
                       "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                           "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                           "price": {"type": "number"}}, "required": ["sku", "qty"]}}}}},
    "json: any object": {"json_schema": {"type": "object"}},
    "regex: ISO date": {"regex": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"},
    "choice: 3 labels": {"choice": ["positive", "negative", "neutral"]},
    "grammar: arithmetic (Lark)": {"grammar": 'start: expr\nexpr: term (("+" | "-") term)*\n'
                                              'term: factor (("*" | "/") factor)*\nfactor: NUMBER | "(" expr ")"\n'
                                              'NUMBER: /[0-9]+/'},
}


def run(model, specs, gen: int) -> list:
    """``specs``: one dict of constraint parameters per row; the rows' Completions."""
    prompts = prompts_of(model, len(specs), 32, seed=len(specs))
    with slotinfer.Inferencer(model, slots=len(specs), max_len=64 + gen, prefix_cache_bytes=0) as inf:
        for s in {str(s): s for s in specs}.values():  # compile the step variants and the grammars first
            inf.generate(prompts_of(model, 1, 32, seed=-1)[0], max_tokens=4, ignore_eos=True, **s)
        handles = [inf.submit(p, max_tokens=gen, ignore_eos=True, **s) for p, s in zip(prompts, specs)]
        return [h.result() for h in handles]


def per_request(results) -> float:
    return statistics.median(r.metrics["decode_tokens_per_s"] for r in results)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    model = slotinfer.load(a.model or default_model.path() or default_model.NAME)
    json_ = {"json_schema": ENDLESS}
    half = a.rows // 2
    points = {"free": [{}] * a.rows, "json": [json_] * a.rows, "mixed": [{}] * half + [json_] * (a.rows - half),
              "1 free": [{}], "1 json": [json_]}
    got = {k: [] for k in points}
    for _ in range(a.repeats):
        for name, specs in points.items():
            t0 = time.perf_counter()
            results = run(model, specs, a.gen)
            wall = time.perf_counter() - t0
            row = {"total": sum(len(r.tokens) for r in results) / wall, "each": per_request(results)}
            if name == "mixed":
                row["free rows, each"] = per_request(results[:half])
                row["json rows, each"] = per_request(results[half:])
            got[name].append(row)
    med = {k: {f: statistics.median(r[f] for r in rows) for f in rows[0]} for k, rows in got.items()}
    print(f"{model!r}, {a.rows} rows x {a.gen} tokens, medians of {a.repeats} (tokens/s; 'each' is a request's "
          "own decode rate)")
    print("| point | tokens/s (all rows, end to end) | each request | vs free |")
    print("|---|---:|---:|---:|")
    for k in ("free", "json", "mixed", "1 free", "1 json"):
        base = med["1 free" if k.startswith("1 ") else "free"]["each"]
        print(f"| {k} | {med[k]['total']:.1f} | {med[k]['each']:.1f} | {med[k]['each'] / base:.2f}x |")
    m = med["mixed"]
    print(f"| mixed: free rows | | {m['free rows, each']:.1f} | {m['free rows, each'] / med['free']['each']:.2f}x |")
    print(f"| mixed: json rows | | {m['json rows, each']:.1f} | {m['json rows, each'] / med['free']['each']:.2f}x |")

    grammars = Grammars(model.tokenizer, model.config.vocab_size, model.eos_ids)
    t0 = time.perf_counter()
    grammars.tokenizer
    print(f"\nthe model's grammar tokenizer, built once: {1e3 * (time.perf_counter() - t0):.0f} ms")
    print("| constraint | compile (ms) | one mask (µs) |")
    print("|---|---:|---:|")
    mask = np.full((a.rows, words(model.config.vocab_size)), -1, dtype=np.int32)
    for name, params in COMPILED.items():
        t0 = time.perf_counter()
        c = grammars.constraint({k: (slotinfer.request.check(params)[k]) for k in params})
        compile_ms = 1e3 * (time.perf_counter() - t0)
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            c.fill(mask, 0)
            ts.append(time.perf_counter() - t0)
        print(f"| {name} | {compile_ms:.1f} | {1e6 * statistics.median(ts):.0f} |")
    cs = [grammars.constraint({"json_schema": slotinfer.request.check(json_)["json_schema"]}) for _ in range(a.rows)]
    for c in cs:  # into a string, where the most tokens are allowed
        for t in model.tokenizer.encode('{"notes":["a', add_special_tokens=False):
            c.advance(t)
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        for i, c in enumerate(cs):
            c.fill(mask, i)
        ts.append(time.perf_counter() - t0)
    print(f"\nmasks of {a.rows} rows inside a JSON string (one step's host work): "
          f"{1e3 * statistics.median(ts):.2f} ms")


if __name__ == "__main__":
    main()
