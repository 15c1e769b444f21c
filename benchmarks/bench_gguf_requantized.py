"""How K-quant GGUF weights kept compact agree with the dequantized ones: greedy tokens on the
conformance prompts, and memory, for the GPU's requantized MLX affine layout and the CPU kernels'
blocks.

SmolLM2-135M-Instruct's Q4_1 file is re-encoded as llama.cpp lays out Q6_K and Q4_K_M files (the test
writer's ``requantize``), then each is run on this machine's CPU three ways: with the weights
dequantized to float32 (the reference), with the weights the GPU policy keeps
(``device.requantized_layout``) dequantized again so that only the weights differ, and on the CPU's
own kernels with the blocks as stored (Q4_K, Q6_K, Q5_0, Q8_0; :mod:`slotinfer.cpu.qkernel`).

    python benchmarks/bench_gguf_requantized.py [--all-8-bit]
"""

import argparse
import sys
from pathlib import Path

import slotinfer  # first: installs the BLAS before mlx.core loads
from slotinfer import default_model, device
from slotinfer.loading import gguf, loader
from slotinfer.cli.bench import CACHE
from slotinfer.text.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_fixtures import T, llama_cpp_q4_k_m, requantize  # noqa: E402

PROMPTS = ["The capital of France is", "In 2024, there were 12345 cats and 3 dogs in the"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
          {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
          {"role": "user", "content": "Name a fruit."}]]
RECIPES = {
    "Q6_K": lambda n, w: T.F32 if w.ndim != 2 else T.Q6_K if w.shape[1] % 256 == 0 else T.Q8_0,
    "Q4_K_M": lambda n, w: llama_cpp_q4_k_m(n, w, tied=True),
}


def greedy(model) -> list[list[int]]:
    prompts = PROMPTS + [model.apply_chat_template(c) for c in CHATS]
    return [model.generate(p, max_tokens=32).tokens for p in prompts]


def agreement(got, want) -> list[str]:
    out = []
    for a, b in zip(got, want):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append(f"{n}/{len(b)}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all-8-bit", action="store_true", help="requantize every type to 8 bits (not the policy)")
    args = ap.parse_args()
    if args.all_8_bit:
        device.requantized_layout = lambda bits_per_weight: {"group_size": 32, "bits": 8}
    src = default_model.path()
    if src is None:
        raise SystemExit(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    for name, recipe in RECIPES.items():
        path = CACHE / "bench" / f"smollm2-{name}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            requantize(src, path, recipe)
        want = greedy(slotinfer.load(path, dtype="float32"))
        cfg, weights, quant, meta, _ = gguf.read(path, keep_quantized=True)
        bits = sorted({q["bits"] for q in quant.values()})
        kept = sum(w.nbytes for w in weights.values()) / 2**20
        tok = Tokenizer.from_gguf(meta, path.name)
        model = loader.assemble(cfg, weights, quant, dtype=None, path=path, tokenizer=lambda: (tok, tok.eos_ids))
        print(f"{name}: kept as {bits} bits, {kept:.0f} MiB; greedy tokens in agreement before the first "
              f"difference: {', '.join(agreement(greedy(model), want))}")
        if device.cpu_block_kernels():
            model = slotinfer.load(path)
            layers = [m for _, m in model.net.named_modules() if hasattr(m, "fmt")]
            formats = sorted({m.fmt for m in layers})
            kept = sum(m.weight.nbytes for m in layers) / 2**20
            print(f"{name}: blocks {formats}, {kept:.0f} MiB ({path.stat().st_size / 2**20:.0f} MiB file); "
                  f"greedy tokens in agreement: {', '.join(agreement(greedy(model), want))}")


if __name__ == "__main__":
    main()
