"""The slot table's K/V in pool blocks (slotinfer.kv.slot_table) against a numpy reference.

Engine-level equality with Model.generate (test_properties) covers the table end to end;
here it is held to its own contract: a write through a slot's block table lands at exactly the
(slot, head, position) vectors named, eagerly and inside a compiled step; padding lands in TRASH;
reads give back what was written; blocks go back to the pool when a slot is released.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotinfer.errors import InvalidRequestError
from slotinfer.kv import TRASH, write_index
from slotinfer.kv.slot_table import SlotTable, scatter


def _table(slots, kv_heads, max_len, head_dim, block_size, blocks):
    cfg = SimpleNamespace(num_kv_heads=kv_heads, head_dim=head_dim, num_layers=1)
    each = 2 * kv_heads * block_size * head_dim * 4
    return SlotTable(cfg, slots=slots, max_len=max_len, dtype=mx.float32, kv_cache_bytes=blocks * each,
                     block_size=block_size)


def _read(t, slot, start, stop):
    """Copies of ``slot``'s K/V at positions ``start:stop``, ``[layers, kv_heads, n, head_dim]`` each."""
    return (mx.stack([t.gather(k, [slot], stop)[0, :, start:] for k in t.keys]),
            mx.stack([t.gather(v, [slot], stop)[0, :, start:] for v in t.values]))


def _write(t, slot, keys, values):
    """Put ``keys`` and ``values`` (``[layers, kv_heads, n, head_dim]``) at ``slot``'s positions 0..n-1."""
    index = t.index([slot], np.arange(keys.shape[2])[None])
    for layer in range(len(t.keys)):
        t.keys[layer] = scatter(t.keys[layer], index, keys[layer][None])
        t.values[layer] = scatter(t.values[layer], index, values[layer][None])


@st.composite
def writes(draw):
    slots, heads = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    max_len, dim, bs = draw(st.integers(2, 20)), draw(st.sampled_from([1, 4])), draw(st.sampled_from([1, 3, 8]))
    lengths = [draw(st.integers(1, max_len)) for _ in range(slots)]
    rows = draw(st.lists(st.integers(0, slots - 1), min_size=1, max_size=slots, unique=True))
    L = draw(st.integers(1, min(lengths[r] for r in rows)))
    # distinct positions within each row (a chunk's tokens), or -1: padding
    pos = [draw(st.lists(st.integers(0, lengths[r] - 1), min_size=L, max_size=L, unique=True)) for r in rows]
    pad = [[draw(st.booleans()) and j > 0 for j in range(L)] for _ in rows]
    return slots, heads, max_len, dim, bs, lengths, rows, [[-1 if q else p for p, q in zip(ps, qs)]
                                                          for ps, qs in zip(pos, pad)]


