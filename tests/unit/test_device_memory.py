"""The device-memory figures the KV cache is sized from, and the cap that keeps a step's arguments
within the share of device memory XLA's GPU scheduler assumes."""

import os

import jax

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.runner.device_memory import (CACHE_GRANULE, XLA_PROGRAM_SHARE, DeviceMemory, device_memory,
                                                driver_memory, kv_cache_bytes, pages_for_memory)

GB = 10**9


class _Dev:
    platform = "gpu"

    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_allocator_stats_are_used_when_present_and_cpu_has_none():
    mem = device_memory(_Dev({"bytes_limit": 100, "bytes_in_use": 30}))  # no CUDA driver on this machine
    assert mem == DeviceMemory(100, 30, None, "XLA allocator")
    assert device_memory(jax.devices("cpu")[0]) is None


def test_kv_cache_stays_within_xla_program_share():
    # An H200 under the VMM allocator (driver figures): 150 GB, 31.4 GB of weights loaded.
    mem = DeviceMemory(150 * GB, int(31.4 * GB), 150 * GB, "CUDA driver")
    whole = lambda b: int(b) // CACHE_GRANULE * CACHE_GRANULE
    assert kv_cache_bytes(mem, 0.9) == whole(150 * GB * XLA_PROGRAM_SHARE - 31.4 * GB)
    assert kv_cache_bytes(mem, 0.5) == whole(150 * GB * 0.5 - 31.4 * GB)  # a lower utilization wins
    # BFC pool without a driver answer: utilization of the pool only.
    assert kv_cache_bytes(DeviceMemory(100 * GB, 30 * GB, None, "XLA allocator"), 0.9) == whole(60 * GB)
    assert kv_cache_bytes(DeviceMemory(100 * GB, 95 * GB, 100 * GB, "CUDA driver"), 0.9) == 0
    # Below one granule the budget is kept as it is (small devices).
    assert kv_cache_bytes(DeviceMemory(2 * GB, GB, None, "XLA allocator"), 0.9) == int(0.8 * GB)


def test_kv_cache_size_is_stable_across_starts():
    # The driver's in-use figure moves by tens of MB between two starts of the same server; the cache's
    # page count (a dimension of every step program) must not, or the compilation cache never hits.
    base = DeviceMemory(150 * GB, int(31.4 * GB), 150 * GB, "CUDA driver")
    sizes = {kv_cache_bytes(DeviceMemory(base.limit, base.in_use + d * 10**6, base.device_total, base.source), 0.9)
             for d in range(0, 40, 5)}
    assert len(sizes) == 1


def test_cpu_falls_back_to_pages_for_max_num_seqs():
    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models",
                                                  "tiny-deepseek-v2.json"))
    pages, how = pages_for_memory(cfg, 16, "float32", 0.9, fallback_pages=77)
    assert (pages, how.split(" (")[0]) == (77, "77 pages")


def test_driver_figures_leave_room_in_the_allocators_pool():
    """Under the VMM allocator the pool is XLA_PYTHON_CLIENT_MEM_FRACTION of the device (JAX's 0.75 where nothing
    set it): weights + cache stay within gpu_memory_utilization of it, so the steps' temporaries and XLA's
    autotuning scratch fit; with the package's 0.92 (xla_env.py) the cache is 75 GiB on an H200 with V2-Lite."""
    total, weights = 150 * GB, int(31.4 * GB)
    default = driver_memory(total - weights, total, {})
    assert default == DeviceMemory(int(total * 0.75), weights, total, "CUDA driver")
    cache = kv_cache_bytes(default, 0.9)
    assert weights + cache <= 0.9 * 0.75 * total and cache > 60 * GB
    wide = driver_memory(total - weights, total, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"})
    assert kv_cache_bytes(wide, 0.9) == 75 * 2**30
