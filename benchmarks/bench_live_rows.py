"""Decode cost against live rows: one request on a large table, and a full table, side by side.

Two measurements, each a fresh process so neither inherits the other's compiled steps:

* ``one``: a single request (32-token prompt, 128 generated) on an Inferencer of ``--slots``
  slots, decode tokens/s; run at 1 slot and at 32, their ratio is what an idle server's first
  user sees against a one-slot engine (target >= 0.9x);
* ``busy``: 32 requests at once on 32 slots (``--prompt-tokens``-token prompts, 32 by default,
  64 generated each), decode tokens/s (``--busy-only``: this one alone).

``--baseline REV`` runs the same measurements on a checkout of git revision ``REV`` (a temporary
worktree) in turn with this one (``--rev``: a revision instead of the working tree), so the ratios
against it are taken side by side; the median of ``--repeats`` runs is printed.

    python benchmarks/bench_live_rows.py                              # SmolLM2-135M when installed
    python benchmarks/bench_live_rows.py --random-shape --baseline HEAD~1 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(mode: str, slots: int, model_arg: str | None, random_shape: bool, prompt_tokens: int = 32) -> dict:
    import slotinfer  # first: installs the BLAS before mlx.core loads
    from slotinfer.cli.bench import engine_tokens_per_s, prompts_of
    from slotinfer.cli.bench_common import bench_model_path
    from slotinfer import default_model

    path = model_arg or (bench_model_path() if random_shape or default_model.path() is None else default_model.path())
    model = slotinfer.load(path)
    if mode == "busy":
        return engine_tokens_per_s(model, 32, prompt_tokens, 64)
    prompt = prompts_of(model, 1, 32, seed=1)[0]
    with slotinfer.Inferencer(model, slots=slots, max_len=1024) as inf:
        inf.generate(prompt, max_tokens=8, ignore_eos=True)  # compile outside the timing
        c = inf.generate(prompt, max_tokens=128, ignore_eos=True)
    return {"decode_tokens_per_s": c.metrics["decode_tokens_per_s"]}


def run(tree: Path, mode: str, slots: int, args) -> float:
    cmd = [sys.executable, __file__, "--one", mode, "--slots", str(slots)]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--random-shape"] if args.random_shape else []
    cmd += ["--prompt-tokens", str(args.prompt_tokens)]
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}  # that tree's slotinfer first, this script
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} on {slots} slots failed in {tree}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["decode_tokens_per_s"]


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="slotinfer-baseline-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)
    for shim in (ROOT / "slotinfer" / "cpu").glob("_blas_shim*.so"):  # built at install, not tracked
        shutil.copy(shim, path / "slotinfer" / "cpu")
    for kernels in (ROOT / "slotinfer" / "cpu" / "qkernel").glob("*.so"):  # the quantized kernels, likewise
        if (path / "slotinfer" / "cpu" / "qkernel").is_dir():
            shutil.copy(kernels, path / "slotinfer" / "cpu" / "qkernel")
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model folder, GGUF file or hub id (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--random-shape", action="store_true", help="the random Qwen3-0.6B-shaped model")
    ap.add_argument("--baseline", metavar="REV", help="also measure git revision REV, in turn with this tree")
    ap.add_argument("--rev", help="measure git revision REV instead of the working tree")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of the 32 busy requests")
    ap.add_argument("--busy-only", action="store_true", help="measure the 32 busy requests only")
    ap.add_argument("--one", choices=["one", "busy"], help=argparse.SUPPRESS)
    ap.add_argument("--slots", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.slots, args.model, args.random_shape, args.prompt_tokens)))
        return

    trees = {args.rev or "this tree": worktree(args.rev) if args.rev else ROOT}
    if args.baseline:
        trees[args.baseline] = worktree(args.baseline)
    points = [("busy", 32)] if args.busy_only else [("one", 1), ("one", 32), ("busy", 32)]
    got = {(t, p): [] for t in trees for p in points}
    try:
        for r in range(args.repeats):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for p in points:
                for t in order:
                    got[t, p].append(run(trees[t], *p, args))
    finally:
        for tree in trees.values():
            if tree != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)])
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"decode tokens/s, median of {args.repeats}")
    print("| tree | 1 request, 1 slot | 1 request, 32 slots | ratio | 32 requests, 32 slots |")
    print("|---|---:|---:|---:|---:|")
    for t in trees:
        if args.busy_only:
            print(f"| {t} | | | | {med[t, ('busy', 32)]:.1f} |")
            continue
        a, b, c = med[t, ("one", 1)], med[t, ("one", 32)], med[t, ("busy", 32)]
        print(f"| {t} | {a:.1f} | {b:.1f} | {b / a:.2f} | {c:.1f} |")
    if args.baseline:
        this, base = list(trees)
        print(f"32 busy rows, {this} / {base}: {med[this, ('busy', 32)] / med[base, ('busy', 32)]:.2f}")


if __name__ == "__main__":
    main()
