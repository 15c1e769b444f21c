"""Memory and reuse of K/V beyond one slot: the block pool (which is also the prefix cache) and attention over its blocks."""

from .block_pool import (KV_BLOCK_SIZE, RESERVED, TRASH, ZERO, BlockPool, block_bytes, blocks_for_budget,
                         chain_hash)
from .paged_attention import PagedDecodeView, PagedKV, PagedSequenceCache, paged_attend, write_index

__all__ = ["chain_hash", "BlockPool", "block_bytes", "blocks_for_budget", "RESERVED", "KV_BLOCK_SIZE", "TRASH", "ZERO",
           "PagedDecodeView", "PagedKV", "PagedSequenceCache", "paged_attend", "write_index"]
