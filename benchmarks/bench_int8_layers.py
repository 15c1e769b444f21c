"""SmolLM2-135M's layers on the CPU's kernels with 8-bit activations (the option) against float32
activations (the default), at several row counts.

One thread; each side cycles through 8 copies of its weight (so they are read from memory), the two
sides alternate product by product, and each figure is the median CPU time (``time.process_time``)
of the products.  With ``--against-portable``, both sides have the option on: the int8 loops this CPU
uses (AVX512-VNNI's, AVX2's) against the portable int8 loops.

    python benchmarks/bench_int8_layers.py [--reps 30] [--rows 1,4,8,32,128]
    python benchmarks/bench_int8_layers.py --against-portable --rows 1,32 --reps 10
"""

import argparse
import sys
import time
from pathlib import Path

import slotinfer  # noqa: F401 - first: installs the BLAS before mlx.core loads
import gguf
import mlx.core as mx
import numpy as np

from slotinfer.cpu import qkernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_fixtures import random_tensor_blocks  # noqa: E402

T = gguf.GGMLQuantizationType
CASES = [("q|k|v", 960, 576, "Q5_0"), ("gate|up", 3072, 576, "Q5_0"), ("down", 576, 1536, "Q4_K"),
         ("down", 576, 1536, "Q6_K"), ("gate|up", 3072, 576, "Q4_1"), ("head", 49152, 576, "Q8_0")]


def blocks(name, n, k, rng):
    if name in ("Q4_K", "Q6_K"):  # gguf has no quantizer for them: random blocks of the right scale
        return random_tensor_blocks((n, k), T[name], 0.05, rng)
    return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), T[name])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", default="1,4,8,32,128")
    ap.add_argument("--against-portable", action="store_true",
                    help="the option on both sides: this CPU's int8 loops against the portable ones")
    args = ap.parse_args()
    module = qkernel.load()
    if module is None:
        raise SystemExit(f"the kernels are {qkernel.status()}")
    module.set_threads(1)
    best = module.kernels()
    print(f"loops: {best}, int8 loops: {module.int8_kernels()}")
    rng = np.random.default_rng(0)
    for label, n, k, fmt in CASES:
        w = [mx.array(blocks(fmt, n, k, rng)) for _ in range(8 if n * k < 10**7 else 2)]
        for rows in map(int, args.rows.split(",")):
            x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
            t = {False: [], True: []}  # True: the int8 loops in use; False: float, or portable int8
            for rep in range(args.reps):
                for on in (False, True) if rep % 2 else (True, False):
                    if args.against_portable:
                        module.set_int8_activations(True)
                        module.set_kernels(best if on else "portable")
                    else:
                        module.set_int8_activations(on)
                    c = time.process_time()
                    mx.eval(qkernel.qlinear(x, w[rep % len(w)], qkernel.FORMATS[fmt]))
                    t[on].append(time.process_time() - c)
            module.set_int8_activations(False)
            module.set_kernels(best)
            a, b = np.median(t[True]) * 1e3, np.median(t[False]) * 1e3
            other = "portable int8" if args.against_portable else "float"
            print(f"{label} {n}x{k} {fmt}, {rows} rows: int8 {a:.3f} ms, {other} {b:.3f} ms, speed {b / a:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
