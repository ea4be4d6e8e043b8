"""DeepSeek MoE: the fp32 router (greedy, group_limited_greedy, noaux_tc) and the routed experts.

MoE(x) = sum_k w_k * Expert_{idx_k}(x) + Shared(x); every expert is SwiGLU.

Router (HF's arithmetic, in fp32):
- logits = x @ gate; scores = softmax(logits) or sigmoid(logits).
- greedy: top-k of scores.
- group_limited_greedy: group score = max in each of n_group groups; keep the top topk_group groups.
- noaux_tc: choice scores = scores + e_score_correction_bias; group score = sum of the top-2 choice
  scores of the group; keep the top topk_group groups; top-k of the choice scores; weights are the
  *unbiased* scores of the chosen experts.
- Experts outside kept groups are masked with -inf (official DeepSeek; HF fills 0.0, which only
  differs when a kept score can be negative).
- norm_topk_prob: w /= sum(w) + 1e-20; then w *= routed_scaling_factor.

Expert implementations (`moe_impl`):
- "ragged": sort token copies by expert, grouped GEMM with `jax.lax.ragged_dot`, scatter-add back.
- "dense": every token through every expert, weighted by a [T, E] combine matrix (reference, tiny models).
- "pallas": block-aligned grouped GEMM kernels (kernels/moe_gmm.py); "pallas_interpret" runs them on CPU.
  Two fusions of that path on one device (RunnerConfig, on by default), both for decode-size steps:
  the shared MLP as extra experts inside the kernels (`shared_into_kernels`), and routing + alignment
  in one kernel (kernels/moe_route.py, `routing_into_kernels`).

Sharded (`mesh_rules` given and the "expert" or "moe_mlp" axis split over the mesh): `experts_sharded`
runs the chosen implementation under `jax.shard_map` on each device's slice of the experts (expert
parallel) and/or of their intermediate dim (tensor parallel). Tokens sharded over the same mesh axes
(data-parallel attention) are all-gathered first; each device computes the token copies routed to its
local experts, and the partial sums are reduce-scattered back to the token owners (psum over the
other axes). A first version, "soft all-to-all" as in sglang-jax: every device sees every token.
With `MeshRules.moe_dispatch` "all_to_all" each token goes only to its experts' devices instead
(models/moe_a2a.py). Without `mesh_rules` the single-device code runs unchanged.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.layers import silu_mul, swiglu_mlp, weight
from deepinfer_jax.models.parallel import MeshRules
from deepinfer_jax.models.quant import QuantizedWeight, fp8_kernel_act, is_fp8, is_quantized
from deepinfer_jax.models.quant_fp4 import PackedShape, packed_spec


def router_logits(p: dict, x: jax.Array) -> jax.Array:
    """x: [T, D] -> the router's logits [T, E], fp32 (HF: an fp32 linear of x and the gate weight).

    With 16-bit x and a gate weight of the same dtype, the products are formed from the 16-bit values
    and summed in fp32: a product of two bf16 (or fp16) numbers is exact in fp32, so this equals HF's
    upcast-then-multiply up to summation order, on the tensor cores instead of fp32 FMAs (an 8,192-token
    prefill step: 74 us a layer in fp32 on an H200)."""
    g = p["gate"]
    if x.dtype in (jnp.bfloat16, jnp.float16) and not is_quantized(g) and g.dtype == x.dtype:
        return jnp.einsum("td,de->te", x, g, preferred_element_type=jnp.float32)
    return jnp.einsum("td,de->te", x.astype(jnp.float32), weight(g, jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def route(p: dict, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [T, D] -> (weights [T, k] fp32, expert ids [T, k] int32)."""
    logits = router_logits(p, x)
    scores = jax.nn.softmax(logits, axis=-1) if cfg.scoring_func == "softmax" else jax.nn.sigmoid(logits)
    choice = scores
    if cfg.topk_method == "noaux_tc":
        choice = scores + p["e_score_correction_bias"].astype(jnp.float32)
    if cfg.topk_method in ("group_limited_greedy", "noaux_tc") and cfg.n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        if cfg.topk_method == "noaux_tc":
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        else:
            group_scores = jnp.max(grouped, axis=-1)
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
        group_mask = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(group_mask[:, :, None], grouped, -jnp.inf).reshape(T, E)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)  # [T, k]
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def route_sharded(mr: MeshRules, p: dict, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`route` on each device's own tokens (x split over "tokens"; the router weights replicated).
    Left to XLA, the group mask's scatter over token rows makes it all-gather the [T, E] scores."""
    router = {k: p[k] for k in ("gate", "e_score_correction_bias") if k in p}
    tspec = mr.spec(("tokens", None))
    return jax.shard_map(lambda r, x: route(r, cfg, x), mesh=mr.mesh, in_specs=(jax.tree.map(lambda _: P(), router), tspec),
                         out_specs=(tspec, tspec))(router, x)


def experts_ragged(p: dict, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
    """Grouped GEMM over expert-sorted token copies. x [T, D], w/idx [T, k] -> [T, D]."""
    return _experts_ragged_f32(p, x, w, idx).astype(x.dtype)


def _experts_ragged_f32(p: dict, x: jax.Array, w: jax.Array, idx: jax.Array,
                        first_expert: jax.Array | None = None, act=silu_mul) -> jax.Array:
    """experts_ragged before the final cast (fp32 [T, D]). With `first_expert`, `p` holds only the
    experts first_expert .. first_expert + E_local - 1 (this device's slice): copies routed elsewhere
    sort after every local group, fall outside the ragged groups and contribute nothing. `act(gate, up)`: the
    gated activation (DeepSeek-V4's clamped SwiGLU; silu(gate) * up by default)."""
    T, D = x.shape
    k = idx.shape[-1]
    E = p["gate_up"].shape[0]
    flat = idx.reshape(-1)  # [T*k]
    valid = None
    if first_expert is not None:
        local = flat - first_expert
        valid = (local >= 0) & (local < E)  # [T*k] copies routed to this device's experts
        flat = jnp.where(valid, local, E)  # others sort last, in the (E+1)-th group
    order = jnp.argsort(flat, stable=True)  # [T*k] copies sorted by expert
    token_of = order // k
    group_sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)  # [E]
    xs = x[token_of]  # [T*k, D]
    gate_up = weight(p["gate_up"], x.dtype).reshape(E, D, -1)  # [E, D, 2I]
    h = jax.lax.ragged_dot(xs, gate_up, group_sizes)  # [T*k, 2I]
    inter = h.shape[-1] // 2
    a = act(h[:, :inter], h[:, inter:])
    y = jax.lax.ragged_dot(a, weight(p["down"], x.dtype), group_sizes)  # [T*k, D]
    y = y.astype(jnp.float32) * w.reshape(-1)[order][:, None]
    if valid is not None:
        y = jnp.where(valid[order][:, None], y, 0.0)
    return jnp.zeros((T, D), jnp.float32).at[token_of].add(y)


def experts_dense(p: dict, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
    """Every token through every expert, combined with a [T, E] weight matrix (zero off the top-k)."""
    return _experts_dense_f32(p, x, w, idx).astype(x.dtype)


def _experts_dense_f32(p: dict, x: jax.Array, w: jax.Array, idx: jax.Array,
                       first_expert: jax.Array | None = None, act=silu_mul) -> jax.Array:
    """experts_dense before the final cast; `first_expert` and `act` as in _experts_ragged_f32."""
    E = p["gate_up"].shape[0]
    if first_expert is not None:
        local = idx - first_expert
        idx = jnp.where((local >= 0) & (local < E), local, E)  # E: out of range, dropped below
    combine = jnp.zeros((x.shape[0], E), jnp.float32).at[jnp.arange(x.shape[0])[:, None], idx].add(w, mode="drop")
    gu = jnp.einsum("td,edgi->tegi", x, weight(p["gate_up"], x.dtype))  # [T, E, 2, I]
    a = act(gu[:, :, 0], gu[:, :, 1])  # [T, E, I]
    y = jnp.einsum("tei,eid->ted", a, weight(p["down"], x.dtype))  # [T, E, D]
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine)


EXPERT_AXES = {"gate_up": ("expert", "embed", None, "moe_mlp"), "down": ("expert", "moe_mlp", "embed")}


def local_experts_xla(moe_impl: str, ex_l: dict, x: jax.Array, w: jax.Array, idx: jax.Array, first: jax.Array,
                      act=silu_mul) -> jax.Array:
    """Inside shard_map: the experts first .. first + E_local - 1 (`ex_l`) on the token copies routed to them, in
    XLA ("dense": every local expert; otherwise the ragged grouped GEMM) with the gated activation `act(gate, up)`
    -> fp32 [T, D] partial sums (DeepSeek-V4's experts, models/v4_parallel.py)."""
    f = _experts_dense_f32 if moe_impl == "dense" else _experts_ragged_f32
    return f(ex_l, x, w, idx, first, act=act)


def expert_weight_specs(mr: MeshRules, ex: dict) -> dict:
    """The shard_map in_specs of routed experts {gate_up, down} (float, INT8 / INT4, or FP8 / FP4 kept as stored)
    under `mr`."""
    return {k: _weight_specs(mr, EXPERT_AXES[k], ex[k]) for k in ("gate_up", "down")}


def _leaf_spec(mr: MeshRules, axes: tuple, leaf) -> P:
    """The PartitionSpec of an expert weight leaf; a quantized leaf's int8 scale keeps length-1 axes
    (one scale shared along a contracted axis) unsplit."""
    spec = tuple(mr.spec(axes)) + (None,) * (leaf.ndim - len(axes))
    return P(*[None if n == 1 else a for a, n in zip(spec, leaf.shape)])


def _weight_specs(mr: MeshRules, axes: tuple, w):
    """The in_specs of an expert weight: an FP8 / FP4 weight kept as stored (q [.., E, (2,) N, K]) gets its float
    leaf's partition mapped onto that layout for q and scale alike (quant_fp4.packed_spec); other leaves
    `_leaf_spec` each."""
    if isinstance(w, PackedShape):
        spec = P(*packed_spec(w, tuple(mr.spec(axes))))
        return dataclasses.replace(w, q=spec, scale=spec)
    return jax.tree.map(lambda leaf: _leaf_spec(mr, axes, leaf), w)


def _check_int4_groups(mr: MeshRules, name: str, leaf, specs) -> None:
    """An INT4 weight split along a grouped (contracted) axis needs whole groups on every device."""
    if not isinstance(leaf, QuantizedWeight) or leaf.bits != 4:
        return
    for ax, (a, n_q, n_s) in enumerate(zip(specs.q, leaf.q.shape, leaf.scale.shape)):
        n = 1
        for m in (() if a is None else (a,) if isinstance(a, str) else a):
            n *= mr.mesh.shape[m]
        if n > 1 and n_s % n:
            raise ValueError(
                f"INT4 expert weight {name!r}: {n_s} quantization group(s) along axis {ax} cannot be split over "
                f"{n} devices (group size {leaf.group_size}); use enable_expert_parallel, a smaller group "
                f"size, or fewer devices")


def experts_sharded(mr: MeshRules, moe_impl: str, ex: dict, x: jax.Array, w: jax.Array, idx: jax.Array,
                    layer: jax.Array | None) -> jax.Array:
    """Routed experts with the expert weights split over the mesh (see the module docstring).
    ex: {gate_up [(L,) E, D, 2, I], down [(L,) E, I, D]} (stacked when `layer` is given); x [T, D],
    w/idx [T, k] -> [T, D]. The same arithmetic per token copy as the single-device path; only the
    order of the final sums over experts and intermediate slices differs."""
    lead = ("layers",) if layer is not None else ()
    tok = mr.mesh_axes("tokens")
    exp_axes, mlp_axes = mr.mesh_axes("expert"), mr.mesh_axes("moe_mlp")
    reduce_axes = tuple(a for a in mr.mesh.axis_names if a in exp_axes or a in mlp_axes)
    # Token shards that devices holding other experts need (a size-1 axis needs no gather).
    gather = tuple(a for a in tok if a in reduce_axes and mr.mesh.shape[a] > 1)
    rest = tuple(a for a in reduce_axes if a not in gather)
    ex_specs = {k: _weight_specs(mr, lead + EXPERT_AXES[k], ex[k]) for k in ("gate_up", "down")}
    for k in ("gate_up", "down"):
        _check_int4_groups(mr, k, ex[k], ex_specs[k])
    tspec = mr.spec(("tokens", None))

    def local(ex_l, x, w, idx, layer):
        out_dtype = x.dtype
        if gather:
            x, w, idx = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, w, idx))
        y = local_experts_f32(moe_impl, ex_l, x, w, idx, layer, exp_axes, lead)
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        if rest:
            y = jax.lax.psum(y, rest)
        return y.astype(out_dtype)

    if mr.moe_dispatch == "all_to_all":  # token copies sent to their experts' devices and back (moe_a2a.py)
        from deepinfer_jax.models.moe_a2a import all_to_all_local, check_all_to_all

        check_all_to_all(mr)
        compute = functools.partial(local_experts_f32, moe_impl, exp_axes=exp_axes, lead=lead)
        local = functools.partial(all_to_all_local, mr, compute, exp_axes=exp_axes, lead=lead)
    if moe_impl not in ("dense", "ragged", "pallas", "pallas_interpret"):
        raise ValueError(f"moe_impl {moe_impl!r} is not one of 'ragged', 'dense', 'pallas', 'pallas_interpret'")
    layer_arg = jnp.int32(0) if layer is None else layer
    fn = jax.shard_map(lambda e, x, w, i, l: local(e, x, w, i, None if layer is None else l), mesh=mr.mesh,
                       in_specs=(ex_specs, tspec, tspec, tspec, P()), out_specs=tspec,
                       check_vma=not moe_impl.startswith("pallas") and mr.moe_dispatch != "all_to_all")
    return fn({"gate_up": ex["gate_up"], "down": ex["down"]}, x, w, idx, layer_arg)


