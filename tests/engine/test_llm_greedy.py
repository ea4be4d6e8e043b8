"""Greedy LLM.generate equals HF transformers' greedy generate, token for token, under every
scheduling regime: prefix caching on and off, a pool small enough to preempt, a token budget small
enough to chunk prompts, and prompts sharing long prefixes. No compilation after warm-up."""

from __future__ import annotations

import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.mla_split import splits_prefill_attention
from deepinfer_jax.runner.step_programs import program_kind

LENGTHS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 64, 65, 100, 129, 200, 255, 300, 5, 33, 180]
MAX_TOKENS = [4, 9, 16, 12] * 5
MODEL_LEN = 512


def _llm(path, **kw):
    args = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=MODEL_LEN, max_num_seqs=16,
                max_num_batched_tokens=256, page_size=8, progress=False)
    args.update(kw)
    return LLM(path, **args)


def _addresses(runner):
    """Device addresses of the buffers every step program reads and writes in place."""
    at = {"kv_cache": runner.kv_cache.unsafe_buffer_pointer(), "prev": runner._prev_tokens.unsafe_buffer_pointer()}
    for key, res in runner.programs.residents.items():
        at[key, "inbox"], at[key, "outbox"] = res.inbox.unsafe_buffer_pointer(), res.outbox.unsafe_buffer_pointer()
    for layout, inbox in runner.programs.forward_inboxes.items():  # the shared prefill forwards' (prefill_shared_forward)
        at[layout, "forward inbox"] = inbox.unsafe_buffer_pointer()
    for shape, out in runner.programs.forward_outputs.items():
        at[shape, "forward out"] = out.unsafe_buffer_pointer()
    return at


def _check(llm, model, hf_greedy, prompts, max_tokens):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    before = _addresses(llm.engine.runner)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    # Each step program's inputs and results stay at the addresses warm-up gave them (what lets XLA
    # replay its CUDA graph unchanged on the GPU).
    assert _addresses(llm.engine.runner) == before
    assert [o.prompt_token_ids for o in outs] == prompts
    for p, n, o in zip(prompts, max_tokens, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, n), f"prompt of {len(p)} tokens"
        assert o.outputs[0].finish_reason == "length"
    assert llm.engine.runner.compiles_after_warmup == 0
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0  # every block back in the pool
    assert len(llm.engine.runner.page_rows) == 0  # every finished request's page ids dropped
    # Warm-up made one step program per bucket and sampling variant (base, full; greedy for decode buckets), and
    # where prefill buckets take the split attention (Pallas, RunnerConfig.prefill_context_variant) one per context
    # variant of each; with RunnerConfig.prefill_shared_forward a prefill bucket's context variant is its forward
    # and the two variants' samplers instead. Each compiled (its bucket's forward traced once) or, when an earlier
    # engine of the session stored the same program, loaded from the program cache untraced.
    runner = llm.engine.runner
    buckets = runner.shapes.buckets
    rc = runner.runner_cfg
    split = rc.prefill_context_variant and splits_prefill_attention(runner.cfg, rc.attn_impl, None,
                                                                    rc.prefill_attention)
    assert split is (rc.attn_impl != "reference" and rc.prefill_context_variant)  # these tests' dims fit the kernels
    decode_buckets = sum(b <= runner.shapes.seq_rows(b) for b in buckets)  # each with a greedy variant too
    shared = rc.prefill_shared_forward and not rc.collect_routing  # (one device here)
    prefill = [b for b in buckets if b > runner.shapes.seq_rows(b)]
    # shared: a forward a context variant, and the two variants' samplers a number of sequence rows (runner's
    # sampler_id); else a whole program a context variant and sampling variant
    prefill_programs = ((1 + split) * len(prefill) + 2 * len({runner.shapes.seq_rows(b) for b in prefill})
                        if shared else (1 + split) * 2 * len(prefill))
    programs = (2 + rc.greedy_variant) * decode_buckets + prefill_programs
    assert len(runner.programs.executables) == programs == llm.engine.num_warmup_compiles
    assert set(runner.programs.jitted) <= set(runner.programs.executables)
    assert len(runner.programs.jitted) + runner.programs_loaded == programs
    # each traced program that holds the forward traced it once a bucket (a sampler holds none: it may be traced
    # where its bucket's forward came from the program cache)
    layouts = {key if kind == "forward" else key[0] for kind, key in map(program_kind, runner.programs.jitted)
               if kind != "sampler"}
    assert len(runner.programs.forward_fns) == len(layouts)
    return outs


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_matches_hf(hf_case, hf_greedy, caching):
    """One model: the engine's path is the model's; the V3 model goes through the same engine against HF in
    test_shared_prefixes_hit_the_cache (prompts of 201-300 tokens, chunked) and test_engine_features.py, and every
    model's paged steps equal its full forward in tests/model/test_paged_forward.py."""
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(10, LENGTHS, model.config.vocab_size)
    _check(_llm(path, enable_prefix_caching=caching), model, hf_greedy, prompts, MAX_TOKENS)


