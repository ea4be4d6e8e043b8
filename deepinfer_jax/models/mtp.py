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
from deepinfer_jax.models.deepseek import decoder_layer, sequence_inputs
from deepinfer_jax.models.layers import linear, rms_norm


def mtp_forward(
    params: dict,
    cfg: ModelConfig,
    hidden: jax.Array,  # [B, S, D] main model's final-normed hidden states
    next_ids: jax.Array,  # [B, S] int32: the token at position i+1 (anything at the last position)
    *,
    j: int = 0,
    moe_impl: str = "ragged",
    attention_mask: jax.Array | None = None,  # [B, S] bool, False for padding
) -> jax.Array:  # [B, S, V] fp32: logits of the token at i+2
    mp = params["mtp"][j]
    B, S = next_ids.shape
    eps = cfg.rms_norm_eps
    e = rms_norm(params["embed"][next_ids], mp["enorm"], eps)  # [B, S, D]
    x = jnp.concatenate([e, rms_norm(hidden.astype(e.dtype), mp["hnorm"], eps)], axis=-1)  # [B, S, 2D]
    h = linear(x, mp["eh_proj"])  # [B, S, D]
    cos, sin, mask = sequence_inputs(cfg, B, S, attention_mask)
    kind = "moe" if cfg.n_routed_experts else "dense"
    h = decoder_layer(mp["layer"], cfg, kind, h, cos, sin, mask, mla.attend_expanded, moe_impl)
    return linear(rms_norm(h, mp["shared_head_norm"], eps), params["lm_head"]).astype(jnp.float32)
