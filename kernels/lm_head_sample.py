"""The lm_head and the base sampler's reductions over the vocabulary in one kernel (Pallas, Triton backend).

    h [T, D] (final-normed hidden states), W [D, V] (lm_head), per row t: temperature [T], key data [T, 2],
    suppressed ids [T, S] (-1 padded)
        -> TileStats, each [V // block_v, T]: per vocabulary tile and row, what sampling/sampler.py
           `sample_from_tile_stats` merges into the row's token and its logprob

The XLA path writes the fp32 logits [T, V] and the sampler reads them several times over (the row max
and log-normaliser, the suppression, the greedy argmax, the Gumbel draw and its argmax): ~50 us a step
on an H200 at batch 32 beside the lm_head's 104 (benchmarks/RESULTS.md, session 16; ~18 on an H100 in
session 33, the noise from sampling.noise_bits), and the draw's integer work is what the lm_head's weight
stream leaves the SMs time for. Neither form here has beaten XLA on the GPU (RunnerConfig's comments have the
figures). Here program v multiplies h by W's column tile v in block_k steps (fp32 accumulation), rounds
the logits to h's dtype as the XLA path's einsum does, and reduces the tile to (col = the tile's vocabulary ids):

    m            max of the logits                            (the row max: the log-normaliser's shift)
    s            sum of exp(logits - m)
    gmax, garg   max and first argmax of x = the logits with suppressed ids at -inf        (greedy)
    zmax, zarg   max and first argmax of z = x / t + noise(key, col), t the temperature   (the draw;
                 a greedy row, t < GREEDY_EPS, divides by 1 as sampling.sample does)
    zraw         the logit at zarg (the drawn token's logprob; a greedy token's logit is gmax)

The noise is the caller's (`noise`: sampling.gumbel_noise, elementwise jnp, the function the XLA path's
draw calls), so the merged draw is `sampling.sample`'s base variant's token for token: the Gumbel-max over
all V ids, the first maximum winning. `noise=None` is the greedy variant's form (every row greedy, no draw):
zmax, zarg, zraw are gmax, garg, gmax and no noise is computed.

Three parts (ARCHITECTURE.md rule 6): `lm_head_sample_stats` (the kernel; `interpret=True` runs it on
the CPU) and `lm_head_sample_stats_reference` (pure JAX over the XLA path's logits and the same
noise). Invariants: block_v (a power of two, at least 16) divides V and block_k D; T is padded to a
power of two of at least 16 rows (Triton's dot), the padding rows dropped.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.decode_matmul import largest_pow2_divisor
from deepinfer_jax.kernels.triton_params import compiler_params

# fp32 operands multiply in IEEE fp32 (Pallas-Triton's default precision is TF32); bf16 is unaffected.
EXACT = jax.lax.Precision.HIGHEST
GREEDY_EPS = 1e-5  # temperature below this => greedy (sampling.GREEDY_EPS)


class TileStats(NamedTuple):
    """Per vocabulary tile and row (each [tiles, T]): the module docstring's reductions."""
    m: jax.Array     # f32
    s: jax.Array     # f32
    gmax: jax.Array  # f32
    garg: jax.Array  # i32, a vocabulary id
    zmax: jax.Array  # f32
    zarg: jax.Array  # i32, a vocabulary id
    zraw: jax.Array  # f32


def supported(vocab: int, hidden: int) -> bool:
    """Whether the kernel tiles an lm_head [hidden, vocab]."""
    return largest_pow2_divisor(vocab, 128) >= 16 and largest_pow2_divisor(hidden, 128) >= 16


def tile_stats(logits, first, temperature, k0, k1, suppress_cols, noise) -> tuple:
    """One tile's reductions (module docstring): logits [T, n] f32 of vocabulary ids first .. first + n - 1,
    temperature [T], k0 / k1 [T, 1] uint32, suppress_cols a list of [T] suppressed ids (-1: none), `noise` the
    Gumbel noise (k0, k1, ids [T, n]) -> [T, n] f32, or None (no draw: the z stats are the greedy ones) -> seven
    [T] arrays in TileStats' order."""
    pos = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    col = first + pos
    suppressed = jnp.zeros(col.shape, jnp.bool_)
    for ids in suppress_cols:
        suppressed = suppressed | (col == ids[:, None])
    m = logits.max(axis=1)
    s = jnp.exp(logits - m[:, None]).sum(axis=1)
    x = jnp.where(suppressed, -jnp.inf, logits)
    gmax, garg = x.max(axis=1), jnp.argmax(x, axis=1).astype(jnp.int32)
    if noise is None:
        return m, s, gmax, garg + first, gmax, garg + first, gmax
    t = jnp.where(temperature < GREEDY_EPS, jnp.float32(1.0), temperature)
    z = x / t[:, None] + noise(k0, k1, col)
    zmax, zpos = z.max(axis=1), jnp.argmax(z, axis=1).astype(jnp.int32)
    zraw = jnp.where(pos == zpos[:, None], logits, -jnp.inf).max(axis=1)
    return m, s, gmax, garg + first, zmax, zpos + first, zraw


