"""KV cache manager: which pages each request holds, prefix-cache lookups, and block caching.

Protocol (vLLM v1's, with caching moved after the compute):
1. `get_computed_blocks(req)` for a request that holds no blocks: the prefix-cache hit as
   (block ids, hit tokens). It takes no references and records nothing.
2. `allocate_slots(req, n, hit_blocks)`: make room for `n` more tokens after
   `req.num_computed_tokens` (+ the hit). All or nothing: False leaves every state unchanged.
   The caller then sets `req.num_computed_tokens` to the hit tokens (new requests).
3. After the step has written the KV, the caller advances `req.num_computed_tokens` and calls
   `cache_blocks(req)`, which hashes every block that became full. Blocks are cached only once their
   KV exists, so a same-step hit on a block still being written is impossible.
4. `free(req)` returns its blocks in reverse order (sequence tail evicted first).

Invariants: a request's block list covers exactly cdiv(tokens with KV slots, page_size) pages (slots of
speculative drafts included, rejected ones too), in sequence order; its first `_num_cached[req]` blocks are hashed (or were hits). Between its creation (the
first allocation) and `free` the list only grows at its end; `block_list_generation` names that lifetime
(a number no other list of any manager had), so a reader may keep what it copied and take only the new
tail. Block hashes of a request are kept across preemption (token ids never change) and dropped when it
finishes.
With a host tier (scheduler/host_tier.py), a hit list may name host blocks (negative ids, `host_hit_id`):
the lookup takes each block from HBM where cached there, else from the host tier, and stops at the first
block in neither. Allocation gives each host hit a fresh device block (cached under its hash at once) and
records the load; blocks the allocation evicts from HBM are saved to the host tier. `take_transfers` hands the
step's copies to the plan.
Counters `prefix_cache_queries` / `prefix_cache_hits` are in tokens, counted once per successful
first allocation (a re-admission after preemption counts again), as vLLM's metrics.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from deepinfer_jax.scheduler.block_pool import BlockPool
from deepinfer_jax.scheduler.host_tier import HostTier, KVTransfers, host_hit_id, is_host_hit
from deepinfer_jax.scheduler.prefix_cache import (
    BlockHash,
    PrefixCache,
    extend_block_hashes,
    max_hit_blocks,
)
from deepinfer_jax.types import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_generations = itertools.count(1)  # one number per block list's lifetime, over every manager (data-parallel ranks)


class KVCacheManager:
    """Per-request page lists on top of a BlockPool (and a PrefixCache when caching is on)."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.block_pool = BlockPool(num_pages, self.prefix_cache)
        self.host_tier = None
        if num_host_blocks:
            if not enable_prefix_caching:
                raise ValueError("the KV host tier (kv_offloading_size) needs prefix caching enabled")
            self.host_tier = HostTier(num_host_blocks)
            self.block_pool.on_evict = self.host_tier.store
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        self._generation: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests."""
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's page table (a live list: copy before handing it out)."""
        return self._blocks.get(request_id, [])

    def block_list_generation(self, request_id: str) -> int:
        """The lifetime of the request's block list (0 while it holds none): equal numbers mean the later
        list is the earlier one, grown at its end."""
        return self._generation.get(request_id, 0)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.page_size:  # only the tokens of the blocks not hashed yet
            start = len(hashes) * self.page_size
            extend_block_hashes(hashes, request.token_ids_slice(start, request.num_tokens), self.page_size, start)
        return hashes

    # ---- protocol ------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request's tokens: (block ids, number of tokens).

        Never covers the last token, so at most (num_tokens - 1) // page_size blocks.
        """
        if self.prefix_cache is None:
            return [], 0
        hashes = self._block_hashes(request)
        n = min(len(hashes), max_hit_blocks(request.num_tokens, self.page_size))
        if self.host_tier is None:
            hit = self.prefix_cache.lookup(hashes[:n])
            return hit, len(hit) * self.page_size
        hit = []
        for h in hashes[:n]:
            block_id = self.prefix_cache.get(h)
            if block_id is None:
                host_block = self.host_tier.lookup(h)
                if host_block is None:
                    break
                block_id = host_hit_id(host_block)
            hit.append(block_id)
        return hit, len(hit) * self.page_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Reserve pages for `num_new_tokens` tokens after the computed ones; False if short.

        `new_computed_blocks` (prefix hits, only for a request holding no blocks) are taken with
        one more reference each and count as computed tokens not yet in `num_computed_tokens`.
        `num_lookahead_tokens`: slots for that many more (speculative drafts, not yet tokens of the request).
        Pages of drafts a step rejects stay in the request's list (its next tokens fill them); they are freed
        with the request's others.
        """
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if new_computed_blocks and blocks:
            raise ValueError(f"request {rid} already holds blocks; prefix hits only on admission")
        num_hit = len(new_computed_blocks)
        total = request.num_computed_tokens + num_hit * self.page_size + num_new_tokens
        if num_new_tokens <= 0 or total > request.num_tokens:
            raise ValueError(
                f"request {rid}: cannot schedule {num_new_tokens} new tokens "
                f"({request.num_computed_tokens} computed + {num_hit} hit blocks, "
                f"{request.num_tokens} known)"
            )
        have = (len(blocks) if blocks else 0) + num_hit
        num_new_blocks = max(cdiv(total + num_lookahead_tokens, self.page_size) - have, 0)
        pool = self.block_pool
        host_hits = [i for i, b in enumerate(new_computed_blocks) if is_host_hit(b)]
        device_hits = [b for b in new_computed_blocks if not is_host_hit(b)]
        # Hits sitting in the free queue stop being free once touched; host hits each take a fresh block.
        evictable_hits = sum(1 for b in device_hits if pool.ref_count(b) == 0)
        if num_new_blocks + len(host_hits) + evictable_hits > pool.num_free_blocks:
            return False
        if blocks is None:
            blocks = self._blocks[rid] = []
            self._generation[rid] = next(_generations)
            self._num_cached[rid] = num_hit
            if self.prefix_cache is not None:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit * self.page_size
            if self.host_tier is not None:
                self.host_tier.queries += request.num_tokens - len(device_hits) * self.page_size
                self.host_tier.hits += len(host_hits) * self.page_size
        pool.touch(device_hits)  # before allocating, so hits are not evicted by it
        if host_hits:
            blocks.extend(self._load_host_hits(request, new_computed_blocks, host_hits))
        else:
            blocks.extend(new_computed_blocks)
        blocks.extend(pool.get_new_blocks(num_new_blocks))
        return True

    def _load_host_hits(self, request: Request, hits: Sequence[int], host_hits: list[int]) -> list[int]:
        """The hit list with each host hit replaced by a fresh device block, cached under its hash, whose
        load is recorded. Host hits are touched first, so that this allocation's saves do not evict them."""
        tier, hashes = self.host_tier, self._block_hashes(request)
        for i in host_hits:
            tier.touch(-1 - hits[i])
        fresh = iter(self.block_pool.get_new_blocks(len(host_hits)))
        out = list(hits)
        for i in host_hits:
            out[i] = next(fresh)
            tier.load(-1 - hits[i], out[i])
            self.block_pool.cache_block(out[i], hashes[i])
        return out

    def take_transfers(self) -> KVTransfers | None:
        """The page copies recorded since the last call (None without a host tier)."""
        return None if self.host_tier is None else self.host_tier.take_transfers()

    def cache_blocks(self, request: Request) -> None:
        """Hash the blocks made full by the computed tokens (call after the step ran)."""
        if self.prefix_cache is None:
            return
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.page_size, len(blocks))
        start = self._num_cached[rid]
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_cached[rid] = num_full

    def free(self, request: Request) -> None:
        """Release the request's pages, tail first. Drops its hashes too if it is finished."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._generation.pop(rid, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        if request.is_finished:
            self._hashes.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks (both tiers); only possible when no request holds pages."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.host_tier is not None:
            self.host_tier.reset()
        return True
