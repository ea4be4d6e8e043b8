"""Decoding FP4 (e2m1) codes and e8m0 scales in JAX, shared by the kernels that read FP4 weights in place
(kernels/moe_gmm_quant.py) and by models/quant_fp4.py's reference dequantization, so both decode alike.

A packed byte holds two e2m1 codes, the low nibble first (the even element). A code is sign (bit 3), exponent
(bits 2-1) and mantissa (bit 0): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. An e8m0 byte s is 2 ** (s - 127).

`nibble_values` is what the kernels decode with: on the GPU it is one PTX block a word of 4 bytes (`PAIRS_PTX`),
elsewhere (interpret mode, fp32 activations) the integer ops of `e2m1_to_float`; both give the same values.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

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


# Four packed bytes ($4) and their scales as bf16 pairs ($5: bytes 0-1, $6: bytes 2-3) -> the low nibbles' bf16
# values x scale ($0: bytes 0-1, $1: bytes 2-3) and the high nibbles' ($2, $3). The word's eight codes, nibble i
# = byte i // 2's low (even i) or high nibble, are decoded by byte lookups: `prmt` takes each selector nibble's
# low 3 bits as a byte index into its two table words, so with the signs masked off the codes index the bf16
# magnitudes' low bytes (0.0 0.5 1.0 1.5 | 2.0 3.0 4.0 6.0 -> 00 00 80 C0 | 00 40 80 C0) and high bytes (00 3F 3F
# 3F | 40 40 40 40); the sign bits, moved to bit 0 of their nibbles, select 0x80 or 0x00. A `prmt` for each result
# register then gathers its two values' bytes, and an fma with -0 applies their scales (exact: a power of two
# times an e2m1 value is a bf16; adding -0 keeps a +0 product +0). 22 instructions for 8 values.
PAIRS_PTX = """{
.reg .b32 mag, mag_hi, sgn, sgn_hi, lo_a, lo_b, hi_a, hi_b, nz;
and.b32 mag, $4, 0x77777777;
shr.u32 mag_hi, mag, 16;
and.b32 sgn, $4, 0x88888888;
shr.u32 sgn_hi, sgn, 19;
shr.u32 sgn, sgn, 3;
prmt.b32 lo_a, 0xC0800000, 0xC0804000, mag;
prmt.b32 lo_b, 0xC0800000, 0xC0804000, mag_hi;
prmt.b32 hi_a, 0x3F3F3F00, 0x40404040, mag;
prmt.b32 hi_b, 0x3F3F3F00, 0x40404040, mag_hi;
prmt.b32 sgn, 0x00008000, 0, sgn;
prmt.b32 sgn_hi, 0x00008000, 0, sgn_hi;
or.b32 hi_a, hi_a, sgn;
or.b32 hi_b, hi_b, sgn_hi;
prmt.b32 $0, lo_a, hi_a, 0x6240;
prmt.b32 $1, lo_b, hi_b, 0x6240;
prmt.b32 $2, lo_a, hi_a, 0x7351;
prmt.b32 $3, lo_b, hi_b, 0x7351;
mov.b32 nz, 0x80008000;
fma.rn.bf16x2 $0, $0, $5, nz;
fma.rn.bf16x2 $1, $1, $6, nz;
fma.rn.bf16x2 $2, $2, $5, nz;
fma.rn.bf16x2 $3, $3, $6, nz;
}"""


_lock = threading.Lock()


def multi_result_inline_asm() -> bool:
    """Let Pallas-Triton's `elementwise_inline_asm` return several results (idempotent, thread-safe; False where
    the lowering has another form). The pinned jax's rule wraps the op's result list in a one-element list, which
    the lowering then rejects for more than one result; the patch unwraps it (kernels/triton_offsets.py's
    convention for patching that lowering)."""
    with _lock:
        try:
            from jax._src.pallas.triton import lowering
            from jax._src.pallas.triton.primitives import elementwise_inline_asm_p
        except ImportError:
            return False
        rule = lowering.triton_lowering_rules.get(elementwise_inline_asm_p)
        if rule is None:
            return False
        if getattr(rule, "_multi_result", False):
            return True

        def unwrapped(ctx, *args, **params):
            out = rule(ctx, *args, **params)
            if len(ctx.avals_out) > 1 and len(out) == 1:
                out = list(out[0])
            return out

        unwrapped._multi_result = True
        lowering.triton_lowering_rules[elementwise_inline_asm_p] = unwrapped
        return True


def nibble_values(b: jax.Array, scale: jax.Array, dtype, *, asm: bool) -> tuple[jax.Array, jax.Array]:
    """Packed bytes b (uint8) and each byte's scale as a float (same shape) -> (low nibbles' values, high nibbles')
    x scale, each b's shape in `dtype`: the even and the odd elements. `asm` (inside a GPU kernel, bf16 out):
    `PAIRS_PTX`; else integer ops and an fp32 multiply (exact in bf16 too: e2m1 times a power of two)."""
    if asm and dtype == jnp.bfloat16 and multi_result_inline_asm():
        lo, hi = plgpu.elementwise_inline_asm(
            PAIRS_PTX, args=[b.astype(jnp.uint8), scale.astype(jnp.bfloat16)], constraints="=r,=r,=r,=r,r,r,r",
            pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(b.shape, jnp.bfloat16)] * 2)
        return lo, hi
    i = b.astype(jnp.int32)
    s = scale.astype(jnp.float32)
    return (e2m1_to_float(i & 15) * s).astype(dtype), (e2m1_to_float(i >> 4) * s).astype(dtype)
