"""Random weights drawn on the device (benchmarks at real shapes without a host copy or a checkpoint).

Scale matters for MoE speed: weights that are too small make every router score tie and collapse
routing onto a few experts (BENCHMARKS.md). Linear weights ~ U(-a, a) (a = 0.05 by default, the same
range the vLLM peer's dummy loader is patched to), norms ~ U(0.9, 1.1), correction biases ~ U(0, 0.1).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import is_spec, spec_dtype
from deepinfer_jax.models.registry import param_specs
from deepinfer_jax.weights.pending import PendingParams, abstract_from_specs


def random_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16, seed: int = 0, scale: float = 0.05,
                  shardings: Any = None) -> Any:
    """Every leaf drawn in one jitted program (one compile, instead of one per leaf, shared by every seed and
    call with the same shapes); leaf i uses fold_in(key(seed), i), so the values do not depend on how the
    drawing is batched or sharded."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten_with_path(specs, is_leaf=is_spec)
    plan = []
    for path, spec in leaves:
        name = jax.tree_util.keystr(path)
        lo, hi = (-scale, scale)
        if "norm" in name:
            lo, hi = 0.9, 1.1
        elif "e_score_correction_bias" in name:
            lo, hi = 0.0, 0.1
        elif "tid2eid" in name:  # DeepSeek-V4's hash routing table: expert ids, uniform over the experts
            lo, hi = 0, cfg.n_routed_experts
        plan.append((tuple(spec.shape), jnp.dtype(spec_dtype(spec, dtype)), lo, hi))
    out_shardings = None if shardings is None else tuple(jax.tree.leaves(shardings))
    out = _drawer(tuple(plan), out_shardings)(jax.random.key(seed))
    return jax.tree.unflatten(treedef, out)


@functools.lru_cache(maxsize=8)
def _drawer(plan: tuple, out_shardings: tuple | None):
    """The jitted draw of `plan`'s leaves ((shape, dtype, lo, hi) each) from a key."""

    def draw(key):  # no fp32 temporary: uniform draws in the leaf's dtype
        keys = [jax.random.fold_in(key, i) for i in range(len(plan))]
        return [jax.random.randint(k, shape, lo, hi, dt) if jnp.issubdtype(dt, jnp.integer)
                else jax.random.uniform(k, shape, dt, lo, hi) for k, (shape, dt, lo, hi) in zip(keys, plan)]

    return jax.jit(draw, out_shardings=None if out_shardings is None else list(out_shardings))


def pending_random_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16, seed: int = 0, scale: float = 0.05,
                          shardings: Any = None) -> PendingParams:
    """`random_params` pending (weights/pending.py): drawn when the engine starts the load."""
    return PendingParams(abstract_from_specs(cfg, jnp.dtype(dtype), shardings),
                         lambda: random_params(cfg, dtype, seed=seed, scale=scale, shardings=shardings))
