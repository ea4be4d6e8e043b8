"""The GQA decoder family: Llama, Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen), Qwen3, Qwen3-MoE, Mistral.

One module serves them all; config.json sets what differs (config.py `_dense_config`): Qwen2's q/k/v bias
(`attention_bias`), Qwen3's per-head RMSNorm on q and k before RoPE (`qk_norm`), Mistral's sliding window,
RoPE scaling (linear, llama3, yarn), tied or untied embeddings, grouped KV heads.

Each decoder layer is pre-norm, HF's arithmetic:
    x = rms_norm(h); q = x Wq (+bq) [H, hd]; k, v = x Wkv (+bkv) [2, KVH, hd]; (q, k = rms_norm per head);
    q, k = rope(q), rope(k) (rotate-half layout); a = softmax(q k^T * hd^-0.5 + causal mask) v;
    h += a Wo; h += down(silu(gate(x')) * up(x')) with x' = rms_norm(h).

Params (a single "dense" segment of all L layers, stacked; weights [in, out]):
  embed [V, D]; final_norm [D]; lm_head [D, V] (a copy of embed's transpose when tied)
  segments[0]: {input_layernorm [L, D], post_attention_layernorm [L, D],
                attn: {q_proj [L, D, H, hd], kv_proj [L, D, 2, KVH, hd], o_proj [L, H, hd, D],
                       q_bias [L, H, hd], kv_bias [L, 2, KVH, hd] (attention_bias),
                       q_norm [L, hd], k_norm [L, hd] (qk_norm)},
                mlp: {gate_up [L, D, 2, I], down [L, I, D]}
                or, Qwen3-MoE, moe: {gate [L, D, E], experts: {gate_up [L, E, D, 2, Im], down [L, E, Im, D]}}}
KV cache: [L, P, page_size, 2, KVH, hd] (kernels/gqa_reference.py), page 0 the null page as for DeepSeek.

Entry points as models/deepseek.py's: `forward` (the whole sequence, no cache: the reference) and
`forward_paged` (one ragged engine step over the paged cache).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig, yarn_get_mscale
from deepinfer_jax.kernels.gqa_reference import MASK_VALUE, paged_gqa_attention_reference
from deepinfer_jax.models.cache import StepMetadata, write_slots
from deepinfer_jax.models.layers import StackedWeight, linear, rms_norm, stacked_matmul, swiglu_mlp, weight
from deepinfer_jax.models.moe import moe_block
from deepinfer_jax.models.params import ParamSpec
from deepinfer_jax.models.quant import is_quantized


# ------------------------------------------------------------------------------------------------
# Params and cache layout
# ------------------------------------------------------------------------------------------------


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    L, D, V, I = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    H, KVH, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def P(shape, axes):
        return ParamSpec((L,) + shape, ("layers",) + axes)

    attn = {
        "q_proj": P((D, H, hd), ("embed", "heads", "head_dim")),
        "kv_proj": P((D, 2, KVH, hd), ("embed", None, "kv_heads", "head_dim")),
        "o_proj": P((H, hd, D), ("heads", "head_dim", "embed")),
    }
    if cfg.attention_bias:
        attn["q_bias"] = P((H, hd), ("heads", "head_dim"))
        attn["kv_bias"] = P((2, KVH, hd), (None, "kv_heads", "head_dim"))
    if cfg.qk_norm:
        attn["q_norm"] = P((hd,), ("head_dim",))
        attn["k_norm"] = P((hd,), ("head_dim",))
    layer = {
        "input_layernorm": P((D,), ("embed",)),
        "post_attention_layernorm": P((D,), ("embed",)),
        "attn": attn,
    }
    if cfg.n_routed_experts:  # Qwen3-MoE: every layer's MLP is the routed experts (no shared expert)
        E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
        layer["moe"] = {"gate": P((D, E), ("embed", None)),
                        "experts": {"gate_up": P((E, D, 2, Im), ("expert", "embed", None, "moe_mlp")),
                                    "down": P((E, Im, D), ("expert", "moe_mlp", "embed"))}}
    else:
        layer["mlp"] = {"gate_up": P((D, 2, I), ("embed", None, "mlp")), "down": P((I, D), ("mlp", "embed"))}
    return {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "final_norm": ParamSpec((D,), ("embed",)),
        "lm_head": ParamSpec((D, V), ("embed", "vocab")),
        "segments": [layer],
    }


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    return (cfg.num_hidden_layers, num_pages, page_size, 2, cfg.num_key_value_heads, cfg.head_dim)


# ------------------------------------------------------------------------------------------------
# RoPE (HF `_compute_{default,linear,llama3,yarn}_parameters`, rotate-half layout)
# ------------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """-> (inverse frequencies [hd / 2] fp32, the cos/sin amplitude), HF's fp32 arithmetic."""
    d, base, rs = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    pos_freqs = np.float32(base) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
    inv = (1.0 / pos_freqs).astype(np.float32)
    if rs is None:
        return inv, 1.0
    if rs.rope_type == "linear":
        return (inv / np.float32(rs.factor)).astype(np.float32), 1.0
    if rs.rope_type == "llama3":
        old = rs.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    # yarn
    amp = rs.attention_factor
    if amp is None:
        amp = (yarn_get_mscale(rs.factor, rs.mscale) / yarn_get_mscale(rs.factor, rs.mscale_all_dim)
               if rs.mscale and rs.mscale_all_dim else yarn_get_mscale(rs.factor))

    def corr_dim(rot: float) -> float:
        return d * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(rs.beta_fast), corr_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1 - ramp
    interp = 1.0 / (np.float32(rs.factor) * pos_freqs)
    return (interp * (1 - extrapolation) + inv * extrapolation).astype(np.float32), float(amp)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [...] -> cos, sin [..., hd / 2] fp32 (times the attention factor)."""
    inv, amp = rope_inv_freq(cfg)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    return jnp.cos(angles) * amp, jnp.sin(angles) * amp


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's rotate-half: x [*lead, heads, d] with halves (x1, x2); cos/sin [*lead, d/2], broadcast over the heads.
    y = (x1 c - x2 s, x2 c + x1 s), in fp32, cast back."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------


def project_qkv(p: dict, cfg: ModelConfig, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """x [..., D] -> q [..., H, hd] roped, kv [..., 2, KVH, hd] (k roped). cos/sin [..., hd/2]. A projection may be
    a StackedWeight (`decode_projections`)."""
    q = project(x, p["q_proj"], "...d,dhk->...hk")
    kv = project(x, p["kv_proj"], "...d,dgkh->...gkh")
    if cfg.attention_bias:
        q, kv = q + p["q_bias"].astype(x.dtype), kv + p["kv_bias"].astype(x.dtype)
    k, v = kv[..., 0, :, :], kv[..., 1, :, :]
    if cfg.qk_norm:
        q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, jnp.stack([k, v.astype(k.dtype)], axis=-3)


def project(x: jax.Array, w, spec: str, in_dims: int = 1) -> jax.Array:
    """x through weight `w` by the einsum `spec`, or, a StackedWeight, by the decode-projection kernel reading
    the layer's weight in place (its first `in_dims` dims contracted)."""
    if isinstance(w, StackedWeight):
        return stacked_matmul(x, w, in_dims)
    return jnp.einsum(spec, x, weight(w, x.dtype))


