"""The block pool: under random admissions, growth, shared prefixes, registrations and releases,
no block is held twice unless shared by reference, reference counts are what the tables say,
a write never lands in a block another slot holds, a cached hit is always the right tokens,
allocation stays within the pool and ``can_allocate`` / ``can_grow`` are exact, and every block
is free again when all slots are.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from slotinfer.errors import InvalidRequestError, OutOfMemoryError
from slotinfer.kv import RESERVED, TRASH, ZERO, BlockPool, blocks_for_budget
from slotinfer.kv.block_pool import block_bytes

SLOTS = 4
slots = st.integers(0, SLOTS - 1)
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)
# prompts that often start alike: two shared beginnings cut anywhere, then a few own tokens
prompts = st.builds(lambda base, n, own: base[:n] + own, st.sampled_from([[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [1] * 12]),
                    st.integers(0, 12), st.lists(st.integers(0, 2), max_size=4)).filter(bool)


class PoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(RESERVED + 1, 16), bs=st.integers(1, 4), width=st.integers(1, 6),
                cap=st.sampled_from([None, 0, 1, 3]))
    def make(self, num_blocks, bs, width, cap):
        self.pool = BlockPool(num_blocks, bs, slots=SLOTS, max_blocks=width, cache_blocks=cap)
        self.bs = bs
        self.tokens = {}  # slot -> (its tokens, salt)
        self.content = {}  # block -> the tokens its last writer put in it

    def _write(self, slot, start):
        """The slot wrote its tokens from position ``start`` on: only into blocks it alone holds."""
        toks = self.tokens[slot][0]
        p = self.pool
        positions = np.arange(start, len(toks))
        p.locate(np.full(len(positions), slot), positions)  # the engine's one way to a write: it must agree
        for j in range(start // self.bs, p.blocks_for(len(toks))):
            b = int(p.tables[slot, j])
            assert p.ref[b] == 1, f"slot {slot} writes into block {b}, held {p.ref[b]} times"
            self.content[b] = tuple(toks[j * self.bs:(j + 1) * self.bs])

    def _grow(self, slot, n):
        """Grow ``slot`` to ``n`` tokens, checking that can_grow says exactly what grow does."""
        p = self.pool
        before_free, before_tables = p.num_free, p.tables.copy()
        held_elsewhere = set(p.tables[np.arange(SLOTS) != slot].ravel().tolist())
        expect = p.blocks_for(n) <= p.tables.shape[1] and p.needed(slot, n) <= p.num_free
        assert p.can_grow(slot, n) == expect
        if not expect:
            event("growth refused")
            with pytest.raises((OutOfMemoryError, InvalidRequestError)):
                p.grow(slot, n)
            assert p.num_free == before_free and (p.tables == before_tables).all()
            return False
        need = p.needed(slot, n)
        new = p.grow(slot, n)
        assert len(new) == need and p.num_free == before_free - need
        assert not (set(new) & held_elsewhere) and not (set(new) & set(before_tables[slot].tolist()) - {ZERO})
        return True

    @rule(slot=slots, prompt=prompts, salt=st.sampled_from([None, "a"]), cached=st.booleans())
    def admit(self, slot, prompt, salt, cached):
        p = self.pool
        if slot in self.tokens:
            return
        hit = []
        if cached:
            hit = p.lookup(prompt, salt, limit=min(len(prompt) - 1, p.tables.shape[1] * self.bs))
            for j, b in enumerate(hit):  # a hit is always the right tokens
                assert self.content[b] == tuple(prompt[j * self.bs:(j + 1) * self.bs])
            p.share(slot, hit)
            event("a cached prefix shared" if hit else "no cached prefix")
        start = len(hit) * self.bs
        if cached and len(prompt) - 1 > start and len(hit) < p.tables.shape[1]:
            parent = p.key_of(hit[-1]) if hit else None
            b, n = p.lookup_partial(parent, prompt[start:len(prompt) - 1], salt)
            if b is not None:  # a partial hit is always the right tokens, after the right parent, of the salt
                assert self.content[b][:n] == tuple(prompt[start:start + n]) and n >= 1
                of, have, salt_of = p.partial[b] if b in p.partial else p.meta[b][1:]
                assert of == parent and salt_of == salt and have[:n] == tuple(prompt[start:start + n])
                if b in p.partial and n == len(have):
                    p.adopt(slot, b)
                    start += n
                    event("a partial block adopted")
                else:
                    event("a partial block to copy")
        self.tokens[slot] = (list(prompt), salt)
        if not self._grow(slot, len(prompt)):
            p.release_slot(slot)
            del self.tokens[slot]
            return
        self._write(slot, start)

    @rule(slot=slots, more=tokens)
    def extend(self, slot, more):
        if slot not in self.tokens:
            return
        toks = self.tokens[slot][0]
        if self._grow(slot, len(toks) + len(more)):
            start = len(toks)
            toks += more
            self._write(slot, start)

    @rule(slot=slots)
    def register(self, slot):
        if slot in self.tokens:
            self._register(slot)

    def _register(self, slot):
        """Register ``slot``'s full blocks; returns the last one's key (None: none)."""
        toks, salt = self.tokens[slot]
        parent = None
        for j in range(len(toks) // self.bs):
            parent = self.pool.register(int(self.pool.tables[slot, j]), parent,
                                        toks[j * self.bs:(j + 1) * self.bs], salt)
        return parent

    @rule(slot=slots, keep=st.booleans())
    def release(self, slot, keep):
        """The slot lets go; ``keep``: its full blocks registered and its last, partial one kept first."""
        if slot not in self.tokens:
            return
        p, toks, salt = self.pool, *self.tokens[slot]
        j = len(toks) // self.bs
        if keep and len(toks) % self.bs:
            parent = self._register(slot)
            block = int(p.tables[slot, j])
            if p.register_partial(block, parent, toks[j * self.bs:], salt):
                event("a partial block kept")
        self.pool.release_slot(slot)
        del self.tokens[slot]

    @rule()
    def compact(self):
        """No slot holds a block: the cached ones move to the lowest ids and still hit."""
        if self.tokens:
            return
        old = self.pool.compact()
        self.content = {RESERVED + i: self.content[b] for i, b in enumerate(old)}
        assert sorted([*self.pool.meta, *self.pool.partial]) == list(range(RESERVED, RESERVED + len(old)))
        event("compacted")

    @invariant()
    def the_cache_is_the_free_queues_tail_within_its_cap(self):
        if not hasattr(self, "pool"):
            return
        p = self.pool
        kept = set(p.meta) | set(p.partial)
        assert len(p.cached) <= p.cache_blocks and set(p.cached) <= kept and not set(p.meta) & set(p.partial)
        assert all(p.ref[b] == 0 for b in p.cached) and all(p.ref[b] > 0 for b in kept - set(p.cached))
        parents = {(m[0], m[2]) for m in p.partial.values()} | {(m[1], m[3]) for m in p.meta.values()}
        assert parents == set(p.by_parent) and {b for group in p.by_parent.values() for b in group} == kept
        if p.cached:
            assert list(p.free)[-len(p.cached):] == list(p.cached)
        assert {p.by_hash[m[0]] for m in p.meta.values()} == set(p.meta)

    @invariant()
    def refcounts_match_tables(self):
        if not hasattr(self, "pool"):
            return
        p = self.pool
        held = np.concatenate([p.tables[s, : p.held[s]] for s in range(SLOTS)])
        assert not np.isin(held, [ZERO, TRASH]).any()
        np.testing.assert_array_equal(p.ref, np.bincount(held, minlength=p.num_blocks))
        for s in range(SLOTS):
            assert (p.tables[s, p.held[s]:] == ZERO).all()
            row = p.tables[s, : p.held[s]].tolist()
            assert len(set(row)) == len(row), f"slot {s} holds a block twice: {row}"
            n = len(self.tokens[s][0]) if s in self.tokens else 0
            assert p.held[s] == p.blocks_for(n)
        assert set(p.free) == set(np.flatnonzero(p.ref == 0).tolist()) - {ZERO, TRASH}
        assert p.num_used + p.num_free == p.num_blocks - RESERVED

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for s in list(self.tokens):
            self.pool.release_slot(s)
        p = self.pool
        assert p.num_free == p.num_blocks - RESERVED and not p.ref.any()


TestPoolMachine = PoolMachine.TestCase


def test_allocation_order_keeps_cached_prefixes_longest():
    """Unregistered blocks are reused first, then registered ones, a prefix's last block before its first."""
    pool = BlockPool(2 + 6, 2, slots=2, max_blocks=4)
    pool.grow(0, 6)  # blocks 2, 3, 4
    parent = None
    for j, toks in enumerate([(1, 2), (3, 4), (5, 6)]):
        parent = pool.register(int(pool.tables[0, j]), parent, toks)
    pool.grow(1, 4)  # blocks 5, 6
    pool.release_slot(1)
    pool.release_slot(0)
    assert pool.allocate(5) == [5, 6, 7, 4, 3]  # the free ones, then the cached prefix's tail first
    assert pool.lookup([1, 2, 3, 4, 5, 6]) == [2]


