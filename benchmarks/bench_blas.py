"""MLX f32 decode matmuls (x @ w.T) under each BLAS slotinfer can load.

The BLAS is chosen once per process, so every option runs in a fresh
subprocess with SLOTINFER_BLAS set.  Prints markdown tables (median ms, GB/s
of weight traffic, GFLOP/s, speed-up over MLX's reference BLAS); results and
conclusions are in docs/blas.md.

    python benchmarks/bench_blas.py                        # all options, default threads
    chrt -f 10 python benchmarks/bench_blas.py --rounds 2 --budget 0.5   # as in docs/blas.md
    python benchmarks/bench_blas.py --threads 1,2 --busy 1  # thread counts, one busy neighbour
    python benchmarks/bench_blas.py --options none,mkl,/path/to/libblas.so
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

OPTIONS = ["none", "openblas-scipy", "openblas-numpy", "openblas-system", "mkl"]
ROWS = [1, 8, 32]
COLD_BYTES = 256 << 20
WEIGHTS = [(1024, 1024), (3072, 1024), (1024, 3072), (151936, 1024)]  # (out, in); last = LM head


def worker(budget: float) -> None:
    from slotinfer.cpu import blas  # slotinfer/__init__ loads the BLAS before mlx.core

    info = blas.ensure_blas()
    import mlx.core as mx

    results = []
    for n, k in WEIGHTS:
        # Cycle through >= 256 MB of weight copies: a model's layers do not fit in
        # the last-level cache, so decode streams weights from DRAM.
        ws = [mx.random.normal((n, k)) for _ in range(max(1, -(-COLD_BYTES // (n * k * 4))))]
        mx.eval(ws)
        for m in ROWS:
            x = mx.random.normal((m, k))
            mx.eval(x @ ws[0].T)  # warm-up
            times, start = [], time.perf_counter()
            while len(times) < 3 or (time.perf_counter() - start < budget and len(times) < 200):
                w = ws[len(times) % len(ws)]
                t = time.perf_counter()
                mx.eval(x @ w.T)
                times.append(time.perf_counter() - t)
            times.sort()
            results.append({"m": m, "n": n, "k": k, "s": times[len(times) // 2]})
        del ws, w
    print(json.dumps({"info": {"name": info.name, "version": info.version, "threads": info.threads},
                      "results": results}))


def run(option: str, threads: int | None, budget: float) -> dict | None:
    env = dict(os.environ, SLOTINFER_BLAS=option)
    if threads:
        env["SLOTINFER_BLAS_THREADS"] = str(threads)
    p = subprocess.run([sys.executable, __file__, "--worker", "--budget", str(budget)],
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"{option}: failed\n{p.stderr}", file=sys.stderr)
        return None
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if option != "none" and out["info"]["name"] == "reference":
        print(f"{option}: not available, skipped", file=sys.stderr)
        return None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--threads", default="", help="comma list of BLAS thread counts to pin")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per shape")
    ap.add_argument("--busy", type=int, default=0,
                    help="run this many busy-looping processes alongside (a server's own threads, neighbours)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved runs per option; keeps each shape's fastest median (shared machines)")
    a = ap.parse_args()
    if a.worker:
        return worker(a.budget)

    jobs = {}  # label -> (option, threads); "none" runs once whatever the thread counts
    for t in [int(s) for s in a.threads.split(",") if s] or [None]:
        for opt in a.options.split(","):
            jobs.setdefault(opt if t is None or opt == "none" else f"{opt} t={t}", (opt, t))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        runs = measure(jobs, a.rounds, a.budget)
    finally:
        for h in hogs:
            h.kill()
    report(runs)


def measure(jobs: dict, rounds: int, budget: float) -> dict:
    runs = {}
    for _ in range(rounds):
        for label, (opt, t) in jobs.items():
            if runs.get(label, 0) is None or not (out := run(opt, t, budget)):
                runs[label] = None  # unavailable: do not retry
            elif label in runs:
                for old, new in zip(runs[label]["results"], out["results"]):
                    old["s"] = min(old["s"], new["s"])
            else:
                runs[label] = out
                i = out["info"]
                print(f"{label}: {i['version'] or i['name']}, threads={i['threads']}", file=sys.stderr)
    return {lb: out for lb, out in runs.items() if out}


def report(runs: dict) -> None:
    print("| BLAS | rows | weight (out x in) | ms | GB/s | GFLOP/s |\n|---|---|---|---|---|---|")
    for label, out in runs.items():
        for r in out["results"]:
            s, m, n, k = r["s"], r["m"], r["n"], r["k"]
            print(f"| {label} | {m} | {n}x{k} | {s * 1e3:.3f} | {n * k * 4 / s / 1e9:.1f} "
                  f"| {2 * m * n * k / s / 1e9:.1f} |")
    if "none" in runs:
        secs = {lb: {(r["m"], r["n"], r["k"]): r["s"] for r in out["results"]} for lb, out in runs.items()}
        labels = [lb for lb in runs if lb != "none"]
        print("\nSpeed-up over MLX's reference BLAS (x):\n")
        print("| rows | weight | " + " | ".join(labels) + " |\n|---|---|" + "---|" * len(labels))
        for r in runs["none"]["results"]:
            key = (r["m"], r["n"], r["k"])
            cells = [f"{secs['none'][key] / secs[lb][key]:.1f}" for lb in labels]
            print(f"| {r['m']} | {r['n']}x{r['k']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
