"""How much device memory the KV cache may take: XLA's allocator figures or the CUDA driver's, and the
share of device memory XLA's GPU scheduler assumes a program may use.

Invariants of `kv_cache_bytes`: weights (in use) + KV cache <= XLA_PROGRAM_SHARE x device memory, so the rest of
the allocator's share (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.92 by default: xla_env.py) stays free for the steps'
temporaries (a prefill step's are a few GB, a dense 8B model's 13 GiB at 2,048 tokens); and a
budget of CACHE_GRANULE or more is a whole number of CACHE_GRANULEs. The driver's free-memory figure
moves by some 20 MB from one start to the next; the cache's page count is part of every step
program's shape, so an unrounded size gave each start new programs and the persistent compilation
cache never hit (`serve` recompiled its 16 programs on a warm cache: 89.7 s to ready instead of
seconds, benchmarks/RESULTS.md).

XLA's GPU compiler budgets a program's memory from the device size less its arguments and outputs,
and counts the donated cache twice (argument and aliased output): with an engine-sized cache the
budget is exceeded whatever this share, and the rematerialization pass then recomputed values to
save memory that was not short (a decode step ran its q / kv_a GEMM three times per layer). That pass
is off (`xla_env.py`), which the cap alone did not achieve (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, replace

XLA_PROGRAM_SHARE = 0.75
CACHE_GRANULE = 2**30  # bytes; a restart lands on another page count ~20 MB / 1 GiB = 2% of the time


@dataclass(frozen=True)
class DeviceMemory:
    limit: int  # bytes the allocator may hand out (XLA's pool, or the whole device)
    in_use: int  # bytes held now (the weights, when called after loading)
    device_total: int | None  # the device's whole memory, when the driver answers
    source: str  # where `limit` and `in_use` come from


def cuda_mem_info(device) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device from the driver (cuMemGetInfo), or None."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != 0:
        # No context current on this thread: make the device's primary context (JAX's) current.
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        ordinal = getattr(device, "local_hardware_id", None) or 0
        if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), ordinal)
                or cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) or cuda.cuCtxSetCurrent(ctx)
                or cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))):
            return None
    return int(free.value), int(total.value)


def device_memory(device) -> DeviceMemory | None:
    """The memory figures of `device`, or None (CPU). XLA's BFC allocator reports its pool
    (`memory_stats`); under the VMM allocator that xla_env.py's command-buffer mode selects there are
    no stats, and a GPU falls back to the driver (`driver_memory`: the allocator's share of the device, and
    total - free in use)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats
        stats = None
    info = cuda_mem_info(device) if device.platform == "gpu" else None
    total = None if info is None else info[1]
    if stats and "bytes_limit" in stats:
        return DeviceMemory(int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)), total, "XLA allocator")
    if info is None:
        return None
    return driver_memory(*info)


def driver_memory(free: int, total: int, environ=os.environ) -> DeviceMemory:
    """The driver's figures under XLA's VMM allocator: it hands out at most XLA_PYTHON_CLIENT_MEM_FRACTION of
    the device (JAX's default 0.75), so that share is the limit, not the whole device. (With the whole device
    as the limit, an engine started without that variable filled the allocator's pool with weights and cache,
    and warm-up failed on an H200 when XLA's autotuner asked for 734 MB of scratch.)"""
    fraction = float(environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    return DeviceMemory(int(total * min(fraction, 1.0)), total - free, total, "CUDA driver")


def kv_cache_bytes(mem: DeviceMemory, gpu_memory_utilization: float) -> int:
    """Bytes for the KV cache: gpu_memory_utilization of the limit less what is in use, capped so that
    what is in use plus the cache stays within XLA_PROGRAM_SHARE of the device, rounded down to whole
    CACHE_GRANULEs (module docstring)."""
    budget = mem.limit * gpu_memory_utilization - mem.in_use
    if mem.device_total is not None:
        budget = min(budget, mem.device_total * XLA_PROGRAM_SHARE - mem.in_use)
    budget = max(0, int(budget))
    return budget - budget % CACHE_GRANULE if budget >= CACHE_GRANULE else budget


def given_memory(gib: float) -> DeviceMemory:
    """A device of `gib` GiB with nothing in use (`--gpu-memory`: engine/plan.py and the engine alike)."""
    size = int(gib * 2**30)
    return DeviceMemory(size, 0, size, f"--gpu-memory {gib:g}")


def pages_for_memory(cfg, page_size: int, dtype, gpu_memory_utilization: float, fallback_pages: int,
                     loading=None, memory: DeviceMemory | None = None,
                     extra_bytes_per_page: int = 0) -> tuple[int, str]:
    """KV pages that fit in gpu_memory_utilization of the first device's memory, less what is in use (the
    weights) and what `loading` (a weights/pending.py PendingParams, or None) will take, within the share XLA's
    scheduler assumes (`kv_cache_bytes`); a device without memory figures (CPU) -> fallback_pages. -> (pages, a
    line for the log). `memory`: these figures instead of the device's (`given_memory`). `extra_bytes_per_page`:
    another cache's bytes for each page (a speculative draft model's, whose pool mirrors the target's pages)."""
    import jax

    from deepinfer_jax.models.registry import kv_cache_bytes_per_page

    per_page = kv_cache_bytes_per_page(cfg, page_size, dtype) + extra_bytes_per_page
    device = jax.devices()[0]
    mem = memory or device_memory(device)
    if mem is None:
        return fallback_pages, f"{fallback_pages} pages (no device memory stats; sized for max_num_seqs)"
    if loading is not None:
        mem = replace(mem, in_use=mem.in_use + loading.bytes_on(device))
    pages = kv_cache_bytes(mem, gpu_memory_utilization) // per_page
    return pages, (f"{pages} pages x {page_size} tokens = {pages * page_size} tokens "
                   f"({pages * per_page / 2**30:.2f} GiB of {mem.limit / 2**30:.1f} GiB, {mem.source})")


def v4_pools(cfg, num_pages: int, how: str, page_size: int, scheduler_config, runner_config):
    """DeepSeek-V4's per-group pools (config_v4.CachePools) -> (pools, a line for the log). `num_pages` (and `how`,
    the line that sized it) as the engine found them: set explicitly or, on a device without memory figures, the
    fallback (`pages_for_memory`), they are pages of context; sized by the device's memory, the pools are the most
    that fit those pages' bytes (the family's `kv_cache_bytes_per_page`: a page of context)."""
    import jax.numpy as jnp

    from deepinfer_jax.config_v4 import v4_cache_pools, v4_fit_pools, v4_pool_bytes
    from deepinfer_jax.models.registry import kv_cache_bytes_per_page

    sc, item = scheduler_config, jnp.dtype(runner_config.kv_dtype).itemsize
    rest = (sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len, item)
    if how.endswith("(set explicitly)") or "no device memory stats" in how:
        pools = v4_cache_pools(cfg.v4, page_size, num_pages, *rest)
    else:
        budget = num_pages * kv_cache_bytes_per_page(cfg, page_size, runner_config.kv_dtype)
        pools = v4_fit_pools(cfg.v4, page_size, budget, *rest)
    nbytes = sum(v4_pool_bytes(pools))
    by_group = ", ".join(f"{g.name} {pools.pool_pages[k]}" for g, k in zip(pools.groups, pools.pool_of))
    return pools, f"pages per cache group: {by_group} x {page_size} rows ({nbytes / 2**30:.3f} GiB; {how})"
