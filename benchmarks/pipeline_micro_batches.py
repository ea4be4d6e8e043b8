"""Pipeline micro-batches on GPUs: bf16 agreement with one GPU first, then a prefill step's time split and unsplit.

    python benchmarks/pipeline_micro_batches.py [--preset deepseek-v2-lite] [--layouts pp2,pp4] [--prompts 16]
        [--prompt-len 250]

The same random weights and a batch of `--prompts` prompts of `--prompt-len` tokens (one prefill step of them all;
the bucket ladder is powers of two from 32 up to --max-step-tokens, 4096) run on one GPU and on each layout (pp2:
2 stages of one GPU; pp4: 4 stages). Prints, per layout: requests whose greedy tokens equal one GPU's, the mean common prefix and the largest
|logprob difference| over it (sharded_check.py's measures); then that first prefill step's milliseconds run as the
rule splits it (runner/micro_batches.py: M micro-batches of bucket b) and run whole, each the mean of 10 runs, and
the hidden-state bytes one step moves between stages. The split pays where (M + N - 1) x t(b) < N x t(B): expect
about (M + N - 1) / (M x N) of the whole step's time on a compute-bound prefill, plus the transfers.
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

LAYOUTS = {"single": 1, "pp2": 2, "pp4": 4}  # name -> pipeline stages (one GPU a stage)
MAX_TOKENS = 16


def make_engine(cfg, params, pp: int, top: int):
    import jax

    from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.sharding import ParallelConfig
    from deepinfer_jax.sharding.pipeline import build_pipeline_sharding

    sharding = None if pp == 1 else build_pipeline_sharding(cfg, ParallelConfig(1, 1, False, pp))
    gpu = jax.default_backend() == "gpu"
    return LLMEngine(
        cfg, params, None, sharding=sharding,
        scheduler_config=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=top, max_model_len=1024),
        cache_config=CacheConfig(page_size=64, enable_prefix_caching=False, gpu_memory_utilization=0.5),
        runner_config=RunnerConfig(dtype="bfloat16", attn_impl="pallas" if gpu else "reference",
                                   moe_impl="pallas" if gpu else "ragged",
                                   token_buckets=tuple(32 << i for i in range((top // 32).bit_length()))),
        progress=False)


def greedy(eng, prompts):
    from deepinfer_jax.types import SamplingParams

    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    return [(list(o.token_ids), [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)])
            for o in (outs[f"r{i}"] for i in range(len(prompts)))]


def time_prefill(eng, prompts):
    """The first step of `prompts` (all prefill) -> {"split": (M, b, ms) or None, "whole": ms, "bytes": (split,
    whole)}: the runner's step as its rule splits it, and as one micro-batch."""
    import jax

    from deepinfer_jax.runner.model_runner import ModelRunner
    from deepinfer_jax.types import SamplingParams

    eng.set_decode_groups(1)  # one plan of every prompt (decode groups would admit 1/N of them each)
    for i, p in enumerate(prompts):
        eng.add_request(f"t{i}", p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    plan = eng.scheduler.schedule()
    requests = {s.request_id: eng.scheduler.requests[s.request_id] for s in plan.seqs}
    runner = eng.runner
    hosts = {"split": runner.prepare(plan.seqs, requests, eng._seeds),
             "whole": ModelRunner.prepare(runner, plan.seqs, requests, eng._seeds)}
    out = {}
    for name, host in hosts.items():
        if name == "split" and not getattr(host, "micro", ()):
            out[name] = None
            continue
        jax.block_until_ready(runner.run(host).buf)
        before = getattr(runner, "stage_boundary_bytes", 0)  # a single-device runner has no stages
        t = time.perf_counter()
        for _ in range(10):
            res = runner.run(host)
        jax.block_until_ready(res.buf)
        ms = (time.perf_counter() - t) / 10 * 1e3
        out[f"{name}_bytes"] = (getattr(runner, "stage_boundary_bytes", 0) - before) // 10
        out[name] = (len(host.micro), host.micro_bucket, ms) if name == "split" else ms
    return out


def pipeline_setup(preset: str, layouts_arg: str):
    """(the preset's ModelConfig, the --layouts names) with the compilation cache on and the devices printed, or
    None (after a line on stderr) where the machine has fewer devices than the largest layout's stages."""
    import jax

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache

    enable_compilation_cache("default")
    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", f"{preset}.json"))
    layouts = [n for n in layouts_arg.split(",") if n]
    need = max(LAYOUTS[n] for n in layouts)
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}", flush=True)
    if len(jax.devices()) < need:
        print(f"needs {need} devices", file=sys.stderr)
        return None
    return cfg, layouts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--layouts", default="pp2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=250)
    ap.add_argument("--max-step-tokens", type=int, default=4096, help="the top of the bucket ladder (a power of two)")
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    from deepinfer_jax.weights.random_init import random_params

    setup = pipeline_setup(args.preset, args.layouts)
    if setup is None:
        return 2
    cfg, layouts = setup
    if args.prompts * args.prompt_len > args.max_step_tokens:
        print("--prompts x --prompt-len must fit one step of --max-step-tokens", file=sys.stderr)
        return 2
    params = random_params(cfg, jnp.bfloat16, seed=0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, min(cfg.vocab_size, 100000), args.prompt_len).tolist() for _ in range(args.prompts)]
    eng = make_engine(cfg, params, 1, args.max_step_tokens)
    base = greedy(eng, prompts)
    del eng
    rows = ["| layout | identical requests | mean common prefix | max abs logprob diff | split (M x b) | split ms | "
            "whole ms | MiB between stages, split / whole |", "|---|---|---|---|---|---|---|---|"]
    for name in layouts:
        eng = make_engine(cfg, params, LAYOUTS[name], args.max_step_tokens)
        same, prefix, _, diff = compare(base, greedy(eng, prompts))
        late = eng.runner.compiles_after_warmup
        t = time_prefill(eng, prompts)
        split = t["split"]
        mib = (f"{t['split_bytes'] / 2**20:.2f} / " if split else "- / ") + f"{t['whole_bytes'] / 2**20:.2f}"
        rows.append(f"| {name} | {same}/{len(prompts)} | {prefix:.1f} of {MAX_TOKENS} | {diff:.4f} | "
                    + (f"{split[0]} x {split[1]} | {split[2]:.1f} | " if split else "not split | - | ")
                    + f"{t['whole']:.1f} | {mib} |")
        print(rows[-1] + f" (compiles after warm-up: {late})", flush=True)
        del eng
    print("== summary ==")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
