"""Valid-output rate of structured output through the server and the ``openai`` client.

Starts ``slotinfer serve`` on the default model (16 slots; ``--url`` drives a running server
instead) and sends ``--prompts`` chat requests per schema, greedy and sampled, all at once, with
``response_format`` ``json_schema`` (strict).  Each answer that ends with ``finish_reason``
``"stop"`` is parsed and validated against its schema with ``jsonschema``; answers cut by
``max_tokens`` are counted apart.  Also one tool call per schema with ``tool_choice`` naming the
function, checked the same way.

    python benchmarks/bench_structured_serve.py
    python benchmarks/bench_structured_serve.py --url http://127.0.0.1:8000/v1 --served-model NAME
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time

import jsonschema
import openai

from slotinfer import default_model

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
               "properties": {"name": {"type": "string", "maxLength": 40},
                              "age": {"type": "integer", "minimum": 0, "maximum": 130},
                              "city": {"type": "string", "maxLength": 40}}},
    "sentiment": {"type": "object", "additionalProperties": False, "required": ["label", "confidence"],
                  "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                 "confidence": {"type": "number", "minimum": 0, "maximum": 1}}},
    "todo": {"type": "object", "additionalProperties": False, "required": ["title", "steps"],
             "properties": {"title": {"type": "string", "maxLength": 60},
                            "steps": {"type": "array", "minItems": 1, "maxItems": 4,
                                      "items": {"type": "string", "maxLength": 50}}}},
    "event": {"type": "object", "additionalProperties": False, "required": ["event", "date", "online"],
              "properties": {"event": {"type": "string", "maxLength": 50},
                             "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                             "online": {"type": "boolean"},
                             "attendees": {"type": "array", "maxItems": 3,
                                           "items": {"type": "string", "maxLength": 30}}}},
}
QUESTIONS = ["Describe someone you might meet in Paris.", "How did the customer feel: 'The food was cold.'",
             "Plan a picnic.", "Invent a conference for next spring.", "Tell me about a famous scientist.",
             "Was this review happy: 'Best purchase ever!'", "Make a plan to learn the guitar.",
             "Announce a birthday party."]


async def ask(client, model, schema_name, question, sampled: bool, max_tokens: int):
    r = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question + " Answer in JSON."}], max_tokens=max_tokens,
        temperature=0.8 if sampled else 0.0, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": schema_name, "strict": True,
                                                                "schema": SCHEMAS[schema_name]}})
    return r.choices[0].finish_reason, r.choices[0].message.content


async def call(client, model, schema_name, question, max_tokens: int):
    tool = {"type": "function", "function": {"name": f"save_{schema_name}", "description": "Save the answer.",
                                             "parameters": SCHEMAS[schema_name]}}
    r = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, tools=[tool],
        tool_choice={"type": "function", "function": {"name": tool["function"]["name"]}})
    c = r.choices[0]
    calls = c.message.tool_calls or []
    return c.finish_reason, [(t.function.name, t.function.arguments) for t in calls]


def valid(schema_name, text) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[schema_name])
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


async def run(url, model, prompts: int, max_tokens: int):
    client = openai.AsyncOpenAI(base_url=url, api_key="none", timeout=3600)
    jobs = [(s, q, sampled) for s in SCHEMAS for q in QUESTIONS[:prompts] for sampled in (False, True)]
    t0 = time.perf_counter()
    answers = await asyncio.gather(*(ask(client, model, s, q, sampled, max_tokens) for s, q, sampled in jobs))
    wall = time.perf_counter() - t0
    tally = collections.Counter()
    for (s, _, sampled), (reason, text) in zip(jobs, answers):
        mode = "sampled" if sampled else "greedy"
        tally[mode, "sent"] += 1
        tally[mode, reason] += 1
        if reason == "stop":
            tally[mode, "valid"] += valid(s, text)
    calls = await asyncio.gather(*(call(client, model, s, QUESTIONS[i], max_tokens)
                                   for i, s in enumerate(SCHEMAS)))
    good_calls = sum(reason == "tool_calls" and len(cs) == 1 and cs[0][0] == f"save_{s}" and valid(s, cs[0][1])
                     for s, (reason, cs) in zip(SCHEMAS, calls))
    print(f"{len(jobs)} requests over {len(SCHEMAS)} schemas, all at once, max_tokens {max_tokens}: {wall:.1f} s")
    print("| mode | sent | finished (stop) | valid of finished | cut by max_tokens |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("greedy", "sampled"):
        done = tally[mode, "stop"]
        print(f"| {mode} | {tally[mode, 'sent']} | {done} | {tally[mode, 'valid']}/{done} "
              f"({100 * tally[mode, 'valid'] / max(done, 1):.0f}%) | {tally[mode, 'length']} |")
    print(f"\nforced tool calls (tool_choice names the function): {good_calls}/{len(SCHEMAS)} parse, name the "
          "function and validate")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="an OpenAI-compatible server's /v1 URL (default: start slotinfer serve)")
    ap.add_argument("--served-model", default="bench")
    ap.add_argument("--prompts", type=int, default=8, help="questions per schema (each greedy and sampled)")
    ap.add_argument("--max-tokens", type=int, default=160)
    a = ap.parse_args()
    server, url = None, a.url
    if url is None:
        from slotinfer.cli.bench_serve import ServerProcess

        server = ServerProcess(default_model.path(), 16, 1024)
        url = server.url + "/v1"
    try:
        asyncio.run(run(url, a.served_model, a.prompts, a.max_tokens))
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    main()
