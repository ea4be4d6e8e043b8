"""Prefix cache: a hash chain over FULL blocks and the map from block hash to block id.

Block i of a sequence (tokens [i*page_size, (i+1)*page_size)) has the hash

    h_i = sha256(h_{i-1} || int64 bytes of the block's token ids),  h_{-1} = ROOT_HASH

so a block hash identifies the whole prefix up to the end of that block: equal block contents after
different prefixes get different hashes. Partial blocks are never hashed and never cached.

Collision policy: SHA-256 over 256 bits; a collision is treated as impossible (like vLLM's sha256
option) and token ids are not re-checked on a hit. Hashes are stable within a process and across
runs on machines of the same byte order; they are never persisted.

Lookup (`PrefixCache.lookup`) returns the longest run of leading block hashes that are all cached:
the chain breaks at the first miss (a later block can't be reused without its parents). The caller
caps the query so that a hit never covers the last token of a sequence (`max_hit_blocks`), which
must be computed to get logits. Touching the hit blocks (ref count up, off the free queue) is the
block pool's job (`BlockPool.touch`), done when the request actually gets its slots.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

ROOT_HASH: BlockHash = hashlib.sha256(b"deepinfer-jax prefix cache root v1").digest()


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], page_size: int, start: int = 0
) -> list[BlockHash]:
    """Append to `block_hashes` (in place) the hashes of the full blocks of `token_ids` it lacks.

    `block_hashes` must be the hashes of the first len(block_hashes) blocks of the same sequence;
    incremental use costs one hash per newly completed block. `token_ids` may start at token `start`
    of the sequence (a multiple of page_size, at most len(block_hashes) * page_size), so a caller
    need not build the whole sequence to hash its newest blocks. Returns `block_hashes`.
    """
    if start % page_size or start > len(block_hashes) * page_size:
        raise ValueError(f"start {start} must be a multiple of page_size {page_size} within the hashed blocks")
    num_full = (start + len(token_ids)) // page_size
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i else None
        lo = i * page_size - start
        block_hashes.append(hash_block_tokens(parent, token_ids[lo : lo + page_size]))
    return block_hashes


def max_hit_blocks(num_tokens: int, page_size: int) -> int:
    """Most full blocks a hit may cover: the last token is always recomputed for its logits."""
    return max(num_tokens - 1, 0) // page_size


class PrefixCache:
    """Map block hash -> block id, at most one block per hash.

    A second block filled with an already-cached hash (two identical prompts computed in the same
    step) is simply not cached: `insert` returns False and that block stays private.
    """

    def __init__(self) -> None:
        self._map: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        return len(self._map)

    def get(self, block_hash: BlockHash) -> int | None:
        return self._map.get(block_hash)

    def insert(self, block_hash: BlockHash, block_id: int) -> bool:
        """Map the hash to the block unless it is already mapped; True when inserted."""
        if block_hash in self._map:
            return False
        self._map[block_hash] = block_id
        return True

    def remove(self, block_hash: BlockHash, block_id: int) -> None:
        """Forget the hash if (and only if) it maps to `block_id` (eviction of that block)."""
        if self._map.get(block_hash) == block_id:
            del self._map[block_hash]

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest prefix of `block_hashes` that is fully cached."""
        hit: list[int] = []
        for h in block_hashes:
            block_id = self._map.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def clear(self) -> None:
        self._map.clear()
