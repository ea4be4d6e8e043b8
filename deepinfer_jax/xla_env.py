"""XLA options deepinfer-jax sets before JAX starts its backends (XLA reads XLA_FLAGS once, at start).

JAX-free: `deepinfer_jax/__init__.py` applies them on import, so they take effect whenever the package
is imported before the first JAX computation (the CLI, `LLM`, the benchmarks). A flag the user already
put in XLA_FLAGS is left as given; DEEPINFER_XLA_DEFAULTS=0 turns the defaults off.

- `xla_gpu_command_buffer_update_mode=SKIP_TEMP`: a decode step runs as one CUDA graph (command
  buffer) of ~400 kernels. By default (ALWAYS_UPDATE) XLA re-records a program's graph whenever one of
  its buffers changes address: a fresh temp buffer, input or output every step cost 4.7-9.5 ms of host
  time a step on an H200, as long as half the device step (benchmarks/RESULTS.md).
  SKIP_TEMP maps each program's temp buffer at a fixed virtual address of its own (CUDA VMM); every
  other buffer a step program touches already keeps its address, because the runner feeds it resident
  buffers that never move (`StepPrograms._step_fn`: the weights, the KV cache, the inbox, the outbox
  and the sampled ids, donated and updated in place). So each program's graph is recorded once.
  SKIP_PROFILED, the other mode that keeps graphs, also aliased every stable argument (the weights and the
  75 GiB KV cache) into a virtual range of each program, so a switch from one program to another (a
  prefill step after decode steps, a decode step after a prefill, another decode bucket) unmapped and
  mapped them again: ~6 ms of host time per switch, and Protocol A's GPU sat idle 11.4 ms a run at the
  prefill (SKIP_TEMP: 1.0 ms; 3,588 against 3,572 tok/s on one H200). The mode switches
  the GPU client to XLA's VMM allocator, which reports no memory stats; the KV cache is then sized
  from the driver's free-memory figure (`runner/device_memory.py: pages_for_memory`). CPU ignores it. Applied only
  where at most one CUDA device is visible: with several GPUs the collectives would run from
  VMM-allocated buffers inside the graphs, which has not been measured yet (set the flag by hand to
  try it). Under the VMM allocator a copy into pinned host memory crashes the process (a segfault in
  `jax.device_put(x, pinned_host)`, jax 0.11.2 on an H100), so an engine that keeps weights or KV in
  host memory (--cpu-offload-gb, --kv-offloading-size) takes the mode out again before the backend starts
  (`use_host_memory`), and its steps pay the graph re-recording above.
- `xla_disable_hlo_passes=rematerialization`: XLA's GPU compiler budgets a program's memory as the
  device memory less its parameters and outputs, and counts the donated KV cache twice (argument and
  aliased output). With an engine-sized cache (75 GiB on an H200) the budget is exceeded before any
  activation is placed, and the rematerialization pass recomputes small decode-step values to save
  memory that is not short: a V2-Lite decode step at batch 32 ran the q / kv_a projection GEMM three
  times per layer (9.28 -> 9.57 ms a step, benchmarks/RESULTS.md). The cache is sized to leave a
  quarter of the device free (runner/device_memory.py), far more than any step's activations.
  Applied on every machine.

Beside the flags, XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 where the user set none: the share of the GPU that JAX's
allocator may hand out (JAX's own default is 0.75). The engine keeps its weights and KV cache within 0.75 of the
device (runner/device_memory.py), so what is left for the steps' temporaries is this share less 0.75: with
JAX's 0.75 it was the 10% of the allocator's share that gpu_memory_utilization 0.9 leaves, too little for a dense
8B model's 2,048-token prefill step on an H100 (12.8 GiB of temporaries against 9.4 GiB free: warm-up ran out of
memory), and every benchmark of the project runs at 0.92 (benchmarks/gpu.sh), so this is what is measured.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

DEFAULT_FLAGS: dict[str, str] = {"xla_disable_hlo_passes": "rematerialization"}
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_MEM_FRACTION = "0.92"
SINGLE_GPU_FLAGS: dict[str, str] = {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}


def with_default_flags(xla_flags: str, defaults: dict[str, str] = DEFAULT_FLAGS) -> str:
    """`xla_flags` (an XLA_FLAGS string) plus `--name=value` for each default whose name it lacks."""
    given = {tok.lstrip("-").split("=", 1)[0] for tok in xla_flags.split()}
    extra = [f"--{k}={v}" for k, v in defaults.items() if k not in given]
    return " ".join([xla_flags.strip(), *extra]).strip()


def visible_cuda_devices() -> int:
    """CUDA devices the driver shows this process (CUDA_VISIBLE_DEVICES applies); 0 without a driver."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    n = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(n)) != 0:
        return 0
    return n.value


