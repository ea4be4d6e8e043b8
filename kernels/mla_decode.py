"""Paged MLA attention (absorbed form) in Pallas (Triton backend), split over the context.

Semantics are `mla_reference.paged_mla_attention_reference`: for each query token t (any mix of
decode tokens and prefill-chunk tokens), MQA of its H absorbed query heads against the 576-wide
latent keys of its own sequence up to its position, fp32 online softmax, 512-wide latent values.

Grid: (token, head block, context split). A program walks its share of the sequence's keys (the
batch's longest context divided evenly over the splits) through the page table, one block of
`block_keys` keys (by default half a page; its page id loaded a step ahead) or `pages_per_step` whole
pages per step, keeping the running max / sum / accumulator in registers; the latent key is read as two
power-of-two slices (c_kv 512 and k_pe 64), as the Triton backend requires. The splits are merged in
JAX with the usual log-sum-exp rescaling, so short batches still fill the GPU (flash-decoding).

`interpret=True` runs the same kernel on the CPU (tests); the reference defines correctness.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.kernels.triton_params import compiler_params

# fp32 operands multiply in IEEE fp32 (Pallas-Triton's default precision is TF32); bf16 is unaffected.
EXACT = jax.lax.Precision.HIGHEST

NEG = -1e30


def page_scores(q_lat, q_pe, kv_ref, layer, page, i, visible_to, *, page_size, rank, scale, block=None):
    """Scores of q_lat [rows, R], q_pe [rows, dr] against page `page` (the i-th of its sequence): s [rows,
    ps] fp32, scaled, NEG where a key's position p > visible_to (a scalar, or [rows, 1] per row); and the
    page's values [ps, R]. With `block` (static, dividing ps) the i-th `block`-key slice of the sequence
    instead, which lies in page `page`: s [rows, block], values [block, R]. q_lat may be a tuple of c column
    chunks [rows, R / c] (`qk_chunks`): the scores are then a sum of c + 1 independent dots, each a short chain
    of MMAs over R / c rather than one over R, and the values come back as the c chunks [block, R / c]."""
    dr = q_pe.shape[-1]
    if block is None or block == page_size:
        block, keys = page_size, slice(None)
    else:
        keys = pl.ds((i % (page_size // block)) * block, block)
    chunks = q_lat if isinstance(q_lat, tuple) else (q_lat,)
    w = rank // len(chunks)
    # An FP8 cache (e4m3, scale 1.0) is widened to the query's dtype after the load, as the reference does
    wide = (lambda a: a.astype(q_pe.dtype)) if kv_ref.dtype == jnp.float8_e4m3fn else (lambda a: a)
    kv = tuple(wide(kv_ref[layer, page, keys, pl.ds(j * w, w)]) for j in range(len(chunks)))  # c x [block, R / c]
    pe = wide(kv_ref[layer, page, keys, pl.ds(rank, dr)])  # [block, dr]
    dots = [jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=EXACT) for q, k in zip(chunks, kv)]
    dots.append(jnp.dot(q_pe, pe.T, preferred_element_type=jnp.float32, precision=EXACT))
    s = functools.reduce(jnp.add, dots)  # [rows, block]
    key_pos = i * block + jnp.arange(block)
    return jnp.where(key_pos[None, :] <= visible_to, s * scale, NEG), (kv if isinstance(q_lat, tuple) else kv[0])


def attend_page(q_lat, q_pe, kv_ref, layer, page, i, visible_to, carry, *, page_size, rank, scale):
    """One online-softmax step over page `page` (`page_scores`), shared by the decode and prefill
    kernels; carry = (acc [rows, R], max [rows], sum [rows])."""
    return softmax_step(*page_scores(q_lat, q_pe, kv_ref, layer, page, i, visible_to, page_size=page_size,
                                     rank=rank, scale=scale), carry)


def softmax_step(s, v, carry):
    """The online-softmax update for one key block: s [rows, keys] fp32 scores (scaled, masked to NEG),
    v [keys, dv] values; carry = (acc [rows, dv], max [rows], sum [rows]) -> the updated carry."""
    return softmax_steps([s], [v], carry)


def softmax_steps(ss, vs, carry):
    """`softmax_step` over several key blocks at once (one max, one rescale): the blocks' loads are
    independent, so a kernel walking several pages a step keeps more bytes in flight. Invariant (as
    for one block): the first update of a carry sees at least one unmasked key per row. The accumulator
    may be a tuple of column chunks, each block's values then the matching tuple (`page_scores`' chunks)."""
    acc, m, l = carry
    chunked = isinstance(acc, tuple)
    accs = acc if chunked else (acc,)
    m_new = m
    for s in ss:
        m_new = jnp.maximum(m_new, s.max(axis=-1))
    corr = jnp.exp(m - m_new)
    l, accs = l * corr, tuple(a * corr[:, None] for a in accs)
    for s, v in zip(ss, vs):
        p = jnp.exp(s - m_new[:, None])
        l = l + p.sum(axis=-1)
        accs = tuple(a + jnp.dot(p.astype(x.dtype), x, preferred_element_type=jnp.float32, precision=EXACT)
                     for a, x in zip(accs, v if chunked else (v,)))
    return (accs if chunked else accs[0]), m_new, l


def _kernel(layer_ref, pps_ref, seq_ref, pos_ref, pt_ref, ql_ref, qp_ref, kv_ref, o_ref, m_ref, l_ref, *,
            page_size, rank, scale, pages_per_step, block_keys, prefetch_ids, qk_chunks=1):
    t, sp = pl.program_id(0), pl.program_id(2)  # axis 1 (head block) is in the BlockSpecs
    layer, seq, pos, pages_per_split = layer_ref[0], seq_ref[t], pos_ref[t], pps_ref[0]
    n_pages = pos // block_keys + 1  # key blocks ("pages" below) holding keys 0..pos
    first = sp * pages_per_split
    last = jnp.minimum(first + pages_per_split, n_pages)
    bh = ql_ref.shape[2]
    q_lat = ql_ref[0, 0] if qk_chunks == 1 else tuple(  # [bh, R], or qk_chunks x [bh, R / qk_chunks]
        ql_ref[0, 0, :, pl.ds(j * (rank // qk_chunks), rank // qk_chunks)] for j in range(qk_chunks))
    q_pe = qp_ref[0, 0]  # [bh, dr]
    g = pages_per_step
    per_page = page_size // block_keys

    def attend(page, i, carry):  # key block i, which lies in page `page`
        return softmax_step(*page_scores(q_lat, q_pe, kv_ref, layer, page, i, pos, page_size=page_size, rank=rank,
                                         scale=scale, block=block_keys), carry)

    def body(i, carry):  # one key block a step
        return attend(pt_ref[seq, i // per_page], i, carry)

    def body_group(j, carry):
        # Pages first + g*j ... + g - 1; those at or past `last` (the next split's, or none) are read
        # as page last - 1 and fully masked. The group's first page always holds a visible key.
        blocks = []
        for k in range(g):
            i = first + j * g + k
            visible = jnp.where(i < last, pos, -1)
            blocks.append(page_scores(q_lat, q_pe, kv_ref, layer, pt_ref[seq, jnp.minimum(i, last - 1)], i,
                                      visible, page_size=page_size, rank=rank, scale=scale))
        return softmax_steps([b[0] for b in blocks], [b[1] for b in blocks], carry)

    def body_prefetch(i, carry):  # as `body`, the next block's page id loaded a step ahead
        *carry, page = carry
        nxt = pt_ref[seq, jnp.minimum(i + 1, last - 1) // per_page]
        return (*attend(page, i, tuple(carry)), nxt)

    w = rank // qk_chunks  # qk_chunks > 1: the latent in column chunks (g == 1, prefetch_ids: the wrapper checks)
    zeros = jnp.zeros((bh, rank), jnp.float32) if qk_chunks == 1 else tuple(
        jnp.zeros((bh, w), jnp.float32) for _ in range(qk_chunks))
    init = (zeros, jnp.full((bh,), NEG, jnp.float32), jnp.zeros((bh,), jnp.float32))
    if g == 1 and prefetch_ids:
        page0 = pt_ref[seq, jnp.minimum(first // per_page, pt_ref.shape[1] - 1)]
        acc, m, l, _ = jax.lax.fori_loop(first, jnp.maximum(last, first), body_prefetch, (*init, page0))
    elif g == 1:
        acc, m, l = jax.lax.fori_loop(first, jnp.maximum(last, first), body, init)
    else:
        steps = jnp.maximum(last - first + g - 1, 0) // g
        acc, m, l = jax.lax.fori_loop(0, steps, body_group, init)
    for j, a in enumerate(acc if qk_chunks > 1 else (acc,)):
        o_ref[0, 0, 0, :, pl.ds(j * w, w)] = a
    m_ref[0, 0, 0] = m
    l_ref[0, 0, 0] = l


def auto_splits(num_tokens: int, cap: int = 128) -> int:
    """Context splits for a step of `num_tokens` query tokens: about 128 (token, split) programs, so a few long
    sequences still spread over the GPU's 132 SMs; at most `cap` (1 token -> 128 splits, 2 -> 64, 8 -> 16, 32 -> 4,
    >= 128 -> 1; the page table's key blocks bound it further). H100 (`benchmarks/attn_sweep.py`, device time a
    layer): batch 1 at 32K context 80.3 us with 16 splits, 42.3 with 32, 24.3 with 64, 19.0 with 128; batch 2 at
    32K 80.6 / 43.7 / 32.5 / 34.7; batch 1 at 128K 310.1 / 155.7 / 81.1 / 56.7 (16 programs stream at about
    0.5 TB/s, 128 at 2-2.7). H200 sweep (8 warps): batch 8 at 4K 228 us with 4 splits, 150 with 16; batch 256 at
    2K 315 with 1 split, 493 with 2. A split past a short context's blocks runs no iterations but still writes
    its empty partial (splits x 16 x 512 fp32 a token), which the merge reads."""
    return max(1, min(cap, 128 // max(1, num_tokens)))


PAGES_PER_STEP = 1  # pages a program walks per loop step (the model's default; `pages_per_step`)
BLOCK_KEYS = 32  # keys a program reads per loop step, at most a page (`block_keys`)
QK_CHUNKS = 4  # column chunks of the latent in a key block's dots (`qk_chunks`)


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "block_h", "num_warps", "num_stages",
                                             "pages_per_step", "block_keys", "prefetch_ids", "qk_chunks", "interpret"))
def paged_mla_attention(q_lat, q_pe, kv_cache, layer, seq_ids, positions, page_table, scale, *, num_splits=None,
                        block_h=16, num_warps=4, num_stages=3, pages_per_step=1, block_keys=None, prefetch_ids=True,
                        qk_chunks=None, interpret=False):
    """q_lat [T, H, R], q_pe [T, H, dr], kv_cache [L, P, ps, R + dr] (the whole cache: slicing a layer out
    would copy it), layer: int32 scalar -> o_lat [T, H, R] (q_lat's dtype). num_splits None: auto_splits(T).
    pages_per_step > 1 loads that many pages per loop step, independent loads in flight together
    (one pipeline stage then: two stages of two bf16 pages would overflow shared memory)."""
    o, m, l = paged_mla_attention_splits(
        q_lat, q_pe, kv_cache, layer, seq_ids, positions, page_table, scale, num_splits=num_splits,
        block_h=block_h, num_warps=num_warps, num_stages=num_stages, pages_per_step=pages_per_step,
        block_keys=block_keys, prefetch_ids=prefetch_ids, qk_chunks=qk_chunks, interpret=interpret)
    return merge_splits(o, m, l).astype(q_lat.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "block_h", "num_warps", "num_stages",
                                             "pages_per_step", "block_keys", "prefetch_ids", "qk_chunks", "interpret"))
def paged_mla_attention_splits(q_lat, q_pe, kv_cache, layer, seq_ids, positions, page_table, scale, *,
                               num_splits=None, block_h=16, num_warps=4, num_stages=3, pages_per_step=1,
                               block_keys=None, prefetch_ids=True, qk_chunks=None, interpret=False):
    """`paged_mla_attention` before the merge: each context split's unnormalised accumulator o [T, nh,
    splits, bh, R] fp32, running max m and sum l [T, nh, splits, bh] (heads h = hb * bh + i; a split
    past a sequence's pages has l = 0, m = NEG). `merge_splits` (or kernels/mla_output.py, which also
    applies W_UV) combines them.

    The defaults were the fastest measured (H200 device time per layer, `benchmarks/attn_sweep.py`,
    benchmarks/RESULTS.md): 32-key blocks (`block_keys`, half a 64-key page), the next block's page
    id loaded a step ahead (`prefetch_ids`: the page table read leaves the key load's critical path) and three
    pipeline stages, against whole pages in two: batch 32 at 640 keys 12.4 us against 15.6, at 256 keys 8.6
    against 8.5; batch 64 at 2,048 46.2 against 54.7; batch 128 at 1,024 46.6 against 54.6; batch 8 at
    4,096 15.7 against 19.4. 16-key blocks, four to six stages and 8 warps were slower everywhere.
    qk_chunks > 1 (with the page id prefetch, one block a step): the latent cut into that many column chunks,
    each block's scores a sum of independent dots (`page_scores`); None: QK_CHUNKS where that applies, else 1.
    H200 (attn_sweep.py): batch 32 at 512 / 640 / 768 keys 11.0 / 12.1 / 13.3 us with 4 chunks
    against 11.0 / 12.4 / 13.9 with 1, batch 64 at 2,048 44.6 against 46.5; 2 and 8 chunks were slower than 4."""
    T, H, R = q_lat.shape
    dr = q_pe.shape[-1]
    _, _, ps, _ = kv_cache.shape
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    max_pages = page_table.shape[1]
    bh = min(block_h, H)
    assert H % bh == 0, (H, bh)
    nh = H // bh
    bk = block_keys or (min(BLOCK_KEYS, ps) if pages_per_step == 1 and ps % min(BLOCK_KEYS, ps) == 0 else ps)
    assert ps % bk == 0 and (bk == ps or pages_per_step == 1), (ps, bk, pages_per_step)
    splits = max(1, min(auto_splits(T) if num_splits is None else num_splits, max_pages * (ps // bk)))
    # Key blocks per split from the longest context in this batch (a device scalar), not from the page
    # table's width: a batch of short contexts in a long-max_model_len cache still spreads its blocks
    # over all splits. Splits past a shorter sequence's blocks run no iterations.
    longest = jnp.max(positions) // bk + 1
    pps = ((longest + splits - 1) // splits).astype(jnp.int32).reshape(1)
    # [T, H, R] -> [T, nh, bh, R] so a program's query block is one contiguous slab.
    ql = q_lat.reshape(T, nh, bh, R)
    qp = q_pe.reshape(T, nh, bh, dr)
    if qk_chunks is None:
        qk_chunks = QK_CHUNKS if pages_per_step == 1 and prefetch_ids and R % QK_CHUNKS == 0 else 1
    if qk_chunks > 1 and (pages_per_step != 1 or not prefetch_ids or R % qk_chunks):
        raise ValueError(f"qk_chunks {qk_chunks}: one block a step with the page id prefetch, dividing R = {R}")
    kernel = functools.partial(_kernel, page_size=ps, rank=R, scale=scale, pages_per_step=pages_per_step,
                               block_keys=bk, prefetch_ids=prefetch_ids, qk_chunks=qk_chunks)
    out_shape = (
        jax.ShapeDtypeStruct((T, nh, splits, bh, R), jnp.float32),
        jax.ShapeDtypeStruct((T, nh, splits, bh), jnp.float32),
        jax.ShapeDtypeStruct((T, nh, splits, bh), jnp.float32),
    )
    full = lambda a: pl.BlockSpec(a.shape, lambda t, h, s: (0,) * a.ndim)  # noqa: E731
    # fp32 latents (the correctness path) keep one pipeline stage: three 32-key blocks would take 221 KB of
    # the 227 KB of shared memory, as would two of several pages a step in bf16.
    stages = num_stages if kv_cache.dtype.itemsize < 4 and pages_per_step == 1 else 1
    params = compiler_params(num_warps, stages, interpret)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(T, nh, splits),
        in_specs=[
            full(layer), full(pps), full(seq_ids), full(positions), full(page_table),
            pl.BlockSpec((1, 1, bh, R), lambda t, h, s: (t, h, 0, 0)),
            pl.BlockSpec((1, 1, bh, dr), lambda t, h, s: (t, h, 0, 0)),
            full(kv_cache),
        ],
        out_specs=[
            pl.BlockSpec((1, 1, 1, bh, R), lambda t, h, s: (t, h, s, 0, 0)),
            pl.BlockSpec((1, 1, 1, bh), lambda t, h, s: (t, h, s, 0)),
            pl.BlockSpec((1, 1, 1, bh), lambda t, h, s: (t, h, s, 0)),
        ],
        out_shape=out_shape,
        compiler_params=params,
        interpret=interpret,
    )(layer, pps, seq_ids, positions, page_table, ql, qp, kv_cache)
    return o, m, l


def merge_splits(o, m, l):
    """The context splits of `paged_mla_attention_splits` merged: o = sum_s exp(m_s - M) acc_s /
    sum_s exp(m_s - M) l_s -> [T, H, R] fp32."""
    T, nh, _, bh, R = o.shape
    M = m.max(axis=2, keepdims=True)  # [T, nh, 1, bh]
    w = jnp.exp(m - M)  # [T, nh, splits, bh]; empty splits have l = 0 and contribute nothing
    # A multiply-and-sum (one reduction fusion) rather than an einsum, which is a dot over a handful of
    # splits.
    num = jnp.sum(w[..., None] * o, axis=2)  # [T, nh, bh, R]
    den = jnp.sum(w * l, axis=2)
    return (num / den[..., None]).reshape(T, nh * bh, R)
