"""SmolLM2-135M's K-quant layers on the CPU's kernels: the blocks as stored against the repacked blocks
they replaced (Q5_0 against Q8_0 for gate|up, Q4_K against Q4_1 and Q6_K against Q8_0 for down).

One thread, 1 and 32 rows; each side cycles through 8 copies of its weight, the sides alternate, and
each figure is the median CPU time (``time.process_time``) of 30 products.

    python benchmarks/bench_kquant_layers.py
"""

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
CASES = [("gate|up", 3072, 576, "Q5_0", "Q8_0"), ("down", 576, 1536, "Q4_K", "Q4_1"),
         ("down", 576, 1536, "Q6_K", "Q8_0")]


def blocks(name, n, k, rng):
    if name in ("Q4_K", "Q6_K"):  # gguf has no quantizer for them: random blocks of the right scale
        return random_tensor_blocks((n, k), T[name], 0.05, rng)
    return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), T[name])


def main():
    module = qkernel.load()
    if module is None:
        raise SystemExit(f"the kernels are {qkernel.status()}")
    module.set_threads(1)
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
