"""DeepSeek-V2 / V3 decoder as pure functions over the params pytree (see params.py for its layout).

Two entry points, both usable under `jax.jit`; `forward` also under `jax.grad`:

- `forward(params, cfg, token_ids[B, S])` -> logits [B, S, V]: the whole sequence at once, no cache,
  expanded (or absorbed) MLA with a causal mask. The reference every other path is checked against.
- `forward_paged(params, cfg, kv_cache, meta)` -> (logits [S, V], kv_cache): one ragged engine step.
  Writes each token's latent into its cache slot, then attends in the absorbed form over the paged
  cache. Prefill, chunked prefill and decode are the same call, so prefill followed by token-by-token
  decode equals one full forward (tested).

Sharding: with `mesh_rules` (models/parallel.py), the cache write + paged attention of each layer runs
under `jax.shard_map`: tokens, sequence rows and cache pages split over the "tokens"/"seqs"/"pages" mesh
axes (data-parallel attention: each rank's tokens only touch its own pages, and the step metadata are
rank-local), heads over the "heads" axes (tensor parallel). Everything else is left to XLA's SPMD
partitioner, which follows the param shardings. Without mesh_rules the single-device code runs.

Each decoder layer is pre-norm: h += attn(norm(h)); h += mlp_or_moe(norm(h)). Layers of one kind are
stacked per segment and run under `lax.scan`, so compile time does not grow with depth. Which decode
kernels serve a step, and the calls that hand them the stacked weights: models/decode_kernels.py.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.kernels.mla_reference import paged_mla_attention_reference
from deepinfer_jax.models import dsa, mla
from deepinfer_jax.models.cache import StepMetadata, to_cache_dtype, write_slots
from deepinfer_jax.models.decode_kernels import (
    decode_absorb_weights, decode_attention_output, decode_kernel_step, decode_latent_weights,
    decode_moe_launch_applies, decode_route_weights, decode_stacked, decode_stacked_splits, decode_value_weights,
    merged_qkv_applies, oproj_partials, residual_route_step, route_experts_step)
from deepinfer_jax.models.layers import StackedWeight, linear, rms_norm, rope_cos_sin, swiglu_mlp
from deepinfer_jax.models.mla_split import attend_split, chunk_split_plan
from deepinfer_jax.models.moe import moe_block, shared_into_kernels
from deepinfer_jax.models.parallel import MeshRules
from deepinfer_jax.models.params import layer_segments
from deepinfer_jax.models.pipeline import PipelineStage, stage_segments


def holds_host(tree) -> bool:
    """Whether any array of `tree` (or a tracer of one) lives in host memory (runner/weight_offload.py)."""
    return any(getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host for x in jax.tree.leaves(tree))


def _on_device(x):
    """`x` (a stacked weight, a tuple or dict of them, or None) unless part of it lives in host memory: None then.
    A weight in host memory is not read in place from its stack: the layer loop copies in its layer's slice."""
    return None if x is None or holds_host(x) else x


def _mlp(lp: dict, cfg: ModelConfig, kind: str, x: jax.Array, moe_impl: str) -> jax.Array:
    """x: [T, D] -> [T, D] through the dense MLP or the MoE block of this layer."""
    if kind == "dense":
        return swiglu_mlp(x, lp["mlp"])
    return moe_block(lp["moe"], cfg, x, moe_impl)


def _logits(params: dict, cfg: ModelConfig, h: jax.Array, mesh_rules: MeshRules | None = None) -> jax.Array:
    """Final norm and lm_head: h [..., D] -> fp32 logits [..., V] (the lm_head's output in h's dtype, then fp32).
    A vocab padded for tensor parallelism (cfg.padded_vocab_size) loses its padding columns here. Sharded, the
    logits are first computed with the vocab split as lm_head's columns are: without that constraint XLA's
    partitioner gathered the whole lm_head weight [D, V] on every device each step to produce the replicated
    logits the sampler takes, instead of gathering the [S, V] logits."""
    logits = linear(rms_norm(h, params["final_norm"], cfg.rms_norm_eps), params["lm_head"])
    if mesh_rules is not None:
        from jax.sharding import NamedSharding

        spec = mesh_rules.spec(("seqs",) * (logits.ndim - 1) + ("vocab",))
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh_rules.mesh, spec))
    if cfg.param_vocab_size != cfg.vocab_size:
        logits = logits[..., : cfg.vocab_size]
    return logits.astype(jnp.float32)


