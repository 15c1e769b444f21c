"""Engine throughput next to mlx-lm's BatchGenerator, side by side in one process.

Workload: a random-weight model of Qwen3-0.6B's shape (stored bf16, as published),
prompts of 32 tokens, exactly 64 generated tokens each (EOS ignored), at 1, 8 and
32 sequences.  mlx-lm gets its best CPU setup: the same optimized BLAS (slotinfer,
imported first, loads it for the whole process) and weights cast to float32.  During
mlx-lm's runs slotinfer's own sgemm loops are switched off, so mlx-lm runs on the plain
library, as it would with OpenBLAS preloaded (``--mlx-lm-own-loops`` lets it use them too).

    python benchmarks/bench_engine.py                 # needs `pip install mlx-lm` for the comparison
    python benchmarks/bench_engine.py --slots 32 --repeats 3
    python benchmarks/bench_engine.py --slots 32 --repeats 4 --each   # every repeat printed too
    python benchmarks/bench_engine.py --smollm2       # the default model's GGUF; mlx-lm on the same
                                                      # weights as f32 safetensors (benchmarks/export_hf.py)
"""

import argparse
import statistics
import time

import slotinfer  # first: installs the BLAS before mlx.core loads
import mlx.core as mx
from slotinfer.cpu.blas import set_own_products
from slotinfer.cli.bench import bench_model_path, engine_tokens_per_s, prompts_of


def mlx_lm_tokens_per_s(lm_model, prompts, gen_tokens):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(lm_model, stop_tokens=[], completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    t0 = time.perf_counter()
    gen.insert(prompts, [gen_tokens] * len(prompts))
    n = 0
    while responses := gen.next_generated():
        n += len(responses)
    wall = time.perf_counter() - t0
    gen.close()
    return n / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", default="1,8,32")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-mlx-lm", action="store_true")
    ap.add_argument("--mlx-lm-own-loops", action="store_true",
                    help="let mlx-lm's matmuls use slotinfer's own loops too (default: the plain library)")
    ap.add_argument("--each", action="store_true", help="print every repeat, not only the medians")
    ap.add_argument("--smollm2", action="store_true",
                    help="SmolLM2-135M-Instruct: slotinfer loads its GGUF, mlx-lm the same weights exported as "
                         "Hugging Face-layout f32 safetensors")
    args = ap.parse_args()

    if args.smollm2:
        from export_hf import export
        from slotinfer import default_model
        from slotinfer.cli.bench import CACHE
        if default_model.path() is None:
            raise SystemExit(f"the default model is not installed: {default_model.INSTALL}")
        model = slotinfer.load(default_model.path())
        path = CACHE / "bench" / "smollm2-hf"
        if not (path / "model.safetensors").exists():
            export(default_model.path(), path)
    else:
        path = bench_model_path()
        model = slotinfer.load(path)
    lm = None
    if not args.no_mlx_lm:
        try:
            import mlx_lm
            lm, _ = mlx_lm.load(str(path))
            lm.set_dtype(mx.float32)
        except ImportError:
            print("mlx-lm not installed: `pip install mlx-lm` for the side-by-side column")
    from mlx.utils import tree_flatten
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.net.parameters()))
    print(f"BLAS {slotinfer.BLAS.name}; slotinfer dtype {model.dtype}; weights {weight_bytes / 1e6:.0f} MB; "
          f"median of {args.repeats}")
    # every decode step reads every weight once: steps/s x weight bytes is the bandwidth the step draws
    print(f"{'seqs':>4} {'slotinfer tok/s':>16} {'weights GB/s':>13} {'mlx-lm f32 tok/s':>17} {'ratio':>6}")
    for slots in [int(s) for s in args.slots.split(",")]:
        ours, theirs = [], []
        prompts = prompts_of(model, slots, args.prompt_tokens, seed=slots)
        if lm is not None:
            mlx_lm_tokens_per_s(lm, prompts[:1], 4)  # warm up
        for _ in range(args.repeats):  # interleaved, so drifts in machine load hit both alike
            ours.append(engine_tokens_per_s(model, slots, args.prompt_tokens, args.gen_tokens)["tokens_per_s"])
            if lm is not None:
                # mlx-lm's setup is MLX + the optimized library: none of slotinfer's own loops
                was = set_own_products(args.mlx_lm_own_loops)
                theirs.append(mlx_lm_tokens_per_s(lm, prompts, args.gen_tokens))
                set_own_products(was)
            if args.each:
                them = f"{theirs[-1]:.1f}" if theirs else "-"
                print(f"     repeat {len(ours)}: slotinfer {ours[-1]:.1f}, mlx-lm {them}", flush=True)
        a = statistics.median(ours)
        b = statistics.median(theirs) if theirs else float("nan")
        gbs = a / slots * weight_bytes / 1e9
        print(f"{slots:>4} {a:>16.1f} {gbs:>13.1f} {b:>17.1f} {a / b:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
