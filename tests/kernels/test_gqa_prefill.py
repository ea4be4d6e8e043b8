"""The ragged GQA prefill kernel (kernels/gqa_prefill.py) in Pallas interpret mode equals the pure-JAX reference:
a step of prefill chunks (one over cached context), whole prompts and decode tokens of five sequences over
non-contiguous pages plus padding, runs longer than a query block, with and without a sliding window, query heads
per KV head a power of two and not; and its query blocks are the runs cut as the module says."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.gqa_prefill import max_blocks, query_blocks, ragged_gqa_attention
from deepinfer_jax.kernels.gqa_reference import paged_gqa_attention_reference

PS, KVH, HD = 8, 2, 16


def _case(G, seed=0):
    rng = np.random.default_rng(seed)
    lens = [37, 11, 20, 9, 30]  # tokens cached so far (incl. this step's) per sequence
    pages = [[7, 2, 11, 4, 9], [3, 13], [12, 1, 6], [5, 10], [14, 15, 16, 17]]
    table = np.zeros((6, 6), np.int32)
    for s, pg in enumerate(pages):
        table[s, :len(pg)] = pg
    # 0: a chunk of its last 13 tokens over 24 cached; 1: its whole 11-token prompt; 2, 3: a decode token each;
    # 4: its whole 30-token prompt
    seq, pos = [], []
    for s, n in [(0, 13), (1, 11), (2, 1), (3, 1), (4, 30)]:
        seq += [s] * n
        pos += list(range(lens[s] - n, lens[s]))
    seq += [0] * 4  # padding tokens
    pos += [0] * 4
    cache = rng.standard_normal((2, 18, PS, 2, KVH, HD)).astype(np.float32)
    q = rng.standard_normal((len(seq), KVH * G, HD)).astype(np.float32)
    a = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    return jnp.asarray(q), jnp.asarray(cache), a(seq), a(pos), jnp.asarray(table)


@pytest.mark.parametrize("G, window, rows, block_keys", [(4, None, 32, 8), (3, None, 16, 8), (4, 7, 32, 4),
                                                         (3, 13, 64, 8), (1, None, 16, 8)])
def test_kernel_equals_reference(G, window, rows, block_keys):
    q, cache, seq, pos, table = _case(G)
    ref = paged_gqa_attention_reference(q, cache, 1, seq, pos, table, 0.25, window)
    out = ragged_gqa_attention(q, cache, 1, seq, pos, table, 0.25, window, rows=rows, block_keys=block_keys,
                               interpret=True)
    np.testing.assert_allclose(np.asarray(out)[:-4], np.asarray(ref)[:-4], atol=2e-5, rtol=1e-5)


def test_bf16_cache():
    q, cache, seq, pos, table = _case(4, seed=1)
    q, cache = q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16)
    ref = paged_gqa_attention_reference(q, cache, 0, seq, pos, table, 0.25).astype(jnp.float32)
    out = ragged_gqa_attention(q, cache, 0, seq, pos, table, 0.25, rows=32, interpret=True)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32))[:-4], np.asarray(ref)[:-4], atol=2e-2)


def test_query_blocks_cut_runs():
    seq = jnp.asarray([0] * 5 + [1] * 2 + [2] * 9 + [0] * 3, jnp.int32)  # three rows and a padding run
    nb = max_blocks(len(seq), 3, 4)
    start, count, sid = (np.asarray(x) for x in query_blocks(seq, 4, nb))
    used = 7
    assert used <= nb
    assert start[:used].tolist() == [0, 4, 5, 7, 11, 15, 16] and (start[used:] == len(seq)).all()
    assert count[:used].tolist() == [4, 1, 2, 4, 4, 1, 3] and (count[used:] == 0).all()
    assert sid[:used].tolist() == [0, 0, 1, 2, 2, 2, 0]
