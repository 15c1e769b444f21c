"""The block pool: K/V memory in fixed-size blocks, handed to slots through per-slot block tables.

Host-side bookkeeping only (numpy and dicts; the K/V arrays themselves are per layer
``[num_blocks, kv_heads, block_size, head_dim]``, addressed by the ids kept here).

- Two ids are reserved.  ``ZERO`` is never written: it pads block tables, so a read past a
  row's blocks meets finite values under a zero weight.  ``TRASH`` takes the writes of
  padding tokens and idle rows, which can be NaN (a fully masked row of a sliding-window
  layer), and no table ever names it.
- Every other block is free (reference count 0, in the free queue) or held by the tables
  that name it, one reference per table entry: a block shared by two slots' prefixes has
  count 2.  The free queue is an ``OrderedDict``, O(1) at both ends and by key: allocation
  takes from its front; a released block without a hash goes to the front (nothing to keep),
  one with a hash to the back (a cached prefix, kept as long as nothing needs its memory).
  A table releases its last block first, so a prefix's tail is evicted before its head.
- The pool is the prefix cache.  A full block can be registered under the chained hash of its
  prefix (:func:`chain_hash`); :meth:`lookup` finds the longest registered chain that starts a
  prompt, each block checked against its own tokens, parent and salt, so a hash collision never
  serves another prompt's K/V, and :meth:`share` puts the blocks found into a slot's table by
  reference.  A registered block nobody holds is free capacity: it waits at the back of the free
  queue (least recently released first) until an allocation takes it and it loses its hash.
  ``cache_blocks`` caps how many such blocks are kept (0: nothing is registered, no cache).
- A row's last, **partial** block can be kept too when its table lets it go
  (:meth:`register_partial`): filed under its parent's key and salt with the tokens it holds, it is
  cached and evicted like a full block.  :meth:`lookup_partial` finds the block kept after a
  parent (partial, or full and shared only in part) that shares the longest start with a prompt's
  next tokens; the caller adopts a partial one (:meth:`adopt`: the row owns it and writes past its
  tokens) when the prompt goes on past all of them, or else copies its K/V into a block of its own.  So a chat's next turn reuses the whole of the turn before, not only its full
  blocks.

    >>> pool = BlockPool(num_blocks=10, block_size=4, slots=2, max_blocks=4)
    >>> pool.grow(0, 6)                     # slot 0 holds 6 tokens: 2 blocks
    [2, 3]
    >>> pool.tables[0].tolist(), pool.num_free
    ([2, 3, 0, 0], 6)
    >>> pool.release_slot(0); pool.num_free
    8
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..errors import InvalidRequestError, OutOfMemoryError
from .quant import Q8, row_bytes

ZERO, TRASH = 0, 1  # reserved ids: the table padding (never written) and the sink of padding writes
RESERVED = 2
# Tokens of one block of the engine's pool, and of the reference's (Model.generate): decode reads
# blocks through paged_attend, which sums P.V block by block, so both must cut at the same place.
# 128: the smallest size whose paged decode attention holds today's speed (docs/kv-cache.md).
KV_BLOCK_SIZE = 128


def chain_hash(parent: int | None, tokens: tuple[int, ...], salt: str | None) -> int:
    """The key of a block of ``tokens`` after the block keyed ``parent`` (None: the first block):
    one key names a whole prefix.  A match must still be checked against the block's own tokens,
    parent and salt (:meth:`BlockPool.lookup` does)."""
    return hash((parent, tokens, salt))


def token_bytes(head_dim: int, dtype) -> int:
    """Bytes of one token's head vector of K (or V) kept in ``dtype`` (an mx dtype, or "q8_0")."""
    return row_bytes(head_dim) if isinstance(dtype, str) and dtype == Q8 else head_dim * dtype.size


def block_bytes(*, num_layers: int, kv_heads: int, head_dim: int, dtype, block_size: int) -> int:
    """Bytes one block holds: K and V of ``block_size`` tokens in every layer (``dtype``: an mx
    dtype, or "q8_0")."""
    return 2 * num_layers * kv_heads * block_size * token_bytes(head_dim, dtype)


