"""Prompt lookup: a row drafts from its own prompt and output.

A row whose last ``n`` tokens occurred earlier in the row proposes the tokens that followed that
earlier occurrence (the most recent one), trying ``n`` from ``max_n`` down to ``min_n``.  Code being
edited, a JSON document being rewritten and quotations all repeat long spans of the prompt, and
these continuations are exactly those spans.

By default ``n`` goes from 5 down to 1: replayed over the copy-heavy prompts' outputs with the
engine's gate and measured step costs (``benchmarks/spec_replay.py`` against ``--max-n 4 --min-n
2``), single-token matches and 5-grams draft 1.02-1.03x faster than ``n`` from 4 down to 2, and as
fast on the prompts with nothing to copy: the gate shuts on a row whose short matches keep missing.

The index is incremental: appending a token registers the n-grams it completes a continuation
for, so a step costs O(max_n - min_n) dictionary operations however long the row is.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """A row's tokens and, for each n-gram (``min_n <= n <= max_n``) followed by at least one token,
    the start of its most recent such occurrence.

        >>> index = NgramIndex([5, 6, 7, 8, 5, 6], max_n=3, min_n=1)
        >>> index.propose(3)  # the suffix [5, 6] occurred at 0; 7, 8, 5 followed it
        [7, 8, 5]
    """

    __slots__ = ("tokens", "max_n", "min_n", "_last")

    def __init__(self, tokens: Iterable[int] = (), *, max_n: int = 5, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.tokens: list[int] = []
        self.max_n, self.min_n = max_n, min_n
        self._last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        """Append tokens; each one is the continuation of the n-grams that end just before it."""
        tokens, last, lo, hi = self.tokens, self._last, self.min_n, self.max_n
        for t in new:
            end = len(tokens)  # the n-grams ending at ``end - 1`` now have a continuation
            for n in range(lo, min(hi, end) + 1):
                last[tuple(tokens[end - n:end])] = end - n
            tokens.append(t)

    def find(self, n: int) -> int | None:
        """Start of the most recent earlier occurrence of the row's last ``n`` tokens, or None."""
        if n > len(self.tokens) - 1:
            return None
        return self._last.get(tuple(self.tokens[-n:]))

    def propose(self, k: int) -> list[int]:
        """At most ``k`` tokens: what followed the longest suffix seen before (empty when none was)."""
        if k <= 0:
            return []
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._last.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []

    def entries(self) -> dict[tuple[int, ...], int]:
        """A copy of the index (for tests: an index built incrementally equals one built at once)."""
        return dict(self._last)


class PromptLookup:
    """The draft source over a row's own tokens (its :class:`NgramIndex`)."""

    name = "lookup"

    def __init__(self, *, max_n: int = 5, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        NgramIndex(max_n=max_n, min_n=min_n)  # checks the bounds now, not at the first row

    def index(self, tokens: Iterable[int] = ()) -> NgramIndex:
        return NgramIndex(tokens, max_n=self.max_n, min_n=self.min_n)

    def propose(self, row, k: int) -> list[int]:
        return row.index.propose(k)
