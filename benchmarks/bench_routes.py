"""Each generation route against chat completions: the same conversation and output through
``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages`` of one ``slotinfer serve`` (a child
process), streamed and read as raw events, one request at a time, the routes taking turns (the
official clients are checked to read the same streams, but their parsing runs in this process and
would weigh on a 2-core machine's server).

    python benchmarks/bench_routes.py --requests 12 --tokens 64

Prints each route's output tokens/s (median over its requests, wall time from sending the request
to its last event) and its ratio to chat completions. Figures in docs/serve.md.
"""

import argparse
import statistics
import time

import anthropic
import httpx
import openai

from slotinfer.cli.bench_serve import ServerProcess, bench_model

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me about the sea, at length."}]


def _events(url, body, headers=None) -> int:
    """Posts ``body`` streamed and reads its events as they come (raw SSE, as any client must): the
    number of ``data:`` lines."""
    with httpx.stream("POST", url, json=body, headers=headers, timeout=600) as r:
        r.raise_for_status()
        return sum(1 for line in r.iter_lines() if line.startswith("data:"))


def chat(url, n):
    return _events(url + "/v1/chat/completions", {"model": "bench", "messages": MESSAGES, "max_tokens": n,
                                                   "temperature": 0, "stream": True, "ignore_eos": True})


def responses(url, n):
    return _events(url + "/v1/responses", {"model": "bench", "instructions": MESSAGES[0]["content"],
                                           "input": MESSAGES[1]["content"], "max_output_tokens": n, "temperature": 0,
                                           "stream": True, "ignore_eos": True})


def messages(url, n):
    return _events(url + "/v1/messages", {"model": "bench", "system": MESSAGES[0]["content"], "messages": MESSAGES[1:],
                                          "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True})


def sdk(url, n):
    """The same streams read by the official clients, which parse every event into their types."""
    oai = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0)
    claude = anthropic.Anthropic(base_url=url, api_key="-", max_retries=0)
    chat_ = oai.chat.completions.create(model="bench", messages=MESSAGES, max_tokens=n, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    resp = oai.responses.create(model="bench", instructions=MESSAGES[0]["content"], input=MESSAGES[1]["content"],
                                max_output_tokens=n, temperature=0, stream=True, extra_body={"ignore_eos": True})
    with claude.messages.stream(model="bench", max_tokens=n, system=MESSAGES[0]["content"], messages=MESSAGES[1:],
                                extra_body={"ignore_eos": True, "temperature": 0}) as s:
        final = s.get_final_message()
    return sum(1 for _ in chat_), [e for e in resp][-1].response.usage.output_tokens, final.usage.output_tokens


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=12, help="requests per route")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--model", default=None, help="a random model's shape (default: the real default model)")
    args = p.parse_args()
    server = ServerProcess(bench_model(args.model), 4, 1024)
    try:
        assert sdk(server.url, 4)[1:] == (4, 4)  # the official clients read all three streams
        routes = {"chat": chat, "responses": responses, "messages": messages}
        rates = {name: [] for name in routes}
        for run in routes.values():  # warm-up, and the prompt enters the prefix cache
            run(server.url, 4)
        for i in range(args.requests):
            order = list(routes) if i % 2 == 0 else list(routes)[::-1]
            for name in order:
                t0 = time.perf_counter()
                routes[name](server.url, args.tokens)
                rates[name].append(args.tokens / (time.perf_counter() - t0))
        base = statistics.median(rates["chat"])
        print(f"{'route':<12} {'tokens/s':>9} {'vs chat':>8}")
        for name, xs in rates.items():
            print(f"{name:<12} {statistics.median(xs):>9.1f} {statistics.median(xs) / base:>7.3f}x")
    finally:
        server.close()


if __name__ == "__main__":
    main()
