"""Load time and peak memory of a K-quant GGUF: a llama-shaped Q4_K_M file of random blocks.

The file is written once (llama.cpp's Q4_K_M recipe: Q4_K, Q6_K for the output, value
projections and every other down projection, the Q5_0/Q8_0 fallbacks for rows that are not
whole 256-value super-blocks), then loaded in a fresh process per run; each run reports the
load's wall time, the process's peak resident memory, MLX's peak allocation, and the model's
float32 size (what the CPU policy holds) and largest tensor, so the peak can be read against
"the float32 weights plus one tensor".

    python benchmarks/bench_gguf_load.py                 # Llama 3.2 1B's shape
    python benchmarks/bench_gguf_load.py --shape smollm2 # SmolLM2-135M's (rows of 576: mostly fallbacks)
    python benchmarks/bench_gguf_load.py --file model.gguf
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

SHAPES = {
    "llama-1b": dict(hidden=2048, ffn=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True),
    "smollm2": dict(hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3, vocab=49152, tied=True),
}

CHILD = """
import json, resource, sys, time
import slotinfer
import mlx.core as mx
from mlx.utils import tree_flatten
t = time.perf_counter()
m = slotinfer.load(sys.argv[1])
seconds = time.perf_counter() - t
sizes = [v.size for _, v in tree_flatten(m.net.parameters())]
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"load_s": round(seconds, 2), "peak_rss_gib": round(rss / 2**20, 2),
                  "mlx_peak_gib": round(mx.get_peak_memory() / 2**30, 2), "f32_gib": round(4 * sum(sizes) / 2**30, 2),
                  "largest_tensor_gib": round(4 * max(sizes) / 2**30, 2), "dtype": str(m.dtype)}))
"""


def write(path: Path, shape: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_fixtures import llama_cpp_q4_k_m, write_random_gguf

    return write_random_gguf(path, **SHAPES[shape], qtype=llama_cpp_q4_k_m, rope_base=500000.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    ap.add_argument("--file", help="a GGUF file to load instead of writing one")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if args.file:
        path = Path(args.file)
    else:
        from slotinfer.cli.bench import CACHE

        path = CACHE / "bench" / f"{args.shape}-Q4_K_M-random.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write(path, args.shape)
    print(f"{path.name}: {path.stat().st_size / 2**30:.2f} GiB on disk")
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, check=True)
        print(json.loads(out.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
