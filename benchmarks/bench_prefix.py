"""Prefix reuse through an OpenAI-compatible server: time to first token on the traffic that repeats itself.

Two workloads, streamed through ``/v1/chat/completions`` as a chat client sends them:

* ``shared``: one ~1,000-token system prompt and 24 different questions, 4 clients in a
  closed loop (6 questions each), 8 new tokens each.  Before it, ``cold``: the same-sized
  prompt with a system prompt no request has sent (3 of them, one at a time), the TTFT a
  cache cannot help;
* ``chat``: 4 conversations of 6 turns at once, each turn resending the whole history with the
  model's answers, 24 new tokens each; TTFT per turn.

``--overhead`` instead measures what the cache costs where it never hits: 32 requests of random
256-token prompts, 64 tokens generated each, on an in-process Inferencer with and without the
cache, alternated, tokens/s end to end (median of 5).

Hit rate: prompt tokens the server reports as cached (``usage.prompt_tokens_details.cached_tokens``,
or llama-server's ``timings.cache_n``) over prompt tokens.  Without ``--url`` the script starts
``slotinfer serve`` on the default model (8 slots); ``--url`` drives any other server.

    python benchmarks/bench_prefix.py
    python benchmarks/bench_prefix.py --url http://127.0.0.1:8081 --served-model smollm2
    python benchmarks/bench_prefix.py --overhead
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import httpx

from slotinfer.cli.bench_serve import stream_chunks

TOPICS = ["billing", "shipping", "returns", "warranty", "accounts", "privacy", "gift cards", "repairs"]


def system_prompt(tag: str) -> str:
    """About 1,000 tokens of a support assistant's rules; ``tag`` makes it unlike any other."""
    rules = [f"Rule {i} ({tag}): when a customer asks about {t}, answer politely, cite the policy section "
             f"{i}.1, never promise a refund before checking the order, and keep the answer short."
             for i, t in enumerate((TOPICS * 3)[:16])]
    return f"You are the support assistant of the Example Store ({tag}).\n" + "\n".join(rules)


QUESTIONS = [f"Question {i}: how do I handle {t} for order {1000 + i}?" for i, t in enumerate(TOPICS * 3)]
TURNS = ["Tell me about your store.", "What can I buy there?", "How fast is shipping?",
         "Can I return an item?", "What about gift cards?", "Thanks, anything else I should know?"]


async def chat(client, url, model, messages, max_tokens) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first, text, usage, timings = None, "", None, None
    async for chunk in stream_chunks(client, url + "/v1/chat/completions", body):
        for c in chunk.get("choices") or []:
            piece = (c.get("delta") or {}).get("content")
            if piece:
                first = first or time.perf_counter()
                text += piece
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
    prompt = (usage or {}).get("prompt_tokens") or (timings or {}).get("prompt_n", 0) + (timings or {}).get("cache_n", 0)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and timings:
        cached = timings.get("cache_n", 0)
    return {"ttft": (first or time.perf_counter()) - t0, "text": text, "prompt": prompt or 0, "cached": cached or 0}


def hit_rate(rows) -> float:
    total = sum(r["prompt"] for r in rows)
    return sum(r["cached"] for r in rows) / total if total else float("nan")


async def shared(url, model):
    async with httpx.AsyncClient(timeout=600) as client:
        cold = []
        for i in range(3):  # system prompts no request sent before: nothing to reuse
            msgs = [{"role": "system", "content": system_prompt(f"cold {i} {time.time()}")},
                    {"role": "user", "content": QUESTIONS[i]}]
            cold.append(await chat(client, url, model, msgs, 8))
        sys_text = system_prompt(f"shared {time.time()}")
        rows = []

        async def client_loop(k):
            for q in QUESTIONS[k::4]:
                msgs = [{"role": "system", "content": sys_text}, {"role": "user", "content": q}]
                rows.append(await chat(client, url, model, msgs, 8))

        await asyncio.gather(*(client_loop(k) for k in range(4)))
    return cold, rows


async def conversations(url, model):
    per_turn = [[] for _ in TURNS]
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(k):
            msgs = [{"role": "system", "content": f"You are a friendly shop assistant (conversation {k}, "
                                                  f"{time.time()})."}]
            for t, q in enumerate(TURNS):
                msgs.append({"role": "user", "content": q})
                r = await chat(client, url, model, msgs, 24)
                per_turn[t].append(r)
                msgs.append({"role": "assistant", "content": r["text"]})

        await asyncio.gather(*(one(k) for k in range(4)))
    return per_turn


def overhead(repeats: int = 5):
    import slotinfer
    from slotinfer import default_model
    from slotinfer.cli.bench import engine_tokens_per_s

    model = slotinfer.load(default_model.path())
    runs = {"cache": [], "no cache": []}
    for r in range(repeats):
        for name in (["cache", "no cache"] if r % 2 == 0 else ["no cache", "cache"]):
            budget = None if name == "cache" else 0
            runs[name].append(engine_tokens_per_s(model, 32, 256, 64, prefix_cache_bytes=budget)["tokens_per_s"])
    a, b = (statistics.median(runs[k]) for k in ("cache", "no cache"))
    print(f"0% hits, 32 x 256-token prompts, 64 new tokens: tokens/s with the cache {a:.1f}, without {b:.1f} "
          f"({a / b:.3f}x), median of {repeats}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--overhead", action="store_true", help="the cache's cost at a 0%% hit rate, in process")
    ap.add_argument("--url", help="an OpenAI-compatible server (default: start slotinfer serve on the default model)")
    ap.add_argument("--served-model", help="the 'model' field sent")
    ap.add_argument("--serve-args", default="", help="extra arguments for the slotinfer serve it starts")
    args = ap.parse_args()
    if args.overhead:
        return overhead()
    server = None
    url, model = args.url, args.served_model
    if url is None:
        from slotinfer import default_model
        from slotinfer.cli.bench_serve import ServerProcess

        server = ServerProcess(default_model.path(), 8, 4096, extra=args.serve_args.split())
        url, model = server.url, "bench"
    try:
        cold, rows = asyncio.run(shared(url, model))
        per_turn = asyncio.run(conversations(url, model))
    finally:
        if server is not None:
            server.close()
    ms = lambda s: f"{s * 1e3:.0f} ms"  # noqa: E731
    cold_p50 = statistics.median(r["ttft"] for r in cold)
    shared_p50 = statistics.median(r["ttft"] for r in rows)
    print(f"server: {url}")
    print(f"shared system prompt ({rows[0]['prompt']} prompt tokens, 24 questions, 4 clients):")
    print(f"  cold TTFT p50 {ms(cold_p50)}   shared TTFT p50 {ms(shared_p50)} "
          f"(p95 {ms(sorted(r['ttft'] for r in rows)[int(0.95 * len(rows))])})   ratio {shared_p50 / cold_p50:.2f}"
          f"   hit rate {hit_rate(rows):.0%}")
    print("six-turn chats (4 at once): TTFT p50 per turn")
    print("  " + "   ".join(f"turn {t + 1}: {ms(statistics.median(r['ttft'] for r in rs))}" for t, rs in enumerate(per_turn)))
    later = [r for rs in per_turn[1:] for r in rs]
    print(f"  turns 2-6: TTFT p50 {ms(statistics.median(r['ttft'] for r in later))}, hit rate {hit_rate(later):.0%}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
