"""The rejection sampler keeps the target distribution (sampling/rejection.py), checked as vLLM's
tests/v1/sample/test_rejection_sampler.py does: the output's empirical distribution over many independent rows
against the target's, by a chi-square bound; and the same bound fails for a sampler that skips the residual.

Keys are fixed, so every draw (and every statistic) is deterministic."""

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.sampling import make_key_data_batch, rejection_sample
from deepinfer_jax.sampling.draw import categorical_rows

N = 20000  # rows (independent draws)
# chi-square critical value at 7 degrees of freedom (8 ids), p = 1e-4
CHI2_7 = 29.9
P = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02], np.float64)


def _keys(n, seed=0):
    return jnp.asarray(make_key_data_batch(np.arange(n) + seed * n, np.arange(n) % 7))


def _chi2(tokens, p):
    counts = np.bincount(np.asarray(tokens), minlength=len(p))
    expected = len(tokens) * p
    return float(((counts - expected) ** 2 / expected).sum())


def _run(draft, probs=None, seed=0, greedy=False):
    logits = jnp.asarray(np.tile(np.log(P), (N, 1)), jnp.float32)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    fn = jax.jit(rejection_sample)
    tok, acc = fn(logits, jnp.asarray(draft, jnp.int32), _keys(N, seed), jnp.full((N,), greedy), greedy_ids,
                  None if probs is None else jnp.asarray(probs, jnp.float32))
    return np.asarray(tok), np.asarray(acc)


def test_point_mass_drafts_keep_the_target_distribution():
    """n-gram drafts (q a point mass): each draft id accepted with probability p(d), the output ~ p."""
    for d in (0, 3, 7):
        tok, acc = _run(np.full(N, d))
        assert _chi2(tok, P) < CHI2_7, d
        assert abs(acc.mean() - P[d]) < 4 * np.sqrt(P[d] * (1 - P[d]) / N)
        assert (tok[acc] == d).all() and (tok[~acc] != d).all()  # a rejected draft is never emitted


def test_drafts_drawn_from_q_keep_the_target_distribution():
    """The general case: drafts drawn from q, accepted with min(1, p/q), else a draw from max(0, p - q)."""
    rng = np.random.default_rng(1)
    q = rng.dirichlet(np.ones(len(P)))
    draft = rng.choice(len(P), size=N, p=q)
    tok, acc = _run(draft, np.tile(q, (N, 1)), seed=1)
    assert _chi2(tok, P) < CHI2_7
    expected_acceptance = np.minimum(P, q).sum()  # sum_x q(x) min(1, p(x) / q(x))
    assert abs(acc.mean() - expected_acceptance) < 0.02


def test_no_draft_is_the_plain_draw_and_greedy_accepts_the_argmax():
    tok, acc = _run(np.full(N, -1), seed=2)
    logits = jnp.asarray(np.tile(np.log(P), (N, 1)), jnp.float32)
    assert (tok == np.asarray(categorical_rows(_keys(N, 2), logits))).all() and not acc.any()
    tok, acc = _run(np.arange(N) % len(P), greedy=True)
    assert (tok == 0).all() and (acc == (np.arange(N) % len(P) == 0)).all()


def test_the_bound_fails_for_a_sampler_that_skips_the_residual():
    """The statistic has the power to catch a subtly wrong sampler: a rejected point-mass draft resampled from p
    itself (d not removed) over-weights d, and the same bound rejects it."""
    d = 1
    keys = _keys(N, 3)
    logits = jnp.asarray(np.tile(np.log(P), (N, 1)), jnp.float32)
    tok, acc = _run(np.full(N, d), seed=3)
    wrong = np.where(acc, d, np.asarray(categorical_rows(keys, logits)))
    assert _chi2(tok, P) < CHI2_7
    assert _chi2(wrong, P) > 10 * CHI2_7


def test_sample_verifies_drafts_in_every_variant():
    """sampler.sample with draft_token_ids: the greedy variant (no draw) and the draw variants accept a greedy row's
    draft iff it is the argmax, emit the argmax, and report it in SampleOutput.accepted; a temperature row with
    no draft draws as without verification."""
    import dataclasses

    from deepinfer_jax.sampling import SamplingTensors, sample

    logits = jnp.asarray(np.tile(np.log(P), (4, 1)), jnp.float32)
    st = SamplingTensors.defaults(4)
    st = dataclasses.replace(st, temperature=np.array([0, 0, 1, 1], np.float32), rng_key_data=np.asarray(_keys(4)),
                             draft_token_ids=np.array([0, 3, -1, -1], np.int32))
    plain = dataclasses.replace(st, draft_token_ids=None)
    for draw in (False, True):
        rows = 2 if not draw else 4
        cut = lambda t: jax.tree.map(lambda a: a[:rows], t)  # noqa: E731 - the greedy variant's rows only
        out = jax.jit(sample, static_argnames=("max_logprobs", "full", "draw"))(
            logits[:rows], cut(st), max_logprobs=0, full=False, draw=draw)
        assert np.asarray(out.accepted).tolist() == [1, 0, 0, 0][:rows]
        assert np.asarray(out.token_ids)[:2].tolist() == [0, 0]
    free = jax.jit(sample, static_argnames=("max_logprobs", "full"))(logits, plain, max_logprobs=0, full=False)
    assert np.asarray(out.token_ids)[2:].tolist() == np.asarray(free.token_ids)[2:].tolist()
    assert free.accepted is None
