"""All-to-all token dispatch for the routed experts under expert parallelism (`MeshRules.moe_dispatch`
"all_to_all"; `--all2all-backend all_to_all`).

The all-gather form (moe.py experts_sharded) hands every device every token of the step and reduce-scatters
the partial outputs back. Here each token goes only to the devices that hold one of its k experts, as
vLLM's and SGLang's all-to-all backends (DeepEP, pplx) and DeepSeek's own inference do:

1. Sources. The EP group is every device splitting the "expert" axis (TP x DP with --enable-expert-parallel).
   Devices of one data rank hold the same tokens (attention is data-parallel, replicated over "tensor"), so
   each of them takes a disjoint slice of them: T_s = ceil(T_r / tp) tokens a device.
2. Dispatch. A token is sent once to each device owning one of its experts (not once per copy), with its
   whole routing row (weights and global expert ids); the receiver computes only the copies of its own
   experts (moe.local_experts_f32, the same grouped GEMM as the all-gather form).
3. Buffers. `jax.lax.all_to_all` moves fixed-size buffers [n, C, D] (n devices, C rows for each). Dropless:
   C must hold the largest count of tokens any source sends to any device. The counts are exchanged first
   (a pmax of one int32), then the step runs the branch of a static capacity ladder (`capacity_ladder`:
   1/8, 1/4, 1/2, 3/4 of T_s rounded up to 8 rows, and T_s) that first fits: a balanced step sends a fraction
   of T_s rows, a skewed one falls back to the worst case C = T_s, and no token is ever dropped. Ladder
   branches (one compiled `lax.switch`) rather than a single worst-case buffer, which moves as many bytes as
   the all-gather form: a token of DeepSeek-V3 (k = 8 of 256 experts) reaches 66% of 8 devices and 12% of 64.
4. Combine. The expert outputs (fp32) go back by the inverse all-to-all into the same slots; each source
   sums its token's rows from every device, casts, and the slices of one data rank are all-gathered over
   the axes that split them (so every device of the rank again holds all of its T_r outputs).

XLA:CPU has no ragged all-to-all, so this fixed-size form is the one tested here (tests/sharding/
test_moe_dispatch.py) and the reference a ragged form (`jax.lax.ragged_all_to_all`, GPU) must equal.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from deepinfer_jax.models.parallel import MeshRules

ROW_MULTIPLE = 8  # buffer capacities are rounded up to this many rows
# The rungs of the capacity ladder, in eighths of T_s. 3/4: uniform routing of DeepSeek-V3 (k = 8 of 256) over
# 8 devices reaches a given device with a token's probability 0.66, which 1/2 would not hold.
LADDER_EIGHTHS = (1, 2, 4, 6, 8)


def capacity_ladder(tokens: int, eighths: tuple[int, ...] = LADDER_EIGHTHS, multiple: int = ROW_MULTIPLE
                    ) -> tuple[int, ...]:
    """The static buffer capacities (rows per destination device) for a source of `tokens` tokens, ascending;
    the last is `tokens` itself, the dropless worst case."""
    caps = {tokens}
    for e in eighths:
        c = -(-tokens * e // 8)
        c = -(-c // multiple) * multiple
        if c < tokens:
            caps.add(c)
    return tuple(sorted(caps))


def check_all_to_all(mr: MeshRules) -> None:
    """Refuse a layout the all-to-all form does not cover (ValueError naming the flag)."""
    exp, tok = mr.mesh_axes("expert"), mr.mesh_axes("tokens")
    if mr.size("expert") <= 1 or mr.size("moe_mlp") > 1 or not set(tok) <= set(exp):
        raise ValueError("--all2all-backend all_to_all needs expert parallelism (the experts split over every "
                         "device, their intermediate dim unsplit): set --enable-expert-parallel, or use "
                         "--all2all-backend allgather_reducescatter")


def _prod(mr: MeshRules, axes: tuple) -> int:
    return math.prod(mr.mesh.shape[a] for a in axes)


def all_to_all_local(mr: MeshRules, compute: Callable, ex_l: dict, x: jax.Array, w: jax.Array, idx: jax.Array,
                     layer: jax.Array | None, *, exp_axes: tuple, lead: tuple) -> jax.Array:
    """Inside shard_map, one device: its experts `ex_l` [(L,) E_local, ...], its data rank's tokens x [T_r, D]
    and routing w/idx [T_r, k] (global expert ids) -> the routed experts' output for those tokens [T_r, D].
    `compute(ex_l, x, w, idx, layer)`: this device's experts on the token copies routed to them, fp32 (moe.py
    local_experts_f32)."""
    T_r, D = x.shape
    out_dtype = x.dtype
    n = _prod(mr, exp_axes)  # devices of the EP group
    rep = tuple(a for a in exp_axes if a not in mr.mesh_axes("tokens"))  # axes holding the same tokens
    n_rep = _prod(mr, rep)
    Ts = -(-T_r // n_rep)  # this device's slice of its rank's tokens
    if Ts * n_rep != T_r:
        pad = Ts * n_rep - T_r
        x = jnp.pad(x, ((0, pad), (0, 0)))
        w = jnp.pad(w, ((0, pad), (0, 0)))
        idx = jnp.pad(idx, ((0, pad), (0, 0)), constant_values=-1)
    if rep:
        start = jax.lax.axis_index(rep) * Ts
        x, w, idx = (jax.lax.dynamic_slice_in_dim(a, start, Ts, axis=0) for a in (x, w, idx))
    E_local = jax.tree.leaves(ex_l["down"])[0].shape[len(lead)]
    dest = jnp.where(idx >= 0, idx // E_local, n)  # [Ts, k] the device of each copy (n: none)
    mask = jnp.any(dest[:, :, None] == jnp.arange(n)[None, None, :], axis=1)  # [Ts, n] token t goes to device j
    pos = jnp.cumsum(mask, axis=0, dtype=jnp.int32) - 1  # [Ts, n] its row in device j's buffer
    need = jax.lax.pmax(jnp.max(jnp.sum(mask, axis=0, dtype=jnp.int32)), exp_axes)  # the largest count anywhere
    ladder = capacity_ladder(Ts)

    def exchange(C: int):
        def run(x, w, idx):
            slot = jnp.where(mask, pos, C)  # [Ts, n]; C: not sent (dropped by the scatter)
            dev = jnp.broadcast_to(jnp.arange(n)[None, :], slot.shape)
            tok = jnp.broadcast_to(jnp.arange(Ts, dtype=jnp.int32)[:, None], slot.shape)
            src = jnp.full((n, C), Ts, jnp.int32).at[dev, slot].set(tok, mode="drop")  # [n, C] token a row; Ts: none
            xp, wp = (jnp.concatenate([a, jnp.zeros((1, a.shape[1]), a.dtype)]) for a in (x, w))
            ip = jnp.concatenate([idx, jnp.full((1, idx.shape[1]), -1, idx.dtype)])
            send = (xp[src], wp[src], ip[src])  # [n, C, D], [n, C, k] x2: the rows for each device
            recv = [jax.lax.all_to_all(a, exp_axes, 0, 0) for a in send]  # [n, C, ...] the rows from each device
            y = compute(ex_l, recv[0].reshape(n * C, D), recv[1].reshape(n * C, -1), recv[2].reshape(n * C, -1),
                        layer)  # [n C, D] fp32
            back = jax.lax.all_to_all(y.reshape(n, C, D), exp_axes, 0, 0)  # [n, C, D] rows of my tokens
            return jnp.zeros((Ts + 1, D), jnp.float32).at[src].add(back)[:Ts]  # [Ts, D] fp32, each token's sum

        return run

    if len(ladder) == 1:
        y = exchange(ladder[0])(x, w, idx)
    else:
        branch = sum((need > c).astype(jnp.int32) for c in ladder[:-1])  # the first capacity >= need
        y = jax.lax.switch(branch, [exchange(c) for c in ladder], x, w, idx)
    y = y.astype(out_dtype)
    if rep:
        y = jax.lax.all_gather(y, rep, axis=0, tiled=True)[:T_r]
    return y
