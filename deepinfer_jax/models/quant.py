"""Weight-only quantized linear weights: INT8 per output channel, INT4 grouped along the input dim.

A `QuantizedWeight` replaces a float `[in, out]` (or `[E, in, out]`) leaf in the params pytree. The
model's `linear` dequantizes inside the matmul path, so the same forward serves float and quantized
checkpoints. Invariants:
- int8: `q` int8 `[..., in, out]`, `scale` `[..., 1, out]`; w ~= q * scale.
- int4: `q` uint8 `[..., in // 2, out]` holding two 4-bit values per byte (low nibble = even input row,
  high nibble = odd row, each stored as value + 8 in [0, 15]); `scale` `[..., in // group, out]`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    q: jax.Array
    scale: jax.Array
    bits: int = dataclasses.field(metadata=dict(static=True), default=8)
    group_size: int = dataclasses.field(metadata=dict(static=True), default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's logical shape."""
        if self.bits == 4:
            return self.q.shape[:-2] + (self.q.shape[-2] * 2, self.q.shape[-1])
        return self.q.shape

    @property
    def ndim(self) -> int:
        return len(self.shape)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def dequantize(w: QuantizedWeight, dtype=jnp.bfloat16) -> jax.Array:
    """Back to a float `[..., in, out]` array."""
    if w.bits == 8:
        return (w.q.astype(jnp.float32) * w.scale.astype(jnp.float32)).astype(dtype)
    lo = (w.q & 0x0F).astype(jnp.int32) - 8  # even input rows
    hi = (w.q >> 4).astype(jnp.int32) - 8  # odd input rows
    vals = jnp.stack([lo, hi], axis=-2)  # [..., in/2, 2, out]
    vals = vals.reshape(*w.q.shape[:-2], w.q.shape[-2] * 2, w.q.shape[-1]).astype(jnp.float32)
    g = w.group_size
    grouped = vals.reshape(*vals.shape[:-2], vals.shape[-2] // g, g, vals.shape[-1])
    out = grouped * w.scale.astype(jnp.float32)[..., :, None, :]
    return out.reshape(vals.shape).astype(dtype)


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x: [..., in] @ dequant(w): [in, out] -> [..., out]. INT8 folds the scale after the matmul."""
    if w.bits == 8:
        y = jnp.einsum("...i,io->...o", x, w.q.astype(x.dtype))
        return (y.astype(jnp.float32) * w.scale[0].astype(jnp.float32)).astype(x.dtype)
    return jnp.einsum("...i,io->...o", x, dequantize(w, x.dtype))


def flatten_out_dims(w: QuantizedWeight) -> QuantizedWeight:
    """[in, *out] -> [in, prod(out)] for a 2-D-input quantized weight (e.g. gate_up [D, 2, I] -> [D, 2I])."""
    return QuantizedWeight(
        w.q.reshape(w.q.shape[0], -1), w.scale.reshape(w.scale.shape[0], -1), w.bits, w.group_size
    )