def decoder_layer(lp: dict, cfg: ModelConfig, kind: str, h: jax.Array, cos, sin, mask, attend, moe_impl: str) -> jax.Array:
    """One pre-norm decoder layer over the whole sequence: h [B, S, D] -> [B, S, D]."""
    B, S = h.shape[:2]
    x = rms_norm(h, lp["input_layernorm"], cfg.rms_norm_eps)
    q_nope, q_pe, c_kv, k_pe = mla.project_qkv(lp["attn"], cfg, x, cos, sin)
    m = dsa.sparse_mask(lp["attn"], cfg, x, cos, sin, mask) if cfg.has_indexer else mask  # [B, S, S]
    a = attend(lp["attn"], cfg, q_nope, q_pe, c_kv, k_pe, m)  # [B, S, H, dv]
    h = h + mla.output_projection(lp["attn"], a)
    x = rms_norm(h, lp["post_attention_layernorm"], cfg.rms_norm_eps)
    return h + _mlp(lp, cfg, kind, x.reshape(B * S, -1), moe_impl).reshape(B, S, -1)


def sequence_inputs(cfg: ModelConfig, B: int, S: int, attention_mask: jax.Array | None):
    """(cos, sin [B, S, dr/2], causal mask [B, S, S]) of a whole-sequence forward from position 0."""
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    cos, sin = rope_cos_sin(cfg, positions)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((S, S), bool)), (B, S, S))
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, :]
    return cos, sin, mask


def forward(
    params: dict,
    cfg: ModelConfig,
    token_ids: jax.Array,  # [B, S] int32
    *,
    moe_impl: str = "ragged",
    mla_form: str = "expanded",
    attention_mask: jax.Array | None = None,  # [B, S] bool, False for padding (right padding)
    return_hidden: bool = False,
    layer_fetch: Callable | None = None,  # forward_paged's: each layer's weights in host memory copied in
):  # [B, S, V] fp32 logits, and with return_hidden the final-normed hidden states [B, S, D] (MTP's input)
    B, S = token_ids.shape
    cos, sin, mask = sequence_inputs(cfg, B, S, attention_mask)
    attend = {"expanded": mla.attend_expanded, "absorbed": mla.attend_absorbed_dense}[mla_form]
    h = params["embed"][token_ids]  # [B, S, D]

    for seg, seg_params in zip(layer_segments(cfg), params["segments"]):

        def body(h, lp, kind=seg.kind):
            lp = lp if layer_fetch is None else layer_fetch(lp)
            return decoder_layer(lp, cfg, kind, h, cos, sin, mask, attend, moe_impl), None

        h, _ = jax.lax.scan(body, h, seg_params)
    if not return_hidden:
        return _logits(params, cfg, h)
    normed = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    return linear(normed, params["lm_head"])[..., : cfg.vocab_size].astype(jnp.float32), normed


def paged_attention(
    q_lat, q_pe, kv_cache, layer, meta: StepMetadata, scale: float, attn_impl: str
) -> jax.Array:
    """Dispatch the absorbed paged attention to a kernel or its reference (same semantics).
    The whole cache goes in with a layer index: slicing one layer out would copy it."""
    if attn_impl == "reference":
        return paged_mla_attention_reference(
            q_lat, q_pe, kv_cache, layer, meta.seq_ids, meta.positions, meta.page_table, scale
        )
    if attn_impl in ("pallas", "pallas_interpret"):
        from deepinfer_jax.kernels import mla_decode, mla_prefill

        if decode_kernel_step(meta):
            kernel = functools.partial(mla_decode.paged_mla_attention, pages_per_step=mla_decode.PAGES_PER_STEP)
        else:
            kernel = mla_prefill.paged_mla_prefill_attention
        return kernel(
            q_lat, q_pe, kv_cache, layer, meta.seq_ids, meta.positions, meta.page_table, scale,
            interpret=attn_impl == "pallas_interpret",
        )
    raise ValueError(f"attn_impl {attn_impl!r} is not one of 'reference', 'pallas', 'pallas_interpret'")


