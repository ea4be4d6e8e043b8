"""XLA options deepinfer-jax sets before JAX starts its backends (XLA reads XLA_FLAGS once, at start).

JAX-free: `deepinfer_jax/__init__.py` applies them on import, so they take effect whenever the package
is imported before the first JAX computation (the CLI, `LLM`, the benchmarks). A flag the user already
put in XLA_FLAGS is left as given; DEEPINFER_XLA_DEFAULTS=0 turns the defaults off.

- `xla_gpu_command_buffer_update_mode=SKIP_PROFILED`: a decode step runs as one CUDA graph (command
  buffer) of ~1,100 kernels. By default XLA re-records the graph whenever an argument's address
  changes, which happens every step (fresh input and output buffers): 4.7-9.5 ms of host time a step
  on an H200, as long as half the device step. SKIP_PROFILED watches which buffers keep their
  addresses over the first runs and gives the others stable virtual addresses (CUDA VMM remapping),
  so the graph is recorded once: host enqueue 1.9 ms a step (benchmarks/RESULTS.md). It switches
  the GPU client to XLA's VMM allocator, which reports no memory stats; the KV cache is then sized
  from the driver's free-memory figure (`ModelRunner.pages_for_memory`). CPU ignores it.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULT_FLAGS: dict[str, str] = {"xla_gpu_command_buffer_update_mode": "SKIP_PROFILED"}


def with_default_flags(xla_flags: str, defaults: dict[str, str] = DEFAULT_FLAGS) -> str:
    """`xla_flags` (an XLA_FLAGS string) plus `--name=value` for each default whose name it lacks."""
    given = {tok.lstrip("-").split("=", 1)[0] for tok in xla_flags.split()}
    extra = [f"--{k}={v}" for k, v in defaults.items() if k not in given]
    return " ".join([xla_flags.strip(), *extra]).strip()


def apply_default_xla_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put the defaults into environ["XLA_FLAGS"] unless DEEPINFER_XLA_DEFAULTS=0."""
    if environ.get("DEEPINFER_XLA_DEFAULTS", "1") == "0":
        return
    environ["XLA_FLAGS"] = with_default_flags(environ.get("XLA_FLAGS", ""))
