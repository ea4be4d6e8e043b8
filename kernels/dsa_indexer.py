"""The lightning indexer's scores over the paged cache (DeepSeek Sparse Attention, V3.2) in Pallas (Triton
backend), and the top-k selection that follows them.

Semantics are `dsa_reference`: for each query token t, index[t, l] = sum_h iw[t, h] relu(iq[t, h] . ik[l])
over the index keys ik (the last Di columns of each cache entry) of its own sequence, -inf past its position.

Grid: (token, key split). A program walks its share of the sequence's pages through the page table (the
batch's longest context divided over the splits), one page a step: the page's index keys [ps, Di] against
the token's Hi query heads, ReLU, the heads' weighted sum, written as the page's ps scores. The scores
[T, max_pages * ps] then go to XLA's top-k (`select_topk`), whose indices are the selected keys' positions.

`interpret=True` runs the same kernel on the CPU (tests); the reference defines correctness.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.triton_params import compiler_params

EXACT = jax.lax.Precision.HIGHEST  # fp32 operands multiply in IEEE fp32 (Triton's default is TF32)


def _kernel(layer_ref, pps_ref, seq_ref, pos_ref, pt_ref, iq_ref, iw_ref, kv_ref, _init_ref, o_ref, *, page_size,
            key_start):
    t, sp = pl.program_id(0), pl.program_id(1)
    layer, seq, pos, per_split = layer_ref[0], seq_ref[t], pos_ref[t], pps_ref[0]
    n_pages = pos // page_size + 1
    first = sp * per_split
    last = jnp.minimum(first + per_split, n_pages)
    q = iq_ref[0]  # [Hi, Di]
    w = iw_ref[0]  # [Hi, 1] fp32
    di = q.shape[-1]

    def body(i, carry):
        k = kv_ref[layer, pt_ref[seq, i], :, pl.ds(key_start, di)]  # [ps, Di]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=EXACT)  # [Hi, ps]
        score = jnp.sum(w * jnp.maximum(s, 0.0), axis=0)  # [ps]
        key_pos = i * page_size + jnp.arange(page_size)
        o_ref[0, pl.ds(i * page_size, page_size)] = jnp.where(key_pos <= pos, score, -jnp.inf)
        return carry

    jax.lax.fori_loop(first, jnp.maximum(last, first), body, ())


def auto_splits(num_tokens: int) -> int:
    """Context splits for a step of `num_tokens` query tokens: about 512 (token, split) programs, at most 64 (a
    decode step of a few long sequences still spreads its pages over the GPU; a prefill step needs no split)."""
    return max(1, min(64, 512 // max(1, num_tokens)))


@functools.partial(jax.jit, static_argnames=("key_start", "num_splits", "num_warps", "num_stages", "interpret"))
def paged_index_scores(iq, iw, kv_cache, layer, seq_ids, positions, page_table, *, key_start, num_splits=None,
                       num_warps=4, num_stages=2, interpret=False):
    """iq [T, Hi, Di], iw [T, Hi] fp32, kv_cache [L, P, ps, W] (the index key in columns key_start..+Di), layer:
    int32 scalar -> scores [T, max_pages * ps] fp32, -inf at keys past each token's position. num_splits None:
    auto_splits(T); the pages of the batch's longest context are divided evenly over the splits."""
    T, Hi, Di = iq.shape
    _, _, ps, _ = kv_cache.shape
    max_pages = page_table.shape[1]
    splits = max(1, min(auto_splits(T) if num_splits is None else num_splits, max_pages))
    longest = jnp.max(positions) // ps + 1
    pps = ((longest + splits - 1) // splits).astype(jnp.int32).reshape(1)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    full = lambda a: pl.BlockSpec(a.shape, lambda t, s: (0,) * a.ndim)  # noqa: E731
    kernel = functools.partial(_kernel, page_size=ps, key_start=key_start)
    # Keys past every split's pages keep the -inf they start with (the kernel writes only visited pages).
    init = jnp.full((T, max_pages * ps), -jnp.inf, jnp.float32)
    return pl.pallas_call(
        kernel,
        grid=(T, splits),
        in_specs=[
            full(layer), full(pps), full(seq_ids), full(positions), full(page_table),
            pl.BlockSpec((1, Hi, Di), lambda t, s: (t, 0, 0)),
            pl.BlockSpec((1, Hi, 1), lambda t, s: (t, 0, 0)),
            full(kv_cache),
            pl.BlockSpec((1, max_pages * ps), lambda t, s: (t, 0)),
        ],
        out_specs=pl.BlockSpec((1, max_pages * ps), lambda t, s: (t, 0)),
        out_shape=jax.ShapeDtypeStruct((T, max_pages * ps), jnp.float32),
        input_output_aliases={8: 0},
        compiler_params=compiler_params(num_warps, num_stages, interpret),
        interpret=interpret,
    )(layer, pps, seq_ids, positions, page_table, iq, iw.astype(jnp.float32)[..., None], kv_cache, init)


def select_topk(scores: jax.Array, positions: jax.Array, topk: int) -> tuple[jax.Array, jax.Array]:
    """scores [T, K] (-inf past each position) -> (idx [T, k] int32 key positions, valid [T, k] bool), k =
    min(topk, K), best first (`dsa_reference.topk_indices`). valid is False where fewer than k keys are visible."""
    k = min(topk, scores.shape[-1])
    _, idx = jax.lax.top_k(scores, k)
    return idx, idx <= positions[:, None]
