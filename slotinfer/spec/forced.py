"""Forced tokens: the span a row's constraint allows in one way only.

Past ``{"name":"`` a JSON schema with fixed keys allows nothing but the next key; a regex with a
literal middle allows nothing but that literal.  llguidance's matcher computes these fast-forward
tokens (``LLMatcher.compute_ff_tokens``, without changing the matcher's state), leaving out a final
token that could still merge with what follows.  Every token it gives is one the grammar accepts,
one after another; the model, verifying them, still picks its own tokenization, so they are drafts
like any other, only far more often right.
"""

from __future__ import annotations


class ForcedTokens:
    """The draft source over a row's constraint: ``row.matcher`` (an ``llguidance.LLMatcher``
    advanced by every token the row takes), or None for a free row.

        >>> forced = ForcedTokens()
        >>> forced.propose(row, 8)  # e.g. the tokens of '{"name' for a schema whose first key is "name"
    """

    name = "forced"
    # A new row's acceptance for these starts at 0.9 (9 accepted, 1 miss), not shut: they are the
    # grammar's only way on, and the model takes them unless it would spell them in other tokens.
    prior = (9.0, 1.0)

    @staticmethod
    def applies(row) -> bool:
        """Only a constrained row has forced tokens (a free row's gate for them would stay open at
        the prior, and have every step read back first for drafts that never come)."""
        return row.matcher is not None

    def propose(self, row, k: int) -> list[int]:
        matcher = row.matcher
        if matcher is None or k <= 0 or matcher.is_stopped():
            return []
        return list(matcher.compute_ff_tokens()[:k])
