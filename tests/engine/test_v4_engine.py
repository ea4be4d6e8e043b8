"""DeepSeek-V4 through the whole engine: greedy tokens equal HF transformers' in fp32 on the tiny random checkpoint
with every layer kind (sliding, CSA, HCA; hash_moe, moe), under batching, chunked prefill whose chunks end inside
compression windows, preemption and prefix caching, contexts past the sliding window and many compression windows.
One engine serves every check (its pools small enough to preempt, its token budget odd so chunks split windows),
over the per-group cache (models/v4_paged.py): window pages given back, compressed rows written once."""

from __future__ import annotations

import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
    from hf_models_v4 import build_hf_v4

    model = build_hf_v4(seed=0)
    path = str(tmp_path_factory.mktemp("v4"))
    model.save_pretrained(path, safe_serialization=True)
    return model, path


SIZES = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=13, page_size=4)


def _memory_for_context_pages(path, pages: int) -> float:
    """GiB of a device whose KV cache share (after the weights, within XLA's 75%) is the bytes of pools holding
    `pages` pages of context at SIZES."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.config_v4 import v4_cache_pools, v4_pool_bytes
    from deepinfer_jax.engine.plan import plan

    v4 = ModelConfig.from_model_dir(path).v4
    pools = v4_cache_pools(v4, 4, pages, SIZES["max_num_seqs"], 13, 64, dtype_bytes=4)
    weights = plan(path, dtype="float32", gpu_memory_gib=1.0).weight_bytes_per_device
    return (weights + sum(v4_pool_bytes(pools)) + 64) / 0.75 / 2**30


@pytest.fixture(scope="module")
def engine(v4_dir):
    """The cache sized from a device's memory (`gpu_memory`), as `deepinfer plan` sizes it: pools of one
    max_model_len of context (and 4 sequences' windows), small enough to preempt."""
    model, path = v4_dir
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, gpu_memory=_memory_for_context_pages(path, 1),
              progress=False, token_buckets=(4, 13), greedy_variant=False, warmup_runs=1, **SIZES)
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
    system = random_prompts(31, [34], vocab)[0]
    tails = random_prompts(32, [3, 11, 22], vocab)
    prompts = [system + t for t in tails] + random_prompts(33, [5, 29], vocab)
    n = [9, 12, 6, 14, 10]
    before = llm.engine.stats().num_preemptions
    _greedy(llm, model, hf_greedy, prompts, n)
    # 8 usable csa pages of 16 tokens (4 rows of 4) for ~260 tokens in flight
    assert llm.engine.stats().num_preemptions > before
    again = _greedy(llm, model, hf_greedy, prompts[:3], n[:3])  # the shared prefix is cached now
    # a hit ends on every compressed group's page boundary: lcm(4 x 4 for csa, 4 x 8 for hca) = 32 tokens; the
    # small windowed pools evict the prefix's freed window pages soon, so the prompts admitted once a batch-mate
    # has computed the prefix again hit, and give HF's tokens from there
    hits = [o.num_cached_tokens for o in again]
    assert set(hits) <= {0, 32} and hits[-1] == 32, hits


def test_cache_pools_are_the_plans(engine, v4_dir):
    """The engine's cache is the pools `deepinfer plan` reports for the same device and sizes, byte for byte; the
    compressed groups' pages are a fraction of the windowed ones' per token of context."""
    from deepinfer_jax.config_v4 import v4_pool_bytes
    from deepinfer_jax.engine.plan import plan

    _, llm = engine
    pools = llm.engine.cache_pools
    # max_model_len (64) tokens of context: 4 csa pages of 16 tokens and 2 hca pages of 32, and a page of each per
    # sequence; the sliding and state pools 4 windows of 8 and a 13-token step
    assert pools.context_tokens == 64 and pools.pool_pages == (21, 9, 21, 7, 21)  # a pool per group
    p = plan(v4_dir[1], dtype="float32", gpu_memory_gib=_memory_for_context_pages(v4_dir[1], 1), **SIZES)
    assert p.fits and p.kv_tokens_per_rank == pools.context_tokens
    assert [g["pool_pages"] for g in p.kv_groups] == [pools.pool_pages[k] for k in pools.pool_of]
    allocated = llm.engine.runner.memory_report()["kv_cache"]
    assert allocated == sum(v4_pool_bytes(pools)) == sum(g["pool_bytes"] for g in p.kv_groups)
    assert [g["name"] for g in p.kv_groups] == ["sliding", "csa", "csa_state", "hca", "hca_state"]
    assert p.kv_bytes_per_token == (2 * (24 + 12) // 4 + 24 // 8) * 4


def test_async_engine_streams_hf_greedy_tokens(engine, hf_greedy):
    """The server's path (AsyncEngine deltas) over the same engine: the deltas add up to HF's greedy tokens."""
    import asyncio

    from deepinfer_jax.engine.async_engine import AsyncEngine

    model, llm = engine
    prompt = random_prompts(34, [23], model.config.vocab_size)[0]
    eng = AsyncEngine(lambda: llm.engine, max_queue_len=4).start()
    assert eng.wait_ready(10)

    async def go():
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        return [o async for o in eng.submit("v4", prompt, sp)]

    outs = asyncio.run(go())
    eng.shutdown()
    assert len(outs) > 1 and outs[-1].finished
    assert sum((o.outputs[0].token_ids for o in outs), []) == hf_greedy(model, prompt, 8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(pipeline_parallel_size=2), "--pipeline-parallel-size above 1 is not supported for deepseek_v4"),
    (dict(quantization="fp8"), "quantization 'fp8' is not supported for deepseek_v4"),
])
def test_unsupported_options_are_refused_by_name(v4_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(v4_dir[1], dtype="float32", skip_tokenizer_init=True, max_model_len=64, progress=False, **kwargs)
