"""Tests for deepinfer_jax.sampling: exact outcomes on small known logits (CPU, fp32).

All randomness comes from fixed key data, so statistical checks are deterministic.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.sampling import (
    SamplingTensors, apply_penalties, apply_suppression, apply_truncation, make_key_data,
    make_key_data_batch, sample, token_counts)

PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32)       # distinct, sums to 1
LOGITS5 = np.log(PROBS)


def jsample(logits, st, max_logprobs=0):
    return jax.jit(sample, static_argnames="max_logprobs")(
        jnp.asarray(logits), st, max_logprobs=max_logprobs)


def make_st(batch, prompt_len=0, output_len=0, suppress_len=0, seeds=None, **kw):
    """Defaults (all off) with per-field overrides broadcast to [B] / given as [B, L]."""
    st = SamplingTensors.defaults(batch, prompt_len, output_len, suppress_len)
    seeds = np.arange(batch) if seeds is None else seeds
    upd = {"rng_key_data": make_key_data_batch(seeds, np.zeros(batch, np.int64))}
    for name, v in kw.items():
        ref = getattr(st, name)
        upd[name] = np.broadcast_to(np.asarray(v, ref.dtype), ref.shape).copy()
    return dataclasses.replace(st, **upd)


def tile(logits, batch):
    return np.tile(np.asarray(logits, np.float32)[None], (batch, 1))


def counts(tokens, vocab):
    return np.bincount(np.asarray(tokens), minlength=vocab)


# ----------------------------------------------------------------------------- greedy

def test_greedy_is_argmax_and_padding_garbage_is_harmless():
    rng = np.random.RandomState(0)
    logits = rng.randn(6, 37).astype(np.float32)
    st = make_st(6, temperature=0.0)
    np.testing.assert_array_equal(jsample(logits, st).token_ids, logits.argmax(-1))
    # Two extra padding rows with garbage values must not change the real rows.
    pad = make_st(8, output_len=3, suppress_len=2, temperature=[0] * 6 + [np.nan, 1e9],
                  top_k=[0] * 6 + [-7, 10**6], top_p=[1] * 6 + [0.0, np.nan],
                  min_p=[0] * 6 + [1.0, 5.0], presence_penalty=[0] * 6 + [9, np.inf],
                  repetition_penalty=[1] * 6 + [0.0, -3.0],
                  output_token_ids=np.array([[-1] * 3] * 6 + [[5, 99, -4], [0, 0, 36]]),
                  suppress_token_ids=np.array([[-1] * 2] * 6 + [[3, 4], [-1, 1000]]))
    big = np.concatenate([logits, np.full((2, 37), np.nan, np.float32)])
    np.testing.assert_array_equal(jsample(big, pad).token_ids[:6], logits.argmax(-1))


def test_top_k_1_equals_greedy_at_high_temperature():
    logits = np.random.RandomState(1).randn(500, 23).astype(np.float32)
    out = jsample(logits, make_st(500, temperature=100.0, top_k=1))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_greedy_uses_penalised_logits():
    logits = np.array([[3.0, 2.9, 1.0, 0.0]], np.float32)
    st = make_st(1, output_len=2, temperature=0.0, frequency_penalty=0.2,
                 output_token_ids=[[0, -1]])
    assert int(jsample(logits, st).token_ids[0]) == 1                # 3.0 - 0.2 < 2.9


# ----------------------------------------------------------------------------- truncation

def test_top_k_2_only_samples_top_two():
    logits = tile(np.random.RandomState(2).randn(30), 3000)
    top2 = set(np.argsort(-logits[0])[:2])
    toks = np.asarray(jsample(logits, make_st(3000, temperature=5.0, top_k=2)).token_ids)
    assert set(toks.tolist()) == top2


@pytest.mark.parametrize("top_k,top_p,min_p,expected", [
    (0, 0.6, 0.0, {0, 1}),        # mass above id2 = 0.7 >= 0.6
    (0, 0.75, 0.0, {0, 1, 2}),
    (0, 0.01, 0.0, {0}),          # top token always kept
    (0, 0.8, 0.0, {0, 1, 2}),
    (3, 0.8, 0.0, {0, 1}),        # top-p over top-3 renormalised: 0.7/0.85 >= 0.8
    (4, 1.0, 0.0, {0, 1, 2, 3}),
    (0, 1.0, 0.3, {0, 1, 2}),     # keep p >= 0.3 * 0.4 = 0.12
    (0, 1.0, 0.76, {0}),          # 0.3 < 0.304
    (0, 0.9, 0.5, {0, 1}),        # top-p keeps 0..3, min-p then drops < 0.2
    (5, 1.0, 0.0, {0, 1, 2, 3, 4}),
])
def test_truncation_mask_and_empirical_support(top_k, top_p, min_p, expected):
    n = 2000
    masked = np.asarray(apply_truncation(jnp.asarray(tile(LOGITS5, 1)), jnp.array([top_k]),
                                         jnp.array([top_p]), jnp.array([min_p])))[0]
    kept = set(np.flatnonzero(np.isfinite(masked)).tolist())
    assert kept == expected
    np.testing.assert_array_equal(masked[sorted(kept)], LOGITS5[sorted(kept)])
    st = make_st(n, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    toks = set(np.asarray(jsample(tile(LOGITS5, n), st).token_ids).tolist())
    assert toks == expected


def test_truncation_rows_are_independent():
    x = jnp.asarray(tile(LOGITS5, 3))
    out = np.asarray(apply_truncation(x, jnp.array([2, 0, 0]), jnp.array([1.0, 0.6, 1.0]),
                                      jnp.array([0.0, 0.0, 0.0])))
    assert np.isfinite(out).sum(-1).tolist() == [2, 2, 5]
    np.testing.assert_array_equal(out[2], LOGITS5)                   # all off: unchanged


# ----------------------------------------------------------------------------- penalties

def reference_penalties(logits, prompt, output, pres, freq, rep):
    out = logits.astype(np.float32).copy()
    for b in range(out.shape[0]):
        cnt = np.zeros(out.shape[1], np.int64)
        for t in output[b]:
            if t >= 0:
                cnt[t] += 1
        seen = cnt > 0
        seen[[t for t in prompt[b] if t >= 0]] = True
        for v in range(out.shape[1]):
            if seen[v]:
                out[b, v] = out[b, v] / rep[b] if out[b, v] > 0 else out[b, v] * rep[b]
            out[b, v] -= freq[b] * cnt[v] + pres[b] * (cnt[v] > 0)
    return out


def test_penalties_match_formulas():
    logits = np.array([[2.0, -2.0, 1.0, 0.5, -1.0, 0.0, 3.0, 4.0],
                       [1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 7.0]], np.float32)
    prompt = np.array([[0, 1, -1], [4, -1, -1]], np.int32)
    output = np.array([[2, 2, 3, -1], [5, 0, 0, 0]], np.int32)
    pres, freq, rep = [0.5, 0.0], [0.25, 0.1], [2.0, 1.5]
    st = make_st(2, 3, 4, presence_penalty=pres, frequency_penalty=freq,
                 repetition_penalty=rep, prompt_token_ids=prompt, output_token_ids=output)
    got = np.asarray(apply_penalties(jnp.asarray(logits), st))
    np.testing.assert_allclose(got, reference_penalties(logits, prompt, output, pres, freq,
                                                        rep), rtol=1e-6)
    # Hand-checked: row 0: id0 prompt 2/2=1, id1 -2*2=-4, id2 (1/2)-0.5-2*0.25=-0.5,
    # id3 0.5/2-0.5-0.25=-0.5; unseen ids (incl. the last: -1 padding must not wrap) kept.
    np.testing.assert_allclose(got[0], [1, -4, -0.5, -0.5, -1, 0, 3, 4], rtol=1e-6)
    np.testing.assert_allclose(got[1], [1 / 1.5 - 0.3, 1, 1, 1, -1.5, -1.5 - 0.1, -1, 7],
                               rtol=1e-6)


def test_token_counts_ignores_padding_and_out_of_range():
    ids = jnp.array([[1, 1, -1, 3, 9, -1], [-1, -1, -1, -1, -1, -1]], jnp.int32)
    np.testing.assert_array_equal(token_counts(ids, 5), [[0, 2, 0, 1, 0], [0] * 5])


def test_penalties_off_is_identity():
    logits = jnp.asarray(np.random.RandomState(3).randn(2, 9), jnp.float32)
    st = make_st(2, 2, 2, prompt_token_ids=[[1, 2]] * 2, output_token_ids=[[3, 3]] * 2)
    np.testing.assert_array_equal(apply_penalties(logits, st), logits)


# ----------------------------------------------------------------------------- suppression

def test_suppressed_ids_never_sampled():
    n, logits = 3000, tile(LOGITS5, 3000)
    st = make_st(n, suppress_len=3, temperature=1.0,
                 suppress_token_ids=[[0, 2, -1]] * (n - 1) + [[-1, -1, -1]])
    toks = np.asarray(jsample(logits, st).token_ids)
    assert set(toks[:-1].tolist()) == {1, 3, 4}
    np.testing.assert_array_equal(
        apply_suppression(jnp.asarray(logits[:1]), jnp.array([[4, -1, 0]]))[0],
        [-np.inf, LOGITS5[1], LOGITS5[2], LOGITS5[3], -np.inf])
    greedy = make_st(1, suppress_len=1, temperature=0.0, suppress_token_ids=[[0]])
    assert int(jsample(logits[:1], greedy).token_ids[0]) == 1


# ----------------------------------------------------------------------------- seeds / keys

def test_make_key_data_matches_jax_fold_in():
    for seed in (0, 1, 12345, 2**31, 2**32 - 1):
        for step in (0, 1, 77, 2**32 - 1):
            ref = jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), step))
            got = make_key_data(seed, step)
            assert got.dtype == np.uint32 and got.shape == (2,)
            np.testing.assert_array_equal(got, np.asarray(ref))
    np.testing.assert_array_equal(make_key_data_batch([5, 6], [3, 4]),
                                  [make_key_data(5, 3), make_key_data(6, 4)])


def test_same_seed_same_token_across_batches():
    v = 50
    row = np.random.RandomState(4).randn(v).astype(np.float32) * 0.1   # high entropy
    seeds = np.arange(64)
    base = np.asarray(jsample(tile(row, 64), make_st(64, seeds=seeds)).token_ids)
    np.testing.assert_array_equal(jsample(tile(row, 64), make_st(64, seeds=seeds)).token_ids,
                                  base)                              # repeatable
    # Reversed positions, different batch size, mixed with other (penalised / greedy) rows.
    perm = seeds[::-1]
    np.testing.assert_array_equal(jsample(tile(row, 64), make_st(64, seeds=perm)).token_ids,
                                  base[::-1])
    other = np.random.RandomState(5).randn(3, v).astype(np.float32)
    mixed = np.concatenate([tile(row, 5), other])
    st = make_st(8, output_len=2, seeds=[7, 3, 60, 0, 21, 99, 98, 97],
                 temperature=[1] * 5 + [0.0, 2.0, 0.5], top_k=[0] * 5 + [0, 3, 0],
                 frequency_penalty=[0] * 5 + [0, 1.0, 2.0],
                 output_token_ids=[[-1, -1]] * 5 + [[1, 2], [3, 4], [5, 5]])
    np.testing.assert_array_equal(jsample(mixed, st).token_ids[:5], base[[7, 3, 60, 0, 21]])


def test_different_seeds_differ_and_steps_differ():
    v, n = 50, 400
    logits = tile(np.zeros(v), n)
    toks = np.asarray(jsample(logits, make_st(n)).token_ids)
    assert len(set(toks.tolist())) > 40                  # ~uniform over 50 ids
    keys = make_key_data_batch(np.full(n, 7), np.arange(n))   # one seed, many steps
    st = dataclasses.replace(make_st(n), rng_key_data=keys)
    assert len(set(np.asarray(jsample(logits, st).token_ids).tolist())) > 40


# ----------------------------------------------------------------------------- distribution

def chi2(observed, probs):
    expected = probs * observed.sum()
    nz = expected > 0
    assert observed[~nz].sum() == 0
    return float((((observed - expected) ** 2)[nz] / expected[nz]).sum())


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 0), (2.0, 4)])
def test_frequencies_match_softmax(temperature, top_k):
    n, v = 4000, 8
    logits = np.random.RandomState(6).randn(v).astype(np.float32)
    z = logits / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    st = make_st(n, seeds=np.arange(n) + 1000, temperature=temperature, top_k=top_k)
    obs = counts(jsample(tile(logits, n), st).token_ids, v)
    assert chi2(obs, p) < 24.3, (obs, p * n)             # chi2(7) p-value ~ 1e-3


# ----------------------------------------------------------------------------- logprobs / jit

def test_logprobs_are_raw_log_softmax():
    rng = np.random.RandomState(7)
    logits = rng.randn(4, 20).astype(np.float32)
    st = make_st(4, output_len=2, suppress_len=1, temperature=[0.0, 0.5, 1.0, 3.0],
                 top_k=[0, 3, 0, 0], presence_penalty=1.0, output_token_ids=[[1, 2]] * 4,
                 suppress_token_ids=[[int(logits[i].argmax())] for i in range(4)])
    out = jsample(logits, st, max_logprobs=5)
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    toks = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprob, ref[np.arange(4), toks], rtol=1e-6)
    order = np.argsort(-ref, axis=-1)[:, :5]
    np.testing.assert_array_equal(out.top_logprob_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(ref, order, -1), rtol=1e-6)
    assert out.top_logprob_ids.dtype == jnp.int32 and out.top_logprobs.dtype == jnp.float32
    empty = jsample(logits, st, max_logprobs=0)
    assert empty.top_logprobs.shape == (4, 0) and empty.top_logprob_ids.shape == (4, 0)


def test_jit_matches_eager_and_bf16_logits():
    rng = np.random.RandomState(8)
    logits = rng.randn(16, 24).astype(np.float32)
    st = make_st(16, 3, 2, 1, temperature=np.linspace(0, 2, 16), top_k=[0, 3] * 8,
                 top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                 prompt_token_ids=rng.randint(-1, 24, (16, 3)),
                 output_token_ids=rng.randint(-1, 24, (16, 2)),
                 suppress_token_ids=rng.randint(-1, 24, (16, 1)))
    eager = sample(jnp.asarray(logits), st, max_logprobs=2)
    jitted = jsample(logits, st, max_logprobs=2)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(a, b)
    out = jsample(jnp.asarray(logits, jnp.bfloat16), st, max_logprobs=2)
    assert out.token_ids.shape == (16,) and out.logprob.dtype == jnp.float32


@pytest.mark.parametrize("full", [False, True])
def test_sampler_has_no_device_side_branch(full):
    """A lax.cond on a device value makes the GPU runtime read its predicate on the host, stalling the
    host until the forward before it has run: the sampler must lower to straight-line code."""
    st = make_st(4, output_len=8 if full else 0)
    text = jax.jit(lambda l, s: sample(l, s, max_logprobs=2, full=full)).lower(
        jnp.zeros((4, 64), jnp.float32), st).as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text  # (threefry's fixed loop is fine)


def test_base_variant_equals_full_when_no_row_needs_it():
    """full=False leaves out penalties and top-k/top-p; with those knobs off it samples the same tokens."""
    logits = jax.random.normal(jax.random.key(0), (6, 300)) * 3
    st = make_st(6, seeds=list(range(6)), temperature=np.array([0.0, 1.0, 0.7, 1.3, 1.0, 0.0], np.float32),
                 min_p=np.array([0.0, 0.0, 0.1, 0.0, 0.05, 0.0], np.float32))
    base = sample(logits, st, max_logprobs=0, full=False)
    full = sample(logits, st, max_logprobs=0, full=True)
    np.testing.assert_array_equal(np.asarray(base.token_ids), np.asarray(full.token_ids))
    np.testing.assert_allclose(np.asarray(base.logprob), np.asarray(full.logprob))


@pytest.mark.parametrize("vocab", [5, 1024, 3000, 102400])
def test_chunked_draw_is_the_whole_rows_gumbel_max(vocab, monkeypatch):
    """categorical_rows takes its argmax in chunks (ARGMAX_CHUNK, here also small, so that every size splits):
    the same ids as one argmax of logits + gumbel_noise over the whole row, ties and masked (-inf) ids included."""
    from deepinfer_jax.sampling import draw

    rng = np.random.default_rng(vocab)
    batch = 8
    logits = rng.standard_normal((batch, vocab)).astype(np.float32) * 4
    logits[1] = np.where(rng.random(vocab) < 0.9, -np.inf, logits[1])  # mostly masked
    logits[2] = 0.0  # all tied
    logits[3, : vocab // 2] = -np.inf  # the first chunks masked
    logits[4, -1] = 60.0  # the last id, in the padded chunk
    key_data = jnp.asarray(make_key_data_batch(np.arange(batch) * 7 + 1, np.arange(batch)), jnp.uint32)
    col = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), (batch, vocab))
    want = np.asarray(jnp.argmax(logits + draw.gumbel_noise(key_data[:, :1], key_data[:, 1:], col), axis=-1))
    for chunk in (draw.ARGMAX_CHUNK, 7, 64):
        monkeypatch.setattr(draw, "ARGMAX_CHUNK", chunk)
        got = np.asarray(jax.jit(draw.categorical_rows)(key_data, jnp.asarray(logits)))
        np.testing.assert_array_equal(got, want)
    assert got[4] == vocab - 1
    assert np.isfinite(logits[1, got[1]]) or not np.isfinite(logits[1]).any()  # a masked id only if all are
    assert got[3] >= vocab // 2


def test_noise_bits_are_a_bijection_per_key_and_uniform():
    """draw.noise_bits: for each key, distinct ids get distinct bits (2**16 ids); over many keys and ids each bit
    is set half the time, neighbouring ids and keys one step apart are uncorrelated, and the Gumbel noise has the
    distribution's mean (Euler's gamma) and variance (pi^2 / 6)."""
    from deepinfer_jax.sampling import draw

    keys = jnp.asarray(make_key_data_batch(np.arange(64) + 5, np.zeros(64, np.int64)), jnp.uint32)  # [64, 2]
    col = jnp.broadcast_to(jnp.arange(1 << 16, dtype=jnp.int32), (64, 1 << 16))
    bits = np.asarray(draw.noise_bits(keys[:, :1], keys[:, 1:], col))  # [64, 65536]
    assert all(len(np.unique(row)) == row.size for row in bits)
    ones = np.stack([(bits >> b) & 1 for b in range(32)]).mean(axis=(1, 2))  # each bit's frequency
    assert np.abs(ones - 0.5).max() < 0.003, ones
    u = (bits >> 9).astype(np.float64) / (1 << 23)  # the top 23 bits, as the noise takes them
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.003  # neighbouring ids
    steps = jnp.asarray(make_key_data_batch(np.full(64, 5), np.arange(64)), jnp.uint32)  # one seed, 64 steps
    v = np.asarray(draw.noise_bits(steps[:, :1], steps[:, 1:], col[:, :4096]) >> 9).astype(np.float64)
    assert abs(np.corrcoef(v[:-1].ravel(), v[1:].ravel())[0, 1]) < 0.01  # consecutive steps
    g = np.asarray(draw.gumbel_noise(keys[:, :1], keys[:, 1:], col), np.float64)
    assert abs(g.mean() - np.euler_gamma) < 0.01 and abs(g.var() - np.pi ** 2 / 6) < 0.02


def test_draw_frequencies_over_a_large_vocabulary():
    """The draw over 3,000 ids, 20,000 keys: each id's frequency matches softmax (chi-square over the ids expected
    at least 5 times, the rest pooled; p-value ~1e-3 bound), so the noise is uniform across ids too."""
    n, v = 20000, 3000
    logits = (np.random.RandomState(11).randn(v) * 2).astype(np.float32)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    st = make_st(n, seeds=np.arange(n) + 77, temperature=1.0)
    obs = counts(jsample(tile(logits, n), st).token_ids, v)
    big = p * n >= 5
    dof = int(big.sum())
    pooled_obs, pooled_p = np.append(obs[big], obs[~big].sum()), np.append(p[big], p[~big].sum())
    assert chi2(pooled_obs, pooled_p) < dof + 3.1 * np.sqrt(2 * dof), dof


def test_greedy_variant_skips_only_the_draw():
    """sample(draw=False), the runner's greedy variant: for rows that are all greedy, the same tokens and logprobs
    as the full computation, with suppression still applied."""
    rng = np.random.default_rng(21)
    logits = jnp.asarray(rng.normal(size=(6, 300)) * 3, jnp.float32)
    top = np.asarray(jnp.argmax(logits, axis=-1))
    sup = np.stack([top, np.full(6, -1)], axis=1).astype(np.int32)
    st = make_st(6, suppress_len=2, temperature=0.0, suppress_token_ids=sup)
    a = sample(logits, st, max_logprobs=0, full=False)
    b = sample(logits, st, max_logprobs=0, full=False, draw=False)
    assert np.asarray(a.token_ids).tolist() == np.asarray(b.token_ids).tolist()
    assert not (np.asarray(b.token_ids) == top).any()  # suppressed
    np.testing.assert_array_equal(np.asarray(a.logprob), np.asarray(b.logprob))
