"""Decode-size projections that read one layer's weight in place from the layer-stacked array, in
Pallas (Triton backend).

    y = x @ W[layer]        x [T, K] (a decode step's few tokens), W [L, K, N] -> y [T, N]

The model keeps each projection's weights stacked over layers for `lax.scan`. At decode sizes a
projection is a weight stream (T rows against K x N weights). XLA sent o_proj to cuBLAS, which cannot
take a slice of the stacked array, so every layer first copied its 8 MB slice (5.0 us) and then
multiplied (4.1 us); this kernel does both in 4.8 us (H200, V2-Lite, batch 32; benchmarks/RESULTS.md).
DeepSeek uses it for o_proj and the dense MLP (models/decode_kernels.py: STACKABLE); its q / kv_a
projections stay with XLA's fused split-K GEMM (7.5 us, against 10.5 for this kernel's two launches). The
dense families use it for every projection (models/dense.py: STACKABLE).

Grid (N // block_n, split_k). Program (n, s) multiplies x[:, K chunk s] by W[layer, chunk s, column tile
n] in block_k steps, fp32 accumulation, and writes its partial sum; the split_k partials [split_k, T, N]
fp32 are added in JAX, where XLA fuses the sum into the consumer. `plan` picks the tiles so that about
128 programs stream the weight at once.

Three parts (ARCHITECTURE.md rule 6): `decode_matmul` (the kernel; `interpret=True` runs it on the CPU)
and `decode_matmul_reference` (pure JAX, the same result up to fp32 summation order). Invariants: T is
padded to a power of two of at least 16 rows (Triton's dot) and the padding rows are dropped; block_n
divides N, split_k * block_k divides K (split_k need not be a power of two: it only counts programs).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.triton_params import compiler_params

# fp32 operands multiply in IEEE fp32 (Pallas-Triton's default precision is TF32); bf16 is unaffected.
EXACT = jax.lax.Precision.HIGHEST

# Steps of at most this many tokens use the kernel (RunnerConfig.decode_projection_kernel); larger
# steps are GEMMs that XLA's tiles serve well.
MAX_TOKENS = 64
TARGET_PROGRAMS = 128  # about one program per SM of an H200 (132)


def largest_pow2_divisor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


class Launch(NamedTuple):
    """One decode projection's launch: its tiles, K chunks and Triton's warps and pipeline stages."""
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def plan(K: int, N: int) -> Launch | None:
    """The launch for a [K, N] weight, or None when no power-of-two tiling of at least 16 fits (the
    caller then keeps XLA's GEMM)."""
    block_n = largest_pow2_divisor(N, 128)
    block_k = largest_pow2_divisor(K, 64)
    if block_n < 16 or block_k < 16:
        return None
    return Launch(block_n, block_k, fewest_chunks(N // block_n, K // block_k))


def fewest_chunks(tiles: int, steps: int, programs: int = TARGET_PROGRAMS) -> int:
    """The fewest K chunks (a divisor of the K steps) that bring `tiles` column tiles to `programs` programs, or
    every step its own chunk."""
    return next((d for d in range(1, steps + 1) if steps % d == 0 and tiles * d >= programs), steps)


def supported(num_tokens: int, K: int, N: int) -> bool:
    return num_tokens <= MAX_TOKENS and plan(K, N) is not None


def _decode_matmul_kernel(layer_ref, x_ref, w_ref, o_ref, *, block_n, block_k, k_steps):
    n, s = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    cols = pl.ds(n * block_n, block_n)

    def body(i, acc):
        ks = pl.ds((s * k_steps + i) * block_k, block_k)
        return acc + jnp.dot(x_ref[:, ks], w_ref[layer, ks, cols], preferred_element_type=jnp.float32,
                             precision=EXACT)

    acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((x_ref.shape[0], block_n), jnp.float32))
    o_ref[s, :, cols] = acc


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "split_k", "num_warps", "num_stages",
                                             "reduce", "interpret"))
def decode_matmul(x, w, layer, *, block_n=None, block_k=None, split_k=None, num_warps=None, num_stages=None,
                  reduce=True, interpret=False):
    """x [T, K], w [L, K, N] (stacked over layers), layer: int32 scalar -> x @ w[layer], [T, N] fp32.
    Launch parameters left as None come from `plan(K, N)`. `reduce=False`: the split-K partials [split_k, rows, N]
    fp32 instead (rows: T padded to a power of two of at least 16), for a launch that adds them up itself
    (kernels/residual_route.py, kernels/route_experts.py)."""
    T, K = x.shape
    _, K2, N = w.shape
    assert K == K2, (x.shape, w.shape)
    auto = plan(K, N)
    if auto is None:
        raise ValueError(f"decode_matmul: no power-of-two tiling for a [{K}, {N}] weight")
    block_n, block_k, split_k, num_warps, num_stages = (
        a if v is None else v for v, a in zip((block_n, block_k, split_k, num_warps, num_stages), auto))
    rows = max(16, 1 << (T - 1).bit_length())
    xp = x.astype(w.dtype)
    if rows != T:
        xp = jnp.zeros((rows, K), w.dtype).at[:T].set(xp)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    stages = num_stages if w.dtype.itemsize < 4 else 1  # fp32 tiles: one stage fits in shared memory
    params = compiler_params(num_warps, stages, interpret)
    part = pl.pallas_call(
        functools.partial(_decode_matmul_kernel, block_n=block_n, block_k=block_k, k_steps=K // (split_k * block_k)),
        grid=(N // block_n, split_k), out_shape=jax.ShapeDtypeStruct((split_k, rows, N), jnp.float32),
        compiler_params=params, interpret=interpret,
    )(layer, xp, w)
    return part.sum(axis=0)[:T] if reduce else part


def decode_matmul_reference(x, w, layer):
    """Pure JAX: x [T, K] @ w[layer] [K, N] -> [T, N] fp32."""
    wl = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    return jnp.dot(x.astype(wl.dtype), wl, preferred_element_type=jnp.float32, precision=EXACT)