def local_experts_f32(moe_impl: str, ex_l: dict, x: jax.Array, w: jax.Array, idx: jax.Array,
                      layer: jax.Array | None, exp_axes: tuple, lead: tuple) -> jax.Array:
    """Inside shard_map: this device's slice of the experts (`ex_l`, [(L,) E_local, ...]) applied to the token
    copies of x [T, D] (w/idx [T, k], global expert ids) routed to it; copies routed elsewhere (or id -1)
    contribute nothing. -> fp32 [T, D] partial sums."""
    E_local = jax.tree.leaves(ex_l["down"])[0].shape[len(lead)]
    first = jax.lax.axis_index(exp_axes) * E_local if exp_axes else jnp.int32(0)
    if moe_impl in ("pallas", "pallas_interpret"):
        from deepinfer_jax.kernels.moe_gmm import moe_experts

        # Copies routed to other devices' experts get id -1: the kernel gives them no rows.
        loc = idx - first
        ok = (loc >= 0) & (loc < E_local)
        w_loc, idx_loc = jnp.where(ok, w, 0.0), jnp.where(ok, loc, -1)
        y = quantized_experts(ex_l, x, w_loc, idx_loc, layer, moe_impl == "pallas_interpret") if (
            is_quantized(ex_l["gate_up"])) else None
        if y is None:  # float experts, or shapes the quantized kernels do not tile
            if layer is not None and is_quantized(ex_l["gate_up"]):  # dequantize this layer only, not every layer
                ex_l = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), ex_l)
                layer = None
            y = moe_experts(x, weight(ex_l["gate_up"], x.dtype), weight(ex_l["down"], x.dtype), w_loc, idx_loc,
                            layer=layer, interpret=moe_impl == "pallas_interpret")
        return y.astype(jnp.float32)
    if layer is not None:
        ex_l = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), ex_l)
    f = {"dense": _experts_dense_f32, "ragged": _experts_ragged_f32}[moe_impl]
    return f(ex_l, x, w, idx, first)


