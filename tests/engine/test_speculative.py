"""Speculative decoding through the engine (n-gram drafts; docs/speculative.md): greedy output token for token as
without speculation, with drafts both accepted and rejected, under chunked prefill, prefix caching and a pool small
enough to preempt; logprobs, stop ids, min_tokens, penalties, n > 1 and seeds; no recompile after warm-up and no
page leak."""

from __future__ import annotations

import numpy as np
import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams

K = 3
ARGS = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
            page_size=8, progress=False, token_buckets=(16, 64))


@pytest.fixture(scope="module")
def path(hf_case):
    return hf_case("v3_grouped_noaux")[1]


@pytest.fixture(scope="module")
def plain(path):
    # test_engine_features.py's engine (its programs come from the session's program cache when that ran first)
    return LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
               max_num_batched_tokens=256, page_size=8, progress=False)


@pytest.fixture(scope="module")
def spec(path):
    # 40 pages of 8 tokens: the prompts below cannot all run at once, so requests get preempted
    return LLM(path, num_pages=40, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                                       "prompt_lookup_max": 3, "prompt_lookup_min": 1}, **ARGS)


def _prompts():
    """Prompts whose text repeats (n-gram drafts find matches) and random ones; one longer than the step's token
    budget (chunked prefill), two sharing a prefix (prefix cache hits)."""
    rng = np.random.default_rng(5)
    loop = rng.integers(2, 320, 6).tolist()
    shared = rng.integers(2, 320, 24).tolist()
    return ([loop * 4, (loop[:3] + [7]) * 5, shared + loop * 2, shared + [9, 9, 9], rng.integers(2, 320, 90).tolist()]
            + random_prompts(31, [5, 17, 40], 320))


def _gen(llm, prompts, **kw):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**kw))


def test_greedy_output_is_the_same_with_and_without_speculation(plain, spec):
    prompts = _prompts()
    want = [o.outputs[0].token_ids for o in _gen(plain, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)]
    stats = spec.engine.spec_stats
    before = stats.num_draft_tokens, stats.num_accepted_tokens
    got = _gen(spec, prompts, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(o.outputs[0].finish_reason == "length" for o in got)
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert 0 < accepted < drafted  # drafts were accepted, and rejected
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    eng = spec.engine
    assert eng.scheduler.num_preemptions > 0 and eng.scheduler.kv_cache_manager.prefix_cache_hits > 0
    assert eng.runner.compiles_after_warmup == 0
    assert eng.scheduler.kv_cache_manager.usage == 0.0  # every page back in the pool


def test_logprobs_stop_ids_and_seeds(plain, spec):
    prompts = _prompts()[:3]
    kw = dict(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    for a, b in zip(_gen(plain, prompts, **kw), _gen(spec, prompts, **kw)):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for ea, eb, t in zip(a.logprobs, b.logprobs, b.token_ids):
            assert eb[t].logprob == pytest.approx(ea[t].logprob, abs=1e-4) and set(ea) == set(eb)
    free = _gen(plain, prompts[:1], temperature=0.0, max_tokens=16, ignore_eos=True)[0].outputs[0].token_ids
    stop = free[5]
    out = _gen(spec, prompts[:1], temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])[0].outputs[0]
    assert out.token_ids == free[: free.index(stop) + 1] and out.stop_reason == stop
    # min_tokens holds the stop id back at each verified position as it would one token a step; penalties count
    # the drafts before a position as outputs
    late = dict(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop], min_tokens=free.index(stop) + 2)
    kw = dict(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=0.3)
    for p in (late, kw):
        assert ([o.outputs[0].token_ids for o in _gen(spec, prompts, **p)]
                == [o.outputs[0].token_ids for o in _gen(plain, prompts, **p)])
    # seeded sampling at temperature > 0 reproduces, n > 1 children differ
    kw = dict(temperature=1.0, seed=11, max_tokens=12, n=3, ignore_eos=True)
    first = [tuple(c.token_ids) for c in _gen(spec, prompts[:1], **kw)[0].outputs]
    again = [tuple(c.token_ids) for c in _gen(spec, prompts[:1], **kw)[0].outputs]
    assert first == again and len(set(first)) > 1 and all(len(t) == 12 for t in first)
    assert spec.engine.runner.compiles_after_warmup == 0
