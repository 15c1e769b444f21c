"""Serving benchmark: N concurrent streaming clients in a closed loop against an OpenAI-compatible
server, and the same workload on the in-process Inferencer, side by side.

Each client sends its requests one after another (a closed loop): 32-token prompts (token ids)
and exactly 64 new tokens each (``ignore_eos``), streamed.  Reported: output tokens/s over the
whole run, time to first token (TTFT) and inter-token latency (ITL), p50 and p95.  Without
``--url`` the server is ``slotinfer serve`` started in a child process, so the clients (this
process) and the server do not share one interpreter; ``--url`` points at any other server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time

SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                    max_position_embeddings=8192)


def add_arguments(p):
    from .common import positive_int

    p.add_argument("--url", help="an OpenAI-compatible server to drive (default: start slotinfer serve)")
    p.add_argument("--served-model", default=None, help="the 'model' field sent to --url")
    p.add_argument("--shape", choices=["smollm2-135m", "qwen3-0.6b"], default=None,
                   help="a random-weight model of this shape (built once) instead of the default model, "
                        "SmolLM2-135M-Instruct, which is also what runs when that is not installed")
    p.add_argument("--clients", default="32", help="comma-separated client counts")
    p.add_argument("--requests", type=positive_int, default=3, help="requests per client (closed loop)")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="runs of each side, alternating server/in-process then in-process/server")
    p.add_argument("--in-process", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the workload on an in-process Inferencer and print the ratio")
    p.add_argument("--plot", metavar="FILE.svg", help="write tokens/s against client count as an SVG plot")


def bench_model(shape: str | None):
    """The model folder or file to serve: the default model unless a random ``shape`` is asked for."""
    from .bench_common import CACHE, bench_model_path
    from ..default_model import path as default_path

    if shape is None and default_path() is not None:
        return default_path()
    if shape == "qwen3-0.6b":
        return bench_model_path()
    path = CACHE / "bench" / "smollm2-135m-shape"
    if not (path / "config.json").exists():
        from ..testing import make_tiny_model
        print(f"building a random SmolLM2-135M-shaped checkpoint (bf16) in {path} ...", flush=True)
        make_tiny_model("llama", path, overrides=SMOLLM2_135M, dtype="bfloat16")
    return path


def workload(n_clients: int, per_client: int, prompt_tokens: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return [[[rng.randrange(3, vocab) for _ in range(prompt_tokens)] for _ in range(per_client)]
            for _ in range(n_clients)]


def summarize(wall: float, rows: list[dict]) -> dict:
    """rows: per request, output tokens, TTFT and the gaps between its tokens (seconds)."""
    ttft = sorted(r["ttft"] for r in rows)
    itl = sorted(g for r in rows for g in r["gaps"])
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"tokens_per_s": sum(r["tokens"] for r in rows) / wall, "wall_s": wall,
            "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95), "itl_p50": pct(itl, 0.5), "itl_p95": pct(itl, 0.95)}


async def drive_http(url: str, model: str | None, prompts, gen_tokens: int) -> dict:
    """Every client's requests through ``url``'s /v1/completions, streamed."""
    import httpx

    async def one(client, ids):
        body = {"prompt": ids, "max_tokens": gen_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
        t0 = time.perf_counter()
        stamps, used = [], None
        async for chunk in stream_chunks(client, url + "/v1/completions", body):
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:  # a token's chunk
                stamps.append(time.perf_counter())
            used = chunk.get("usage") or used
        return _row(t0, stamps, used["completion_tokens"] if used else len(stamps))

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(prompts) + 4)) as client:
        return await _closed_loop(prompts, lambda ids: one(client, ids))


async def stream_chunks(client, url: str, body: dict):
    """The JSON chunks of a streamed (server-sent events) response to ``body`` posted to ``url``."""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])


async def drive_inferencer(inf, prompts, gen_tokens: int) -> dict:
    """The same workload on the Inferencer's asyncio API, no HTTP."""

    async def one(ids):
        t0 = time.perf_counter()
        stamps, n = [], 0
        async for _ in inf.stream_async(ids, max_tokens=gen_tokens, ignore_eos=True):
            stamps.append(time.perf_counter())
            n += 1
        return _row(t0, stamps, n)

    return await _closed_loop(prompts, one)


def _row(t0, stamps, tokens) -> dict:
    return {"tokens": tokens, "ttft": stamps[0] - t0 if stamps else float("nan"),
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])]}