def write_and_attend(q_lat, q_pe, latent, kv_cache, layer, meta: StepMetadata, scale: float, attn_impl: str):
    """Write this step's latents [T, R + dr] into their cache slots, then attend over the paged cache.
    -> (o_lat [T, H, R], kv_cache)."""
    kv_cache = write_latents(kv_cache, layer, meta, latent)
    return paged_attention(q_lat, q_pe, kv_cache, layer, meta, scale, attn_impl), kv_cache


def write_latents(kv_cache, layer, meta: StepMetadata, latent):
    """This step's latents [T, R + dr] into their cache slots (meta.slot_mapping) of layer `layer`."""
    return write_slots(kv_cache, layer, meta.slot_mapping, latent)


def write_and_attend_sharded(mr: MeshRules, q_lat, q_pe, latent, kv_cache, layer, meta: StepMetadata,
                             scale: float, attn_impl: str):
    """write_and_attend per device under shard_map: each data rank sees its own tokens, sequence rows
    and cache pages (the metadata are rank-local: page ids and seq_ids index the local shards), each
    tensor rank its own heads. The latent cache is one head wide, so it is replicated over the heads
    axes and every head rank writes the same latents."""
    tok = mr.spec(("tokens",))[0]
    heads = mr.spec(("tokens", "heads", None))
    meta_specs = StepMetadata(token_ids=P(tok), positions=P(tok), seq_ids=P(tok), slot_mapping=P(tok),
                              page_table=mr.spec(("seqs", None)), logits_indices=mr.spec(("seqs",)))
    cache = mr.spec(("layers", "pages", None, "kv_latent"))
    fn = jax.shard_map(
        lambda ql, qp, lat, c, li, m: write_and_attend(ql, qp, lat, c, li, m, scale, attn_impl),
        mesh=mr.mesh, in_specs=(heads, heads, mr.spec(("tokens", None)), cache, P(), meta_specs),
        out_specs=(heads, cache), check_vma=attn_impl == "reference")
    return fn(q_lat, q_pe, latent, kv_cache, layer, meta)


def attention_inputs(p: dict, cfg: ModelConfig, x, cos, sin, kv_cache, li, j, meta: StepMetadata, absorb_kv_b,
                     latent_norm, attn_impl: str, merged_qkv: bool = False, absorbed: bool = True):
    """The attention's inputs from x [T, D]: (q_nope [T, H, dn] or None, q_lat [T, H, R], q_pe [T, H, dr] roped,
    latent [T, R + dr] in the cache's dtype or None, kv_cache). Where the absorb launch writes the latents
    (`latent_norm`: `decode_latent_weights`), latent is None and the returned cache holds them; with `merged_qkv`
    (`merged_qkv_applies`) that launch reads the q / kv_a projections in place out of one XLA GEMM's output, and
    q_nope is None (no decode path reads it). `li`: the cache's layer, `j`: the layer in the segment's stacked
    weights. absorbed=False (the split prefill attention, which absorbs the query only where it needs to): q_lat
    is None."""
    interpret, dn = attn_impl == "pallas_interpret", cfg.qk_nope_head_dim
    if merged_qkv:
        from deepinfer_jax.kernels import mla_absorb

        q_lat, q_pe, kv_cache = mla_absorb.absorb_query_write_latents(
            mla.project_qkv_merged(p, cfg, x), absorb_kv_b, j, cos, sin, None, latent_norm, kv_cache, li,
            meta.slot_mapping, dn=dn, eps=cfg.latent_norm_eps, interpret=interpret)
        return None, q_lat, q_pe, None, kv_cache
    written = latent_norm is not None
    q_nope, q_pe, c_kv, k_pe = mla.project_qkv(p, cfg, x, cos, sin, whole_q=absorb_kv_b is not None,
                                               raw_latent=written)
    latent = None if written else to_cache_dtype(jnp.concatenate([c_kv, k_pe], axis=-1), kv_cache.dtype)  # [T, R + dr]
    if absorb_kv_b is None:
        return q_nope, mla.absorb_query(p, cfg, q_nope) if absorbed else None, q_pe, latent, kv_cache
    from deepinfer_jax.kernels import mla_absorb

    # q_nope holds the whole unroped q [T, H, dn + dr]: the kernel absorbs its nope part, rotates its rope part.
    kw = dict(dn=dn, interpret=interpret)
    if written:  # c_kv holds the raw kv_a rows [T, R + dr]: normed, roped and cached in place
        q_lat, q_pe, kv_cache = mla_absorb.absorb_query_write_latents(
            q_nope, absorb_kv_b, j, cos, sin, c_kv, latent_norm, kv_cache, li, meta.slot_mapping,
            eps=cfg.latent_norm_eps, **kw)
    else:
        q_lat, q_pe = mla_absorb.absorb_query(q_nope, absorb_kv_b, j, cos, sin, **kw)
    return q_nope[..., :dn], q_lat, q_pe, latent, kv_cache