def output_projection(p: dict, a: jax.Array) -> jax.Array:
    """a [..., H, hd] -> [..., D] through o_proj [H, hd, D]."""
    return project(a, p["o_proj"], "...hv,hvd->...d", in_dims=2)


# Decode-size steps' projections that kernels/decode_matmul.py reads in place from the layer-stacked weights
# (RunnerConfig.decode_projection_kernel): (group, name, weight dims contracted), as DeepSeek's decode projections.
# On an H100 this path is even with XLA's cuBLAS GEMMs on the layers' slices (docs/models.md).
STACKABLE = (("attn", "q_proj", 1), ("attn", "kv_proj", 1), ("attn", "o_proj", 2), ("mlp", "gate_up", 1),
             ("mlp", "down", 1))


def decode_projections(seg: dict, num_tokens: int, attn_impl: str, sharded: bool, enabled: bool) -> dict:
    """{(group, name): stacked weight [L, ...]} of the layers' projections a step of `num_tokens` token slots reads
    in place: with `enabled`, on the Pallas path on one device, float weights on the device that the kernel tiles,
    steps of at most decode_matmul.MAX_TOKENS tokens (models/decode_kernels.py `decode_stacked`). Empty otherwise."""
    if sharded:
        return {}
    from deepinfer_jax.models.decode_kernels import decode_stacked
    from deepinfer_jax.models.deepseek import holds_host

    float_on_device = {group: {name: w for name, w in seg.get(group, {}).items()
                               if not is_quantized(w) and not holds_host(w)} for group in ("attn", "mlp")}
    return decode_stacked(float_on_device, num_tokens, attn_impl, None, enabled, STACKABLE)


