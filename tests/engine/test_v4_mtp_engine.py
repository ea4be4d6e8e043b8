"""`deepseek_mtp` speculation on DeepSeek-V4 through the engine: the tiny V4 checkpoint with an MTP block in
DeepSeek's released names (tests/hf_models_v4.py add_mtp_block) gives HF transformers' greedy tokens with K = 2 drafts
a step (the MTP's weights are random, so few drafts are accepted: the verify path is what must be
exact), over chunked prefill past the sliding window and compression windows; the MTP layer's rows are one more
layer of the cache's sliding group, and the compressors' state groups have pages of their own. A checkpoint that declares MTP without its tensors is refused in one line."""

from __future__ import annotations

import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.config_v4 import v4_pool_bytes

# pages of 8 rows: the compressors' state groups take their own pages of 4 rows (config_v4.page_rows_of)
SIZES = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=13, page_size=8, num_pages=20)


def _llm(path, k):
    return LLM(path, dtype="float32", skip_tokenizer_init=True, progress=False, token_buckets=(13,),
               greedy_variant=False, warmup_runs=0,
               speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": k}, **SIZES)


def test_greedy_tokens_are_hfs_with_mtp_drafts(v4_mtp_dirs, hf_greedy):
    """K = 2: the MTP's first pass over the step and one chained pass (K = 1 is the first alone: the model test's
    drafts check both against the reference)."""
    model, path = v4_mtp_dirs[:2]
    llm = _llm(path, 2)
    eng = llm.engine
    assert eng.cfg.has_mtp and eng.cfg.v4.mtp_in_cache == 1
    groups = eng.cache_pools.groups
    assert groups[0].layers == tuple(range(eng.cfg.num_hidden_layers + 1))  # the MTP layer's rows: sliding
    assert [g.rows_per_page(8) for g in groups if g.name.endswith("_state")] == [4, 4]
    # the arrays the runner allocated are the pools' bytes as plan / v4_pools count them
    assert [a.nbytes for a in eng.runner.kv_cache] == list(v4_pool_bytes(eng.cache_pools))
    prompts = random_prompts(41, [5, 29, 17], model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 12) for p in prompts]
    assert eng.spec_stats.num_draft_tokens > 0
    assert eng.scheduler.kv_cache_manager.usage == 0.0


def test_declared_mtp_without_tensors_is_refused(v4_mtp_dirs):
    with pytest.raises(ValueError, match="'deepseek_mtp' needs a checkpoint with MTP weights"):
        _llm(v4_mtp_dirs[3], 1)
