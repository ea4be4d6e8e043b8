"""Page copies between the device KV cache and the host tier's pages (scheduler/host_tier.py).

The host tier's pages are one array `storage` [num_host_blocks, L, page_size, D] in the cache's dtype (a block's
page is contiguous there). Two kinds of pool:

- Pinned (`pinned`): a JAX array in the device's "pinned_host" memory, where the backend has it and its programs
  compile (checked once, `_pinned_programs`); the copies are DMA from and to page-locked memory, and nothing on
  the host touches the pages. `apply(kv_cache, transfers)` queues three programs, in this order: the loads' pages
  read out of `storage` onto the device (`_fetch`: a dynamic slice of host memory a page, each copied to the
  device; where `RUN_PAGES` loads in a row read consecutive host blocks, ascending or descending, as a prefix's
  pages saved together lie, one slice of them all, so a copy moves `RUN_PAGES` pages), so a save later in the
  batch cannot change them; the saves' pages gathered on the device and written
  into `storage` (`_save`: each page copied to host memory and updated in place there, `storage` donated); the
  loaded pages scattered into the cache (the cache donated), after the gather in dispatch order, so a page
  saved and reused in the same batch is read first. The host waits for none of them.
- Pageable (elsewhere: a sharded cache, or a backend without pinned host memory): a numpy array, and `apply` runs
  1. finish the saves of earlier batches: their gathered pages are copied into `storage` (they were dispatched a
     step ago with an asynchronous device-to-host copy, so this rarely waits);
  2. read the loads' pages out of `storage` (a host-side copy, so a save landing later cannot change them);
  3. gather the saves' pages on the device (a program a run, below; the KV cache is only read) and start their
     copy to the host without waiting;
  4. put the loads' pages on the device (asynchronous) and scatter them into the cache (a program a run, the
     cache donated), after the gathers in dispatch order.
  Nothing here waits for the device except step 1's copies of a batch already in flight.

A batch of more than `MAX_COPY_PAGES` copies (a long context coming back: 2,048 pages at 128K tokens) runs as
programs of at most that many, all its loads' reads first, then all its saves, then all its scatters, so the order
above holds across them (the pinned programs copy page by page, unrolled, so their compile time grows with the
count: ~50 ms a page on a CPU). Each run's count is padded to a power of two, padding rows repeating its first copy
(the same page written twice with the same bytes), so a program has one executable per size class; `warm` runs
every class once at warm-up (null-page copies), so serving compiles none.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.models.cache import NULL_PAGE, kv_cache_bytes_per_page
from deepinfer_jax.xla_env import use_host_memory

log = logging.getLogger(__name__)
HOST_KIND = "pinned_host"
MAX_COPY_PAGES = 64  # pages a copy program moves at most (module doc)
RUN_PAGES = 8  # consecutive host blocks a pinned fetch copies at once (module doc)


class _Copies(NamedTuple):  # what `apply` reads of scheduler/host_tier.py's KVTransfers (runner imports no scheduler)
    saves: list
    loads: list


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _gather(kv, ids):  # kv [L, P, ps, D], ids [n] -> [n, L, ps, D]
    return jnp.moveaxis(jnp.take(kv, ids, axis=1), 1, 0)


def _scatter(kv, ids, pages):  # pages [n, L, ps, D] -> kv with kv[:, ids[i]] = pages[i]
    return kv.at[:, ids].set(jnp.moveaxis(pages, 0, 1).astype(kv.dtype))


def _fetch(storage, ids, run: int = 1):
    """storage [N, L, ps, D] in host memory, ids [n] -> pages [n * run, L, ps, D] on the device: blocks ids[i] ..
    ids[i] + run - 1, one copy each i."""
    return jnp.concatenate([jax.device_put(jax.lax.dynamic_slice_in_dim(storage, ids[i], run, 0),
                                           jax.memory.Space.Device) for i in range(ids.shape[0])])


def _save(storage, ids, pages):  # pages [n, L, ps, D] on the device -> storage with storage[ids[i]] = pages[i]
    for i in range(ids.shape[0]):
        row = jax.device_put(pages[i:i + 1], jax.memory.Space.Host)
        storage = jax.lax.dynamic_update_slice_in_dim(storage, row, ids[i], 0)
    return storage


def _pinned_programs(kv_cache: Any, num_host_blocks: int):
    """(storage zeroed in pinned host memory, fetch, save) for a cache on one device whose backend has pinned host
    memory and compiles the two programs (tried on one page); None otherwise (the pool is then pageable)."""
    devices = list(kv_cache.sharding.device_set)
    if len(devices) != 1 or HOST_KIND not in [m.kind for m in devices[0].addressable_memories()]:
        return None
    use_host_memory(None, 1.0)  # a clear error, not a crash, under the VMM allocator (xla_env.py)
    host = jax.sharding.SingleDeviceSharding(devices[0], memory_kind=HOST_KIND)
    L, _, ps, D = kv_cache.shape
    fetch = jax.jit(_fetch, static_argnums=2)
    save = jax.jit(_save, donate_argnums=0, out_shardings=host)
    try:
        storage = jax.device_put(np.zeros((num_host_blocks, L, ps, D), np.dtype(kv_cache.dtype)), host)
        one = np.zeros((1,), np.int32)
        fetch.lower(storage, one).compile()
        save.lower(storage, one, jax.ShapeDtypeStruct((1, L, ps, D), kv_cache.dtype)).compile()
    except Exception as e:  # noqa: BLE001 - a backend whose compiler lacks these host-memory copies
        log.warning("KV host tier: pageable host memory (pinned host memory unavailable: %s)", str(e)[:200])
        return None
    return storage, fetch, save


class KVTransfer:
    """The host tier's page storage and the programs that copy pages in and out of the device cache."""

    def __init__(self, kv_cache: Any, num_host_blocks: int) -> None:
        L, _, ps, D = kv_cache.shape
        self.page_bytes = L * ps * D * kv_cache.dtype.itemsize
        pinned = _pinned_programs(kv_cache, num_host_blocks)
        self.pinned = pinned is not None
        if pinned is not None:
            self.storage, self._fetch, self._save = pinned
        else:
            self.storage = np.zeros((num_host_blocks, L, ps, D), dtype=np.dtype(kv_cache.dtype))
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=0)
        self._inflight: list[tuple[np.ndarray, Any]] = []  # (host blocks, gathered pages) not yet in storage
        # pages a fetch of consecutive host blocks copies; 1: page by page
        self.run = RUN_PAGES if self.pinned and 1 < RUN_PAGES <= min(num_host_blocks, MAX_COPY_PAGES) else 1
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def warm(self, kv_cache: Any, max_pages: int) -> tuple[Any, int]:
        """Run every copy program once at each size class a batch of at most `max_pages` copies can take (runs of at
        most MAX_COPY_PAGES), on null-page copies: loads into the device's null page (garbage by
        design) from host block 0 (blocks 0 .. run - 1 for the fetches of runs) and saves of the null page into host
        block 0, which no block hash names before the first request. -> (the new KV cache, size classes run); the
        byte counters stay at zero."""
        top = _pow2(min(max_pages, MAX_COPY_PAGES))
        n, classes = 1, 0
        while n <= top:
            kv_cache = self.apply(kv_cache, _Copies(saves=[(NULL_PAGE, 0)] * n, loads=[(0, NULL_PAGE)] * n))
            n, classes = 2 * n, classes + 1
        runs = min(max_pages, MAX_COPY_PAGES) // self.run if self.run > 1 else 0
        n = 1
        while n <= _pow2(runs) and runs:  # the fetches of runs: blocks 0 .. run - 1, n times
            kv_cache = self.apply(kv_cache, _Copies(saves=[], loads=[(h, NULL_PAGE) for h in range(self.run)] * n))
            n, classes = 2 * n, classes + 1
        self.flush()
        self.bytes_to_host = self.bytes_to_device = 0
        return kv_cache, classes

    def flush(self) -> None:
        """Land every save in flight in `storage` (waits for their copies; the pageable pool's)."""
        for host_ids, pages in self._inflight:
            self.storage[host_ids] = np.asarray(pages)[: len(host_ids)]
        self._inflight.clear()

    def apply(self, kv_cache: Any, transfers) -> Any:
        """Queue one step's copies (scheduler/host_tier.py KVTransfers); returns the new KV cache."""
        if self.pinned:
            return self._apply_pinned(kv_cache, transfers)
        self.flush()
        loads = []
        for part in _parts(transfers.loads):  # one host copy a run, padding included
            host_ids, dev_ids = _padded(part)
            loads.append((dev_ids, np.take(self.storage, host_ids, axis=0)))
        for part in _parts(transfers.saves):
            dev_ids, host_ids = _padded(part)
            gathered = self._gather(kv_cache, dev_ids)
            gathered.copy_to_host_async()
            self._inflight.append((host_ids[: len(part)], gathered))
        devices = list(kv_cache.sharding.device_set)
        for dev_ids, pages in loads:
            if len(devices) == 1:  # queue the host-to-device copy now; sharded, the jit places the pages
                pages = jax.device_put(pages, devices[0])
            kv_cache = self._scatter(kv_cache, dev_ids, pages)
        self.bytes_to_device += len(transfers.loads) * self.page_bytes
        self.bytes_to_host += len(transfers.saves) * self.page_bytes
        return kv_cache

    def _apply_pinned(self, kv_cache: Any, transfers) -> Any:
        """`apply` on the pinned pool (module doc): fetch the loads, save the saves, scatter the loads."""
        fetched = []
        runs, singles = _runs(transfers.loads, self.run)
        for part in _parts(runs, MAX_COPY_PAGES // self.run):
            starts, dev_ids = _padded(part)
            fetched.append((dev_ids, self._fetch(self.storage, starts, self.run)))
        for part in _parts(singles):
            host_ids, dev_ids = _padded(part)
            fetched.append((dev_ids, self._fetch(self.storage, host_ids, 1)))
        for part in _parts(transfers.saves):
            src, dst = _padded(part)
            self.storage = self._save(self.storage, dst, self._gather(kv_cache, src))
        for dev_ids, pages in fetched:
            kv_cache = self._scatter(kv_cache, dev_ids, pages)
        self.bytes_to_device += len(transfers.loads) * self.page_bytes
        self.bytes_to_host += len(transfers.saves) * self.page_bytes
        return kv_cache


def _parts(pairs, most: int | None = None) -> list:
    """`pairs` in runs of at most `most` (MAX_COPY_PAGES)."""
    most = most or MAX_COPY_PAGES
    return [pairs[i:i + most] for i in range(0, len(pairs), most)]


def _runs(loads, run: int) -> tuple[list, list]:
    """Loads (host block, device block) -> (runs, singles): each run (first host block, its `run` device blocks in
    host-block order) stands for `run` loads in a row whose host blocks are consecutive, ascending or descending;
    singles are the other loads. run 1: no runs."""
    runs, singles, i = [], [], 0
    while i < len(loads):
        seg = loads[i:i + run]
        h = [x for x, _ in seg]
        step = 1 if len(h) > 1 and h[1] > h[0] else -1
        if run > 1 and len(seg) == run and h == list(range(h[0], h[0] + step * run, step)):
            runs.append((min(h), np.array([d for _, d in sorted(seg)], np.int32)))
            i += run
        else:
            singles.append(loads[i])
            i += 1
    return runs, singles


def _padded(pairs) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) pairs, each b a block id or a run's array of them -> (the a's, the b's flattened), int32 arrays of a
    power-of-two count of pairs, padded with the first pair."""
    pad = list(pairs) + [pairs[0]] * (_pow2(len(pairs)) - len(pairs))
    return (np.array([x for x, _ in pad], np.int32),
            np.concatenate([np.atleast_1d(y) for _, y in pad]).astype(np.int32))


def host_tier_blocks(cfg, page_size: int, dtype, gib: float) -> int:
    """Host-tier pages that fit in `gib` GiB (kv_offloading_size); ValueError when not even one does."""
    per_page = kv_cache_bytes_per_page(cfg, page_size, dtype)
    n = int(gib * 2**30) // per_page
    if n < 1:
        raise ValueError(f"kv_offloading_size {gib} GiB holds no KV page (a page is {per_page} bytes)")
    return n
