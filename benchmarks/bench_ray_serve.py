"""Online serving on Ray Serve: routing policies side by side, and the cost of the detour.

``--part routing`` (default: both parts): 2 replicas of the model on one local cluster, one
application per policy in turn (``prefix``: slotinfer's prefix-affinity router; ``pow2``: Ray
Serve's default, the shorter queue of two; ``round_robin``), each driven with the prefix-cache
benchmark's workloads (benchmarks/bench_prefix.py: one shared system prompt and 24 questions from
4 clients; ``--chats`` six-turn chats at once, each behind its own system prompt), then one ``slotinfer serve`` on the same workloads for
reference.  Figures: prompt tokens served from cache (``cached_tokens`` over prompt tokens) and
TTFT p50.

``--part overhead``: one replica behind the ingress against one ``slotinfer serve`` of the same
engine, random ``--prompt-tokens``-token prompts, ``--gen-tokens`` streamed tokens each, at 1
and 8 clients in a closed loop; after one unmeasured run of each (the engines compile that load's
shapes), runs alternate (serve, ray, ray, serve, ...) and the figures are medians over ``--rounds``
runs of each: tokens/s and TTFT p50, and their ratios.  Beside
them, the CPU time each side's processes took per generated token (the server's process; the
replica's, the ingress's and Serve's HTTP proxy's): a figure the machine's other work moves far
less than the wall-clock ones.  ``--stream-interval N``: the replica sends a row's tokens N a
message (``serve_app``'s ``stream_interval``); ``--stream-hold-ms MS``: how long it holds a row's tokens
after the first to send them together (``serve_app``'s ``stream_hold_ms``, default 50; 0: at once).

    python benchmarks/bench_ray_serve.py
    python benchmarks/bench_ray_serve.py --part routing --routing prefix,round_robin
    python benchmarks/bench_ray_serve.py --part overhead --rounds 3 --model PATH
    python benchmarks/bench_ray_serve.py --part overhead --stream-interval 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import sys
import time

import slotinfer  # noqa: F401  before MLX, as every benchmark
from slotinfer.cli.bench_serve import ServerProcess, drive_http, workload

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_prefix import TOPICS, TURNS, chat, hit_rate, shared  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    """A local Ray cluster with Serve's HTTP proxy on a free port; one application at a time."""

    def __init__(self, cores: int):
        import ray
        from ray import serve

        self.ray, self.serve, self.cores = ray, serve, cores
        ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.url = f"http://127.0.0.1:{self.port}"

    def run(self, model, replicas: int, routing: str, slots: int, max_len: int, stream_interval: int = 1,
            stream_hold_ms: float | None = None):
        import slotinfer.ray as sr

        threads = max(1, self.cores // replicas)  # each engine's BLAS threads: the cores split between them
        app = sr.serve_app(model, replicas=replicas, routing=routing, slots=slots, max_queue=0, max_len=max_len,
                           stream_interval=stream_interval,
                           **({} if stream_hold_ms is None else {"stream_hold_ms": stream_hold_ms}),
                           num_cpus=min(1.0, (self.cores - 0.5) / replicas), ingress_cpus=0.25,
                           replica_options={"runtime_env": {"env_vars": {"SLOTINFER_BLAS_THREADS": str(threads)}}})
        t0 = time.perf_counter()
        self.serve.run(app, name="bench", route_prefix="/")
        return time.perf_counter() - t0

    def delete(self):
        self.serve.delete("bench")

    def close(self):
        self.serve.shutdown()
        self.ray.shutdown()


async def conversations(url, chats: int):
    """``chats`` six-turn chats at once, each behind its own ~250-token system prompt (an odd count, so
    that a round robin's turn does not land on the same replica by the parity of the arrivals)."""
    import httpx

    per_turn = [[] for _ in TURNS]
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(k):
            rules = " ".join(f"Rule {i}: answer questions about {t} politely and cite section {i}.{k}."
                             for i, t in enumerate(TOPICS))
            msgs = [{"role": "system", "content": f"You are shop assistant number {k} ({time.time()}). {rules}"}]
            for t, q in enumerate(TURNS):
                msgs.append({"role": "user", "content": q})
                r = await chat(client, url, None, msgs, 16)
                per_turn[t].append(r)
                msgs.append({"role": "assistant", "content": r["text"]})

        await asyncio.gather(*(one(k) for k in range(chats)))
    return per_turn


def _prefix_figures(url, chats: int) -> dict:
    cold, rows = asyncio.run(shared(url, None))
    per_turn = asyncio.run(conversations(url, chats))
    later = [r for rs in per_turn[1:] for r in rs]
    return {"shared_hit": hit_rate(rows), "shared_ttft": statistics.median(r["ttft"] for r in rows),
            "cold_ttft": statistics.median(r["ttft"] for r in cold),
            "chat_hit": hit_rate(later), "chat_ttft": statistics.median(r["ttft"] for r in later)}


def routing_part(args, fleet):
    out = {}
    for routing in args.routing.split(","):
        took = fleet.run(args.model, 2, routing, args.slots, args.max_len)
        print(f"  {routing}: application up in {took:.0f} s", flush=True)
        try:
            out[routing] = _prefix_figures(fleet.url, args.chats)
        finally:
            fleet.delete()
    server = ServerProcess(args.model, args.slots, args.max_len)
    try:
        out["one slotinfer serve"] = _prefix_figures(server.url, args.chats)
    finally:
        server.close()
    ms = lambda s: f"{s * 1e3:.0f} ms"  # noqa: E731
    print("\n| routing (2 replicas) | shared prompt: cached | TTFT p50 | chat turns 2-6: cached | TTFT p50 |")
    print("|---|---|---|---|---|")
    for name, f in out.items():
        print(f"| {name} | {f['shared_hit']:.0%} | {ms(f['shared_ttft'])} | {f['chat_hit']:.0%} | {ms(f['chat_ttft'])} |")
    return out


def _processes(server) -> dict:
    """Each side's process ids by role: the server's; the application's replica and ingress, and Serve's
    HTTP proxy (Ray names its actors' processes ``ray::ServeReplica:APP:DEPLOYMENT``, ``ray::ProxyActor``)."""
    roles = {"serve": [server.proc.pid], "replica": [], "ingress": [], "proxy": []}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or it ended
            continue
        if line.startswith("ray::ServeReplica:bench:"):
            roles["ingress" if "slotinfer-ingress" in line else "replica"].append(int(entry))
        elif line.startswith("ray::ProxyActor"):
            roles["proxy"].append(int(entry))
    return roles


def _cpu(pids) -> float:
    """User and system CPU seconds the processes have taken (Linux's /proc; 0 without it)."""
    total = 0.0
    if not os.path.isdir("/proc"):
        return total
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def overhead_part(args, fleet):
    from slotinfer.serve.app import default_name

    fleet.run(args.model, 1, "prefix", args.slots, args.max_len, args.stream_interval, args.stream_hold_ms)
    server = ServerProcess(args.model, args.slots, args.max_len)
    roles = _processes(server)
    sides = {"serve": ["serve"], "ray": ["replica", "ingress", "proxy"]}
    vocab = 1000  # random ids below it: inside any vocabulary
    name = default_name(args.model)
    runs = {}
    try:
        for clients in (1, 8):
            per = max(2, 8 // clients)
            prompts = workload(clients, per, args.prompt_tokens, vocab, seed=clients)
            for url, model in ((server.url, "bench"), (fleet.url, name)):  # unmeasured: each engine compiles
                asyncio.run(drive_http(url, model, prompts, args.gen_tokens))  # this load's prefill and batch shapes
            for r in range(args.rounds):
                for where in (["serve", "ray"] if r % 2 == 0 else ["ray", "serve"]):
                    url, model = (server.url, "bench") if where == "serve" else (fleet.url, name)
                    before = {role: _cpu(roles[role]) for role in sides[where]}
                    got = asyncio.run(drive_http(url, model, prompts, args.gen_tokens))
                    tokens = got["tokens_per_s"] * got["wall_s"]
                    got["cpu_ms"] = {role: (_cpu(roles[role]) - t) * 1e3 / tokens for role, t in before.items()}
                    runs.setdefault((clients, where), []).append(got)
                    print(f"  {clients} clients, {where}: {got['tokens_per_s']:.1f} tokens/s, TTFT p50 "
                          f"{got['ttft_p50'] * 1e3:.0f} ms, CPU ms per token "
                          + ", ".join(f"{k} {v:.2f}" for k, v in got["cpu_ms"].items())
                          + f"; load average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        server.close()
        fleet.delete()
    print("\n| clients | one serve: tokens/s | TTFT p50 | Ray Serve (1 replica): tokens/s | TTFT p50 | "
          "tokens/s ratio |")
    print("|---|---|---|---|---|---|")
    for clients in (1, 8):
        s, r = runs[(clients, "serve")], runs[(clients, "ray")]
        st, rt = (statistics.median(x["tokens_per_s"] for x in v) for v in (s, r))
        sf, rf = (statistics.median(x["ttft_p50"] for x in v) for v in (s, r))
        print(f"| {clients} | {st:.1f} | {sf * 1e3:.0f} ms | {rt:.1f} | {rf * 1e3:.0f} ms | {rt / st:.2f}x |")
    if not os.path.isdir("/proc"):
        return runs  # the CPU figures read Linux's /proc
    print("\nCPU time per generated token (ms, medians):\n")
    print("| clients | one serve | Ray: replica | ingress | HTTP proxy | Ray, all three |")
    print("|---|---|---|---|---|---|")
    for clients in (1, 8):
        med = {role: statistics.median(x["cpu_ms"][role] for x in runs[(clients, where)])
               for where in sides for role in sides[where]}
        ray_all = statistics.median(sum(x["cpu_ms"].values()) for x in runs[(clients, "ray")])
        print(f"| {clients} | {med['serve']:.2f} | {med['replica']:.2f} | {med['ingress']:.2f} | {med['proxy']:.2f} "
              f"| {ray_all:.2f} |")
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["routing", "overhead", "both"], default="both")
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--routing", default="prefix,pow2,round_robin", help="the policies compared, in order")
    ap.add_argument("--chats", type=int, default=5, help="routing: six-turn chats at once")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=128, help="overhead: each prompt's length")
    ap.add_argument("--gen-tokens", type=int, default=32, help="overhead: tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3, help="overhead: runs of each side")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="overhead: tokens a row per message from the replica (serve_app's stream_interval)")
    ap.add_argument("--stream-hold-ms", type=float, default=None,
                    help="overhead: how long the replica holds a row's tokens after the first "
                         "(serve_app's stream_hold_ms; default its own, 50)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="CPUs the local cluster declares")
    args = ap.parse_args()
    if args.model is None:
        from slotinfer import default_model

        args.model = str(default_model.path())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model {os.path.basename(args.model)}; "
          f"{args.slots} slots per engine; stream interval {args.stream_interval}; "
          f"stream hold {'default' if args.stream_hold_ms is None else args.stream_hold_ms} ms; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    fleet = Fleet(args.cores)
    try:
        if args.part in ("routing", "both"):
            routing_part(args, fleet)
        if args.part in ("overhead", "both"):
            overhead_part(args, fleet)
    finally:
        fleet.close()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
