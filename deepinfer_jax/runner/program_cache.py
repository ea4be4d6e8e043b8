"""Compiled step programs kept on disk, so that a later start skips tracing and lowering them.

JAX's persistent compilation cache (runner/compile_cache.py) skips XLA's compile, but finds its entry
by the lowered program: a warm start still traces and lowers every step program first. On an H200
that was most of `serve`'s warm start (16 programs of V2-Lite: 11.7 s of 15.0 s; benchmarks/RESULTS.md).
This cache stores each compiled program itself (`jax.experimental.serialize_executable`)
under a key of everything the program is made from:

- the package's Python source (every `.py` under deepinfer_jax, kernels included), jax's and jaxlib's
  versions, the device (platform, kind, count, driver) and XLA_FLAGS;
- what the caller passes: the model and runner configurations, the step's shapes and layouts, the
  structure, shapes and dtypes of its arguments.

A start with the same key loads the program as stored; any difference misses, compiles, and stores the
new program beside the old. Only a program XLA compiled in this process is stored (`compile_program`):
one that JAX loaded from its own compilation cache does not serialize again whole (XLA:CPU's then
lacked its compiled functions: "Function ... not found" at its first run), so after an upgrade that
leaves a program's HLO unchanged, that program keeps coming from JAX's cache, traced as before. An
entry that fails to load (truncated, from another build) is compiled again and rewritten. Each store keeps the directory within MAX_BYTES (4 GiB, or
$DEEPINFER_PROGRAM_CACHE_MAX_BYTES) by deleting the least recently used entries (a load marks its entry
used); serve's 16 programs of V2-Lite take 35 MB on an H200. Entries are pickles: like JAX's own cache,
the directory must be the user's own. Invariant: a program is only ever loaded under the key it was
stored with.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import threading
import time
from typing import Any

import jax

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the entry format or the key's meaning changes
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_BYTES = int(os.environ.get("DEEPINFER_PROGRAM_CACHE_MAX_BYTES", 4 << 30))
STALE_PART_SECONDS = 3600  # a writer's temporary file this old was left by a crash


@functools.cache
def source_fingerprint(root: str = PACKAGE_DIR) -> str:
    """sha256 of every .py file under `root` (symlinked folders followed), names and contents."""
    h = hashlib.sha256()
    for d, dirs, files in os.walk(root, followlinks=True):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(d, name)
            h.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read() + b"\0")
    return h.hexdigest()


def environment() -> tuple:
    """The facts outside the caller's arguments that a compiled program depends on."""
    import jaxlib

    dev = jax.devices()[0]
    return (FORMAT, source_fingerprint(), jax.__version__, jaxlib.__version__, dev.platform, dev.device_kind,
            dev.client.platform_version, jax.device_count(), os.environ.get("XLA_FLAGS", ""),
            jax.config.jax_enable_x64, str(jax.config.jax_default_matmul_precision))


def signature(args: Any) -> tuple:
    """The structure, shapes, dtypes and placement of a program's arguments."""
    leaves, treedef = jax.tree.flatten(args)
    return str(treedef), tuple((tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None))) for a in leaves)


def program_key(*parts: Any) -> str:
    """The key of a program made from `parts` (their repr must determine it) in this environment."""
    return hashlib.sha256(repr((environment(), parts)).encode()).hexdigest()


_local = threading.local()  # per compile thread: did JAX's compilation cache serve the last compile?
_listener_lock = threading.Lock()
_listening = False


def _note_jax_cache_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":  # recorded on the compiling thread
        _local.jax_cache_hit = True


def compile_program(lowered) -> tuple[Any, bool]:
    """`lowered.compile()` -> (the compiled program, whether it may be stored: XLA compiled it here,
    rather than JAX loading it from its persistent compilation cache; module docstring)."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_note_jax_cache_hit)
            _listening = True
    _local.jax_cache_hit = False
    compiled = lowered.compile()
    return compiled, not _local.jax_cache_hit


def _path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"{key}.program")


def load(cache_dir: str, key: str, device) -> Any | None:
    """The program stored under `key`, loaded onto `device` (a jax.stages.Compiled), or None."""
    path = _path(cache_dir, key)
    if not os.path.exists(path):
        return None
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        with open(path, "rb") as f:
            blob, in_tree, out_tree = pickle.load(f)
        compiled = deserialize_and_load(blob, in_tree, out_tree, backend=device.client, execution_devices=[device])
        os.utime(path)  # used now: `prune` deletes the least recently used entries first
        return compiled
    except Exception as e:  # a truncated or foreign entry: compile instead
        log.warning("program cache: could not load %s (%s: %s); compiling it again", path, type(e).__name__, e)
        return None


def store(cache_dir: str, key: str, compiled: Any, max_bytes: int | None = None) -> bool:
    """Write `compiled` under `key` (whole or not at all), then `prune` the directory to `max_bytes`
    (default MAX_BYTES); False if it cannot be serialized or written. `compiled` must be one XLA
    compiled in this process (`compile_program`'s second result)."""
    from jax.experimental.serialize_executable import serialize

    path = _path(cache_dir, key)
    tmp = f"{path}.{os.getpid()}.part"
    try:
        data = pickle.dumps(serialize(compiled))
        os.makedirs(cache_dir, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        prune(cache_dir, MAX_BYTES if max_bytes is None else max_bytes, keep=path)
        return True
    except Exception as e:
        log.warning("program cache: could not store a program in %s (%s: %s)", cache_dir, type(e).__name__, e)
        if os.path.exists(tmp):
            os.remove(tmp)
        return False


def prune(cache_dir: str, max_bytes: int, keep: str | None = None) -> int:
    """Delete the least recently used entries (the oldest modification times: a load touches its
    entry) until those left total at most `max_bytes`, never `keep`; and temporary files a crashed
    writer left over an hour ago. Safe against another process pruning at once. Returns how many
    entries were deleted."""
    entries, now = [], time.time()
    for name in os.listdir(cache_dir):
        path = os.path.join(cache_dir, name)
        try:
            st = os.stat(path)
            if name.endswith(".part") and now - st.st_mtime > STALE_PART_SECONDS:
                os.remove(path)
            elif name.endswith(".program"):
                entries.append((st.st_mtime, st.st_size, path))
        except FileNotFoundError:  # deleted by another process meanwhile
            continue
    total, removed = sum(size for _, size, _ in entries), 0
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        if path == keep:
            continue
        try:
            os.remove(path)
            removed += 1
        except FileNotFoundError:
            pass
        total -= size
    if removed:
        log.info("program cache: deleted %d least recently used programs from %s (over %d bytes)", removed,
                 cache_dir, max_bytes)
    return removed
