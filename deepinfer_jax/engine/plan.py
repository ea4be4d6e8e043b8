"""`deepinfer plan`: whether a model fits, from its config.json and safetensors headers alone (no weights read).

    deepinfer plan --model DIR [--tensor-parallel-size N] [--data-parallel-size N] [--enable-expert-parallel]
                   [--pipeline-parallel-size N]
                   [--dtype ...] [--quantization ...] [--kv-cache-dtype ...] [--gpu-memory GIB]
                   [--gpu-memory-utilization F] [--max-model-len N] [--page-size N] [--max-num-seqs N]
                   [--max-num-batched-tokens N] [--cpu-offload-gb GIB] [--kv-offloading-size GIB]
                   [--speculative-config JSON] [--json]

Every figure comes from the functions the engine itself uses, so the two cannot disagree: the param specs
(models/params.py) and the sharding rules (sharding/rules.py) give each leaf's shard on a device; the loader's
own choice of which leaves stay FP8 (weights/hf_loader.py `fp8_leaf_paths`, from the tensors' dtypes in the
headers) and the converted checkpoint's quantization give their formats (DeepSeek-V4: the loader's abstract tree,
split by `v4_rules`); the family's `models/registry.kv_cache_bytes_per_page` gives the KV bytes a token, with
`--speculative-config` "deepseek_mtp" the MTP layer's rows too, as the engine allocates them (`mtp_cache`);
`runner/device_memory.kv_cache_bytes` gives the cache's share of a device of
`--gpu-memory` GiB with the weights in use, exactly as the engine sizes its cache after loading. DeepSeek-V4's
cache is paged per group (docs/v4.md): the plan lists each group's bytes (per token of context for the compressed
groups, per sequence for the windowed ones) and, with a device's memory, the pools the engine makes of the cache's
bytes (`runner/device_memory.v4_pools`, for --page-size / --max-num-seqs / --max-num-batched-tokens) and the
tokens of context they hold.
With
`--cpu-offload-gb` the leaves runner/weight_offload.py `choose`s from the same per-leaf bytes are counted in host
memory, not on the device; `--kv-offloading-size` adds the KV host tier's pages (of PAGE_SIZE tokens, the engine's
default page) in host memory.
A directory of config.json alone (no weights downloaded yet; Hugging Face layout) is planned from the config: the
tensors its shapes imply, FP8 (with their block scales) for every leaf an FP8 release stores so when its
quantization_config says "fp8", and the output says that the figures come from the config alone.

Per device: the weights' shard bytes are the largest over the devices (leaves split evenly, so all equal); the
latent cache is replicated over tensor ranks and split by pages over data ranks, so a token's KV bytes are on
every tensor rank of its data rank. With pipeline parallelism a device holds its stage's share (models/pipeline.py):
the embedding on the first stage, the final norm and lm_head on the last (no MTP head), and its stage's layers
and their KV cache; the figures per device are the largest stage's, and each stage's weight bytes are listed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

from deepinfer_jax.engine.plan_v4 import v4_groups, v4_weight_bytes


DTYPES = ("auto", "bfloat16", "float16", "float32")
PAGE_SIZE = 64  # CacheConfig.page_size's default: the host tier holds whole pages


def resolve_dtype(dtype: str, model_dir: str) -> str:
    """vLLM's rule for "auto": the checkpoint's dtype, with float32 checkpoints served in bfloat16;
    a converted checkpoint is served in the dtype it was converted to."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    meta = os.path.join(model_dir, "deepinfer_checkpoint.json")
    if os.path.isfile(meta):  # a converted checkpoint was written in the dtype its user chose
        with open(meta) as f:
            return json.load(f)["dtype"]
    with open(os.path.join(model_dir, "config.json")) as f:
        d = json.load(f)
    t = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
    return "float16" if t == "float16" else "bfloat16"


