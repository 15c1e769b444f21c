"""The slot table: the Inferencer's device state, and the attention views the model runs through.

Each of the ``b`` slots holds one item's K/V, kept in blocks of a pool shared by every slot
(:class:`~slotinfer.kv.BlockPool`): per layer one ``[num_blocks, kv_heads, block_size, head_dim]``
array, bounded by a byte budget (``kv_cache_bytes``), and a block table per slot naming its blocks
in order.  Memory follows the tokens held, not ``slots x max_len``: a slot takes the blocks of
what it prefills when its item is admitted (:meth:`SlotTable.admit`), one more each time decoding
crosses a block boundary (:meth:`SlotTable.grow`; the scheduler preempts the newest item when none
is free), and gives them back when it ends.

The pool is also the prefix cache: an admitted item starts from the longest cached prefix of what
it prefills, its blocks shared by reference (no copy), and full blocks are registered as prefill
chunks go in (:meth:`SlotTable.register`) and when an item leaves its slot.  A row writes only
past its shared prefix, which is whole blocks, so no write ever lands in a shared block.

The device arrays hold the blocks in use, grown by a quarter as needed (:meth:`SlotTable.cover`)
and cut back when the pool is idle, keeping the cached blocks (moved to the lowest ids).
``lengths[b]`` says how many tokens each slot holds and ``new_batch_idx[b]`` which slots still
await their prompt, as in the seed design.  Writes of padding and of idle rows land in the pool's
``TRASH`` block, so no real position is ever clobbered and no shape has to change.  The model never
sees slots: it calls ``ctx.update`` and ``ctx.mask`` on one of the views below (decode's is
:class:`~slotinfer.kv.PagedDecodeView`), exactly as on the single-sequence cache.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import device
from .views import scatter, window_mask
from ..errors import OutOfMemoryError
from .block_pool import KV_BLOCK_SIZE, RESERVED, BlockPool, block_bytes, blocks_for_budget
from .paged_attention import write_index
from .quant import Q8, QuantizedKV, check_head_dim, quantize, row_bytes

__all__ = ["SlotTable", "PrefillView", "scatter", "default_kv_cache_bytes"]


_GROWTH = 16  # blocks: the arrays' size when idle, and the least they grow by


def default_kv_cache_bytes(want: int, device_kind=None) -> int:
    """The K/V pool's default budget: ``want`` (what ``slots x max_len`` tokens take), at most a
    quarter of the memory that holds K/V (the machine's RAM on CPU; MLX's recommended working set
    on a GPU) and half of what is available now, so a large table starts and requests wait for
    blocks instead of the process running out of memory."""
    free = device.memory_available(device_kind)
    return min(int(want), device.kv_memory(device_kind) // 4, *(() if free is None else (free // 2,)))


class SlotTable:
    """Per-layer K/V for ``slots`` rows of up to ``max_len`` tokens each, in a pool of blocks.

    ``kv_cache_bytes`` sizes the pool (None: :func:`default_kv_cache_bytes` of ``slots x max_len``
    tokens); ``max_len`` caps one slot (its block table's width).  ``prefix_cache_bytes`` caps the
    cached blocks no slot holds (None: no cap but the pool's; 0: no prefix cache).  ``dtype``: an mx
    dtype, or "q8_0" (uint8 pools of :mod:`slotinfer.kv.quant` blocks, each token's head vector a
    row of ``row`` bytes).
    """

    def __init__(self, config, *, slots: int, max_len: int, dtype, kv_cache_bytes: int | None = None,
                 block_size: int = KV_BLOCK_SIZE, prefix_cache_bytes: int | None = None):
        self.slots, self.max_len, self.block_size = slots, max_len, block_size
        self.kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        self.max_blocks = -(-max_len // block_size)
        self.quantized = isinstance(dtype, str) and dtype == Q8
        if self.quantized:
            check_head_dim(self.head_dim)
        # a pool row: one token's head vector, head_dim values (or its q8_0 bytes)
        self.row = row_bytes(self.head_dim) if self.quantized else self.head_dim
        array_dtype = mx.uint8 if self.quantized else dtype
        each = block_bytes(num_layers=config.num_layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                           dtype=dtype, block_size=block_size)
        self.block_nbytes = each
        if kv_cache_bytes is None:
            kv_cache_bytes = max(default_kv_cache_bytes((slots * self.max_blocks + RESERVED) * each),
                                 (RESERVED + 1) * each)
        num_blocks = blocks_for_budget(kv_cache_bytes, num_layers=config.num_layers, kv_heads=self.kv_heads,
                                       head_dim=self.head_dim, dtype=dtype, block_size=block_size)
        _check_fits(num_blocks * each, int(kv_cache_bytes))
        self.pool = BlockPool(num_blocks, block_size, slots=slots, max_blocks=self.max_blocks,
                              cache_blocks=None if prefix_cache_bytes is None else prefix_cache_bytes // each)
        self.num_blocks = num_blocks
        # the cap on cached blocks no slot holds, as the parameter was given (the pool's budget bounds them too)
        self.cache_budget_bytes = self.budget_bytes if prefix_cache_bytes is None else int(prefix_cache_bytes)
        self.chains: list[list[int]] = [[] for _ in range(slots)]  # keys of each slot's registered leading blocks
        # The device arrays hold the blocks in use (the pool hands out its lowest free ids first, so
        # those stay packed at the start), grown as they need more, up to the budget, and cut back to
        # ``idle_blocks`` when nothing is held: an idle engine holds the reserved blocks and 16 more.
        self.keys = [mx.zeros((0, self.kv_heads, block_size, self.row), dtype=array_dtype)
                     for _ in range(config.num_layers)]
        self.values = [mx.zeros_like(k) for k in self.keys]
        self.idle_blocks = min(num_blocks, RESERVED + min(self.max_blocks, _GROWTH))
        self._resize(self.idle_blocks)
        # Host-side, per slot: tokens cached (0: empty; a decode step writes its token there), and
        # a newly admitted slot's place in the prefill queue, FIFO (-1: not new, its prompt is in).
        self.lengths = np.zeros(slots, dtype=np.int32)
        self.new_batch_idx = np.full(slots, -1, dtype=np.int32)

    # -- blocks --------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one item may hold: the pool's blocks, and the table's width."""
        return min(self.num_blocks - RESERVED, self.max_blocks) * self.block_size

    @property
    def caching(self) -> bool:
        """Whether the pool keeps a prefix cache."""
        return self.pool.cache_blocks > 0

    def cached_prefix(self, feed, salt, *, count: bool = False) -> list[int]:
        """The cached blocks that start ``feed`` (a prompt, or a resumed item's prompt and tokens),
        short of its last token, whose logits give the next one."""
        if not self.caching or len(feed) <= self.block_size:
            return []
        return self.pool.lookup(feed, salt, limit=len(feed) - 1, count=count)

    def _plan(self, tokens: int, feed, salt, *, count: bool = False):
        """What an item of ``tokens`` tokens that prefills ``feed`` reuses: ``(hits, block, n, adopt,
        need)``, its cached whole blocks, then a kept partial block sharing ``n`` more tokens (None,
        0: none) that it adopts or copies, and the free blocks admitting it takes."""
        pool = self.pool
        hits = self.cached_prefix(feed, salt, count=count)
        need = max(0, pool.blocks_for(tokens) - len(hits)) + sum(1 for b in hits if pool.ref[b] == 0)
        start = len(hits) * self.block_size
        block, n = (None, 0)
        if self.caching and len(feed) - 1 > start and len(hits) < self.max_blocks:
            block, n = pool.lookup_partial(pool.key_of(hits[-1]) if hits else None, feed[start:len(feed) - 1], salt)
        adopt = block in pool.partial and n == len(pool.partial[block][1]) and not pool.ref[block]
        source = int(block is not None and not adopt and not pool.ref[block])  # a free block held while copied
        if source and not pool.can_allocate(need + 1):
            block, n, source = None, 0, 0  # no room for the copy and its source at once: recompute them
        if count and block is not None:
            pool.count_partial(n, full_hit=bool(hits))
        return hits, block, n, adopt, need + source

    def can_admit(self, tokens: int, feed=(), salt=None) -> bool:
        """Whether the free blocks (cached ones included) hold an item of ``tokens`` tokens now that
        prefills ``feed``: its cached prefix is shared, and what it takes of the free blocks is new
        blocks and the cached ones nobody held."""
        return self.pool.can_allocate(self._plan(tokens, feed, salt)[4])

    def admit(self, slot: int, tokens: int, feed=(), salt=None) -> int:
        """``slot`` takes a new item holding ``tokens`` tokens (what it prefills): the longest cached
        prefix of ``feed`` shared into its table, then a kept partial block that goes on with it
        adopted (when ``feed`` goes on past all of its tokens) or copied into a block of the slot's
        own, the other blocks taken, its prompt last in the prefill queue.  Returns the tokens reused
        (the slot's length now)."""
        pool = self.pool
        hits, block, n, adopt, _ = self._plan(tokens, feed, salt, count=True)
        pool.share(slot, hits)  # before allocating, which could evict them
        self.chains[slot] = [pool.key_of(b) for b in hits]
        if adopt:
            pool.adopt(slot, block)
        elif block is not None:
            pool.hold(block)  # kept from the allocation below while its copy is taken
        pool.grow(slot, tokens)
        if block is not None and not adopt:
            self._copy(block, int(pool.tables[slot, len(hits)]))
            pool.let_go(block)
        self.lengths[slot] = len(hits) * self.block_size + n
        self.new_batch_idx[slot] = int(np.count_nonzero(self.new_batch_idx >= 0))
        return int(self.lengths[slot])

    def _copy(self, src: int, dst: int):
        """Block ``dst`` gets the K/V block ``src`` holds, in every layer (the positions past what is
        reused are the row's own to overwrite)."""
        self.cover()
        bs = self.block_size
        index = write_index(mx.full((1, bs), dst, dtype=mx.int32), mx.arange(bs, dtype=mx.int32)[None],
                            kv_heads=self.kv_heads, block_size=bs, head_dim=self.row, num_blocks=self.num_blocks)
        source = mx.array([src], dtype=mx.int32)
        # read out first: a write whose value still reads the pool array cannot write it in place, and
        # would copy the whole array, every layer
        blocks = [[mx.take(a, source, axis=0) for a in kv] for kv in (self.keys, self.values)]
        mx.eval(blocks)
        for kv, got in zip((self.keys, self.values), blocks):
            for layer, block in enumerate(got):
                kv[layer] = scatter(kv[layer], index, block)

    def register(self, slot: int, tokens, salt=None):
        """The full blocks of ``tokens`` (what ``slot`` holds from position 0, K/V written or issued)
        become cached prefixes; blocks registered before are passed over."""
        if not self.caching:
            return
        chain, bs = self.chains[slot], self.block_size
        for j in range(len(chain), min(len(tokens) // bs, int(self.pool.held[slot]))):
            chain.append(self.pool.register(int(self.pool.tables[slot, j]), chain[-1] if chain else None,
                                            tokens[j * bs:(j + 1) * bs], salt))

    def keep(self, slot: int, tokens, salt=None):
        """``slot`` is about to let go of ``tokens``' K/V: its full blocks become cached prefixes
        (:meth:`register`), and its last, partial block is kept too, after them."""
        if not self.caching:
            return
        self.register(slot, tokens, salt)
        chain, bs, pool = self.chains[slot], self.block_size, self.pool
        j = len(tokens) // bs
        if len(tokens) % bs and len(chain) == j < int(pool.held[slot]):
            block = int(pool.tables[slot, j])
            if pool.ref[block] == 1 and block not in pool.meta:
                pool.register_partial(block, chain[-1] if chain else None, tokens[j * bs:], salt)

    def blocks_missing(self, slots, tokens) -> int:
        """How many blocks more than the free ones ``slots`` need to hold their ``tokens`` (0: they fit)."""
        need = sum(self.pool.needed(s, int(n)) for s, n in zip(slots, tokens))
        return max(0, need - self.pool.num_free)

    def trim(self, slot: int):
        """``slot`` keeps the blocks its length and the next step's write need; the rest go back."""
        self.pool.shrink(slot, int(self.lengths[slot]) + 1)

    def grow(self, slots, tokens):
        """Grow each of ``slots`` to hold its ``tokens`` tokens (check :meth:`blocks_missing` first)."""
        for s, n in zip(slots, tokens):
            self.pool.grow(s, int(n))

    def cover(self):
        """Make the arrays hold every block in use: grown by at least a quarter (and 16 blocks) at a
        time, as each growth copies them, never past the budget.  :meth:`locate` calls it, so the blocks taken
        in one step (a burst of admissions) grow the arrays once."""
        have = self.keys[0].shape[0]
        need = int(self.pool.tables.max()) + 1
        if need > have:
            self._resize(min(self.num_blocks, max(need, have + max(have // 4, _GROWTH))))

    def _resize(self, blocks: int):
        """Make each layer's arrays hold ``blocks`` blocks, the first ones kept (new ones zero, as
        ZERO must stay)."""
        have = self.keys[0].shape[0]
        for kv in (self.keys, self.values):
            for layer, a in enumerate(kv):
                if blocks > have:
                    more = (blocks - have, self.kv_heads, self.block_size, self.row)
                    kv[layer] = mx.concatenate([a, mx.zeros(more, dtype=a.dtype)])
                else:
                    kv[layer] = mx.zeros((blocks, *a.shape[1:]), dtype=a.dtype)  # nothing held: nothing to keep
                mx.eval(kv[layer])  # one layer at a time: the old array is freed before the next is copied

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
        """``slot`` is empty again, its blocks back in the pool (its registered ones stay cached)."""
        self.prompt_in(slot)
        self.lengths[slot] = 0
        self.chains[slot] = []
        self.pool.release_slot(slot)
        if self.pool.num_used == 0 and self.keys[0].shape[0] > max(self.idle_blocks, RESERVED + len(self.pool.cached)):
            self._shrink()  # idle: the memory of a burst goes back to the system, the cache kept

    def _shrink(self):
        """Cut the arrays back to the idle size and the cached blocks, which move to the lowest ids."""
        kept = self.pool.compact()
        size = max(self.idle_blocks, RESERVED + len(kept))
        index = mx.array(kept, dtype=mx.int32) if kept else None
        for kv in (self.keys, self.values):
            for layer, a in enumerate(kv):
                parts = [mx.zeros((RESERVED, *a.shape[1:]), dtype=a.dtype)]
                if index is not None:
                    parts.append(mx.take(a, index, axis=0))
                parts.append(mx.zeros((size - RESERVED - len(kept), *a.shape[1:]), dtype=a.dtype))
                kv[layer] = mx.concatenate(parts)
                mx.eval(kv[layer])  # one layer at a time: the old array is freed before the next is copied
        device.release_free_memory()

    def locate(self, slots, positions):
        """The pool's :meth:`~slotinfer.kv.BlockPool.locate`, once the arrays hold every block in use:
        the one way to a write's place."""
        self.cover()
        return self.pool.locate(np.asarray(slots), np.asarray(positions))

    def index(self, slots, positions):
        """Flat write offsets (:func:`~slotinfer.kv.write_index`) of tokens at ``positions``
        ([n] or [n, L], numpy; negative: padding, written to TRASH) of ``slots`` [n]."""
        blocks, offsets = self.locate(slots, positions)
        if blocks.ndim == 1:
            blocks, offsets = blocks[:, None], offsets[:, None]
        return write_index(mx.array(blocks), mx.array(offsets), kv_heads=self.kv_heads, block_size=self.block_size,
                           head_dim=self.row, num_blocks=self.num_blocks)

    def gather(self, cache, slots, span: int):
        """``slots``' K/V of one layer's pool ``cache`` at positions ``0:span``, copied out
        contiguously as ``[n, kv_heads, span, row]`` (``row``: head_dim values, or their q8_0 bytes)."""
        nb = -(-span // self.block_size)
        tables = mx.array(self.pool.tables[np.asarray(slots), :nb])
        n, bs = tables.shape[0], self.block_size
        got = mx.take(cache, tables.reshape(-1), axis=0).reshape(n, nb, self.kv_heads, bs, self.row)
        return got.transpose(0, 2, 1, 3, 4).reshape(n, self.kv_heads, nb * bs, self.row)[:, :, :span]

    @property
    def allocated_bytes(self) -> int:
        """Bytes the device arrays hold now (the blocks in use, cached ones and growth room)."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    @property
    def budget_bytes(self) -> int:
        """The pool's byte budget: ``kv_cache_bytes`` rounded down to whole blocks."""
        return self.num_blocks * self.block_nbytes

    def stats(self) -> dict:
        """Blocks of the pool: total (less the reserved), used, free (cached ones included), cached,
        their size in tokens and bytes."""
        p = self.pool
        return {"blocks": p.num_blocks - RESERVED, "blocks_used": p.num_used, "blocks_free": p.num_free,
                "blocks_cached": len(p.cached), "blocks_allocated": self.keys[0].shape[0],
                "block_tokens": self.block_size, "block_bytes": self.block_nbytes,
                "token_bytes": self.block_nbytes // self.block_size}

    def cache_stats(self) -> dict:
        """The prefix cache's counters and size (its blocks nobody holds), or None when it is off."""
        if not self.caching:
            return None
        p, c = self.pool, self.pool.counters
        query, hit = c["query_tokens"], c["hit_tokens"]
        return {"queries": c["queries"], "hits": c["hits"], "query_tokens": query, "hit_tokens": hit,
                "hit_rate": hit / query if query else 0.0, "inserted_blocks": c["registered"], "partial_hits": c["partial_hits"],
                "evictions": c["evicted"], "blocks": len(p.cached), "bytes": len(p.cached) * self.block_nbytes,
                "shared_blocks": len(p.meta) - len(p.cached), "budget_bytes": self.cache_budget_bytes,
                "block_size": self.block_size}




def _check_fits(need: int, asked: int):
    """Refuse a pool larger than the memory available, with a typed error instead of a crash."""
    free = device.memory_available()
    if free is not None and need > free:
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        raise OutOfMemoryError(
            f"the K/V pool of kv_cache_bytes={asked} ({gib(need)}) does not fit: {gib(free)} is available here; "
            f"lower kv_cache_bytes")


class PrefillView:
    """Attention context of the Encoder: new prompt tokens of ``rows``, padded on the right.

    Row ``i`` writes its chunk at ``starts[i] ...`` into its slot's blocks; tokens after
    ``lens[i]`` are padding and go to TRASH.  When every row starts at 0 the queries attend to
    the fresh K/V directly; a later chunk (or one after a prefix-cache hit) attends to its
    slot's blocks copied out contiguously, as one prefill of the whole prompt would.
    """

    def __init__(self, table: SlotTable, rows: list[int], starts: list[int], lens: list[int], chunk: int, span: int,
                 fresh: bool):
        self.table = table
        self.rows = rows
        starts_np = np.asarray(starts, dtype=np.int32)
        j = np.arange(chunk, dtype=np.int32)[None]
        q_pos = starts_np[:, None] + j  # [n, L]
        self.index = table.index(rows, np.where(j < np.asarray(lens)[:, None], q_pos, -1))
        self.offset = mx.array(starts_np)
        self.q_pos = mx.array(q_pos)
        self.fresh = fresh
        self.span = chunk if fresh else span
        self._masks = {}

    def update(self, layer, k, v):
        t = self.table
        if t.quantized:  # q8_0: the chunk attends over its K/V as stored, whether fresh or read back
            k, v = quantize(k), quantize(v)
            t.keys[layer] = scatter(t.keys[layer], self.index, k)
            t.values[layer] = scatter(t.values[layer], self.index, v)
            if not self.fresh:
                k, v = t.gather(t.keys[layer], self.rows, self.span), t.gather(t.values[layer], self.rows, self.span)
            return QuantizedKV(k, v), None
        t.keys[layer] = scatter(t.keys[layer], self.index, k)
        t.values[layer] = scatter(t.values[layer], self.index, v)
        if self.fresh:
            return k, v
        return (t.gather(t.keys[layer], self.rows, self.span).astype(k.dtype),
                t.gather(t.values[layer], self.rows, self.span).astype(v.dtype))

    def mask(self, layer, L, window):
        if window not in self._masks:
            k_pos = mx.arange(self.span)
            self._masks[window] = window_mask(self.q_pos, k_pos, window)[:, None]  # [n, 1, L, span]
        return self._masks[window]
