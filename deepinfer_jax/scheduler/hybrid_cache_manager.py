"""Hybrid KV cache manager: a page table per cache group per request (DeepSeek-V4's `v4_cache_groups`), the
accounting of vLLM's hybrid KV cache manager, behind KVCacheManager's protocol (kv_cache_manager.py).

A group's page holds `rows_per_page(page_size)` rows of each of its layers (page_size, or the compressors' state
groups' own smaller page: config_v4.py `page_rows_of`); a row stands for `tokens_per_row` tokens (1 for the
windowed groups, the compression rate for `csa` / `hca`). After `n` computed tokens a request's table of a group
covers `group.pages(n)` pages, page i at index i. Pools: `CachePools` (config_v4.py) gives each group its pool,
one shared pool when the groups' pages have equal bytes, else one per group.

- Windowed groups (`window_tokens`: `sliding` and the compressors' `*_state`): before each allocation the pages
  wholly before `first_live_page(num_computed)` go back to their pool and the null page takes their place in
  the table, so a request holds at most its window and its step's chunk of them whatever its length. (They go
  back even when the allocation then fails: no later token reads them.)
- `allocate_slots(req, k)` needs `pages(n + k) - pages(n)` new pages in each group, all or nothing over the
  groups and pools; `free` returns every group's pages, tail first.
- Prefix caching: page i of a group is cached under the hash of the token blocks up to the one holding its last
  token (of the request's page_size-token chain), keyed by group and page index, so it names exactly the rows it
  holds (a smaller page is cached once the block holding its last token is full). A hit of h tokens needs every compressed group's pages of those h tokens and each windowed
  group's pages from `first_live_page(h)` on (null before); h is a multiple of every compressed group's page
  span (page_size * rate), the longest such h whose pages are all cached. The hit (`GroupHit`) is what
  `allocate_slots` takes.
- The page lists change in the middle (freed pages become null), so `block_list_generation` is always 0
  (unknown: readers convert the whole list each step). No host tier (`take_transfers` is None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from deepinfer_jax.config_v4 import CachePools, v4_max_live_pages
from deepinfer_jax.scheduler.block_pool import NULL_BLOCK_ID, BlockPool
from deepinfer_jax.scheduler.prefix_cache import BlockHash, PrefixCache, extend_block_hashes
from deepinfer_jax.types import Request


@dataclass(frozen=True)
class GroupHit:
    """A prefix-cache hit over the groups: `num_tokens` and each group's page ids (null pages for a windowed
    group's pages behind the window)."""

    num_tokens: int = 0
    blocks: tuple[tuple[int, ...], ...] = field(default_factory=tuple)

    def __bool__(self) -> bool:
        return self.num_tokens > 0


