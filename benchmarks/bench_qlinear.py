"""One quantized linear layer on CPU: float32 sgemm against quantized kernels, at decode row counts.

For each fused linear layer of SmolLM2-135M (hidden 576, intermediate 1536) and of Qwen3-0.6B
(hidden 1024, intermediate 3072) -- q|k|v, gate|up and down -- and 1, 8 and 32 rows, ``x @ W.T``
is timed as

* ``f32``: float32 weights, MLX's matmul through slotinfer's BLAS path (``import slotinfer``
  first, as the engine does on CPU);
* ``mlx q4 g32`` ... ``mlx q8 g64``: ``mx.quantized_matmul`` on ``mx.quantize``'s affine layout
  (4 or 8 bits, groups of 32 or 64, float16 scales and biases as MLX checkpoints store them);
* ``own q8_0`` / ``own q4_0`` / ``own q4_1``: slotinfer's own kernel on the GGUF blocks as
  stored (``slotinfer/cpu/qkernel``), when it is built.

Every variant cycles through copies of its weight that add up to ``--budget-mib`` (well over the
L3 cache), so each call reads its weight from memory, as a decode step does.  The variants run
interleaved, one short pass of ``--calls`` products each per round, the order rotating; a cell is
the median over rounds, and its ratio the median of the per-round ratios ``f32 time / this
time`` (>1: faster than f32).  GB/s counts the weight bytes one 1-row call reads (packed values
plus scales/biases).  Correctness: before timing, each kernel's product is compared with numpy's
dequantize-then-matmul of the same blocks (``gguf.quants.dequantize``, the GGUF reference, or
MLX's affine formula) in float64, and the largest relative error is printed.

    python benchmarks/bench_qlinear.py --threads 1
    python benchmarks/bench_qlinear.py --threads 1 --rows 1 --clock cpu   # CPU time, one core
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

if "--threads" in sys.argv[:-1]:  # the BLAS reads its thread count when slotinfer loads it
    os.environ["SLOTINFER_BLAS_THREADS"] = sys.argv[sys.argv.index("--threads") + 1]

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx
from slotinfer.cpu import qkernel

try:
    from gguf import GGMLQuantizationType, quants
except ImportError:  # the GGUF reader is a dependency, but keep the MLX columns runnable without it
    quants = None

MODELS = {
    "smollm2": {"q|k|v": (960, 576), "gate|up": (3072, 576), "down": (576, 1536)},
    "qwen3": {"q|k|v": (4096, 1024), "gate|up": (6144, 1024), "down": (1024, 3072)},
}
MLX_QUANT = [(4, 32), (4, 64), (8, 32), (8, 64)]
OWN = ["q8_0", "q4_0", "q4_1"]
CLOCK = time.perf_counter  # --clock cpu: this process's CPU time


class Variant:
    """One way to compute ``x @ W.T``: its weight copies, bytes per copy, and the product."""

    def __init__(self, name, copies, nbytes, product):
        self.name, self.copies, self.nbytes, self.product = name, copies, nbytes, product
        self.cursor = 0

    def run(self, x, calls):
        outs = []
        for _ in range(calls):
            outs.append(self.product(x, self.copies[self.cursor]))
            self.cursor = (self.cursor + 1) % len(self.copies)
        t = CLOCK()
        mx.eval(outs)
        return (CLOCK() - t) / calls


def n_copies(nbytes, budget):
    return max(2, -(-budget // nbytes))


def copy_np(a):
    return mx.array(np.array(a, copy=True))


def build_variants(w_np, budget, own, mlx_quant=MLX_QUANT):
    n, k = w_np.shape
    w = mx.array(w_np)
    variants = [Variant("f32", [w] + [copy_np(w_np) for _ in range(n_copies(w.nbytes, budget) - 1)], w.nbytes,
                        lambda x, c: x @ c.T)]
    checks = {"f32": (w_np.astype(np.float64), lambda x: np.array(x @ w.T))}
    w16 = w.astype(mx.float16)
    for bits, group in mlx_quant:
        q = mx.quantize(w16, group_size=group, bits=bits)
        mx.eval(q)
        nbytes = sum(a.nbytes for a in q)
        copies = [q] + [tuple(copy_np(a) for a in q) for _ in range(n_copies(nbytes, budget) - 1)]

        def product(x, c, bits=bits, group=group):
            return mx.quantized_matmul(x, *c, transpose=True, group_size=group, bits=bits)

        name = f"mlx q{bits} g{group}"
        variants.append(Variant(name, copies, nbytes, product))
        # the reference dequantizes in float32 (d * q + bias is exact there; in float16 it is not)
        wq, scales, biases = q
        dq = np.array(mx.dequantize(wq, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group,
                                    bits=bits), dtype=np.float64)
        checks[name] = (dq, lambda x, product=product, q=q: np.array(product(x, q)))
    if own and quants is not None:
        for fmt in OWN:
            qtype = GGMLQuantizationType[fmt.upper()]
            blocks = quants.quantize(w_np, qtype)
            b = mx.array(blocks)
            copies = [b] + [copy_np(blocks) for _ in range(n_copies(b.nbytes, budget) - 1)]

            def product(x, c, fmt=fmt):
                return qkernel.qlinear(x, c, fmt)

            name = f"own {fmt}"
            variants.append(Variant(name, copies, b.nbytes, product))
            dq = quants.dequantize(blocks, qtype).astype(np.float64)
            checks[name] = (dq, lambda x, product=product, b=b: np.array(product(x, b)))
    return variants, checks


def check(checks, k, rows=8):
    """Largest |kernel - numpy dequantize-then-matmul| / max |reference|, per kernel."""
    x_np = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    x = mx.array(x_np)
    errs = {}
    for name, (dq, fn) in checks.items():
        ref = x_np.astype(np.float64) @ dq.T
        errs[name] = float(np.abs(fn(x) - ref).max() / np.abs(ref).max())
    return errs


def measure(variants, m, k, rounds, calls):
    x = mx.random.normal((m, k))
    mx.eval(x)
    times = {v.name: [] for v in variants}
    ratios = {v.name: [] for v in variants}
    for r in range(rounds + 1):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        this = {v.name: v.run(x, calls) for v in order}
        if r:  # the first round warms every variant up
            for name, t in this.items():
                times[name].append(t)
                ratios[name].append(this["f32"] / t)
    return ({n: statistics.median(t) for n, t in times.items()},
            {n: statistics.median(q) for n, q in ratios.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen3")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=8, help="products per variant per round (1 row); 4 above")
    ap.add_argument("--budget-mib", type=int, default=64, help="weight copies each variant cycles through")
    ap.add_argument("--threads", type=int, help="BLAS and own-kernel threads (default: the BLAS's)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the process's CPU time (with --threads 1: each kernel's cost on one core, "
                         "less sensitive to other jobs on a shared machine than wall time)")
    ap.add_argument("--no-own", action="store_true", help="leave out slotinfer's own kernel")
    ap.add_argument("--mlx", default="4:32,4:64,8:32,8:64",
                    help="mx.quantized_matmul layouts, bits:group, comma-separated ('' for none)")
    ap.add_argument("--kernels", help="the own kernel's loops: portable, avx2 or avx512 (default: the best)")
    args = ap.parse_args()
    module = qkernel.load()
    own = module is not None and not args.no_own
    if args.clock == "cpu":
        global CLOCK
        CLOCK = time.process_time
    if module is None:
        print(f"own kernel {qkernel.status()}")
    elif quants is None:
        print("gguf is not installed: own-kernel columns left out")
    threads = slotinfer.BLAS.threads
    if own:
        module.set_threads(threads)
        if args.kernels:
            module.set_kernels(args.kernels)
    mlx_quant = [tuple(int(v) for v in spec.split(":")) for spec in args.mlx.split(",") if spec]
    print(f"BLAS {slotinfer.BLAS.name}, {threads} thread(s); own kernel: "
          + (f"{module.kernels()}, {module.threads()} thread(s)" if own else "none"))
    rows = [int(r) for r in args.rows.split(",")]
    budget = args.budget_mib << 20
    rng = np.random.default_rng(0)
    results = []  # (model, layer, n, k, m, medians, ratios, nbytes)
    for model in args.models.split(","):
        for layer, (n, k) in MODELS[model].items():
            w_np = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
            variants, checks = build_variants(w_np, budget, own, mlx_quant)
            errs = check(checks, k)
            print(f"{model} {layer} {n}x{k}: max relative error vs numpy dequantize-then-matmul: "
                  + ", ".join(f"{name} {e:.1e}" for name, e in errs.items()), flush=True)
            nbytes = {v.name: v.nbytes for v in variants}
            for m in rows:
                med, rat = measure(variants, m, k, args.rounds, args.calls if m == 1 else max(1, args.calls // 2))
                results.append((model, layer, n, k, m, med, rat, nbytes))
                print(f"  rows {m}: " + ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in med.items()),
                      flush=True)
            del variants, checks
    print_tables(results)


def cell(text):  # a markdown table cell: "q|k|v" would split into three
    return text.replace("|", "\\|")


def print_tables(results):
    names = list(results[0][5])
    print("\nms per call (ratio: f32 time / this time, median of per-round ratios)\n")
    print("| model | layer | n x k | rows | " + " | ".join(names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    for model, layer, n, k, m, med, rat, _ in results:
        cells = [f"{med[nm] * 1e3:.3f}" + ("" if nm == "f32" else f" ({rat[nm]:.2f}x)") for nm in names]
        print(f"| {model} | {cell(layer)} | {n}x{k} | {m} | " + " | ".join(cells) + " |")
    one = [r for r in results if r[4] == 1]
    if not one:
        return
    print("\n1 row: GB/s of weights read (bits per weight in the header)\n")
    bits = {nm: one[0][7][nm] * 8 / (one[0][2] * one[0][3]) for nm in names}
    print("| model | layer | " + " | ".join(f"{nm} ({bits[nm]:.2g} b)" for nm in names) + " |")
    print("|---|---|" + "---|" * len(names))
    for model, layer, n, k, m, med, rat, nbytes in one:
        print(f"| {model} | {cell(layer)} | " + " | ".join(f"{nbytes[nm] / med[nm] / 1e9:.1f}" for nm in names) + " |")


if __name__ == "__main__":
    main()