def fit_problem(model: str, parallel: tuple, dtype: str, quantization: str | None,
                kv_cache_dtype: str, gpu_memory: float | None, gpu_memory_utilization: float,
                max_model_len: int | None, cpu_offload_gb: float = 0.0, speculative_config=None,
                **v4_sizes) -> str | None:
    """"MODEL does not fit: REASON" (`deepinfer plan`'s verdict) when the model cannot fit the device (its own memory
    figures, or `gpu_memory` GiB); None when it fits, or when the device reports none (CPU) and no gpu_memory is
    given. `parallel`: (tensor_parallel_size, data_parallel_size, enable_expert_parallel[, pipeline_parallel_size]);
    `cpu_offload_gb`: GiB of weights in host memory; `v4_sizes`: page_size, max_num_seqs, max_num_batched_tokens as
    the engine will have them (DeepSeek-V4's pools); `speculative_config`: with deepseek_mtp, the MTP layer's cache
    rows count (a draft model's weights and cache do not: `plan` does not count them). Reads config.json and the
    safetensors headers only."""
    import jax

    from deepinfer_jax.config import SpeculativeConfig
    from deepinfer_jax.runner.device_memory import device_memory, given_memory

    memory = given_memory(gpu_memory) if gpu_memory is not None else device_memory(jax.devices()[0])
    if memory is None:
        return None
    tp, dp, ep, *pp = parallel
    spec = SpeculativeConfig.parse(speculative_config)
    p = plan(model, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
             pipeline_parallel_size=pp[0] if pp else 1, dtype=dtype,
             quantization=quantization, kv_cache_dtype=kv_cache_dtype, memory=memory,
             gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
             cpu_offload_gb=cpu_offload_gb, speculative_config=spec if spec and spec.method == "deepseek_mtp" else None,
             **v4_sizes)
    return f"{model} does not fit: {p.reason}" if p.fits is False else None


def size(b: float) -> str:
    """Bytes for a reader: GiB, MiB or bytes."""
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{int(b)} bytes"


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    dtype: str
    weights: str  # "float", "fp8 (kept)", "fp8 (online)", "int8", "int4"; V4: "fp4 (kept) + fp8 (kept)"
    kv_cache_dtype: str
    tensor_parallel_size: int
    data_parallel_size: int
    enable_expert_parallel: bool
    weight_bytes_per_device: int  # on the device (less what --cpu-offload-gb keeps in host memory)
    kv_bytes_per_token: int  # on each device holding the token's pages
    max_model_len: int
    gpu_memory_bytes: int | None
    kv_cache_bytes_per_device: int | None
    kv_tokens_per_rank: int | None  # tokens of KV each data-parallel rank holds
    fits: bool | None  # None: no --gpu-memory given
    reason: str
    # DeepSeek-V4's per-group cache: per group its layers, row bytes, tokens a row, window, bytes a token of context
    # (compressed groups) or a sequence (windowed), and with a device's memory its pool's pages and bytes
    kv_groups: tuple = ()
    pipeline_parallel_size: int = 1
    stage_weight_bytes: tuple[int, ...] = ()  # per device of each pipeline stage (PP > 1)
    offloaded_weight_bytes: int = 0  # weights in host memory (--cpu-offload-gb)
    offload_window_bytes: int = 0  # the most of them a step holds on the device at once (weight_offload.step_window)
    kv_host_tier_bytes: int = 0  # the KV cache's host tier (--kv-offloading-size), whole pages
    kv_host_tier_tokens: int = 0
    from_config_only: bool = False  # no weight files yet: the figures come from config.json's shapes alone

    def lines(self) -> list[str]:
        gib = size
        out = [f"model {self.model}: weights {self.weights}, dtype {self.dtype}, KV cache {self.kv_cache_dtype}, "
               f"TP {self.tensor_parallel_size} x DP {self.data_parallel_size}"
               + (f" x PP {self.pipeline_parallel_size}" if self.pipeline_parallel_size > 1 else "")
               + (" with expert parallelism" if self.enable_expert_parallel else ""),
               f"weights per device: {gib(self.weight_bytes_per_device)}"
               + (" (the largest stage; per stage: " + ", ".join(gib(b) for b in self.stage_weight_bytes) + ")"
                  if self.stage_weight_bytes else "")
               + (f" on the device, {gib(self.offloaded_weight_bytes)} in host memory (--cpu-offload-gb), of which "
                  f"a step holds at most {gib(self.offload_window_bytes)} on the device at once"
                  if self.offloaded_weight_bytes else ""),
               f"KV cache per token: {self.kv_bytes_per_token} bytes"
               + (" (the compressed cache groups; the windowed ones cost a fixed share per sequence)"
                  if self.kv_groups else "")]
        for g in self.kv_groups:
            per = (f"{g['bytes_per_token']:,.1f} bytes per token" if g["window"] is None else
                   f"window {g['window']} tokens, {size(g['bytes_per_sequence'])} per sequence")
            pool = (f"; pool {g['pool_pages']} pages of {g['page_size']} rows ({size(g['pool_bytes'])})"
                    if "pool_pages" in g else "")
            out.append(f"  group {g['name']}: {g['layers']} layers x {g['row_bytes']} bytes a row, a row per "
                       f"{g['tokens_per_row']} tokens, {per}{pool}")
        if self.kv_host_tier_bytes:
            out.append(f"KV host tier: {gib(self.kv_host_tier_bytes)} in host memory -> {self.kv_host_tier_tokens} "
                       f"tokens (--kv-offloading-size)")
        if self.gpu_memory_bytes is not None:
            out.append(f"KV cache per device: {gib(self.kv_cache_bytes_per_device)} of {gib(self.gpu_memory_bytes)}"
                       f" -> {self.kv_tokens_per_rank} tokens per data-parallel rank "
                       f"(max_model_len {self.max_model_len})")
        if self.from_config_only:
            out.append("(no weight files in the directory yet: these figures come from config.json alone, its "
                       "parameter shapes at the dtype and quantization it names)")
        out.append(("fits" if self.fits else "does not fit") + (f": {self.reason}" if self.reason else "")
                   if self.fits is not None else "give --gpu-memory GIB to check that it fits")
        return out


