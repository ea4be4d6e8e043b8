"""DeepSeek-V4's attention over gathered cache rows with the sink, in Pallas (Triton backend).

Semantics are `v4_sparse_attention_reference`: for each query token t and head h, one softmax over the rows at
its slots in two caches, `a` (the sliding window's raw rows) and `b` (a CSA layer's chosen compressed rows, or an
HCA layer's rows), plus the head's sink logit, the rows being both keys and values (K = V, `head_dim` wide):

    s[l] = q[t, h] . row[l] * scale   (valid slots only)
    o[t, h] = sum_l softmax([s, sink[h]])[l] * row[l]

Grid: (token, head block). A program walks the token's `a` slots then its `b` slots `block_keys` at a time,
gathering the rows from the caches viewed as [slots, width] (the first `hd` columns: a csa row's index key after
them is not read), an fp32 online softmax whose running max starts at the sink (sum 1, accumulator 0): the sink
adds its term to the denominator and nothing to the values, and a fully masked block changes nothing.

`interpret=True` runs the same kernel on the CPU (tests); the reference defines correctness.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.mla_decode import NEG, softmax_step
from deepinfer_jax.kernels.triton_params import compiler_params

EXACT = jax.lax.Precision.HIGHEST

BLOCK_KEYS = 32  # rows gathered a loop step


def _kernel(sa_ref, va_ref, sb_ref, vb_ref, sink_ref, q_ref, a_ref, b_ref, o_ref, *, scale, block_keys):
    t = pl.program_id(0)
    q = q_ref[0]  # [bh, hd]
    hd = q.shape[-1]

    def walk(rows_ref, slot_ref, valid_ref, carry):
        def body(j, carry):
            keys = pl.ds(j * block_keys, block_keys)
            kv = rows_ref[slot_ref[t, keys], pl.ds(0, hd)]  # [bk, hd] gathered
            s = jnp.dot(q, kv.T, preferred_element_type=jnp.float32, precision=EXACT)  # [bh, bk]
            s = jnp.where(valid_ref[t, keys][None, :] != 0, s * scale, NEG)
            return softmax_step(s, kv, carry)

        return jax.lax.fori_loop(0, slot_ref.shape[1] // block_keys, body, carry)

    bh = q.shape[0]
    init = (jnp.zeros((bh, hd), jnp.float32), sink_ref[0].astype(jnp.float32), jnp.ones((bh,), jnp.float32))
    carry = walk(a_ref, sa_ref, va_ref, init)
    acc, _, l = walk(b_ref, sb_ref, vb_ref, carry)
    o_ref[0] = (acc / l[:, None]).astype(o_ref.dtype)


def pad_slots(slots: jax.Array, valid: jax.Array, block_keys: int = BLOCK_KEYS) -> tuple[jax.Array, jax.Array]:
    """slots / valid [T, n] -> int32 [T, n'], n' the multiple of block_keys at or above n (padding: slot 0,
    invalid; an invalid slot is read as slot 0)."""
    pad = -slots.shape[1] % block_keys
    ok = jnp.pad(valid, ((0, 0), (0, pad)))
    return jnp.where(ok, jnp.pad(slots, ((0, 0), (0, pad))), 0).astype(jnp.int32), ok.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "block_h", "block_keys", "num_warps", "num_stages",
                                             "interpret"))
def v4_sparse_attention(q, rows_a, slots_a, valid_a, rows_b, slots_b, valid_b, sinks, scale, *, block_h=16,
                        block_keys=BLOCK_KEYS, num_warps=4, num_stages=2, interpret=False):
    """q [T, H, hd], rows_a [Na, Wa] / rows_b [Nb, Wb] (Wa, Wb >= hd; the first hd columns are the row), slots /
    valid [T, n] int32 (`pad_slots`: n a multiple of block_keys), sinks [H] -> o [T, H, hd] in q's dtype."""
    T, H, hd = q.shape
    bh = min(block_h, H)
    assert H % bh == 0 and slots_a.shape[1] % block_keys == 0 and slots_b.shape[1] % block_keys == 0, (
        H, bh, slots_a.shape, slots_b.shape, block_keys)
    full = lambda a: pl.BlockSpec(a.shape, lambda t, h: (0,) * a.ndim)  # noqa: E731
    sinks = sinks.astype(jnp.float32).reshape(H // bh, bh)
    itemsize = min(rows_a.dtype.itemsize, rows_b.dtype.itemsize)
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_keys=block_keys),
        grid=(T, H // bh),
        in_specs=[
            full(slots_a), full(valid_a), full(slots_b), full(valid_b),
            pl.BlockSpec((1, bh), lambda t, h: (h, 0)),
            pl.BlockSpec((1, bh, hd), lambda t, h: (t, h, 0)),
            full(rows_a), full(rows_b),
        ],
        out_specs=pl.BlockSpec((1, bh, hd), lambda t, h: (t, h, 0)),
        out_shape=jax.ShapeDtypeStruct((T, H, hd), q.dtype),
        compiler_params=compiler_params(num_warps, num_stages if itemsize < 4 else 1, interpret),
        interpret=interpret,
    )(slots_a, valid_a, slots_b, valid_b, sinks, q, rows_a, rows_b)


def v4_sparse_attention_reference(q, rows_a, slots_a, valid_a, rows_b, slots_b, valid_b, sinks, scale):
    """The pure-JAX semantics of `v4_sparse_attention` (any n, no padding needed)."""
    hd = q.shape[-1]
    keys = jnp.concatenate([rows_a[slots_a, :hd], rows_b[slots_b, :hd]], axis=1).astype(jnp.float32)  # [T, n, hd]
    valid = jnp.concatenate([valid_a, valid_b], axis=1) != 0
    s = jnp.einsum("thd,tnd->thn", q.astype(jnp.float32), keys, precision=EXACT) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], s.shape[:2] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("thn,tnd->thd", p, keys, precision=EXACT).astype(q.dtype)
