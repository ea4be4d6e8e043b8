"""RunnerConfig.decode_shared_forward: decode buckets run every sampling variant's step as the bucket's forward and
the variant's sampler (as prefill buckets do with prefill_shared_forward), so warm-up compiles each bucket's forward
once: a dense model (Llama) with the greedy and full variants compiles one forward a bucket and no whole step
program, where the one-program decode steps compile a decode bucket's forward three times (base, greedy, full).
Tokens, logprobs and ranks equal the one-program engine's in every variant (greedy: HF's tokens); no compile after
warm-up, no KV page left in use."""

from __future__ import annotations

from hf_models import assert_same_outputs, random_prompts
from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.runner.step_programs import program_kind

PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=11, max_tokens=7, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=12, max_tokens=5, ignore_eos=True, logprobs=2)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _engine(path, shared: bool):
    # 4 sequence rows: bucket 4 decodes, bucket 16 prefills
    return LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=96, max_num_seqs=4,
               max_num_batched_tokens=16, token_buckets=(4, 16), page_size=8, progress=False, warmup_runs=1,
               decode_shared_forward=shared)


def _generate(llm, prompts):
    """The mixed batch (base and full variants), then an all-greedy one (the greedy variant)."""
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]
    outs += [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY)]
    runner = llm.engine.runner
    assert runner.compiles_after_warmup == 0
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0
    assert {"base", "greedy", "full"} <= set(runner.steps_by_variant)
    return outs


def test_decode_variants_share_the_bucket_forward(hf_case, hf_greedy):
    model, path = hf_case("llama_llama3")
    prompts = random_prompts(45, [3, 11, 6], model.config.vocab_size)
    one = _engine(path, shared=False)
    kinds = [program_kind(pid)[0] for pid in one.engine.runner.warmup_plan()[1]]
    # bucket 4: base and greedy whole steps and the full variant's forward; bucket 16: its forward
    assert kinds.count("step") == 2 and kinds.count("forward") == 2
    whole = _generate(one, prompts)
    del one

    two = _engine(path, shared=True)
    kinds = [program_kind(pid)[0] for pid in two.engine.runner.warmup_plan()[1]]
    assert kinds.count("step") == 0 and kinds.count("forward") == 2  # one forward a bucket
    assert kinds.count("sampler") == 3  # base, greedy, full: one a variant, both buckets having 4 rows
    assert two.engine.num_warmup_compiles == len(kinds)
    split = _generate(two, prompts)

    assert_same_outputs(whole, split)
    assert split[0].token_ids == hf_greedy(model, prompts[0], 6)
    assert [s.token_ids for s in split[3:]] == [hf_greedy(model, p, 5) for p in prompts[:2]]
    assert split[1].token_ids != split[0].token_ids  # the seeded draw is not greedy's
