"""Host-side derivation of per-token PRNG key data (numpy only, no device work).

The sampler consumes key data ``u32[B, 2]`` (its draw hashes a row's two words with each
vocabulary id: draw.noise_bits), derived with threefry2x32. For a seeded request the
key for its ``step``-th output token (``step = num_output_tokens`` so far) is::

    jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), step))

Invariants:
  * ``make_key_data(seed, step)`` equals the expression above bit for bit for every
    ``0 <= seed < 2**32`` (under JAX's default 32-bit mode, where ``PRNGKey`` keeps only the
    low 32 bits of the seed), and for every ``0 <= seed < 2**64`` with ``jax_enable_x64``.
    Seeds are taken modulo 2**64 (negative seeds in two's complement), so distinct 64-bit
    seeds give distinct keys.
  * ``step`` is taken modulo 2**32, as ``fold_in`` does.
  * The result depends only on ``(seed, step)``: never on batch position or composition,
    so a seeded request reproduces its tokens in any batch.

Threefry is evaluated in numpy so a decode step can build keys for a whole batch with
one vectorised call (``make_key_data_batch``) instead of one device dispatch per row.
"""

from __future__ import annotations

import numpy as np

_M32 = 0xFFFFFFFF
_ROT0 = (13, 15, 26, 6)
_ROT1 = (17, 29, 16, 24)


def _rotl(x: np.ndarray, d: int) -> np.ndarray:
    return (x << np.uint32(d)) | (x >> np.uint32(32 - d))


def threefry2x32(k1: np.ndarray, k2: np.ndarray, x0: np.ndarray,
                 x1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 (20 rounds) exactly as jax's lowering; all args u32[N], wrap-around."""
    k1, k2, x0, x1 = (np.asarray(a, np.uint32) for a in (k1, k2, x0, x1))
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x = [x0 + ks[0], x1 + ks[1]]
    for i in range(5):
        for r in (_ROT0 if i % 2 == 0 else _ROT1):
            x[0] = x[0] + x[1]
            x[1] = _rotl(x[1], r) ^ x[0]
        x[0] = x[0] + ks[(i + 1) % 3]
        x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x[0], x[1]


def make_key_data_batch(seeds, steps) -> np.ndarray:
    """Vectorised key data: seeds int[N] (any Python/numpy ints; a uint64 array is taken as it is), steps int[N]
    (an integer array is taken modulo 2**32 without a Python loop) -> u32[N, 2]."""
    if isinstance(seeds, np.ndarray) and seeds.dtype == np.uint64:
        seeds = seeds.ravel()
    else:
        seeds = np.asarray([int(s) % (1 << 64) for s in np.ravel(seeds)], dtype=np.uint64)
    if isinstance(steps, np.ndarray) and steps.dtype.kind in "iu":
        steps = (steps.ravel().astype(np.int64) & _M32).astype(np.uint32)
    else:
        steps = np.asarray([int(s) & _M32 for s in np.ravel(steps)], dtype=np.uint32)
    if seeds.shape != steps.shape:
        raise ValueError(f"seeds {seeds.shape} and steps {steps.shape} differ")
    k1 = (seeds >> np.uint64(32)).astype(np.uint32)      # PRNGKey: [hi32, lo32]
    k2 = (seeds & np.uint64(_M32)).astype(np.uint32)
    zeros = np.zeros_like(steps)
    o0, o1 = threefry2x32(k1, k2, zeros, steps)          # fold_in: hash of count [0, step]
    return np.stack([o0, o1], axis=-1).astype(np.uint32)


def make_key_data(seed: int, step: int) -> np.ndarray:
    """u32[2] key data for token ``step`` of a request seeded with ``seed``."""
    return make_key_data_batch([seed], [step])[0]
