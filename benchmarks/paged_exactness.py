"""Greedy tokens with decode attention read from pool blocks, against today's contiguous path.

Issue #27: the engine's greedy tokens must equal ``Model.generate`` alone.  Paged P·V sums per
block, then across blocks (``kv.paged_attend``), which rounds differently from one contiguous
product.  For each model this runs greedy decodes of a few prompts of different lengths:

- **today**: ``Model.generate(ids, ignore_eos=True)`` (contiguous K/V, the reference path);
- **paged alone**: the same prompt's K/V (prefilled as ``generate`` prefills it) written into
  pool blocks through a block table, then each decode step through a one-row
  :class:`~slotinfer.kv.paged_attention.PagedDecodeView` whose table holds exactly the row's blocks;
- **paged batched**: the prompts together as the engine would run them: rows padded with two
  idle rows (their writes go to TRASH), tables padded with ZERO blocks to a common width rounded
  up to 2 blocks, blocks scattered over the pool, attention split over the CPU policy's streams,
  each step compiled;
- **contiguous batched**: the same, with each step's blocks copied out into contiguous K/V and
  attended by today's ``attend_split``: today's attention at the same row count.

It reports, per model, block size and row count (``--rows``): rows whose tokens differ (and the
first step where they do) between paged alone and today, the largest logit difference there,
rows that differ between paged and contiguous batched, rows and the largest logit difference
between contiguous batched and today (0: bit for bit), and whether paged batched equals paged alone bit for bit (tokens
and every step's logits).  From 8 rows on, the linear layers' products sum in another form than
one row's (docs/blas.md), so batched and alone differ in the last bits whatever attention does;
below 8 they do not, and there any difference is attention's.  The model's attention reaches the
paged view through a stand-in for the one branch the wiring adds to ``transformer.Attention``
(:func:`paged_attention_installed`).

    python benchmarks/paged_exactness.py                       # tiny random models of every family, SmolLM2
    python benchmarks/paged_exactness.py --families llama,gemma2 --no-smollm2 --steps 16
"""

from __future__ import annotations

import argparse
import contextlib
from collections import OrderedDict
import tempfile
import time
from pathlib import Path

import slotinfer  # noqa: F401  (first: installs the BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np

from slotinfer import device
from slotinfer.kv.views import SequenceCache
from slotinfer.kv import BlockPool, write_index
from slotinfer.kv.paged_attention import PagedDecodeView, PagedKV
from slotinfer.models import transformer
from slotinfer.kv.slot_table import scatter


@contextlib.contextmanager
def paged_attention_installed(contiguous: bool = False):
    """The model's attention sends a :class:`PagedKV` to its own ``attend`` (what the wiring's
    branch in ``transformer.Attention`` will do); contiguous K/V go to ``attend_split`` as before.

    ``contiguous``: instead, the rows' blocks are copied out into contiguous K/V and attended
    by today's ``attend_split``: today's attention on the same values, in the same harness."""
    original = transformer.attend_split

    def attend_any(q, k, v, scale, mask, softcap, ops, split):
        if not isinstance(k, PagedKV):
            return original(q, k, v, scale, mask, softcap, ops, split)
        if not contiguous:
            return k.attend(q, scale, mask, softcap, ops, split)
        b, nblk = k.tables.shape
        _, kvh, bs, d = k.keys.shape

        def rows(pool):
            return mx.take(pool, k.tables, axis=0).transpose(0, 2, 1, 3, 4).reshape(b, kvh, nblk * bs, d)
        return original(q, rows(k.keys), rows(k.values), scale, mask, softcap, ops, split)

    transformer.attend_split = attend_any
    try:
        yield
    finally:
        transformer.attend_split = original


