"""The structured-output stage of the sampler: a packed allowed-token bitmask (sampling.apply_token_bitmask)
against a numpy unpacking, and `sample` drawing only allowed ids, an all-ones row changing nothing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.sampling import SamplingTensors, apply_token_bitmask, make_key_data_batch, sample


def _unpack(bits: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), bitorder="little").reshape(bits.shape[0], -1)[:, :vocab].astype(bool)


def test_apply_token_bitmask_matches_numpy():
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 100):
        words = (vocab + 31) // 32
        bits = rng.integers(-(2**31), 2**31, size=(4, words), dtype=np.int64).astype(np.int32)
        logits = rng.normal(size=(4, vocab)).astype(np.float32)
        out = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bits)))
        ref = np.where(_unpack(bits, vocab), logits, -np.inf)
        np.testing.assert_array_equal(out, ref)


def test_sample_draws_only_allowed_ids():
    rng = np.random.default_rng(1)
    batch, vocab = 8, 300
    words = (vocab + 31) // 32
    allowed = rng.random((batch, vocab)) < 0.05
    allowed[:, 7] = True
    allowed[-1] = True  # a free row: all ones
    packed = np.packbits(np.pad(allowed, ((0, 0), (0, words * 32 - vocab))), axis=-1, bitorder="little")
    bits = packed.view(np.int32)
    logits = rng.normal(size=(batch, vocab)).astype(np.float32) * 3
    temp = np.array([0.0, 1.0] * (batch // 2), np.float32)
    fn = jax.jit(lambda lg, st: sample(lg, st, max_logprobs=0, full=True))
    for step in range(20):
        st = dataclasses.replace(SamplingTensors.defaults(batch, mask_words=words), temperature=temp,
                                 rng_key_data=make_key_data_batch(list(range(batch)), [step] * batch),
                                 allowed_token_bits=bits)
        ids = np.asarray(fn(jnp.asarray(logits), st).token_ids)
        assert allowed[np.arange(batch), ids].all()
        greedy = temp == 0
        masked = np.where(allowed, logits, -np.inf)
        np.testing.assert_array_equal(ids[greedy], masked[greedy].argmax(-1))
        free = dataclasses.replace(st, allowed_token_bits=np.zeros((batch, 0), np.int32))
        assert ids[-1] == np.asarray(fn(jnp.asarray(logits), free).token_ids)[-1]


def test_logit_bias_matches_numpy_and_steers_sampling():
    from deepinfer_jax.sampling import apply_logit_bias

    rng = np.random.default_rng(2)
    batch, vocab = 4, 50
    logits = rng.normal(size=(batch, vocab)).astype(np.float32)
    ids = np.array([[3, 7, -1], [49, 49, 0], [-1, -1, -1], [60, 5, 6]], np.int32)  # -1 and >= V ignored
    vals = np.array([[100, -100, 5], [1.5, 2.0, -3], [9, 9, 9], [100, 0.5, -0.5]], np.float32)
    ref = logits.copy()
    for b in range(batch):
        for t, v in zip(ids[b], vals[b]):
            if 0 <= t < vocab:
                ref[b, t] += v
    out = np.asarray(jax.jit(apply_logit_bias)(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(vals)))
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)
    st = dataclasses.replace(SamplingTensors.defaults(batch, bias_len=3),
                             temperature=np.array([0, 1, 0, 1], np.float32), logit_bias_ids=ids,
                             rng_key_data=make_key_data_batch([1, 2, 3, 4], [0] * batch), logit_bias_values=vals)
    got = sample(jnp.asarray(logits), st, max_logprobs=0, full=True)
    tokens = np.asarray(got.token_ids)
    assert tokens[0] == 3 and tokens[2] == logits[2].argmax()  # +100 wins; a row of padding is untouched
    # returned logprobs are the model's own, without the bias
    top = logits.max(-1, keepdims=True)
    lsm = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(got.logprob), lsm[np.arange(batch), tokens], atol=1e-5)
