"""DeepSeek-V3.2 through the whole engine: greedy tokens equal HF transformers' in fp32 with the indexer's keys in
the paged cache, under batching, chunked prefill, preemption and prefix caching, prompts longer than index_topk.
One engine serves every check (its pool small enough to preempt, its token budget small enough to chunk)."""

from __future__ import annotations

import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams

CASE = "v32_sparse"


@pytest.fixture(scope="module")
def engine(hf_case):
    model, path = hf_case(CASE)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, max_num_seqs=6,
              max_num_batched_tokens=32, page_size=8, num_pages=20, progress=False,
              token_buckets=(8, 32), greedy_variant=False, warmup_runs=1)  # few step programs to compile
    return model, llm


def _greedy(llm, model, hf_greedy, prompts, n):
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in n]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, k, o in zip(prompts, n, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, k), f"prompt of {len(p)} tokens"
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0
    return outs


def test_greedy_matches_hf_with_chunks_preemption_and_prefix_hits(engine, hf_greedy):
    model, llm = engine
    vocab = model.config.vocab_size
    assert llm.engine.runner.kv_cache.shape[-1] == llm.model_config.kv_cache_dim  # latent + index key
    system = random_prompts(21, [41], vocab)[0]
    tails = random_prompts(22, [3, 17, 26, 9, 30, 1], vocab)
    prompts = [system + t for t in tails] + random_prompts(23, [5, 13, 70], vocab)
    n = [7, 12, 5, 9, 14, 6, 10, 8, 11]
    before = llm.engine.stats().num_preemptions
    _greedy(llm, model, hf_greedy, prompts, n)
    assert llm.engine.stats().num_preemptions > before  # 20 pages of 8 for ~400 tokens in flight
    again = _greedy(llm, model, hf_greedy, prompts[:4], n[:4])  # the shared prefix is cached now
    assert all(o.num_cached_tokens >= 40 for o in again)
