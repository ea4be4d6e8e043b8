"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer, and MLA over the keys it selects.

Each layer's indexer (params `attn.indexer`, models/params.py) scores every cached token for each query and
attention runs over the `index_topk` best only. Hi = index_n_heads, Di = index_head_dim, dr = qk_rope_head_dim.

    iq[t]    = wq_b(q_a_layernorm(q_a_proj(x_t)))  [Hi, Di]    (the q-LoRA latent MLA's query starts from)
    ik[l]    = LayerNorm(wk(x_l))                  [Di]         (one key per token, cached beside the latent)
    iw[t]    = weights_proj(x_t) * Hi^-0.5 * Di^-0.5   [Hi]     (fp32; Di^-0.5 is the score's softmax scale)
    index[t, l] = sum_h iw[t, h] * relu(iq[t, h] . ik[l])

RoPE (the step's cos / sin) rotates the first dr dims of iq and ik in the half-split layout (first half
against second half), where MLA's own rope part is pairwise-interleaved (HF transformers' V3.2, and
DeepSeek's). The selection and the paged form's arithmetic: kernels/dsa_reference.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.kernels.dsa_reference import index_scores, paged_dsa_attention_reference, topk_mask
from deepinfer_jax.models import mla
from deepinfer_jax.models.cache import StepMetadata, write_slots
from deepinfer_jax.models.layers import linear, weight

# HF builds the indexer's k_norm (a LayerNorm with bias) with a fixed eps.
INDEX_NORM_EPS = 1e-6


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in fp32, cast back to x's dtype. x [..., Di], w / b [Di]."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)
    return y.astype(x.dtype)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split RoPE on the first 2 * cos.shape[-1] dims of x, the rest passed through.

    x: [*lead, *mid, Di]; cos/sin: [*lead, dr/2] broadcast over `mid` (heads). With a = x[:dr/2], b = x[dr/2:dr]:
    y[:dr/2] = a c - b s, y[dr/2:dr] = b c + a s. Computed in fp32, cast back."""
    half = cos.shape[-1]
    extra = x.ndim - cos.ndim
    c = cos.reshape(cos.shape[:-1] + (1,) * extra + cos.shape[-1:])
    s = sin.reshape(sin.shape[:-1] + (1,) * extra + sin.shape[-1:])
    xf = x.astype(jnp.float32)
    a, b = xf[..., :half], xf[..., half : 2 * half]
    y = jnp.concatenate([a * c - b * s, b * c + a * s, xf[..., 2 * half :]], axis=-1)
    return y.astype(x.dtype)


def index_keys(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., D] -> the indexer's roped keys [..., Di]. p: the layer's attn.indexer params."""
    k = layer_norm(linear(x, p["wk"]), p["k_norm"], p["k_norm_bias"], INDEX_NORM_EPS)
    return apply_rope_half(k, cos, sin)


def index_queries(p: dict, cfg: ModelConfig, x: jax.Array, qa: jax.Array, cos, sin) -> tuple[jax.Array, jax.Array]:
    """x [..., D], qa [..., Rq] (the q-LoRA latent) -> (iq [..., Hi, Di] roped, iw [..., Hi] fp32)."""
    q = jnp.einsum("...r,rhd->...hd", qa, weight(p["wq_b"], qa.dtype))
    scale = (cfg.index_n_heads * cfg.index_head_dim) ** -0.5
    w = jnp.einsum("...d,dh->...h", x.astype(jnp.float32), p["weights_proj"].astype(jnp.float32)) * scale
    return apply_rope_half(q, cos, sin), w


def indexer_inputs(p: dict, cfg: ModelConfig, x: jax.Array, cos, sin) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., D] -> (iq [..., Hi, Di], iw [..., Hi], ik [..., Di]) for the layer whose attn params are p."""
    iq, iw = index_queries(p["indexer"], cfg, x, mla.q_latent(p, cfg, x), cos, sin)
    return iq, iw, index_keys(p["indexer"], x, cos, sin)


def sparse_mask(p: dict, cfg: ModelConfig, x: jax.Array, cos, sin, mask: jax.Array) -> jax.Array:
    """The full-sequence forward's mask: x [B, S, D], mask [B, S, S] bool (causal, padding) -> mask [B, S, S]
    keeping, for each query, only the index_topk visible keys the indexer selects."""
    iq, iw, ik = indexer_inputs(p, cfg, x, cos, sin)
    return topk_mask(index_scores(iq, iw, ik), mask, cfg.index_topk)


ATTN_IMPLS = ("reference", "pallas", "pallas_interpret")


def check_paged_support(attn_impl: str, mesh_rules) -> None:
    """Refuse, naming the setting, what the sparse paged step does not run: it runs on one device."""
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl {attn_impl!r} is not one of {ATTN_IMPLS}")
    if mesh_rules is not None:
        raise ValueError("DeepSeek Sparse Attention (deepseek_v32) runs on one device; its sharded step is not built")


def write_and_attend_sparse(p: dict, cfg: ModelConfig, x: jax.Array, cos, sin, kv_cache, layer, meta: StepMetadata,
                            attn_impl: str = "reference"):
    """One layer's paged sparse attention: this step's latents and index keys written to their cache slots, then
    absorbed MLA over each query's selected keys. x [T, D] -> ([T, H, dv], kv_cache).

    attn_impl "reference": kernels/dsa_reference.py. "pallas" / "pallas_interpret": the indexer's scores over
    the paged keys (kernels/dsa_indexer.py), XLA's top-k, and sparse MLA over the selected keys' cache slots
    (kernels/mla_sparse.py). The scores are [T, context] fp32: a prefill step's budget of tokens times the
    longest context of the step."""
    q_nope, q_pe, c_kv, k_pe = mla.project_qkv(p, cfg, x, cos, sin)
    iq, iw, ik = indexer_inputs(p, cfg, x, cos, sin)
    entry = jnp.concatenate([c_kv, k_pe, ik], axis=-1)  # [T, R + dr + Di]
    kv_cache = write_slots(kv_cache, layer, meta.slot_mapping, entry)
    q_lat = mla.absorb_query(p, cfg, q_nope)  # [T, H, R]
    if attn_impl == "reference":
        o_lat = paged_dsa_attention_reference(
            q_lat, q_pe, iq, iw, kv_cache, layer, meta.seq_ids, meta.positions, meta.page_table, cfg.softmax_scale,
            cfg.qk_rope_head_dim, cfg.index_topk)
    else:
        from deepinfer_jax.kernels import dsa_indexer, mla_sparse

        interpret = attn_impl == "pallas_interpret"
        scores = dsa_indexer.paged_index_scores(iq, iw, kv_cache, layer, meta.seq_ids, meta.positions,
                                                meta.page_table, key_start=cfg.latent_dim, interpret=interpret)
        idx, valid = dsa_indexer.select_topk(scores, meta.positions, cfg.index_topk)
        slots, ok = mla_sparse.selected_slots(idx, valid, meta.seq_ids, meta.page_table, kv_cache.shape[2],
                                              mla_sparse.BLOCK_KEYS)
        o_lat = mla_sparse.sparse_mla_attention(q_lat, q_pe, kv_cache, layer, slots, ok, cfg.softmax_scale,
                                                interpret=interpret)
    return mla.absorbed_output(p, cfg, o_lat), kv_cache
