"""Block pool: `num_pages` KV-cache pages with reference counts and an LRU free queue.

Invariants:
- Block 0 is the NULL block: never allocated, never freed, never hashed. The runner pads page
  tables (and the slots of padding tokens) with it, so its contents are garbage by design.
  Usable blocks are 1 .. num_pages-1.
- A block is in the free queue iff its ref count is 0. Free blocks that hold a cached (hashed) full
  block keep their hash: they can still be hit and revived by `touch` until allocation evicts them.
- The free queue is ordered: allocation pops from the head (least recently freed = evicted first).
  `free_blocks` appends hashed blocks at the tail in the order given (callers pass a sequence's
  blocks in reverse so its tail is evicted before its head, like vLLM) and puts unhashed blocks at
  the head, since they hold nothing worth keeping.
- Allocation of a hashed block removes its hash from the prefix cache (eviction); with `on_evict` set
  (the host tier, scheduler/host_tier.py) it is told (block id, hash) first, so the page can be saved.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from deepinfer_jax.scheduler.prefix_cache import BlockHash, PrefixCache

NULL_BLOCK_ID = 0


class BlockPool:
    """Owns ref counts, block hashes and the free queue of all pages."""

    def __init__(self, num_pages: int, prefix_cache: PrefixCache | None = None) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (block 0 is the null block), got {num_pages}")
        self.num_pages = num_pages
        self.prefix_cache = prefix_cache
        self.on_evict = None  # (block id, hash) -> None, called when allocation evicts a cached block
        self._ref = [0] * num_pages
        self._hash: list[BlockHash | None] = [None] * num_pages
        self._ref[NULL_BLOCK_ID] = 1  # pinned forever
        # block id -> None, head = next to allocate. OrderedDict gives O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_pages))

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached or not (a cached free block is evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (ref count > 0), in [0, 1]."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue from head (evicted first) to tail."""
        return list(self._free)

    # ---- allocation ----------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop `num_blocks` from the head of the free queue, evicting their hashes; ref count 1."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            if self.on_evict is not None and self._hash[block_id] is not None:
                self.on_evict(block_id, self._hash[block_id])
            self._evict(block_id)
            self._ref[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to each block (prefix hits); free ones leave the free queue."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                raise ValueError("the null block cannot be touched")
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block, in order; blocks reaching 0 join the free queue."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID or self._ref[block_id] <= 0:
                raise ValueError(f"double free of block {block_id}")
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None
                if self._hash[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    # ---- prefix caching ------------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that a held, full block has this hash. False if caching is off or the hash is
        already cached in another block (this block then stays uncached)."""
        if self.prefix_cache is None or self._hash[block_id] is not None:
            return False
        if self._ref[block_id] <= 0:
            raise ValueError(f"block {block_id} is free; only held blocks can be cached")
        if not self.prefix_cache.insert(block_hash, block_id):
            return False
        self._hash[block_id] = block_hash
        return True

    def _evict(self, block_id: int) -> None:
        h = self._hash[block_id]
        if h is not None:
            self._hash[block_id] = None
            assert self.prefix_cache is not None
            self.prefix_cache.remove(h, block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only when no block is held (as vLLM); False otherwise."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for block_id in range(1, self.num_pages):
            self._evict(block_id)
        return True
