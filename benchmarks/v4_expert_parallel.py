"""DeepSeek-V4 with its routed experts over several GPUs (docs/multi-gpu.md "DeepSeek-V4"): correctness, then timing.

    python benchmarks/v4_expert_parallel.py [--devices 8] [--layers 4] [--batches 1,16,64] [--prompt 512]
                                            [--config CONFIG_JSON] [--tiny]

1. Correctness first: the tiny random V4 model of the tests (every attention kind, hash and scored MoE), fp32,
   greedy tokens of a chunked batch through `LLM` under EP = 2 and EP = 3 (`--enable-expert-parallel`) and its
   experts' width over 2, each equal to one device's; the script stops if not.
2. Memory: the V4 shape (`--config`, default HF's DeepseekV4Config: V4-Flash, 256 experts top-6 of width 2048,
   hidden 4096) cut to `--layers` layers, random bf16 weights (load_format "dummy", float experts), EP over
   `--devices` GPUs (the attention's query heads over them too where they divide `o_groups`, sharding/rules.py
   v4_rules): the weight bytes on GPU 0 against `deepinfer plan`'s per-device figure (they must be equal).
3. Timing: for each batch, `batch` prompts of `--prompt` random tokens then 32 greedy tokens each; prints the
   prefill seconds (one output token) and the tokens per second of 32 more (the prompts then served by the prefix
   cache, so nearly all of that run is decode).
`--tiny`: steps 2-3 at the tiny shape on fake CPU devices (a smoke run of the same code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

if "--tiny" in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np  # noqa: E402


def write_config(d: str, cfg: dict) -> str:
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(cfg, model_type="deepseek_v4"), f)
    return d


def greedy(model_dir: str, prompts, max_tokens: int, dtype: str, **kw):
    from deepinfer_jax import LLM, SamplingParams

    llm = LLM(model_dir, load_format="dummy", dtype=dtype, skip_tokenizer_init=True, progress=False, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def check(tiny: dict) -> None:
    sizes = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=13, page_size=4, num_pages=48,
                 token_buckets=(13,), greedy_variant=False, warmup_runs=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, tiny["vocab_size"], n).tolist() for n in (5, 19, 27, 2)]
    with tempfile.TemporaryDirectory() as d:
        write_config(d, tiny)
        _, base = greedy(d, prompts, 8, "float32", **sizes)
        for tp, ep in ((2, True), (3, True), (2, False)):
            _, got = greedy(d, prompts, 8, "float32", tensor_parallel_size=tp, enable_expert_parallel=ep, **sizes)
            if got != base:
                sys.exit(f"TP={tp} ep={ep}: greedy tokens {got} differ from one device's {base}")
    print("check: EP=2, EP=3 and the experts' width over 2 give one device's greedy tokens (tiny V4, fp32)")


def main() -> None:
    from hf_models_v4 import V4_TINY

    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=None, help="GPUs the experts span (default: all)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--config", default=None, help="a deepseek_v4 config.json (default: HF's DeepseekV4Config)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    import jax

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.plan import v4_weight_bytes
    from deepinfer_jax.sharding import ParallelConfig
    from deepinfer_jax.sharding.rules import v4_bytes_per_device

    check(V4_TINY)
    if args.tiny:
        cfg, dtype = dict(V4_TINY, num_hidden_layers=args.layers, max_position_embeddings=4096), "float32"
        cfg.update(layer_types=(V4_TINY["layer_types"] * args.layers)[: args.layers],
                   mlp_layer_types=(V4_TINY["mlp_layer_types"] * args.layers)[: args.layers])
        args.prompt, batches, n = min(args.prompt, 40), [1, 4], args.devices or 2
    else:
        if args.config:
            with open(args.config) as f:
                cfg = json.load(f)
        else:
            from transformers import DeepseekV4Config

            cfg = DeepseekV4Config().to_dict()
        L = args.layers
        cfg.update(num_hidden_layers=L, num_nextn_predict_layers=0)
        for k in ("layer_types", "mlp_layer_types"):
            if cfg.get(k):
                cfg[k] = cfg[k][:L]
        dtype, batches, n = "bfloat16", [int(b) for b in args.batches.split(",")], args.devices or jax.device_count()
    with tempfile.TemporaryDirectory() as d:
        write_config(d, cfg)
        by_leaf: dict = {}  # `deepinfer plan`'s figure (a config without weight files: the float specs)
        v4_weight_bytes(ModelConfig.from_model_dir(d), dtype, by_leaf=by_leaf)
        planned = v4_bytes_per_device(ModelConfig.from_model_dir(d), ParallelConfig(n, 1, True), by_leaf)
        print(f"V4 {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {cfg['n_routed_experts']} experts "
              f"top-{cfg['num_experts_per_tok']}, EP={n}: plan {planned / 2**30:.3f} GiB of weights a device")
        rng = np.random.default_rng(1)
        print("| batch | prefill s | decode tok/s |\n|---|---|---|")
        for b in batches:
            prompts = [rng.integers(2, cfg["vocab_size"], args.prompt).tolist() for _ in range(b)]
            kw = dict(max_model_len=args.prompt + 64, max_num_seqs=b, max_num_batched_tokens=max(2048, b),
                      tensor_parallel_size=n, enable_expert_parallel=True, warmup_runs=1)
            llm, _ = greedy(d, prompts[:1], 2, dtype, **kw)  # compiled and warm
            dev = jax.devices()[0]
            held = sum(s.data.nbytes for a in jax.tree.leaves(llm.engine.runner.params)
                       for s in a.addressable_shards if s.device == dev)
            if held != planned:
                sys.exit(f"weights on device 0: {held} bytes, plan says {planned}")
            t0 = time.perf_counter()
            from deepinfer_jax import SamplingParams

            llm.generate([{"prompt_token_ids": q} for q in prompts], SamplingParams(temperature=0.0, max_tokens=1))
            t1 = time.perf_counter()
            llm.generate([{"prompt_token_ids": q} for q in prompts],
                         SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True))
            t2 = time.perf_counter()
            # the second run's prompts hit the prefix cache (their last token only is computed): mostly decode
            print(f"| {b} | {t1 - t0:.3f} | {b * 32 / (t2 - t1):.1f} |", flush=True)
            del llm


if __name__ == "__main__":
    main()