def run_layers(body, carry, scanned: dict, layer_ids: np.ndarray, local_ids: np.ndarray, unroll: int | bool | str,
               layer_fetch: Callable | None = None):
    """The segment's layers: `body(carry, (layer params, layer index, index in the segment)) -> (carry, y)`
    over the stacked `scanned` params -> (carry, ys stacked over the layers, or None).

    `layer_fetch`: where `scanned` holds arrays in host memory (--cpu-offload-gb), the function that copies a
    layer's slice of them to the device (runner/weight_offload.py `to_device`). Its layers then run under
    `lax.scan` whatever `unroll` says, each iteration copying its own slice in: a loop over host arrays whose body
    moves its slice to the device is the parameter-streaming form XLA's host offloading schedules as one
    layer's copy at a time (a step then holds one layer's offloaded bytes, not the segment's).

    unroll an int or True: `lax.scan` with that unroll (True: straight-line layers whose weight slices and
    indices are constants, so each layer's fusions are distinct HLO that XLA compiles and autotunes on
    its own). "indexed": straight-line layers too, but each reads its weights by a layer index that XLA
    cannot see through (one scalar each out of an optimization barrier), so every layer's fusions are the
    same HLO: compiled and autotuned once, like the scanned body, with no while loop in the program. Its
    layers call one jitted `body`, traced once (twice where the first layer's carry differs in structure)
    and lowered to one function that each layer calls: XLA inlines the calls, so the program is the
    straight-line one, but tracing and lowering no longer grow with the depth (8 such forwards of V2-Lite's
    26 layers were most of `serve`'s warm-up tracing, benchmarks/RESULTS.md)."""
    if layer_fetch is not None and holds_host(scanned) and len(layer_ids) == 1:
        # A one-layer segment copies its (one-layer) stack in whole: XLA drops a one-trip loop, and the slice of a
        # host array it leaves becomes a bitcast across memory spaces that GPU compilation rejects.
        scanned, layer_fetch = layer_fetch(scanned), None
    if layer_fetch is not None and holds_host(scanned):
        def streamed(carry, xs, body=body):
            lp, li, j = xs
            return body(carry, (layer_fetch(lp), li, j))

        return jax.lax.scan(streamed, carry, (scanned, layer_ids, local_ids))
    if unroll != "indexed":
        return jax.lax.scan(body, carry, (scanned, layer_ids, local_ids), unroll=unroll)
    ids = jax.lax.optimization_barrier(tuple(jnp.asarray(i) for i in (*layer_ids, *local_ids)))
    n = len(layer_ids)
    layer = jax.jit(body)
    ys = []
    for li, j in zip(ids[:n], ids[n:]):
        # The layer's index passes a barrier with the previous layer's outputs: its weight slices are copied out in
        # turn, one layer's at a time, not all of them up front.
        (li, j), carry = jax.lax.optimization_barrier(((li, j), carry))
        lp = jax.tree.map(lambda a, j=j: jax.lax.dynamic_index_in_dim(a, j, keepdims=False), scanned)
        carry, y = layer(carry, (lp, li, j))
        ys.append(y)
    return carry, (None if ys[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys))


