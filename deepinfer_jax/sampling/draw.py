"""The sampler's random draw: a per-row Gumbel-max over the vocabulary, its noise hashed from the row's key data
and each id (no jax.random call in the step). Used by sampler.py and rejection.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


ARGMAX_CHUNK = 1024  # the categorical draw's argmax runs over chunks of this many ids first


def _mix32(x: jax.Array) -> jax.Array:
    """uint32 -> uint32, a bijection with a low avalanche bias ("lowbias32": two xorshift-multiply rounds)."""
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def noise_bits(k0: jax.Array, k1: jax.Array, col: jax.Array) -> jax.Array:
    """A row's key data words k0, k1 (uint32, e.g. [B, 1]) and vocabulary ids col (int32, e.g. [B, n], broadcasting
    with them) -> uint32 random bits: `_mix32` twice, a key word folded in before each. For each key the map from
    id to bits is a bijection, so no two ids of a row share their bits. About 15 integer operations an id, where
    jax.random's threefry2x32 takes ~100; yet at batch 32 x 102,400 ids on an H100 the base sampler cost the same
    with either (17.8 us beyond the lm_head with this hash, 15.5 with threefry: benchmarks/RESULTS.md): the
    draw's fused passes over the logits, not the hash, set its time. The key data comes from threefry
    (`keys.make_key_data`)."""
    return _mix32(_mix32(col.astype(jnp.uint32) + k0) ^ k1)


def gumbel_noise(k0: jax.Array, k1: jax.Array, col: jax.Array) -> jax.Array:
    """`noise_bits` -> float32 Gumbel(0, 1) noise: the bits' top 23 as a uniform u in [tiny, 1) (jax.random.uniform's
    mapping), then -log(-log(u)). Pure elementwise jnp, so XLA fuses it into the draw's argmax."""
    bits = noise_bits(k0, k1, col)
    u = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0  # [0, 1)
    tiny = jnp.float32(np.finfo(np.float32).tiny)
    u = jnp.maximum(tiny, u * (1.0 - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def categorical_rows(key_data: jax.Array, logits: jax.Array) -> jax.Array:
    """key_data u32[B, 2], logits f32[B, V] -> i32[B]: each row's Gumbel-max draw, the argmax of logits +
    gumbel_noise(key, id) (an id at -inf is never drawn unless all are), taken over chunks of ARGMAX_CHUNK ids
    and then over the chunks' maxima. The first maximum wins either way (the first chunk holding it, its first
    index there). On an H200 at B = 32, V = 102,400 the fused draw and argmax took 26.5 us a step as one
    [B, V] reduction and 21.8 us in chunks with threefry's noise, the noise's hash included
    (benchmarks/RESULTS.md)."""
    batch, vocab = logits.shape
    kd = key_data.astype(jnp.uint32)
    col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    z = logits + gumbel_noise(kd[:, :1], kd[:, 1:], col)  # f32[B, V]
    n = -(-vocab // ARGMAX_CHUNK)
    if n == 1:
        return jnp.argmax(z, axis=-1).astype(jnp.int32)
    z = jnp.pad(z, ((0, 0), (0, n * ARGMAX_CHUNK - vocab)), constant_values=-jnp.inf).reshape(batch, n, ARGMAX_CHUNK)
    first = jnp.argmax(z, axis=-1).astype(jnp.int32)                   # i32[B, n] within each chunk
    best = jnp.argmax(jnp.max(z, axis=-1), axis=-1).astype(jnp.int32)  # i32[B]    the chunk
    return best * ARGMAX_CHUNK + jnp.take_along_axis(first, best[:, None], axis=-1)[:, 0]
