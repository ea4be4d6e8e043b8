"""DeepSeek-V4 over a device mesh: its routed experts (expert parallelism, or their intermediate dim split), its
shared expert's intermediate dim and its attention's query heads (tensor parallelism, `v4_heads_sharded`).

`v4_experts_sharded(cfg, mr, moe_impl, ex, x, w, idx)` is V4's form of `moe.experts_sharded`: the routing (hash
table or scored top-k, `deepseek_v4.v4_moe`) is computed before, on every device alike; inside one `shard_map`
each device applies its slice of the experts (`ex`, {gate_up [E, D, 2, I], down [E, I, D]}: float, or FP4 / FP8
as released, split by sharding/packed.py) to the token copies routed to it, with V4's clamped SwiGLU
(`swiglu_limit`), and the partial sums are added over the devices. A device holding experts e0 .. e0 + E_local - 1
sees global ids and keeps only its own copies; with the intermediate dim split ("moe_mlp"), the clamp is
elementwise per column, so each device's slice of I gives its part of the down projection's sum exactly. The shared
expert's intermediate dim split over "tensor" (rules "mlp") runs in the same `shard_map` on each device's slice of
its I, for the same reason, and its partial output joins the routed partial sums before their one reduction (one
all-reduce of [T, D] a MoE layer, as V3's shared and routed experts' sums fuse).

Implementations per device: "pallas" / "pallas_interpret" with FP4 / FP8 experts: the quantized grouped GEMMs of
kernels/moe_gmm_quant.py on the stored bytes (copies of other devices' experts get id -1, no rows); otherwise the
ragged grouped GEMM ("ragged", the default) or every local expert densely ("dense"), dequantizing a kept slice.
Tokens split over the mesh (data-parallel attention) are gathered first and the sums reduce-scattered back, as
`moe.experts_sharded` does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepinfer_jax.config_v4 import V4Config
from deepinfer_jax.models.layers import linear, weight
from deepinfer_jax.models.moe import expert_weight_specs, local_experts_xla
from deepinfer_jax.models.parallel import MeshRules
from deepinfer_jax.models.quant_fp4 import PackedShape, packed_spec
from deepinfer_jax.models.v4_params import packed_order

# The attention leaves split with the query heads and their logical axes (models/v4_params.py).
HEAD_LEAVES = {"q_b_proj": ("q_lora", "heads", "qk_head"), "sinks": ("heads",), "o_a_proj": ("o_groups", None, None),
               "o_b_proj": ("o_groups", "embed")}
# The shared expert's leaves and their logical axes, split by its intermediate dim I ("mlp").
SHARED_LEAVES = {"gate_up": ("embed", None, "mlp"), "down": ("mlp", "embed")}


def v4_shared_expert(p: dict, x: jax.Array, act) -> jax.Array:
    """The shared expert: x [S, D] -> [S, D], `act(gate, up)` the clamped SwiGLU; gate_up [D, 2, I], down [I, D] (or
    a device's slice of I inside shard_map: the clamp is elementwise, so the slices' outputs sum to the whole's)."""
    sgu = jnp.einsum("sd,dgi->sgi", x, weight(p["gate_up"], x.dtype))
    return linear(act(sgu[:, 0], sgu[:, 1]), p["down"])


def splits_shared(mr: MeshRules | None) -> bool:
    """Whether `mr` splits the shared expert's intermediate dim ("mlp", sharding/rules.py v4_splits_shared)."""
    return mr is not None and mr.size("mlp") > 1


def splits_experts(mr: MeshRules | None) -> bool:
    """Whether `mr` splits the routed experts or their intermediate dim over more than one device."""
    return mr is not None and (mr.size("expert") > 1 or mr.size("moe_mlp") > 1)


def _local_experts(cfg: V4Config, moe_impl: str, exp_axes: tuple, fmts: tuple | None, act, ex_l: dict, x: jax.Array,
                   w: jax.Array, idx: jax.Array) -> jax.Array:
    """Inside shard_map: this device's experts ex_l [E_local, ...] on the copies of x [T, D] routed to them (w / idx
    [T, k], global ids) -> fp32 [T, D] partial sums. `fmts`: the kept experts' kernel formats (or None)."""
    E_local = ex_l["down"].shape[0]
    first = jax.lax.axis_index(exp_axes) * E_local if exp_axes else jnp.int32(0)
    if fmts is not None and moe_impl in ("pallas", "pallas_interpret"):
        from deepinfer_jax.kernels.moe_gmm_quant import moe_experts_quant, supported

        D, I = ex_l["down"].shape[-1], ex_l["down"].shape[-2]
        if supported(*fmts, D, I, idx.size):
            loc = idx.astype(jnp.int32) - first
            ok = (loc >= 0) & (loc < E_local)
            gu, dn = ex_l["gate_up"], ex_l["down"]
            y = moe_experts_quant(x, gu.q, gu.scale, dn.q, dn.scale, jnp.where(ok, w, 0.0), jnp.where(ok, loc, -1),
                                  fmt_gu=fmts[0], fmt_down=fmts[1], swiglu_limit=cfg.swiglu_limit,
                                  interpret=moe_impl == "pallas_interpret")
            return y.astype(jnp.float32)
    return local_experts_xla(moe_impl, ex_l, x, w, idx, first, act=act)


def v4_experts_sharded(cfg: V4Config, mr: MeshRules, moe_impl: str, ex: dict, x: jax.Array, w: jax.Array,
                       idx: jax.Array, act, fmts: tuple | None, shared: dict | None = None) -> jax.Array:
    """V4's routed experts split over the mesh as `mr` lays them out: x [T, D], w / idx [T, k] -> [T, D] in x's
    dtype (the module docstring). `act(gate, up)`: the clamped SwiGLU; `fmts`: the kernel formats of experts kept
    as released (deepseek_v4.expert_formats), or None. `shared`: the shared expert {gate_up [D, 2, I], down [I, D]}
    with I split as the rules' "mlp" (`splits_shared`): each device adds its slice's partial output to its routed
    partial sums before the one reduction (the devices that hold the same slice along the other reduced axes add it
    once), so the layer still sums once; None: the caller adds the shared expert."""
    tok = mr.mesh_axes("tokens")
    exp_axes, mlp_axes = mr.mesh_axes("expert"), mr.mesh_axes("moe_mlp")
    reduce_axes = tuple(a for a in mr.mesh.axis_names if a in exp_axes or a in mlp_axes)
    gather = tuple(a for a in tok if a in reduce_axes and mr.mesh.shape[a] > 1)
    rest = tuple(a for a in reduce_axes if a not in gather)
    specs = expert_weight_specs(mr, ex)
    tspec = mr.spec(("tokens", None))
    weights = {"gate_up": ex["gate_up"], "down": ex["down"]}
    once = tuple(a for a in reduce_axes if a not in mr.mesh_axes("mlp") and mr.mesh.shape[a] > 1)
    if shared is not None:
        if not set(mr.mesh_axes("mlp")) <= set(reduce_axes):
            raise ValueError(f"deepseek_v4's shared expert splits over {mr.mesh_axes('mlp')}, which its routed "
                             f"experts' reduction {reduce_axes} does not span (sharding/rules.py v4_rules)")
        weights["shared"] = shared
        specs = {**specs, "shared": {k: _leaf_spec(mr, k, SHARED_LEAVES[k], shared[k]) for k in SHARED_LEAVES}}

    def local(ex_l, x, w, idx):
        dt = x.dtype
        if gather:
            x, w, idx = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, w, idx))
        y = _local_experts(cfg, moe_impl, exp_axes, fmts, act, ex_l, x, w, idx)
        if "shared" in ex_l:
            ys = v4_shared_expert(ex_l["shared"], x, act).astype(jnp.float32)
            y = y + (jnp.where(jax.lax.axis_index(once) == 0, ys, 0.0) if once else ys)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        if rest:
            y = jax.lax.psum(y, rest)
        return y.astype(dt)

    fn = jax.shard_map(local, mesh=mr.mesh, in_specs=(specs, tspec, tspec, tspec), out_specs=tspec,
                       check_vma=not moe_impl.startswith("pallas"))
    return fn(weights, x, w, idx)


