"""Prefill tokens/s of long prompts, slotinfer beside llama.cpp on the same GGUF, runs alternated.

For each shape ``ROWSxTOKENS`` and round: llama.cpp's ``llama-batched-bench -m M -c 20000 -b 2048
-ub 512 -npp TOKENS -ntg 1 -npl ROWS -t THREADS`` (its ``S_PP t/s``: prompt tokens over the prompt
phase), then slotinfer's engine on ``ROWS`` prompts of ``TOKENS`` random tokens, one new token each,
no prefix cache, the default 512-token prefill budget (prompt tokens over the wall time until every
row has its token).  A prompt of 8,192 tokens leaves slotinfer no room for its new token in
SmolLM2's 8,192-token context, so slotinfer takes 8,191 there (llama.cpp takes its 8,192).  The
median of the rounds and the ratio per shape are printed at the end.  Runs the slotinfer it imports:
point ``PYTHONPATH`` at another checkout to measure that one.

    python benchmarks/bench_prefill_peer.py --llama /path/to/llama.cpp/build/bin --rounds 2
    python benchmarks/bench_prefill_peer.py --llama BIN --shapes 1x2048,4x2048,1x8192 --threads 2
"""

import argparse
import os
import statistics
import subprocess
import time

import slotinfer  # first: the BLAS before mlx.core
from slotinfer import default_model
from slotinfer.cli.bench import prompts_of
from slotinfer.engine.engine import Engine


def llama_pp(binary: str, model: str, rows: int, tokens: int, threads: int) -> float:
    """llama.cpp's S_PP t/s for ``rows`` prompts of ``tokens`` tokens."""
    cmd = [os.path.join(binary, "llama-batched-bench"), "-m", model, "-c", "20000", "-b", "2048", "-ub", "512",
           "-npp", str(tokens), "-ntg", "1", "-npl", str(rows), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    # |    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] == str(tokens) and cells[2] == str(rows):
            return float(cells[5])
    raise RuntimeError(f"no S_PP row for {rows}x{tokens} in llama-batched-bench's output:\n{out}")


def slotinfer_pp(model, rows: int, tokens: int, budget: int) -> float:
    """slotinfer's prompt tokens over the wall time until each of ``rows`` rows has its one new token."""
    tokens = min(tokens, model.config.max_position_embeddings - 1)
    e = Engine(model, slots=rows, max_len=tokens + 1, prefill_tokens=budget, prefix_cache_bytes=0)
    for p in prompts_of(model, rows, tokens, seed=rows * tokens):
        e.add(e.make_item(p, max_tokens=1, ignore_eos=True))
    t = time.perf_counter()
    while e.busy:
        e.step()
    return rows * tokens / (time.perf_counter() - t)


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama", required=True, help="llama.cpp's build/bin folder (llama-batched-bench)")
    ap.add_argument("--shapes", default="1x2048,4x2048,1x8192", help="ROWSxTOKENS, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
    ap.add_argument("--budget", type=int, default=512, help="slotinfer's prefill_tokens")
    args = ap.parse_args()
    path = default_model.path()
    if path is None:
        raise SystemExit(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    model = slotinfer.load(path)
    slotinfer_pp(model, 1, 600, args.budget)  # compile and fault in outside the timing
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    got = {s: ([], []) for s in shapes}
    for r in range(args.rounds):
        for rows, tokens in shapes:
            lp = llama_pp(args.llama, str(path), rows, tokens, args.threads)
            sp = slotinfer_pp(model, rows, tokens, args.budget)
            got[rows, tokens][0].append(sp)
            got[rows, tokens][1].append(lp)
            print(f"round {r + 1} {rows}x{tokens}: slotinfer {sp:.1f}, llama.cpp {lp:.1f} tokens/s "
                  f"(load {load()})", flush=True)
    print(f"{'shape':>8} {'slotinfer':>10} {'llama.cpp':>10} {'ratio':>6}")
    for (rows, tokens), (s, l) in got.items():
        ms, ml = statistics.median(s), statistics.median(l)
        print(f"{rows}x{tokens:<6} {ms:10.1f} {ml:10.1f} {ms / ml:6.2f}")


if __name__ == "__main__":
    main()
