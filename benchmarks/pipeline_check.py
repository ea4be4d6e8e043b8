"""Pipeline parallelism on GPUs: bf16 agreement with one GPU first, then the time of a prefill and a decode step.

    python benchmarks/pipeline_check.py [--preset deepseek-v2-lite] [--layouts pp2,pp2tp2,pp4] [--max-tokens 24]

The same random weights (drawn once on device 0) and the same mixed greedy batch (sharded_check.py's prompts) run
on one GPU and on each layout (pp2: 2 stages of one GPU; pp2tp2: 2 stages of TP = 2; pp4: 4 stages). Prints, per
layout: requests whose greedy tokens equal one GPU's, the mean common prefix and the largest |logprob difference|
over it (sharded_check.py's measures), then the seconds of the whole batch and the mean time of a decode step of
16 sequences and of a 4096-token prefill step. These padding steps run whole, one stage after another (a real
prefill step of several sequences may run as micro-batches: benchmarks/pipeline_micro_batches.py), so expect one
GPU's step time plus the transfers, not a speed-up: the figure to watch is the transfer's share.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.sharded_check import compare  # noqa: E402

LAYOUTS = {"single": (1, 1), "pp2": (2, 1), "pp2tp2": (2, 2), "pp4": (4, 1)}  # name -> (PP, TP)


def run_layout(cfg, params, name, prompts, max_tokens):
    """-> ([(token ids, sampled logprobs)] per prompt, batch seconds, decode step ms, prefill step ms)."""
    import jax

    from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.sharding import ParallelConfig
    from deepinfer_jax.sharding.pipeline import build_pipeline_sharding
    from deepinfer_jax.types import SamplingParams

    pp, tp = LAYOUTS[name]
    sharding = None if pp * tp == 1 else build_pipeline_sharding(cfg, ParallelConfig(tp, 1, False, pp))
    gpu = jax.default_backend() == "gpu"
    eng = LLMEngine(
        cfg, params, None, sharding=sharding,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=1024),
        cache_config=CacheConfig(page_size=64, enable_prefix_caching=False, gpu_memory_utilization=0.5),
        runner_config=RunnerConfig(dtype="bfloat16", attn_impl="pallas" if gpu else "reference",
                                   moe_impl="pallas" if gpu else "ragged", token_buckets=(16, 4096)),
        progress=False)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    seconds = time.perf_counter() - t0
    res = [(list(outs[f"r{i}"].token_ids), [lp[t].logprob for lp, t in zip(outs[f"r{i}"].logprobs,
                                                                         outs[f"r{i}"].token_ids)])
           for i in range(len(prompts))]
    runner = eng.runner
    times = []
    for bucket in (16, 4096):  # padding steps of each bucket, timed end to end
        host = runner.padding_step(bucket, False)
        jax.block_until_ready(runner.run(host).buf)
        t = time.perf_counter()
        for _ in range(10):
            out = runner.run(host)
        jax.block_until_ready(out.buf)
        times.append((time.perf_counter() - t) / 10 * 1e3)
    print(f"{name}: compiles after warm-up {runner.compiles_after_warmup}", flush=True)
    del eng, runner
    return res, seconds, times[0], times[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--layouts", default="pp2,pp2tp2")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.weights.random_init import random_params

    enable_compilation_cache("default")
    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{args.preset}.json"))
    layouts = [n for n in args.layouts.split(",") if n]
    need = max(pp * tp for pp, tp in (LAYOUTS[n] for n in layouts))
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}", flush=True)
    if len(jax.devices()) < need:
        print(f"needs {need} devices", file=sys.stderr)
        return 2
    params = random_params(cfg, jnp.bfloat16, seed=0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, min(cfg.vocab_size, 100000), n).tolist() for n in [1, 7, 33, 64, 130, 257, 400, 511]]
    base, secs, dec, pre = run_layout(cfg, params, "single", prompts, args.max_tokens)
    head = ("| layout | identical requests | mean common prefix | max abs logprob diff | batch s | decode step ms | "
            "prefill step ms |")
    rows = [head, "|---|---|---|---|---|---|---|",
            f"| single | - | - | - | {secs:.2f} | {dec:.2f} | {pre:.1f} |"]
    print(rows[-1], flush=True)
    for name in layouts:
        got, secs, dec, pre = run_layout(cfg, params, name, prompts, args.max_tokens)
        same, prefix, _, diff = compare(base, got)
        rows.append(f"| {name} | {same}/{len(prompts)} | {prefix:.1f} of {args.max_tokens} | {diff:.4f} | {secs:.2f} | "
                    f"{dec:.2f} | {pre:.1f} |")
        print(rows[-1], flush=True)
    print("== summary ==")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
