"""The KV cache's host tier through LLM: greedy tokens equal HF transformers' while the tier serves prefix hits
(a device pool too small for the prompts, which come back) and while preempted requests come back from it
(swap) or, with a one-page tier, mostly recompute."""

from __future__ import annotations

import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.config import CacheConfig, ModelConfig
from deepinfer_jax.models.cache import kv_cache_bytes_per_page

PAGE = 8


def _llm(path, cfg, host_pages):
    gib = host_pages * kv_cache_bytes_per_page(cfg, PAGE, "float32") / 2**30
    return LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=512, max_num_seqs=16,
               max_num_batched_tokens=256, page_size=PAGE, progress=False, num_pages=80,
               kv_offloading_size=gib)


@pytest.mark.parametrize("host_pages", [300, 1])
def test_greedy_with_the_host_tier(hf_case, hf_greedy, host_pages):
    model, path = hf_case("v3_grouped_noaux")
    llm = _llm(path, ModelConfig.from_model_dir(path), host_pages)
    assert llm.engine.num_host_blocks == host_pages
    # 6 prompts of 150-160 tokens: ~120 pages for 79 usable ones, so requests preempt and cached pages leave HBM.
    prompts = random_prompts(31, [150, 153, 156, 159, 160, 151], model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    address = llm.engine.runner.kv_cache.unsafe_buffer_pointer()
    stats = []
    for _ in range(2):  # the second round finds its prompts' pages on the host (or recomputes them)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_greedy(model, p, 6), f"prompt of {len(p)} tokens"
        stats.append(llm.engine.stats())
    st = stats[-1]
    assert llm.engine.runner.kv_cache.unsafe_buffer_pointer() == address  # the loads scatter in place (donated)
    assert st.num_preemptions > 0 and st.host_blocks_saved > 0
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0
    assert llm.engine.runner.compiles_after_warmup == 0
    kv_transfer = llm.engine.runner.kv_transfer
    assert kv_transfer.bytes_to_host == st.host_blocks_saved * kv_transfer.page_bytes
    if host_pages > 1:
        # the first round's prompts are distinct: its hits are the preempted request's own pages (the exact swap
        # case, pages coming back from the host, is tests/unit/scheduler/test_host_tier.py's)
        assert stats[0].num_preemptions > 0 and stats[0].prefix_cache_hits > 0
        # tier hits in the second round: at least 3 prompts' 18 full pages each
        assert st.host_blocks_loaded >= 3 * 18 and st.host_tier_hits == st.host_blocks_loaded * PAGE
        assert sum(o.num_cached_tokens for o in outs) >= 3 * 18 * PAGE
        assert kv_transfer.bytes_to_device == st.host_blocks_loaded * kv_transfer.page_bytes
    else:
        assert st.host_blocks_loaded <= st.host_blocks_saved
    _check_metrics(llm.engine, st)


def _check_metrics(engine, st):
    """/metrics and the dashboard's host tier read the engine's counters."""
    from deepinfer_jax.server.dashboard import _host_cache
    from deepinfer_jax.server.metrics import ServerMetrics

    m = ServerMetrics("m")
    memory = engine.memory_report()
    snap = m.snapshot(st, 0, memory)
    one = lambda name, labels=(): snap["deepinfer:" + name][labels]  # noqa: E731
    assert one("kv_offload_hits_total") == st.host_tier_hits and one("kv_offload_queries_total") == st.host_tier_queries
    assert one("kv_offload_usage_perc") == st.host_tier_usage > 0
    page = engine.runner.kv_transfer.page_bytes
    assert one("kv_offload_bytes_total", (("direction", "to_host"),)) == st.host_blocks_saved * page
    assert one("kv_offload_bytes_total", (("direction", "to_device"),)) == st.host_blocks_loaded * page
    host = _host_cache(snap, memory)
    assert host["bytes"] == engine.num_host_blocks * page and host["hits"] == st.host_tier_hits


def test_host_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="needs prefix caching"):
        CacheConfig(kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size must be >= 0"):
        CacheConfig(kv_offloading_size=-1.0)


@pytest.mark.parametrize("pool", ["pinned", "pinned, 1-page programs", "pageable"])
def test_kv_transfer_copies_pages_exactly(pool, monkeypatch):
    """runner/kv_transfer.py on a small cache, with the pool in pinned host memory and in a numpy array: loads write
    the device pages; a device page saved and loaded over in the same batch is saved with its old contents, and a
    host block loaded and saved over in the same batch is loaded with its old contents (also where a batch runs as
    several pinned programs, one page each)."""
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.runner import kv_transfer
    from deepinfer_jax.scheduler.host_tier import KVTransfers

    if pool == "pageable":
        monkeypatch.setattr(kv_transfer, "_pinned_programs", lambda kv, n: None)
    if pool == "pinned, 1-page programs":
        monkeypatch.setattr(kv_transfer, "MAX_COPY_PAGES", 1)
    L, P, D = 2, 6, 3
    kv = jnp.arange(L * P * PAGE * D, dtype=jnp.float32).reshape(L, P, PAGE, D)
    ref = np.array(kv)
    t = kv_transfer.KVTransfer(kv, num_host_blocks=4)
    assert t.pinned == (pool != "pageable")
    if t.pinned:
        assert t.storage.sharding.memory_kind == "pinned_host"
    kv = t.apply(kv, KVTransfers(saves=[(2, 3), (5, 0), (1, 1)]))
    if not t.pinned:
        assert not t.storage.any()  # still in flight
    # page 4 saved to host block 3 and overwritten by it: each read before it is written
    kv = t.apply(kv, KVTransfers(saves=[(4, 3)], loads=[(3, 4), (0, 3)]))
    t.flush()
    storage = np.asarray(t.storage)
    for host, dev in [(3, 4), (0, 5), (1, 1)]:
        np.testing.assert_array_equal(storage[host], ref[:, dev])
    out = np.array(kv)
    np.testing.assert_array_equal(out[:, 4], ref[:, 2])
    np.testing.assert_array_equal(out[:, 3], ref[:, 5])
    for p in (1, 2, 5):
        np.testing.assert_array_equal(out[:, p], ref[:, p])
    assert t.bytes_to_host == 4 * t.page_bytes and t.bytes_to_device == 2 * t.page_bytes


@pytest.mark.parametrize("run", [1, 2, 3])
def test_kv_transfer_fetches_runs_of_host_blocks(run, monkeypatch):
    """Pinned fetches of consecutive host blocks as one copy (RUN_PAGES): ascending and descending runs, loads
    between them that make no run, and more loads than a program takes (MAX_COPY_PAGES) all land on their own
    device pages; warm-up compiles every program a batch can take, so this batch compiles none."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.runner import kv_transfer
    from deepinfer_jax.runner.compile_cache import CompileCounter
    from deepinfer_jax.scheduler.host_tier import KVTransfers

    monkeypatch.setattr(kv_transfer, "RUN_PAGES", run)
    monkeypatch.setattr(kv_transfer, "MAX_COPY_PAGES", 4)
    CompileCounter.install()
    L, P, H, D = 2, 12, 9, 3
    kv = jax.device_put(jnp.zeros((L, P, PAGE, D), jnp.float32), jax.devices()[0])  # committed, as the cache
    t = kv_transfer.KVTransfer(kv, num_host_blocks=H)
    assert t.pinned and t.run == run
    kv, _ = t.warm(kv, P)
    host = np.arange(H * L * PAGE * D, dtype=np.float32).reshape(H, L, PAGE, D) + 1.0
    t.storage = jax.device_put(host, t.storage.sharding)  # pinned host memory, as the saves leave it
    # host blocks 2, 3, 4 ascending; 8, 7, 6 descending; 0 alone; 5, 1 no run
    loads = [(2, 1), (3, 2), (4, 3), (8, 4), (7, 5), (6, 6), (0, 7), (5, 8), (1, 9)]
    before = CompileCounter.count()
    kv = t.apply(kv, KVTransfers(loads=loads))
    out = np.array(kv)
    assert CompileCounter.count() == before
    for h, d in loads:
        np.testing.assert_array_equal(out[:, d], host[h])
    for d in (0, 10, 11):  # untouched (page 0: the null page the warm-up wrote)
        if d:
            assert not out[:, d].any()
    runs, singles = kv_transfer._runs(loads, run)
    assert len(runs) == {1: 0, 2: 2, 3: 2}[run] and len(runs) * run + len(singles) == len(loads)
