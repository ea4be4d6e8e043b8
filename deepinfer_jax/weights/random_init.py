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
from deepinfer_jax.weights.pending import HOST_MEMORY, PendingParams, abstract_from_specs


def random_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16, seed: int = 0, scale: float = 0.05,
                  shardings: Any = None, target: Any = None) -> Any:
    """Every leaf drawn in one jitted program (one compile, instead of one per leaf, shared by every seed and
    call with the same shapes); leaf i uses fold_in(key(seed), i), so the values do not depend on how the
    drawing is batched or sharded. `target`: the abstract params (weights/pending.py) with leaves placed in host
    memory (runner/weight_offload.py): those are drawn one at a time by programs whose output is in host memory,
    so the device holds one of them only while its program runs."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten_with_path(specs, is_leaf=is_spec)
    plan = [(i, tuple(spec.shape), jnp.dtype(spec_dtype(spec, dtype)), *leaf_range(cfg, path, scale))
            for i, (path, spec) in enumerate(leaves)]
    out_shardings = None if shardings is None else tuple(jax.tree.leaves(shardings))
    host = [] if target is None else [i for i, a in enumerate(jax.tree.leaves(target))
                                      if a.sharding.memory_kind in HOST_MEMORY]
    if not host:
        out = _drawer(tuple(plan), out_shardings)(jax.random.key(seed))
        return jax.tree.unflatten(treedef, out)
    on_device = [i for i in range(len(plan)) if i not in set(host)]
    out = [None] * len(plan)
    drawn = _drawer(tuple(plan[i] for i in on_device),
                    None if out_shardings is None else tuple(out_shardings[i] for i in on_device))(jax.random.key(seed))
    for i, x in zip(on_device, drawn):
        out[i] = x
    for i, a in zip(host, (jax.tree.leaves(target)[i] for i in host)):
        out[i] = _drawer((plan[i],), (a.sharding,), to_host=True)(jax.random.key(seed))[0]
    return jax.tree.unflatten(treedef, out)


def leaf_range(cfg: ModelConfig, path: Any, scale: float) -> tuple[float, float]:
    """(lo, hi) of the uniform draw of the leaf at `path` (module docstring)."""
    name = jax.tree_util.keystr(path)
    if "norm" in name:
        return 0.9, 1.1
    if "e_score_correction_bias" in name:
        return 0.0, 0.1
    if "tid2eid" in name:  # DeepSeek-V4's hash routing table: expert ids, uniform over the experts
        return 0, cfg.n_routed_experts
    return -scale, scale


def draw_leaf(key: Any, shape: tuple, dt: Any, lo: float, hi: float) -> jax.Array:
    """One leaf's uniform draw in its own dtype (no fp32 temporary)."""
    if jnp.issubdtype(dt, jnp.integer):
        return jax.random.randint(key, shape, lo, hi, dt)
    return jax.random.uniform(key, shape, dt, lo, hi)


@functools.lru_cache(maxsize=8)
def _drawer(plan: tuple, out_shardings: tuple | None, to_host: bool = False):
    """The jitted draw of `plan`'s leaves ((index, shape, dtype, lo, hi) each) from a key (`to_host`: copied to
    host memory by the program, its output placed there by `out_shardings`)."""

    def draw(key):  # no fp32 temporary: uniform draws in the leaf's dtype
        keys = [jax.random.fold_in(key, i) for i, *_ in plan]
        out = [draw_leaf(k, shape, dt, lo, hi) for k, (_, shape, dt, lo, hi) in zip(keys, plan)]
        return [jax.device_put(x, jax.memory.Space.Host) for x in out] if to_host else out

    return jax.jit(draw, out_shardings=None if out_shardings is None else list(out_shardings))


def pending_random_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16, seed: int = 0, scale: float = 0.05,
                          shardings: Any = None) -> PendingParams:
    """`random_params` pending (weights/pending.py): drawn when the engine starts the load (`load_to`: with the
    leaves a target tree places in host memory drawn there)."""
    return PendingParams(abstract_from_specs(cfg, jnp.dtype(dtype), shardings), load_to=lambda target: random_params(
        cfg, dtype, seed=seed, scale=scale, shardings=shardings, target=target))