def mlp(lp: dict, cfg: ModelConfig, x: jax.Array, moe_impl: str):
    """x [T, D] -> ([T, D], routed expert ids [T, k] or None): the SwiGLU MLP, or Qwen3-MoE's experts
    (models/moe.py: softmax top-k routing, renormalised with norm_topk_prob)."""
    if "moe" not in lp:
        return swiglu_mlp(x, lp["mlp"]), None
    return moe_block(lp["moe"], cfg, x, moe_impl, return_routing=True)


def softmax_scale(cfg: ModelConfig) -> float:
    return cfg.head_dim ** -0.5


def _logits(params: dict, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    return linear(rms_norm(h, params["final_norm"], cfg.rms_norm_eps), params["lm_head"]).astype(jnp.float32)


def forward(
    params: dict,
    cfg: ModelConfig,
    token_ids: jax.Array,  # [B, S] int32
    *,
    attention_mask: jax.Array | None = None,  # [B, S] bool, False for padding (right padding)
) -> jax.Array:  # [B, S, V] fp32
    B, S = token_ids.shape
    KVH, G = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    cos, sin = rope_cos_sin(cfg, positions)  # [B, S, hd/2]
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    visible = j <= i
    if cfg.sliding_window is not None:
        visible = visible & (j > i - cfg.sliding_window)
    mask = jnp.broadcast_to(visible, (B, S, S))
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, :]
    h = params["embed"][token_ids]  # [B, S, D]

    def body(h, lp):
        x = rms_norm(h, lp["input_layernorm"], cfg.rms_norm_eps)
        q, kv = project_qkv(lp["attn"], cfg, x, cos, sin)  # [B, S, H, hd], [B, S, 2, KVH, hd]
        qg = q.reshape(B, S, KVH, G, -1)
        s = jnp.einsum("bskgd,btkd->bkgst", qg, kv[:, :, 0], preferred_element_type=jnp.float32)
        s = jnp.where(mask[:, None, None], s * softmax_scale(cfg), MASK_VALUE)
        probs = jax.nn.softmax(s, axis=-1).astype(kv.dtype)
        a = jnp.einsum("bkgst,btkd->bskgd", probs, kv[:, :, 1]).reshape(B, S, cfg.num_attention_heads, -1)
        h = h + output_projection(lp["attn"], a)
        x = rms_norm(h, lp["post_attention_layernorm"], cfg.rms_norm_eps)
        return h + mlp(lp, cfg, x.reshape(B * S, -1), "ragged")[0].reshape(B, S, -1), None

    h, _ = jax.lax.scan(body, h, params["segments"][0])
    return _logits(params, cfg, h)


def write_kv(kv_cache: jax.Array, layer, meta: StepMetadata, kv: jax.Array) -> jax.Array:
    """This step's keys and values kv [T, 2, KVH, hd] into their cache slots (meta.slot_mapping) of `layer`."""
    return write_slots(kv_cache, layer, meta.slot_mapping, kv)


ATTN_IMPLS = ("reference", "pallas", "pallas_interpret")


def _pallas_attention(cfg: ModelConfig, kv_cache: jax.Array, attn_impl: str, sharded: bool) -> bool:
    """Whether the step's attention runs the Pallas kernels: the Pallas path, one device, shapes they take."""
    from deepinfer_jax.kernels import gqa_attention

    interpret = attn_impl == "pallas_interpret"
    return attn_impl != "reference" and not sharded and gqa_attention.supported(cfg.head_dim, kv_cache.shape[2],
                                                                                 interpret)


def prefill_blocks(meta: StepMetadata, cfg: ModelConfig, kv_cache: jax.Array, attn_impl: str, sharded: bool):
    """The step's query blocks (kernels/gqa_prefill.py `query_block_layout`), laid out once for all its layers,
    where a prefill-size step (more token slots than sequence rows) runs the Pallas kernels and the query-block
    kernel takes its shape (`gqa_prefill.applies`); None otherwise."""
    from deepinfer_jax.kernels import gqa_prefill

    T, H, G = meta.token_ids.shape[0], cfg.num_attention_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    if (not _pallas_attention(cfg, kv_cache, attn_impl, sharded) or T <= meta.page_table.shape[0]
            or not gqa_prefill.applies(T, H, G)):
        return None
    return gqa_prefill.query_block_layout(meta.seq_ids, meta.page_table.shape[0], G)


