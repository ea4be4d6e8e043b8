"""bf16 equality of sharded layouts against one device, on the GPU machine (the sharding issue).

    python benchmarks/sharded_check.py [--layouts tp2,dp2ep2,tp2ep2,single_xla] [--preset deepseek-v2-lite]

The same random weights (drawn once on device 0, then placed on each layout's shardings) and the same
mixed batch (prompts of 1 to 511 random ids, greedy, 24 output tokens, with the sampled token's
logprob) run on one device and on each layout. Prints, per layout: requests whose greedy tokens are
identical, the mean common prefix, the first-token agreement, and the largest |logprob difference|
over the common prefix (the bf16 tolerance figure). With random weights the logits have tiny margins,
so a bf16 reduction-order difference can flip a near-tie and the continuations then diverge: the
logprob difference over the common prefix is the measure of numerical agreement.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# name -> (TP, DP, EP, kernels): "single_xla" is one device through the XLA reference paths instead of
# the Pallas kernels: its difference from "single" is the bf16 noise of two valid implementations.
LAYOUTS = {"single": (1, 1, False, True), "tp2": (2, 1, False, True), "dp2ep2": (1, 2, True, True),
           "tp2ep2": (2, 1, True, True), "single_xla": (1, 1, False, False)}


def run_layout(cfg, params, name, prompts, max_tokens, dtype="bfloat16", runner_kwargs=None):
    """Greedy generation of `prompts` under the layout `name` -> [(token ids, sampled logprobs)] per prompt.
    `runner_kwargs`: more RunnerConfig fields (benchmarks/runner_flags.py's variants)."""
    import jax

    from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.sharding import ParallelConfig, build_sharding
    from deepinfer_jax.types import SamplingParams

    tp, dp, ep, kernels = LAYOUTS[name]
    gpu = jax.default_backend() == "gpu" and kernels
    parallel = ParallelConfig(tp, dp, ep)
    sharding = None if parallel.is_single_device else build_sharding(cfg, parallel)
    if sharding is not None:
        params = jax.device_put(params, sharding.param_shardings(cfg))
    eng = LLMEngine(
        cfg, params, None, sharding=sharding,
        scheduler_config=SchedulerConfig(max_num_seqs=16 // dp, max_num_batched_tokens=4096 // dp, max_model_len=1024),
        cache_config=CacheConfig(page_size=64, enable_prefix_caching=False, gpu_memory_utilization=0.5),
        runner_config=RunnerConfig(dtype=dtype, attn_impl=gpu and "pallas" or "reference",
                                   moe_impl=gpu and "pallas" or "ragged",
                                   token_buckets=(16 // dp, 4096 // dp), warmup_full_variant=True,
                                   **(runner_kwargs or {})),
        progress=False)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    res = []
    for i in range(len(prompts)):
        c = outs[f"r{i}"]
        res.append((list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]))
    print(f"{name}: compiles after warm-up {eng.runner.compiles_after_warmup}", flush=True)
    del eng
    return res


def compare(base, got) -> tuple[int, float, int, float]:
    """Two runs' [(token ids, sampled logprobs)] per request -> (requests with identical tokens, mean
    common prefix, requests whose first token agrees, largest |logprob difference| over the common prefixes)."""
    same, prefix, first, diff = 0, [], 0, 0.0
    for (bt, bl), (gt, gl) in zip(base, got):
        n = next((i for i, (a, b) in enumerate(zip(bt, gt)) if a != b), len(bt))
        same += n == len(bt)
        first += bt[0] == gt[0]
        prefix.append(n)
        if n:
            diff = max(diff, float(np.max(np.abs(np.asarray(bl[:n]) - np.asarray(gl[:n])))))
    return same, float(np.mean(prefix)), first, diff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--layouts", default="tp2,dp2ep2")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.weights.random_init import random_params

    enable_compilation_cache("default")
    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"))
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}", flush=True)
    params = random_params(cfg, jnp.bfloat16, seed=0)
    rng = np.random.default_rng(1)
    lens = [1, 7, 33, 64, 130, 257, 400, 511]
    prompts = [rng.integers(100, min(cfg.vocab_size, 100000), n).tolist() for n in lens]
    base = run_layout(cfg, params, "single", prompts, args.max_tokens)
    print("| layout | identical requests | mean common prefix | first token agrees | max abs logprob diff (common prefix) |")
    print("|---|---|---|---|---|")
    rows = []
    for name in [n for n in args.layouts.split(",") if n]:
        same, prefix, first, diff = compare(base, run_layout(cfg, params, name, prompts, args.max_tokens))
        rows.append(f"| {name} | {same}/{len(prompts)} | {prefix:.1f} of {args.max_tokens} | "
                    f"{first}/{len(prompts)} | {diff:.4f} |")
        print(rows[-1], flush=True)
    print("== summary ==")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
