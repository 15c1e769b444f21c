"""The K/V block size, in process on the engine: decode tokens/s at 1 and 32 rows, and time to first
token on the two workloads the prefix cache serves (one shared system prompt; multi-turn chats).

Each run prints one JSON line; ``--block-size`` picks the engine's block (the pool's, which is also
the prefix cache's).  Run it under two checkouts to compare revisions: a revision whose Engine has
no ``block_size`` argument runs with its own.

* ``decode``: ``rows`` requests of a 256-token prompt, 64 new tokens each, all admitted at once;
  tokens/s of the decode steps only (the steps after the last prompt is in);
* ``shared``: a ~1,000-token system prompt (as benchmarks/bench_prefix.py writes it) and 24
  questions, 4 at a time in a closed loop, 8 new tokens each: the median TTFT of the 23 that
  follow the first;
* ``chat``: 4 conversations of 6 turns at once, each turn resending the whole history with the
  model's answers, 24 new tokens each: the median TTFT of turns 2-6.

    python benchmarks/bench_block_size.py --block-size 128
    python benchmarks/bench_block_size.py --block-size 64 --small   # a few minutes on a busy machine
    PYTHONPATH=/tmp/base python benchmarks/bench_block_size.py   # another revision, its own block
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import slotinfer  # noqa: E402
from bench_prefix import QUESTIONS, TURNS, system_prompt  # noqa: E402
from slotinfer import default_model  # noqa: E402
from slotinfer.cli.bench import prompts_of  # noqa: E402
try:
    from slotinfer.engine.engine import Engine  # noqa: E402
except ImportError:  # a revision from before the engine's folder
    from slotinfer.engine import Engine  # noqa: E402


def engine(model, block_size, **kw):
    if block_size and "block_size" in inspect.signature(Engine).parameters:
        kw["block_size"] = block_size
    return Engine(model, **kw)


def decode_tokens_per_s(model, block_size, rows: int, prompt=256, new=64) -> float:
    e = engine(model, block_size, slots=rows, max_len=prompt + new + 8, prefill_tokens=prompt * rows,
               prefix_cache_bytes=0)
    for p in prompts_of(model, 1, prompt, seed=-rows):  # compile outside the timing
        e.add(e.make_item(p, max_tokens=4, ignore_eos=True))
    e.run_until_done()
    items = [e.make_item(p, max_tokens=new, ignore_eos=True) for p in prompts_of(model, rows, prompt, seed=rows)]
    for it in items:
        e.add(it)
    while any(not it.tokens for it in items):  # prefill, and the first token of every row
        e.step()
    n0, t0 = sum(len(it.tokens) for it in items), time.perf_counter()
    e.run_until_done()
    return (sum(len(it.tokens) for it in items) - n0) / (time.perf_counter() - t0)


def closed_loop(e, model, conversations, new: int, concurrency: int) -> list[list[float]]:
    """Run ``conversations`` (each a list of message lists, or a callable making the next turn's
    messages from the answers so far) ``concurrency`` at a time; TTFT of each turn."""
    waiting, live, ttft = list(range(len(conversations))), {}, [[] for _ in conversations]
    answers = [[] for _ in conversations]

    def submit(c):
        msgs = conversations[c](answers[c])
        it = e.make_item(model.chat_prompt(None, msgs), max_tokens=new, ignore_eos=True, temperature=0.0)
        e.add(it)
        live[c] = it

    while waiting or live:
        while waiting and len(live) < concurrency:
            submit(waiting.pop(0))
        e.step()
        for c, it in list(live.items()):
            if it.handle.done():
                r = it.handle.result(0)
                ttft[c].append(r.metrics["time_to_first_token_s"])
                answers[c].append(r.text)
                del live[c]
                if len(answers[c]) < conversations[c].turns:
                    waiting.append(c)
    return ttft


class Conversation:
    def __init__(self, system, users):
        self.system, self.users, self.turns = system, users, len(users)

    def __call__(self, answers):
        msgs = [{"role": "system", "content": self.system}]
        for i, a in enumerate(answers):
            msgs += [{"role": "user", "content": self.users[i]}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": self.users[len(answers)]}]


def shared_ttft(model, block_size, questions=24, new=8) -> float:
    e = engine(model, block_size, slots=8, max_len=2048)
    closed_loop(e, model, [Conversation(system_prompt("warm-up"), ["hello"])], 4, 1)  # compile outside
    system = system_prompt("shared")
    ttft = closed_loop(e, model, [Conversation(system, [q]) for q in QUESTIONS[:questions]], new, 4)
    return statistics.median(t[0] for t in ttft[1:])


def chat_ttft(model, block_size, chats=4, turns=6, new=24) -> float:
    e = engine(model, block_size, slots=8, max_len=2048)
    closed_loop(e, model, [Conversation(system_prompt("warm-up"), ["hello"])], 4, 1)
    convs = [Conversation(f"You are assistant number {i} of the Example Store. Answer briefly.", TURNS[:turns])
             for i in range(chats)]
    ttft = closed_loop(e, model, convs, new, chats)
    return statistics.median(t for turns in ttft for t in turns[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block-size", type=int, default=0, help="the engine's K/V block (0: the revision's own)")
    ap.add_argument("--parts", default="decode,shared,chat")
    ap.add_argument("--small", action="store_true", help="a quick version on a busy machine: 128-token prompts and "
                    "32 new tokens for decode, 8 questions of 4 new tokens, 2 chats of 4 turns of 8 new tokens")
    a = ap.parse_args()
    sizes = dict(decode=dict(prompt=128, new=32), shared=dict(questions=8, new=4), chat=dict(chats=2, turns=4, new=8)) \
        if a.small else dict(decode={}, shared={}, chat={})
    model = slotinfer.load(default_model.path())
    out = {"block_size": a.block_size or "default", "revision": os.path.dirname(os.path.dirname(slotinfer.__file__))}
    parts = a.parts.split(",")
    if "decode" in parts:
        out["decode_1"] = round(decode_tokens_per_s(model, a.block_size, 1, **sizes["decode"]), 2)
        out["decode_32"] = round(decode_tokens_per_s(model, a.block_size, 32, **sizes["decode"]), 2)
    if "shared" in parts:
        out["ttft_shared_s"] = round(shared_ttft(model, a.block_size, **sizes["shared"]), 4)
    if "chat" in parts:
        out["ttft_chat_s"] = round(chat_ttft(model, a.block_size, **sizes["chat"]), 4)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
