"""Decoding FP4 (e2m1) codes and e8m0 scales in JAX, shared by the kernels that read FP4 weights in place
(kernels/moe_gmm_quant.py) and by models/quant_fp4.py's reference dequantization, so both decode alike.

A packed byte holds two e2m1 codes, the low nibble first (the even element). A code is sign (bit 3), exponent
(bits 2-1) and mantissa (bit 0): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. An e8m0 byte s is 2 ** (s - 127).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP4_GROUP = 32  # DeepSeek-V4's routed experts: one e8m0 scale per 1 x 32 group
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e8m0_to_float(s: jax.Array) -> jax.Array:
    """e8m0 bytes (uint8 / int32) -> fp32 2 ** (s - 127), exactly (byte 0: 2 ** -127, a denormal; 255 is NaN
    in e8m0 and never written)."""
    s = s.astype(jnp.int32)
    bits = jax.lax.bitcast_convert_type(s << 23, jnp.float32)
    return jnp.where(s == 0, jnp.float32(2.0**-127), bits)


def e2m1_to_float(c: jax.Array) -> jax.Array:
    """e2m1 codes (int32 in [0, 16)) -> fp32 values, built as fp32 bits by integer ops (no table lookup: it
    lowers in a kernel): the sign to bit 31, exponent and mantissa to bits 24-22 with fp32's bias less e2m1's
    (127 - 1) added where the exponent is non-zero; code 1, e2m1's one subnormal, is 0.5's bits; code 0 is +-0.
    10 ops a value against 17 for a decode in float arithmetic: the FP4 kernels decode every weight of every
    step, so at decode sizes this ALU work, more than the bytes, can bound them."""
    c = c.astype(jnp.int32)
    em = c & 7
    mag = jnp.where(em >= 2, (em << 22) + (126 << 23), jnp.where(em == 1, 0x3F000000, 0))
    return jax.lax.bitcast_convert_type(mag | ((c & 8) << 28), jnp.float32)


def fp4_unpack(q: jax.Array) -> jax.Array:
    """Packed bytes [.., K / 2] -> the e2m1 values [.., K] in fp32 (low nibble first)."""
    b = q.astype(jnp.int32)
    v = jnp.stack([e2m1_to_float(b & 15), e2m1_to_float(b >> 4)], axis=-1)
    return v.reshape(q.shape[:-1] + (2 * q.shape[-1],))


def fp4_rows(q: jax.Array, scale: jax.Array, group: int = FP4_GROUP) -> jax.Array:
    """q [.., N, K / 2], scale [.., N, cdiv(K, group)] -> the fp32 weight [.., N, K] (HF's orientation)."""
    v = fp4_unpack(q)
    s = jnp.repeat(e8m0_to_float(scale), group, axis=-1)[..., : v.shape[-1]]
    return v * s
