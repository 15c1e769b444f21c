"""A suffix pool shared across rows: what followed each n-gram in the text rows have produced.

Like llama.cpp's ``ngram-mod`` pool and vLLM's suffix decoding, text one row has seen drafts for
another: a batch of similar requests (the same document edited again, the same JSON shape filled
in, an agent loop re-sending its tool output) copies from its neighbours and predecessors.

Entries map ``(cache_salt, n-gram)`` to the token that followed it most recently.  The salt is
part of the key, compared exactly (no hashing), so a row drafts only from text of rows with the
same salt: one tenant's text never drafts for another, and ``None`` is a namespace of its own.  A
draft chains lookups: the token found is appended to the context and the next n-gram looked up,
up to ``k`` tokens.  Memory is bounded by ``max_entries``: past it the least recently used entry
(written or read) goes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# What one entry holds in CPython (an OrderedDict slot, the key tuple with its salt and n ints,
# the value): tracemalloc gives 150-190 bytes for n = 2..4 on real text, with the token ints shared
# with the rows' own lists; counted generously, since the budget itself is in entries.
BYTES_PER_ENTRY = 260


class SuffixPool:
    """n-gram -> next token continuations learned from rows' text, per ``cache_salt``, LRU-bounded.

        >>> pool = SuffixPool(n=2, max_entries=1000)
        >>> pool.learn([1, 2, 3, 4, 1, 2], salt="a")
        >>> pool.follow([9, 1, 2], 3, salt="a")  # 1 2 -> 3, 2 3 -> 4, 3 4 -> 1
        [3, 4, 1]
        >>> pool.follow([9, 1, 2], 3, salt="b")
        []
    """

    name = "pool"

    def __init__(self, *, n: int = 3, max_entries: int = 1 << 18):
        if n < 1 or max_entries < 1:
            raise ValueError(f"need n >= 1 and max_entries >= 1, got n={n}, max_entries={max_entries}")
        self.n, self.max_entries = n, max_entries
        self._next: OrderedDict[tuple, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def nbytes(self) -> int:
        """An estimate of the memory the entries hold (``BYTES_PER_ENTRY`` each)."""
        return len(self._next) * BYTES_PER_ENTRY

    def learn(self, tokens: Sequence[int], salt: str | None = None, *, start: int = 0) -> None:
        """Record the continuation of every n-gram of ``tokens`` whose next token is at ``start`` or
        later (``start`` lets a row feed only what it appended since the last call)."""
        n, table = self.n, self._next
        for end in range(max(start, n), len(tokens)):
            key = (salt, *tokens[end - n:end])
            table[key] = tokens[end]
            table.move_to_end(key)
        while len(table) > self.max_entries:
            table.popitem(last=False)

    def follow(self, context: Sequence[int], k: int, salt: str | None = None) -> list[int]:
        """At most ``k`` tokens continuing ``context`` from text learned under ``salt``."""
        n, table = self.n, self._next
        if k <= 0 or len(context) < n:
            return []
        window = list(context[-n:])
        out: list[int] = []
        while len(out) < k:
            key = (salt, *window)
            t = table.get(key)
            if t is None:
                break
            table.move_to_end(key)
            out.append(t)
            window = window[1:] + [t]
        return out

    def propose(self, row, k: int) -> list[int]:
        """The draft source's call: :meth:`follow` on a row's tokens, under its salt."""
        return self.follow(row.tokens, k, row.salt)
