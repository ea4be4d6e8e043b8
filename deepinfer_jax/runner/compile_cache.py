"""The JAX persistent compilation cache, on by default so a second start skips XLA compilation."""

from __future__ import annotations

import os

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "deepinfer-jax", "xla")


def enable_compilation_cache(cache_dir: str | None = "default") -> str | None:
    """Point JAX at `cache_dir` ("default": $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer-jax/xla;
    None: leave the cache off). Caches every compile, however small. Returns the directory used."""
    if cache_dir is None:
        return None
    if cache_dir == "default":
        cache_dir = os.environ.get("DEEPINFER_CACHE_DIR", DEFAULT_DIR)
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return cache_dir
