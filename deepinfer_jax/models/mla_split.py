"""A prefill step's MLA attention split by key set (kernels/mla_chunk.py, kernels/mla_context.py,
kernels/mla_prefill.py): each token against the new tokens of its own chunk in the expanded form, and against
the cached context before its chunk in the expanded form (runs of many new tokens: `CONTEXT_MIN_QUERIES`) or the
absorbed form (the rest); the parts merged by log-sum-exp. One layer's attention of an 8,192-token chunk over 8K-120K
cached tokens ran 2.9-4.6x faster with the context expanded than absorbed on an H100 (benchmarks/prefill_context.py,
benchmarks/RESULTS.md).

Pure functions of the layer's params and the step's metadata, called from models/deepseek.py's layer body on
the Pallas path on one device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models import mla
from deepinfer_jax.models.cache import StepMetadata
from deepinfer_jax.models.decode_kernels import decode_kernel_step, pallas_one_device
from deepinfer_jax.models.layers import weight
from deepinfer_jax.models.parallel import MeshRules

# Query block of the expanded chunk and context attention: 64 tokens x one head per program.
CHUNK_BLOCK_Q = 64
# A run (a sequence's new tokens in the step) of at least this many tokens attends to its cached context in the
# expanded form: up-projecting a context token pays back from 171 query tokens on (kernels/mla_context.py).
CONTEXT_MIN_QUERIES = 256
PREFILL_ATTENTION = ("expanded", "absorbed")


def splits_prefill_attention(cfg: ModelConfig, attn_impl: str, mesh_rules: MeshRules | None,
                             prefill_attention: str) -> bool:
    """Whether prefill-bucket steps take the split attention (`attend_split`): "expanded" on the Pallas path, one
    device, head dims the chunk kernel supports; never with sparse attention
    (models/dsa.py), whose steps attend to their selected keys alike at every size."""
    from deepinfer_jax.kernels import mla_chunk

    if prefill_attention not in PREFILL_ATTENTION:
        raise ValueError(f"prefill_attention {prefill_attention!r} is not one of {', '.join(PREFILL_ATTENTION)}")
    return (prefill_attention == "expanded" and not cfg.has_indexer and pallas_one_device(attn_impl, mesh_rules)
            and mla_chunk.supported(cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                    interpret=attn_impl == "pallas_interpret"))


def chunk_split_plan(cfg: ModelConfig, meta: StepMetadata, attn_impl: str, mesh_rules: MeshRules | None,
                     prefill_attention: str):
    """For a prefill-bucket step where `splits_prefill_attention`: the step-wide inputs of the split
    prefill attention (`attend_split`): (run_start [T], query blocks, visible_to [T], their block_q, the
    expanded context's (picked [T], cu [S + 1]) of `mla_context.plan` or None); else None."""
    from deepinfer_jax.kernels import mla_context, mla_prefill

    T, S = meta.token_ids.shape[0], meta.page_table.shape[0]
    if not splits_prefill_attention(cfg, attn_impl, mesh_rules, prefill_attention) or decode_kernel_step(meta):
        return None
    rs = mla_prefill.run_starts(meta.seq_ids, meta.positions)
    bq = mla_prefill.effective_block_q(T, CHUNK_BLOCK_Q)
    blocks = mla_prefill.query_blocks(meta.seq_ids, meta.positions, bq, mla_prefill.num_query_blocks_bound(T, S, bq))
    ctx = None
    if T >= CONTEXT_MIN_QUERIES:
        ctx = mla_context.plan(meta.seq_ids, meta.positions, rs, S, CONTEXT_MIN_QUERIES)
    return rs, blocks, meta.positions[rs] - 1, bq, ctx


def attend_split(p: dict, cfg: ModelConfig, q_nope, q_pe, latent, kv_cache, layer, meta: StepMetadata, plan,
                 attn_impl: str) -> jax.Array:
    """Prefill attention in parts: each token against the new tokens of its own chunk in the expanded form
    (keys and values rebuilt from this step's latents), against the cached context before its chunk in the
    expanded form where the plan picked its run (the context's latents up-projected window by window, continuing
    the chunk part's softmax state) and in the absorbed form otherwise; merged by log-sum-exp.
    latent [T, R + dr] as written to the cache; kv_cache already holds it. -> [T, H, dv] in q's dtype.

    The context parts (the query's absorption through W_UK, the context kernels, W_UV, the merge) run only
    where some token of the step has cached context (`jax.lax.cond` on the device): a step of fresh prompts
    takes the chunk part alone, normalised in the kernel, which is what the merge gives when the context
    kernel saw no key (o = 0, m = NEG, l = 0: weights 1 and 0, exactly; `mla_chunk.normalise`). On an H200
    the context part cost a Protocol A prefill step ~10 ms of its 166 (benchmarks/RESULTS.md). The price: XLA's
    GPU runtime reads each layer's predicate on the host, so the host enqueues a layer only once the one before
    has run and queues the next step only when this one ends (1-2 ms of a Protocol A run; in serving, no overlap
    of the engine's bookkeeping with a prefill-bucket step). Where the host gives
    `meta.has_context` (RunnerConfig.prefill_context_variant), its program takes the one branch it names."""
    from deepinfer_jax.kernels import mla_chunk, mla_context, mla_prefill

    rs, blocks, visible_to, bq, ctx = plan
    interpret = attn_impl == "pallas_interpret"
    R, scale = cfg.kv_lora_rank, cfg.softmax_scale
    c_kv, k_pe = latent[:, :R].astype(q_nope.dtype), latent[:, R:].astype(q_nope.dtype)

    def up_project(c):  # [N, R] -> [N, H, dn + dv]
        return jnp.einsum("tr,rhe->the", c, weight(p["kv_b_proj"], c.dtype))

    chunk = functools.partial(mla_chunk.chunk_attention, q_nope, q_pe, up_project(c_kv), k_pe, rs, blocks, scale,
                              block_q=bq, interpret=interpret)

    def with_context():
        state, absorbed_visible = chunk(), visible_to
        if ctx is not None:
            picked, cu = ctx
            H, dn, dv = q_nope.shape[1], q_nope.shape[2], cfg.v_head_dim
            state = mla_context.expanded_context(
                q_nope, q_pe, kv_cache, layer, meta.page_table, meta.seq_ids, picked, cu, blocks, up_project,
                scale, state, block_q=bq, window=mla_context.window_size(H, dn + dv, q_nope.dtype.itemsize),
                interpret=interpret)
            absorbed_visible = jnp.where(picked, -1, visible_to)
        acc, m1, l1 = state
        q_lat = mla.absorb_query(p, cfg, q_nope)  # [T, H, R]
        o_ctx, m2, l2 = mla_prefill.paged_mla_prefill_attention(
            q_lat, q_pe, kv_cache, layer, meta.seq_ids, meta.positions, meta.page_table, scale,
            visible_to=absorbed_visible, return_lse=True, interpret=interpret)
        o_ctx = mla.absorbed_output(p, cfg, o_ctx)  # [T, H, dv]
        return mla_chunk.merge_with_context(acc, m1, l1, o_ctx, m2, l2).astype(q_nope.dtype)

    if meta.has_context is not None:  # known on the host: no branch on the device
        return with_context() if meta.has_context else chunk(out_dtype=q_nope.dtype)
    return jax.lax.cond(jnp.any(visible_to >= 0), with_context, lambda: chunk(out_dtype=q_nope.dtype))
