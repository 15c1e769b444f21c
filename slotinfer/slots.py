"""The slot table: the Inferencer's device state, and the attention views the model runs through.

Each of the ``b`` slots holds one item's K/V cache, preallocated once for every layer
as ``[b, kv_heads, capacity, head_dim]``; ``lengths[b]`` says how many tokens each holds
and ``new_batch_idx[b]`` which slots still await their prompt, as in the seed design.  Column ``max_len`` is a trash column:
writes of padding and of idle rows land there, so no real position is ever clobbered
and no shape has to change.  The model never sees slots: it calls ``ctx.update`` and
``ctx.mask`` on one of the views below, exactly as on the single-sequence cache.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import device
from .cache import window_mask
from .errors import OutOfMemoryError


class SlotTable:
    """Per-layer K/V for ``slots`` rows of up to ``max_len`` tokens each."""

    def __init__(self, config, *, slots: int, max_len: int, dtype):
        self.slots, self.max_len = slots, max_len
        self.capacity = max_len + 1  # + the trash column
        self.kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        shape = (slots, self.kv_heads, self.capacity, self.head_dim)
        _check_fits(2 * config.num_layers * int(np.prod(shape)) * dtype.size, slots, max_len)
        self.keys = [mx.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [mx.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        mx.eval(self.keys, self.values)
        # Host-side, per slot: tokens cached (0: empty; a decode step writes its token there), and
        # a newly admitted slot's place in the prefill queue, FIFO (-1: not new, its prompt is in).
        self.lengths = np.zeros(slots, dtype=np.int32)
        self.new_batch_idx = np.full(slots, -1, dtype=np.int32)

    def admit(self, slot: int):
        """``slot`` takes a new item: empty, its prompt last in the prefill queue."""
        self.lengths[slot] = 0
        self.new_batch_idx[slot] = int(np.count_nonzero(self.new_batch_idx >= 0))

    def new_slots(self) -> list[int]:
        """The slots whose prompt is still (partly) to prefill, in admission order."""
        new = np.flatnonzero(self.new_batch_idx >= 0)
        return new[np.argsort(self.new_batch_idx[new])].tolist()

    def prompt_in(self, slot: int):
        """``slot``'s prompt is cached: it leaves the prefill queue."""
        i = self.new_batch_idx[slot]
        if i >= 0:
            self.new_batch_idx[self.new_batch_idx > i] -= 1
            self.new_batch_idx[slot] = -1

    def release(self, slot: int):
        """``slot`` is empty again."""
        self.prompt_in(slot)
        self.lengths[slot] = 0

    def read(self, slot: int, start: int, stop: int):
        """Copies of ``slot``'s K/V at positions ``start:stop``, ``[layers, kv_heads, n, head_dim]`` each."""
        return (mx.stack([k[slot, :, start:stop] for k in self.keys]),
                mx.stack([v[slot, :, start:stop] for v in self.values]))

    def write(self, slot: int, keys, values):
        """Put ``keys`` and ``values`` (``[layers, kv_heads, n, head_dim]``) at ``slot``'s positions 0..n-1."""
        index = self.flat_index(mx.array([slot]), mx.arange(keys.shape[2])[None])
        for layer in range(len(self.keys)):
            self.keys[layer] = scatter(self.keys[layer], index, keys[layer][None])
            self.values[layer] = scatter(self.values[layer], index, values[layer][None])

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def flat_index(self, rows, positions):
        """Offsets of every element that (row, position) writes in a layer flattened to 1-D.

        ``rows`` is [n], ``positions`` [n, L]; the result is [n * heads * L * head_dim],
        in the order of a ``[n, heads, L, head_dim]`` update (int64 only when a layer
        holds 2**31 elements or more).  One index per element lets :func:`scatter`
        write with ``put_along_axis``, which MLX's CPU backend runs as one flat loop,
        where a scatter of rows steps two general iterators per element (~3.5x slower
        for a decode step's K/V).
        """
        h, cap, d = self.kv_heads, self.capacity, self.head_dim
        dt = mx.int32 if self.slots * h * cap * d < 2**31 else mx.int64
        heads = mx.arange(h, dtype=dt)
        base = (rows.astype(dt)[:, None] * h + heads[None]) * cap  # [n, heads]
        cols = (base[:, :, None] + positions.astype(dt)[:, None, :]) * d  # [n, heads, L]
        return (cols[..., None] + mx.arange(d, dtype=dt)).reshape(-1)


