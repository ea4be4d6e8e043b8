"""DeepSeek-V3 multi-token prediction (MTP) module as a pure function, usable under `jax.jit` / `jax.grad`.

MTP module j (params["mtp"][j], see params.py) predicts the token two places ahead. At position i it
combines the main model's hidden state there with the embedding of the token at i+1 (DeepSeek-V3
report §2.2; the layout of vLLM's and SGLang's deepseek_mtp):

    h'_i  = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])      concat order: embedding first
    h''   = one decoder layer (causal attention over the h' sequence, positions 0..S-1)
    logits_i = lm_head(shared_head_norm(h''_i))                -> distribution of t_{i+2}

`h_i` is the main model's final-normed hidden state (`forward(..., return_hidden=True)`), as vLLM and
SGLang hand it to the draft. The embedding and the output head are the main model's (DeepSeek-V3 shares
them; checkpoints' `shared_head.head` / per-layer `embed_tokens` copies are not loaded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models import mla
from deepinfer_jax.models.cache import NULL_PAGE, StepMetadata
from deepinfer_jax.models.deepseek import (attention_inputs, decoder_layer, sequence_inputs, write_and_attend,
                                            write_and_attend_sharded)
from deepinfer_jax.models.layers import linear, rms_norm, rope_cos_sin, swiglu_mlp
from deepinfer_jax.models.moe import moe_block
from deepinfer_jax.models.parallel import MeshRules


def mtp_forward(
    params: dict,
    cfg: ModelConfig,
    hidden: jax.Array,  # [B, S, D] main model's final-normed hidden states
    next_ids: jax.Array,  # [B, S] int32: the token at position i+1 (anything at the last position)
    *,
    j: int = 0,
    moe_impl: str = "ragged",
    attention_mask: jax.Array | None = None,  # [B, S] bool, False for padding
    return_hidden: bool = False,
):  # [B, S, V] fp32: logits of the token at i+2; with return_hidden also h'' [B, S, D] (the chained MTP's input)
    mp = params["mtp"][j]
    B, S = next_ids.shape
    eps = cfg.rms_norm_eps
    e = rms_norm(params["embed"][next_ids], mp["enorm"], eps)  # [B, S, D]
    x = jnp.concatenate([e, rms_norm(hidden.astype(e.dtype), mp["hnorm"], eps)], axis=-1)  # [B, S, 2D]
    h = linear(x, mp["eh_proj"])  # [B, S, D]
    cos, sin, mask = sequence_inputs(cfg, B, S, attention_mask)
    kind = "moe" if cfg.n_routed_experts else "dense"
    h = decoder_layer(mp["layer"], cfg, kind, h, cos, sin, mask, mla.attend_expanded, moe_impl)
    logits = linear(rms_norm(h, mp["shared_head_norm"], eps), params["lm_head"])[..., : cfg.vocab_size]
    return (logits.astype(jnp.float32), h) if return_hidden else logits.astype(jnp.float32)


# ---- the paged MTP of speculative decoding (docs/speculative.md, `deepseek_mtp`) -------------------------------
# Its attention KV is one more layer of the paged cache: layer num_hidden_layers + j of the same pages, at the
# same slots as the target's (MTP position i: the target's hidden state at i and the token at i + 1).
# Sharded (`mesh_rules`), it runs as the target's layers do (models/deepseek.py): the cache write and attention
# under shard_map (rank-local metadata with data-parallel attention, heads over the tensor axes), the experts
# through the mesh's dispatch; the MTP's params carry the layout of a target layer (models/params.py).


def mtp_layer_paged(params: dict, cfg: ModelConfig, kv_cache: jax.Array, meta: StepMetadata, hidden: jax.Array,
                    next_ids: jax.Array, *, attn_impl: str = "reference", moe_impl: str = "ragged", j: int = 0,
                    mesh_rules: MeshRules | None = None):
    """One MTP pass over a ragged step, as `mtp_forward` over a whole sequence: hidden [T, D] (the target's
    final-normed hidden state, or the MTP's own output when chained) and next_ids [T] (the token after each
    slot's) -> (the MTP layer's output h'' [T, D] before shared_head_norm, kv_cache with its latents written at
    meta.slot_mapping of cache layer num_hidden_layers + j)."""
    mp = params["mtp"][j]
    lp, eps, li = mp["layer"], cfg.rms_norm_eps, cfg.num_hidden_layers + j
    e = rms_norm(params["embed"][next_ids], mp["enorm"], eps)  # [T, D]
    h = linear(jnp.concatenate([e, rms_norm(hidden.astype(e.dtype), mp["hnorm"], eps)], axis=-1), mp["eh_proj"])
    cos, sin = rope_cos_sin(cfg, meta.positions)  # [T, dr/2]
    x = rms_norm(h, lp["input_layernorm"], eps)
    _, q_lat, q_pe, latent, kv_cache = attention_inputs(lp["attn"], cfg, x, cos, sin, kv_cache, li, 0, meta, None,
                                                        None, attn_impl)
    if mesh_rules is None:
        o_lat, kv_cache = write_and_attend(q_lat, q_pe, latent, kv_cache, li, meta, cfg.softmax_scale, attn_impl)
    else:
        o_lat, kv_cache = write_and_attend_sharded(mesh_rules, q_lat, q_pe, latent, kv_cache, li, meta,
                                                   cfg.softmax_scale, attn_impl)
    h = h + mla.output_projection(lp["attn"], mla.absorbed_output(lp["attn"], cfg, o_lat))
    x = rms_norm(h, lp["post_attention_layernorm"], eps)
    mlp = (moe_block(lp["moe"], cfg, x, moe_impl, mesh_rules=mesh_rules) if cfg.n_routed_experts
           else swiglu_mlp(x, lp["mlp"]))
    return h + mlp, kv_cache


def mtp_logits(params: dict, cfg: ModelConfig, h: jax.Array, j: int = 0) -> jax.Array:
    """The MTP's output h'' [..., D] -> fp32 logits [..., V] (shared_head_norm, the target's lm_head)."""
    logits = linear(rms_norm(h, params["mtp"][j]["shared_head_norm"], cfg.rms_norm_eps), params["lm_head"])
    return logits[..., : cfg.vocab_size].astype(jnp.float32)


def first_pass_inputs(meta: StepMetadata, sampled: jax.Array, accepted: jax.Array,
                      num_drafts: int) -> tuple[jax.Array, jax.Array]:
    """`mtp_propose`'s pass 1 (any family): (last_slot [S], the slot of each sequence row's last accepted position
    p_r; nxt [T], the token after each slot: the next slot's, the emitted one at p_r)."""
    S = meta.next_token_ids.shape[0]
    W, T, host_next = num_drafts + 1, meta.token_ids.shape[0], meta.next_token_ids
    acc = accepted.reshape(S, W).astype(jnp.int32)
    n_acc = jnp.sum(jnp.cumprod(acc, axis=1), axis=1)  # [S] leading accepted drafts
    rows = jnp.arange(S, dtype=jnp.int32) * W + n_acc
    last_slot = meta.logits_indices[rows]  # [S]
    emitted = jnp.where(host_next == -1, sampled[rows], host_next)  # [S] the token after p_r
    nxt = jnp.concatenate([meta.token_ids[1:], meta.token_ids[:1]])  # [T] the next slot's token
    return last_slot, nxt.at[jnp.where(host_next >= -1, last_slot, T)].set(emitted, mode="drop")