@pytest.mark.parametrize("page_rows_min", [None, 0])
def test_greedy_with_preemption(hf_case, hf_greedy, monkeypatch, page_rows_min):
    """page_rows_min 0: every step's page table from the runner's PageRows (kept across steps, rebuilt when a
    preempted request's pages are allocated again) rather than only those of long sequences."""
    if page_rows_min is not None:
        from deepinfer_jax.runner import inputs

        monkeypatch.setattr(inputs, "PAGE_ROWS_MIN", page_rows_min)
    model, path = hf_case("v3_flat_plain_rope")
    prompts = random_prompts(11, LENGTHS, model.config.vocab_size)
    llm = _llm(path, num_pages=80)  # ~640 token slots for ~2,000 prompt tokens in flight
    _check(llm, model, hf_greedy, prompts, MAX_TOKENS)
    assert llm.engine.stats().num_preemptions > 0


def test_greedy_with_the_cpu_serving_defaults(hf_case, hf_greedy):
    """What `deepinfer serve` runs a small model with on a CPU (engine/serving_defaults.py): two token buckets
    (16 and 256 here: every step of 17 to 256 tokens padded to 256), no greedy variant, one warm-up run a step
    program. HF's tokens, no compile after warm-up, and the 5 programs warm-up made: the decode bucket's base and full steps, the top bucket's forward
    and its two samplers."""
    from deepinfer_jax.engine.serving_defaults import serving_defaults

    model, path = hf_case("v3_grouped_noaux")
    given = {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": MODEL_LEN}
    auto, _ = serving_defaults(ModelConfig.from_model_dir(path), "cpu", given)
    assert auto == {"token_buckets": (16, 256), "greedy_variant": False, "warmup_runs": 1}
    prompts = random_prompts(15, LENGTHS, model.config.vocab_size)
    llm = _llm(path, **auto)
    assert llm.engine.runner.shapes.buckets == (16, 256)
    _check(llm, model, hf_greedy, prompts, MAX_TOKENS)
    assert llm.engine.num_warmup_compiles == 5


def test_greedy_with_chunked_prefill(hf_case, hf_greedy):
    """Also RunnerConfig.prefill_layers "indexed": on the CPU (no layers unrolled) every step program runs its
    layers straight-line, each reading its weights by a runtime index (models/deepseek.py run_layers)."""
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(12, LENGTHS, model.config.vocab_size)
    llm = _llm(path, max_num_batched_tokens=32, max_num_seqs=8,  # prompts of up to 300 tokens: 10+ chunks
               prefill_layers="indexed")
    _check(llm, model, hf_greedy, prompts, MAX_TOKENS)


def test_shared_prefixes_hit_the_cache(hf_case, hf_greedy):
    model, path = hf_case("v3_grouped_noaux")
    vocab = model.config.vocab_size
    system = random_prompts(13, [200], vocab)[0]
    tails = random_prompts(14, [1, 3, 8, 9, 20, 40, 57, 64, 70, 90, 5, 16, 31, 33, 2, 100], vocab)
    prompts = [system + t for t in tails]
    n = [6] * len(prompts)
    cached = _llm(path, enable_prefix_caching=True)
    uncached = _llm(path, enable_prefix_caching=False)
    first = _check(cached, model, hf_greedy, prompts, n)
    again = _check(cached, model, hf_greedy, prompts, n)  # everything but partial blocks is cached now
    plain = _check(uncached, model, hf_greedy, prompts, n)
    for p, o in zip(prompts, again):
        assert o.num_cached_tokens == ((len(p) - 1) // 8) * 8
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert sum(o.num_cached_tokens for o in first) > 0  # later admissions hit the shared system prompt
    for a, b in zip(again, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries >= stats.prefix_cache_hits


def test_greedy_with_pallas_kernels_in_interpret_mode(hf_case, hf_greedy):
    """The GPU's path on the CPU: the kernels (MLA decode and prefill attention, MoE grouped GEMM, the
    decode projections reading o_proj and the dense MLP in place: every bucket here is at most 32 tokens)
    in Pallas interpret mode, the 16-slot bucket with the layers unrolled, the 32-slot one scanned: HF's tokens."""
    model, path = hf_case("v3_grouped_noaux")
    prompts = random_prompts(15, [1, 9, 40, 70], model.config.vocab_size)
    llm = _llm(path, attn_impl="pallas_interpret", moe_impl="pallas_interpret", max_num_batched_tokens=32,
               max_num_seqs=4, unroll_max_tokens=16)
    _check(llm, model, hf_greedy, prompts, [5, 6, 7, 4])


def test_greedy_with_fused_moe_kernels_in_interpret_mode(hf_case, hf_greedy):
    """The experimental MoE fusions (routing + alignment in one kernel, shared experts inside the expert
    kernels), on decode and prefill buckets, in Pallas interpret mode: still HF's tokens. Without
    RunnerConfig.prefill_context_variant: the prefill buckets' split attention decides its context part with
    a lax.cond a layer."""
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(16, [1, 9, 40, 70], model.config.vocab_size)
    llm = _llm(path, attn_impl="pallas_interpret", moe_impl="pallas_interpret", max_num_batched_tokens=32,
               max_num_seqs=4, unroll_max_tokens=16, fuse_shared_experts=True, fuse_moe_routing=True,
               prefill_context_variant=False)
    _check(llm, model, hf_greedy, prompts, [5, 6, 7, 4])


def test_prefill_context_known_on_the_host(hf_case, hf_greedy, monkeypatch):
    """RunnerConfig.prefill_context_variant: each prefill bucket compiles a program with the context part
    and one without, and each step takes the one its host-side `StepMetadata.has_context` names, in place of
    a lax.cond a layer. Fresh prompts, later chunks of a long prompt (context) and decodes in prefill buckets
    (4 sequence rows, buckets of 16+ slots): still HF's tokens, and both variants ran."""
    from deepinfer_jax.runner import model_runner

    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(17, [1, 9, 40, 70], model.config.vocab_size)
    # test_prefill_shared_forward.py's engine with the shared forwards (one program cache entry for both)
    llm = _llm(path, attn_impl="pallas_interpret", moe_impl="pallas_interpret", max_num_batched_tokens=32,
               max_num_seqs=4, unroll_max_tokens=16, prefill_context_variant=True)
    runner = llm.engine.runner
    prefill_buckets = [b for b in runner.shapes.buckets if b > runner.shapes.seq_rows(b)]
    assert prefill_buckets
    seen, build = [], model_runner.build_metadata

    def spy(*a, **k):
        meta = build(*a, **k)
        seen.append(meta.has_context)
        return meta

    monkeypatch.setattr(model_runner, "build_metadata", spy)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in [5, 6, 7, 4]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, n, o in zip(prompts, [5, 6, 7, 4], outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, n), f"prompt of {len(p)} tokens"
    assert True in seen and False in seen  # both programs of the prefill buckets served steps
    assert runner.compiles_after_warmup == 0
    # Two sampling variants per decode bucket and a third, greedy; two context variants of each prefill bucket,
    # each its shared forward (RunnerConfig.prefill_shared_forward); the two sampling variants' samplers, shared
    # by the context variants and by buckets of as many sequence rows.
    decode_buckets = len(runner.shapes.buckets) - len(prefill_buckets)
    rows = {runner.shapes.seq_rows(b) for b in prefill_buckets}
    assert len(runner.programs.executables) == 3 * decode_buckets + 2 * len(prefill_buckets) + 2 * len(rows)
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0


def test_dropping_the_llm_frees_the_kv_cache_at_once(hf_case):
    """Without a collection pass: no reference cycle keeps the runner (and the device memory of its KV
    cache) alive once its owner drops it. A second engine in the same process (benchmarks/gpu_vs_cpu.py)
    sizes its cache from the memory the first one gave back."""
    import gc
    import weakref

    _, path = hf_case("v3_flat_plain_rope")
    llm = _llm(path, max_num_batched_tokens=32)  # a decode bucket (16) and a prefill bucket (32), compiled here
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0.0, max_tokens=2))
    runner, cache = weakref.ref(llm.engine.runner), weakref.ref(llm.engine.runner.kv_cache)
    gc.disable()
    try:
        del llm
        assert runner() is None and cache() is None
    finally:
        gc.enable()


def test_greedy_steps_take_the_greedy_variant(hf_case, hf_greedy, monkeypatch):
    """RunnerConfig.greedy_variant: a step whose every request is greedy runs its decode bucket's greedy program
    (no draw); one with a sampled request runs the base program, and one asking for logprobs the full one.
    The greedy requests get HF's tokens whichever program served them, and seeded draws repeat."""
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(19, [3, 12, 30], model.config.vocab_size)
    llm = _llm(path)  # bucket 16 holds the 16 sequence rows: a decode bucket
    runner, ran = llm.engine.runner, []
    run = runner.run
    monkeypatch.setattr(runner, "run", lambda host: (ran.append((host.bucket, host.variant)), run(host))[1])
    greedy = [SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 3
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 5) for p in prompts]
    decode = {b for b in runner.shapes.buckets if b <= runner.shapes.seq_rows(b)}
    assert {v for b, v in ran if b in decode} == {"greedy"} and {v for b, v in ran if b not in decode} == {"base"}
    mixed = greedy[:2] + [SamplingParams(temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)]
    for want_variant in ("base", "full"):
        ran.clear()
        if want_variant == "full":
            mixed = mixed[:2] + [SamplingParams(temperature=1.0, seed=5, max_tokens=5, ignore_eos=True, logprobs=1)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], mixed)
        assert [o.outputs[0].token_ids for o in outs[:2]] == [hf_greedy(model, p, 5) for p in prompts[:2]]
        assert {v for _, v in ran} == {want_variant}
    assert runner.compiles_after_warmup == 0