def quantized_experts(ex: dict, x: jax.Array, w: jax.Array, idx: jax.Array, layer: jax.Array | None,
                      interpret: bool) -> jax.Array | None:
    """INT8 / INT4 / FP8 experts {gate_up, down} ([(L,) E, ..] QuantizedWeights or Fp8Weights, read at `layer` in
    place) through kernels/moe_gmm_quant.py, which dequantizes each weight tile inside the kernels (W8A16 / W4A16;
    FP8: W8A8 or W8A16 as `quant.fp8_kernel_act` picks): [T, D] in
    x's dtype, or None where its tiles do not fit the shapes (the caller then dequantizes one layer)."""
    from deepinfer_jax.kernels.moe_gmm_quant import WeightFormat, moe_experts_quant, supported

    gu, down = ex["gate_up"], ex["down"]
    if is_fp8(gu) and is_fp8(down):  # HF's [out, in] blocks as stored; W8A8 or W8A16 by `fp8_kernel_act`
        act = fp8_kernel_act(x.shape[0], experts=True)
        fg, fd = (WeightFormat("fp8", group=a.block[1], block_n=a.block[0], act=act, layout="nk") for a in (gu, down))
    elif is_fp8(gu) or is_fp8(down):
        return None
    else:
        fg, fd = (WeightFormat(f"int{a.bits}", a.group_size) for a in (gu, down))
    D, I = gu.shape[-3], gu.shape[-1]
    if not supported(fg, fd, D, I, idx.size):
        return None
    return moe_experts_quant(x, gu.q, gu.scale, down.q, down.scale, w, idx, layer, fmt_gu=fg, fmt_down=fd,
                             interpret=interpret)


