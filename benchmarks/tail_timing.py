"""What lm_head_sweep.py and sampler_sweep.py share: the decode tail's inputs at V2-Lite's shape and the chained
timer. Nothing here runs on import beyond numpy; jax is imported by the callers first."""

from __future__ import annotations

import time

import numpy as np


def tail_inputs(batch: int, hidden: int, vocab: int, seed: int = 0):
    """(h0 [B, D] bf16 N(0, 1), w [D, V] bf16 U(+-0.05), keys [B, 2] uint32): the same draws in every sweep."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    h0 = jnp.asarray(rng.normal(size=(batch, hidden)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(-0.05, 0.05, size=(hidden, vocab)), jnp.bfloat16)
    keys = rng.integers(0, 2**32, size=(batch, 2), dtype=np.uint32)
    return h0, w, keys


def chained_us(fn, h0, *, repeat: int, iters: int) -> float:
    """Device microseconds per call of `fn(h) -> f32 [B]`: `repeat` calls chained in one jitted program, each
    input depending on the last result through a float product (XLA folds an integer `x * 0` and then CSEs the
    copies: session 22's first sweep), run `iters` times after a warm-up."""
    import jax

    def chain(h):
        for _ in range(repeat):
            out = fn(h)
            h = h + (out[:, None] * 0.0).astype(h.dtype)
        return out
    prog = jax.jit(chain)
    jax.block_until_ready(prog(h0))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = prog(h0)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / (iters * repeat) * 1e6
