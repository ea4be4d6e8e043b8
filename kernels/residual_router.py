"""The decode layer's path from o_proj to the router in one kernel: o_proj's split-K partial sums added
up and to the residual, the post-attention RMSNorm, and the router's logits (Pallas, Triton backend).

    parts [S, Tp, D] fp32   (kernels/decode_matmul.py's split-K partials of o_proj, Tp >= T rows)
    h [T, D]                (the residual stream before the attention's output is added)
    norm_w [L, D]           (post_attention_layernorm, layer-stacked; row `layer` is used)
    gate [L, D, E]          (the router's weight, layer-stacked; layer `layer` is used)
        -> h_new [T, D]  = h + round(sum_s parts[s, :T])                    (h's dtype)
           x [T, D]      = rms_norm(h_new, norm_w[layer])                   (HF's arithmetic, models/layers.py)
           logits [T, E] = x . gate[layer], fp32 sums of the exact fp32 products (models/moe.py router_logits)

In XLA the same is four kernels a layer, each 1.6-2.2 us on an H200 at batch 32 however little it does
(the partials' sum with the residual add, the RMSNorm, a split-K router GEMM and its reduce; 7.2 us,
benchmarks/RESULTS.md, session 10). Measured in the step (session 11): this kernel takes 11.8 us, so it
is off by default (RunnerConfig.decode_router_kernel); each program's serial walk over its token's
partial rows, on one SM, costs more than XLA's four launches.

Grid (T, E // block_e). Program (t, eb) sums token t's row of the partials, adds the residual and takes
the row's RMS (the whole row, D values), writes h_new and x (the eb = 0 programs only), then walks the
row again in block_d chunks, recomputing x's chunk (the same elementwise arithmetic, so the same values)
and contracting it with the [block_d, block_e] tile of the gate. The second pass reads from L1 / L2 what
the first read; it saves holding a [D, block_e] product in registers.

Three parts (ARCHITECTURE.md rule 6): `residual_norm_router` (the kernel; `interpret=True` runs it on
the CPU) and `residual_norm_router_reference` (pure JAX: the model's own functions). Invariants: block_d
divides D and block_e divides E (both powers of two); rows of `parts` past T are never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def supported(D: int, E: int, block_d: int = 256, block_e: int = 16) -> bool:
    pow2 = lambda n: n >= 1 and n & (n - 1) == 0  # noqa: E731
    return pow2(D) and pow2(E) and D % min(block_d, D) == 0 and E % min(block_e, E) == 0


def _kernel(layer_ref, parts_ref, h_ref, nw_ref, g_ref, h_out, x_out, lg_out, *, S, eps, block_d, block_e):
    t, eb = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    D = h_ref.shape[1]
    hdt, xdt = h_out.dtype, x_out.dtype

    def residual(cols):  # h + round(sum_s parts[s, t]) on `cols`, in h's dtype
        o = parts_ref[0, t, cols]
        for s in range(1, S):
            o = o + parts_ref[s, t, cols]
        return (h_ref[t, cols].astype(jnp.float32) + o.astype(hdt).astype(jnp.float32)).astype(hdt)

    def normed(hn, rstd, cols):  # rms_norm's arithmetic: normalise in fp32, round, times the weight
        n = (hn.astype(jnp.float32) * rstd).astype(hdt).astype(jnp.float32)
        return (nw_ref[layer, cols].astype(jnp.float32) * n).astype(xdt)

    whole = pl.ds(0, D)
    hn = residual(whole)  # [D]
    hf = hn.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(hf * hf) / D + eps)

    @pl.when(eb == 0)
    def _():
        h_out[t, whole] = hn
        x_out[t, whole] = normed(hn, rstd, whole)

    experts = pl.ds(eb * block_e, block_e)

    def body(c, acc):
        cols = pl.ds(c * block_d, block_d)
        x = normed(residual(cols), rstd, cols).astype(jnp.float32)  # [bd]
        g = g_ref[layer, cols, experts].astype(jnp.float32)  # [bd, be]
        return acc + jnp.sum(x[:, None] * g, axis=0)

    lg_out[t, experts] = jax.lax.fori_loop(0, D // block_d, body, jnp.zeros((block_e,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("eps", "block_d", "block_e", "num_warps", "interpret"))
def residual_norm_router(parts, h, norm_w, gate, layer, *, eps, block_d=256, block_e=16, num_warps=4,
                         interpret=False):
    """parts [S, Tp, D] fp32, h [T, D], norm_w [L, D], gate [L, D, E], layer: int32 scalar -> (h_new [T, D]
    in h's dtype, x [T, D] in rms_norm's dtype, logits [T, E] fp32); the module docstring."""
    S, Tp, D = parts.shape
    T, D2 = h.shape
    _, D3, E = gate.shape
    block_d, block_e = min(block_d, D), min(block_e, E)
    assert D == D2 == D3 == norm_w.shape[1] and Tp >= T and supported(D, E, block_d, block_e), (
        parts.shape, h.shape, norm_w.shape, gate.shape)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    x_dtype = jnp.promote_types(norm_w.dtype, h.dtype)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
    return pl.pallas_call(
        functools.partial(_kernel, S=S, eps=float(eps), block_d=block_d, block_e=block_e),
        grid=(T, E // block_e),
        out_shape=(jax.ShapeDtypeStruct((T, D), h.dtype), jax.ShapeDtypeStruct((T, D), x_dtype),
                   jax.ShapeDtypeStruct((T, E), jnp.float32)),
        compiler_params=params, interpret=interpret,
    )(layer, parts, h, norm_w, gate)


def residual_norm_router_reference(parts, h, norm_w, gate, layer, *, eps):
    """Pure JAX, the model's arithmetic (kernels do not import models: a test ties this to
    `layers.rms_norm` and `moe.router_logits`): h + o_proj's output in h's dtype, the RMSNorm, and the
    router's fp32 logits (products of the two operands' values, summed in fp32)."""
    T = h.shape[0]
    h_new = h + parts.sum(axis=0)[:T].astype(h.dtype)
    hf = h_new.astype(jnp.float32)
    normed = (hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)).astype(h.dtype)
    x = jax.lax.dynamic_index_in_dim(norm_w, layer, keepdims=False) * normed
    g = jax.lax.dynamic_index_in_dim(gate, layer, keepdims=False)
    logits = jnp.einsum("td,de->te", x.astype(jnp.float32), g.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    return h_new, x, logits
