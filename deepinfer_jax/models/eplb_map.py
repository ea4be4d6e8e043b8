"""An expert placement (sharding/eplb.py) applied in the model: logical expert ids to physical slots, and the
physical expert weights from the logical ones.

The MoE params of a layer may carry `eplb`: {log_to_phys [E, R_max] int32, replicas [E] int32} (stacked [L, ...]
with the layers). The router's logical ids are then mapped to slots before the experts run, each token copy to
copy number (t k + j) mod replicas[e] of its expert e, so the copies of a hot expert share its tokens evenly;
the expert weights are [P, ...] over the physical slots. The map is data, not shape: a new placement of the same
slot count runs in the same compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def to_physical(idx: jax.Array, log_to_phys: jax.Array, replicas: jax.Array) -> jax.Array:
    """idx [T, k] logical expert ids -> [T, k] physical slots (log_to_phys [E, R], replicas [E])."""
    T, k = idx.shape
    copy = (jnp.arange(T, dtype=jnp.int32)[:, None] * k + jnp.arange(k, dtype=jnp.int32)[None, :]) % replicas[idx]
    return log_to_phys[idx, copy]


def physical_experts(experts: dict, phys_to_log: jax.Array, axis: int = 0) -> dict:
    """Logical expert weights {gate_up, down} [.., E, ...] -> the physical slots' [.., P, ...] (`axis`: the expert
    axis; 1 for weights stacked over layers, with phys_to_log [L, P] then)."""
    if axis == 0:
        return jax.tree.map(lambda a: jnp.take(a, phys_to_log, axis=0), experts)
    return jax.tree.map(lambda a: jax.vmap(lambda w, m: jnp.take(w, m, axis=0))(a, phys_to_log), experts)
