"""Server memory with a large table: RSS of ``slotinfer serve --slots 64 --max-len 8192`` idle, and its
peak while it serves 64 concurrent prompts of about 500 tokens.

    python benchmarks/bench_serve_rss.py                      # SmolLM2-135M-Instruct
    python benchmarks/bench_serve_rss.py --slots 64 --max-len 8192 --prompt-tokens 500 --max-tokens 64
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from slotinfer import default_model
from slotinfer.cli.bench_serve import ServerProcess


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    server = ServerProcess(default_model.path(), a.slots, a.max_len)
    try:
        pid = server.proc.pid
        time.sleep(2)
        idle = rss_bytes(pid)
        rng = random.Random(0)
        words = "the of and to in is was for on that with as by at from his her it an are were".split()
        prompts = [" ".join(rng.choice(words) for _ in range(a.prompt_tokens)) for _ in range(a.slots)]
        peak, done = [idle], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], rss_bytes(pid))
                time.sleep(0.05)

        def one(p):
            r = httpx.post(server.url + "/v1/completions", timeout=3600,
                           json={"model": "bench", "prompt": p, "max_tokens": a.max_tokens, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens"]

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(a.slots) as pool:
            lens = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
        done.set()
        t.join()
        after = rss_bytes(pid)
    finally:
        server.close()
    gib = 2**30
    print(f"slotinfer serve --slots {a.slots} --max-len {a.max_len}: idle RSS {idle / gib:.2f} GiB; "
          f"{a.slots} concurrent prompts of {min(lens)}-{max(lens)} tokens, {a.max_tokens} new tokens each, "
          f"in {wall:.0f} s: peak RSS {peak[0] / gib:.2f} GiB, {after / gib:.2f} GiB after")


if __name__ == "__main__":
    main()
