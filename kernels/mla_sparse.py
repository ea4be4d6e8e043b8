"""Sparse MLA attention (absorbed form) over the keys the lightning indexer selected (DeepSeek Sparse Attention,
V3.2), in Pallas (Triton backend).

Semantics are `dsa_reference.paged_dsa_attention_reference` given the selection: for each query token t, MQA of
its H absorbed query heads against the latents [c_kv | k_pe] of its selected keys only (k = index_topk of them,
whatever the context's length), fp32 online softmax, c_kv as the values.

Grid: (token, head block). A program walks the token's k selected keys `block_keys` at a time: their cache
slots (page * page_size + offset, resolved from the page table in XLA) gather the block's latent rows out of
the cache viewed as [L, P * page_size, W], a free reshape. Slots past the selected keys are masked (`valid`).

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

BLOCK_KEYS = 32  # selected keys gathered a loop step


def _kernel(layer_ref, slot_ref, valid_ref, ql_ref, qp_ref, kv_ref, o_ref, *, rank, scale, block_keys):
    t = pl.program_id(0)
    layer = layer_ref[0]
    q_lat, q_pe = ql_ref[0, 0], qp_ref[0, 0]  # [bh, R], [bh, dr]
    dr = q_pe.shape[-1]
    n_blocks = slot_ref.shape[1] // block_keys

    def body(j, carry):
        keys = pl.ds(j * block_keys, block_keys)
        slots = slot_ref[t, keys]  # [bk]
        kv = kv_ref[layer, slots, pl.ds(0, rank)]  # [bk, R] gathered
        pe = kv_ref[layer, slots, pl.ds(rank, dr)]  # [bk, dr]
        s = jnp.dot(q_lat, kv.T, preferred_element_type=jnp.float32, precision=EXACT)
        s = s + jnp.dot(q_pe, pe.T, preferred_element_type=jnp.float32, precision=EXACT)  # [bh, bk]
        s = jnp.where(valid_ref[t, keys][None, :] != 0, s * scale, NEG)
        return softmax_step(s, kv, carry)

    bh = q_lat.shape[0]
    init = (jnp.zeros((bh, rank), jnp.float32), jnp.full((bh,), NEG, jnp.float32), jnp.zeros((bh,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(0, n_blocks, body, init)
    o_ref[0, 0] = (acc / l[:, None]).astype(o_ref.dtype)


def selected_slots(idx, valid, seq_ids, page_table, page_size: int, block_keys: int):
    """Selected key positions idx [T, k] (and valid [T, k]) -> their cache slots and validity [T, k'] int32, k'
    the multiple of block_keys at or above k (padding: slot 0 of the null page, invalid)."""
    pages = jnp.take_along_axis(page_table[seq_ids], idx // page_size, axis=1)  # [T, k]
    slots = pages * page_size + idx % page_size
    pad = -idx.shape[1] % block_keys
    slots = jnp.pad(jnp.where(valid, slots, 0), ((0, 0), (0, pad)))
    return slots.astype(jnp.int32), jnp.pad(valid, ((0, 0), (0, pad))).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "block_h", "block_keys", "num_warps", "num_stages",
                                             "interpret"))
def sparse_mla_attention(q_lat, q_pe, kv_cache, layer, slots, valid, scale, *, block_h=16, block_keys=BLOCK_KEYS,
                         num_warps=4, num_stages=2, interpret=False):
    """q_lat [T, H, R], q_pe [T, H, dr], kv_cache [L, P, ps, W] (latent in its first R + dr columns), layer: int32
    scalar, slots / valid [T, k] int32 (`selected_slots`, k a multiple of block_keys, each token's first slot
    valid) -> o_lat [T, H, R] in q_lat's dtype."""
    T, H, R = q_lat.shape
    dr = q_pe.shape[-1]
    L, P, ps, W = kv_cache.shape
    bh = min(block_h, H)
    assert H % bh == 0 and slots.shape[1] % block_keys == 0, (H, bh, slots.shape, block_keys)
    nh = H // bh
    kv = kv_cache.reshape(L, P * ps, W)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    full = lambda a: pl.BlockSpec(a.shape, lambda t, h: (0,) * a.ndim)  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, rank=R, scale=scale, block_keys=block_keys),
        grid=(T, nh),
        in_specs=[
            full(layer), full(slots), full(valid),
            pl.BlockSpec((1, 1, bh, R), lambda t, h: (t, h, 0, 0)),
            pl.BlockSpec((1, 1, bh, dr), lambda t, h: (t, h, 0, 0)),
            full(kv),
        ],
        out_specs=pl.BlockSpec((1, 1, bh, R), lambda t, h: (t, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((T, nh, bh, R), q_lat.dtype),
        compiler_params=compiler_params(num_warps, num_stages if kv.dtype.itemsize < 4 else 1, interpret),
        interpret=interpret,
    )(layer, slots, valid, q_lat.reshape(T, nh, bh, R), q_pe.reshape(T, nh, bh, dr), kv)
    return out.reshape(T, H, R)
