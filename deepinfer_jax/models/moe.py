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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.layers import silu_mul, swiglu_mlp, weight


def route(p: dict, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x: [T, D] -> (weights [T, k] fp32, expert ids [T, k] int32)."""
    logits = jnp.einsum(
        "td,de->te", x.astype(jnp.float32), weight(p["gate"], jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
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


def experts_ragged(p: dict, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
    """Grouped GEMM over expert-sorted token copies. x [T, D], w/idx [T, k] -> [T, D]."""
    T, D = x.shape
    k = idx.shape[-1]
    E = p["gate_up"].shape[0]
    flat = idx.reshape(-1)  # [T*k]
    order = jnp.argsort(flat, stable=True)  # [T*k] copies sorted by expert
    token_of = order // k
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E]
    xs = x[token_of]  # [T*k, D]
    gate_up = weight(p["gate_up"], x.dtype).reshape(E, D, -1)  # [E, D, 2I]
    h = jax.lax.ragged_dot(xs, gate_up, group_sizes)  # [T*k, 2I]
    inter = h.shape[-1] // 2
    a = silu_mul(h[:, :inter], h[:, inter:])
    y = jax.lax.ragged_dot(a, weight(p["down"], x.dtype), group_sizes)  # [T*k, D]
    y = y.astype(jnp.float32) * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, D), jnp.float32).at[token_of].add(y).astype(x.dtype)


def experts_dense(p: dict, x: jax.Array, w: jax.Array, idx: jax.Array) -> jax.Array:
    """Every token through every expert, combined with a [T, E] weight matrix (zero off the top-k)."""
    E = p["gate_up"].shape[0]
    combine = jnp.zeros((x.shape[0], E), jnp.float32).at[jnp.arange(x.shape[0])[:, None], idx].add(w)
    gu = jnp.einsum("td,edgi->tegi", x, weight(p["gate_up"], x.dtype))  # [T, E, 2, I]
    a = silu_mul(gu[:, :, 0], gu[:, :, 1])  # [T, E, I]
    y = jnp.einsum("tei,eid->ted", a, weight(p["down"], x.dtype))  # [T, E, D]
    return jnp.einsum("ted,te->td", y.astype(jnp.float32), combine).astype(x.dtype)


def moe_block(p: dict, cfg: ModelConfig, x: jax.Array, moe_impl: str = "ragged", return_routing: bool = False,
              experts: dict | None = None, layer: jax.Array | None = None):
    """x: [T, D] -> [T, D]: routed experts plus the shared experts (and the expert ids [T, k] if asked).

    Expert weights are `p["experts"]`, or `experts` stacked over layers [L, E, ...] with `layer` the
    index to use (the kernel reads the stacked array in place; the XLA paths slice it)."""
    w, idx = route(p, cfg, x)
    ex = p["experts"] if experts is None else experts
    if moe_impl in ("pallas", "pallas_interpret"):
        from deepinfer_jax.kernels.moe_gmm import moe_experts

        out = moe_experts(x, weight(ex["gate_up"], x.dtype), weight(ex["down"], x.dtype), w, idx,
                          layer=layer, interpret=moe_impl == "pallas_interpret")
        return (_plus_shared(p, x, out), idx) if return_routing else _plus_shared(p, x, out)
    if experts is not None:
        ex = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), ex)
    if moe_impl == "dense":
        out = experts_dense(ex, x, w, idx)
    elif moe_impl == "ragged":
        out = experts_ragged(ex, x, w, idx)
    else:
        raise ValueError(f"moe_impl {moe_impl!r} is not one of 'ragged', 'dense', 'pallas', 'pallas_interpret'")
    out = _plus_shared(p, x, out)
    return (out, idx) if return_routing else out


def _plus_shared(p: dict, x: jax.Array, out: jax.Array) -> jax.Array:
    return out + swiglu_mlp(x, p["shared"]) if "shared" in p else out