class PagedRunner:
    """Greedy decoding of rows whose K/V live in a block pool (one ``[blocks, kv_heads, bs, D]``
    array per layer), the host keeping the block tables (:class:`~slotinfer.kv.BlockPool`)."""

    def __init__(self, model, *, block_size: int, slots: int, max_len: int, seed: int = 0):
        cfg = model.config
        self.model, self.net, self.bs = model, model.net, block_size
        self.max_blocks = -(-max_len // block_size)
        num_blocks = 2 + slots * self.max_blocks + 8
        self.pool = BlockPool(num_blocks, block_size, slots=slots, max_blocks=self.max_blocks)
        # blocks scattered over the pool: take the free queue in a random order
        order = np.random.default_rng(seed).permutation(list(self.pool.free))
        self.pool.free = OrderedDict.fromkeys(order.tolist())
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.keys = [mx.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_layers)]
        self.values = [mx.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_layers)]
        self.kvh, self.d, self.num_blocks = cfg.num_kv_heads, cfg.head_dim, num_blocks
        self.lengths = np.zeros(slots, dtype=np.int32)
        self._compiled = {}

    def _index(self, slots, positions):
        blocks, offsets = self.pool.locate(np.asarray(slots), np.asarray(positions))
        return write_index(mx.array(blocks), mx.array(offsets), kv_heads=self.kvh, block_size=self.bs,
                           head_dim=self.d, num_blocks=self.num_blocks)

    def prefill(self, slot: int, ids) -> int:
        """Prefill ``ids`` as ``Model.generate`` does (contiguous, alone), put its K/V in ``slot``'s
        blocks, and return the first greedy token."""
        cache = SequenceCache(self.model.config.num_layers)
        h = self.net(mx.array([ids]), cache)
        self.pool.grow(slot, len(ids))
        index = self._index([slot], np.arange(len(ids))[None])
        for layer in range(len(self.keys)):
            self.keys[layer] = scatter(self.keys[layer], index, cache.keys[layer])
            self.values[layer] = scatter(self.values[layer], index, cache.values[layer])
        self.lengths[slot] = len(ids)
        logits = self.net.head(h[:, -1, :])
        mx.eval(logits, self.keys, self.values)
        return int(mx.argmax(logits, axis=-1).item())

    def _step_fn(self, compiled: bool):
        def step(tok, offset, mask_pos, tables, index, keys, values):
            view = PagedDecodeView(keys, values, index, offset, tables, mask_pos)
            logits = self.net.head(self.net(tok[:, None], view)[:, 0])
            return [logits, *view.keys, *view.values]
        if not compiled:
            return step
        fn = mx.compile(lambda *a: step(*a[:5], list(a[5:5 + len(self.keys)]), list(a[5 + len(self.keys):])))
        return lambda tok, offset, mask_pos, tables, index, keys, values: fn(tok, offset, mask_pos, tables, index,
                                                                            *keys, *values)

    def step(self, rows, tokens, *, pad_to: int | None = None, table_bucket: int = 1, compiled: bool = False):
        """One decode step for the live ``rows`` (slots) feeding ``tokens``; returns their logits
        [len(rows), vocab].  ``pad_to``: add idle rows up to that many (writes to TRASH);
        the tables are cut to the widest row's blocks, rounded up to ``table_bucket``."""
        rows = list(rows)
        n = pad_to or len(rows)
        for s in rows:
            self.pool.grow(s, int(self.lengths[s]) + 1)
        idle = [s for s in range(self.pool.tables.shape[0]) if s not in rows][: n - len(rows)]
        picked = rows + idle
        nblk = max(int(self.pool.held[s]) for s in rows)
        nblk = min(-(-nblk // table_bucket) * table_bucket, self.max_blocks)
        pos = np.array([self.lengths[s] if s in rows else -1 for s in picked], dtype=np.int32)
        index = self._index(picked, pos[:, None])
        offset = mx.array(np.maximum(pos, 0))
        mask_pos = mx.array(np.where(pos >= 0, pos, nblk * self.bs - 1))
        tables = mx.array(self.pool.tables[picked, :nblk])
        tok = mx.array(list(tokens) + [0] * len(idle), dtype=mx.int32)
        key = (compiled, n, nblk)
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._step_fn(compiled)
        out = fn(tok, offset, mask_pos, tables, index, self.keys, self.values)
        L = len(self.keys)
        logits, self.keys, self.values = out[0], list(out[1:1 + L]), list(out[1 + L:])
        mx.eval(logits, self.keys, self.values)
        for s in rows:
            self.lengths[s] += 1
        assert not np.isnan(np.array(logits[: len(rows)])).any()
        return logits[: len(rows)]


def greedy(runner, prompts, steps: int, *, batched: bool, pad_to=None, table_bucket=1, compiled=False):
    """Greedy tokens (and every step's logits) of each prompt: all rows in each step when
    ``batched``, else each prompt alone from start to end."""
    out_tokens, out_logits = [[] for _ in prompts], [[] for _ in prompts]
    groups = [list(range(len(prompts)))] if batched else [[i] for i in range(len(prompts))]
    for group in groups:
        last = [runner.prefill(i, prompts[i]) for i in group]
        for i, t in zip(group, last):
            out_tokens[i].append(t)
        for _ in range(steps - 1):
            logits = runner.step(group, last, pad_to=pad_to if batched else None,
                                 table_bucket=table_bucket if batched else 1, compiled=compiled)
            last = np.array(mx.argmax(logits, axis=-1)).tolist()
            for j, i in enumerate(group):
                out_tokens[i].append(last[j])
                out_logits[i].append(np.array(logits[j]))
        for i in group:
            runner.pool.release_slot(i)
            runner.lengths[i] = 0
    return out_tokens, out_logits


def contiguous_logits(model, ids, tokens):
    """Each decode step's logits on today's reference path (``SequenceCache``, as ``Model.generate``
    runs it) when it is fed ``tokens``."""
    cache = SequenceCache(model.config.num_layers)
    model.net(mx.array([ids]), cache)
    cache.advance(len(ids))
    out = []
    for t in tokens:
        out.append(np.array(model.net.head(model.net(mx.array([[t]]), cache)[:, -1])[0]))
        cache.advance(1)
    return out


def first_flips(a, b):
    """For each row, the first step where the token lists ``a`` and ``b`` differ (rows that never do left out)."""
    return [next(i for i, (x, y) in enumerate(zip(ra, rb)) if x != y) for ra, rb in zip(a, b) if ra != rb]


def bit_equal(a_logits, b_logits):
    return all(np.array_equal(x, y) for ra, rb in zip(a_logits, b_logits) for x, y in zip(ra, rb))


def compare(model, prompts, steps: int, block_size: int, *, pad_to: int, table_bucket: int, seed: int = 0):
    """Greedy tokens of each prompt four ways, and how they differ:

    - today: ``Model.generate`` alone (contiguous attention, one row);
    - paged alone: one row, attention through pool blocks;
    - paged batched / contiguous batched: all prompts in each step, padded to ``pad_to`` rows,
      compiled, attention through the blocks or through today's ``attend`` on the same values.

    The linear layers' products take another summation form from 8 rows on (docs/blas.md), so
    alone and batched can differ there whatever attention does; the batched pair isolates
    attention at the same row count.
    """
    max_len = max(len(p) for p in prompts) + steps + 1
    today = [model.generate(p, max_tokens=steps, ignore_eos=True).tokens for p in prompts]
    today_logits = [contiguous_logits(model, p, t[:-1]) for p, t in zip(prompts, today)]

    def run(batched, seed, contiguous=False):
        runner = PagedRunner(model, block_size=block_size, slots=pad_to, max_len=max_len, seed=seed)
        with paged_attention_installed(contiguous):
            return greedy(runner, prompts, steps, batched=batched, pad_to=pad_to, table_bucket=table_bucket,
                          compiled=batched)

    alone, alone_logits = run(False, seed)
    paged, paged_logits = run(True, seed + 1)
    contig, contig_logits = run(True, seed + 2, contiguous=True)
    def fed_alike(ta, la, tb, lb):  # logits of the steps where two runs were fed the same tokens
        return [(a, b) for xa, xb, ra, rb in zip(ta, tb, la, lb) for k, (a, b) in enumerate(zip(ra, rb))
                if xa[:k + 1] == xb[:k + 1]]

    pairs = fed_alike(alone, alone_logits, today, today_logits)
    return dict(rows=len(prompts), total=pad_to,
                alone_vs_today=first_flips(alone, today),
                drift=max((float(np.max(np.abs(a - b))) for a, b in pairs), default=0.0),
                paged_vs_contig=first_flips(paged, contig),
                contig_vs_today=first_flips(contig, today),
                contig_drift=max((float(np.max(np.abs(a - b)))
                                  for a, b in fed_alike(contig, contig_logits, today, today_logits)), default=0.0),
                alone_equals_paged=alone == paged and bit_equal(alone_logits, paged_logits))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    from slotinfer.testing import FAMILIES, make_tiny_model
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--tiny-blocks", default="4,16", help="block sizes for the tiny models")
    ap.add_argument("--smollm2-blocks", default="32,128")
    ap.add_argument("--no-smollm2", action="store_true")
    ap.add_argument("--steps", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--smollm2-steps", type=int, default=32)
    ap.add_argument("--rows", default="4,8", help="prompts decoded together (each run adds 2 padding rows); "
                    "the linear products change form from 8 rows")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    device.retain_freed_memory()
    rng = np.random.default_rng(args.seed)
    print(f"ops {device.model_ops().name!r}, {device.model_ops().attention_streams} attention streams")
    print("| model | block | rows (+ padding) | paged alone vs today: rows flipped (at step) | logits max abs diff "
          "| batched, paged vs contiguous: rows flipped | batched contiguous vs today: rows flipped | logits max abs diff "
          "| paged batched == paged alone, bit for bit |")
    print("|---|---:|---:|---|---:|---|---|---:|---|")

    def flips(f):
        return f"{len(f)}" + (f" (at {', '.join(map(str, f))})" if f else "")

    def report(name, model, prompts, blocks, steps):
        for bs in blocks:
            for rows in args.rows:
                t = time.perf_counter()
                r = compare(model, prompts[:rows], steps, bs, pad_to=rows + 2, table_bucket=2, seed=args.seed)
                print(f"| {name} | {bs} | {r['rows']} (+2) | {flips(r['alone_vs_today'])} | {r['drift']:.1e} "
                      f"| {flips(r['paged_vs_contig'])} | {flips(r['contig_vs_today'])} | {r['contig_drift']:.1e} "
                      f"| {'yes' if r['alone_equals_paged'] else 'no'} |  <!-- {time.perf_counter() - t:.0f} s -->",
                      flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            make_tiny_model(family, Path(tmp) / family)
            model = slotinfer.load(Path(tmp) / family)
            vocab = model.config.vocab_size
            prompts = [rng.integers(3, vocab, n).tolist() for n in (3, 61, 17, 100, 9, 40, 26, 77)]
            report(family, model, prompts, [int(b) for b in args.tiny_blocks.split(",")], args.steps)
    if not args.no_smollm2:
        from slotinfer import default_model
        path = default_model.path()
        if path is None:
            print(f"{default_model.NAME} is not installed ({default_model.INSTALL})")
            return
        model = slotinfer.load(path)
        texts = [("Write a short story about a lighthouse keeper who finds a message in a bottle.", 1),
                 ("Summarize the causes of the First World War. ", 60),
                 ("Explain how a refrigerator works, step by step, to a ten-year-old. ", 12),
                 ("Describe the water cycle. ", 120),
                 ("What is the capital of France?", 1),
                 ("List the planets of the solar system with one fact about each. ", 30),
                 ("Translate into French: the weather is nice today and we will walk to the market. ", 50),
                 ("Give three tips for learning to play the guitar. ", 20)]
        prompts = [model.encode_prompt(model.chat_prompt(messages=[{"role": "user", "content": t * n}])) for t, n in texts]
        print(f"<!-- SmolLM2 prompts of {[len(p) for p in prompts]} tokens -->")
        report("SmolLM2-135M", model, prompts, [int(b) for b in args.smollm2_blocks.split(",")], args.smollm2_steps)


if __name__ == "__main__":
    main()
