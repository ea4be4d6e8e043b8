"""kernels/lm_head_sample.py in interpret mode: the lm_head's per-tile sampling reductions against their pure-JAX
reference (the XLA path's logits, the sampler's Gumbel noise), and merged by sampling.sample_from_tile_stats
against sampling.sample's base variant on the same logits: the same tokens, the same logprobs up to fp32
summation order."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.kernels import lm_head_sample as lhs
from deepinfer_jax.sampling import SamplingTensors, gumbel_noise, sample, sample_from_tile_stats

T, D, V = 5, 64, 1024  # T pads to 16 rows inside the kernel
TEMPS = [0.0, 1.0, 0.7, 1.3, 0.0]


def _case(seed, dtype, suppress):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(T, D)), dtype)
    w = jnp.asarray(rng.normal(size=(D, V)) * 0.25, dtype)
    temp = jnp.asarray(TEMPS, jnp.float32)
    keys = jnp.asarray(rng.integers(0, 2**32, size=(T, 2), dtype=np.uint32))
    logits = jnp.einsum("td,dv->tv", h, w).astype(jnp.float32)
    if suppress:  # each row's greedy token among its suppressed ids, so suppression changes the greedy pick
        top = np.asarray(jnp.argmax(logits, axis=-1))
        sup = np.stack([top, rng.integers(0, V, T), np.full(T, -1)], axis=1).astype(np.int32)
    else:
        sup = np.zeros((T, 0), np.int32)
    return h, w, temp, keys, jnp.asarray(sup), logits


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("suppress", [True, False])
def test_kernel_matches_reference(dtype, suppress):
    h, w, temp, keys, sup, _ = _case(1, dtype, suppress)
    got = lhs.lm_head_sample_stats(h, w, temp, keys, sup, noise=gumbel_noise, block_v=128, block_k=32, interpret=True)
    want = lhs.lm_head_sample_stats_reference(h, w, temp, keys, sup, noise=gumbel_noise, block_v=128)
    for name, a, b in zip(lhs.TileStats._fields, got, want):
        assert a.shape == b.shape == (V // 128, T), name
        if name in ("garg", "zarg"):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6, err_msg=name)
    if suppress:  # no row's suppressed id is its greedy pick in any tile
        garg = np.asarray(got.garg)
        assert not any(np.isin(garg[:, t], np.asarray(sup)[t]).any() for t in range(T))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("suppress", [True, False])
@pytest.mark.parametrize("seed", [2, 3])
def test_merged_tiles_sample_as_the_sampler(dtype, suppress, seed):
    h, w, temp, keys, sup, logits = _case(seed, dtype, suppress)
    st = dataclasses.replace(SamplingTensors.defaults(T, suppress_len=sup.shape[1]), temperature=np.asarray(temp),
                             rng_key_data=np.asarray(keys), suppress_token_ids=np.asarray(sup))
    want = sample(logits, st, max_logprobs=0, full=False)
    stats = lhs.lm_head_sample_stats(h, w, temp, keys, sup, noise=gumbel_noise, interpret=True)  # 8 tiles of 128
    got = sample_from_tile_stats(stats, st, max_logprobs=0)
    assert np.asarray(got.token_ids).tolist() == np.asarray(want.token_ids).tolist()
    np.testing.assert_allclose(np.asarray(got.logprob), np.asarray(want.logprob), rtol=1e-5, atol=1e-5)
    assert got.top_logprobs.shape == got.top_logprob_ids.shape == (T, 0)
    # the draw differs from the greedy pick somewhere, so both halves of the merge are exercised
    assert (np.asarray(got.token_ids) != np.asarray(jnp.argmax(logits, -1)))[np.asarray(temp) > 0].any()


def test_tiles_need_powers_of_two():
    assert lhs.supported(102400, 2048) and lhs.supported(129280, 7168)
    assert not lhs.supported(1000, 2048)  # 1000 = 8 x 125: no 16-wide tile


@pytest.mark.parametrize("rows,vocab,block_t,block_v",
                         [(5, 1024, None, 256), (32, 2048, None, None), (12, 768, 4, None), (16, 1024, 16, 128)])
def test_logits_kernel_matches_reference_and_samples_as_the_sampler(rows, vocab, block_t, block_v):
    """logits_sample_stats (RunnerConfig.sampler_kernel) over the XLA lm_head's fp32 logits: the reference's tile
    reductions at several row blocks (odd row counts take one-row blocks), and merged, `sample`'s base variant:
    the same tokens, the logprobs up to fp32 summation order."""
    rng = np.random.default_rng(rows * vocab)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 3, jnp.float32)
    temp = jnp.asarray(rng.choice([0.0, 1.0, 0.7, 1.3], rows), jnp.float32)
    keys = jnp.asarray(rng.integers(0, 2**32, size=(rows, 2), dtype=np.uint32))
    top = np.asarray(jnp.argmax(logits, axis=-1))
    sup = jnp.asarray(np.stack([top, rng.integers(0, vocab, rows), np.full(rows, -1)], axis=1).astype(np.int32))
    got = lhs.logits_sample_stats(logits, temp, keys, sup, noise=gumbel_noise, block_t=block_t, block_v=block_v,
                                  interpret=True)
    tiles = got.m.shape[0]
    assert tiles > 1 and vocab % tiles == 0
    want = lhs.logits_sample_stats_reference(logits, temp, keys, sup, noise=gumbel_noise, block_v=vocab // tiles)
    for name, a, b in zip(lhs.TileStats._fields, got, want):
        assert a.shape == b.shape == (tiles, rows), name
        if name in ("garg", "zarg"):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6, err_msg=name)
    st = dataclasses.replace(SamplingTensors.defaults(rows, suppress_len=3), temperature=np.asarray(temp),
                             rng_key_data=np.asarray(keys), suppress_token_ids=np.asarray(sup))
    merged, base = sample_from_tile_stats(got, st, max_logprobs=0), sample(logits, st, max_logprobs=0, full=False)
    assert np.asarray(merged.token_ids).tolist() == np.asarray(base.token_ids).tolist()
    np.testing.assert_allclose(np.asarray(merged.logprob), np.asarray(base.logprob), rtol=1e-5, atol=1e-5)
    assert not np.isin(np.asarray(merged.token_ids)[np.asarray(temp) == 0], top).any()  # the greedy picks suppressed


def test_logits_kernel_greedy_form_samples_as_the_greedy_variant():
    """noise=None (the greedy variant through the kernel): the z stats are the greedy ones, the reference agrees,
    and merged it is `sample(draw=False)`: the argmax past the suppressed ids and its logprob."""
    rng = np.random.default_rng(3)
    rows, vocab = 8, 1024
    logits = jnp.asarray(rng.normal(size=(rows, vocab)) * 3, jnp.float32)
    temp = jnp.zeros((rows,), jnp.float32)
    keys = jnp.asarray(rng.integers(0, 2**32, size=(rows, 2), dtype=np.uint32))
    top = np.asarray(jnp.argmax(logits, axis=-1))
    sup = jnp.asarray(np.stack([top, np.full(rows, -1)], axis=1).astype(np.int32))
    got = lhs.logits_sample_stats(logits, temp, keys, sup, noise=None, block_v=128, interpret=True)
    want = lhs.logits_sample_stats_reference(logits, temp, keys, sup, noise=None, block_v=128)
    for name, a, b in zip(lhs.TileStats._fields, got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6, err_msg=name)
    assert np.array_equal(np.asarray(got.zarg), np.asarray(got.garg))
    st = dataclasses.replace(SamplingTensors.defaults(rows, suppress_len=2), temperature=np.asarray(temp),
                             rng_key_data=np.asarray(keys), suppress_token_ids=np.asarray(sup))
    merged = sample_from_tile_stats(got, st, max_logprobs=0)
    greedy = sample(logits, st, max_logprobs=0, full=False, draw=False)
    assert np.asarray(merged.token_ids).tolist() == np.asarray(greedy.token_ids).tolist()
    assert (np.asarray(merged.token_ids) != top).all()  # each row's suppressed top id was not picked
    np.testing.assert_allclose(np.asarray(merged.logprob), np.asarray(greedy.logprob), rtol=1e-5, atol=1e-5)


def test_logits_kernel_tiles():
    assert lhs.logits_supported(102400) and lhs.logits_supported(129280) and not lhs.logits_supported(1000)
    stats = jax.eval_shape(lambda *a: lhs.logits_sample_stats(*a, noise=gumbel_noise, interpret=True),
                           jnp.zeros((32, 102400), jnp.float32), jnp.ones((32,)), jnp.zeros((32, 2), jnp.uint32),
                           jnp.full((32, 0), -1, jnp.int32))
    assert stats.m.shape == (200, 32)  # V2-Lite at 32 rows: tiles of 512 ids, one row block
