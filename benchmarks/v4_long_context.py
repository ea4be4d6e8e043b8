"""DeepSeek-V4's per-group cache at long contexts: tokens of KV per GiB of device memory against a dense cache.

    python benchmarks/v4_long_context.py [--config CONFIG_JSON] [--contexts 131072,1048576]
                                         [--page-size 64] [--max-num-seqs 4] [--skip-check]

1. Correctness first: a tiny random V4 model through the engine (`LLM`, per-group cache, chunked prefill that
   ends inside compression windows) must give the greedy tokens of the whole-sequence reference generator
   (`v4_greedy_generate`) on the same weights; the script stops if not.
2. Memory, measured on the device: for each context, the engine's pools (runner/device_memory.v4_pools, as
   `LLM` sizes them) for `--max-num-seqs` sequences of that context are allocated on the device
   (registry.init_kv_cache) and their bytes read back from the arrays and, where the backend reports it, from the
   allocator; then tokens of context per GiB, set against the dense caches the same context would take: V3's MLA
   latent (61 layers of 576 values) and the token-granular V4 layout (every layer's raw row and projections per
   token). The attention over such contexts is not timed here: the reference path gathers whole histories per
   token (docs/v4.md: the paged kernels are the next step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from deepinfer_jax.config import ModelConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from deepinfer_jax.config_v4 import v4_cache_bytes_per_token, v4_cache_groups, v4_pool_bytes  # noqa: E402

MLA_V3 = 61 * 576  # values per token: V3's latent (kv_lora_rank 512 + rope 64) in each of 61 layers


def check_against_reference() -> None:
    """Greedy tokens through the engine == v4_greedy_generate's on the same random weights (fp32)."""
    from hf_models_v4 import V4_TINY

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.models.deepseek_v4 import v4_greedy_generate

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(dict(V4_TINY, model_type="deepseek_v4"), f)
        llm = LLM(d, dtype="float32", load_format="dummy", skip_tokenizer_init=True, max_model_len=64,
                  max_num_seqs=2, max_num_batched_tokens=13, page_size=4, num_pages=8, progress=False,
                  token_buckets=(4, 13), greedy_variant=False, warmup_runs=1)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(2, V4_TINY["vocab_size"], n).tolist() for n in (29, 41)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        cfg, params = llm.engine.cfg.v4, llm.engine.runner.params
        for p, o in zip(prompts, outs):
            buf = jnp.zeros(64, jnp.int32).at[: len(p)].set(jnp.asarray(p, jnp.int32))
            want = np.asarray(v4_greedy_generate(cfg, params, buf, len(p), 12))[len(p): len(p) + 12].tolist()
            if o.outputs[0].token_ids != want:
                sys.exit(f"per-group cache differs from the reference: {o.outputs[0].token_ids} != {want}")
    print("check: engine greedy tokens == v4_greedy_generate's (2 prompts, chunks of 13 across windows of 4 / 8)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="a deepseek_v4 config.json (default: HF's DeepseekV4Config)")
    ap.add_argument("--contexts", default="131072,1048576")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-check", action="store_true")
    a = ap.parse_args()
    if not a.skip_check:
        check_against_reference()
    d = {"model_type": "deepseek_v4"}
    if a.config:
        with open(a.config) as f:
            d = json.load(f)
    from deepinfer_jax.models.registry import init_kv_cache
    from deepinfer_jax.runner.device_memory import device_memory, v4_pools

    cfg = ModelConfig.from_hf_dict(d)
    v4, ps, dev = cfg.v4, a.page_size, jax.devices()[0]
    runner = RunnerConfig(dtype="bfloat16")
    hd, di = v4.head_dim, v4.index_head_dim
    granular = sum(hd + {"sliding_attention": 0, "compressed_sparse_attention": 4 * hd + 4 * di,
                         "heavily_compressed_attention": 2 * hd}[t] for t in v4.layer_types)  # values per token
    print(f"device {dev.device_kind}; {v4.num_hidden_layers} layers, bf16, page_size {ps}, "
          f"{a.max_num_seqs} sequences a context")
    grow = 2**30 / v4_cache_bytes_per_token(v4)["total"]
    print(f"growing groups alone: {grow:,.0f} tokens/GiB (the limit at many tokens a sequence); the windowed pools "
          f"add a fixed share for {a.max_num_seqs} sequences and a {a.max_num_batched_tokens}-token step")
    print(f"{'context':>9} | {'pools GiB':>9} {'measured':>9} | {'V4 tokens/GiB':>13} | "
          f"{'V3 MLA tokens/GiB':>17} | {'V4 token-granular/GiB':>21} | groups (pages)")
    for ctx in (int(c) for c in a.contexts.split(",")):
        sched = SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                max_model_len=ctx)
        pools, _ = v4_pools(cfg, a.max_num_seqs * (-(-ctx // ps)) + 1, "(set explicitly)", ps, sched, runner)
        mem0 = device_memory(dev)
        cache = jax.block_until_ready(init_kv_cache(cfg, pools, ps, jnp.bfloat16))
        mem1 = device_memory(dev)
        nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(cache))
        assert nbytes == sum(v4_pool_bytes(pools)), (nbytes, v4_pool_bytes(pools))
        measured = "n/a" if mem0 is None or mem1 is None else f"{(mem1.in_use - mem0.in_use) / 2**30:9.3f}"
        del cache
        tokens = a.max_num_seqs * ctx
        groups = ", ".join(f"{g.name} {pools.pool_pages[k]}" for g, k in zip(v4_cache_groups(v4), pools.pool_of))
        print(f"{ctx:>9,} | {nbytes / 2**30:9.3f} {measured:>9} | {tokens / (nbytes / 2**30):13,.0f} | "
              f"{2**30 / (MLA_V3 * 2):17,.0f} | {2**30 / (granular * 2):21,.0f} | {groups}")


if __name__ == "__main__":
    main()