async def _closed_loop(prompts, one) -> dict:
    rows = []

    async def client(mine):
        for ids in mine:
            rows.append(await one(ids))

    t0 = time.perf_counter()
    await asyncio.gather(*(client(mine) for mine in prompts))
    return summarize(time.perf_counter() - t0, rows)


class ServerProcess:
    """``slotinfer serve`` in a child process, on a free port of 127.0.0.1."""

    def __init__(self, model_path, slots: int, max_len: int, extra=()):
        cmd = [sys.executable, "-m", "slotinfer", "serve", str(model_path), "--port", "0", "--slots", str(slots),
               "--max-len", str(max_len), "--max-queue", "0", "--served-model-name", "bench", "--log-level", "warning",
               *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.url = None
        for line in self.proc.stderr:
            m = re.search(r"running on (http://\S+:\d+)", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            raise RuntimeError(f"slotinfer serve did not start (exit {self.proc.wait()})")

    def close(self):
        self.proc.terminate()
        self.proc.wait(60)
        self.proc.stderr.close()


def run(args) -> int:
    import slotinfer

    counts = [int(c) for c in str(args.clients).split(",")]
    gen, plen = args.gen_tokens, args.prompt_tokens
    server, model = None, None
    path = args.model or (None if args.url else bench_model(args.shape))
    if path is not None:
        model = slotinfer.load(path, dtype=args.dtype)
        print(f"model: {model}\nBLAS: {slotinfer.BLAS.name}  compute dtype: {model.dtype}")
    vocab = model.tokenizer.vocab_size if model is not None else 256
    print(f"workload: closed loop, {args.requests} requests per client, prompts of {plen} tokens, "
          f"{gen} new tokens each (ignore_eos), streamed")
    print(f"{'clients':>7} {'where':>10} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} "
          f"{'ITL p95':>8}")
    max_len = plen + gen + 8
    medians = {"server": [], "in-process": []}  # per client count, for --plot
    try:
        url = args.url
        if url is None:
            server = ServerProcess(path, max(counts), max_len)
            url = server.url
        for n in counts:
            prompts = workload(n, args.requests, plen, vocab, seed=n)
            name = args.served_model or ("bench" if server else None)
            local = args.in_process and model is not None
            inf = slotinfer.Inferencer(model, slots=max(counts), max_len=max_len) if local else None
            try:
                warm = [mine[:1] for mine in prompts]  # every client once, a few tokens: the step shapes compile
                asyncio.run(drive_http(url, name, warm, 4))
                if inf is not None:
                    asyncio.run(drive_inferencer(inf, warm, 4))
                runs = {"server": [], "in-process": []}
                for where in alternating(args.rounds if local else 1):
                    if where == "server":
                        r = asyncio.run(drive_http(url, name, prompts, gen))
                    else:
                        r = asyncio.run(drive_inferencer(inf, prompts, gen))
                    runs[where].append(r)
                    _print(n, where, r)
            finally:
                if inf is not None:
                    inf.close()
            for where, rs in runs.items():
                if rs:
                    medians[where].append(statistics.median(r["tokens_per_s"] for r in rs))
            if runs["in-process"]:
                served, local = medians["server"][-1], medians["in-process"][-1]
                print(f"{n:>7} {'ratio':>10} {served:>9.1f} / {local:.1f} tokens/s (medians) = {served / local:.2f}x",
                      flush=True)
    finally:
        if server is not None:
            server.close()
    if args.plot:
        from ._svg import svg_plot

        series = {("slotinfer serve" if server else args.url): medians["server"]}
        if len(medians["in-process"]) == len(counts):
            series["in-process Inferencer"] = medians["in-process"]
        with open(args.plot, "w") as f:
            f.write(svg_plot(counts, series, f"streaming clients, {plen}-token prompts, {gen} new tokens",
                             "concurrent clients", "output tokens/s (median)"))
        print(f"plot: {args.plot}")
    return 0


def alternating(rounds: int) -> list[str]:
    """server, in-process, then in-process, server, ...: a machine that drifts during the runs moves both means alike."""
    from .bench_common import alternating_order

    return [{"continuous": "server", "static": "in-process"}[m] for m in alternating_order(rounds)]


def _print(n, where, r):
    ms = lambda s: f"{s * 1e3:7.0f}ms"  # noqa: E731
    print(f"{n:>7} {where:>10} {r['tokens_per_s']:>9.1f} {ms(r['ttft_p50']):>9} {ms(r['ttft_p95']):>9} "
          f"{ms(r['itl_p50']):>8} {ms(r['itl_p95']):>8}", flush=True)
