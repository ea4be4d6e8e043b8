"""Pipeline decode groups on GPUs: bf16 agreement with one GPU first, then decode throughput with N groups in flight
against one step at a time.

    python benchmarks/pipeline_decode_groups.py [--preset deepseek-v2-lite] [--layouts pp2,pp4] [--requests 32]
        [--prompt-len 64] [--max-tokens 128]

The same random weights and `--requests` prompts of `--prompt-len` tokens run on one GPU and on each layout (pp2: 2
stages of one GPU each; pp4: 4), greedy. Prints, per layout: requests whose first 16 tokens equal one GPU's, the mean
common prefix and the largest |logprob difference| over it (sharded_check.py's measures); then, for N decode groups
(engine/decode_groups.py, the default) and for one (`LLMEngine.set_decode_groups(1)`), the wall time of the whole
batch of `--max-tokens` tokens each (after a warm-up batch), its output tokens a second, the engine steps, the most
steps in flight and the compiles after warm-up. Every request fits one group's step (max_num_seqs = --requests), so
one group decodes them all in one step and N groups each decode about 1/N of them: a decode step's time is mostly
the stage's weight reads, so expect up to N times the tokens a second with N groups, less the fill and the
transfers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.pipeline_micro_batches import LAYOUTS, pipeline_setup  # noqa: E402
from benchmarks.sharded_check import compare  # noqa: E402

CHECK_TOKENS = 16


def make_engine(cfg, params, pp: int, seqs: int, top: int):
    import jax

    from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.sharding import ParallelConfig
    from deepinfer_jax.sharding.pipeline import build_pipeline_sharding

    sharding = None if pp == 1 else build_pipeline_sharding(cfg, ParallelConfig(1, 1, False, pp))
    gpu = jax.default_backend() == "gpu"
    return LLMEngine(
        cfg, params, None, sharding=sharding,
        scheduler_config=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=top, max_model_len=1024),
        cache_config=CacheConfig(page_size=64, enable_prefix_caching=False, gpu_memory_utilization=0.5),
        runner_config=RunnerConfig(dtype="bfloat16", attn_impl="pallas" if gpu else "reference",
                                   moe_impl="pallas" if gpu else "ragged",
                                   token_buckets=tuple(sorted({*(8 << i for i in range((seqs // 8).bit_length())),
                                                               *(32 << i for i in range((top // 32).bit_length()))}))),
        progress=False)


def generate(eng, prompts, max_tokens: int, tag: str):
    """Greedy `max_tokens` for each prompt -> ([(token ids, sampled logprobs)] in order, engine steps)."""
    from deepinfer_jax.types import SamplingParams

    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                       logprobs=0))
    outs, steps = {}, 0
    while eng.has_unfinished_requests():
        steps += 1
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    return [(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)])
            for o in (outs[f"{tag}{i}"] for i in range(len(prompts)))], steps


def timed(eng, prompts, max_tokens: int, groups: int) -> tuple[float, int, int]:
    """(seconds, engine steps, most steps in flight) of the batch with `groups` decode groups, after a warm-up."""
    eng.set_decode_groups(groups)
    generate(eng, prompts, 4, "w")
    eng.max_steps_in_flight = 0
    t = time.perf_counter()
    _, steps = generate(eng, prompts, max_tokens, "t")
    return time.perf_counter() - t, steps, eng.max_steps_in_flight


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--layouts", default="pp2")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-step-tokens", type=int, default=2048, help="the top of the bucket ladder (a power of two)")
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    from deepinfer_jax.weights.random_init import random_params

    setup = pipeline_setup(args.preset, args.layouts)
    if setup is None:
        return 2
    cfg, layouts = setup
    if args.prompt_len + args.max_tokens > 1024:
        print("--prompt-len + --max-tokens must fit max_model_len 1024", file=sys.stderr)
        return 2
    params = random_params(cfg, jnp.bfloat16, seed=0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, min(cfg.vocab_size, 100000), args.prompt_len).tolist() for _ in range(args.requests)]
    eng = make_engine(cfg, params, 1, args.requests, args.max_step_tokens)
    base, _ = generate(eng, prompts, CHECK_TOKENS, "c")
    del eng
    rows = ["| layout | identical requests | mean common prefix | max abs logprob diff | groups | seconds | tokens/s | "
            "steps | most in flight | compiles after warm-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in layouts:
        pp = LAYOUTS[name]
        eng = make_engine(cfg, params, pp, args.requests, args.max_step_tokens)
        same, prefix, _, diff = compare(base, generate(eng, prompts, CHECK_TOKENS, "c")[0])
        for groups in sorted({pp, 1}, reverse=True):
            seconds, steps, most = timed(eng, prompts, args.max_tokens, groups)
            rows.append(f"| {name} | {same}/{len(prompts)} | {prefix:.1f} of {CHECK_TOKENS} | {diff:.4f} | {groups} | "
                        f"{seconds:.2f} | {args.requests * args.max_tokens / seconds:.0f} | {steps} | {most if groups > 1 else '-'} | "
                        f"{eng.runner.compiles_after_warmup} |")
            print(rows[-1], flush=True)
        del eng
    print("== summary ==")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