def _check_fits(need: int, slots: int, max_len: int):
    """Refuse a table larger than the memory available, with a typed error instead of a crash."""
    free = device.memory_available()
    if free is not None and need > free:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        raise OutOfMemoryError(
            f"the K/V slot table of {slots} slots x {max_len} tokens needs {gib(need)} "
            f"({need / slots / (max_len + 1) / 1024:.0f} KiB a token) and {gib(free)} is available here: "
            f"lower slots or max_len")


def scatter(cache, index, new):
    """Write ``new`` [n, heads, L, dim] into ``cache`` at ``index`` (from :meth:`SlotTable.flat_index`);
    returns the updated cache, written in place when nothing else holds ``cache``."""
    flat = mx.put_along_axis(cache.reshape(-1), index, new.reshape(-1).astype(cache.dtype), axis=0)
    return flat.reshape(cache.shape)


class DecodeView:
    """Attention context of one decode step: one new token for each of ``count`` rows.

    ``positions`` [count] is where each row's new token goes (its current length; the
    trash column for padding rows); ``index`` the flat offsets of those writes.  The rows
    are the table's first ``count`` slots when ``rows`` is None (read as a slice), else the
    slots ``rows`` [count] (gathered).  Attention covers the first ``span`` columns only,
    so a step costs what the live rows and lengths need, not the table's capacity.
    """

    def __init__(self, table_keys, table_values, index, positions, span: int, *, rows=None, count: int):
        self.keys, self.values = list(table_keys), list(table_values)
        self.index, self.offset, self.span = index, positions, span
        self.rows, self.count = rows, count
        self._masks = {}

    def update(self, layer, k, v):
        self.keys[layer] = scatter(self.keys[layer], self.index, k)
        self.values[layer] = scatter(self.values[layer], self.index, v)
        # K/V stored in another dtype than the model computes in (float16 on CPU) are read back in its own
        return self._rows(self.keys[layer]).astype(k.dtype), self._rows(self.values[layer]).astype(v.dtype)

    def _rows(self, cache):
        if self.rows is None:
            return cache[: self.count, :, : self.span]
        return mx.take(cache[:, :, : self.span], self.rows, axis=0)

    def mask(self, layer, L, window):
        if window not in self._masks:
            m = window_mask(self.offset[:, None], mx.arange(self.span), window)  # [n, 1, span]
            self._masks[window] = m[:, None]
        return self._masks[window]


class PrefillView:
    """Attention context of the Encoder: new prompt tokens of ``rows``, padded on the right.

    Row ``i`` writes its chunk at ``starts[i] ...``; tokens after ``lens[i]`` are
    padding and go to the trash column.  When every row starts at 0 the queries
    attend to the fresh K/V directly; a later chunk attends to what its slot holds.
    """

    def __init__(self, table, rows, starts, lens, chunk: int, span: int, fresh: bool):
        self.table = table
        self.rows, self.offset = rows, starts
        j = mx.arange(chunk)[None]
        q_pos = starts[:, None] + j  # [n, L]
        write = mx.where(j < lens[:, None], q_pos, table.max_len)
        self.index = table.flat_index(rows, write)
        self.q_pos = q_pos
        self.fresh = fresh
        self.span = chunk if fresh else span
        self._masks = {}

    def update(self, layer, k, v):
        t = self.table
        t.keys[layer] = scatter(t.keys[layer], self.index, k)
        t.values[layer] = scatter(t.values[layer], self.index, v)
        if self.fresh:
            return k, v
        return (t.keys[layer][self.rows, :, : self.span].astype(k.dtype),
                t.values[layer][self.rows, :, : self.span].astype(v.dtype))

    def mask(self, layer, L, window):
        if window not in self._masks:
            k_pos = mx.arange(self.span)
            self._masks[window] = window_mask(self.q_pos, k_pos, window)[:, None]  # [n, 1, L, span]
        return self._masks[window]
