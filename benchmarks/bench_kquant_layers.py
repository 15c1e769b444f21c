"""SmolLM2-135M's K-quant layers on the CPU's kernels: the blocks as stored against the repacked blocks
they replaced (Q5_0 against Q8_0 for gate|up, Q4_K against Q4_1 and Q6_K against Q8_0 for down).

One thread, 1 and 32 rows; each side cycles through 8 copies of its weight, the sides alternate, and
each figure is the median CPU time (``time.process_time``) of 30 products.

With ``--model`` (one or more GGUF files): each file's own products instead, grouped by layer, format
and shape, at ``--rows`` rows, one thread: the median CPU time of one step's products of a group (all
its layers in one evaluation, so the weights come from memory as in a step), and the weight bytes
read per second of CPU time.  The files alternate, ``--rounds`` rounds.

    python benchmarks/bench_kquant_layers.py
    python benchmarks/bench_kquant_layers.py --model Q4_K_M.gguf SmolLM2-135M-Instruct.Q4_1.gguf --rows 1
"""

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import slotinfer  # first: installs the BLAS before mlx.core loads
import gguf
import mlx.core as mx
import numpy as np

from slotinfer.cpu import qkernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_fixtures import random_tensor_blocks  # noqa: E402

T = gguf.GGMLQuantizationType
CASES = [("gate|up", 3072, 576, "Q5_0", "Q8_0"), ("down", 576, 1536, "Q4_K", "Q4_1"),
         ("down", 576, 1536, "Q6_K", "Q8_0")]


def blocks(name, n, k, rng):
    if name in ("Q4_K", "Q6_K"):  # gguf has no quantizer for them: random blocks of the right scale
        return random_tensor_blocks((n, k), T[name], 0.05, rng)
    return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), T[name])


def products_of(path):
    """A GGUF file's quantized products, {(layer kind, format, n, k): [weights]}, in order."""
    from slotinfer.cpu import qlayers

    groups = collections.defaultdict(list)
    for name, m in slotinfer.load(path).net.named_modules():
        if isinstance(m, (qlayers.BlockLinear, qlayers.BlockEmbedding)):
            n, nbytes = m.weight.shape
            k = nbytes // qkernel.BLOCK_BYTES[m.fmt] * qkernel.BLOCK_VALUES[m.fmt]
            groups[(name.split(".")[-1], m.fmt, n, k)].append(m.weight)
    return groups


def files(paths, rows, rounds):
    models = {Path(p).name: products_of(p) for p in paths}
    fmt = {v: k for k, v in qkernel.FORMATS.items()}
    t = {name: collections.defaultdict(list) for name in models}
    for _ in range(rounds):
        for name, groups in models.items():
            for (kind, f, n, k), ws in groups.items():
                x = mx.random.normal((rows, k))
                mx.eval(x)
                c = time.process_time()
                mx.eval([qkernel.qlinear(x, w, f, spare=False) for w in ws])
                t[name][(kind, f, n, k)].append(time.process_time() - c)
    for name, groups in models.items():
        print(f"{name}, {rows} row(s), one thread, CPU time of one step's products by group:")
        total = 0.0
        for (kind, f, n, k), ws in groups.items():
            sec = statistics.median(t[name][(kind, f, n, k)])
            total += sec
            gb = len(ws) * n * qkernel.row_bytes(f, k) / sec / 1e9
            print(f"  {kind:14} {fmt[f]:5} {n:6} x {k:5} x{len(ws):3}: {sec * 1e3:7.3f} ms  {gb:5.1f} GB/s", flush=True)
        print(f"  products: {total * 1e3:.2f} ms a step")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", help="GGUF files: their own products instead of the random layers")
    ap.add_argument("--rows", type=int, default=1, help="rows of x (with --model)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds (with --model)")
    args = ap.parse_args()
    module = qkernel.load()
    if module is None:
        raise SystemExit(f"the kernels are {qkernel.status()}")
    module.set_threads(1)
    if args.model:
        return files(args.model, args.rows, args.rounds)
    rng = np.random.default_rng(0)
    for label, n, k, new, old in CASES:
        w = {f: [mx.array(blocks(f, n, k, rng)) for _ in range(8)] for f in (new, old)}
        for rows in (1, 32):
            x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
            t = {new: [], old: []}
            for rep in range(30):
                for f in (new, old) if rep % 2 else (old, new):
                    c = time.process_time()
                    mx.eval(qkernel.qlinear(x, w[f][rep % 8], qkernel.FORMATS[f]))
                    t[f].append(time.process_time() - c)
            a, b = np.median(t[new]) * 1e3, np.median(t[old]) * 1e3
            print(f"{label} {n}x{k}, {rows} rows: {new} {a:.3f} ms, {old} {b:.3f} ms, {new} / {old} speed {b / a:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
