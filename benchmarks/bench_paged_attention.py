"""One layer's decode attention over paged K/V blocks against today's contiguous slot rows.

Issue #27 item 4 ("measure first"): 32 rows each attend one new query over its cached
K/V, float32, for the SmolLM2-135M shape (9 query heads, 3 K/V heads, head_dim 64) and the
Qwen3-0.6B shape (16, 8, 128), at several spans and block sizes.  The forms, all split
over the CPU policy's concurrent streams by rows as the engine splits decode attention
(``device.model_ops()``):

- contiguous: today's slot table ``[rows, kv_heads, capacity, head_dim]``, read as
  ``[:, :, :span]`` with a length mask through ``transformer.attend_split`` (what a decode
  step runs);
- gather: a block pool ``[blocks, kv_heads, block, head_dim]`` and a block table per row;
  ``mx.take`` copies each row's blocks into contiguous K/V (one copy, head-major blocks),
  then the same ``attend``;
- gather_mm: no copy.  Scores per (row, head, block) straight out of the pool with
  ``mx.gather_mm``, one softmax over all of a row's block scores with the length mask,
  P.V per block with ``gather_mm`` again, and a sum over blocks;
- paged_attend: the library's form (``slotinfer.kv.paged_attend``), gather_mm's products with
  the scores laid out as contiguous ones for the ops' softmax, and the blocks' P.V partials
  summed as a chain in block order, so that a row alone equals the row in any batch bit for bit;
- grouped (not today's code, for comparison): the contiguous table, with each K/V head's
  query heads as the rows of one product, as gather_mm has them.

Each row's position is random in [span/2, span) (one row at span - 1); block tables are a
random permutation of the pool, so a row's blocks are scattered as they would be after
some traffic.  Before any timing, each form's output is checked against the contiguous
one (absolute difference under ``--atol``), so a wrong formulation is never timed.  Then
the forms run in turn, in a rotating order, ``--repeats`` rounds after a warm-up.  Times
are medians; ratios are medians of the ratios within each round, so that a busy moment
of the shared machine weighs on both sides of a ratio.

Each round also times one layer's linear products at the same rows (fused q|k|v, o,
fused gate|up, down, taking ``--linear-sets`` distinct weight sets in turn so that they
come from memory, as in a step); the LM head is timed once per shape, as a number of
layers' worth of linear time.  From these, a whole decode step's speed against today's
is estimated round by round as (layers x (linear + attention) + head) for each form.
Norms, rope, activations and K/V writes are left out of both sides, so the real step
ratio lies closer to 1 than the estimate.

    python benchmarks/bench_paged_attention.py
    python benchmarks/bench_paged_attention.py --shapes qwen3 --spans 512,2048 --blocks 64 --repeats 40
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx
from slotinfer import device
from slotinfer.kv.views import window_mask
from slotinfer.cpu import fastmath
from slotinfer.kv import paged_attend
from slotinfer.models.transformer import attend, attend_split, cpu_streams


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int


SHAPES = {
    "smollm2": Shape("SmolLM2-135M", 9, 3, 64, 576, 1536, 30, 49152),
    "qwen3": Shape("Qwen3-0.6B", 16, 8, 128, 1024, 3072, 28, 151936),
}


def split_rows(fn, streams: int, rows: int, *per_row):
    """``fn`` over the rows split into ``streams`` parts on concurrent CPU streams, as
    ``attend_split`` splits a decode step's attention; each argument is cut by rows."""
    n = min(streams, rows)
    if n < 2:
        return fn(*per_row)
    cuts = [rows * i // n for i in range(n + 1)]
    outs = []
    for s, lo, hi in zip(cpu_streams(n), cuts, cuts[1:]):
        with mx.stream(s):
            outs.append(fn(*(a[lo:hi] for a in per_row)))
    return mx.concatenate(outs, axis=0)


def block_index(table, kv_heads: int):
    """[rows, kv_heads, blocks]: each (row, head, block)'s matrix in the pool viewed as
    ``[pool_blocks * kv_heads, block, head_dim]`` (head-major blocks: a free view)."""
    return table[:, None, :] * kv_heads + mx.arange(kv_heads, dtype=table.dtype)[None, :, None]


def contiguous_form(shape, span, scale, ops):
    def run(q, keys, values, pos):
        mask = window_mask(pos[:, None], mx.arange(span), None)[:, None]  # as DecodeView.mask
        return attend_split(q, keys[:, :, :span], values[:, :, :span], scale, mask, None, ops,
                            ops.attention_streams)
    return run


def paged_run(part, block: int, head_dim: int, ops):
    """A paged form over the pool: ``part(q, table, pos, kf, vf)`` on each stream's rows,
    with the pools viewed as ``[blocks * kv_heads, block, head_dim]`` (free views)."""
    def run(q, pool_k, pool_v, table, pos):
        kf, vf = pool_k.reshape(-1, block, head_dim), pool_v.reshape(-1, block, head_dim)
        return split_rows(lambda q, t, p: part(q, t, p, kf, vf), ops.attention_streams, q.shape[0], q, table, pos)
    return run


def grouped_form(shape, span, scale, ops):
    """Not today's code: the same contiguous table, with each K/V head's ``rep`` query heads
    as the rows of one product (``attend`` broadcasts them into ``rep`` one-row products)."""
    hkv, d, rep = shape.kv_heads, shape.head_dim, shape.heads // shape.kv_heads

    def part(q, keys, values, pos):
        n = q.shape[0]
        s = (q * scale).reshape(n, hkv, rep, d) @ keys.swapaxes(-1, -2)  # [n, hkv, rep, span]
        s = mx.where(window_mask(pos[:, None], mx.arange(span), None)[:, None], s, -mx.inf)
        return (ops.softmax(s) @ values).reshape(n, hkv * rep, 1, d)

    def run(q, keys, values, pos):
        return split_rows(part, ops.attention_streams, q.shape[0], q, keys[:, :, :span], values[:, :, :span], pos)
    return run


def gather_form(shape, nblk, block, scale, ops):
    hkv, d = shape.kv_heads, shape.head_dim

    def part(q, table, pos, kf, vf):
        n = q.shape[0]
        idx = block_index(table[:, :nblk], hkv)
        keys = mx.take(kf, idx, axis=0).reshape(n, hkv, nblk * block, d)
        values = mx.take(vf, idx, axis=0).reshape(n, hkv, nblk * block, d)
        mask = window_mask(pos[:, None], mx.arange(nblk * block), None)[:, None]
        return attend(q, keys, values, scale, mask, None, ops)
    return paged_run(part, block, d, ops)


def gather_mm_form(shape, nblk, block, scale, ops):
    hkv, d, rep = shape.kv_heads, shape.head_dim, shape.heads // shape.kv_heads
    cols = mx.arange(nblk)[:, None] * block + mx.arange(block)[None]  # [nblk, block]: logical positions

    def part(q, table, pos, kf, vf):
        n = q.shape[0]
        rhs = block_index(table[:, :nblk], hkv)  # [n, hkv, nblk]
        lhs = mx.broadcast_to(mx.arange(n * hkv, dtype=rhs.dtype).reshape(n, hkv, 1), rhs.shape)
        # scores [n, hkv, nblk, rep, block]: each (row, head)'s queries against each of its blocks
        s = mx.gather_mm((q * scale).reshape(n * hkv, rep, d), kf.swapaxes(-1, -2), lhs, rhs)
        visible = cols[None, None, :, None, :] <= pos[:, None, None, None, None]
        s = mx.where(visible, s, -mx.inf)
        e = fastmath.exp(s - mx.max(s, axis=(2, 4), keepdims=True))  # the CPU policy's exp, as in ops.softmax
        p = e / mx.sum(e, axis=(2, 4), keepdims=True)  # softmax over the row's whole span
        o = mx.gather_mm(p.reshape(n * hkv * nblk, rep, block), vf, None, rhs.reshape(-1))
        return o.reshape(n, hkv, nblk, rep, d).sum(axis=2).reshape(n, hkv * rep, 1, d)
    return paged_run(part, block, d, ops)


def library_form(shape, nblk, block, scale, ops):
    """``kv.paged_attend`` as the engine calls it: the decode view's mask, split over the streams."""
    span = nblk * block

    def run(q, pool_k, pool_v, table, pos):
        mask = window_mask(pos[:, None], mx.arange(span), None)[:, None]
        return paged_attend(q, pool_k, pool_v, table[:, :nblk], scale, mask, None, ops, ops.attention_streams)
    return run


def paged_pool(keys, values, block: int, max_span: int, key):
    """The slot table's first ``max_span`` columns laid out as a block pool
    ``[2 + rows * blocks, kv_heads, block, head_dim]`` (blocks 0 and 1 reserved, as the
    design's ZERO and TRASH) at randomly permuted places, and each row's block table."""
    b, hkv, _, d = keys.shape
    nb = max_span // block
    perm = (mx.random.permutation(b * nb, key=key) + 2).astype(mx.int32)
    pools = []
    for cache in (keys, values):
        blocks = cache[:, :, :max_span].reshape(b, hkv, nb, block, d).transpose(0, 2, 1, 3, 4)
        pool = mx.zeros((2 + b * nb, hkv, block, d))
        pool[perm] = blocks.reshape(b * nb, hkv, block, d)
        pools.append(pool)
    mx.eval(pools, perm)
    return pools[0], pools[1], perm.reshape(b, nb)


def timed(fn, args):
    t = time.perf_counter()
    mx.eval(fn(*args))
    return time.perf_counter() - t


def interleaved(calls, repeats: int, warmup: int):
    """Times in seconds of each (fn, args) in ``calls``, one list per call, run in turn in a
    rotating order for ``repeats`` rounds: entry ``r`` of every list comes from round ``r``."""
    for fn, args in calls:
        for _ in range(warmup):
            mx.eval(fn(*args))
    times = [[0.0] * repeats for _ in calls]
    for r in range(repeats):
        for i in range(len(calls)):
            j = (i + r) % len(calls)
            times[j][r] = timed(*calls[j])
    return times


def paired_ratio(num, den):
    """Median over rounds of ``num[r] / den[r]``: a slow moment of the shared machine hits both."""
    return statistics.median(a / b for a, b in zip(num, den))


class Linear:
    """One decode step's linear products of one layer at ``rows`` rows (fused q|k|v, o, fused
    gate|up, down; weights ``[out, in]`` as ``nn.Linear`` holds them), over ``sets`` distinct
    weight sets taken in turn so that each call reads its weights from memory, as a step does."""

    def __init__(self, shape, rows: int, sets: int):
        h, self.q_dim, kv_dim = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        self.inter = shape.intermediate
        self.weights = []
        for _ in range(sets):
            w = (mx.random.normal((self.q_dim + 2 * kv_dim, h)) * 0.02, mx.random.normal((h, self.q_dim)) * 0.02,
                 mx.random.normal((2 * self.inter, h)) * 0.02, mx.random.normal((h, self.inter)) * 0.02)
            mx.eval(w)
            self.weights.append(w)
        self.x = mx.random.normal((rows, h))
        mx.eval(self.x)
        self.turn = 0

    def __call__(self):
        qkv, o, gate_up, down = self.weights[self.turn]
        self.turn = (self.turn + 1) % len(self.weights)
        y = self.x + (self.x @ qkv.T)[:, : self.q_dim] @ o.T
        return y + (y @ gate_up.T)[:, : self.inter] @ down.T


def head_per_layer(shape, linear, rows: int, repeats: int):
    """The LM head's time in layers' worth of linear time (median of paired rounds)."""
    head = mx.random.normal((shape.vocab, shape.hidden)) * 0.02
    x = mx.random.normal((rows, shape.hidden))
    mx.eval(head, x)
    t_head, t_layer = interleaved([(lambda: x @ head.T, ()), (linear, ())], repeats, 2)
    return paired_ratio(t_head, t_layer), statistics.median(t_head) * 1e3


def attention_rows(shape, spans, blocks, rows, args, ops):
    """Rows of the attention table for one shape."""
    max_span = max(spans)
    capacity = max_span + 1  # the slot table's columns: max_len plus the trash column
    kq, kk, kv, kt = mx.random.split(mx.random.key(args.seed), 4)
    keys = mx.random.normal((rows, shape.kv_heads, capacity, shape.head_dim), key=kk)
    values = mx.random.normal((rows, shape.kv_heads, capacity, shape.head_dim), key=kv)
    q = mx.random.normal((rows, shape.heads, 1, shape.head_dim), key=kq)
    mx.eval(keys, values, q)
    scale = shape.head_dim ** -0.5
    linear = Linear(shape, rows, args.linear_sets) if args.linear_sets else None
    head_layers, head_ms = head_per_layer(shape, linear, rows, args.repeats) if linear else (0.0, 0.0)
    out = []
    for block in blocks:
        if max_span % block:
            raise SystemExit(f"span {max_span} is not a whole number of {block}-token blocks")
        pool_k, pool_v, table = paged_pool(keys, values, block, max_span, kt)
        for span in spans:
            nblk = -(-span // block)
            pos = mx.random.randint(span // 2, span, (rows,), key=mx.random.key(args.seed * 7919 + span))
            pos = pos.astype(mx.int32)
            pos[0] = span - 1
            forms = {
                "contiguous": (mx.compile(contiguous_form(shape, span, scale, ops)), (q, keys, values, pos)),
                "grouped": (mx.compile(grouped_form(shape, span, scale, ops)), (q, keys, values, pos)),
                "gather": (mx.compile(gather_form(shape, nblk, block, scale, ops)), (q, pool_k, pool_v, table, pos)),
                "gather_mm": (mx.compile(gather_mm_form(shape, nblk, block, scale, ops)),
                              (q, pool_k, pool_v, table, pos)),
                "paged_attend": (mx.compile(library_form(shape, nblk, block, scale, ops)),
                                 (q, pool_k, pool_v, table, pos)),
            }
            ref = forms["contiguous"][0](*forms["contiguous"][1])
            diffs = {}
            for name in ("grouped", "gather", "gather_mm", "paged_attend"):
                got = forms[name][0](*forms[name][1])
                diffs[name] = mx.max(mx.abs(got - ref)).item()
                if not diffs[name] < args.atol:  # also catches NaN
                    raise SystemExit(f"{shape.name} span {span} block {block}: {name} differs from contiguous "
                                     f"by {diffs[name]:.3g} (atol {args.atol}); not timing a wrong formulation")
            calls = list(forms.values()) + ([(linear, ())] if linear else [])
            times = dict(zip(list(forms) + ["linear"], interleaved(calls, args.repeats, args.warmup)))
            row = dict(shape=shape.name, span=span, block=block, diff=max(diffs[n] for n in ("gather", "gather_mm", "paged_attend")),
                       grouped_diff=diffs["grouped"], linear_ms=statistics.median(times.get("linear", [0])) * 1e3,
                       head_ms=head_ms)
            for name in forms:
                row[name] = statistics.median(times[name]) * 1e3
                row[name + "_ratio"] = paired_ratio(times[name], times["contiguous"])
                if linear:  # the whole step, estimated round by round: today's time over this form's
                    row[name + "_step"] = statistics.median(
                        (shape.layers * (lin + c) + head_layers * lin) / (shape.layers * (lin + f) + head_layers * lin)
                        for lin, c, f in zip(times["linear"], times["contiguous"], times[name]))
                    row["share"] = statistics.median(
                        shape.layers * c / (shape.layers * (lin + c) + head_layers * lin)
                        for lin, c in zip(times["linear"], times["contiguous"]))
            out.append(row)
            print(f"  {shape.name} span {span:>5} block {block:>4}: "
                  + "  ".join(f"{k} {row[k]:.2f} ms" for k in forms)
                  + (f"  linear {row['linear_ms']:.2f} ms/layer" if linear else ""), flush=True)
        del pool_k, pool_v, table
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="smollm2,qwen3", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--spans", default="128,512,1024,2048")
    ap.add_argument("--blocks", default="16,32,64,128", help="block sizes, tokens")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per point (the medians' sample)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--linear-sets", type=int, default=8,
                    help="distinct weight sets for the linear timing (0: no step estimate)")
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device.retain_freed_memory()  # the CPU policy the loader applies: the engine's allocator behaviour
    ops = device.model_ops()
    spans = [int(s) for s in args.spans.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    print(f"{args.rows} rows, f32, ops {ops.name!r}, {ops.attention_streams} attention streams; "
          f"medians of {args.repeats} interleaved rounds")
    results = []
    for shape in shapes:
        results += attention_rows(shape, spans, blocks, args.rows, args, ops)
    step = args.linear_sets > 0
    print()
    print("Attention of one layer, ms; paged / contiguous: time ratios (median of per-round ratios)"
          + ("; step speed: a whole decode step's speed against today's, estimated" if step else ""))
    print()
    head = ("| shape | span | block | contiguous | gather | gather_mm | paged_attend | gather / contiguous "
            "| gather_mm / contiguous | paged_attend / contiguous")
    head += " | step speed, gather | step speed, gather_mm | step speed, paged_attend |" if step else " |"
    print(head + " max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if step else "") + "---:|")
    for r in results:
        line = (f"| {r['shape']} | {r['span']} | {r['block']} | {r['contiguous']:.2f} | {r['gather']:.2f} "
                f"| {r['gather_mm']:.2f} | {r['paged_attend']:.2f} | {r['gather_ratio']:.2f} "
                f"| {r['gather_mm_ratio']:.2f} | {r['paged_attend_ratio']:.2f} |")
        if step:
            line += f" {r['gather_step']:.2f}x | {r['gather_mm_step']:.2f}x | {r['paged_attend_step']:.2f}x |"
        print(line + f" {r['diff']:.1e} |")
    print()
    print("Per shape and span, over all block sizes: today's attention and linear time per layer, attention's share "
          "of an estimated step, and (not today's code) the contiguous table with grouped query rows")
    print()
    print("| shape | span | contiguous ms | linear ms | attention share of step | grouped / contiguous "
          "| grouped step speed | grouped max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for shape in shapes:
        for span in spans:
            rs = [r for r in results if r["shape"] == shape.name and r["span"] == span]
            med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
            print(f"| {shape.name} | {span} | {med('contiguous'):.2f} | "
                  + (f"{med('linear_ms'):.2f} | {med('share'):.0%} | " if step else "- | - | ") + f"{med('grouped_ratio'):.2f} | "
                  + (f"{med('grouped_step'):.2f}x | " if step else "- | ")
                  + f"{max(r['grouped_diff'] for r in rs):.1e} |")


if __name__ == "__main__":
    main()