def routing_into_kernels(cfg: ModelConfig, moe_impl: str, mesh_rules: MeshRules | None, num_tokens: int,
                         experts: dict) -> bool:
    """Whether `kernels/moe_route.py` can route this step: the kernel path on one device, greedy top-k
    without expert groups (softmax or sigmoid scores, optionally noaux_tc's bias), float expert
    weights, and a decode-size step (`moe_route.supported`)."""
    from deepinfer_jax.kernels import moe_route

    if not _unsplit_kernel_path(moe_impl, mesh_rules) or is_quantized(experts["gate_up"]):
        return False
    if (cfg.n_group > 1 and cfg.topk_method != "greedy") or cfg.scoring_func not in ("softmax", "sigmoid"):
        return False
    S = experts["shared"]["gate_up"].shape[-1] // experts["gate_up"].shape[-1] if "shared" in experts else 0
    return moe_route.supported(num_tokens, cfg.n_routed_experts, cfg.num_experts_per_tok, S)


def moe_block(p: dict, cfg: ModelConfig, x: jax.Array, moe_impl: str = "ragged", return_routing: bool = False,
              experts: dict | None = None, layer: jax.Array | None = None, mesh_rules: MeshRules | None = None,
              fuse_routing: bool = False, single_launch: bool = False, routed: tuple | None = None,
              mosaic: bool = False):
    """x: [T, D] -> [T, D]: routed experts plus the shared experts (and the expert ids [T, k] if asked).

    Expert weights are `p["experts"]`, or `experts` stacked over layers [L, E, ...] with `layer` the
    index to use (the kernel reads the stacked array in place; the XLA paths slice it). With
    moe_impl "pallas*", `experts` may also carry the stacked shared MLP (`experts["shared"]`, unquantized,
    see `shared_into_kernels`): the kernels then compute it as extra experts and `p` has no "shared". With
    `mesh_rules` splitting "expert" or "moe_mlp", the routed experts run sharded (experts_sharded).
    `fuse_routing`: where `routing_into_kernels` allows, the routing and the token alignment run in one
    Pallas kernel (kernels/moe_route.py) instead of XLA's top-k, reductions and cumsums; `single_launch`:
    there, both expert kernels run in one launch (kernels/moe_gmm.py). `routed`: `moe_route.route_align`'s
    outputs for x, from a launch that routed already (kernels/residual_route.py); only where the routing runs
    in its kernel. `mosaic`: moe_impl
    "pallas*" steps of prefill size run the expert GEMMs on Mosaic GPU (kernels/moe_gmm.py `mosaic_applies`).
    `p["eplb"]`: an expert placement (models/eplb_map.py): the expert weights are its physical slots, the router's
    ids are mapped onto them, and the ids returned stay logical; the routing then runs in XLA, not in a kernel."""
    out, idx = _moe(p, cfg, x, moe_impl, experts, layer, mesh_rules, fuse_routing, single_launch, routed, mosaic)
    return (out, idx) if return_routing else out


