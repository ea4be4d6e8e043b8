"""The parallel configuration (vLLM's three knobs) and the device mesh built from it.

Mesh: two axes, ("data", "tensor") of sizes (data_parallel_size, tensor_parallel_size), devices in
order (the tensor axis varies fastest, so a TP group is a run of neighbouring devices, which on a GPU
host share the fastest links). Expert parallelism is not a third axis: as in vLLM, the MoE layers span
all TP x DP devices, split over experts with `enable_expert_parallel` and over the experts'
intermediate dim otherwise (see rules.py). Pipeline parallelism is not an axis either: each of its
`pipeline_parallel_size` stages gets a mesh of its own over the next TP x DP devices (sharding/pipeline.py).
"""

from __future__ import annotations

from dataclasses import dataclass

DATA = "data"
TENSOR = "tensor"
AXES = (DATA, TENSOR)
# Expert-parallel token movement: every device sees every token (all-gather, then reduce-scatter), or each
# token goes only to its experts' devices and back (models/moe_a2a.py).
ALL2ALL_BACKENDS = ("allgather_reducescatter", "all_to_all")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    all2all_backend: str = "allgather_reducescatter"  # vLLM's --all2all-backend: how EP moves tokens (ALL2ALL_BACKENDS)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"--all2all-backend {self.all2all_backend!r} is not one of {', '.join(ALL2ALL_BACKENDS)}")

    @property
    def world_size(self) -> int:
        """The devices of one mesh: TP x DP (with pipeline parallelism, of one stage)."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def num_devices(self) -> int:
        """Every device the layout uses: TP x DP x PP."""
        return self.world_size * self.pipeline_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """vLLM's rule: EP spans TP x DP devices when enabled, else 1."""
        return self.world_size if self.enable_expert_parallel else 1

    @property
    def is_single_device(self) -> bool:
        return self.num_devices == 1


def make_mesh(pc: ParallelConfig, devices=None):
    """A ("data", "tensor") Mesh over the first TP x DP of `devices` (default: jax.devices())."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < pc.world_size:
        raise ValueError(f"tensor_parallel_size {pc.tensor_parallel_size} x data_parallel_size "
                         f"{pc.data_parallel_size} needs {pc.world_size} devices; {len(devices)} available")
    grid = np.array(devices[: pc.world_size], dtype=object).reshape(pc.data_parallel_size, pc.tensor_parallel_size)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))
