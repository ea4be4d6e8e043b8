"""Which kernels serve a decode-size step, and the calls that hand them the layer's stacked weights.

`forward_paged` (models/deepseek.py) asks these functions, once per layer segment and step shape, which
of RunnerConfig's decode kernels apply (each returns the stacked weights the kernel reads in place, or
None / False), and calls the multi-step ones from its layer body: the attention's output kernel (merge and
W_UV), o_proj's split-K partials, and the launch from those partials to the routing (and on to the experts).
Pure functions of the parameters and the step's shapes; no state.
"""

from __future__ import annotations

import math

import jax

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.cache import StepMetadata
from deepinfer_jax.models.layers import StackedWeight
from deepinfer_jax.models.moe import routing_into_kernels
from deepinfer_jax.models.parallel import MeshRules
from deepinfer_jax.models.quant import fp8_kernel_act, is_fp8, is_quantized


# Projections a decode step reads in place (group, name, weight dims contracted): those XLA copies
# before its GEMM (o_proj's slice for cuBLAS; the dense MLP's down weight, padded for a split K). The
# q / kv_a projections stay with XLA, which fuses them into one GEMM: 7.5 us a layer on an H200 against
# 10.5 us for the kernel's two launches (benchmarks/RESULTS.md).
STACKABLE = (("attn", "o_proj", 2), ("mlp", "gate_up", 1), ("mlp", "down", 1))


def pallas_one_device(attn_impl: str, mesh_rules: MeshRules | None) -> bool:
    return attn_impl in ("pallas", "pallas_interpret") and mesh_rules is None


def decode_kernel_step(meta: StepMetadata) -> bool:
    """Whether the per-token decode attention kernel serves this step: no more token slots than sequence
    rows. A step with more is a bucket sized for prefill, which the block-query prefill kernel serves,
    reading each page once per query block."""
    return meta.token_ids.shape[0] <= meta.page_table.shape[0]


def decode_stacked(seg_params: dict, num_tokens: int, attn_impl: str, mesh_rules: MeshRules | None,
                   enabled: bool, stackable=STACKABLE) -> dict:
    """{(group, name): stacked weight [L, ...]} of the segment's projections (`stackable`: (group, name, weight dims
    contracted)) that a step reads in place through kernels/decode_matmul.py: with `enabled`, on the Pallas path on
    one device, for a step of at most decode_matmul.MAX_TOKENS tokens, float weights the kernel can tile; FP8
    weights where `fp8_stackable` sends them through kernels/fp8_gemm.py (read in place the same way). Empty
    otherwise."""
    if not enabled or not pallas_one_device(attn_impl, mesh_rules):
        return {}
    from deepinfer_jax.kernels import decode_matmul

    out = {}
    for group, name, in_dims in stackable:
        w = seg_params.get(group, {}).get(name)
        if w is None:
            continue
        K, N = math.prod(w.shape[1:1 + in_dims]), math.prod(w.shape[1 + in_dims:])
        if is_fp8(w):
            if fp8_stackable(w, num_tokens, K, N):
                out[(group, name)] = w
        elif not is_quantized(w) and decode_matmul.supported(num_tokens, K, N):
            out[(group, name)] = w
    return out


def decode_stacked_splits(seg, seg_params: dict, cfg: ModelConfig, num_tokens: int, attn_impl: str,
                          mesh_rules: MeshRules | None, enabled: bool) -> dict:
    """{(group, name): models/fp8_parallel.Fp8Split} of the segment's FP8 projections (`STACKABLE`) that a step
    reads in place through kernels/fp8_gemm.py on each device's slice: with `enabled`, on the Pallas path under a
    mesh, where each device's GEMM (`fp8_parallel.fp8_split`'s `local` rows, K and N) takes the kernel by the one
    device's rule (`fp8_stackable`). Empty on one device (`decode_stacked` serves it) and elsewhere."""
    if not enabled or mesh_rules is None or attn_impl not in ("pallas", "pallas_interpret"):
        return {}
    from deepinfer_jax.models.fp8_parallel import fp8_split
    from deepinfer_jax.models.params import layer_specs

    specs = layer_specs(cfg, seg.kind, seg.num_layers)
    out = {}
    for group, name, in_dims in STACKABLE:
        w = seg_params.get(group, {}).get(name)
        if w is not None and is_fp8(w):
            split = fp8_split(mesh_rules, w, specs[group][name].axes, in_dims, num_tokens)
            if split is not None and fp8_stackable(w, *split.local):
                out[(group, name)] = split
    return out