def _moe(p, cfg, x, moe_impl, experts, layer, mesh_rules, fuse_routing, single_launch, routed, mosaic=False):
    """moe_block's work: (out [T, D], idx [T, k])."""
    ex = p["experts"] if experts is None else experts
    fused = fuse_routing and "eplb" not in p and routing_into_kernels(cfg, moe_impl, mesh_rules, x.shape[0], ex)
    if routed is not None and not fused:
        raise ValueError("moe_block takes precomputed routing only where it routes in its kernel")
    if fused:
        from deepinfer_jax.kernels.moe_route import moe_fused_decode

        bias = p["e_score_correction_bias"] if cfg.topk_method == "noaux_tc" else None
        shared = (ex["shared"]["gate_up"], ex["shared"]["down"]) if "shared" in ex else ()
        out, idx = moe_fused_decode(
            x, None if routed else router_logits(p, x), bias, ex["gate_up"], ex["down"], layer, *shared,
            k=cfg.num_experts_per_tok,
            scoring_func=cfg.scoring_func, norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor, single_launch=single_launch,
            routed=routed, interpret=moe_impl == "pallas_interpret")
        return (out if shared else _plus_shared(p, x, out)), idx
    if mesh_rules is not None and mesh_rules.size("tokens") > 1:
        w, idx = route_sharded(mesh_rules, p, cfg, x)
    else:
        w, idx = route(p, cfg, x)
    if "eplb" in p:  # an expert placement: the experts are physical slots (models/eplb_map.py)
        from deepinfer_jax.models.eplb_map import to_physical

        logical, idx = idx, to_physical(idx, p["eplb"]["log_to_phys"], p["eplb"]["replicas"])
        out, _ = _routed(p, cfg, x, moe_impl, ex, experts, layer, mesh_rules, w, idx, mosaic)
        return out, logical
    return _routed(p, cfg, x, moe_impl, ex, experts, layer, mesh_rules, w, idx, mosaic)


