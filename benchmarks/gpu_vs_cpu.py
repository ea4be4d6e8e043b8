"""GPU kernels vs the CPU reference path on the same weights (the GPU issue's correctness target).

    python benchmarks/gpu_vs_cpu.py --write expected.json     # on the CPU: XLA reference paths, fp32
    python benchmarks/gpu_vs_cpu.py --check expected.json     # on the GPU: Pallas kernels, fp32 and bf16

Model: the V2-Lite attention and expert shapes (16 heads, 512 + 64 latent, hidden 2048, experts of
1408) cut to 3 layers, 16 experts (top-6) and a 4,096-token vocabulary, random weights U(+-0.05) from a
fixed seed (jax.random's threefry gives the same bits on every backend). Eight prompts of 1 to 300
random ids, greedy, 32 tokens with the sampled token's logprob. The check prints how many requests
give identical tokens in fp32 (the target: all), the largest logprob difference, and, for bf16 on the
GPU against fp32 on the GPU, the same figures (the usual bf16 error).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from sharded_check import compare  # noqa: E402

from benchmarks.runner_flags import add_variant_flags, variant_kwargs  # noqa: E402


def report(name, base, got):
    same, prefix, _, diff = compare(base, got)
    print(f"| {name} | {same}/{len(base)} | {prefix:.1f} of {len(base[0][0])} | {diff:.2e} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write")
    g.add_argument("--check")
    add_variant_flags(ap)  # the GPU runs' kernel variants (the CPU reference path has none)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 GEMMs in fp32, not TF32
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.weights.random_init import random_params
    from sharded_check import run_layout

    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models", "deepseek-v2-lite.json"))
    cfg = dataclasses.replace(cfg, num_hidden_layers=3, vocab_size=4096, n_routed_experts=16)
    params = random_params(cfg, jnp.float32, seed=0)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(2, cfg.vocab_size, n).tolist() for n in (1, 5, 17, 64, 100, 129, 200, 300)]
    if args.write:
        res = run_layout(cfg, params, "single_xla", prompts, 32, dtype="float32")
        with open(args.write, "w") as f:
            json.dump(res, f)
        return 0
    with open(args.check) as f:
        cpu = [tuple(r) for r in json.load(f)]
    print(f"device: {jax.devices()[0].device_kind}")
    gpu32 = run_layout(cfg, params, "single", prompts, 32, dtype="float32", runner_kwargs=variant_kwargs(args))
    gpu16 = run_layout(cfg, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), "single", prompts, 32,
                       dtype="bfloat16", runner_kwargs=variant_kwargs(args))
    print("| run | identical requests | mean common prefix | max abs logprob diff (common prefix) |")
    print("|---|---|---|---|")
    report("GPU Pallas fp32 vs CPU reference fp32", cpu, gpu32)
    report("GPU Pallas bf16 vs GPU Pallas fp32", gpu32, gpu16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