def leaf_bytes(shape: tuple[int, ...], itemsize: float, splits: tuple[int, ...]) -> int:
    """Bytes of one shard of an array of `shape` split `splits[i]` ways along axis i (length-1 axes unsplit)."""
    return int(math.prod(d // (s if d > 1 else 1) for d, s in zip(shape, splits)) * itemsize)


def fp8_bytes_per_device(spec, path: tuple, lay: tuple[int, int], block: tuple[int, int], table: dict,
                         mesh: dict) -> int:
    """Bytes on one device of the Fp8Weight that the leaf `spec` at `path` loads as: q (1 byte an element) and its
    fp32 scales, both divided by the devices that split the float leaf; a ValueError where that cuts a block."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.models.quant import FP8_PARTS_LEAVES, Fp8Weight, fp8_layout
    from deepinfer_jax.models.quant_fp4 import packed_spec
    from deepinfer_jax.sharding.packed import check_blocks

    q, s, ins, outs, parts = fp8_layout(spec.shape, lay[0], lay[1], block, path[-1] in FP8_PARTS_LEAVES)
    w = Fp8Weight(jax.ShapeDtypeStruct(q, jnp.float8_e4m3fn), jax.ShapeDtypeStruct(s, jnp.float32), tuple(block),
                  ins, outs, parts)
    entries = tuple(tuple(table.get(ax, ())) if ax else None for ax in spec.axes)
    pspec = packed_spec(w, tuple(e or None for e in entries))
    check_blocks(w, pspec, mesh, spec.axes, ".".join(str(k) for k in path))
    devices = math.prod(mesh[a] for e in pspec if e for a in ((e,) if isinstance(e, str) else e))
    return (math.prod(q) + 4 * math.prod(s)) // devices


def weight_bytes_per_device(cfg, dtype: str, parallel, fp8_paths: frozenset = frozenset(),
                            fp8_block: tuple[int, int] = (128, 128), int_method: str = "none",
                            group_size: int = 128, stage=None, by_leaf: dict | None = None) -> int:
    """Bytes of the params on one device: each leaf's shard under the default rules on a (data, tensor) mesh;
    leaves at `fp8_paths` as Fp8Weight (a layout that would cut a scale block refused as the loader refuses it),
    quantizable leaves as INT8 / INT4 with `int_method`.
    `stage` (a models/pipeline.py PipelineStage): a device of that pipeline stage, which holds its layers' share
    of each stacked segment (bytes linear in the layers: the layer axis is never split) and the embedding or the
    final norm and lm_head as its place in the pipeline says (no MTP head: speculative decoding is refused there).
    `by_leaf`: filled with each leaf's bytes by path (a quantized leaf's q and scale together)."""
    import numpy as np

    from deepinfer_jax.models.params import is_spec, spec_dtype
    from deepinfer_jax.models.pipeline import param_segments
    from deepinfer_jax.models.registry import param_specs  # the model family's (the dense family's own)
    from deepinfer_jax.models.quant import METHODS, quant_layout, quantized_shapes
    from deepinfer_jax.sharding.rules import check_rules, default_rules

    mesh = {"data": parallel.data_parallel_size, "tensor": parallel.tensor_parallel_size}
    rules = default_rules(parallel)
    check_rules(cfg, mesh, rules)  # the engine's refusal of a mesh that does not divide the model
    table = dict(rules)
    bits = METHODS[int_method]
    total = 0

    def share(path: tuple) -> tuple[int, int]:  # (numerator, denominator) of a leaf's bytes this stage holds
        if stage is None:
            return 1, 1
        if path[0] == "segments":
            seg = param_segments(cfg)[path[1]]
            return max(0, min(seg.stop, stage.stop) - max(seg.start, stage.start)), seg.num_layers
        if path[0] == "mtp":  # not kept: speculative decoding is refused with pipeline parallelism
            return 0, 1
        return int(stage.first if path[0] == "embed" else stage.last), 1

    def walk(tree: Any, path: tuple) -> None:
        nonlocal total
        if is_spec(tree):
            num, den = share(path)
            if not num:
                return
            before = total
            splits = tuple(math.prod(mesh[a] for a in table.get(ax, ())) if ax else 1 for ax in tree.axes)
            lay = quant_layout(path)
            if path in fp8_paths:  # q and its scales split as the float leaf is (sharding/packed.py)
                total += fp8_bytes_per_device(tree, path, lay, fp8_block, table, mesh)
            elif bits and lay is not None:
                q, s, _ = quantized_shapes(tree.shape, bits, lay[0], lay[1], group_size)
                total += leaf_bytes(q, 1, splits) + leaf_bytes(s, 4, splits)
            else:
                total += leaf_bytes(tree.shape, np.dtype(spec_dtype(tree, dtype)).itemsize, splits)
            total = before + (total - before) * num // den
            if by_leaf is not None:
                by_leaf[path] = total - before
        elif isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, path + (k,))
        else:
            for i, v in enumerate(tree):
                walk(v, path + (i,))

    walk(param_specs(cfg), ())
    return total


def mtp_cache(cfg):
    """`cfg` as the engine sizes its cache for `deepseek_mtp` speculation (LLMEngine): DeepSeek-V4's groups with
    the MTP layer's rows (config_v4.with_mtp_cache); V2 / V3 keep theirs (the layer is added to the cache's shape,
    `kv_bytes_per_page`). A checkpoint without MTP weights, or a model the MTP does not run on, is refused
    as the engine refuses it (runner/spec_mtp.check_supported)."""
    from deepinfer_jax.config_v4 import with_mtp_cache
    from deepinfer_jax.runner.spec_mtp import check_supported

    if cfg.family == "deepseek_v4" and cfg.has_mtp:
        cfg = with_mtp_cache(cfg)
    check_supported(cfg, cfg.family, False)
    return cfg


def kv_bytes_per_page(cfg, page_size: int, dtype, mtp: bool = False) -> int:
    """The cache's bytes a page (models/registry.py), with `mtp` the MTP layer's rows too: V2 / V3's cache has
    one more layer (runner/spec_mtp.kv_cache_shape); DeepSeek-V4's groups hold them already (`mtp_cache`)."""
    import jax.numpy as jnp

    from deepinfer_jax.models.registry import kv_cache_bytes_per_page as per_page, kv_cache_shape
    from deepinfer_jax.runner.spec_mtp import kv_cache_shape as with_mtp

    if not mtp or cfg.family == "deepseek_v4":
        return per_page(cfg, page_size, dtype)
    return math.prod(with_mtp(kv_cache_shape(cfg, 1, page_size))) * jnp.dtype(dtype).itemsize


