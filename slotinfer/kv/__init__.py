"""Memory and reuse of K/V beyond one slot: the prefix cache (and, next, the block pool)."""

from .prefix_cache import BLOCK_SIZE, PrefixCache

__all__ = ["BLOCK_SIZE", "PrefixCache"]
