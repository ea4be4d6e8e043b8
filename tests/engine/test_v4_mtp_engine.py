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


@pytest.fixture(scope="module")
def mtp_llm(v4_mtp_dirs):
    return _llm(v4_mtp_dirs[1], 2)


def test_greedy_tokens_are_hfs_with_mtp_drafts(mtp_llm, v4_mtp_dirs, hf_greedy):
    """K = 2: the MTP's first pass over the step and one chained pass (K = 1 is the first alone: the model test's
    drafts check both against the reference)."""
    model = v4_mtp_dirs[0]
    llm = mtp_llm
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


def test_plan_counts_the_mtp_layers_cache_rows(mtp_llm, v4_mtp_dirs):
    """`deepinfer plan --speculative-config` with deepseek_mtp: per group the layers the engine's pools hold (the MTP
    layer's among them), the bytes a sequence of the windowed group and, per compressed group, the bytes a token of
    context of the arrays the runner allocated, whose sum is plan's KV bytes a token."""
    import math

    from deepinfer_jax.engine.plan import plan

    eng = mtp_llm.engine
    sizes = dict(dtype="float32", page_size=8, max_num_seqs=4, max_num_batched_tokens=13, max_model_len=64)
    spec = plan(v4_mtp_dirs[1], speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2}, **sizes)
    pools, per_token = eng.cache_pools, 0.0
    assert len(spec.kv_groups) == len(pools.groups)
    for gi, (g, pg) in enumerate(zip(pools.groups, spec.kv_groups)):
        assert (pg["name"], pg["layers"]) == (g.name, len(g.layers))
        if g.window_tokens is None:  # the pool's bytes a page over the tokens of context a page holds
            k = pools.pool_of[gi]
            allocated = eng.runner.kv_cache[k].nbytes / pools.pool_pages[k] / g.rows_per_page(8) / g.tokens_per_row
            assert pg["bytes_per_token"] == allocated
            per_token += allocated
        else:
            assert pg["bytes_per_sequence"] == g.window_tokens * g.row_bytes * len(g.layers)
    assert spec.kv_bytes_per_token == math.ceil(per_token)
    # the MTP layer is a sliding one (as released): one more layer of the windowed group than without speculation
    bare = plan(v4_mtp_dirs[1], **sizes).kv_groups
    assert [g["layers"] for g in spec.kv_groups] == [g["layers"] + (g["name"] == "sliding") for g in bare]


def test_declared_mtp_without_tensors_is_refused(v4_mtp_dirs):
    with pytest.raises(ValueError, match="'deepseek_mtp' needs a checkpoint with MTP weights"):
        _llm(v4_mtp_dirs[3], 1)
    from deepinfer_jax.engine.plan import plan

    with pytest.raises(ValueError, match="'deepseek_mtp' needs a checkpoint with MTP weights"):
        plan(v4_mtp_dirs[3], speculative_config='{"method": "deepseek_mtp", "num_speculative_tokens": 1}')
