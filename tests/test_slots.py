"""The slot table's K/V write (slotinfer.slots.scatter) against a numpy reference.

Engine-level equality with Model.generate (test_properties) covers the write end to end;
here it is held to its own contract: exactly the (row, head, position) vectors named are
written, every other element is left as it was, eagerly and inside a compiled step.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from slotinfer.slots import SlotTable, scatter


def _table(slots, kv_heads, max_len, head_dim):
    cfg = SimpleNamespace(num_kv_heads=kv_heads, head_dim=head_dim, num_layers=1)
    return SlotTable(cfg, slots=slots, max_len=max_len, dtype=mx.float32)


@st.composite
def writes(draw):
    slots, heads = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    max_len, dim = draw(st.integers(2, 20)), draw(st.sampled_from([1, 4, 8]))
    rows = draw(st.lists(st.integers(0, slots - 1), min_size=1, max_size=slots, unique=True))
    L = draw(st.integers(1, max_len))
    # distinct positions within each row (a chunk's tokens), the trash column included
    pos = [draw(st.lists(st.integers(0, max_len), min_size=L, max_size=L, unique=True)) for _ in rows]
    return slots, heads, max_len, dim, rows, pos


@settings(max_examples=60, deadline=None)
@given(writes(), st.booleans(), st.integers(0, 2**32 - 1))
def test_scatter_writes_exactly_the_named_vectors(case, compiled, seed):
    slots, heads, max_len, dim, rows, pos = case
    t = _table(slots, heads, max_len, dim)
    rng = np.random.default_rng(seed)
    before = rng.standard_normal((slots, heads, max_len + 1, dim)).astype(np.float32)
    new = rng.standard_normal((len(rows), heads, len(pos[0]), dim)).astype(np.float32)

    def write(cache, rows_, pos_, new_):
        return scatter(cache, t.flat_index(rows_, pos_), new_)

    fn = mx.compile(write) if compiled else write
    got = np.asarray(fn(mx.array(before), mx.array(rows, dtype=mx.int32), mx.array(pos, dtype=mx.int32),
                        mx.array(new)))
    want = before.copy()
    for i, r in enumerate(rows):
        for j, p in enumerate(pos[i]):
            want[r, :, p, :] = new[i, :, j, :]
    np.testing.assert_array_equal(got, want)


def test_scatter_takes_a_transposed_update():
    """Updates arrive as views ([n, L, heads, dim] transposed); the write follows their logical order."""
    t = _table(3, 2, 6, 4)
    upd = mx.arange(2 * 3 * 2 * 4, dtype=mx.float32).reshape(2, 3, 2, 4).transpose(0, 2, 1, 3)
    rows, pos = mx.array([2, 0]), mx.array([[1, 2, 3], [0, 4, 6]])
    got = np.asarray(scatter(mx.zeros((3, 2, 7, 4)), t.flat_index(rows, pos), upd))
    u = np.asarray(upd)
    np.testing.assert_array_equal(got[2, :, 1:4], u[0])
    np.testing.assert_array_equal(got[0, :, [0, 4, 6]].transpose(1, 0, 2), u[1])
    assert np.count_nonzero(got[1]) == 0


def test_offsets_widen_to_int64_only_past_int32():
    """A layer of 2**31 elements or more needs 64-bit offsets; smaller ones keep 32-bit."""
    def last_offsets(slots, heads, capacity, dim):
        t = SlotTable.__new__(SlotTable)  # the shape only: no K/V allocated
        t.slots, t.kv_heads, t.capacity, t.head_dim = slots, heads, capacity, dim
        return t.flat_index(mx.array([slots - 1]), mx.array([[capacity - 1]]))

    assert last_offsets(64, 8, 32768, 128).dtype == mx.int64  # 2**31 elements exactly
    assert last_offsets(64, 8, 32767, 128).dtype == mx.int32
    last = last_offsets(64, 8, 40000, 128)
    assert int(last[-1].item()) == 64 * 8 * 40000 * 128 - 1  # no wrap-around