def apply_default_xla_flags(environ: MutableMapping[str, str] = os.environ, num_gpus: int | None = None) -> None:
    """Put DEFAULT_FLAGS, and SINGLE_GPU_FLAGS where at most one GPU is visible (`num_gpus`, default:
    asked of the driver), into environ["XLA_FLAGS"], and DEFAULT_MEM_FRACTION into
    environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] where it is unset, unless DEEPINFER_XLA_DEFAULTS=0."""
    if environ.get("DEEPINFER_XLA_DEFAULTS", "1") == "0":
        return
    environ.setdefault(MEM_FRACTION, DEFAULT_MEM_FRACTION)
    flags = dict(DEFAULT_FLAGS)
    if (visible_cuda_devices() if num_gpus is None else num_gpus) <= 1:
        flags.update(SINGLE_GPU_FLAGS)
    environ["XLA_FLAGS"] = with_default_flags(environ.get("XLA_FLAGS", ""), flags)


MODE = "xla_gpu_command_buffer_update_mode"


def _vmm_flags(xla_flags: str) -> list[str]:
    """The tokens of `xla_flags` that set a command-buffer update mode other than ALWAYS_UPDATE (each puts the GPU
    client on XLA's VMM allocator)."""
    return [t for t in xla_flags.split() if t.lstrip("-").split("=", 1)[0] == MODE
            and t.split("=", 1)[-1] != "ALWAYS_UPDATE"]


def _backend_state() -> tuple[bool, str | None]:
    """(whether JAX has started its backends, the default platform if it has); imports and starts nothing (a
    backend can only have started where JAX's modules are loaded)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None or not bridge.backends_are_initialized():
        return False, None
    return True, sys.modules["jax"].default_backend()


def use_host_memory(cpu_offload_gb: float | None, kv_offloading_size: float | None,
                    environ: MutableMapping[str, str] = os.environ, started: bool | None = None,
                    platform: str | None = None) -> None:
    """Before an engine that keeps arrays in pinned host memory (weights: --cpu-offload-gb, the KV host tier:
    --kv-offloading-size, either > 0) starts: take a VMM-allocator command-buffer mode out of environ["XLA_FLAGS"]
    while JAX has not started its backends; a ValueError naming the flag if a GPU backend already started with it
    (copies to pinned host memory would crash). `started` and `platform` default to JAX's own state."""
    asked = [f for f, gib in (("--cpu-offload-gb", cpu_offload_gb), ("--kv-offloading-size", kv_offloading_size))
             if gib and gib > 0]
    vmm = _vmm_flags(environ.get("XLA_FLAGS", ""))
    if not asked or not vmm:
        return
    if started is None:
        started, platform = _backend_state()
    if not started:
        environ["XLA_FLAGS"] = " ".join(t for t in environ["XLA_FLAGS"].split() if t not in vmm)
        return
    if platform == "gpu":
        raise ValueError(f"{asked[0]} keeps arrays in pinned host memory, which crashes under XLA's VMM allocator, and "
                         f"this process's GPU backend started with {' '.join(vmm)} (deepinfer's default on one GPU): "
                         f"create the engine before anything else uses JAX, or set DEEPINFER_XLA_DEFAULTS=0")
