"""The JAX persistent compilation cache, on by default so a second start skips XLA compilation; and
the GEMM autotuning results shipped with the package, so a first start skips most of XLA's autotuning.

XLA picks each GEMM fusion's kernel by timing candidates on the device. On an empty cache that was
most of `serve`'s start (H200, V2-Lite, 16 step programs: 172 s to ready; 60 s with the results on
disk; benchmarks/RESULTS.md). XLA keeps the results in its per-fusion autotune cache, which
JAX puts in `<cache dir>/xla_gpu_per_fusion_autotune_cache_dir`: one file per fusion, under a
directory named by a fingerprint of the GPU and XLA version, so results measured on another GPU are
never used. `assets/autotune/*.tgz` hold such entries, made by `benchmarks/serve_start.sh` (its
`autotune.tgz`) on the GPUs named in the file names, plus those of Protocol A's programs with
the 16,384-token prefill bucket unrolled (its start on an empty cache: 29.4 s with them, 83.0 s without);
`seed_autotune_results` adds the ones the cache lacks, as vLLM ships tuned MoE kernel configurations per GPU.
`CompileCounter` counts the process's compilations (the runner's recompile guard).
"""

from __future__ import annotations

import os
import tarfile
import threading
from importlib import resources
from typing import Any

import jax

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "deepinfer-jax", "xla")
AUTOTUNE_DIR = "xla_gpu_per_fusion_autotune_cache_dir"  # the name JAX gives it inside the cache dir


def enable_compilation_cache(cache_dir: str | None = "default") -> str | None:
    """Point JAX at `cache_dir` ("default": $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer-jax/xla;
    None: leave the cache off) and seed it with the shipped autotuning results. Caches every compile,
    however small. Returns the directory used."""
    if cache_dir is None:
        return None
    if cache_dir == "default":
        cache_dir = os.environ.get("DEEPINFER_CACHE_DIR", DEFAULT_DIR)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        if not os.access(cache_dir, os.W_OK):
            raise PermissionError(0, "not writable")
    except OSError as e:
        raise ValueError(f"compilation cache directory {cache_dir!r} (--compilation-cache-dir, $DEEPINFER_CACHE_DIR): "
                         f"{e.strerror or e}; pass a writable directory, or none to turn the cache off") from None
    seed_autotune_results(cache_dir)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return cache_dir


def shipped_autotune_archives() -> list:
    return sorted(p for p in (resources.files("deepinfer_jax") / "assets" / "autotune").iterdir()
                  if p.name.endswith(".tgz"))


def seed_autotune_results(cache_dir: str, archives=None) -> int:
    """Extract the autotune entries of `archives` (default: the shipped ones) that
    `cache_dir/xla_gpu_per_fusion_autotune_cache_dir` lacks; entries already there are kept. Only
    regular files at `<fingerprint>/<name>.pb` are taken. Returns how many were added."""
    dest = os.path.join(cache_dir, AUTOTUNE_DIR)
    added = 0
    for archive in shipped_autotune_archives() if archives is None else archives:
        with resources.as_file(archive) as path, tarfile.open(path, "r:gz") as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if not (member.isfile() and len(parts) == 3 and parts[0] == AUTOTUNE_DIR
                        and parts[2].endswith(".pb") and ".." not in parts):
                    continue
                target = os.path.join(dest, parts[1], parts[2])
                if os.path.exists(target):
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with tar.extractfile(member) as src, open(target + ".part", "wb") as out:
                    out.write(src.read())
                os.replace(target + ".part", target)  # whole or absent, should two starts race
                added += 1
    return added


class CompileCounter:
    """Counts XLA backend compilations process-wide (jax.monitoring duration events)."""

    _lock = threading.Lock()
    _count = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if cls._installed:
                return

            def listener(event: str, duration: float, **kw: Any) -> None:
                if event == "/jax/compilation_cache/compile_time_saved_sec" or event.endswith("backend_compile_duration"):
                    with cls._lock:
                        cls._count += 1

            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._installed = True

    @classmethod
    def count(cls) -> int:
        return cls._count
