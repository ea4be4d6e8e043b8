"""Random weights drawn on the device (benchmarks at real shapes without a host copy or a checkpoint).

Scale matters for MoE speed: weights that are too small make every router score tie and collapse
routing onto a few experts (BENCHMARKS.md). Linear weights ~ U(-a, a) (a = 0.05 by default, the same
range the vLLM peer's dummy loader is patched to), norms ~ U(0.9, 1.1), correction biases ~ U(0, 0.1).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import ParamSpec, is_spec, param_specs, spec_dtype


def random_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16, seed: int = 0, scale: float = 0.05,
                  shardings: Any = None) -> Any:
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten_with_path(specs, is_leaf=is_spec)
    shard_leaves = [None] * len(leaves) if shardings is None else jax.tree.leaves(shardings)
    key = jax.random.key(seed)
    out = []
    for i, ((path, spec), sh) in enumerate(zip(leaves, shard_leaves)):
        name = jax.tree_util.keystr(path)
        lo, hi = (-scale, scale)
        if "norm" in name:
            lo, hi = 0.9, 1.1
        elif "e_score_correction_bias" in name:
            lo, hi = 0.0, 0.1
        out.append(_uniform(jax.random.fold_in(key, i), spec, spec_dtype(spec, dtype), lo, hi, sh))
    return jax.tree.unflatten(treedef, out)


def _uniform(key, spec: ParamSpec, dtype, lo: float, hi: float, sharding) -> jax.Array:
    fn = jax.jit(lambda k: jax.random.uniform(k, spec.shape, dtype, lo, hi),  # no fp32 temporary
                 out_shardings=sharding)
    return fn(key)