def _kernel(h_ref, w_ref, t_ref, k0_ref, k1_ref, sup_ref, *out_refs, block_v, block_k, num_suppress, noise):
    v = pl.program_id(0)
    cols = pl.ds(v * block_v, block_v)

    def body(i, acc):
        ks = pl.ds(i * block_k, block_k)
        return acc + jnp.dot(h_ref[:, ks], w_ref[ks, cols], preferred_element_type=jnp.float32, precision=EXACT)

    rows, d = h_ref.shape
    acc = jax.lax.fori_loop(0, d // block_k, body, jnp.zeros((rows, block_v), jnp.float32))
    logits = acc.astype(h_ref.dtype).astype(jnp.float32)  # the XLA path's einsum output, in fp32
    stats = tile_stats(logits, v * block_v, t_ref[...], k0_ref[...][:, None], k1_ref[...][:, None],
                       [sup_ref[:, j] for j in range(num_suppress)], noise)
    for ref, x in zip(out_refs, stats):
        ref[0, :] = x


@functools.partial(jax.jit, static_argnames=("noise", "block_v", "block_k", "num_warps", "num_stages", "interpret"))
def lm_head_sample_stats(h, w, temperature, key_data, suppress_ids, *, noise, block_v=None, block_k=None, num_warps=4,
                         num_stages=4, interpret=False) -> TileStats:
    """h [T, D], w [D, V] (the lm_head, h's dtype), temperature [T] f32, key_data [T, 2] uint32, suppress_ids
    [T, S] int32 (-1 padded; S may be 0), `noise` the sampler's Gumbel noise (sampling.gumbel_noise: elementwise
    jnp) -> TileStats of [V // block_v, T] arrays (module docstring).
    Tiles left as None: the largest powers of two dividing V up to 128 and D up to 64 (two CTAs an SM with four
    stages of bf16 tiles, as kernels/decode_matmul.py's)."""
    T, D = h.shape
    D2, V = w.shape
    assert D == D2 and supported(V, D), (h.shape, w.shape)
    block_v = block_v or largest_pow2_divisor(V, 128)
    block_k = block_k or largest_pow2_divisor(D, 64)
    rows = max(16, 1 << (T - 1).bit_length())

    def pad(a, fill=0):
        return a if rows == T else jnp.concatenate([a, jnp.full((rows - T, *a.shape[1:]), fill, a.dtype)])

    key_data = key_data.astype(jnp.uint32)
    num_suppress = suppress_ids.shape[1]
    sup = suppress_ids.astype(jnp.int32) if num_suppress else jnp.full((T, 1), -1, jnp.int32)
    args = (pad(h.astype(w.dtype)), w, pad(temperature.astype(jnp.float32), 1.0), pad(key_data[:, 0]),
            pad(key_data[:, 1]), pad(sup, -1))
    tiles = V // block_v
    stages = num_stages if w.dtype.itemsize < 4 else 1  # fp32 tiles: one stage fits in shared memory
    dtypes = [jnp.int32 if name in ("garg", "zarg") else jnp.float32 for name in TileStats._fields]
    out = pl.pallas_call(
        functools.partial(_kernel, block_v=block_v, block_k=block_k, num_suppress=num_suppress, noise=noise),
        grid=(tiles,),
        out_shape=[jax.ShapeDtypeStruct((tiles, rows), dt) for dt in dtypes],
        out_specs=[pl.BlockSpec((1, rows), lambda v: (v, 0)) for _ in dtypes],
        compiler_params=compiler_params(num_warps, stages, interpret), interpret=interpret,
    )(*args)
    return TileStats(*(a[:, :T] for a in out))


def logits_supported(vocab: int) -> bool:
    """Whether `logits_sample_stats` tiles a vocabulary of `vocab` ids."""
    return largest_pow2_divisor(vocab, 128) >= 16


def _logits_kernel(l_ref, t_ref, k0_ref, k1_ref, sup_ref, *out_refs, block_v, num_suppress, noise):
    stats = tile_stats(l_ref[...], pl.program_id(0) * block_v, t_ref[...], k0_ref[...][:, None],
                       k1_ref[...][:, None], [sup_ref[:, j] for j in range(num_suppress)], noise)
    for ref, x in zip(out_refs, stats):
        ref[0, :] = x


@functools.partial(jax.jit, static_argnames=("noise", "block_t", "block_v", "num_warps", "interpret"))
def logits_sample_stats(logits, temperature, key_data, suppress_ids, *, noise, block_t=None, block_v=None,
                        num_warps=8, interpret=False) -> TileStats:
    """The same reductions over the XLA lm_head's fp32 logits [T, V] (the sampler's base variant after XLA's GEMM:
    one pass over the logits instead of XLA's several, RunnerConfig.sampler_kernel): temperature [T] f32, key_data
    [T, 2] uint32, suppress_ids [T, S] int32 (-1 padded; S may be 0) -> TileStats of [V // block_v, T] arrays.
    Grid (V // block_v, T // block_t), program (v, tb) reducing rows tb * block_t .. of column tile v. Tiles left as
    None: block_t the largest power of two dividing T up to 32, block_v the largest dividing V up to 16,384 ids a
    program (512 at 32 rows)."""
    T, V = logits.shape
    assert logits_supported(V), logits.shape
    block_t = block_t or largest_pow2_divisor(T, 32)
    block_v = block_v or largest_pow2_divisor(V, max(16, 16384 // block_t))
    assert T % block_t == 0 and V % block_v == 0, (logits.shape, block_t, block_v)
    num_suppress = suppress_ids.shape[1]
    sup = suppress_ids.astype(jnp.int32) if num_suppress else jnp.full((T, 1), -1, jnp.int32)
    key_data = key_data.astype(jnp.uint32)
    tiles, rows = V // block_v, pl.BlockSpec((block_t,), lambda v, tb: (tb,))
    dtypes = [jnp.int32 if name in ("garg", "zarg") else jnp.float32 for name in TileStats._fields]
    out = pl.pallas_call(
        functools.partial(_logits_kernel, block_v=block_v, num_suppress=num_suppress, noise=noise),
        grid=(tiles, T // block_t),
        in_specs=[pl.BlockSpec((block_t, block_v), lambda v, tb: (tb, v)), rows, rows, rows,
                  pl.BlockSpec((block_t, sup.shape[1]), lambda v, tb: (tb, 0))],
        out_shape=[jax.ShapeDtypeStruct((tiles, T), dt) for dt in dtypes],
        out_specs=[pl.BlockSpec((1, block_t), lambda v, tb: (v, tb)) for _ in dtypes],
        compiler_params=compiler_params(num_warps, 1, interpret), interpret=interpret,
    )(logits.astype(jnp.float32), temperature.astype(jnp.float32), key_data[:, 0], key_data[:, 1], sup)
    return TileStats(*out)


def lm_head_sample_stats_reference(h, w, temperature, key_data, suppress_ids, *, noise, block_v=None) -> TileStats:
    """Pure JAX: the XLA path's logits (einsum in h's dtype, then fp32), then `logits_sample_stats_reference`."""
    V = w.shape[1]
    logits = jnp.einsum("td,dv->tv", h.astype(w.dtype), w).astype(jnp.float32)  # [T, V]
    return logits_sample_stats_reference(logits, temperature, key_data, suppress_ids, noise=noise,
                                         block_v=block_v or largest_pow2_divisor(V, 128))


def logits_sample_stats_reference(logits, temperature, key_data, suppress_ids, *, noise, block_v) -> TileStats:
    """Pure JAX: the same noise over [T, V] and the same reductions over [T, V // block_v, block_v] tiles of the
    fp32 logits [T, V]."""
    T, V = logits.shape
    col = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (T, V))
    kd = key_data.astype(jnp.uint32)
    sup = jnp.zeros((T, V), jnp.bool_)
    for j in range(suppress_ids.shape[1]):
        sup = sup | (col == suppress_ids[:, j : j + 1])
    x = jnp.where(sup, -jnp.inf, logits)
    t = jnp.where(temperature < GREEDY_EPS, 1.0, temperature).astype(jnp.float32)
    tiles = lambda a: a.reshape(T, V // block_v, block_v)  # noqa: E731  [T, tiles, block_v]
    lg, xt = tiles(logits), tiles(x)
    m = lg.max(axis=2)
    first = jnp.arange(V // block_v, dtype=jnp.int32)[None, :] * block_v
    gmax, garg = xt.max(axis=2), jnp.argmax(xt, axis=2).astype(jnp.int32) + first
    z_stats = (gmax, garg, gmax)  # no noise: the greedy variant's form
    if noise is not None:
        zt = tiles(x / t[:, None] + noise(kd[:, :1], kd[:, 1:], col))
        zpos = jnp.argmax(zt, axis=2).astype(jnp.int32)
        z_stats = (zt.max(axis=2), zpos + first, jnp.take_along_axis(lg, zpos[..., None], axis=2)[..., 0])
    stats = (m, jnp.exp(lg - m[..., None]).sum(axis=2), gmax, garg, *z_stats)
    return TileStats(*(a.T for a in stats))
