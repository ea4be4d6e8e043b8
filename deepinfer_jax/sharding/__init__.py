"""Tensor, expert, data and pipeline parallelism over jax.sharding Meshes (see README.md in this folder)."""

from deepinfer_jax.sharding.layout import ModelSharding, build_sharding
from deepinfer_jax.sharding.mesh import DATA, TENSOR, ParallelConfig, make_mesh
from deepinfer_jax.sharding.rules import (
    KV_CACHE_AXES, Rules, check_rules, default_rules, kv_cache_sharding, param_partition_specs, param_shardings,
)

__all__ = [
    "DATA", "TENSOR", "KV_CACHE_AXES", "ModelSharding", "ParallelConfig", "Rules", "build_sharding", "check_rules",
    "default_rules", "kv_cache_sharding", "make_mesh", "param_partition_specs", "param_shardings",
]
