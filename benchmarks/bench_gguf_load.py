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
import tempfile
from pathlib import Path

SHAPES = {  # hidden, feed-forward, layers, heads, kv heads, vocab
    "llama-1b": (2048, 8192, 16, 32, 8, 128256),
    "smollm2": (576, 1536, 30, 9, 3, 49152),
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
    import gguf
    import numpy as np
    from gguf_fixtures import SCALE_FIELDS, _set_f16, add_metadata, llama_cpp_q4_k_m, tokenizer_metadata
    from slotinfer.testing import make_tiny_model

    hidden, ffn, layers, heads, kv, vocab = SHAPES[shape]
    hd = hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    meta = {"block_count": layers, "context_length": 2048, "embedding_length": hidden, "feed_forward_length": ffn,
            "attention.head_count": heads, "attention.head_count_kv": kv, "rope.dimension_count": hd,
            "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 500000.0}
    tok = make_tiny_model("llama", Path(tempfile.mkdtemp()) / "tok")  # a vocabulary, padded to the embedding
    add_metadata(writer, {**{f"llama.{k}": v for k, v in meta.items()}, **tokenizer_metadata(tok, vocab, gemma=False)})
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        for name, s in (("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv * hd, hidden)),
                        ("attn_v", (kv * hd, hidden)), ("attn_output", (hidden, hidden)), ("ffn_norm", (hidden,)),
                        ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            shapes[f"blk.{i}.{name}.weight"] = s
    rng = np.random.default_rng(0)
    for name, s in shapes.items():
        kind = llama_cpp_q4_k_m(name, np.broadcast_to(np.float32(0), s))
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ones(s, dtype=np.float32))
            continue
        if kind in SCALE_FIELDS:  # random blocks, every scale field 1e-3
            per, size = gguf.GGML_QUANT_SIZES[kind]
            blocks = rng.integers(0, 256, size=(s[0] * s[1] // per, size), dtype=np.uint8)
            for field in SCALE_FIELDS[kind]:
                _set_f16(blocks, field, np.full(len(blocks), 1e-3))
        else:
            blocks = gguf.quants.quantize(rng.standard_normal(s, dtype=np.float32) * 0.02, kind)
        writer.add_tensor(name, blocks.reshape(s[0], -1), raw_shape=blocks.reshape(s[0], -1).shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