@settings(max_examples=60, deadline=None)
@given(writes(), st.booleans(), st.integers(0, 2**32 - 1))
def test_writes_land_at_the_named_positions_of_each_slot(case, compiled, seed):
    slots, heads, max_len, dim, bs, lengths, rows, pos = case
    need = sum(-(-n // bs) for n in lengths)
    t = _table(slots, heads, max_len, dim, bs, need + 2 + 3)
    for s, n in enumerate(lengths):
        t.admit(s, n)
    rng = np.random.default_rng(seed)
    before = {s: rng.standard_normal((heads, lengths[s], dim)).astype(np.float32) for s in range(slots)}
    for s in range(slots):
        _write(t, s, mx.array(before[s])[None], mx.array(before[s])[None])
    new = rng.standard_normal((len(rows), heads, len(pos[0]), dim)).astype(np.float32)

    def write(cache, index, new_):
        return scatter(cache, index, new_)

    fn = mx.compile(write) if compiled else write
    t.keys[0] = fn(t.keys[0], t.index(rows, np.array(pos)), mx.array(new))
    for s in range(slots):
        want = before[s].copy()
        if s in rows:
            i = rows.index(s)
            for j, p in enumerate(pos[i]):
                if p >= 0:
                    want[:, p] = new[i, :, j]
        np.testing.assert_array_equal(np.asarray(_read(t, s, 0, lengths[s])[0][0]), want)
        np.testing.assert_array_equal(np.asarray(_read(t, s, 0, lengths[s])[1][0]), before[s])  # values untouched
    if any(p < 0 for ps in pos for p in ps):
        assert np.any(np.asarray(t.keys[0][TRASH]) != 0)  # padding went to TRASH
    assert not np.any(np.asarray(t.keys[0][0]))  # ZERO is never written
    for s in range(slots):
        t.release(s)
    assert t.pool.num_free == t.num_blocks - 2 and t.stats()["blocks_used"] == 0


def test_admission_reserves_blocks_and_a_write_past_them_is_refused():
    t = _table(2, 1, 16, 4, 4, 2 + 5)
    assert t.can_admit(12) and t.capacity_tokens == 16
    t.admit(0, 12)  # 3 blocks
    assert t.stats()["blocks_used"] == 3 and not t.can_admit(12) and t.can_admit(8)
    with pytest.raises(InvalidRequestError, match="grow the slot first"):
        t.index([0], np.array([[12]]))
    t.release(0)
    assert t.can_admit(16)


def test_offsets_widen_to_int64_only_past_int32():
    """A layer of 2**31 elements or more needs 64-bit offsets; smaller ones keep 32-bit."""
    def last_offsets(num_blocks, heads, bs, dim):
        return write_index(mx.array([[num_blocks - 1]]), mx.array([[bs - 1]]), kv_heads=heads, block_size=bs,
                           head_dim=dim, num_blocks=num_blocks)

    assert last_offsets(2048, 8, 1024, 128).dtype == mx.int64  # 2**31 elements exactly
    assert last_offsets(2047, 8, 1024, 128).dtype == mx.int32
    last = last_offsets(2500, 8, 1024, 128)
    assert int(last[-1].item()) == 2500 * 8 * 1024 * 128 - 1  # no wrap-around


def test_the_arrays_grow_with_the_blocks_in_use_up_to_the_budget_keep_what_they_hold_and_shrink_when_idle():
    t = _table(4, 1, 8, 2, 4, 2 + 8)  # 8 usable blocks of 4 tokens; a slot holds 2
    assert t.keys[0].shape[0] == 2 + 2 and t.budget_bytes == 10 * t.block_nbytes
    t.admit(0, 8)
    _write(t, 0, mx.ones((1, 1, 8, 2)), mx.ones((1, 1, 8, 2)))
    for s in (1, 2, 3):
        t.admit(s, 8)
    assert t.keys[0].shape[0] == 4  # blocks taken; the arrays grow when a write needs them
    t.cover()
    assert t.keys[0].shape[0] == 10 and t.allocated_bytes == 10 * t.block_nbytes
    np.testing.assert_array_equal(np.asarray(_read(t, 0, 0, 8)[0]), np.ones((1, 1, 8, 2)))
    assert not np.any(np.asarray(t.keys[0][0]))  # ZERO stays zero
    for s in (3, 2, 1):
        t.release(s)
    assert t.keys[0].shape[0] == 10  # slot 0 still holds its blocks
    t.release(0)
    assert t.keys[0].shape[0] == 4 and t.stats()["blocks_used"] == 0  # idle: back to one request's


def test_the_arrays_grow_by_a_quarter_at_least_so_a_run_of_growth_copies_them_a_few_times():
    t = _table(40, 1, 8, 2, 4, 2 + 80)
    sizes = [t.keys[0].shape[0]]
    for s in range(40):
        t.grow([s], [8])
        t.cover()
        sizes.append(t.keys[0].shape[0])
    grown = [(a, b) for a, b in zip(sizes, sizes[1:]) if b != a]
    assert sizes[-1] == 82 and all(b >= min(82, a + a // 4) for a, b in grown)  # never past the budget
    assert len(grown) <= 14  # from 4 to 82 blocks: log(82 / 4) / log(1.25) < 14, where one a block would be 78