def fit_verdict(weight_bytes: int, per_token: int, max_len: int, memory, gpu_memory_utilization: float
                ) -> tuple[int, int, bool, str]:
    """(KV cache bytes per device, KV tokens per rank, fits, the reason when not) with the weights' bytes added to
    what `memory` has in use: the engine's own sizing (`kv_cache_bytes`, as pages_for_memory after loading)."""
    from dataclasses import replace

    from deepinfer_jax.runner.device_memory import XLA_PROGRAM_SHARE, kv_cache_bytes

    mem = replace(memory, in_use=memory.in_use + weight_bytes)
    cache = kv_cache_bytes(mem, gpu_memory_utilization)
    tokens = cache // per_token
    usable = memory.limit * gpu_memory_utilization - memory.in_use
    if memory.device_total is not None:
        usable = min(usable, memory.device_total * XLA_PROGRAM_SHARE - memory.in_use)
    gib = size
    if weight_bytes >= usable:
        return cache, tokens, False, (
            f"the weights take {gib(weight_bytes)} per device, more than the {gib(max(usable, 0))} usable "
            f"({memory.source}: gpu_memory_utilization {gpu_memory_utilization:g} of {gib(memory.limit)}, weights + "
            f"KV cache within {XLA_PROGRAM_SHARE:.0%} of the device)")
    if tokens < max_len:
        return cache, tokens, False, (f"the KV cache has room for {tokens} tokens per data-parallel rank "
                                      f"({gib(cache)} per device), fewer than max_model_len {max_len}")
    return cache, tokens, True, ""