def forward_paged(
    params: dict,
    cfg: ModelConfig,
    kv_cache: jax.Array,  # [L, P, page_size, R + dr (+ Di with DSA)]
    meta: StepMetadata,
    *,
    moe_impl: str = "ragged",
    attn_impl: str = "reference",
    return_routing: bool = False,
    unroll: int | bool = 1,
    mesh_rules: MeshRules | None = None,
    fuse_shared_experts: bool = False,
    fuse_moe_routing: bool = False,
    prefill_attention: str = "expanded",
    decode_projection_kernel: bool = False,
    decode_output_kernel: bool = False,
    decode_absorb_kernel: bool = False,
    decode_latent_kernel: bool = False,
    moe_single_launch: bool = False,
    decode_route_launch: bool = False,
    decode_moe_launch: bool = False,
    decode_moe_launch_tokens: tuple[int, ...] | None = None,
    decode_moe_shared_tiles: tuple[int, int, int] | None = None,
    decode_merged_qkv: bool = False,
    moe_prefill_mosaic: bool = False,
    stage: PipelineStage | None = None,
    hidden: jax.Array | None = None,
    return_hidden: bool = False,
    layer_fetch: Callable | None = None,
):
    """-> (logits [S, V] fp32, updated kv_cache), plus, with return_routing, the routed expert ids of
    every MoE layer [num_moe_layers, T, k] (benchmarks use them to prove routing is realistic), and last, with
    return_hidden, the final-normed hidden states of every slot [T, D] (the MTP's input: models/mtp.py).
    `unroll`: lax.scan's unroll (True = straight-line layers, which lets XLA put a whole step in one
    command buffer on GPU at the cost of compile time), or "indexed" (`run_layers`: straight-line layers
    compiled once). `mesh_rules`: run sharded (module docstring).
    `fuse_shared_experts`: where `moe.shared_into_kernels` allows, the shared MLP runs inside the
    Pallas expert kernels (read in place from its stacked weights) instead of as XLA GEMMs.
    `fuse_moe_routing`: where `moe.routing_into_kernels` allows, routing and alignment run in one kernel.
    `prefill_attention`: "expanded" splits a prefill-bucket step's attention on the Pallas path (one
    device) into the new tokens' chunk in the expanded form and the cached context, in the expanded form for runs
    of many new tokens and the absorbed form for the rest (models/mla_split.py); "absorbed" keeps the whole of it
    absorbed.
    `decode_projection_kernel`: where `decode_stacked` allows (decode-size steps on the Pallas path, one
    device), o_proj and the dense MLP read their layer's weights in place through
    kernels/decode_matmul.py instead of XLA's GEMMs (`STACKABLE`).
    `decode_output_kernel`: where `decode_value_weights` allows, the decode attention's context splits
    are merged and W_UV applied in one kernel (kernels/mla_output.py).
    `decode_absorb_kernel`: where `decode_absorb_weights` allows, the query is absorbed through W_UK and
    its rope part rotated in one kernel reading q and W_UK in place (kernels/mla_absorb.py).
    `decode_latent_kernel`: where `decode_latent_weights` allows (the absorb kernel's steps), the same kernel
    launch also applies kv_a_layernorm and RoPE to the latents and writes them into the cache in place.
    `moe_single_launch`: where the routing runs in its kernel, the two expert kernels run in one launch, each
    row block's down tiles waiting on its gate_up tiles (kernels/moe_gmm.py `single_launch`).
    `decode_route_launch`: where `decode_route_weights` allows, o_proj's split-K partials go to the residual,
    the post-attention RMSNorm, the router's logits and the routing in one launch (kernels/residual_route.py).
    `decode_moe_launch`: where `decode_moe_launch_applies` allows, that launch also runs the expert kernels'
    single launch, the shared experts' tiles streaming while the routing runs (kernels/route_experts.py);
    `decode_moe_launch_tokens`: the step sizes (token slots) it runs at (None: any); `decode_moe_shared_tiles`: its
    shared experts' tiles (route_experts' `shared_tiles`).
    `decode_merged_qkv`: where `merged_qkv_applies` allows, the q / kv_a projections are one
    GEMM (`mla.project_qkv_merged`) whose output the absorb and latent launch reads in place.
    `moe_prefill_mosaic`: MoE steps of prefill size run the expert GEMMs on Mosaic GPU (kernels/moe_gmm_mgpu.py;
    moe.moe_block `mosaic`).
    `stage`: one pipeline stage (models/pipeline.py): `params` and `kv_cache` are the stage's, the first stage
    embeds the token ids, the others start from `hidden` [T, D] (the stage before's output), and a stage other
    than the last returns (hidden [T, D] after its layers, kv_cache) instead of the logits.
    `layer_fetch`: where layer weights live in host memory (--cpu-offload-gb, runner/weight_offload.py), the function
    that copies one layer's slice of them to the device inside the layer loop (`run_layers`); such a weight is
    never read in place from its stack by a kernel (`_on_device`)."""
    if cfg.has_indexer:
        dsa.check_paged_support(attn_impl, mesh_rules)
    cos, sin = rope_cos_sin(cfg, meta.positions)  # [T, dr/2]
    split_plan = chunk_split_plan(cfg, meta, attn_impl, mesh_rules, prefill_attention)
    h = params["embed"][meta.token_ids] if stage is None or stage.first else hidden  # [T, D]
    routing: list[jax.Array] = []
    segments = layer_segments(cfg) if stage is None else [s.local for s in stage_segments(cfg, stage)]

    for seg, seg_params in zip(segments, params["segments"]):
        # Expert weights stay stacked outside the scan and go to the MoE with the layer's index:
        # slicing them per iteration would copy ~1 GB per layer into a buffer for the kernel. In host memory
        # (`layer_fetch`) they are sliced and copied in per layer like the scanned params (`_on_device`).
        experts = _on_device(seg_params["moe"]["experts"]) if seg.kind == "moe" else None
        scanned = seg_params
        if experts is not None:
            stacked = ("experts",)
            if (fuse_shared_experts and _on_device(seg_params["moe"].get("shared")) is not None
                    and shared_into_kernels(seg_params["moe"], moe_impl, mesh_rules, meta.token_ids.shape[0])):
                experts, stacked = {**experts, "shared": seg_params["moe"]["shared"]}, ("experts", "shared")
            scanned = {**seg_params, "moe": {k: v for k, v in seg_params["moe"].items() if k not in stacked}}
        T = meta.token_ids.shape[0]
        projections = decode_stacked(seg_params, T, attn_impl, mesh_rules, decode_projection_kernel)
        # under a mesh: FP8 projections through the FP8 GEMM on each device's slice (models/fp8_parallel.py)
        splits = decode_stacked_splits(seg, seg_params, cfg, T, attn_impl, mesh_rules, decode_projection_kernel)
        projections.update({k: seg_params[k[0]][k[1]] for k in splits})
        projections = {k: w for k, w in projections.items() if _on_device(w) is not None}
        # kv_b_proj also stays in the scanned params: absorb_query reads each layer's W_UK from it.
        value_kv_b = _on_device(decode_value_weights(seg_params, cfg, meta, attn_impl, mesh_rules, split_plan,
                                                     decode_output_kernel))
        absorb_kv_b = _on_device(decode_absorb_weights(seg_params, cfg, meta, attn_impl, mesh_rules, split_plan,
                                                       decode_absorb_kernel))
        latent_norm = _on_device(decode_latent_weights(seg_params, cfg, meta, absorb_kv_b, decode_latent_kernel))
        merged_qkv = merged_qkv_applies(seg_params, cfg, latent_norm, decode_merged_qkv)
        route_w = None if seg.kind == "moe" and experts is None else _on_device(decode_route_weights(
            seg, seg_params, cfg, projections, experts, meta.token_ids.shape[0], moe_impl, mesh_rules,
            fuse_moe_routing, decode_route_launch))
        moe_launch = decode_moe_launch_applies(route_w, seg_params, experts, moe_single_launch, decode_moe_launch,
                                               meta.token_ids.shape[0], decode_moe_launch_tokens)
        for group, name in projections:  # read in place from the stacked weights, not sliced by the scan
            scanned = {**scanned, group: {k: v for k, v in scanned[group].items() if k != name}}

        def body(carry, xs, kind=seg.kind, experts=experts, projections=projections, value_kv_b=value_kv_b,
                 absorb_kv_b=absorb_kv_b, latent_norm=latent_norm, route_w=route_w, merged_qkv=merged_qkv,
                 moe_launch=moe_launch, splits=splits):
            h, cache = carry
            lp, li, j = xs
            for (group, name), w in projections.items():  # read in place by the decode kernel
                lp = {**lp, group: {**lp[group], name: StackedWeight(w, j, attn_impl == "pallas_interpret",
                                                                     splits.get((group, name)))}}
            x = rms_norm(h, lp["input_layernorm"], cfg.rms_norm_eps)
            if cfg.has_indexer:  # DeepSeek Sparse Attention (models/dsa.py)
                a, cache = dsa.write_and_attend_sparse(lp["attn"], cfg, x, cos, sin, cache, li, meta,
                                                       attn_impl)  # [T, H, dv]
            else:
                q_nope, q_lat, q_pe, latent, cache = attention_inputs(
                    lp["attn"], cfg, x, cos, sin, cache, li, j, meta, absorb_kv_b, latent_norm, attn_impl, merged_qkv,
                    absorbed=split_plan is None)
                written = latent is None  # the absorb kernel's launch wrote this step's latents into the cache
                if split_plan is not None:
                    cache = write_latents(cache, li, meta, latent)
                    a = attend_split(lp["attn"], cfg, q_nope, q_pe, latent, cache, li, meta, split_plan,
                                     attn_impl)  # [T, H, dv]
                elif value_kv_b is not None:
                    if not written:
                        cache = write_latents(cache, li, meta, latent)
                    a = decode_attention_output(q_lat, q_pe, cache, li, meta, cfg, value_kv_b, j, attn_impl)
                else:
                    if written:  # one device (decode_latent_weights)
                        o_lat = paged_attention(q_lat, q_pe, cache, li, meta, cfg.softmax_scale, attn_impl)
                    elif mesh_rules is None:
                        o_lat, cache = write_and_attend(q_lat, q_pe, latent, cache, li, meta, cfg.softmax_scale,
                                                        attn_impl)
                    else:
                        o_lat, cache = write_and_attend_sharded(mesh_rules, q_lat, q_pe, latent, cache, li, meta,
                                                                cfg.softmax_scale, attn_impl)
                    a = mla.absorbed_output(lp["attn"], cfg, o_lat)  # [T, H, dv]
            routed, m = None, None
            if route_w is not None:  # o_proj's partials to the routing, one launch
                parts = oproj_partials(a, lp["attn"]["o_proj"])
                if moe_launch:  # ... and on to the experts' rows in the same launch
                    h, x, m, idx = route_experts_step(parts, h, route_w, j, lp, cfg, experts,
                                                      moe_impl == "pallas_interpret", decode_moe_shared_tiles)
                else:
                    h, x, routed = residual_route_step(parts, h, route_w, j, lp, cfg, experts,
                                                       attn_impl == "pallas_interpret")
            else:
                h = h + mla.output_projection(lp["attn"], a)
                x = rms_norm(h, lp["post_attention_layernorm"], cfg.rms_norm_eps)
            if kind == "dense":
                return (h + swiglu_mlp(x, lp["mlp"]), cache), None
            if m is None:
                m, idx = moe_block(lp["moe"], cfg, x, moe_impl, return_routing=True, experts=experts,
                                   layer=None if experts is None else j,
                                   mesh_rules=mesh_rules, fuse_routing=fuse_moe_routing,
                                   single_launch=moe_single_launch, routed=routed, mosaic=moe_prefill_mosaic)
            return (h + m, cache), (idx if return_routing else None)

        # numpy, not jnp: literal constants, which XLA folds into each unrolled layer's scalar operands.
        # jnp.arange is an iota, and each layer's index then took a kernel to compute (two a layer,
        # ~0.9 us each on an H200).
        layer_ids = np.arange(seg.start, seg.stop, dtype=np.int32)
        local_ids = np.arange(seg.num_layers, dtype=np.int32)
        (h, kv_cache), ys = run_layers(body, (h, kv_cache), scanned, layer_ids, local_ids, unroll, layer_fetch)
        if ys is not None:
            routing.append(ys)
    if stage is not None and not stage.last:  # the next stage's input (no routing: the runner does not collect it)
        return h, kv_cache
    out = (_logits(params, cfg, h[meta.logits_indices], mesh_rules), kv_cache)  # [S, V]: each sequence's last token
    if return_routing:
        out += (jnp.concatenate(routing, axis=0),)
    if return_hidden:
        out += (rms_norm(h, params["final_norm"], cfg.rms_norm_eps),)
    return out
