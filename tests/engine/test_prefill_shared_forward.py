"""RunnerConfig.prefill_shared_forward: a prefill bucket's steps run the bucket's forward (one program a context
variant, shared by the sampling variants) and then the variant's sampler (a program each), instead of one whole
program a variant. Every request's tokens, ranks and logprobs equal those of the same engine with the whole
programs, in every sampling variant: greedy (HF's tokens), seeded draws, top-k / top-p with penalties, logprobs;
no compile after warm-up, no KV page left in use."""

from __future__ import annotations

from hf_models import assert_same_outputs, random_prompts
from deepinfer_jax import LLM, SamplingParams

PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True),
          SamplingParams(temperature=0.6, seed=12, max_tokens=7, ignore_eos=True, logprobs=3),
          SamplingParams(temperature=1.0, seed=13, max_tokens=5, ignore_eos=True, top_k=5, top_p=0.9,
                         presence_penalty=0.5, repetition_penalty=1.2),
          SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)]


def _run(path, prompts, shared: bool):
    # With `shared`, the engine of test_llm_greedy.py's test_prefill_context_known_on_the_host (the default
    # configuration): its programs come from the session's program cache when that test ran first.
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=32, page_size=8, attn_impl="pallas_interpret", moe_impl="pallas_interpret",
              unroll_max_tokens=16, prefill_shared_forward=shared, progress=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    runner = llm.engine.runner
    assert runner.compiles_after_warmup == 0
    assert llm.engine.scheduler.kv_cache_manager.usage == 0.0
    return [o.outputs[0] for o in outs], runner


def test_sampling_variants_share_the_prefill_forward(hf_case, hf_greedy):
    model, path = hf_case("v2_greedy_yarn")
    prompts = random_prompts(44, [1, 9, 40, 70, 12], model.config.vocab_size)
    whole, _ = _run(path, prompts, shared=False)
    split, runner = _run(path, prompts, shared=True)

    # 4 sequence rows: every bucket of 16+ slots (16 and 32) is a prefill bucket, with programs with and without the
    # context part; each of those has one forward. The samplers (base and full) depend only on the forward's output, so the
    # context variants, and the buckets of as many sequence rows, share them and their buffers.
    shapes = runner.shapes
    prefill = [b for b in shapes.buckets if b > shapes.seq_rows(b)]
    assert len(prefill) >= 2
    kinds = [pid[0] for pid in runner.programs.executables if isinstance(pid[0], str)]
    rows = {shapes.seq_rows(b) for b in prefill}
    assert kinds.count("forward") == 2 * len(prefill) and kinds.count("sampler") == 2 * len(rows) < 4 * len(prefill)
    samplers = [res for pid, res in runner.programs.residents.items() if pid[0] == "sampler"]
    assert len(samplers) == 2 * len(rows)
    assert len(runner.programs.residents) == len(samplers) + len(runner.programs.executables) - len(kinds)  # + the decode steps'

    assert_same_outputs(whole, split)
    assert split[0].token_ids == hf_greedy(model, prompts[0], 6)
    assert split[4].token_ids == hf_greedy(model, prompts[4], 4)
    assert len(split[2].logprobs) == 7 and all(len(lp) >= 3 for lp in split[2].logprobs)
    assert len({tuple(o.token_ids) for o in split[1:4]}) == 3  # the draws differ from one another
