"""Attention over pool blocks: what ``attend`` computes over the same positions laid out
contiguously (to float32 rounding; bit for bit when a row's span is one block), and, bit for
bit, the same for a row alone as in any batch, with any padding blocks and any placement of
its blocks in the pool.  Writes through the block table land where the reads look.
"""

import os
import sys

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotinfer.kv.views import window_mask
from slotinfer.cpu.ops import MLX_OPS, cpu_ops
from slotinfer.kv import TRASH, ZERO, BlockPool
from slotinfer.kv import paged_attend, write_index
from slotinfer.kv.paged_attention import PagedSequenceCache
from slotinfer.models.transformer import attend
from slotinfer.kv.slot_table import scatter
from slotinfer.testing import FAMILIES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"))
from paged_exactness import PagedRunner, greedy, paged_attention_installed  # noqa: E402

# "cpu": the CPU's fused MLX arithmetic; "cpu-native": with the extension's decode attention, one
# node per layer (where the extension is built; else the same as "cpu")
OPS = {"cpu": cpu_ops(native=False), "cpu-native": cpu_ops(), "mlx": MLX_OPS}


@st.composite
def cases(draw):
    """Rows with random lengths in a pool of scattered blocks, and the same K/V laid out contiguously."""
    kvh, rep = draw(st.sampled_from([(1, 1), (1, 4), (3, 3), (2, 8), (4, 2)]))
    d = draw(st.sampled_from([8, 16, 64]))
    bs = draw(st.sampled_from([1, 2, 4, 16, 32, 128]))
    b = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(1, 4 * bs + 3), min_size=b, max_size=b))
    width = -(-max(lengths) // bs) + draw(st.integers(0, 2))  # a table wider than any row needs: ZERO padding
    window = draw(st.sampled_from([None, None, 1, 5, 2 * bs]))
    softcap = draw(st.sampled_from([None, None, 20.0]))
    ops = draw(st.sampled_from(sorted(OPS)))
    seed = draw(st.integers(0, 2**16))
    return dict(kvh=kvh, heads=kvh * rep, d=d, bs=bs, lengths=lengths, width=width, window=window,
                softcap=softcap, ops=ops, seed=seed)


def build(c):
    """(q, contiguous keys and values [b, kvh, width*bs, d], the pools, the block tables, the mask)."""
    rng = np.random.default_rng(c["seed"])
    b, kvh, d, bs, width = len(c["lengths"]), c["kvh"], c["d"], c["bs"], c["width"]
    span = width * bs
    keys = rng.standard_normal((b, kvh, span, d)).astype(np.float32)
    values = rng.standard_normal((b, kvh, span, d)).astype(np.float32)
    need = [-(-n // bs) for n in c["lengths"]]
    ids = rng.permutation(np.arange(2, 2 + sum(need) + 3))  # scattered, a few blocks left over
    pool_k = rng.standard_normal((2 + sum(need) + 3, kvh, bs, d)).astype(np.float32)  # leftovers: other data
    pool_v = rng.standard_normal(pool_k.shape).astype(np.float32)
    pool_k[ZERO] = pool_v[ZERO] = 0
    pool_k[TRASH] = pool_v[TRASH] = np.nan  # what padding writes can leave there: never read
    tables = np.full((b, width), ZERO, dtype=np.int32)
    taken = 0
    for i, n in enumerate(need):
        tables[i, :n] = ids[taken:taken + n]
        taken += n
        for j in range(n):
            pool_k[tables[i, j]] = keys[i, :, j * bs:(j + 1) * bs]
            pool_v[tables[i, j]] = values[i, :, j * bs:(j + 1) * bs]
        keys[i, :, n * bs:] = values[i, :, n * bs:] = 0  # past a row's blocks, contiguous reads what ZERO holds
    q = rng.standard_normal((b, c["heads"], 1, d)).astype(np.float32)
    pos = mx.array(np.array(c["lengths"]) - 1)
    mask = window_mask(pos[:, None], mx.arange(span), c["window"])[:, None]
    return (mx.array(q), mx.array(keys), mx.array(values), mx.array(pool_k), mx.array(pool_v), mx.array(tables),
            mask)


@given(cases())
def test_paged_equals_contiguous_attention(c):
    q, keys, values, pool_k, pool_v, tables, mask = build(c)
    scale, ops = c["d"] ** -0.5, OPS[c["ops"]]
    want = attend(q, keys, values, scale, mask, c["softcap"], ops)
    got = paged_attend(q, pool_k, pool_v, tables, scale, mask, c["softcap"], ops)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-6)
    if c["width"] == 1 and c["ops"] == "cpu" and c["heads"] // c["kvh"] < 8:
        assert mx.array_equal(got, want).item()  # one block, one product form: contiguous bit for bit


@pytest.mark.parametrize("rep", [1, 3, 7])
def test_one_block_is_contiguous_bit_for_bit(rep):
    """A span of one block runs the products contiguous attention runs, while a K/V head has fewer
    than 8 query heads (from 8, the CPU products take another summation form: docs/blas.md).  Of
    the MLX-op form; the native kernel has its own order (held by the hypothesis tests above and
    below, and against float64 in tests/cpu/test_qkernel.py)."""
    c = dict(kvh=2, heads=2 * rep, d=64, bs=32, lengths=[32, 7, 19], width=1, window=None, softcap=None, ops="cpu",
             seed=rep)
    q, keys, values, pool_k, pool_v, tables, mask = build(c)
    want = attend(q, keys, values, 0.125, mask, None, OPS["cpu"])
    assert mx.array_equal(paged_attend(q, pool_k, pool_v, tables, 0.125, mask, None, OPS["cpu"]), want).item()


@given(cases())
def test_float16_storage_reads_as_its_float32_values(c):
    """Pools stored in float16 (the CPU's half-memory option) give what float32 pools holding the
    same (rounded) values give, bit for bit: only the rows' blocks are converted."""
    q, _, _, pool_k, pool_v, tables, mask = build(c)
    pool_k, pool_v = pool_k.astype(mx.float16), pool_v.astype(mx.float16)
    scale, ops = c["d"] ** -0.5, OPS[c["ops"]]
    want = paged_attend(q, pool_k.astype(mx.float32), pool_v.astype(mx.float32), tables, scale, mask, c["softcap"], ops)
    got = paged_attend(q, pool_k, pool_v, tables, scale, mask, c["softcap"], ops)
    assert got.dtype == mx.float32 and mx.array_equal(got, want).item()


@given(cases(), st.integers(1, 4))
def test_a_row_alone_equals_the_row_in_a_batch(c, split):
    """Bit for bit: other rows, padding blocks past a row's length and the stream split change nothing."""
    q, _, _, pool_k, pool_v, tables, mask = build(c)
    scale, ops, bs = c["d"] ** -0.5, OPS[c["ops"]], c["bs"]
    batched = paged_attend(q, pool_k, pool_v, tables, scale, mask, c["softcap"], ops, split=split)
    assert not mx.isnan(batched).any().item()  # TRASH (NaN) is never read
    for i, n in enumerate(c["lengths"]):
        nblk = -(-n // bs)
        alone_mask = window_mask(mx.array([n - 1])[:, None], mx.arange(nblk * bs), c["window"])[:, None]
        alone = paged_attend(q[i:i + 1], pool_k, pool_v, tables[i:i + 1, :nblk], scale, alone_mask, c["softcap"], ops)
        assert mx.array_equal(alone, batched[i:i + 1]).item(), f"row {i}"


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_writes_through_the_table_land_where_reads_look(dtype):
    """Tokens written with BlockPool.locate + write_index + scatter, padding included, read back
    through the tables as the contiguous K/V they were; padding lands in TRASH only."""
    kvh, d, bs, slots = 2, 8, 4, 3
    pool = BlockPool(12, bs, slots=slots, max_blocks=4)
    rng = np.random.default_rng(0)
    lengths = [5, 11, 1]
    contiguous = np.zeros((slots, kvh, 16, d), dtype=np.float32)
    pool_k = mx.zeros((12, kvh, bs, d), dtype=dtype)
    for s, n in enumerate(lengths):
        pool.grow(s, n)
    steps = max(lengths)
    for t in range(steps):  # one token per slot per step, as decode writes; ended slots pad
        pos = np.array([t if t < n else -1 for n in lengths])
        blocks, offsets = pool.locate(np.arange(slots), pos[:, None])
        new = rng.standard_normal((slots, kvh, 1, d)).astype(np.float32)
        for s in range(slots):
            if pos[s] >= 0:
                contiguous[s, :, t] = new[s, :, 0]
        index = write_index(mx.array(blocks), mx.array(offsets), kv_heads=kvh, block_size=bs, head_dim=d,
                            num_blocks=12)
        pool_k = scatter(pool_k, index, mx.array(new))
    back = np.array(pool_k.astype(mx.float32))
    contiguous = np.array(mx.array(contiguous).astype(dtype).astype(mx.float32))  # as stored
    for s, n in enumerate(lengths):
        row = back[pool.tables[s, : pool.held[s]]].transpose(1, 0, 2, 3).reshape(kvh, -1, d)[:, :n]
        np.testing.assert_array_equal(row, contiguous[s, :, :n])
    assert not back[ZERO].any()
    assert back[TRASH].any()  # the padding went there


def reference_greedy(model, ids, steps, block_size):
    """``Model.generate``'s greedy loop over a :class:`PagedSequenceCache`: tokens and each decode
    step's logits."""
    net, cache = model.net, PagedSequenceCache(model.config.num_layers, block_size)
    h = net(mx.array([ids]), cache)
    cache.advance(len(ids))
    tokens, logits = [int(mx.argmax(net.head(h[:, -1]), axis=-1).item())], []
    for _ in range(steps - 1):
        h = net(mx.array([[tokens[-1]]]), cache)
        cache.advance(1)
        step = net.head(h[:, -1])
        logits.append(np.array(step[0]))
        tokens.append(int(mx.argmax(step, axis=-1).item()))
    return tokens, logits


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_alone_equals_batched_bit_for_bit(models, family):
    """Whole models decoding through pool blocks: each prompt alone (a one-row view holding exactly
    its blocks, eager) gives the tokens and every step's logits, bit for bit, that it gives among
    other rows (idle padding rows, ZERO-padded tables, other blocks of the pool, a compiled step).
    So does the reference path's loop over a PagedSequenceCache, which is what ``Model.generate``
    must run through once the engine's decode is paged.  Five rows: from 8 the linear products sum
    in another form than one row's (docs/blas.md)."""
    model = models[family]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (2, 9, 23)]
    steps, bs = 8, 4
    with paged_attention_installed():
        runs = [greedy(PagedRunner(model, block_size=bs, slots=5, max_len=40, seed=seed), prompts, steps,
                       batched=batched, pad_to=5, table_bucket=3, compiled=batched)
                for seed, batched in ((0, False), (1, True))]
        reference = [reference_greedy(model, p, steps, bs) for p in prompts]
    (alone, alone_logits), (batched, batched_logits) = runs
    assert alone == batched == [t for t, _ in reference]
    for a, b, (_, r) in zip(alone_logits, batched_logits, reference):
        assert len(a) == steps - 1 and all(np.array_equal(x, y) and np.array_equal(x, z) for x, y, z in zip(a, b, r))