def blocks_for_budget(kv_cache_bytes: int, *, num_layers: int, kv_heads: int, head_dim: int, dtype,
                      block_size: int) -> int:
    """How many blocks (the two reserved ones included) ``kv_cache_bytes`` holds for this shape.

    A budget that holds no block beyond the reserved two is refused: nothing could be cached.
    """
    each = block_bytes(num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                       block_size=block_size)
    n = int(kv_cache_bytes) // each
    if n <= RESERVED:
        raise InvalidRequestError(
            f"kv_cache_bytes={int(kv_cache_bytes)} holds {n} blocks of {block_size} tokens ({each} bytes each); "
            f"at least {RESERVED + 1} are needed ({RESERVED} are reserved): raise kv_cache_bytes to "
            f"{(RESERVED + 1) * each} or more")
    return n


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens, and a block table for each of ``slots`` slots.

    ``tables[slot, :held[slot]]`` are the blocks of a slot's tokens, in order; the rest of the
    row is ``ZERO``.  A slot of ``n`` tokens holds exactly ``ceil(n / block_size)`` blocks.
    """

    chain = staticmethod(chain_hash)

    def __init__(self, num_blocks: int, block_size: int, *, slots: int, max_blocks: int,
                 cache_blocks: int | None = None):
        if num_blocks <= RESERVED:
            raise InvalidRequestError(f"a block pool needs more than {RESERVED} blocks ({RESERVED} are reserved), "
                                      f"got num_blocks={num_blocks}")
        if block_size < 1 or slots < 1 or max_blocks < 1:
            raise InvalidRequestError(f"block_size, slots and max_blocks must be positive, got {block_size}, "
                                      f"{slots}, {max_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(RESERVED, num_blocks))
        self.tables = np.full((slots, max_blocks), ZERO, dtype=np.int32)
        self.held = np.zeros(slots, dtype=np.int32)
        self.by_hash: dict[int, int] = {}  # chain hash -> block id
        self.meta: dict[int, tuple] = {}  # block id -> (hash, parent hash, tokens, salt) of a registered block
        self.cache_blocks = num_blocks if cache_blocks is None else max(0, int(cache_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds, least recent first
        self.partial: dict[int, tuple] = {}  # block id -> (parent hash, tokens, salt) of a kept partial block
        self.by_parent: dict[tuple, dict[int, None]] = {}  # (parent hash, salt) -> the blocks kept after it
        self.counters = dict(allocated=0, evicted=0, registered=0, queries=0, hits=0, query_tokens=0, hit_blocks=0,
                             hit_tokens=0, partial_hits=0)

    # -- the free queue ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (registered but unreferenced ones included)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        """Blocks held by some table."""
        return self.num_blocks - RESERVED - len(self.free)

    def can_allocate(self, n: int) -> bool:
        """Whether :meth:`allocate` of ``n`` blocks succeeds now."""
        return 0 <= n <= len(self.free)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free queue, each with one reference.

        Raises :class:`~slotinfer.errors.OutOfMemoryError` when fewer are free (ask
        :meth:`can_allocate` first); nothing is taken then.
        """
        if not self.can_allocate(n):
            raise OutOfMemoryError(f"{n} K/V blocks asked for and {len(self.free)} are free: "
                                   f"check can_allocate before allocating, or free a slot")
        out = [self.free.popitem(last=False)[0] for _ in range(n)]
        for b in out:
            if b in self.meta or b in self.partial:  # a cached block reused for other tokens: nothing names it now
                self._forget(b)
        self.ref[out] = 1
        self.counters["allocated"] += n
        return out

    def _forget(self, b: int):
        """``b`` is no longer a cached prefix block (evicted)."""
        self._unfile(b)
        self.cached.pop(b, None)
        self.counters["evicted"] += 1

    def _file(self, b: int, parent, salt):
        self.by_parent.setdefault((parent, salt), {})[b] = None

    def _unfile(self, b: int):
        """Take the kept block ``b`` (registered or partial) out of the maps that name it."""
        if b in self.partial:
            parent, _, salt = self.partial.pop(b)
        else:
            key, parent, _, salt = self.meta.pop(b)
            if self.by_hash.get(key) == b:
                del self.by_hash[key]
        group = self.by_parent[(parent, salt)]
        del group[b]
        if not group:
            del self.by_parent[(parent, salt)]

    def _acquire(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
                self.cached.pop(b, None)
            self.ref[b] += 1

    def _release(self, blocks):
        """One reference less on each of ``blocks``, last first; at 0 a block is free again."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None  # registered: the back, kept while memory allows
                if b in self.meta or b in self.partial:
                    self.cached[b] = None
                else:
                    self.free.move_to_end(b, last=False)  # nothing worth keeping: reused first
        while len(self.cached) > self.cache_blocks:  # past the cap: the least recently released go
            b = next(iter(self.cached))
            self._forget(b)
            self.free.move_to_end(b, last=False)

    # -- per-slot block tables -----------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def needed(self, slot: int, tokens: int) -> int:
        """New blocks ``slot`` needs to hold ``tokens`` tokens (0 when it holds them already)."""
        return max(0, self.blocks_for(tokens) - int(self.held[slot]))

    def can_grow(self, slot: int, tokens: int) -> bool:
        return self.blocks_for(tokens) <= self.tables.shape[1] and self.can_allocate(self.needed(slot, tokens))

    def grow(self, slot: int, tokens: int) -> list[int]:
        """Make ``slot``'s table hold ``tokens`` tokens; returns the blocks added (none until a
        block boundary is crossed).  Raises, changing nothing, when the table's width or the free
        blocks do not allow it (ask :meth:`can_grow` first)."""
        have, want = int(self.held[slot]), self.blocks_for(tokens)
        if want > self.tables.shape[1]:
            raise InvalidRequestError(f"{tokens} tokens need {want} blocks of {self.block_size} and a slot's "
                                      f"table holds {self.tables.shape[1]}: lower the length or raise max_blocks")
        if want <= have:
            return []
        new = self.allocate(want - have)
        self.tables[slot, have:want] = new
        self.held[slot] = want
        return new

    def shrink(self, slot: int, tokens: int) -> None:
        """``slot`` gives back the blocks past those that hold ``tokens`` tokens (a speculative step's
        rejected positions), its last first; they hold nothing registered."""
        have, want = int(self.held[slot]), self.blocks_for(tokens)
        if want >= have:
            return
        self._release(self.tables[slot, want:have].tolist())
        self.tables[slot, want:have] = ZERO
        self.held[slot] = want

    def share(self, slot: int, blocks) -> None:
        """Start the empty ``slot``'s table with ``blocks`` (a cached prefix from :meth:`lookup`),
        each one reference more."""
        if self.held[slot]:
            raise InvalidRequestError(f"slot {slot} already holds {self.held[slot]} blocks: share a prefix "
                                      f"into an empty slot only")
        blocks = list(blocks)
        if len(blocks) > self.tables.shape[1] or any(b < RESERVED or b >= self.num_blocks for b in blocks):
            raise InvalidRequestError(f"cannot share blocks {blocks}: ids must lie in [{RESERVED}, "
                                      f"{self.num_blocks}) and fit a table of {self.tables.shape[1]}")
        self._acquire(blocks)
        self.tables[slot, : len(blocks)] = blocks
        self.held[slot] = len(blocks)

    def hold(self, block: int) -> None:
        """One reference more on ``block`` outside any table (a copy's source), so no allocation takes it."""
        self._acquire([block])

    def let_go(self, block: int) -> None:
        """The reference :meth:`hold` took goes back."""
        self._release([block])

    def release_slot(self, slot: int) -> None:
        """``slot`` gives back every block it holds (its last first) and is empty again."""
        n = int(self.held[slot])
        self._release(self.tables[slot, :n].tolist())
        self.tables[slot] = ZERO
        self.held[slot] = 0

    def locate(self, slots, positions):
        """Where tokens are written: ``(blocks, offsets)`` for ``slots`` [n] and ``positions``
        [n] or [n, L] (numpy).  A negative position (a padding token, an idle row) goes to TRASH;
        a position past the blocks a slot holds raises, as it would write memory nobody owns, and so
        does one in a block another table shares."""
        slots, positions = np.asarray(slots), np.asarray(positions)
        rows = slots if positions.ndim == 1 else slots[:, None]
        pad = positions < 0
        col = np.where(pad, 0, positions) // self.block_size
        if np.any(~pad & (col >= self.held[rows])):
            raise InvalidRequestError("a write past the blocks a slot holds: grow the slot first")
        blocks = np.where(pad, TRASH, self.tables[rows, np.minimum(col, self.tables.shape[1] - 1)])
        if np.any(self.ref[blocks] > 1):  # a shared block holds a cached prefix: it is never written
            raise InvalidRequestError("a write into a block that several slots share: a row writes only past its "
                                      "shared prefix")
        return blocks.astype(np.int32), np.where(pad, 0, positions % self.block_size).astype(np.int32)

    # -- cached prefixes -------------------------------------------------------------------------

    def register(self, block: int, parent: int | None, tokens, salt: str | None = None) -> int:
        """Register the full ``block`` (held by some table) as holding ``tokens`` after the block
        keyed ``parent``; returns its key, the ``parent`` of the next block.  A block already
        registered under another key keeps that one."""
        tokens = tuple(tokens)
        if len(tokens) != self.block_size or self.ref[block] < 1:
            raise InvalidRequestError(f"block {block}: only a held, full block of {self.block_size} tokens can be "
                                      f"registered (got {len(tokens)} tokens, {self.ref[block]} references)")
        key = self.chain(parent, tokens, salt)
        if block in self.meta:
            return self.meta[block][0]
        if not self.cache_blocks:
            return key  # no cache: the key chains on, nothing is kept
        old = self.by_hash.get(key)
        if old is not None:  # the same prefix computed twice, or a collision: the older block loses the key
            self._unfile(old)
            if self.cached.pop(old, "held") is None:
                self.free.move_to_end(old, last=False)  # nobody holds it and nothing names it: reused first
        self.by_hash[key] = block
        self.meta[block] = (key, parent, tokens, salt)
        self._file(block, parent, salt)
        self.counters["registered"] += 1
        return key

    def lookup(self, tokens, salt: str | None = None, limit: int | None = None, *, count: bool = True) -> list[int]:
        """The registered blocks that start ``tokens`` (at most ``limit`` tokens of them), first to
        last; each checked against its own tokens, parent and salt.  Takes no reference:
        :meth:`share` them into a slot (before any allocation, which may evict them)."""
        bs, limit = self.block_size, len(tokens) if limit is None else min(limit, len(tokens))
        found, parent = [], None
        for start in range(0, limit - bs + 1, bs):
            block_tokens = tuple(tokens[start:start + bs])
            key = self.chain(parent, block_tokens, salt)
            b = self.by_hash.get(key)
            if b is None or self.meta[b][1:] != (parent, block_tokens, salt):
                break
            found.append(b)
            parent = key
        if not count:
            return found
        c = self.counters
        c["queries"] += 1
        c["query_tokens"] += len(tokens)
        c["hits"] += bool(found)
        c["hit_blocks"] += len(found)
        c["hit_tokens"] += len(found) * bs
        return found

    def register_partial(self, block: int, parent: int | None, tokens, salt: str | None = None) -> bool:
        """Keep the held ``block``, which holds ``tokens`` (fewer than a block) after the block keyed
        ``parent``, as a partial prefix once its table lets it go.  Entries under the same parent and
        salt whose tokens start the new ones give way to it; one whose tokens the new ones start
        makes it redundant (nothing is kept).  Returns whether it is kept."""
        tokens = tuple(tokens)
        if not 0 < len(tokens) < self.block_size or self.ref[block] != 1 or block in self.meta:
            raise InvalidRequestError(f"block {block}: only a block held once, not registered, with 1 to "
                                      f"{self.block_size - 1} tokens can be kept as a partial prefix (got "
                                      f"{len(tokens)} tokens, {self.ref[block]} references)")
        if not self.cache_blocks or block in self.partial:
            return False
        for other in list(self.by_parent.get((parent, salt), ())):
            have = self._tokens(other)
            if have[: len(tokens)] == tokens:
                return False  # as much is kept already
            if other in self.partial and tokens[: len(have)] == have:
                self._unfile(other)  # the new block holds all of it and more
                if self.cached.pop(other, "held") is None:
                    self.free.move_to_end(other, last=False)  # nobody holds it and nothing names it: reused first
        self.partial[block] = (parent, tokens, salt)
        self._file(block, parent, salt)
        self.counters["registered"] += 1
        return True

    def lookup_partial(self, parent: int | None, tokens, salt: str | None = None) -> tuple[int | None, int]:
        """The block kept after the block keyed ``parent`` (partial, or registered) that shares the
        longest start with ``tokens`` (the prompt's tokens after that block, as many as may be reused;
        fewer than a block), and how many tokens it shares: ``(None, 0)`` when none shares one.  The match is made on the block's own
        tokens, parent and salt.  Takes no reference."""
        best, most = None, 0
        tokens = tuple(tokens[: self.block_size - 1])
        for b in self.by_parent.get((parent, salt), ()):
            n = _common(self._tokens(b), tokens)
            if n > most:
                best, most = b, n
        return best, most

    def _tokens(self, b: int) -> tuple:
        return self.partial[b][1] if b in self.partial else self.meta[b][2]

    def adopt(self, slot: int, block: int) -> None:
        """``slot``'s table, which holds a cached prefix of whole blocks, goes on with the kept partial
        ``block`` (nobody holds it): the row owns it now, and writes past its tokens."""
        if block not in self.partial or self.ref[block]:
            raise InvalidRequestError(f"block {block} is not a kept partial block nobody holds: copy it instead")
        n = int(self.held[slot])
        if n >= self.tables.shape[1]:
            raise InvalidRequestError(f"slot {slot}'s table is full: it cannot adopt block {block}")
        self._unfile(block)
        self._acquire([block])
        self.tables[slot, n] = block
        self.held[slot] = n + 1

    def count_partial(self, tokens: int, *, full_hit: bool) -> None:
        """The last counted lookup's partial hit reused ``tokens`` tokens more (``full_hit``: that
        lookup found whole blocks too, and counted as a hit already)."""
        c = self.counters
        c["partial_hits"] += 1
        c["hit_tokens"] += tokens
        c["hits"] += not full_hit

    def key_of(self, block: int) -> int:
        """The key a registered ``block`` is cached under: the ``parent`` of the block after it."""
        return self.meta[block][0]

    def compact(self) -> list[int]:
        """Renumber the cached blocks to the lowest ids, least recently released first, while no
        table holds a block; returns their old ids in their new order (block ``RESERVED + i`` now
        names what ``old[i]`` held: the caller moves the K/V).  Lets the K/V arrays shrink after a
        burst and keep the cache."""
        if self.num_used:
            raise InvalidRequestError("compact the pool only while no slot holds a block")
        old = list(self.cached)
        new = {b: RESERVED + i for i, b in enumerate(old)}
        self.meta = {new[b]: m for b, m in self.meta.items()}
        self.by_hash = {m[0]: b for b, m in self.meta.items()}
        self.partial = {new[b]: m for b, m in self.partial.items()}
        self.by_parent = {}
        for b, (parent, _, salt) in self.partial.items():
            self._file(b, parent, salt)
        for b, (_, parent, _, salt) in self.meta.items():
            self._file(b, parent, salt)
        self.cached = OrderedDict.fromkeys(range(RESERVED, RESERVED + len(old)))
        self.free = OrderedDict.fromkeys(range(RESERVED + len(old), self.num_blocks))
        self.free.update(self.cached)
        return old

    def stats(self) -> dict:
        return {**self.counters, "blocks": self.num_blocks - RESERVED, "used": self.num_used, "free": self.num_free,
                "cached": len(self.cached), "registered_blocks": len(self.meta), "partial_blocks": len(self.partial),
                "block_size": self.block_size}


def _common(a, b) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
