"""Page copies between the device KV cache and the host tier's pages (scheduler/host_tier.py).

The host tier's pages are one numpy array, `storage` [num_host_blocks, L, page_size, D] in the cache's dtype
(a block's page is contiguous there). `apply(kv_cache, transfers)` runs before a step's program, in this order:
1. finish the saves of earlier batches: their gathered pages are copied into `storage` (they were dispatched a
   step ago with an asynchronous device-to-host copy, so this rarely waits);
2. read the loads' pages out of `storage` (a host-side copy, so a save landing later cannot change them);
3. gather the saves' pages on the device (one program; the KV cache is only read) and start their copy to the
   host without waiting;
4. put the loads' pages on the device (asynchronous) and scatter them into the cache (one program, the cache
   donated), after the gather in dispatch order, so a page saved and reused in the same batch is read first.
Nothing here waits for the device except step 1's copies of a batch already in flight. Copy counts are padded
to powers of two (padding rows read or write the null page 0, garbage by design), so the gather and scatter
compile once per size class, on first use.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.models.cache import NULL_PAGE, kv_cache_bytes_per_page


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _gather(kv, ids):  # kv [L, P, ps, D], ids [n] -> [n, L, ps, D]
    return jnp.moveaxis(jnp.take(kv, ids, axis=1), 1, 0)


def _scatter(kv, ids, pages):  # pages [n, L, ps, D] -> kv with kv[:, ids[i]] = pages[i]
    return kv.at[:, ids].set(jnp.moveaxis(pages, 0, 1).astype(kv.dtype))


class KVTransfer:
    """The host tier's page storage and the programs that copy pages in and out of the device cache."""

    def __init__(self, kv_cache: Any, num_host_blocks: int) -> None:
        L, _, ps, D = kv_cache.shape
        self.page_bytes = L * ps * D * kv_cache.dtype.itemsize
        self.storage = np.zeros((num_host_blocks, L, ps, D), dtype=np.dtype(kv_cache.dtype))
        self._gather = jax.jit(_gather)
        self._scatter = jax.jit(_scatter, donate_argnums=0)
        self._inflight: list[tuple[np.ndarray, Any]] = []  # (host blocks, gathered pages) not yet in storage
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    def flush(self) -> None:
        """Land every save in flight in `storage` (waits for their copies)."""
        for host_ids, pages in self._inflight:
            self.storage[host_ids] = np.asarray(pages)[: len(host_ids)]
        self._inflight.clear()

    def apply(self, kv_cache: Any, transfers) -> Any:
        """Queue one step's copies (scheduler/host_tier.py KVTransfers); returns the new KV cache."""
        self.flush()
        loads = None
        if transfers.loads:
            k = len(transfers.loads)
            n = _pow2(k)
            host_ids = np.full((n,), transfers.loads[0][0], np.int64)  # padding rows land in the null page
            host_ids[:k] = [h for h, _ in transfers.loads]
            dev_ids = np.full((n,), NULL_PAGE, np.int32)
            dev_ids[:k] = [d for _, d in transfers.loads]
            loads = (dev_ids, np.take(self.storage, host_ids, axis=0))  # one host copy, padding included
            self.bytes_to_device += k * self.page_bytes
        if transfers.saves:
            n = _pow2(len(transfers.saves))
            dev_ids = np.full((n,), NULL_PAGE, np.int32)
            dev_ids[: len(transfers.saves)] = [d for d, _ in transfers.saves]
            gathered = self._gather(kv_cache, dev_ids)
            gathered.copy_to_host_async()
            self._inflight.append((np.array([h for _, h in transfers.saves], np.int64), gathered))
            self.bytes_to_host += len(transfers.saves) * self.page_bytes
        if loads is not None:
            dev_ids, pages = loads
            devices = list(kv_cache.sharding.device_set)
            if len(devices) == 1:  # queue the host-to-device copy now; sharded, the jit places the pages
                pages = jax.device_put(pages, devices[0])
            kv_cache = self._scatter(kv_cache, dev_ids, pages)
        return kv_cache


def host_tier_blocks(cfg, page_size: int, dtype, gib: float) -> int:
    """Host-tier pages that fit in `gib` GiB (kv_offloading_size); ValueError when not even one does."""
    per_page = kv_cache_bytes_per_page(cfg, page_size, dtype)
    n = int(gib * 2**30) // per_page
    if n < 1:
        raise ValueError(f"kv_offloading_size {gib} GiB holds no KV page (a page is {per_page} bytes)")
    return n
