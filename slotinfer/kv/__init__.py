"""Memory and reuse of K/V beyond one slot: the prefix cache, the block pool and attention over its blocks."""

from .block_pool import KV_BLOCK_SIZE, RESERVED, TRASH, ZERO, BlockPool, block_bytes, blocks_for_budget
from .paged_attention import PagedDecodeView, PagedKV, PagedSequenceCache, paged_attend, write_index
from .prefix_cache import BLOCK_SIZE, PrefixCache, chain_hash

__all__ = ["BLOCK_SIZE", "PrefixCache", "chain_hash", "BlockPool", "block_bytes", "blocks_for_budget", "RESERVED",
           "KV_BLOCK_SIZE", "TRASH", "ZERO", "PagedDecodeView", "PagedKV", "PagedSequenceCache", "paged_attend", "write_index"]
