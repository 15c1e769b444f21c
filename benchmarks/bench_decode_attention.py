"""The native decode attention alone (``paged_decode_attention``, slotinfer/cpu/qkernel/decode_ops.h):
time per row, and, against another build of the extension, bit-for-bit agreement and the speed ratio.

Each form is one call over pool blocks of ``--block`` tokens for ``--rows`` rows at a span (the
row's K/V length, ``--spans``) with a per-row mask as a verify step has it (row i of R sees all but
the last R - 1 - i positions), in float32 pools and in q8_0 pools; SmolLM2-135M's shape by default
(9 query heads, 3 K/V heads, head size 64), ``--layers`` calls in one evaluation making a step's
worth (each call one node, as in a step).  Printed: microseconds per row per layer and milliseconds
per row for the layers, medians over ``--repeats``.

``--baseline PATH``: another build of the extension (a ``_qkernel*.so``, e.g. one built from an
earlier commit into a temporary folder) loaded beside this checkout's.  First every random case of
``--check`` (shapes, head sizes 8 to 256, block sizes, rows, masks, soft caps, thread counts, the
loop sets the CPU runs, float32 and q8_0) must give the same bits in both; then the forms run
alternately in both, and the ratio baseline / this build is the median of the per-round ratios.

    python benchmarks/bench_decode_attention.py
    python benchmarks/bench_decode_attention.py --spans 256,2048 --rows 1,5,32 --threads 1
    python benchmarks/bench_decode_attention.py --baseline /tmp/old/_qkernel.cpython-311-x86_64-linux-gnu.so
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import numpy as np

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx
from slotinfer.cpu import qkernel
from slotinfer.kv.quant import quantize


def load_baseline(path: str):
    """Another build of the extension, as a module of its own beside slotinfer's."""
    spec = importlib.util.spec_from_file_location("baseline_qkernel._qkernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if module.mlx_version != mx.__version__:
        raise SystemExit(f"{path} was built against mlx {module.mlx_version}, not {mx.__version__}")
    return module


def case(rng, *, rows, heads, kvh, d, bs, span, q8, mask_kind, scale=1.0):
    """Arguments of one call: queries, pools, tables (blocks scattered), mask."""
    nblk = -(-span // bs)
    blocks = 1 + rows * nblk
    keys = (rng.standard_normal((blocks, kvh, bs, d)) * scale).astype(np.float32)
    values = rng.standard_normal((blocks, kvh, bs, d)).astype(np.float32)
    keys[0] = values[0] = 0
    tables = rng.permutation(np.arange(1, blocks))[: rows * nblk].reshape(rows, nblk).astype(np.int32)
    q = rng.standard_normal((rows, heads, 1, d)).astype(np.float32)
    pos = np.arange(nblk * bs)[None]
    lengths = np.minimum(span, rng.integers(1, span + 1, size=rows) if mask_kind == "random lengths"
                         else span - (rows - 1 - np.arange(rows)))
    mask = pos < np.maximum(lengths, 1)[:, None]
    if mask_kind == "window":
        mask &= pos > lengths[:, None] - 1 - int(rng.integers(1, 2 * bs + 2))
    elif mask_kind == "random":
        mask &= rng.random(mask.shape) < 0.7
    elif mask_kind == "shared":
        mask = mask[:1]
    if mask_kind == "zero query":
        q[:, ::2] = 0.0
    kp, vp = mx.array(keys), mx.array(values)
    if q8:
        kp, vp = quantize(kp), quantize(vp)
    m = None if mask_kind == "none" else mx.array(mask[:, None, None] if mask.shape[0] > 1 else mask[0])
    return mx.array(q), kp, vp, mx.array(tables), m


def check(new, old, n: int, seed: int) -> None:
    """n random cases: the same bits from both builds, else SystemExit naming the case."""
    rng = np.random.default_rng(seed)
    kernels = [k for k in ("avx512", "avx2", "portable")
               if ("portable", "avx2", "avx512").index(k) <= ("portable", "avx2", "avx512").index(new.best_kernels())]
    default_threads = new.threads()
    try:
        for i in range(n):
            kvh, rep = [(1, 1), (1, 4), (3, 3), (2, 8), (4, 2), (8, 3), (2, 16), (1, 7)][rng.integers(8)]
            d = int(rng.choice([8, 20, 32, 48, 64, 64, 80, 96, 128, 128, 256]))
            q8 = d % 32 == 0 and rng.random() < 0.4
            bs = int(rng.choice([1, 4, 7, 16, 17, 32, 64, 128]))
            span = int(rng.integers(1, 4 * bs + 40))
            mask_kind = str(rng.choice(["none", "verify", "random lengths", "window", "random", "shared", "zero query"]))
            softcap = float(rng.choice([0.0, 0.0, 30.0, 2.0]))
            scale = float(rng.choice([d ** -0.5, 1.0, 8.0]))  # 8: scores far apart, many weights exactly 0
            key_scale = float(rng.choice([1.0, 1e-3, 30.0]))
            rows = int(rng.integers(1, 10))
            threads = int(rng.integers(1, 5))
            k = kernels[i % len(kernels)]
            args = case(rng, rows=rows, heads=kvh * rep, kvh=kvh, d=d, bs=bs, span=span, q8=q8,
                        mask_kind=mask_kind, scale=key_scale)
            got = []
            for module in (new, old):
                module.set_kernels(k)
                module.set_threads(threads)
                got.append(np.array(module.paged_decode_attention(*args, scale, softcap)))
            if got[0].tobytes() != got[1].tobytes():
                raise SystemExit(f"case {i}: the builds differ (kernels {k}, rows {rows}, heads {kvh * rep}/{kvh}, "
                                 f"d {d}, block {bs}, span {span}, q8 {q8}, mask {mask_kind}, softcap {softcap}, "
                                 f"scale {scale}, threads {threads})")
    finally:
        for module in (new, old):
            module.set_kernels(new.best_kernels())
            module.set_threads(default_threads)
    print(f"{n} random cases: the same bits in both builds (kernels {', '.join(kernels)})")


def time_forms(modules, args) -> None:
    forms = [(span, rows, q8) for q8 in (False, True) for span in args.spans for rows in args.rows]
    rng = np.random.default_rng(0)
    print(f"heads {args.heads}/{args.kv_heads}, head size {args.head_dim}, block {args.block}, "
          f"threads {modules[0][1].threads()}, kernels {modules[0][1].kernels()}; {args.layers} layers a step")
    head = f"{'K/V':>7} {'span':>5} {'rows':>4}" + "".join(f" {name + ' us/row/layer':>22} {name + ' ms/row':>12}"
                                                         for name, _ in modules)
    print(head + ("   ratio baseline/this" if len(modules) > 1 else ""))
    for span, rows, q8 in forms:
        a = case(rng, rows=rows, heads=args.heads, kvh=args.kv_heads, d=args.head_dim, bs=args.block, span=span,
                 q8=q8, mask_kind="verify")
        scale = args.head_dim ** -0.5
        calls = max(1, args.layers)
        per = {name: [] for name, _ in modules}
        for _, module in modules:  # warm-up
            mx.eval(module.paged_decode_attention(*a, scale))
        for r in range(args.repeats):
            order = modules if r % 2 == 0 else modules[::-1]
            for name, module in order:
                t0 = time.perf_counter()
                mx.eval([module.paged_decode_attention(*a, scale) for _ in range(calls)])
                per[name].append((time.perf_counter() - t0) / calls)
        line = f"{'q8_0' if q8 else 'float32':>7} {span:>5} {rows:>4}"
        for name, _ in modules:
            t = statistics.median(per[name])
            line += f" {t / rows * 1e6:>22.2f} {t / rows * calls * 1e3:>12.3f}"
        if len(modules) > 1:
            ratios = [b / n for n, b in zip(per[modules[0][0]], per[modules[1][0]])]
            line += f"   {statistics.median(ratios):.2f}x"
        print(line, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", default="256,2048")
    p.add_argument("--rows", default="1,5,32")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--layers", type=int, default=30, help="calls a timing takes (a step's layers)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="the extension's threads (default: slotinfer's)")
    p.add_argument("--baseline", default=None, help="another build's _qkernel*.so to check and time against")
    p.add_argument("--check", type=int, default=300, help="random cases compared bit for bit (with --baseline)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    args.spans = [int(s) for s in args.spans.split(",")]
    args.rows = [int(r) for r in args.rows.split(",")]
    new = qkernel.load()
    if new is None:
        raise SystemExit(f"the extension is {qkernel.status()}")
    if args.threads:
        new.set_threads(args.threads)
    modules = [("this", new)]
    if args.baseline:
        old = load_baseline(args.baseline)
        old.set_threads(new.threads())
        if args.check:
            check(new, old, args.check, args.seed)
        modules.append(("baseline", old))
    time_forms(modules, args)


if __name__ == "__main__":
    main()
