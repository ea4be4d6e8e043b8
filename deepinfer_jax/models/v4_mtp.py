"""DeepSeek-V4's MTP layer in the paged engine (`deepseek_mtp` speculation, docs/speculative.md, docs/v4.md).

DeepSeek's MTPBlock (the V4 inference reference): at position i the main model's last residual streams
[n, D] (before the hyper head) and the token at i + 1 give the block's input streams
    x = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(streams_i))      (the first term added to every stream)
then one V4 block (hyper-connections, attention of the layer's kind, a scored MoE) as layer num_hidden_layers + j,
and logits of t_{i+2} = lm_head(norm(hyper_head(x))) with the MTP's own hyper head and norm and the main model's
embedding and head (`models/deepseek_v4.py`: v4_mtp_input, v4_mtp_logits; the whole-sequence reference
v4_mtp_forward). A chained pass takes the block's output streams as its hidden state, as vLLM chains V3's MTP.

Its rows live in the per-group cache as layer num_hidden_layers + j of every group its kind uses
(`V4Config.mtp_in_cache`, `v4_cache_groups`), at the same slots as the target's tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.cache import NULL_PAGE, StepMetadata
from deepinfer_jax.models.deepseek_v4 import v4_mtp_input, v4_mtp_logits
from deepinfer_jax.models.mtp import first_pass_inputs
from deepinfer_jax.models.v4_paged import GroupCache, paged_block, step_cache


def v4_mtp_layer_paged(params: dict, cfg: ModelConfig, cache: GroupCache, meta: StepMetadata, streams: jax.Array,
                       next_ids: jax.Array, attn_impl: str, moe_impl: str, j: int = 0,
                       mesh_rules: Any = None) -> jax.Array:
    """One MTP pass over a ragged step: streams [T, n, D] (the target's last streams, or the MTP's own output when
    chained) and next_ids [T] (the token after each slot) -> the block's output streams [T, n, D], its rows
    written into `cache` as layer num_hidden_layers + j. `mesh_rules`: the routed experts over the mesh, as the main
    layers' (v4_paged.check_layout)."""
    v4, mp = cfg.v4, params["mtp"][j]
    x = v4_mtp_input(v4, mp, params["embed"], streams, next_ids)
    return paged_block(v4, v4.num_hidden_layers + j, mp["layer"], x, cache,
                       dataclasses.replace(meta, token_ids=next_ids), attn_impl, moe_impl, mesh_rules)


def _one_token_groups(cache: GroupCache, meta: StepMetadata, pos: jax.Array, ok: jax.Array) -> tuple:
    """Per group, (page table, slot [S]) of one token a sequence row at positions pos [S]: the row's slot where it
    writes one (ok, a compressed group's window closes, the page is in the table; a windowed group's ring column),
    else the null page."""
    out, seq = [], jnp.arange(pos.shape[0])
    for gi, (g, (table, _)) in enumerate(zip(cache.groups, meta.groups)):
        w, r = pos // g.tokens_per_row, cache.rows[gi]
        inside = ok & ((pos + 1) % g.tokens_per_row == 0)
        if g.window_tokens is None:
            inside &= w // r < table.shape[1]
        page = cache.pages(gi, table, seq, w[:, None])[0][:, 0]
        out.append((table, jnp.where(inside, page * r + w % r, NULL_PAGE * r).astype(jnp.int32)))
    return tuple(out)


def v4_mtp_propose(params: dict, cfg: ModelConfig, kv_cache: tuple, meta: StepMetadata, streams: jax.Array,
                   sampled: jax.Array, accepted: jax.Array, num_drafts: int, *, attn_impl: str = "reference",
                   moe_impl: str = "ragged", mesh_rules: Any = None):
    """models/mtp.py `mtp_propose` for V4: pass 1 over every slot of the verified step (the token after each slot
    the next slot's, or the emitted one at the last accepted position p_r), draft 1 from its output at p_r; passes
    2..K one slot a row at p_r + k - 1 on the previous pass's output streams and draft. -> (drafts [S, K] int32,
    the pools). A chained position's slots are its pages' where allocated, else the null page's (a draft's quality
    only: the target verifies every draft). `mesh_rules`: the routed experts over the mesh (v4_paged.check_layout)."""
    v4 = cfg.v4
    cache = step_cache(cfg, kv_cache, meta)
    last_slot, nxt = first_pass_inputs(meta, sampled, accepted, num_drafts)
    h = v4_mtp_layer_paged(params, cfg, cache, meta, streams, nxt, attn_impl, moe_impl,
                           mesh_rules=mesh_rules)[last_slot]  # [S, n, D]
    first = jnp.argmax(v4_mtp_logits(v4, params, h), axis=-1).astype(jnp.int32)  # [S]
    if num_drafts == 1:
        return first[:, None], tuple(cache.arrays)
    S = first.shape[0]
    base, live = meta.positions[last_slot], meta.next_token_ids == -1  # p_r; rows that sample (others' unused)

    def chained(carry, k):  # pass k + 1: position p_r + k (one compiled body for passes 2..K)
        h, arrays, prev = carry
        pos = base + k
        c = GroupCache(v4, arrays, cache.ps)
        step = StepMetadata(token_ids=prev, positions=pos, seq_ids=jnp.arange(S, dtype=jnp.int32),
                            slot_mapping=jnp.zeros_like(pos), page_table=meta.page_table,
                            logits_indices=jnp.arange(S, dtype=jnp.int32),
                            groups=_one_token_groups(c, meta, pos, live))
        h = v4_mtp_layer_paged(params, cfg, c, step, h, prev, attn_impl, moe_impl, mesh_rules=mesh_rules)
        d = jnp.argmax(v4_mtp_logits(v4, params, h), axis=-1).astype(jnp.int32)
        return (h, tuple(c.arrays), d), d

    (_, arrays, _), rest = jax.lax.scan(chained, (h, tuple(cache.arrays), first),
                                        jnp.arange(1, num_drafts, dtype=jnp.int32))
    return jnp.concatenate([first[:, None], rest.T], axis=1), arrays
