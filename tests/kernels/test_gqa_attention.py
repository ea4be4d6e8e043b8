"""The paged GQA attention kernel (kernels/gqa_attention.py) in Pallas interpret mode equals the pure-JAX
reference: a ragged step of decode tokens and prefill-chunk tokens of four sequences over non-contiguous pages,
with and without a sliding window, one context split and several."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels.gqa_attention import paged_gqa_attention
from deepinfer_jax.kernels.gqa_reference import paged_gqa_attention_reference

PS, KVH, G, HD = 8, 2, 3, 16


def _case(seed=0):
    rng = np.random.default_rng(seed)
    lens = [37, 5, 20, 9]  # tokens cached so far (incl. this step's) per sequence
    pages = [[7, 2, 11, 4, 9], [3], [12, 1, 6], [5, 10]]
    table = np.zeros((4, 6), np.int32)
    for s, pg in enumerate(pages):
        table[s, :len(pg)] = pg
    # sequence 0: a prefill chunk of its last 6 tokens; 1: its whole 5-token prompt; 2 and 3: one decode token
    seq, pos = [], []
    for s, n in [(0, 6), (1, 5), (2, 1), (3, 1)]:
        seq += [s] * n
        pos += list(range(lens[s] - n, lens[s]))
    seq += [0, 0]  # padding tokens
    pos += [0, 0]
    cache = rng.standard_normal((2, 14, PS, 2, KVH, HD)).astype(np.float32)
    q = rng.standard_normal((len(seq), KVH * G, HD)).astype(np.float32)
    a = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    return jnp.asarray(q), jnp.asarray(cache), a(seq), a(pos), jnp.asarray(table)


@pytest.mark.parametrize("window, splits", [(None, 1), (None, 3), (7, 2), (13, 1)])
def test_kernel_equals_reference(window, splits):
    q, cache, seq, pos, table = _case()
    ref = paged_gqa_attention_reference(q, cache, 1, seq, pos, table, 0.25, window)
    out = paged_gqa_attention(q, cache, 1, seq, pos, table, 0.25, window, num_splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_bf16_cache():
    q, cache, seq, pos, table = _case(1)
    q, cache = q.astype(jnp.bfloat16), cache.astype(jnp.bfloat16)
    ref = paged_gqa_attention_reference(q, cache, 0, seq, pos, table, 0.25).astype(jnp.float32)
    out = paged_gqa_attention(q, cache, 0, seq, pos, table, 0.25, num_splits=2, interpret=True).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-2)
