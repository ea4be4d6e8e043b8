"""The dense family through the whole engine (LLM): greedy tokens equal HF transformers' greedy generate, with
batching, chunked prefill (a 24-token step budget against prompts of up to 90 tokens), preemption (a pool of 24
pages of 8 tokens for ~500 prompt tokens) and prefix caching (prompts sharing a 40-token prefix, run twice).
One engine a family, one bucket of 24 token slots (decode steps padded to it: the attention is one code path
for any step); Mistral's sliding window once more through the Pallas kernels in interpret mode (every step of 24
slots over 4 sequence rows takes the query-block kernel, kernels/gqa_prefill.py). The family's forward against HF
at every position: tests/model/test_dense_vs_hf.py."""

from __future__ import annotations

import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams

LENGTHS = [1, 5, 17, 33, 90, 9, 47, 24]
MAX_TOKENS = [5, 9, 4, 7, 3, 8, 6, 5]


@pytest.mark.parametrize("case, attn_impl", [("llama_llama3", "auto"), ("qwen2_tied", "auto"), ("qwen3", "auto"),
                                             ("qwen3_moe", "auto"), ("mistral_window", "auto"),
                                             ("mistral_window", "pallas_interpret")])
def test_greedy_matches_hf(hf_case, hf_greedy, case, attn_impl):
    model, path = hf_case(case)
    vocab = model.config.vocab_size
    prefix = random_prompts(20, [40], vocab)[0]
    prompts = random_prompts(21, LENGTHS, vocab)
    prompts = prompts[:4] + [prefix + p for p in prompts[4:]]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=160, max_num_seqs=4,
              max_num_batched_tokens=24, token_buckets=(24,), page_size=8, num_pages=24, progress=False,
              greedy_variant=False, warmup_runs=1, attn_impl=attn_impl)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for p, n, o in zip(prompts, MAX_TOKENS, outs):
            assert o.outputs[0].token_ids == hf_greedy(model, p, n), f"prompt of {len(p)} tokens"
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.engine.runner.compiles_after_warmup == 0
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0