def _routed(p, cfg, x, moe_impl, ex, experts, layer, mesh_rules, w, idx, mosaic=False):
    """_moe's routed experts (plus the shared MLP) for routing w/idx [T, k]: (out [T, D], idx)."""
    if mesh_rules is not None and (mesh_rules.size("expert") > 1 or mesh_rules.size("moe_mlp") > 1):
        out = _plus_shared(p, x, experts_sharded(mesh_rules, moe_impl, ex, x, w, idx,
                                                 None if experts is None else layer))
        return out, idx
    if moe_impl in ("pallas", "pallas_interpret"):
        from deepinfer_jax.kernels.moe_gmm import moe_experts

        if "shared" in ex:  # stacked shared MLP handed over with the experts: it runs inside the kernels
            out = moe_experts(x, ex["gate_up"], ex["down"], w, idx, layer=layer,
                              shared_gate_up=ex["shared"]["gate_up"], shared_down=ex["shared"]["down"],
                              interpret=moe_impl == "pallas_interpret")
            return out, idx
        if is_quantized(ex["gate_up"]):
            out = quantized_experts(ex, x, w, idx, layer, moe_impl == "pallas_interpret")
            if out is not None:
                return _plus_shared(p, x, out), idx
        if experts is not None and is_quantized(ex["gate_up"]):
            # Shapes the quantized kernels do not tile: dequantize this layer only, not every layer's experts.
            ex = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), ex)
            layer = None
        out = moe_experts(x, weight(ex["gate_up"], x.dtype), weight(ex["down"], x.dtype), w, idx,
                          layer=layer, mosaic=mosaic, interpret=moe_impl == "pallas_interpret")
        return _plus_shared(p, x, out), idx
    if experts is not None:
        ex = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), ex)
    if moe_impl == "dense":
        out = experts_dense(ex, x, w, idx)
    elif moe_impl == "ragged":
        out = experts_ragged(ex, x, w, idx)
    else:
        raise ValueError(f"moe_impl {moe_impl!r} is not one of 'ragged', 'dense', 'pallas', 'pallas_interpret'")
    return _plus_shared(p, x, out), idx


# Steps of at most this many tokens run the shared MLP inside the expert kernels. Beyond, the separate
# GEMMs win: on an H200 a 16 x 512 prefill step took 113.8 ms fused against 108.5 ms apart.
SHARED_IN_KERNELS_MAX_TOKENS = 256


def shared_into_kernels(moe_params: dict, moe_impl: str, mesh_rules: MeshRules | None,
                        num_tokens: int = 1) -> bool:
    """Whether the shared MLP of these (stacked) MoE params can run inside the Pallas expert kernels:
    the kernel path on one device (or without expert / MLP splitting), float weights, a shared width
    that is a whole number of experts (DeepSeek's n_shared_experts x moe_intermediate_size), and a
    decode-size step (num_tokens <= SHARED_IN_KERNELS_MAX_TOKENS)."""
    if not _unsplit_kernel_path(moe_impl, mesh_rules) or "shared" not in moe_params:
        return False
    if num_tokens > SHARED_IN_KERNELS_MAX_TOKENS:
        return False
    leaves = [moe_params["experts"]["gate_up"], moe_params["shared"]["gate_up"], moe_params["shared"]["down"]]
    if any(is_quantized(a) for a in leaves):
        return False
    return moe_params["shared"]["gate_up"].shape[-1] % moe_params["experts"]["gate_up"].shape[-1] == 0


def _unsplit_kernel_path(moe_impl: str, mesh_rules: MeshRules | None) -> bool:
    """The Pallas expert kernels, with no mesh axis splitting the tokens, the experts or their MLP."""
    return moe_impl in ("pallas", "pallas_interpret") and (
        mesh_rules is None or all(mesh_rules.size(a) <= 1 for a in ("tokens", "expert", "moe_mlp")))


def _plus_shared(p: dict, x: jax.Array, out: jax.Array) -> jax.Array:
    return out + swiglu_mlp(x, p["shared"]) if "shared" in p else out
