"""Valid-output rate of constrained requests through the server and the official ``openai`` client.

Serves a model (SmolLM2-135M-Instruct by default) in-process and sends, all at once so they share
decode steps, ``--per`` requests for each of four ``response_format`` JSON schemas and two forced
tool calls, half greedy (each with its own question) and half sampled (temperature 1, seeded).
A reply is valid when it finished by itself and parses: JSON that ``jsonschema`` validates, or
tool calls whose arguments validate against their function's parameters.

    python benchmarks/bench_valid.py                   # SmolLM2-135M-Instruct, 16 requests per case
    python benchmarks/bench_valid.py --model PATH --per 8
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model
from slotinfer.serve import build_app
from slotinfer.serve.background import serving

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40}}, "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["id", "status", "items"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "tags": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "string", "maxLength": 16}},
        "score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["tags", "score"],
        "additionalProperties": False},
    "address": {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 30},
        "geo": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                 "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"], "additionalProperties": False},
        "verified": {"type": "boolean"}}, "required": ["city", "geo", "verified"], "additionalProperties": False},
}
TOOLS = {
    "weather": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
            "additionalProperties": False}}}],
    "search": [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query"], "additionalProperties": False}}}],
}
QUESTIONS = ["Tell me about Alice, 31.", "Describe an order of two books.", "Summarise: the film was great.",
             "Where is the Eiffel Tower?", "What is the weather in Oslo?", "Find papers on batching.",
             "Who is Bob?", "Give me a record.", "Answer in JSON.", "What time is it in Tokyo?",
             "Describe a shop order.", "List three tags for a cooking blog.", "Where do you live?",
             "Look up the population of Rome.", "Make up an address.", "Give me an example."]


def one(client, name, kind, i, sampled, max_tokens):
    kw = dict(model="m", messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
              max_tokens=max_tokens, temperature=1.0 if sampled else 0.0, seed=i if sampled else None)
    if kind == "json":
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                        "strict": True}}
    else:
        kw.update(tools=TOOLS[name], tool_choice="required", parallel_tool_calls=False)
    try:
        c = client.chat.completions.create(**kw).choices[0]
    except openai.APIStatusError as e:
        return f"HTTP {e.status_code}"
    except openai.APITimeoutError:
        return "timed out"
    if c.finish_reason not in ("stop", "tool_calls"):
        return c.finish_reason
    try:
        if kind == "json":
            jsonschema.validate(json.loads(c.message.content), SCHEMAS[name])
        else:
            params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS[name]}
            calls = c.message.tool_calls or []
            if not calls:
                return "no call"
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    except (ValueError, jsonschema.ValidationError, KeyError) as e:
        return f"invalid: {type(e).__name__}"
    return "valid"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--per", type=int, default=16, help="requests per case, half greedy and half sampled")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    model = slotinfer.load(args.model or default_model.path())
    cases = [(n, "json") for n in SCHEMAS] + [(n, "tools") for n in TOOLS]
    jobs = [(name, kind, i, i % 2 == 1) for name, kind in cases for i in range(args.per)]
    with slotinfer.Inferencer(model, slots=args.slots, max_len=2048, max_queue=len(jobs)) as inf, \
            serving(build_app(inf, served_model_name="m")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda j: one(client, *j, args.max_tokens), jobs))
        wall = time.perf_counter() - t0
    print(f"{'case':<16}{'greedy valid':>14}{'sampled valid':>15}  other outcomes")
    for name, kind in cases:
        mine = [(r, s) for (n, k, _, s), r in zip(jobs, results) if (n, k) == (name, kind)]
        g = [r for r, s in mine if not s]
        s = [r for r, s_ in mine if s_]
        other = sorted({r for r, _ in mine if r != "valid"})
        print(f"{kind + ':' + name:<16}{g.count('valid'):>8}/{len(g):<5}{s.count('valid'):>9}/{len(s):<5}  "
              f"{', '.join(other) or '-'}")
    valid = results.count("valid")
    print(f"all: {valid}/{len(results)} valid ({100 * valid / len(results):.1f}%), {wall:.1f} s for "
          f"{len(results)} concurrent requests in {args.slots} slots")


if __name__ == "__main__":
    main()
