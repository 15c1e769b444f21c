"""Speculative decoding side by side with llama-server's n-gram speculation, single stream, greedy.

    python benchmarks/bench_spec_peer.py --llama-bin /path/to/llama.cpp/build/bin --gen 64 --rounds 3

Both engines run the SmolLM2-135M-Instruct Q4_1 GGUF that ``slotinfer.default_model`` points at, on
the copy-heavy prompts (2 of each kind) and the prompts with nothing to copy of
``benchmarks/data/spec_prompts.jsonl``, chat-rendered by slotinfer and sent to both as the same
token ids, one request at a time, ``--gen`` tokens at most (EOS ends a reply).

Modes: slotinfer with ``speculative`` off and ``"ngram"`` (a fresh drafter each run, as in
bench_spec.py), and llama-server without speculation and with ``--spec-type ngram-simple`` (its
prompt-lookup drafter, which keeps no state between requests) at its defaults and at a lookup
of 3 tokens drafting 8.  Each llama-server runs with 2 threads and 1 slot, started once.  Rounds
take the modes in turn, each round starting one mode further on; figures are medians over the
counted rounds (one uncounted round of one prompt first).  Decode tokens/s: slotinfer's tokens after the first
over its decode time (``metrics["decode_tokens_per_s"]``), llama-server's ``timings.predicted_n``
over ``timings.predicted_ms``.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import slotinfer  # noqa: F401  before MLX: slotinfer swaps in its BLAS
from bench_spec import load_sets, run
from slotinfer import default_model
from slotinfer.engine.engine import BANDWIDTH_ROWS, POSITION_COST, Engine

LLAMA_MODES = {
    "llama off": [],
    "llama ngram-simple": ["--spec-type", "ngram-simple"],
    "llama ngram-simple n3 m8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                 "--spec-ngram-simple-size-m", "8"],
}


def start_server(binary: Path, gguf: str, port: int, extra: list[str], threads: int = 2) -> subprocess.Popen:
    cmd = [str(binary / "llama-server"), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-np", "1", "-c", "4096", "--no-webui", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"llama-server {' '.join(extra)} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"llama-server {' '.join(extra)} did not come up in 300 s")


def llama_run(port: int, reqs, gen: int):
    tokens = ms = 0.0
    outs, drafted, accepted = [], 0, 0
    with httpx.Client(timeout=600) as client:
        for ids, _ in reqs:
            r = client.post(f"http://127.0.0.1:{port}/completion", json={
                "prompt": list(ids), "n_predict": gen, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True})
            r.raise_for_status()
            body = r.json()
            t = body["timings"]
            tokens += t["predicted_n"]
            ms += t["predicted_ms"]
            drafted += t.get("draft_n", 0)
            accepted += t.get("draft_n_accepted", 0)
            outs.append(body.get("tokens"))
    return tokens / (ms / 1e3), outs, dict(drafted=drafted, accepted=accepted)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", required=True, type=Path, help="llama.cpp's build/bin folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server's -t")
    ap.add_argument("--only", help="the prompt set whose name contains this")
    ap.add_argument("--all-copy", action="store_true", help="2 copy-heavy prompts of each kind (default: 1)")
    args = ap.parse_args()
    gguf = default_model.path()
    model, why = default_model.load()
    if model is None:
        sys.exit(f"the default model is not installed: {why}")
    sets = load_sets(model, args.gen)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # the servers go too
    copy = sets["copy, 1 stream" if args.all_copy else "copy, 4 rows"][1]  # 2 of each kind, or 1
    sets = {"copy-heavy": copy, "nothing to copy": sets["open, 1 stream"][1]}
    servers = {name: (args.port + i, start_server(args.llama_bin, str(gguf), args.port + i, extra,
                                                      args.llama_threads))
               for i, (name, extra) in enumerate(LLAMA_MODES.items())}
    try:
        for set_name, reqs in sets.items():
            if args.only and args.only not in set_name:
                continue
            max_len = max(len(ids) for ids, _ in reqs) + args.gen + 8
            engines = {m: Engine(model, slots=1, max_len=max_len, speculative="ngram" if m else None,
                                 draft_tokens=args.draft_tokens) for m in (False, True)}
            modes = ["slotinfer off", "slotinfer ngram", *LLAMA_MODES]
            rates = {m: [] for m in modes}
            outs, counts = {}, {}
            for r in range(args.rounds + 1):
                batch = reqs if r else reqs[:1]  # the uncounted round compiles slotinfer's steps: one prompt does
                for m in modes[r % len(modes):] + modes[:r % len(modes)]:
                    if m.startswith("slotinfer"):
                        rate, o, c = run(engines[m == "slotinfer ngram"], batch, args.draft_tokens, POSITION_COST,
                                         BANDWIDTH_ROWS)
                        c = dict(drafted=c["spec_drafted"], accepted=c["spec_accepted"])
                    else:
                        rate, o, c = llama_run(servers[m][0], batch, args.gen)
                    outs[m], counts[m] = o, c
                    if r:
                        rates[m].append(rate)

            def same(a, b, outs=outs):
                return sum(x == y for x, y in zip(outs[a], outs[b]))

            print(f"\n{set_name}: {len(reqs)} prompts, 1 stream, greedy, gen {args.gen}, {args.rounds} rounds "
                  f"(+1 uncounted of 1 prompt)")
            print(f"  {'mode':<26} {'tok/s':>7} {'vs own off':>10} {'drafted':>8} {'accepted':>8}  rounds")
            for m in modes:
                own = "slotinfer off" if m.startswith("slotinfer") else "llama off"
                ratio = statistics.median(a / b for a, b in zip(rates[m], rates[own]))
                print(f"  {m:<26} {statistics.median(rates[m]):7.1f} {ratio:9.2f}x {counts[m]['drafted']:>8} "
                      f"{counts[m]['accepted']:>8}  {', '.join(f'{x:.1f}' for x in rates[m])}")
            for m in LLAMA_MODES:
                print(f"  slotinfer ngram / {m}: "
                      f"{statistics.median(a / b for a, b in zip(rates['slotinfer ngram'], rates[m])):.2f}x")
            print(f"  same tokens as its own off: slotinfer {same('slotinfer ngram', 'slotinfer off')}/{len(reqs)}, "
                  + ", ".join(f"{m} {same(m, 'llama off')}/{len(reqs)}" for m in list(LLAMA_MODES)[1:])
                  + f"; slotinfer off as llama off {same('slotinfer off', 'llama off')}/{len(reqs)}", flush=True)
    finally:
        for _, proc in servers.values():
            proc.terminate()
        for _, proc in servers.values():
            proc.wait(30)


if __name__ == "__main__":
    main()