def test_lookup_verifies_tokens_and_salt():
    pool = BlockPool(8, 2, slots=2, max_blocks=3)
    pool.grow(0, 4)
    k = pool.register(int(pool.tables[0, 0]), None, (7, 8), "x")
    pool.register(int(pool.tables[0, 1]), k, (9, 9), "x")
    assert pool.lookup([7, 8, 9, 9], "x") == pool.tables[0, :2].tolist()
    assert pool.lookup([7, 8, 9, 9], "y") == [] and pool.lookup([7, 8, 9, 9]) == []
    assert pool.lookup([7, 8, 9, 9], "x", limit=3) == [int(pool.tables[0, 0])]
    # a forged entry under the right key but with other tokens is not served
    b = int(pool.tables[0, 1])
    key, parent, _, salt = pool.meta[b]
    pool.meta[b] = (key, parent, (9, 0), salt)
    assert pool.lookup([7, 8, 9, 9], "x") == [int(pool.tables[0, 0])]


def test_locate_writes_through_the_table():
    pool = BlockPool(10, 4, slots=2, max_blocks=3)
    pool.grow(1, 9)
    blocks, offsets = pool.locate(np.array([1, 1, 0]), np.array([0, 8, -1]))
    assert blocks.tolist() == [pool.tables[1, 0], pool.tables[1, 2], TRASH] and offsets.tolist() == [0, 0, 0]
    with pytest.raises(InvalidRequestError, match="grow the slot first"):
        pool.locate(np.array([1]), np.array([12]))


