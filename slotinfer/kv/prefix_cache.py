"""The prefix cache: K/V of token blocks computed before, reused by every request that starts with them.

Tokens are cut into full blocks of ``block_size``.  A block is keyed by a chained hash of
(its parent's key, its tokens, the request's cache salt), so one key names a whole prefix;
a lookup walks a prompt's blocks from the first and stops at the first miss.  A hit is
checked against the block's own tokens and parent, so a hash collision can never serve
another prompt's K/V.  Requests with different salts never share a block.

Blocks hold their K/V for every layer, ``[layers, kv_heads, block_size, head_dim]`` each,
copied out of a slot when its prompt is in (and again, with what it generated, when it
ends) and copied into a new occupant's slot on a hit: a copy costs microseconds a token
where a prefill costs milliseconds.  The cache never holds more than its byte budget: the
least recently used blocks go first, a prefix's later blocks before its earlier ones.

The cache belongs to one engine, so to one model: keys need no model identity.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

BLOCK_SIZE = 32  # tokens a block holds: a hit reuses whole blocks, so at most 31 tokens of a prefix are recomputed


def chain_hash(parent: int | None, tokens: tuple[int, ...], salt: str | None) -> int:
    """The key of a block of ``tokens`` after the block keyed ``parent`` (None: the first block):
    one key names a whole prefix.  A match must still be checked against the block's own tokens,
    parent and salt (the block pool and the prefix cache both do)."""
    return hash((parent, tokens, salt))


@dataclass(eq=False)
class Block:
    key: int
    parent: int | None
    tokens: tuple[int, ...]
    salt: str | None
    keys: mx.array  # [layers, kv_heads, block_size, head_dim]
    values: mx.array


class PrefixCache:
    """Blocks of K/V keyed by chained token hashes, least recently used evicted past ``budget_bytes``."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype, budget_bytes: int,
                 block_size: int = BLOCK_SIZE):
        self.block_size = block_size
        self.block_bytes = 2 * num_layers * kv_heads * block_size * head_dim * dtype.size
        self.budget_bytes = budget_bytes
        self.blocks: OrderedDict[int, Block] = OrderedDict()  # least recently used first
        self.counters = dict(queries=0, hits=0, query_tokens=0, hit_tokens=0, inserted_blocks=0, evictions=0)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def capacity(self) -> int:
        """Blocks the budget holds."""
        return self.budget_bytes // self.block_bytes

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    chain = staticmethod(chain_hash)

    def _cached(self, key: int, parent: int | None, tokens: tuple[int, ...], salt: str | None) -> bool:
        """Whether ``key`` holds exactly this block: a hash match is checked against the block itself."""
        b = self.blocks.get(key)
        return b is not None and b.parent == parent and b.tokens == tokens and b.salt == salt

    def match(self, tokens, salt: str | None, limit: int) -> list[Block]:
        """The cached blocks that start ``tokens``, at most ``limit`` tokens of them, first to last.

        Counts a query; the blocks found become the most recently used.
        """
        bs = self.block_size
        found, parent = [], None
        for start in range(0, min(limit, len(tokens)) - bs + 1, bs):
            block_tokens = tuple(tokens[start:start + bs])
            key = self.chain(parent, block_tokens, salt)
            if not self._cached(key, parent, block_tokens, salt):
                break
            found.append(self.blocks[key])
            parent = key
        c = self.counters
        c["queries"] += 1
        c["query_tokens"] += len(tokens)
        if found:
            c["hits"] += 1
            c["hit_tokens"] += len(found) * bs
            for b in reversed(found):  # the first block most recent: a prefix's tail is evicted before its head
                self.blocks.move_to_end(b.key)
        return found

    def insert(self, tokens, salt: str | None, read) -> list[Block]:
        """Cache every full block of ``tokens`` not cached yet; returns the new blocks (lazy arrays).

        ``read(start, stop)`` gives the K/V ``(keys, values)`` of positions ``start:stop`` as
        ``[layers, kv_heads, stop - start, head_dim]`` arrays, for the blocks to copy from.
        A prefix longer than the whole budget is cached up to the budget.
        """
        bs = self.block_size
        parent, chain, missing = None, [], []
        for start in range(0, min(len(tokens), self.capacity * bs) - bs + 1, bs):
            block_tokens = tuple(tokens[start:start + bs])
            key = self.chain(parent, block_tokens, salt)
            if not self._cached(key, parent, block_tokens, salt):
                self.blocks.pop(key, None)  # a collision: the newer prefix takes the key
                missing.append((start, key, parent, block_tokens))
            chain.append(key)
            parent = key
        for key in chain:  # what is already cached of this prefix is not evicted for its own tail
            if key in self.blocks:
                self.blocks.move_to_end(key)
        new = []
        if missing:
            lo, hi = missing[0][0], missing[-1][0] + bs
            keys, values = read(lo, hi)
            for start, key, parent, block_tokens in missing:
                while len(self.blocks) >= self.capacity:
                    self.blocks.popitem(last=False)
                    self.counters["evictions"] += 1
                s = start - lo
                b = Block(key, parent, block_tokens, salt, mx.contiguous(keys[:, :, s:s + bs]),
                          mx.contiguous(values[:, :, s:s + bs]))
                self.blocks[key] = b
                new.append(b)
            self.counters["inserted_blocks"] += len(new)
        for key in reversed(chain):  # the head most recent: a prefix's tail is evicted before its head
            self.blocks.move_to_end(key)
        return new

    def stats(self) -> dict:
        c = self.counters
        return {**c, "blocks": len(self.blocks), "bytes": self.nbytes, "budget_bytes": self.budget_bytes,
                "block_size": self.block_size,
                "hit_rate": c["hit_tokens"] / c["query_tokens"] if c["query_tokens"] else 0.0}

    def clear(self):
        self.blocks.clear()