def mtp_propose(params: dict, cfg: ModelConfig, kv_cache: jax.Array, meta: StepMetadata, hidden: jax.Array,
                sampled: jax.Array, accepted: jax.Array, num_drafts: int, *, attn_impl: str = "reference",
                moe_impl: str = "ragged", mesh_rules: MeshRules | None = None):
    """After a verified step: the MTP consumes the step's positions and drafts `num_drafts` (K) tokens a sequence
    row, greedily, chained as vLLM's deepseek_mtp (one MTP layer reused). -> (drafts [S, K] int32, kv_cache).

    hidden [T, D]: the target's final-normed hidden states of the step's slots; sampled, accepted [S * W]: the
    sampler's rows (W = K + 1, row r * W + j verifies sequence r's draft j + 1; runner/inputs.py);
    meta.next_token_ids [S]: -1 where the row samples, the prompt's next token for a prefill chunk that does not
    sample, -2 for a padding row. With n_r accepted drafts, sequence r's last accepted position p_r is the slot
    logits_indices[r * W + n_r], and the token after it is the one the step emitted there.

    Pass 1 runs over every slot of the step: at slot t the token after it is the step's next slot's (the slot's
    own sequence's next input, for every slot up to p_r) or, at p_r, the emitted token (a chunk's last slot: the
    host's next prompt token). So the MTP's KV at all confirmed positions is written with the right inputs; slots
    past p_r (rejected drafts) get some token, and their KV is written again when those positions are confirmed.
    Its output at p_r gives draft 1. Pass k (2..K) is one slot a row at position p_r + k - 1: the MTP's own output
    of the previous pass as the hidden state, draft k - 1 as the token. Those positions' slots are in the
    sequence's pages where allocated, else in the null page (a draft's quality only, never the output: the
    target verifies every draft).

    With data-parallel attention (`mesh_rules` splitting "seqs" over R ranks) the step's rows and slots are laid
    out rank after rank (sharding/data_parallel.py) and the metadata are rank-local but for logits_indices: the
    gathers here index the whole step, and a chained pass's token r (one a row) is row r % (S / R) of its rank."""
    S, P = meta.page_table.shape
    ps, host_next = kv_cache.shape[2], meta.next_token_ids  # [S]
    last_slot, nxt = first_pass_inputs(meta, sampled, accepted, num_drafts)
    kw = dict(attn_impl=attn_impl, moe_impl=moe_impl, mesh_rules=mesh_rules)
    h, kv_cache = mtp_layer_paged(params, cfg, kv_cache, meta, hidden, nxt, **kw)
    h = h[last_slot]  # [S, D]
    first = jnp.argmax(mtp_logits(params, cfg, h), axis=-1).astype(jnp.int32)  # [S]
    if num_drafts == 1:
        return first[:, None], kv_cache
    base = meta.positions[last_slot]  # [S] p_r
    live = host_next == -1  # rows that sample: the others' drafts are never used
    ranks = 1 if mesh_rules is None else mesh_rules.size("seqs")
    local_rows = jnp.arange(S, dtype=jnp.int32) % (S // ranks)  # each row's index within its rank's rows

    def chained(carry, k):  # pass k + 1: position p_r + k (one compiled body for passes 2..K)
        h, kv_cache, prev = carry
        pos = base + k
        ok = live & (pos < P * ps)
        pos = jnp.where(ok, pos, base)
        page = jnp.take_along_axis(meta.page_table, (pos // ps)[:, None], axis=1)[:, 0]
        slot = jnp.where(ok, page * ps + pos % ps, NULL_PAGE * ps + pos % ps)
        step = StepMetadata(token_ids=prev, positions=pos, seq_ids=local_rows,
                            slot_mapping=slot, page_table=meta.page_table,
                            logits_indices=jnp.arange(S, dtype=jnp.int32))
        h, kv_cache = mtp_layer_paged(params, cfg, kv_cache, step, h, prev, **kw)
        d = jnp.argmax(mtp_logits(params, cfg, h), axis=-1).astype(jnp.int32)
        return (h, kv_cache, d), d

    (_, kv_cache, _), rest = jax.lax.scan(chained, (h, kv_cache, first), jnp.arange(1, num_drafts, dtype=jnp.int32))
    return jnp.concatenate([first[:, None], rest.T], axis=1), kv_cache