def paged_attention(q, kv_cache, layer, meta: StepMetadata, cfg: ModelConfig, attn_impl: str, sharded: bool,
                    blocks=None):
    """q [T, H, hd] over the paged cache -> [T, H, hd]: with the step's `prefill_blocks` the query-block kernel
    (kernels/gqa_prefill.py); else on the Pallas path (a decode step) the kernel of a token a program
    (kernels/gqa_attention.py); the reference (same semantics) elsewhere."""
    from deepinfer_jax.kernels import gqa_attention, gqa_prefill

    interpret = attn_impl == "pallas_interpret"
    args = (q, kv_cache, layer, meta.seq_ids, meta.positions, meta.page_table, softmax_scale(cfg), cfg.sliding_window)
    if blocks is not None:
        return gqa_prefill.ragged_gqa_attention(*args, interpret=interpret, blocks=blocks)
    if _pallas_attention(cfg, kv_cache, attn_impl, sharded):
        return gqa_attention.paged_gqa_attention(*args, interpret=interpret)
    return paged_gqa_attention_reference(*args)


def forward_paged(
    params: dict,
    cfg: ModelConfig,
    kv_cache: jax.Array,  # [L, P, page_size, 2, KVH, hd]
    meta: StepMetadata,
    *,
    moe_impl: str = "ragged",
    attn_impl: str = "reference",
    return_routing: bool = False,
    unroll: int | bool | str = 1,
    mesh_rules: Any = None,
    stage: Any = None,
    hidden: jax.Array | None = None,
    layer_fetch: Any = None,
    decode_projection_kernel: bool = False,
):
    """-> (logits [S, V] fp32, updated kv_cache), plus with return_routing the routed expert ids [L, T, k] of a
    Qwen3-MoE model (an empty [0, T, 0] for a dense one). `moe_impl`: its experts' implementation (models/moe.py).
    `unroll`: models/deepseek.py `run_layers`. Writes each token's k and v into its cache slot, then attends over
    the paged cache
    (`paged_attention`: the Pallas kernel or the reference), so prefill, chunked prefill and decode are one call.
    With `mesh_rules` (tensor parallel, sharding/layout.py) the same code runs with the reference attention,
    partitioned by XLA from the params' and the cache's shardings: query heads, KV heads (or replicated) and the
    MLP's intermediate dim over the tensor axis. `stage`, `hidden`: one pipeline stage, as models/deepseek.py
    forward_paged takes them. `layer_fetch`: layer weights in host memory (--cpu-offload-gb) copied in one layer at a
    time by the layer loop, as models/deepseek.py `run_layers` does. `decode_projection_kernel`: decode-size steps
    read the projections in place (`decode_projections`)."""
    from deepinfer_jax.models.deepseek import run_layers

    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl {attn_impl!r} is not available for the dense family; expected one of {ATTN_IMPLS}")
    T = meta.token_ids.shape[0]
    cos, sin = rope_cos_sin(cfg, meta.positions)  # [T, hd/2]
    h = params["embed"][meta.token_ids] if stage is None or stage.first else hidden  # [T, D]

    seg = params["segments"][0]
    projections = decode_projections(seg, T, attn_impl, mesh_rules is not None, decode_projection_kernel)
    scanned = {k: ({n: w for n, w in v.items() if (k, n) not in projections} if isinstance(v, dict) else v)
               for k, v in seg.items()}  # the projections read in place are not sliced by the layer loop
    interpret = attn_impl == "pallas_interpret"
    blocks = prefill_blocks(meta, cfg, kv_cache, attn_impl, mesh_rules is not None)

    def body(carry, xs):
        h, cache = carry
        lp, li, _ = xs
        for (group, name), w in projections.items():
            lp = {**lp, group: {**lp[group], name: StackedWeight(w, li, interpret)}}
        x = rms_norm(h, lp["input_layernorm"], cfg.rms_norm_eps)
        q, kv = project_qkv(lp["attn"], cfg, x, cos, sin)  # [T, H, hd], [T, 2, KVH, hd]
        cache = write_kv(cache, li, meta, kv)
        a = paged_attention(q, cache, li, meta, cfg, attn_impl, mesh_rules is not None, blocks)
        h = h + output_projection(lp["attn"], a)
        x = rms_norm(h, lp["post_attention_layernorm"], cfg.rms_norm_eps)
        m, idx = mlp(lp, cfg, x, moe_impl)
        return (h + m, cache), (idx if return_routing and idx is not None else None)

    L = cfg.num_hidden_layers if stage is None else stage.num_layers
    ids = np.arange(L, dtype=np.int32)
    (h, kv_cache), routing = run_layers(body, (h, kv_cache), scanned, ids, ids, unroll, layer_fetch)
    if stage is not None and not stage.last:  # the next stage's input
        return h, kv_cache
    logits = _logits(params, cfg, h[meta.logits_indices])
    if return_routing:
        return logits, kv_cache, jnp.zeros((0, T, 0), jnp.int32) if routing is None else routing
    return logits, kv_cache
