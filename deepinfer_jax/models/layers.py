"""Small pure building blocks of the DeepSeek forward: RMSNorm, YaRN RoPE, SwiGLU, linear.

Every function is pure (arguments in, arrays out) and works under `jax.jit`, `jax.grad` and `vmap`.
Weights are stored JAX-style `[in, out]` (the converter transposes HF's `[out, in]`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig, yarn_get_mscale
from deepinfer_jax.models.quant import (dequantize, flatten_out_dims, fp8_kernel_act, is_fp8, is_packed,
                                       is_quantized, quantized_matmul)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF's arithmetic: normalise in fp32, cast back to x's dtype, then multiply by the weight.

    x: [..., D], weight: [D] -> [..., D] in the promoted dtype of (weight, x).
    """
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    normed = (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return weight * normed


class StackedWeight(NamedTuple):
    """One layer's weight left inside its layer-stacked array: `stacked` [L, *shape], `layer` an int32
    scalar. Decode steps hand their projections over in this form (models/deepseek.py) so that
    kernels/decode_matmul.py reads the layer's weight in place (`stacked_matmul`); slicing it out
    would copy it every step."""

    stacked: jax.Array
    layer: jax.Array
    interpret: bool = False
    split: object = None  # under a mesh, an FP8 weight's models/fp8_parallel.Fp8Split: the GEMM per device


def stacked_matmul(x: jax.Array, w: StackedWeight, in_dims: int = 1) -> jax.Array:
    """x [..., *in] through one layer of w.stacked [L, *in, *out] (its first `in_dims` weight dims
    contracted) -> [..., *out] in x's dtype, by the decode-projection kernel (an Fp8Weight: the FP8 GEMM,
    `fp8_stacked_matmul`; with `split`, on each device's slice: models/fp8_parallel.py)."""
    from deepinfer_jax.kernels.decode_matmul import decode_matmul

    if is_fp8(w.stacked):
        if w.split is not None:
            from deepinfer_jax.models.fp8_parallel import fp8_matmul_split

            local = functools.partial(fp8_stacked_matmul, in_dims=in_dims, interpret=w.interpret)
            return fp8_matmul_split(local, x, w.stacked, w.layer, w.split)
        return fp8_stacked_matmul(x, w.stacked, w.layer, in_dims, interpret=w.interpret)
    shape = w.stacked.shape[1:]
    K, N = math.prod(shape[:in_dims]), math.prod(shape[in_dims:])
    lead = x.shape[: x.ndim - in_dims]
    y = decode_matmul(x.reshape(-1, K), w.stacked.reshape(w.stacked.shape[0], K, N), w.layer, interpret=w.interpret)
    return y.astype(x.dtype).reshape(*lead, *shape[in_dims:])


def fp8_stacked_matmul(x: jax.Array, f, layer: jax.Array, in_dims: int = 1, out_dtype=None,
                       interpret: bool = False) -> jax.Array:
    """x [..., *in] through layer `layer` of the stacked Fp8Weight f (logical [L, *in, *out]; HF's [L, (2,) N, K]
    e4m3 and its block scales, read as stored) by kernels/fp8_gemm.py -> [..., *out] in `out_dtype` (x's dtype
    when None). W8A8 or W8A16 by `quant.fp8_kernel_act` on this GEMM's rows, K and N."""
    from deepinfer_jax.kernels.fp8_gemm import fp8_matmul

    shape = f.shape[1:]
    ins, outs = shape[:in_dims], shape[in_dims:]
    K, N = math.prod(ins), math.prod(outs)
    lead = x.shape[: x.ndim - in_dims]
    q = f.q.reshape(f.q.shape[0], -1, f.q.shape[-1])  # gate_up [L, 2, I, D] -> [L, 2I, D], gate rows first
    s = f.scale.reshape(f.scale.shape[0], -1, f.scale.shape[-1])
    x2 = x.reshape(-1, K)
    act = fp8_kernel_act(x2.shape[0], K, N) or "bf16"  # decode_stacked sent it here by the same rule
    y = fp8_matmul(x2, q, s, layer, block=(f.block[1], f.block[0]), act=act, layout="nk", out_dtype=out_dtype,
                   interpret=interpret)
    return y.reshape(*lead, *outs)


def linear(x: jax.Array, w) -> jax.Array:
    """x: [..., in] @ w: [in, out] -> [..., out]. `w` may be a quantized weight (see models/quant.py) or a
    StackedWeight."""
    if isinstance(w, StackedWeight):
        return stacked_matmul(x, w)
    if is_quantized(w):
        return quantized_matmul(x, w)
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


def weight(w, dtype) -> jax.Array:
    """A weight leaf as a float array of `dtype` (dequantizing a QuantizedWeight)."""
    return dequantize(w, dtype) if is_quantized(w) else w.astype(dtype)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's activation: silu(gate) * up."""
    return jax.nn.silu(gate) * up


def swiglu_mlp(x: jax.Array, p: dict) -> jax.Array:
    """down(silu(gate(x)) * up(x)). p: gate_up [D, 2, I], down [I, D]. x: [T, D] -> [T, D]."""
    w = p["gate_up"]
    if isinstance(w, StackedWeight):
        gu = stacked_matmul(x, w)  # [T, 2, I]
        return linear(silu_mul(gu[..., 0, :], gu[..., 1, :]), p["down"])
    if is_quantized(w) and not is_packed(w):
        gu = linear(x, _flatten_gate_up(w))  # [T, 2I]
        inter = gu.shape[-1] // 2
        return linear(silu_mul(gu[..., :inter], gu[..., inter:]), p["down"])
    # No [D, 2, I] -> [D, 2I] reshape: with I split over devices (tensor parallel) the merged axis
    # could not keep the split, and XLA would reshuffle the weight every step. Same GEMM otherwise.
    # An FP8 / FP4 weight kept as stored dequantizes to [D, 2, I] the same way (gate and up blocked apart).
    gu = jnp.einsum("...d,dgi->...gi", x, weight(w, x.dtype))  # [T, 2, I]
    return linear(silu_mul(gu[..., 0, :], gu[..., 1, :]), p["down"])


def _flatten_gate_up(w):
    """[D, 2, I] -> [D, 2I] (gate columns first); quantized weights carry the same layout."""
    if is_quantized(w):
        return flatten_out_dims(w)
    return w.reshape(w.shape[0], -1)


# ------------------------------------------------------------------------------------------------
# Rotary embeddings
# ------------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [qk_rope_head_dim // 2] (fp32), YaRN-blended when rope_scaling is set.

    Follows HF `_compute_yarn_parameters` (= official `precompute_freqs_cis`): dims below `low`
    keep the base frequency, dims above `high` are divided by `factor`, linear ramp between.
    """
    d = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    freqs = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return freqs.astype(np.float32)

    def corr_dim(num_rot: float) -> float:
        return d * math.log(rs.original_max_position_embeddings / (num_rot * 2 * math.pi)) / (
            2 * math.log(base)
        )

    low = max(math.floor(corr_dim(rs.beta_fast)), 0)
    high = min(math.ceil(corr_dim(rs.beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    inv = freqs / rs.factor * ramp + freqs * (1.0 - ramp)
    return inv.astype(np.float32)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """Amplitude applied to cos/sin (HF's `attention_factor`); 1.0 for every released DeepSeek config."""
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0
    if rs.mscale and rs.mscale_all_dim:
        return yarn_get_mscale(rs.factor, rs.mscale) / yarn_get_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_get_mscale(rs.factor)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions: [...] int -> cos, sin: [..., qk_rope_head_dim // 2] fp32 (times the attention factor)."""
    inv = jnp.asarray(rope_inv_freq(cfg))
    angles = positions.astype(jnp.float32)[..., None] * inv  # [..., d/2]
    amp = rope_attention_factor(cfg)
    return jnp.cos(angles) * amp, jnp.sin(angles) * amp


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Pairwise (interleaved) rotation, DeepSeek's official layout.

    x: [*lead, *mid, d] with pairs (x[2i], x[2i+1]); cos/sin: [*lead, d/2], broadcast over `mid` (heads).
    y[2i] = x[2i] c - x[2i+1] s,  y[2i+1] = x[2i] s + x[2i+1] c. Computed in fp32, cast back.
    """
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    extra = x.ndim - cos.ndim
    c = cos.reshape(cos.shape[:-1] + (1,) * extra + cos.shape[-1:])
    s = sin.reshape(sin.shape[:-1] + (1,) * extra + sin.shape[-1:])
    x0, x1 = xf[..., 0], xf[..., 1]
    y = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    return y.reshape(x.shape).astype(x.dtype)
