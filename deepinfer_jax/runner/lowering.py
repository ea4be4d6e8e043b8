"""Two costs of lowering Pallas-Triton kernels that warm-up removes (`speed_up_kernel_lowering`).

Warm-up traces and lowers every step program on one thread while the compile threads wait for them, so
on an empty cache the lowering is on the start's critical path. Under cProfile on an H200, `serve`'s 36
programs (Protocol B's flags, V2-Lite) spent 34 s tracing and lowering, of which (benchmarks/RESULTS.md):

- 6.9 s importing modules that do not exist. Each Triton op or type the kernels' lowering makes has MLIR's
  Python bindings look for a Python module of the `tt` dialect under each of their search prefixes
  (`jaxlib.mlir.dialects.tt`, `jaxlib.mosaic.python.tt`, `jax.jaxlib.mosaic.python.tt`); none exists, a
  failed import is not remembered, so every op paid three failed imports (55,188 in all). `_alias_tt_dialect`
  registers jaxlib's Triton dialect module under the first name, where the bindings find it once and
  remember it. Nothing else changes: the ops' Python classes were already registered by that module.
- 12.3 s in 145 Triton lowerings of kernels, 0.085 s each. A decode bucket's variants (base, full,
  greedy) share one traced forward (`StepPrograms._forward_fn`), so their programs hold the very same
  kernel jaxprs, yet each program's module lowered each kernel again. `_memoize_triton_lowering` keeps
  each kernel's lowered Triton module by the identity of its jaxpr and grid mapping (held, so identities
  are never reused) and the platform and compute capability: a kernel met again in a later program is
  serialized from the module already made. The Triton module is built in an MLIR context of its own and
  only serialized afterwards, so the same module serves every program.

Both are patches of jax internals of the pinned version (pyproject.toml); each applies only where the
function or module it replaces has the expected form, and otherwise leaves JAX as it is.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading

log = logging.getLogger(__name__)

TT_MODULE = "jaxlib.mlir.dialects.tt"
_LOWERING_ARGS = ["jaxpr", "grid_mapping", "platform", "compute_capability", "mlir_ctx"]
_lock = threading.Lock()


def _alias_tt_dialect() -> bool:
    """Register jaxlib's Triton dialect module as TT_MODULE, unless a module of that name exists."""
    if TT_MODULE in sys.modules:
        return False
    try:
        import importlib.util

        if importlib.util.find_spec(TT_MODULE) is not None:
            return False
    except ModuleNotFoundError:
        pass
    try:
        from jax._src.lib.triton import dialect
    except ImportError:
        return False
    sys.modules[TT_MODULE] = dialect
    return True


class TritonLoweringCache:
    """`lower_jaxpr_to_triton_module` memoized (module docstring). `hits` / `misses` count the calls."""

    def __init__(self, lower):
        self._lower = lower
        self._entries: dict[tuple, tuple] = {}  # key -> (jaxpr, grid_mapping, result): the refs keep ids unique
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __call__(self, jaxpr, grid_mapping, platform, compute_capability, mlir_ctx):
        key = (id(jaxpr), id(grid_mapping), platform, compute_capability)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                return entry[2]
        result = self._lower(jaxpr, grid_mapping, platform, compute_capability, mlir_ctx=mlir_ctx)
        with self._lock:
            self.misses += 1
            self._entries[key] = (jaxpr, grid_mapping, result)
        return result


def _memoize_triton_lowering() -> TritonLoweringCache | None:
    """Replace Pallas-Triton's `lower_jaxpr_to_triton_module` (which its pallas_call lowering calls through
    the module) by a TritonLoweringCache of it, or None where the Triton backend or the expected signature
    is missing."""
    try:
        from jax._src.pallas.triton import lowering
    except ImportError:
        return None
    lower = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if isinstance(lower, TritonLoweringCache):
        return lower
    if lower is None or list(inspect.signature(lower).parameters) != _LOWERING_ARGS:
        log.debug("Pallas-Triton's lowering has another form; its lowerings are not memoized")
        return None
    lowering.lower_jaxpr_to_triton_module = cache = TritonLoweringCache(lower)
    return cache


def speed_up_kernel_lowering() -> TritonLoweringCache | None:
    """Apply both patches (idempotent, thread-safe: each checks whether it is in place); returns the lowering
    cache, if any."""
    with _lock:
        _alias_tt_dialect()
        return _memoize_triton_lowering()