def splits_heads(mr: MeshRules | None) -> bool:
    """Whether `mr` splits V4's query heads (and with them its output groups) over more than one device."""
    return mr is not None and mr.size("heads") > 1


def _leaf_spec(mr: MeshRules, name: str, axes: tuple, w):
    """The shard_map in_spec of a leaf of logical `axes` split by the rules: an FP8 weight kept as released gets its
    float leaf's partition in the order of its packed layout (v4_params.packed_order, quant_fp4.packed_spec) for q
    and scale alike."""
    spec = tuple(mr.spec(axes))
    if isinstance(w, PackedShape):
        s = P(*packed_spec(w, packed_order(name, spec)))
        return dataclasses.replace(w, q=s, scale=s)
    return P(*spec)


def v4_heads_sharded(mr: MeshRules, fn, p: dict, rep, check_vma: bool = True) -> jax.Array:
    """V4's attention split by query head: inside one `shard_map` each device runs `fn(ph, rep)` with its slices `ph`
    of q_b_proj [Rq, H / tp, hd] and the sinks [H / tp] (its heads), o_a_proj (its g / tp output groups, whose inputs
    are exactly those heads' outputs) and o_b_proj (the rows of those groups), giving its partial [T, D] of the output
    projection; the partials are summed over the tensor axis, the layer's one reduction. `rep`: a pytree of what
    `fn` reads besides (the per-group cache, the step's rows and indexer choices), whole and the same on every
    device. `check_vma`: False where `fn` runs Pallas kernels."""
    axes = mr.mesh_axes("heads")
    ph = {k: p[k] for k in HEAD_LEAVES}
    specs = {k: _leaf_spec(mr, k, HEAD_LEAVES[k], w) for k, w in ph.items()}

    def local(ph, rep):
        return jax.lax.psum(fn(ph, rep), axes)

    in_specs = (specs, jax.tree.map(lambda _: P(), rep))
    return jax.shard_map(local, mesh=mr.mesh, in_specs=in_specs, out_specs=P(), check_vma=check_vma)(ph, rep)
