"""Speculative decoding's rejection sampler (Leviathan et al. / vLLM's rejection_sampler), one row per
verified position, on the device.

Row b verifies the draft token d = draft_ids[b] (< 0: nothing to verify: the row is a plain sample, which is how a
sequence's bonus position and the rows of non-speculating sequences run). With the target distribution p (the
row's processed logits: penalties, masks, temperature and truncation applied) and the draft's q:

  * accept d with probability min(1, p(d) / q(d)), by a uniform u < p(d) / q(d);
  * a rejected row emits a draw from the residual max(0, p - q), normalised;
  * greedy rows (temperature < GREEDY_EPS) accept iff d is the argmax, and emit the argmax.

q = None is a point mass at d (n-gram proposals): accept with probability p(d), the residual is p without d.
The sequence keeps its leading accepted drafts and the token of its first rejected (or its bonus) row; the
output then follows the target distribution exactly.

Randomness: the residual draw is the Gumbel-max draw of draw.categorical_rows with the row's key, so a row with
nothing to verify draws what the plain sampler draws; u hashes the same key with the id V (no vocabulary id), so
it is independent of the draw's noise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.sampling.draw import categorical_rows, noise_bits


def acceptance_uniform(key_data: jax.Array, vocab: int) -> jax.Array:
    """key_data u32[B, 2] -> f32[B] uniform in [0, 1): the row's accept test's u (noise_bits at the id `vocab`)."""
    kd = key_data.astype(jnp.uint32)
    bits = noise_bits(kd[:, :1], kd[:, 1:], jnp.full((kd.shape[0], 1), vocab, jnp.int32))[:, 0]
    return jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0


def rejection_sample(masked: jax.Array, draft_ids: jax.Array, key_data: jax.Array, is_greedy: jax.Array,
                     greedy_ids: jax.Array, draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """masked f32[B, V]: the target's processed logits (temperature-scaled and truncated, -inf where dropped);
    draft_ids i32[B] (< 0: none); key_data u32[B, 2]; is_greedy bool[B]; greedy_ids i32[B] (the argmax before
    the temperature); draft_probs f32[B, V] or None (a point mass at the draft). -> (token i32[B], accepted
    bool[B]): the draft where accepted, else the residual's draw."""
    batch, vocab = masked.shape
    has = (draft_ids >= 0) & (draft_ids < vocab)
    d = jnp.where(has, draft_ids, 0)[:, None]                                      # i32[B, 1]
    probs = jax.nn.softmax(masked, axis=-1)                                        # f32[B, V] target p
    p_d = jnp.take_along_axis(probs, d, axis=-1)[:, 0]                             # f32[B]
    col = jax.lax.broadcasted_iota(jnp.int32, masked.shape, 1)
    u = acceptance_uniform(key_data, vocab)
    if draft_probs is None:
        accept = u < p_d
        residual = jnp.where(has[:, None] & (col == d), -jnp.inf, masked)
    else:
        q = draft_probs.astype(jnp.float32)
        q_d = jnp.take_along_axis(q, d, axis=-1)[:, 0]
        accept = u * q_d < p_d  # u < p/q without dividing (q_d = 0 never happens for a drawn draft; it accepts)
        rest = jnp.maximum(probs - q, 0.0)
        # all of p below q (p == q): nothing is ever rejected; keep the draw well defined all the same
        rest = jnp.where(jnp.sum(rest, axis=-1, keepdims=True) > 0, rest, probs)
        residual = jnp.where(has[:, None], jnp.log(rest), masked)
    drawn = categorical_rows(key_data, residual)
    accept = has & jnp.where(is_greedy, greedy_ids == draft_ids, accept)
    token = jnp.where(is_greedy, greedy_ids, jnp.where(accept, draft_ids, drawn))
    return token.astype(jnp.int32), accept
