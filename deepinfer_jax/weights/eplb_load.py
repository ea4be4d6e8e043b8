"""An EPLB placement (sharding/eplb.py) applied to loaded params: the routed experts of every MoE segment become
the placement's physical slots and the segment's MoE params get its map (models/eplb_map.py).

`with_placement` takes the params as arrays, as an abstract tree (jax.ShapeDtypeStruct leaves) or as
PendingParams (weights/pending.py), and returns the same kind: the abstract tree announces the physical shapes,
so the engine compiles its step programs for them while the logical weights load; each segment's physical
weights are then gathered on the devices, a layer at a time, onto the logical weights' sharding (which splits the
P slots over the EP ranks as it split the E experts). Until the logical weights are freed a device holds both,
(1 + P / E) times its share of the routed experts, plus one layer's experts for the take.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.sharding.eplb import ExpertPlacement


def _moe_segments(params: Any) -> list[int]:
    return [i for i, seg in enumerate(params["segments"]) if "moe" in seg and "experts" in seg["moe"]]


def _map_leaves(placement: ExpertPlacement, rows: slice, sharding: Any, abstract: bool) -> dict:
    """The segment's `eplb` map: log_to_phys [L, E, R + 1] and replicas [L, E] int32, replicated."""
    out = {"log_to_phys": placement.log_to_phys[rows], "replicas": placement.replicas[rows]}
    if abstract:
        return {k: jax.ShapeDtypeStruct(v.shape, jnp.int32, sharding=sharding) for k, v in out.items()}
    return {k: jax.device_put(np.asarray(v, np.int32), sharding) for k, v in out.items()}


def _physical(experts: Any, phys_to_log: np.ndarray, num_logical: int, abstract: bool) -> Any:
    """Every leaf [L, E, ...] of `experts` -> [L, P, ...] on the same sharding (a leaf without the expert axis, such
    as a per-layer scale, unchanged)."""
    P = phys_to_log.shape[1]

    def one(a):
        if a.ndim < 2 or a.shape[1] != num_logical:
            return a
        if abstract:
            return jax.ShapeDtypeStruct((a.shape[0], P) + tuple(a.shape[2:]), a.dtype, sharding=a.sharding)
        return _gather_slots(a, jnp.asarray(phys_to_log, jnp.int32))

    return jax.tree.map(one, experts)


def _gather_slots(a: jax.Array, phys_to_log: jax.Array) -> jax.Array:
    """a [L, E, ...] -> [L, P, ...] on a's sharding, a layer at a time into one donated buffer: the partitioner
    may bring a whole layer's experts to every device for the take, never every layer's."""
    L, P = phys_to_log.shape

    @jax.jit
    def zeros():
        return jax.lax.with_sharding_constraint(jnp.zeros((L, P) + a.shape[2:], a.dtype), a.sharding)

    step = jax.jit(lambda out, a, m, l: out.at[l].set(jnp.take(jax.lax.dynamic_index_in_dim(a, l, keepdims=False),
                                                                m[l], axis=0)),
                   donate_argnums=0, out_shardings=a.sharding)
    out = zeros()
    for layer in range(L):
        out = step(out, a, phys_to_log, jnp.int32(layer))
    return out


def _map_moe_layers(params: Any, fn) -> tuple[Any, int]:
    """params with each MoE segment's experts and `eplb` maps from fn(experts, rows) -> (experts, maps), `rows`
    the segment's slice of the MoE layers counted over the model; -> (params, MoE layers seen)."""
    segs = list(params["segments"])
    first = 0
    for i in _moe_segments(params):
        moe = segs[i]["moe"]
        L = jax.tree.leaves(moe["experts"])[0].shape[0]
        rows = slice(first, first + L)
        first += L
        experts, maps = fn(moe["experts"], rows)
        segs[i] = {**segs[i], "moe": {**moe, "experts": experts, "eplb": maps}}
    return {**params, "segments": segs}, first


def place_tree(params: Any, placement: ExpertPlacement, replicated: Any, num_logical: int,
               abstract: bool = False) -> Any:
    """params (arrays, or ShapeDtypeStructs with `abstract`) -> the physical-slot params. `replicated`: the
    NamedSharding of the maps (P() on the mesh)."""
    out, first = _map_moe_layers(params, lambda ex, rows: (
        _physical(ex, placement.phys_to_log[rows], num_logical, abstract),
        _map_leaves(placement, rows, replicated, abstract)))
    if first != placement.phys_to_log.shape[0]:
        raise ValueError(f"the expert placement has {placement.phys_to_log.shape[0]} MoE layers, the model {first}")
    return out


def with_placement(params: Any, placement: ExpertPlacement, mesh: Any, num_logical: int) -> Any:
    """`params` (arrays or PendingParams) with the routed experts on `placement`'s physical slots."""
    from jax.sharding import NamedSharding, PartitionSpec

    from deepinfer_jax.weights.pending import PendingParams

    replicated = NamedSharding(mesh, PartitionSpec())
    if isinstance(params, PendingParams):
        load = params.load
        return PendingParams(place_tree(params.abstract, placement, replicated, num_logical, abstract=True),
                             lambda: place_tree(load(), placement, replicated, num_logical))
    return place_tree(params, placement, replicated, num_logical)


def replace_placement(params: Any, old: ExpertPlacement, new: ExpertPlacement, mesh: Any) -> Any:
    """Loaded physical-slot params on placement `old` -> the same on `new` (of the same slot count): each new slot
    gathered from a slot of `old` that holds its expert, on the same shardings and shapes, so the compiled step
    programs run them. A device holds both slot sets of one array while it is gathered."""
    from jax.sharding import NamedSharding, PartitionSpec

    if new.phys_to_log.shape != old.phys_to_log.shape or new.log_to_phys.shape != old.log_to_phys.shape:
        raise ValueError(f"a new expert placement must keep the slots {old.phys_to_log.shape}, got "
                         f"{new.phys_to_log.shape}")
    # [L, P]: for each new slot, the first old slot of its logical expert
    source = np.take_along_axis(old.log_to_phys[:, :, 0], new.phys_to_log.astype(np.int64), axis=1)
    replicated = NamedSharding(mesh, PartitionSpec())
    P = new.num_physical
    return _map_moe_layers(params, lambda ex, rows: (
        _physical(ex, source[rows], P, False), _map_leaves(new, rows, replicated, False)))[0]


def moe_layer_count(params: Any) -> int:
    """The MoE layers of `params` (arrays, abstract tree or PendingParams), in segment order."""
    tree = getattr(params, "abstract", params)
    return sum(jax.tree.leaves(tree["segments"][i]["moe"]["experts"])[0].shape[0] for i in _moe_segments(tree))