def test_a_write_into_a_shared_block_is_refused():
    pool = BlockPool(10, 2, slots=2, max_blocks=3)
    pool.grow(0, 3)
    pool.register(int(pool.tables[0, 0]), None, (1, 2))
    pool.share(1, pool.lookup([1, 2, 3]))
    pool.grow(1, 3)
    with pytest.raises(InvalidRequestError, match="share"):
        pool.locate(np.array([1]), np.array([1]))
    assert pool.locate(np.array([1]), np.array([2]))[0].tolist() == [pool.tables[1, 1]]


def test_the_cap_keeps_the_most_recently_released_and_zero_turns_the_cache_off():
    pool = BlockPool(12, 1, slots=2, max_blocks=4, cache_blocks=2)
    for slot, toks in ((0, (1, 2, 3)), (1, (4, 5, 6))):
        pool.grow(slot, 3)
        parent = None
        for j, t in enumerate(toks):
            parent = pool.register(int(pool.tables[slot, j]), parent, (t,))
    pool.release_slot(0)
    assert len(pool.lookup([1, 2, 3, 9])) == 2 and len(pool.cached) == 2  # its tail went first: the head stays
    pool.release_slot(1)
    assert len(pool.cached) == 2 and len(pool.lookup([4, 5, 6, 9])) == 2 and pool.counters["evicted"] == 4
    off = BlockPool(6, 1, slots=1, max_blocks=2, cache_blocks=0)
    off.grow(0, 1)
    off.register(int(off.tables[0, 0]), None, (1,))
    assert not off.meta and off.lookup([1, 2]) == []


def test_budget_to_blocks():
    shape = dict(num_layers=30, kv_heads=3, head_dim=64, dtype=mx.float32, block_size=128)
    each = block_bytes(**shape)
    assert each == 2 * 30 * 3 * 128 * 64 * 4
    assert blocks_for_budget(2**30, **shape) == 2**30 // each
    assert blocks_for_budget(2**30, **{**shape, "dtype": mx.float16}) == 2 * (2**30 // each)
    with pytest.raises(InvalidRequestError, match="raise kv_cache_bytes"):
        blocks_for_budget(2 * each, **shape)


def test_bad_use_is_a_typed_error():
    pool = BlockPool(4, 2, slots=1, max_blocks=4)
    with pytest.raises(OutOfMemoryError, match="can_allocate"):
        pool.allocate(3)
    with pytest.raises(InvalidRequestError, match="max_blocks"):
        pool.grow(0, 9)
    pool.grow(0, 1)
    with pytest.raises(InvalidRequestError, match="empty slot"):
        pool.share(0, [])
    with pytest.raises(InvalidRequestError, match="full block"):
        pool.register(int(pool.tables[0, 0]), None, (1,))
    with pytest.raises(InvalidRequestError, match="num_blocks"):
        BlockPool(2, 2, slots=1, max_blocks=1)