class HybridKVCacheManager:
    """Per-request, per-group page lists over the pools of `pools` (and a prefix cache per pool)."""

    def __init__(self, pools: CachePools, enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 max_chunk: int | None = None) -> None:
        self.pools_spec = pools
        self.groups = pools.groups
        self.page_size = ps = pools.page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_caches = [PrefixCache() if enable_prefix_caching else None for _ in pools.pool_pages]
        self.pools = [BlockPool(n, pc) for n, pc in zip(pools.pool_pages, self.prefix_caches)]
        self.prefix_cache = self.prefix_caches[0]
        self.host_tier = None
        if max_model_len is not None:  # one sequence of max_model_len fits every pool: steps always progress
            need = [0] * len(self.pools)
            for g, k in zip(self.groups, pools.pool_of):
                need[k] += v4_max_live_pages(g, ps, max_model_len, max_chunk or max_model_len)
            for k, (n, pool) in enumerate(zip(need, self.pools)):
                if n > pool.num_usable_blocks:
                    names = [g.name for g, j in zip(self.groups, pools.pool_of) if j == k]
                    raise ValueError(f"the pool of cache groups {names} has {pool.num_usable_blocks} usable pages, "
                                     f"fewer than the {n} one sequence of max_model_len {max_model_len} needs")
        spans = [g.rows_per_page(ps) * g.tokens_per_row for g in self.groups if g.window_tokens is None]
        self.hit_granularity = math.lcm(ps, *spans)  # tokens a prefix hit is a multiple of
        self._blocks: dict[str, list[list[int]]] = {}
        self._skipped: dict[str, list[int]] = {}  # per group: pages before this index are null (windowed)
        self._num_cached: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- queries -------------------------------------------------------------------------------
    def _pool(self, gi: int) -> BlockPool:
        return self.pools[self.pools_spec.pool_of[gi]]

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by requests, over every pool."""
        usable = sum(p.num_usable_blocks for p in self.pools)
        return sum(p.num_usable_blocks - p.num_free_blocks for p in self.pools) / usable

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's page table of each group (live lists: copy before handing them out)."""
        return tuple(self._blocks.get(request_id) or ([] for _ in self.groups))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The first group's table (`sliding`: one page per page_size positions, null behind the window)."""
        blocks = self._blocks.get(request_id)
        return blocks[0] if blocks else []

    def block_list_generation(self, request_id: str) -> int:
        return 0

    def _key(self, gi: int, token_hash: BlockHash) -> BlockHash:
        return bytes([gi]) + token_hash

    def _page_block(self, gi: int, page: int) -> int:
        """The index of the page_size-token block holding the last token of group gi's page `page`."""
        g = self.groups[gi]
        return ((page + 1) * g.rows_per_page(self.page_size) * g.tokens_per_row - 1) // self.page_size

    def _page_key(self, gi: int, page: int, hashes: list[BlockHash]) -> BlockHash:
        return self._key(gi, hashes[self._page_block(gi, page)]) + page.to_bytes(8, "little")

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < request.num_tokens // self.page_size:
            start = len(hashes) * self.page_size
            extend_block_hashes(hashes, request.token_ids_slice(start, request.num_tokens), self.page_size, start)
        return hashes

    # ---- protocol ------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[GroupHit, int]:
        """The longest cached prefix usable by every group: (GroupHit, its tokens). Never the last token."""
        if not self.enable_prefix_caching:
            return GroupHit(), 0
        ps, G = self.page_size, self.hit_granularity
        hashes = self._block_hashes(request)
        limit = min(request.num_tokens - 1, len(hashes) * ps) // G * G
        for gi, g in enumerate(self.groups):  # compressed groups: the leading run of cached pages bounds the hit
            if g.window_tokens is None and limit:
                pc, n = self.prefix_caches[self.pools_spec.pool_of[gi]], 0
                while n < g.pages(limit, ps) and pc.get(self._page_key(gi, n, hashes)) is not None:
                    n += 1
                limit = min(limit, n * g.rows_per_page(ps) * g.tokens_per_row) // G * G
        for h in range(limit, 0, -G):
            hit = self._hit_at(h, hashes)
            if hit is not None:
                return GroupHit(h, hit), h
        return GroupHit(), 0

    def _hit_at(self, h: int, hashes: list[BlockHash]) -> tuple[tuple[int, ...], ...] | None:
        """Each group's pages of a hit of h tokens, or None if one of them is not cached."""
        ps, out = self.page_size, []
        for gi, g in enumerate(self.groups):
            pc = self.prefix_caches[self.pools_spec.pool_of[gi]]
            first = g.first_live_page(h, ps)
            ids = [NULL_BLOCK_ID] * first
            for i in range(first, g.pages(h, ps)):
                b = pc.get(self._page_key(gi, i, hashes))
                if b is None:
                    return None
                ids.append(b)
            out.append(tuple(ids))
        return tuple(out)

    def _free_skipped(self, rid: str, num_computed: int) -> None:
        """Windowed groups: pages wholly before the next token's window go back; null in their place."""
        blocks, skipped = self._blocks[rid], self._skipped[rid]
        for gi, g in enumerate(self.groups):
            if g.window_tokens is None:
                continue
            first = min(g.first_live_page(num_computed, self.page_size), len(blocks[gi]))
            if first > skipped[gi]:
                dead = [b for b in blocks[gi][skipped[gi]:first] if b != NULL_BLOCK_ID]
                blocks[gi][skipped[gi]:first] = [NULL_BLOCK_ID] * (first - skipped[gi])
                skipped[gi] = first
                self._pool(gi).free_blocks(reversed(dead))

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: GroupHit | tuple = (),
                       num_lookahead_tokens: int = 0) -> bool:
        """Reserve every group's pages for `num_new_tokens` tokens after the computed ones (and the hit, for a
        request holding none); False if some pool is short, leaving every table as it was (bar the pages behind
        the windows, which go back first)."""
        rid = request.request_id
        hit = new_computed_blocks if new_computed_blocks else GroupHit()
        blocks = self._blocks.get(rid)
        if hit and blocks:
            raise ValueError(f"request {rid} already holds blocks; prefix hits only on admission")
        computed = request.num_computed_tokens + hit.num_tokens
        total = computed + num_new_tokens
        if num_new_tokens <= 0 or total > request.num_tokens:
            raise ValueError(f"request {rid}: cannot schedule {num_new_tokens} new tokens "
                             f"({request.num_computed_tokens} computed + {hit.num_tokens} hit, {request.num_tokens} known)")
        if blocks:
            self._free_skipped(rid, computed)
        have = [len(b) for b in blocks] if blocks else [len(b) for b in hit.blocks] or [0] * len(self.groups)
        need = [max(g.pages(total + num_lookahead_tokens, self.page_size) - n, 0) for g, n in zip(self.groups, have)]
        per_pool = [0] * len(self.pools)
        for gi, n in enumerate(need):
            per_pool[self.pools_spec.pool_of[gi]] += n
        for gi, ids in enumerate(hit.blocks):  # hits in a free queue stop being free once touched
            pool = self._pool(gi)
            per_pool[self.pools_spec.pool_of[gi]] += sum(1 for b in ids
                                                         if b != NULL_BLOCK_ID and pool.ref_count(b) == 0)
        if any(n > p.num_free_blocks for n, p in zip(per_pool, self.pools)):
            return False
        if blocks is None:
            blocks = self._blocks[rid] = [list(ids) for ids in hit.blocks] or [[] for _ in self.groups]
            self._skipped[rid] = [sum(1 for b in ids if b == NULL_BLOCK_ID) for ids in blocks]
            self._num_cached[rid] = [len(ids) for ids in blocks]
            for gi, ids in enumerate(hit.blocks):
                self._pool(gi).touch([b for b in ids if b != NULL_BLOCK_ID])
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += hit.num_tokens
        for gi, n in enumerate(need):
            blocks[gi].extend(self._pool(gi).get_new_blocks(n))
        return True

    def take_transfers(self) -> None:
        return None

    def cache_blocks(self, request: Request) -> None:
        """Cache each group's pages made full by the computed tokens (call after the step ran)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if not blocks:
            return
        hashes = None
        for gi, g in enumerate(self.groups):
            full = min(g.rows(request.num_computed_tokens) // g.rows_per_page(self.page_size), len(blocks[gi]))
            start = self._num_cached[rid][gi]
            if full <= start:
                continue
            hashes = hashes or self._block_hashes(request)
            while full > start and self._page_block(gi, full - 1) >= len(hashes):  # its last block not full yet
                full -= 1
            for i in range(start, full):
                if blocks[gi][i] != NULL_BLOCK_ID:
                    self._pool(gi).cache_block(blocks[gi][i], self._page_key(gi, i, hashes))
            self._num_cached[rid][gi] = full

    def free(self, request: Request) -> None:
        """Release every group's pages, tail first. Drops the request's hashes too if it is finished."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, None)
        self._skipped.pop(rid, None)
        self._num_cached.pop(rid, None)
        for gi, ids in enumerate(blocks or ()):
            self._pool(gi).free_blocks(b for b in reversed(ids) if b != NULL_BLOCK_ID)
        if request.is_finished:
            self._hashes.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached pages; only possible when no request holds pages."""
        if any(p.num_free_blocks != p.num_usable_blocks for p in self.pools):
            return False
        return all(p.reset_prefix_cache() for p in self.pools)
