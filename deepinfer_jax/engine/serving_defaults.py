"""The engine arguments `deepinfer serve / chat / generate` choose for a model where the user set none: small models
(demo and test models) get fewer, larger step shapes, and a CPU one warm-up run a step program."""

from __future__ import annotations

from typing import Any

from deepinfer_jax.config import ModelConfig

# Models of at most this many parameters (the embedded default model has 5.0M, the test models under 1M; no released
# DeepSeek model comes near) count as small for `serving_defaults`: a step of a few hundred token slots costs them
# a few milliseconds, so fewer, larger step shapes cost nothing that shows.
SMALL_MODEL_PARAMS = 20_000_000
SMALL_SIZES = {"max_num_seqs": 32, "max_num_batched_tokens": 256, "max_model_len": 2048}
CPU_BUCKET_FACTOR = 16  # a small model's token buckets on a CPU: each 16x the last (runner/inputs.py)
# A small model's sequences a step on a CPU. The embedded model's steps there, in CPU time: 32 greedy tokens of one
# request 1.28 s with decode steps of 32 rows, 0.51 s with 16; a one-request prefill step of 16 token slots 15 ms,
# 32 slots 38 ms, 64, 128 or 256 slots ~75 ms (so buckets (16, 256) cost a 17-32 token prompt ~40 ms, no other).
CPU_SMALL_MAX_NUM_SEQS = 16
# A server's step budget on a GPU of at least LARGE_GPU_BYTES (an 80 GB H100, an H200; `large_gpu_total` leaves out
# the A100, as vLLM does): vLLM 0.26's API server takes 8,192 tokens a step there (EngineArgs.get_batch_defaults; 2,048
# on smaller GPUs, as `LLM` here). Long prompts then prefill in
# a quarter of the steps, each reading the cached context once. Protocol B compares the two servers at their defaults
# (benchmarks/gpu.sh), so they take the same budget.
LARGE_GPU_BYTES = 70 * 2**30
LARGE_GPU_MAX_NUM_BATCHED_TOKENS = 8192


def num_params(cfg: ModelConfig) -> int:
    """The model's parameter count (models/params.py's specs; no arrays made)."""
    import math

    import jax

    from deepinfer_jax.models.params import is_spec
    from deepinfer_jax.models.registry import param_specs

    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec))


def large_gpu_total() -> int | None:
    """The first device's total memory in bytes where it is a GPU other than an A100 (where vLLM keeps the smaller
    budget: a larger one lowered its throughput there), from the CUDA driver; else None."""
    import jax

    from deepinfer_jax.runner.device_memory import device_memory

    dev = jax.devices()[0]
    if dev.platform != "gpu" or "a100" in dev.device_kind.lower():
        return None
    mem = device_memory(dev)
    return None if mem is None else mem.device_total


def serving_defaults(cfg: ModelConfig, platform: str, given: dict[str, Any],
                     device_total: int | None = None) -> tuple[dict[str, Any], str]:
    """The engine arguments `deepinfer serve / chat / generate` choose where the user set none (`given`: the
    arguments set, by name), and one line saying which and why.

    Small models (at most SMALL_MODEL_PARAMS parameters: demo and test models) get SMALL_SIZES on every platform:
    each token bucket is a few step programs to compile at start, and such a model gains nothing from 256
    sequences a step. On a CPU a small model gets CPU_SMALL_MAX_NUM_SEQS sequences a step, a coarser token bucket
    ladder (runner/inputs.py coarse_token_buckets: 16 and 256 token slots, not 16 to 256 in powers of two) and no
    greedy sampling variant (the base variant's draw costs it nothing that shows): 5 step programs to compile
    instead of 11, each seconds on a CPU. On a CPU every model runs each step program once at warm-up, not RunnerConfig's 3
    (those record the GPU's CUDA graphs; on a CPU one run leaves nothing to compile). Other models on a GPU of
    `device_total` >= LARGE_GPU_BYTES get LARGE_GPU_MAX_NUM_BATCHED_TOKENS tokens a step, as vLLM's server. Otherwise
    LLM's defaults (vLLM's). A set flag always wins."""
    from deepinfer_jax.runner.inputs import coarse_token_buckets, token_buckets

    n = num_params(cfg)
    small, cpu = n <= SMALL_MODEL_PARAMS, platform == "cpu"
    out: dict[str, Any] = {}
    if small:
        sizes = dict(SMALL_SIZES, **({"max_num_seqs": CPU_SMALL_MAX_NUM_SEQS} if cpu else {}))
        out = {k: v for k, v in sizes.items() if given.get(k) is None}
        if given.get("max_num_batched_tokens") is None and given.get("max_num_seqs") is not None:
            out["max_num_batched_tokens"] = max(SMALL_SIZES["max_num_batched_tokens"], given["max_num_seqs"])
        if "max_model_len" in out:
            out["max_model_len"] = min(out["max_model_len"], cfg.max_position_embeddings)
    large_gpu = platform == "gpu" and not small and (device_total or 0) >= LARGE_GPU_BYTES
    if large_gpu and given.get("max_num_batched_tokens") is None:
        out["max_num_batched_tokens"] = max(LARGE_GPU_MAX_NUM_BATCHED_TOKENS, given.get("max_num_seqs") or 0)
    chosen = [f"{k} {v}" for k, v in out.items()]
    if small and cpu:
        seqs = given.get("max_num_seqs") or out.get("max_num_seqs")
        tokens = given.get("max_num_batched_tokens") or out.get("max_num_batched_tokens") or max(2048, seqs)
        out["token_buckets"] = coarse_token_buckets(tokens, seqs, CPU_BUCKET_FACTOR)
        chosen.append(f"token buckets {out['token_buckets']} (not {token_buckets(tokens, seqs)})")
        if given.get("greedy_variant") is None:
            out["greedy_variant"] = False
            chosen.append("no greedy sampling variant")
    if cpu:
        out["warmup_runs"] = 1
        chosen.append("one warm-up run a step program")
    if not chosen:
        return out, ""
    why = []
    if small:
        why.append("few step programs to compile at start" + (
            ", seconds each on a CPU, while a step padded to a larger bucket costs such a model little" if cpu else ""))
    if cpu:
        why.append("no CUDA graph to record on a CPU")
    if large_gpu and "max_num_batched_tokens" in out:
        why.append(f"a GPU of {device_total / 2**30:.0f} GiB: vLLM's server budget there")
    what = f"a small model ({n / 1e6:.1f}M parameters)" if small else f"a model of {n / 1e6:,.0f}M parameters"
    line = f"engine defaults for {what} on {platform}: {', '.join(chosen)} ({'; '.join(why)})"
    return out, line