def fp8_stackable(w, num_tokens: int, K: int, N: int) -> bool:
    """Whether a stacked Fp8Weight [L, K, N] (logical) goes through kernels/fp8_gemm.py in this step: the rule
    (`quant.fp8_kernel_act`), whole blocks the kernel tiles, and gate and up blocked apart on a block boundary
    (its [L, 2, I, D] read as one [L, 2I, D])."""
    from deepinfer_jax.kernels import fp8_gemm

    bn, bk = w.block
    return (fp8_kernel_act(num_tokens, K, N) is not None and fp8_gemm.supported(K, N, (bk, bn))
            and (w.parts == 1 or (N // w.parts) % bn == 0))


def _decode_kv_b(seg_params: dict, meta: StepMetadata, attn_impl: str, mesh_rules: MeshRules | None,
                 split_plan, enabled: bool) -> jax.Array | None:
    """The segment's stacked kv_b_proj [L, R, H, dn + dv] for a decode kernel that reads it in place:
    with `enabled`, on the Pallas path on one device, for a step the per-token decode kernel serves
    (no more token slots than sequence rows, no split prefill plan), float weights. None otherwise."""
    kv_b = seg_params["attn"]["kv_b_proj"]
    if (not enabled or not pallas_one_device(attn_impl, mesh_rules) or split_plan is not None
            or not decode_kernel_step(meta) or is_quantized(kv_b)):
        return None
    return kv_b


def decode_value_weights(seg_params: dict, cfg: ModelConfig, meta: StepMetadata, attn_impl: str,
                         mesh_rules: MeshRules | None, split_plan, enabled: bool) -> jax.Array | None:
    """The stacked kv_b_proj (`_decode_kv_b`) when this step's attention output goes through
    kernels/mla_output.py (the context splits merged and W_UV applied in one kernel): with `enabled`
    (RunnerConfig.decode_output_kernel) and a step size the kernel tiles. None otherwise."""
    from deepinfer_jax.kernels import mla_output

    kv_b = _decode_kv_b(seg_params, meta, attn_impl, mesh_rules, split_plan, enabled)
    return kv_b if kv_b is not None and mla_output.supported(meta.token_ids.shape[0], cfg.v_head_dim) else None


def decode_absorb_weights(seg_params: dict, cfg: ModelConfig, meta: StepMetadata, attn_impl: str,
                          mesh_rules: MeshRules | None, split_plan, enabled: bool) -> jax.Array | None:
    """The stacked kv_b_proj (`_decode_kv_b`) when this step's query absorption and RoPE go through
    kernels/mla_absorb.py (q and W_UK read in place from the q projection and kv_b): with `enabled`
    (RunnerConfig.decode_absorb_kernel) and a step size the kernel tiles. None otherwise."""
    from deepinfer_jax.kernels import mla_absorb

    kv_b = _decode_kv_b(seg_params, meta, attn_impl, mesh_rules, split_plan, enabled)
    ok = kv_b is not None and mla_absorb.supported(meta.token_ids.shape[0], cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                   cfg.kv_lora_rank)
    return kv_b if ok else None


def decode_latent_weights(seg_params: dict, cfg: ModelConfig, meta: StepMetadata, absorb_kv_b,
                          enabled: bool) -> jax.Array | None:
    """The segment's stacked kv_a_layernorm [L, R] when this step's latents are normed, rotated and written
    into the paged cache by the absorb kernel's launch (`mla_absorb.absorb_query_write_latents`): with
    `enabled` (RunnerConfig.decode_latent_kernel), where the absorb kernel runs (`absorb_kv_b`, from
    `decode_absorb_weights`) and a latent the kernel tiles. None otherwise."""
    from deepinfer_jax.kernels import mla_absorb

    if not enabled or absorb_kv_b is None or not mla_absorb.latent_supported(
            meta.token_ids.shape[0], cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank):
        return None
    return seg_params["attn"]["kv_a_layernorm"]


def merged_qkv_applies(seg_params: dict, cfg: ModelConfig, latent_norm, enabled: bool) -> bool:
    """Whether this step's q / kv_a projections run as one XLA GEMM whose output the absorb and latent launch reads
    in place (`mla.project_qkv_merged`, `mla_absorb.absorb_query_write_latents` with ckv None): with `enabled`
    (RunnerConfig.decode_merged_qkv), where that launch writes the latents (`latent_norm`), a model without q-LoRA
    and float weights."""
    attn = seg_params["attn"]
    return (enabled and latent_norm is not None and cfg.q_lora_rank is None
            and not is_quantized(attn["q_proj"]) and not is_quantized(attn["kv_a_proj_with_mqa"]))


def decode_route_weights(seg, seg_params: dict, cfg: ModelConfig, projections: dict, experts: dict | None,
                         num_tokens: int, moe_impl: str, mesh_rules: MeshRules | None, fuse_moe_routing: bool,
                         enabled: bool) -> tuple[jax.Array, jax.Array] | None:
    """(post_attention_layernorm [L, D], the router's gate [L, D, E]), both layer-stacked, when this MoE
    segment's decode step goes from o_proj's split-K partials to the routing in one launch
    (kernels/residual_route.py): with `enabled` (RunnerConfig.decode_route_launch), o_proj read in place
    (`decode_stacked`), the routing in its kernel (`moe.routing_into_kernels`), a float gate and sizes the
    launch takes. None otherwise."""
    from deepinfer_jax.kernels import residual_route

    if not enabled or seg.kind != "moe" or ("attn", "o_proj") not in projections or not fuse_moe_routing:
        return None
    if is_quantized(projections[("attn", "o_proj")]):  # FP8 o_proj: no float split-K partials to route from
        return None
    gate, norm = seg_params["moe"]["gate"], seg_params["post_attention_layernorm"]
    if is_quantized(gate) or not routing_into_kernels(cfg, moe_impl, mesh_rules, num_tokens, experts):
        return None
    S = _shared_in_kernels(experts)
    ok = residual_route.supported(num_tokens, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, S)
    return (norm, gate) if ok else None


def _shared_in_kernels(experts: dict) -> int:
    """The shared experts the MoE kernels run as extra experts (0 when the shared MLP is not among them)."""
    return experts["shared"]["gate_up"].shape[-1] // experts["gate_up"].shape[-1] if "shared" in experts else 0


def residual_route_step(parts, h, route_w, j, lp: dict, cfg: ModelConfig, experts: dict, interpret: bool):
    """o_proj's split-K partials [split_k, T, D] and the residual h [T, D] -> (h + o_proj's output, its
    post-attention RMSNorm x, x's routing: `moe_route.route_align`'s outputs), in one launch
    (kernels/residual_route.py): the values of the layer's add, `rms_norm`, `moe.router_logits` and the
    routing kernel, up to fp32 summation order."""
    from deepinfer_jax.kernels import moe_route, residual_route

    S, k = _shared_in_kernels(experts), cfg.num_experts_per_tok
    bias = lp["moe"]["e_score_correction_bias"] if cfg.topk_method == "noaux_tc" else None
    h, x, *routed = residual_route.residual_route(
        parts, h, *route_w, j, bias, eps=cfg.rms_norm_eps, k=k, num_shared=S,
        block_m=moe_route.decode_block_m(h.shape[0], k, S), scoring_func=cfg.scoring_func,
        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor, interpret=interpret)
    return h, x, tuple(routed)


def decode_moe_launch_applies(route_w, seg_params: dict, experts: dict | None, single_launch: bool,
                              enabled: bool, num_tokens: int, tokens: tuple[int, ...] | None) -> bool:
    """Whether this MoE segment's step of `num_tokens` token slots runs its route launch and its expert kernels
    as one launch (kernels/route_experts.py): with `enabled` (RunnerConfig.decode_moe_launch), num_tokens one of
    `tokens` (RunnerConfig.decode_moe_launch_tokens; None: any), the route launch (`decode_route_weights`), the
    expert kernels' single launch, and no shared MLP left outside the kernels."""
    return (enabled and (tokens is None or num_tokens in tokens) and route_w is not None and single_launch
            and ("shared" in experts or "shared" not in seg_params["moe"]))


def route_experts_step(parts, h, route_w, j, lp: dict, cfg: ModelConfig, experts: dict, interpret: bool,
                       shared_tiles: tuple[int, int, int] | None = None):
    """o_proj's split-K partials [split_k, T, D] and the residual h [T, D] -> (h + o_proj's output, its
    post-attention RMSNorm x, the MoE block of x, the routed ids [T, k]), in one launch (kernels/route_experts.py):
    the values of `residual_route_step` followed by `moe.moe_block`; `shared_tiles`: the shared experts' tiles
    (RunnerConfig.decode_moe_shared_tiles)."""
    from deepinfer_jax.kernels.route_experts import route_experts

    shared = (experts["shared"]["gate_up"], experts["shared"]["down"]) if "shared" in experts else (None, None)
    bias = lp["moe"]["e_score_correction_bias"] if cfg.topk_method == "noaux_tc" else None
    return route_experts(parts, h, *route_w, j, experts["gate_up"], experts["down"], *shared, bias,
                         eps=cfg.rms_norm_eps, k=cfg.num_experts_per_tok, scoring_func=cfg.scoring_func,
                         norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
                         shared_tiles=shared_tiles, interpret=interpret)


def oproj_partials(a: jax.Array, o_proj: StackedWeight) -> jax.Array:
    """a [T, H, dv] through o_proj read in place, its split-K partials [split_k, T, D] fp32 unsummed
    (kernels/decode_matmul.py; T a power of two of at least 16)."""
    from deepinfer_jax.kernels.decode_matmul import decode_matmul

    w = o_proj.stacked
    return decode_matmul(a.reshape(a.shape[0], -1), w.reshape(w.shape[0], -1, w.shape[-1]), o_proj.layer,
                         reduce=False, interpret=o_proj.interpret)


def decode_attention_output(q_lat, q_pe, kv_cache, layer, meta: StepMetadata, cfg: ModelConfig, kv_b, j,
                            attn_impl: str) -> jax.Array:
    """The decode kernel's context splits merged and multiplied by W_UV (layer `j` of the stacked
    kv_b, read in place) in one kernel: the same [T, H, dv] as `paged_attention` then
    `mla.absorbed_output`, in q_lat's dtype."""
    from deepinfer_jax.kernels import mla_decode, mla_output

    interpret = attn_impl == "pallas_interpret"
    o, m, l = mla_decode.paged_mla_attention_splits(
        q_lat, q_pe, kv_cache, layer, meta.seq_ids, meta.positions, meta.page_table, cfg.softmax_scale,
        pages_per_step=mla_decode.PAGES_PER_STEP, interpret=interpret)
    return mla_output.merge_value_projection(o, m, l, kv_b, j, dn=cfg.qk_nope_head_dim, dtype=q_lat.dtype,
                                             interpret=interpret)
