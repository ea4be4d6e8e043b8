"""DeepSeek-V4's per-group cache at long contexts: tokens of KV per GiB of device memory against a dense cache.

    python benchmarks/v4_long_context.py [--config CONFIG_JSON] [--contexts 131072,1048576]
                                         [--page-size 64] [--max-num-seqs 4] [--skip-check]
                                         [--attention-contexts 32768,131072] [--decode-batch 4] [--tiny]

1. Correctness first: a tiny random V4 model through the engine (`LLM`, per-group cache, chunked prefill that
   ends inside compression windows) must give the greedy tokens of the whole-sequence reference generator
   (`v4_greedy_generate`) on the same weights; the script stops if not.
2. Memory, measured on the device: for each context, the engine's pools (runner/device_memory.v4_pools, as
   `LLM` sizes them) for `--max-num-seqs` sequences of that context are allocated on the device
   (registry.init_kv_cache) and their bytes read back from the arrays and, where the backend reports it, from the
   allocator; then tokens of context per GiB, set against the dense caches the same context would take: V3's MLA
   latent (61 layers of 576 values) and the token-granular V4 layout (every layer's raw row and projections per
   token).
3. Attention, timed: one decode step (`--decode-batch` sequences, each at the context) of one layer of each kind
   (CSA, HCA, sliding) at the model's attention shape (V4-Flash by default: 64 heads of 512, indexer 64 x 128,
   top-512, window 128, m = 4, m' = 128), through models/v4_paged.py's `_layer_attention` on per-group pools
   filled with random rows, for attn_impl "reference" (XLA, query blocks) and "pallas" (the CSA indexer's scores
   in V3.2's paged kernel, the attention in kernels/v4_sparse_attention.py). First the two must agree (fp32, the
   first context); then bf16 timings, and the attention share of a whole decode step (each layer kind's time
   times its count in the model). `--tiny`: the test model's tiny shapes and contexts, Pallas in interpret mode:
   a CPU smoke run of the same code.
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
        # On a GPU the engine runs the XLA paths: the tiny shapes are not the powers of two the Triton lowering
        # needs; the kernels are checked against the reference at the model's shape in step 3.
        impls = {} if jax.default_backend() == "cpu" else dict(attn_impl="reference", moe_impl="ragged")
        llm = LLM(d, dtype="float32", load_format="dummy", skip_tokenizer_init=True, max_model_len=64,
                  max_num_seqs=2, max_num_batched_tokens=13, page_size=4, num_pages=8, progress=False,
                  token_buckets=(4, 13), greedy_variant=False, warmup_runs=1, **impls)
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


def _attention_setup(cfg, ctx: int, batch: int, ps: int, dtype, seed: int = 0):
    """Per-group pools for `batch` sequences of `ctx` tokens (windowed groups: only their live pages), filled
    with random rows, and a decode step's metadata (each sequence's token at position ctx - 1)."""
    from deepinfer_jax.models.cache import StepMetadata

    v4, pools, tables, nxt = cfg.v4, [], [], 1
    pos = np.full(batch, ctx - 1, np.int32)
    groups = v4_cache_groups(v4, 1)
    for g in groups:  # full-width tables (a windowed group's ring of the engine is the identity below its width)
        rows = g.rows_per_page(ps)
        width = -(-(ctx // g.tokens_per_row) // rows)
        table = np.zeros((batch, width), np.int32)
        live = range(width) if not g.window_tokens else range(max(0, (ctx - g.window_tokens) // rows - 1), width)
        for b in range(batch):
            table[b, list(live)] = np.arange(1 + b * len(live), 1 + (b + 1) * len(live))
        tables.append(table)
        pools.append(1 + batch * len(live))
    key = jax.random.key(seed)
    cache = tuple(jax.random.normal(jax.random.fold_in(key, k), (n, len(g.layers) * g.rows_per_page(ps) * g.row_bytes),
                                    dtype) for k, (g, n) in enumerate(zip(groups, pools)))
    metas = []
    for g, table in zip(groups, tables):
        w, rows = pos // g.tokens_per_row, g.rows_per_page(ps)
        real = table[np.arange(batch), w // rows] * rows + w % rows
        metas.append((jnp.asarray(table), jnp.asarray(np.where((pos + 1) % g.tokens_per_row == 0, real, 0))))
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    meta = StepMetadata(i32(np.ones(batch)), i32(pos), i32(np.arange(batch)), i32(np.zeros(batch)),
                        jnp.asarray(tables[0]), i32(np.arange(batch)), groups=tuple(metas))
    return cache, meta


def time_attention(d: dict, contexts: list[int], batch: int, ps: int, interpret: bool, iters: int = 20) -> None:
    """Section 3 of the docstring: a decode step's attention per layer kind, reference against pallas."""
    import time

    from deepinfer_jax.config_v4 import CSA, HCA, SLIDING
    from deepinfer_jax.models import v4_paged
    from deepinfer_jax.weights.random_init import random_params

    kinds = (CSA, HCA, SLIDING)
    # one layer of each kind, a small MoE (its weights are not used here)
    small = dict(d, num_hidden_layers=3, layer_types=list(kinds), mlp_layer_types=["moe"] * 3,
                 n_routed_experts=8, num_experts_per_tok=2, num_nextn_predict_layers=0)
    cfg = ModelConfig.from_hf_dict(small)
    full = ModelConfig.from_hf_dict(d).v4
    count = {k: full.layer_types.count(k) for k in kinds}
    pallas = "pallas_interpret" if interpret else "pallas"

    drawn = {}

    def step_fn(layer: int, impl: str, dtype):
        if dtype not in drawn:
            drawn[dtype] = random_params(cfg, dtype, seed=1, scale=0.05)
        p = drawn[dtype]["layers"][layer]["attn"]

        def run(p, cache, x, meta):  # the weights an argument: closed over, XLA would fold them as constants
            c = v4_paged.GroupCache(cfg.v4, cache, ps)
            out = v4_paged._layer_attention(cfg.v4, layer, p, x, c, meta, impl)
            return out, tuple(c.arrays)

        jitted = jax.jit(run, donate_argnums=1)
        return lambda cache, x, meta: jitted(p, cache, x, meta)

    def x_of(dtype):
        return jax.random.normal(jax.random.key(2), (batch, cfg.v4.hidden_size), dtype)

    # correctness first: pallas == reference on the same rows (fp32, the first context)
    ctx0 = contexts[0]
    for layer, kind in enumerate(kinds):
        outs = []
        for impl in ("reference", pallas):
            cache, meta = _attention_setup(cfg, ctx0, batch, ps, jnp.float32)
            outs.append(np.asarray(step_fn(layer, impl, jnp.float32)(cache, x_of(jnp.float32), meta)[0]))
        err = float(np.max(np.abs(outs[0] - outs[1])) / (np.max(np.abs(outs[0])) + 1e-30))
        if not err < 1e-4:
            sys.exit(f"{kind}: pallas differs from the reference at context {ctx0}: relative max error {err:.2e}")
    print(f"check: attn_impl {pallas} == reference at context {ctx0:,} (fp32, every layer kind)")

    print(f"decode step of {batch} sequences, bf16, page_size {ps}; per layer, and the model's "
          f"{full.num_hidden_layers} layers ({', '.join(f'{count[k]} {k}' for k in kinds)})")
    print(f"{'context':>9} | {'impl':>16} | {'CSA ms':>8} {'HCA ms':>8} {'sliding ms':>10} | {'all layers ms':>13}")
    for ctx in contexts:
        for impl in ("reference", pallas):
            ms = {}
            for layer, kind in enumerate(kinds):
                try:
                    cache, meta = _attention_setup(cfg, ctx, batch, ps, jnp.bfloat16)
                    fn, x = step_fn(layer, impl, jnp.bfloat16), x_of(jnp.bfloat16)
                    out, cache = fn(cache, x, meta)  # compile, warm
                    jax.block_until_ready(out)
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        out, cache = fn(cache, x, meta)
                    jax.block_until_ready((out, cache))
                    ms[kind] = (time.perf_counter() - t0) / iters * 1e3
                    del cache
                except Exception as e:  # noqa: BLE001  (out of memory: report it, go on)
                    print(f"{ctx:>9,} | {impl:>16} | {kind}: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                    ms[kind] = float("nan")
            total = sum(ms[k] * count[k] for k in kinds)
            print(f"{ctx:>9,} | {impl:>16} | {ms[CSA]:8.3f} {ms[HCA]:8.3f} {ms[SLIDING]:10.3f} | {total:13.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="a deepseek_v4 config.json (default: HF's DeepseekV4Config)")
    ap.add_argument("--contexts", default="131072,1048576")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--attention-contexts", default="32768,131072", help="contexts of the decode-step timing")
    ap.add_argument("--decode-batch", type=int, default=4)
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run: the test model's shapes, tiny contexts, Pallas in interpret mode")
    a = ap.parse_args()
    if not a.skip_check:
        check_against_reference()
    d = {"model_type": "deepseek_v4"}
    if a.config:
        with open(a.config) as f:
            d = json.load(f)
    if a.tiny:
        from hf_models_v4 import V4_TINY

        d = dict(V4_TINY, model_type="deepseek_v4")
        a.contexts, a.attention_contexts, a.page_size, a.max_num_seqs, a.decode_batch = "64", "40,64", 4, 2, 2
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
    print()
    time_attention(d, [int(c) for c in a.attention_contexts.split(",")], a.decode_batch, ps, interpret=a.tiny,
                   iters=2 if a.tiny else 20)


if __name__ == "__main__":
    main()
