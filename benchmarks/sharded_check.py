"""bf16 equality of sharded layouts against one device, on the GPU machine (the sharding issue).

    python benchmarks/sharded_check.py [--layouts tp2,dp2ep2,tp2ep2,single_xla] [--preset deepseek-v2-lite]
    python benchmarks/sharded_check.py --fp8 [--preset moonlight-16b-a3b] [--layouts dp2ep2,tp2ep2,single_xla]

The same random weights (drawn once on device 0, then placed on each layout's shardings) and the same
mixed batch (prompts of 1 to 511 random ids, greedy, 24 output tokens, with the sampled token's
logprob) run on one device and on each layout. Prints, per layout: requests whose greedy tokens are
identical, the mean common prefix, the first-token agreement, and the largest |logprob difference|
over the common prefix (the bf16 tolerance figure). With random weights the logits have tiny margins,
so a bf16 reduction-order difference can flip a near-tie and the continuations then diverge: the
logprob difference over the common prefix is the measure of numerical agreement.

`--fp8`: the random weights quantized on the device to FP8 with 128 x 128 blocks (what an FP8 checkpoint of them
loads as) and kept FP8 on every layout (sharding/packed.py). Every layout on the GPU takes the FP8 kernels where
`quant.fp8_kernel_act` routes them (W8A8 at decode sizes): one device on the whole weights, a sharded layout on each
device's slice (models/fp8_parallel.py for o_proj and the dense MLP, the grouped GEMM for the experts), judged by
each device's GEMM; each layout prints which projections take the FP8 GEMM at its decode bucket (Moonlight: the
dense MLP's gate_up on every layout, its down where not split by TP; V2-Lite: none, its I = 10944 is not whole
128-row blocks, so its projections keep the reference everywhere, one device included). "single_xla" (the
reference, dequantize + dot, on one device) shows the kernels' W8A8 rounding beside it. A layout whose split would
cut a 128 x 128 block is refused (printed as such): on V2-Lite (I = 10944, 1408) only dp2ep2 keeps whole blocks; on
Moonlight (I = 11264) tp2ep2 and dp2ep2 do.
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
    if sharding is not None:  # FP8 leaves: q and scale split alike, whole blocks a device (else a ValueError)
        params = jax.device_put(params, sharding.fit_param_shardings(cfg, params))
    eng = LLMEngine(
        cfg, params, None, sharding=sharding,
        scheduler_config=SchedulerConfig(max_num_seqs=16 // dp, max_num_batched_tokens=4096 // dp, max_model_len=1024),
        cache_config=CacheConfig(page_size=64, enable_prefix_caching=False, gpu_memory_utilization=0.5),
        runner_config=RunnerConfig(dtype=dtype, attn_impl=gpu and "pallas" or "reference",
                                   moe_impl=gpu and "pallas" or "ragged",
                                   token_buckets=(16 // dp, 4096 // dp), warmup_full_variant=True,
                                   **(runner_kwargs or {})),
        progress=False)
    if gpu:
        print(f"{name}: FP8 GEMM at {16 // dp}-token decode steps: {fp8_gemm_leaves(cfg, params, sharding, 16 // dp)}",
              flush=True)
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


def fp8_gemm_leaves(cfg, params, sharding, num_tokens: int) -> list[str]:
    """The FP8 projections a decode step of `num_tokens` token slots runs through kernels/fp8_gemm.py under this
    layout (models/decode_kernels.py: `decode_stacked` on one device, `decode_stacked_splits` per device)."""
    from deepinfer_jax.models.decode_kernels import decode_stacked, decode_stacked_splits
    from deepinfer_jax.models.params import layer_segments
    from deepinfer_jax.models.quant import is_fp8

    mr = None if sharding is None else sharding.mesh_rules
    out = []
    for i, (seg, sp) in enumerate(zip(layer_segments(cfg), params["segments"])):
        one = {k for k, w in decode_stacked(sp, num_tokens, "pallas", mr, True).items() if is_fp8(w)}
        keys = one | set(decode_stacked_splits(seg, sp, cfg, num_tokens, "pallas", mr, True))
        out += [f"segments.{i}.{g}.{n}" for g, n in sorted(keys)]
    return out


def quantize_fp8_on_device(params, block=(128, 128)):
    """Every quantizable leaf of a float params tree as the Fp8Weight its FP8 checkpoint would load as
    (models/quant.py quantize_fp8's arithmetic: HF's [out, in] per tensor, scale = amax / 448 a block), computed on
    the device one leaf at a time."""
    import functools
    import math

    import jax
    import jax.numpy as jnp

    from deepinfer_jax.models.quant import E4M3_MAX, FP8_PARTS_LEAVES, Fp8Weight, fp8_layout, quant_layout

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def blocks(w, nl, q_shape, s_shape):
        bn, bk = block
        *lead, N, K = q_shape
        sn, sk = s_shape[-2:]
        hf = jnp.moveaxis(w, nl, -1).reshape(q_shape).astype(jnp.float32)  # [*lead, (2,) N, K]
        pad = jnp.pad(hf, [(0, 0)] * len(lead) + [(0, sn * bn - N), (0, sk * bk - K)])
        x = pad.reshape(*lead, sn, bn, sk, bk)
        scale = jnp.max(jnp.abs(x), axis=(-3, -1)) / E4M3_MAX
        scale = jnp.where(scale > 0, scale, 1.0)
        q = jnp.clip(x / scale[..., :, None, :, None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
        return q.reshape(*lead, sn * bn, sk * bk)[..., :N, :K], scale

    def one(path, leaf):
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        lay = quant_layout(keys)
        if lay is None:
            return leaf
        parts_apart = keys[-1] in FP8_PARTS_LEAVES
        q_shape, s_shape, ins, outs, parts = fp8_layout(leaf.shape, lay[0], lay[1], block, parts_apart)
        nl = leaf.ndim - lay[0] - lay[1]
        flat = leaf.reshape(leaf.shape[:nl] + (math.prod(ins),) + tuple(outs))  # [*lead, K, *out]
        q, scale = blocks(flat, nl, tuple(q_shape), tuple(s_shape))
        return Fp8Weight(q, scale, tuple(block), tuple(ins), tuple(outs), parts)

    return jax.tree_util.tree_map_with_path(one, params)


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
    ap.add_argument("--fp8", action="store_true", help="FP8 128 x 128 block-scaled weights, kept FP8 on every layout")
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
    if args.fp8:
        params = quantize_fp8_on_device(params)
    rng = np.random.default_rng(1)
    lens = [1, 7, 33, 64, 130, 257, 400, 511]
    prompts = [rng.integers(100, min(cfg.vocab_size, 100000), n).tolist() for n in lens]
    base = run_layout(cfg, params, "single", prompts, args.max_tokens)
    print("| layout | identical requests | mean common prefix | first token agrees | max abs logprob diff (common prefix) |")
    print("|---|---|---|---|---|")
    rows = []
    for name in [n for n in args.layouts.split(",") if n]:
        try:
            got = run_layout(cfg, params, name, prompts, args.max_tokens)
        except ValueError as e:  # an FP8 split that would cut a scale block
            rows.append(f"| {name} | refused: {e} | | | |")
            print(rows[-1], flush=True)
            continue
        same, prefix, first, diff = compare(base, got)
        rows.append(f"| {name} | {same}/{len(prompts)} | {prefix:.1f} of {args.max_tokens} | "
                    f"{first}/{len(prompts)} | {diff:.4f} |")
        print(rows[-1], flush=True)
    print("== summary ==")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
