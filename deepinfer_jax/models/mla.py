"""Multi-head Latent Attention (DeepSeek-V2/V3), in both forms.

Notation: T tokens, H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim,
R = kv_lora_rank. Per token the cache keeps only c_kv (normalised latent, [R]) and the roped k_pe
([dr]): 576 values for every released model, shared by all heads.

- Expanded form (`attend_expanded`): K/V are rebuilt per head from the latent through kv_b_proj and
  ordinary causal attention runs; this is how HF computes, and what the full-sequence forward uses.
- Absorbed form (`absorb_query` / `absorbed_output`): W_UK is folded into the query and W_UV applied
  after attention, so attention is MQA over the latent cache (keys 576 wide, values 512 wide).
Both agree in fp32 (tested).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.layers import StackedWeight, apply_rope, linear, rms_norm, stacked_matmul, weight

MASK_VALUE = -1e30


def q_latent(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """x [..., D] -> the q-LoRA latent [..., Rq] = q_a_layernorm(q_a_proj(x)) (q_b_proj's input)."""
    return rms_norm(linear(x, p["q_a_proj"]), p["q_a_layernorm"], cfg.latent_norm_eps)


def project_qkv(
    p: dict, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array, whole_q: bool = False,
    raw_latent: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """x: [..., D] -> q_nope [..., H, dn], q_pe [..., H, dr] (roped), c_kv [..., R] (normed),
    k_pe [..., dr] (roped). cos/sin: [..., dr/2]. `whole_q`: the whole q projection [..., H, dn + dr]
    (before RoPE; q_nope is its first dn) in place of q_nope, for a kernel that reads q_nope in place
    (kernels/mla_absorb.py) where a slice would be copied out first. `raw_latent`: the kv_a projection's
    output [..., R + dr] (before kv_a_layernorm and RoPE) in place of c_kv, and None for k_pe, for the
    kernel that norms, rotates and caches it (`mla_absorb.absorb_query_write_latents`)."""
    dn, R = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = jnp.einsum("...d,dhk->...hk", x, weight(p["q_proj"], x.dtype))
    else:
        q = jnp.einsum("...r,rhk->...hk", q_latent(p, cfg, x), weight(p["q_b_proj"], x.dtype))
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    ckv = linear(x, p["kv_a_proj_with_mqa"])  # [..., R + dr]
    if raw_latent:
        return q if whole_q else q_nope, apply_rope(q_pe, cos, sin), ckv, None
    c_kv = rms_norm(ckv[..., :R], p["kv_a_layernorm"], cfg.latent_norm_eps)
    k_pe = ckv[..., R:]
    return q if whole_q else q_nope, apply_rope(q_pe, cos, sin), c_kv, apply_rope(k_pe, cos, sin)


def project_qkv_merged(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """x [T, D] -> the q and kv_a projections as one GEMM's output [T, H * (dn + dr) + R + dr]: head h's unroped q
    in columns [h * (dn + dr), (h + 1) * (dn + dr)), the kv_a rows (before kv_a_layernorm and RoPE) after them.
    For a model without q-LoRA and float weights. One output for a kernel that reads both parts in place
    (`mla_absorb.absorb_query_write_latents` with ckv None): XLA fuses the weights' concatenation into the GEMM's
    operand, as it does when it merges the two dots itself, and no slice is copied out of the result."""
    D = x.shape[-1]
    w = jnp.concatenate([p["q_proj"].reshape(D, -1), p["kv_a_proj_with_mqa"]], axis=1).astype(x.dtype)
    return jnp.einsum("td,dc->tc", x, w)


def attend_expanded(
    p: dict, cfg: ModelConfig, q_nope, q_pe, c_kv, k_pe, mask: jax.Array
) -> jax.Array:
    """Expanded attention over one batch of contiguous sequences.

    q_nope [B, S, H, dn], q_pe [B, S, H, dr], c_kv [B, K, R], k_pe [B, K, dr], mask [B, S, K] bool.
    Returns [B, S, H, dv].
    """
    dn = cfg.qk_nope_head_dim
    kv = jnp.einsum("bkr,rhe->bkhe", c_kv, weight(p["kv_b_proj"], c_kv.dtype))  # [B, K, H, dn + dv]
    k_nope, v = kv[..., :dn], kv[..., dn:]
    s = jnp.einsum("bshd,bkhd->bhsk", q_nope, k_nope, preferred_element_type=jnp.float32)
    s = s + jnp.einsum("bshd,bkd->bhsk", q_pe, k_pe, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None], s * cfg.softmax_scale, MASK_VALUE)
    probs = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhsk,bkhe->bshe", probs, v)


# Steps of at most this many query tokens absorb through kv_b_proj's whole rows (below).
ABSORB_FULL_WIDTH_MAX_TOKENS = 64


def absorb_query(p: dict, cfg: ModelConfig, q_nope: jax.Array) -> jax.Array:
    """q_nope [..., H, dn] -> q_lat [..., H, R] = q_nope . W_UK (W_UK = kv_b_proj[:, :, :dn]).

    W_UK is a strided slice of each layer's kv_b_proj, which XLA's GEMM copies out first (2.4 us a
    layer at decode sizes on an H200). For a step of at most ABSORB_FULL_WIDTH_MAX_TOKENS tokens the
    query is instead padded with dv zeros and contracted with the whole rows [R, H, dn + dv]: the
    same sums (the padding adds exact zeros), the layer's weight read in place, twice the FLOPs of a
    GEMM that is tiny at those sizes. Prefill-size steps keep the slice."""
    dn = cfg.qk_nope_head_dim
    kv_b = weight(p["kv_b_proj"], q_nope.dtype)  # [R, H, dn + dv]
    if math.prod(q_nope.shape[:-2]) <= ABSORB_FULL_WIDTH_MAX_TOKENS:
        pad = jnp.zeros((*q_nope.shape[:-1], kv_b.shape[-1] - dn), q_nope.dtype)
        return jnp.einsum("...hd,rhd->...hr", jnp.concatenate([q_nope, pad], axis=-1), kv_b)
    return jnp.einsum("...hd,rhd->...hr", q_nope, kv_b[..., :dn])


def absorbed_output(p: dict, cfg: ModelConfig, o_lat: jax.Array) -> jax.Array:
    """o_lat [..., H, R] -> [..., H, dv] = o_lat . W_UV (W_UV = kv_b_proj[:, :, dn:])."""
    w_uv = weight(p["kv_b_proj"], o_lat.dtype)[..., cfg.qk_nope_head_dim :]  # [R, H, dv]
    return jnp.einsum("...hr,rhv->...hv", o_lat, w_uv)


def attend_absorbed_dense(
    p: dict, cfg: ModelConfig, q_nope, q_pe, c_kv, k_pe, mask: jax.Array
) -> jax.Array:
    """The absorbed form over contiguous sequences (same arguments and result as attend_expanded)."""
    q_lat = absorb_query(p, cfg, q_nope)  # [B, S, H, R]
    s = jnp.einsum("bshr,bkr->bhsk", q_lat, c_kv, preferred_element_type=jnp.float32)
    s = s + jnp.einsum("bshd,bkd->bhsk", q_pe, k_pe, preferred_element_type=jnp.float32)
    s = jnp.where(mask[:, None], s * cfg.softmax_scale, MASK_VALUE)
    probs = jax.nn.softmax(s, axis=-1).astype(c_kv.dtype)
    o_lat = jnp.einsum("bhsk,bkr->bshr", probs, c_kv)
    return absorbed_output(p, cfg, o_lat)


def output_projection(p: dict, attn: jax.Array) -> jax.Array:
    """attn [..., H, dv] -> [..., D] through o_proj [H, dv, D] (or a StackedWeight of it, read in place)."""
    if isinstance(p["o_proj"], StackedWeight):
        return stacked_matmul(attn, p["o_proj"], in_dims=2)
    return jnp.einsum("...hv,hvd->...d", attn, weight(p["o_proj"], attn.dtype))
