"""RSS of ``slotinfer serve`` over a long mixed soak through HTTP.

    python benchmarks/soak_serve.py --requests 3000                 # the tiny test model
    python benchmarks/soak_serve.py --model path/to/model.gguf --requests 2000
    python benchmarks/soak_serve.py --requests 3000 -- --no-prefix-cache    # flags of slotinfer serve

Starts the server in a child process and sends it ``--requests`` requests, ``--clients`` at a
time: completions and chats, whole and streamed (a fifth of the streams dropped after their first
chunk), varied ``n``, ``logprobs`` and sampling, small classifies, invalid bodies (unknown fields,
out-of-range values, JSON that does not parse), and every 500th request (``--huge-every``) a
prompt of 4 MB.
Prints the server's RSS (and its prefix cache's bytes) every tenth of the run; docs/robustness.md
has the figures.
"""

import argparse
import asyncio
import random
import re
import subprocess
import sys
from pathlib import Path

import httpx

from slotinfer.cli.bench import soak_model_path

WORDS = "the cat sat on a mat while rain fell over quiet hills and old roads".split()


def rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())[1]) / 1024


def report(url: str, pid: int, at: str):
    """The server's RSS, and the K/V its prefix cache holds (a part of it, bounded by its budget)."""
    m = re.search(r"^slotinfer_prefix_cache_bytes (\S+)", httpx.get(url + "/metrics").text, re.M)
    cache = f"  prefix cache {float(m[1]) / 2**20:7.1f} MiB" if m else ""
    print(f"{at:>7} requests  server RSS {rss_mib(pid):8.1f} MiB{cache}", flush=True)


def request(rng: random.Random, i: int, huge_every: int) -> tuple[str, object, str]:
    """(path, JSON body or raw bytes, kind) of the soak's ``i``-th request."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
    sampling = {"temperature": rng.choice((0, 0.8)), "seed": rng.randrange(2**32), "max_tokens": rng.randint(1, 16)}
    if huge_every and i % huge_every == huge_every - 1:
        return "/v1/completions", {"prompt": "the quick brown fox; " * 200_000, "max_tokens": 1}, "huge"
    kind = rng.choice(("completion", "completion", "chat", "chat", "stream", "stream", "classify", "invalid"))
    if kind == "completion":
        return "/v1/completions", {"prompt": text, "n": rng.randint(1, 3), "logprobs": rng.choice((None, 0, 5)),
                                   **sampling}, kind
    if kind == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                        "logprobs": True, "top_logprobs": rng.randint(0, 20), **sampling}, kind
    if kind == "stream":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "stream": True,
                                        "stream_options": {"include_usage": True}, **sampling}, kind
    if kind == "classify":
        return "/v1/classify", {"input": [text] * rng.randint(1, 8), "labels": ["yes", "no", "maybe so"]}, kind
    return "/v1/completions", rng.choice(({"prompt": text, "max_tokns": 3}, {"prompt": text, "top_p": 7},
                                          b"{not json", b"[" * 50_000)), kind


async def client(url: str, jobs: asyncio.Queue, rng: random.Random, counts: dict):
    async with httpx.AsyncClient(timeout=600) as c:
        while (job := await jobs.get()) is not None:
            path, body, kind = job
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            if kind == "stream":
                async with c.stream("POST", url + path, **kw) as r:
                    drop = rng.random() < 0.2
                    async for _ in r.aiter_lines():
                        if drop:
                            break  # the client goes away: its rows are cancelled
                status = r.status_code
            else:
                status = (await c.post(url + path, **kw)).status_code
            counts[(kind, status)] = counts.get((kind, status), 0) + 1


async def soak(url: str, pid: int, n: int, clients: int, seed: int, huge_every: int):
    rng = random.Random(seed)
    counts: dict = {}
    jobs: asyncio.Queue = asyncio.Queue(maxsize=clients)
    workers = [asyncio.ensure_future(client(url, jobs, random.Random(seed + k), counts)) for k in range(clients)]
    for i in range(n):
        await jobs.put(request(rng, i, huge_every))
        if (i + 1) % max(1, n // 10) == 0:
            report(url, pid, str(i + 1))
    for _ in workers:
        await jobs.put(None)
    await asyncio.gather(*workers)
    report(url, pid, "end")
    print("answers: " + ", ".join(f"{k} {s}: {v}" for (k, s), v in sorted(counts.items())))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder, GGUF file or hub id (default: the tiny test model)")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--huge-every", type=int, default=500, help="a prompt of 4 MB every N requests (0: none)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more flags of slotinfer serve")
    args = p.parse_args()
    model = args.model or str(soak_model_path())
    proc = subprocess.Popen([sys.executable, "-m", "slotinfer", "serve", model, "--port", "0", "--slots", "8",
                             "--max-len", "512", "--max-queue", "0", "--max-body-bytes", str(16 << 20),
                             "--log-level", "warning", *[a for a in args.serve_args if a != "--"]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = next(m.group(1) for line in proc.stderr if (m := re.search(r"running on (http://[\d.:]+)", line)))
        print(f"soak: {args.requests} mixed requests, {args.clients} at a time, through {url} ({model}); "
              f"server RSS at start {rss_mib(proc.pid):.1f} MiB", flush=True)
        asyncio.run(soak(url, proc.pid, args.requests, args.clients, args.seed, args.huge_every))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
