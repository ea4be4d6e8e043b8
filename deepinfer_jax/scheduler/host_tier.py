"""Host tier of the paged KV cache: a second block pool in host memory, keyed by the same block hashes.

Full, hashed pages leaving HBM (a prefix-cache block evicted from the device pool by an allocation) are
saved to it; a prefix lookup that misses in HBM and hits here loads the page back into a fresh device block
instead of recomputing it. The pages themselves live on the runner (runner/kv_transfer.py); this module only
decides which host block holds which hash and lists the copies a step needs (`KVTransfers`).

Invariants:
- Host block ids are 0 .. num_blocks-1 (no null block). At most one host block per hash.
- Eviction order is LRU over all host blocks: `store` takes the head (empty blocks first, then the least
  recently stored or hit) and moves it to the tail; `touch` (a hit) moves a block to the tail.
- A hash already held here is not copied again when its device block is evicted (the host copy is the same
  KV); it is only touched.
- A block stored in the current step (its copy is not on the host yet) is not a hit until the step's
  transfers are taken (`take_transfers`): a lookup treats it as a miss, so a load never reads a page whose
  save is still in flight in the same batch.
- Host hits are encoded in the manager's hit lists as negative ids, `host_hit_id(h) = -1 - h`, so that the
  scheduler passes them through unchanged.

Counters (tokens, like the device prefix cache's): `queries` counts the tokens looked up here (those past the
device hit), `hits` the tokens served from here; `blocks_saved` / `blocks_loaded` count page copies.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from deepinfer_jax.scheduler.prefix_cache import BlockHash


def host_hit_id(host_block: int) -> int:
    """The hit-list id of host block `host_block` (negative, never a device block id)."""
    return -1 - host_block


def is_host_hit(block_id: int) -> bool:
    return block_id < 0


@dataclass
class KVTransfers:
    """One step's page copies, applied by the runner before the step's program, saves first.

    saves: (device block, host block): copy the device page to the host block (its device block is then
    reallocated, so the copy must be queued before anything writes it). loads: (host block, device block).
    """

    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class HostTier:
    """Host block ids, their hashes, the LRU order and the step's pending copies."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least 1 block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._map: dict[BlockHash, int] = {}
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # head: evicted first
        self._fresh: set[int] = set()
        self._transfers = KVTransfers()
        self.queries = 0
        self.hits = 0
        self.blocks_saved = 0
        self.blocks_loaded = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._map)

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding a cached page."""
        return len(self._map) / self.num_blocks

    def block_hash(self, host_block: int) -> BlockHash | None:
        return self._hash[host_block]

    def lru_order(self) -> list[int]:
        """Host blocks from the next evicted to the most recently used."""
        return list(self._lru)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The host block holding this hash, or None (also for a block stored this step)."""
        h = self._map.get(block_hash)
        return None if h is None or h in self._fresh else h

    # ---- changes -------------------------------------------------------------------------------
    def touch(self, host_block: int) -> None:
        self._lru.move_to_end(host_block)

    def store(self, device_block: int, block_hash: BlockHash) -> None:
        """A hashed device block is being evicted: keep its page here (a save), unless already held."""
        held = self._map.get(block_hash)
        if held is not None:
            self.touch(held)
            return
        host_block, _ = self._lru.popitem(last=False)
        old = self._hash[host_block]
        if old is not None:
            del self._map[old]
        self._hash[host_block] = block_hash
        self._map[block_hash] = host_block
        self._lru[host_block] = None
        self._fresh.add(host_block)
        self._transfers.saves.append((device_block, host_block))
        self.blocks_saved += 1

    def load(self, host_block: int, device_block: int) -> None:
        """A host hit gets device block `device_block`: copy the page there (a load)."""
        self.touch(host_block)
        self._transfers.loads.append((host_block, device_block))
        self.blocks_loaded += 1

    def take_transfers(self) -> KVTransfers:
        """The copies recorded since the last call (the step's batch); the next step may hit its saves."""
        out, self._transfers = self._transfers, KVTransfers()
        self._fresh.clear()
        return out

    def reset(self) -> None:
        """Forget every cached hash (reset_prefix_cache); pending copies stay (their pages are still owed)."""
        self._map.clear()
        self._hash = [None] * self.num_blocks
        self._lru = OrderedDict((i, None) for i in range(self.num_blocks))