def plan(model_dir: str, *, tensor_parallel_size: int = 1, data_parallel_size: int = 1,
         enable_expert_parallel: bool = False, pipeline_parallel_size: int = 1, dtype: str = "auto", quantization: str | None = None,
         kv_cache_dtype: str = "auto", gpu_memory_gib: float | None = None, gpu_memory_utilization: float = 0.9,
         max_model_len: int | None = None, memory=None, page_size: int = 64, max_num_seqs: int = 256,
         max_num_batched_tokens: int | None = None, cpu_offload_gb: float = 0.0,
         kv_offloading_size: float = 0.0, speculative_config=None) -> MemoryPlan:
    """The memory plan of serving `model_dir` so (see the module doc). Reads config.json and the safetensors
    headers (or a converted checkpoint's metadata); a ValueError / CheckpointError for what the engine refuses.
    `memory`: a runner/device_memory.DeviceMemory (a device's own figures) instead of `gpu_memory_gib`. page_size,
    max_num_seqs and max_num_batched_tokens (the engine's defaults) size DeepSeek-V4's per-group pools.
    `cpu_offload_gb`, `kv_offloading_size`: GiB of weights, and of KV host tier, in host memory.
    `speculative_config` (serve's --speculative-config: JSON, a mapping or a SpeculativeConfig): "deepseek_mtp" adds
    the MTP layer's rows to the cache per token (`mtp_cache`); "ngram" holds no cache; "draft_model" is refused."""
    import dataclasses

    config_only = False
    from deepinfer_jax.config import ModelConfig, RunnerConfig, SpeculativeConfig
    from deepinfer_jax.runner.device_memory import given_memory
    from deepinfer_jax.sharding.mesh import ParallelConfig
    from deepinfer_jax.weights.loader import check_quantization, is_converted

    check_quantization(model_dir, quantization)
    spec = SpeculativeConfig.parse(speculative_config)
    if spec is not None:
        spec.check_supported()
        spec.check_parallel(pipeline_parallel_size)
        if spec.method == "draft_model":
            raise ValueError("deepinfer plan does not count a --speculative-config draft model yet (its weights and "
                             "cache); plan the draft's directory on its own and add its figures")
    parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel,
                              pipeline_parallel_size)
    dtype = resolve_dtype(dtype, model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    by_leaf: dict = {}  # each leaf's bytes on a device, for --cpu-offload-gb's choice
    if cfg.family == "deepseek_v4":  # float, or FP8 / FP4 as released (docs/v4.md); its routed experts split
        from deepinfer_jax.sharding.rules import check_v4_layout, v4_bytes_per_device
        from deepinfer_jax.weights.loader import check_v4_quantization
        check_v4_layout(parallel)
        check_v4_quantization(quantization)
        if is_converted(model_dir):  # the MTP layers the converter wrote (an HF directory's: what its files hold)
            with open(os.path.join(model_dir, "deepinfer_checkpoint.json")) as f:
                n_mtp = int(json.load(f)["num_nextn_predict_layers"])
            cfg = dataclasses.replace(cfg, num_nextn_predict_layers=n_mtp)
        else:
            from deepinfer_jax.weights.name_table_v4 import v4_checkpoint_config

            cfg = v4_checkpoint_config(cfg, model_dir)
        nbytes, weights = v4_weight_bytes(cfg, dtype, None if is_converted(model_dir) else model_dir, quantization,
                                          by_leaf, parallel)
        from deepinfer_jax.weights.name_table_v4 import v4_shared_block

        shared_block = v4_shared_block(model_dir, cfg, quantization)  # the FP8 blocks a shared expert split keeps
        nbytes = v4_bytes_per_device(cfg, parallel, by_leaf, shared_block)  # the experts (and heads) split
    elif is_converted(model_dir):
        with open(os.path.join(model_dir, "deepinfer_checkpoint.json")) as f:
            meta = json.load(f)
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=int(meta["num_nextn_predict_layers"]))
        method = meta["quantization"]["method"]
        def weigh(stage=None, by_leaf=None):
            return weight_bytes_per_device(cfg, dtype, parallel, int_method=method, stage=stage, by_leaf=by_leaf,
                                           group_size=int(meta["quantization"].get("group_size") or 128))

        nbytes = weigh(by_leaf=by_leaf)
        weights = "float" if method == "none" else method
    else:
        from deepinfer_jax.weights.hf_loader import (
            FP8_BLOCK, effective_config, expected_tensors, fp8_block_shape, fp8_leaf_paths, fused_moe_layers,
        )
        from deepinfer_jax.weights.safetensors_io import TensorInfo, has_weight_files, index_checkpoint

        with open(os.path.join(model_dir, "config.json")) as f:
            hf_config = json.load(f)
        config_only = not has_weight_files(model_dir)
        if config_only:  # no weights yet: the tensors the config implies (FP8 where its quantization_config says)
            tensors = {}
            rules = expected_tensors(cfg, frozenset())
            stand_in = {r.hf_name: TensorInfo(r.hf_name, "", "BF16", (), 0, 0) for r in rules}  # float headers
            # An FP8 release stores every quantizable leaf in FP8 with its scales: kept, not quantized online.
            release = (hf_config.get("quantization_config") or {}).get("quant_method") == "fp8"
            paths, online = fp8_leaf_paths(rules, stand_in, ("none" if quantization == "none" else "fp8") if release
                                           else quantization)
            online = online and not release
        else:
            tensors = index_checkpoint(model_dir)  # headers only
            cfg = effective_config(cfg, tensors)
            rules = expected_tensors(cfg, fused_moe_layers(tensors))
            paths, online = fp8_leaf_paths(rules, tensors, quantization)
        block = FP8_BLOCK if online else fp8_block_shape(hf_config)
        def weigh(stage=None, by_leaf=None):
            return weight_bytes_per_device(cfg, dtype, parallel, paths, block, stage=stage, by_leaf=by_leaf)

        nbytes = weigh(by_leaf=by_leaf)
        weights = ("fp8 (online)" if online else "fp8 (kept)") if paths else "float"
    offloaded = window = 0
    if cpu_offload_gb:  # the engine's own choice (runner/weight_offload.py) on the same per-leaf bytes
        from deepinfer_jax.models.params import layer_segments
        from deepinfer_jax.runner.weight_offload import STREAMING_FAMILIES, check_budget, choose, step_window

        if not parallel.is_single_device:
            raise ValueError("cpu_offload_gb is not supported with tensor, data or expert parallelism yet "
                             "(--tensor-parallel-size / --data-parallel-size above 1)")
        chosen = [(p, by_leaf[p]) for p in choose(by_leaf.items(), check_budget(cpu_offload_gb, nbytes))]
        offloaded = sum(n for _, n in chosen)
        stacked = STREAMING_FAMILIES.get(cfg.family) == "segments"  # (V4's layers are one a dict: none stacked)
        layers = [s.num_layers for s in layer_segments(cfg)] if stacked else []
        window = step_window(chosen, layers, cfg.family)
    nbytes -= offloaded
    kv_dtype = RunnerConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype).kv_dtype
    mtp = spec is not None and spec.method == "deepseek_mtp"
    cfg = mtp_cache(cfg) if mtp else cfg
    per_token = kv_bytes_per_page(cfg, 1, kv_dtype, mtp)
    stage_bytes: tuple[int, ...] = ()
    if pipeline_parallel_size > 1:  # a device holds its stage's share: the largest stage's figures
        from deepinfer_jax.models.pipeline import pipeline_stages

        stages = pipeline_stages(cfg, pipeline_parallel_size)
        stage_bytes = tuple(weigh(st) for st in stages)
        nbytes = max(stage_bytes)
        per_token = per_token * max(st.num_layers for st in stages) // cfg.num_hidden_layers
    host_tier_tokens = 0
    if kv_offloading_size:
        from deepinfer_jax.runner.kv_transfer import host_tier_blocks

        host_tier_tokens = host_tier_blocks(cfg, PAGE_SIZE, kv_dtype, kv_offloading_size) * PAGE_SIZE
    max_len = max_model_len or min(cfg.max_position_embeddings, 4096)
    if memory is None and gpu_memory_gib is not None:
        memory = given_memory(gpu_memory_gib)
    mem_bytes = cache = tokens = fits = None
    reason = ""
    if memory is not None:
        mem_bytes = memory.device_total or memory.limit
        cache, tokens, fits, reason = fit_verdict(nbytes, per_token, max_len, memory, gpu_memory_utilization)
    groups = ()
    if cfg.family == "deepseek_v4":
        from deepinfer_jax.config import SchedulerConfig

        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_len,
                                max_num_batched_tokens=max_num_batched_tokens or max(2048, max_num_seqs))
        runner = RunnerConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        groups, pooled, pool_bytes = v4_groups(cfg, page_size, sched, runner, cache)
        if pooled is not None and fits is not False:
            tokens, fits = pooled, pool_bytes <= cache  # the pools hold at least max_model_len (v4_cache_pools)
            reason = "" if fits else (
                f"the cache groups' pools for one sequence of max_model_len {max_len} and the windows of "
                f"{max_num_seqs} sequences take {size(pool_bytes)}, more than the KV cache's {size(cache)} per device")
    return MemoryPlan(model_dir, dtype, weights, kv_dtype, tensor_parallel_size, data_parallel_size,
                      enable_expert_parallel, nbytes, per_token, max_len, mem_bytes, cache, tokens, fits, reason,
                      kv_groups=groups, pipeline_parallel_size=pipeline_parallel_size,
                      stage_weight_bytes=stage_bytes, offloaded_weight_bytes=offloaded, offload_window_bytes=window,
                      kv_host_tier_bytes=host_tier_tokens * per_token, kv_host_tier_tokens=host_tier_tokens,
                      from_config_only=config_only)


def report(ns: argparse.Namespace) -> int:
    """`deepinfer plan`'s run on its parsed flags (deepinfer_jax/cli.py): the plan as lines or, with --json, as this
    module's `Plan` fields (docs/quantization.md); exit status 0 fits or no --gpu-memory, 1 does not fit, 2 bad input."""
    try:
        result = plan(ns.model, tensor_parallel_size=ns.tensor_parallel_size,
                      data_parallel_size=ns.data_parallel_size, enable_expert_parallel=ns.enable_expert_parallel,
                      pipeline_parallel_size=ns.pipeline_parallel_size,
                      dtype=ns.dtype, quantization=ns.quantization, kv_cache_dtype=ns.kv_cache_dtype,
                      gpu_memory_gib=ns.gpu_memory, gpu_memory_utilization=ns.gpu_memory_utilization,
                      max_model_len=ns.max_model_len, page_size=ns.page_size, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens, cpu_offload_gb=ns.cpu_offload_gb,
                      kv_offloading_size=ns.kv_offloading_size, speculative_config=ns.speculative_config)
    except (ValueError, OSError) as e:
        print(f"deepinfer plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(result), indent=2) if ns.json else "\n".join(result.lines()))
    return 0 if result.fits is not False else 1
