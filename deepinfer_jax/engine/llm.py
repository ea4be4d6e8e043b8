"""The offline API, in vLLM's convention: `LLM(model=DIR, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Sequence

from deepinfer_jax.config import CacheConfig, RunnerConfig, SchedulerConfig
from deepinfer_jax.engine.llm_engine import LLMEngine
from deepinfer_jax.engine.plan import DTYPES, fit_problem, resolve_dtype  # noqa: F401 - resolve_dtype: LLM's API
from deepinfer_jax.runner.multihost import check_launch, init_distributed  # noqa: F401 (the server's way to them)
from deepinfer_jax.types import RequestOutput, RequestOutputKind, SamplingParams
from deepinfer_jax.xla_env import use_host_memory

log = logging.getLogger(__name__)


def quantization_problem(model_dir: str, quantization: str | None) -> str | None:
    """Why `quantization` cannot be served from `model_dir` (weights/loader.py's rule), or None."""
    from deepinfer_jax.weights.loader import check_quantization

    try:
        check_quantization(model_dir, quantization)
    except ValueError as e:
        return str(e)
    return None


def kv_cache_attn_impl(kv_cache_dtype: str, attn_impl: str, kernels_read_fp8: bool = False) -> str:
    """The attention implementation an FP8 KV cache runs on. `kernels_read_fp8`: the model's Pallas attention
    kernels take an e4m3 cache (DeepSeek's MLA kernels: kernels/mla_decode.py, mla_prefill.py and mla_absorb.py's
    latent write), so attn_impl stands as asked. Elsewhere (the sparse V3.2 and the GQA kernels read the cache in
    the compute dtype) the XLA reference, which dequantizes on read: "auto" steps aside from the kernels and an
    explicit Pallas choice is refused."""
    from deepinfer_jax.config import KV_CACHE_DTYPES

    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto" or kernels_read_fp8:
        return attn_impl
    if attn_impl in ("pallas", "pallas_interpret"):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} runs with attn_impl 'reference' only for this model: "
                         "its Pallas attention kernels read and write the cache in the compute dtype")
    if attn_impl == "auto":
        log.info("kv_cache_dtype %s: attention on the XLA reference path (this model's Pallas attention kernels do "
                 "not read an FP8 cache)", kv_cache_dtype)
    return "reference"


def resolve_impls(attn_impl: str, moe_impl: str, attn_impls: tuple[str, ...] = ("reference", "pallas")
                  ) -> tuple[str, str]:
    """"auto" picks the Pallas kernels on a GPU and the XLA paths on other backends (CPU tests). `attn_impls`: those
    the model's family serves (models/registry.py); "auto" takes the reference where it has no Pallas attention,
    and another value is refused by name."""
    import jax

    gpu = jax.default_backend() == "gpu"
    if attn_impl == "auto":
        attn_impl = "pallas" if gpu and "pallas" in attn_impls else "reference"
    elif attn_impl not in attn_impls:
        raise ValueError(f"attn_impl {attn_impl!r} is not available for this model; expected 'auto' or one of "
                         f"{attn_impls}")
    if moe_impl == "auto":
        moe_impl = "pallas" if gpu else "ragged"
    return attn_impl, moe_impl


class LLM:
    """Load a model directory (HF safetensors or converted) and generate offline.

    Arguments mirror vLLM's: model, dtype, quantization (None / "auto": the checkpoint's own format, an FP8
    checkpoint's weights kept as FP8; "none": an FP8 checkpoint dequantized to `dtype` at load; "fp8": a float
    checkpoint's linear weights quantized online to 128 x 128 FP8 blocks; "int8" / "int4": a checkpoint
    converted with that --quantize; weights/loader.py), kv_cache_dtype ("auto": the compute dtype; "fp8": e4m3
    with scale 1.0, RunnerConfig.kv_cache_dtype), max_model_len, max_num_seqs, max_num_batched_tokens,
    page_size (vLLM's block_size), gpu_memory_utilization, enable_prefix_caching, kv_offloading_size (GiB of host
    memory for the KV cache's host tier, 0: off; docs/kv-tier.md), cpu_offload_gb (GiB of weights kept in host
    memory and copied in by each step, one device, 0: off; docs/offload.md),
    skip_tokenizer_init, seed, load_format ("auto", or "dummy": random weights from the directory's
    config.json, drawn on the device from `seed`; a DeepSeek-V4 release config's FP8 / FP4 leaves drawn packed,
    weights/release_random.py), tensor_parallel_size, data_parallel_size,
    enable_expert_parallel (EP size = TP x DP; DP ranks run data-parallel attention, each with its own requests and KV pages,
    and max_num_seqs / max_num_batched_tokens / num_pages then hold per rank), pipeline_parallel_size (the decoder
    layers split into that many stages, each on its own TP x DP devices: sharding/pipeline.py), all2all_backend (how EP moves tokens:
    "allgather_reducescatter", every device sees every token, or "all_to_all", each token sent only to its experts'
    devices; docs/multi-gpu.md), enable_eplb / eplb_config (expert load balancing: redundant copies of the hot
    experts placed at start, {"num_redundant_experts": R, "expert_load": counts.json}; sharding/eplb.py). Ours: num_pages (fix the
    KV pool size), attn_impl / moe_impl ("auto": the Pallas kernels on a GPU, the XLA references
    elsewhere), gpu_memory (GiB per device: the memory the KV cache is sized from and the model checked against,
    for a device without memory figures or to leave room; None: the device's own), unroll_max_tokens (steps of at most this many token slots run the layers unrolled;
    None: 256 on a GPU, none elsewhere), prefill_layers (how the larger steps run their layers: "scan" or
    "indexed"; None: "indexed" on a GPU, RunnerConfig), fuse_shared_experts / fuse_moe_routing (the MoE
    fusions of the Pallas path, on by default, RunnerConfig), decode_projection_kernel (decode steps
    read o_proj and the dense MLP in place, on by default, RunnerConfig), decode_output_kernel (decode
    steps merge the attention's splits and apply W_UV in one kernel, on by default), decode_absorb_kernel
    (decode steps absorb the query through W_UK in one kernel, on by default), decode_latent_kernel (the
    same kernel launch also norms, ropes and caches the step's latents, on by default),
    prefill_context_variant (prefill buckets' programs with and without the context part, picked on the
    host instead of a lax.cond a layer; on by default, RunnerConfig), greedy_variant (decode buckets get a program
    for steps whose every request is greedy, without the draw; on by default, RunnerConfig),
    nnodes, node_rank, master_addr, master_port (vLLM's multi-node launch: one process a host, each with the
    same arguments and its own node_rank; runner/multihost.py; on ranks other than 0 `LLM(...)` runs rank 0's
    steps and returns once rank 0 calls `shutdown()` or exits), prefill_shared_forward (prefill buckets' sampling
    variants share one forward program; on by default,
    RunnerConfig), decode_shared_forward (with it, decode buckets' too; off by default, RunnerConfig), spec_overlap
    (`deepseek_mtp` steps planned before the one in flight is fetched; None: wherever it can run, RunnerConfig), token_buckets (the step sizes in token slots; (): powers of two, runner/inputs.py), warmup_runs
    (runs of each step program at warm-up; None: RunnerConfig's), chat_template,
    compilation_cache_dir ("default": $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer-jax/xla; None: off;
    it holds JAX's compilation cache and, in `programs/`, the compiled step programs that let a second
    start skip tracing: runner/program_cache.py), progress, generation_config ("auto": the sampling defaults of a
    call without sampling_params come from the model's generation_config.json, "vllm": not, or a folder's file;
    text/generation_config.py).
    """

    def __init__(self, model: str, *, dtype: str = "auto", quantization: str | None = None,
                 kv_cache_dtype: str = "auto", max_model_len: int | None = None, gpu_memory: float | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None, page_size: int = 64,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 skip_tokenizer_init: bool = False, seed: int = 0, tensor_parallel_size: int = 1,
                 data_parallel_size: int = 1, enable_expert_parallel: bool = False, pipeline_parallel_size: int = 1,
                 num_pages: int | None = None, attn_impl: str = "auto", moe_impl: str = "auto",
                 chat_template: str | None = None, compilation_cache_dir: str | None = "default",
                 load_format: str = "auto", unroll_max_tokens: int | None = None,
                 prefill_layers: str | None = None,
                 fuse_shared_experts: bool = True, fuse_moe_routing: bool = True,
                 decode_projection_kernel: bool = True, decode_output_kernel: bool = True,
                 decode_absorb_kernel: bool = True, decode_latent_kernel: bool = True,
                 prefill_context_variant: bool = True, greedy_variant: bool = True, prefill_shared_forward: bool = True, progress: bool = True,
                 decode_shared_forward: bool = False, spec_overlap: bool | None = None,
                 token_buckets: Sequence[int] = (), warmup_runs: int | None = None, nnodes: int = 1,
                 node_rank: int = 0, master_addr: str | None = None, master_port: int | None = None,
                 speculative_config: dict | str | None = None, kv_offloading_size: float = 0.0,
                 cpu_offload_gb: float = 0.0, all2all_backend: str = "allgather_reducescatter",
                 enable_eplb: bool = False, eplb_config: dict | str | None = None, generation_config: str = "auto"):
        # Several hosts (runner/multihost.py): jax.distributed first, before anything touches JAX's backends.
        from deepinfer_jax.runner.multihost import StepChannel

        check_launch(nnodes, node_rank, master_addr, master_port)
        use_host_memory(cpu_offload_gb, kv_offloading_size)  # no VMM allocator before the backend starts (xla_env)
        if nnodes > 1 and pipeline_parallel_size > 1:
            raise ValueError("--pipeline-parallel-size > 1 with --nnodes > 1 is not supported yet; the stages run "
                             "on the devices of one host")
        self.node_rank, self.nnodes = node_rank, nnodes
        channel = None
        if nnodes > 1:
            init_distributed(nnodes, node_rank, master_addr, master_port)
            channel = StepChannel(nnodes, node_rank, master_addr, master_port + 1)
            skip_tokenizer_init = skip_tokenizer_init or node_rank > 0  # only rank 0 reads and writes text
        import jax.numpy as jnp

        from deepinfer_jax.runner.compile_cache import enable_compilation_cache
        from deepinfer_jax.weights.loader import prepare_model

        from deepinfer_jax.config import ModelConfig
        from deepinfer_jax.sharding import ParallelConfig, build_sharding

        from deepinfer_jax.config import SpeculativeConfig

        spec = SpeculativeConfig.parse(speculative_config)  # a bad config fails here, before any loading
        if spec is not None:
            spec.check_supported()
            spec.check_parallel(pipeline_parallel_size)
        parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel,
                                  pipeline_parallel_size, all2all_backend=all2all_backend)
        if all2all_backend != "allgather_reducescatter" and not enable_expert_parallel:
            raise ValueError(f"all2all_backend {all2all_backend!r} moves tokens between expert-parallel devices: "
                             "set enable_expert_parallel (--enable-expert-parallel)")
        from deepinfer_jax.sharding.eplb import EPLBConfig

        eplb = EPLBConfig.parse(eplb_config)
        if eplb_config is not None and not enable_eplb:
            raise ValueError("eplb_config (--eplb-config) needs enable_eplb (--enable-eplb)")
        if enable_eplb and parallel.expert_parallel_size <= 1:
            raise ValueError("enable_eplb (--enable-eplb) balances experts over expert-parallel devices: set "
                             "enable_expert_parallel (--enable-expert-parallel) on more than one device")
        if nnodes > 1:
            import jax

            if parallel.world_size != jax.device_count():
                raise ValueError(
                    f"--tensor-parallel-size {tensor_parallel_size} x --data-parallel-size {data_parallel_size} = "
                    f"{parallel.world_size} must equal the {jax.device_count()} devices of the --nnodes {nnodes} "
                    f"hosts ({jax.local_device_count()} on this one): the mesh spans every host")
        if not os.path.isdir(model):
            raise ValueError(f"model directory {model!r} does not exist")
        from deepinfer_jax.text.generation_config import load_sampling_defaults

        self._sampling_defaults, self._defaults_logged = load_sampling_defaults(model, generation_config), False
        cache_dir = enable_compilation_cache(compilation_cache_dir)
        t0 = time.time()
        self.dtype = resolve_dtype(dtype, model)
        # One device: no mesh, the single-device code. Otherwise the weights load onto their shardings.
        self.sharding, shardings = None, None
        self._eplb_start = None  # sharding/eplb.py ExpertPlacement the weights loaded on, with enable_eplb
        vocab_multiple = 1
        if not parallel.is_single_device:
            cfg0 = ModelConfig.from_model_dir(model)
            rules = None
            if cfg0.family == "deepseek_v4":  # its own layout (sharding/rules.py v4_rules, docs/v4.md)
                from deepinfer_jax.sharding.rules import check_v4_layout, v4_rules
                from deepinfer_jax.weights.name_table_v4 import v4_shared_block

                check_v4_layout(parallel)  # the shared expert splits on whole FP8 blocks only (v4_splits_shared)
                rules = v4_rules(parallel, cfg0, v4_shared_block(model, cfg0, quantization))
            if pipeline_parallel_size > 1:  # one layout a stage; leaves load onto the stage that holds them
                from deepinfer_jax.sharding.pipeline import build_pipeline_sharding

                self.sharding = build_pipeline_sharding(cfg0, parallel)
                shardings = self.sharding.load_shardings(cfg0)
            else:
                self.sharding = build_sharding(cfg0, parallel, rules=rules)
                shardings = self.sharding.param_shardings(cfg0)  # an MTP subtree is dropped if the files have none
            vocab_multiple = self.sharding.vocab_multiple
        if load_format == "auto":  # a model that cannot fit is refused before anything loads (engine/plan.py)
            problem = fit_problem(model, (tensor_parallel_size, data_parallel_size, enable_expert_parallel,
                                          pipeline_parallel_size),
                                  self.dtype, quantization, kv_cache_dtype, gpu_memory, gpu_memory_utilization,
                                  max_model_len, page_size=page_size, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens, cpu_offload_gb=cpu_offload_gb,
                                  speculative_config=spec)
            if problem:
                raise ValueError(problem)
        # The weights load while the engine compiles its step programs (weights/pending.py).
        if load_format == "dummy":  # vLLM's dummy format: config.json only, random weights drawn on the device
            from deepinfer_jax.weights.random_init import pending_random_params

            if quantization not in (None, "auto"):
                raise ValueError(f"quantization {quantization!r} with load_format 'dummy' is not supported (random "
                                 "weights are drawn in the engine dtype)")
            from deepinfer_jax.weights.release_random import pending_release_params, release_format

            self.model_config = ModelConfig.from_model_dir(model).with_vocab_multiple(vocab_multiple)
            release = release_format(model, self.model_config)  # a release config: packed FP8 / FP4 leaves
            params = (pending_release_params(self.model_config, release, jnp.dtype(self.dtype), seed=seed,
                                             shardings=shardings) if release else
                      pending_random_params(self.model_config, jnp.dtype(self.dtype), seed=seed, shardings=shardings))
        elif load_format == "auto":
            self.model_config, params = prepare_model(model, jnp.dtype(self.dtype), shardings=shardings,
                                                      progress=progress, quantization=quantization,
                                                      vocab_multiple=vocab_multiple)
        else:
            raise ValueError(f"load_format {load_format!r} is not one of 'auto', 'dummy'")
        if enable_eplb:  # the routed experts on the placement's physical slots (weights/eplb_load.py)
            from deepinfer_jax.weights.eplb_load import moe_layer_count, with_placement

            if self.model_config.family != "deepseek":
                raise ValueError(f"enable_eplb is not supported for {self.model_config.model_type}")
            E = self.model_config.n_routed_experts
            self._eplb_start = eplb.placement(moe_layer_count(params), E, parallel.expert_parallel_size)
            params = with_placement(params, self._eplb_start, self.sharding.mesh, E)
        cfg = self.model_config
        max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        self.tokenizer = None
        if not skip_tokenizer_init:
            from deepinfer_jax.text import load_tokenizer

            self.tokenizer = load_tokenizer(model, chat_template=chat_template)
        sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens or max(2048, max_num_seqs),
                                max_model_len=max_model_len)
        cache = CacheConfig(page_size=page_size, num_pages=num_pages,
                            gpu_memory_utilization=gpu_memory_utilization, gpu_memory_gib=gpu_memory,
                            enable_prefix_caching=enable_prefix_caching, kv_offloading_size=kv_offloading_size,
                            cpu_offload_gb=cpu_offload_gb)
        from deepinfer_jax.models.registry import family_of

        attn_impl = kv_cache_attn_impl(kv_cache_dtype, attn_impl, cfg.family == "deepseek" and not cfg.has_indexer)
        attn_impl, moe_impl = resolve_impls(attn_impl, moe_impl, family_of(cfg).attn_impls)
        runner = RunnerConfig(dtype=self.dtype, kv_cache_dtype=kv_cache_dtype, attn_impl=attn_impl, moe_impl=moe_impl, seed=seed,
                              unroll_max_tokens=unroll_max_tokens, prefill_layers=prefill_layers,
                              fuse_shared_experts=fuse_shared_experts,
                              fuse_moe_routing=fuse_moe_routing, decode_projection_kernel=decode_projection_kernel,
                              decode_output_kernel=decode_output_kernel, decode_absorb_kernel=decode_absorb_kernel,
                              decode_latent_kernel=decode_latent_kernel,
                              prefill_context_variant=prefill_context_variant,
                              greedy_variant=greedy_variant, prefill_shared_forward=prefill_shared_forward,
                              decode_shared_forward=decode_shared_forward, spec_overlap=spec_overlap,
                              token_buckets=tuple(token_buckets),
                              **({} if warmup_runs is None else {"warmup_runs": warmup_runs}),
                              program_cache_dir=None if cache_dir is None else os.path.join(cache_dir, "programs"),
                              count_expert_load=enable_eplb and pipeline_parallel_size == 1)
        self.engine = LLMEngine(cfg, params, self.tokenizer, scheduler_config=sched, cache_config=cache,
                                runner_config=runner, num_pages=num_pages, progress=progress,
                                sharding=self.sharding, speculative_config=spec, load_format=load_format)
        if enable_eplb and pipeline_parallel_size == 1:  # the observed load, and a rebalance on command
            from deepinfer_jax.engine.expert_balance import ExpertBalance

            self.engine.expert_balance = ExpertBalance(self.engine.runner, self._eplb_start,
                                                       parallel.expert_parallel_size, self.sharding.mesh)
        self.startup_seconds = time.time() - t0
        log.info("ready in %.1f s (%d step shapes compiled)", self.startup_seconds, self.engine.num_warmup_compiles)
        self._channel = channel
        if channel is not None and node_rank == 0:
            self.engine.runner.channel = channel  # every step from now on goes to the other ranks first
        elif channel is not None:  # another rank: run rank 0's steps until it closes the channel
            n = self.engine.runner.follow(channel)
            log.info("rank %d: followed %d steps of rank 0, which has closed the channel", node_rank, n)

    @property
    def has_mtp(self) -> bool:
        """Whether the loaded model has its multi-token-prediction layers (ModelConfig.has_mtp): False for a
        checkpoint that declares num_nextn_predict_layers without MTP weights; speculative decoding with MTP
        checks it."""
        return self.model_config.has_mtp

    @property
    def eplb_placement(self):
        """The expert placement in force with enable_eplb (sharding/eplb.py ExpertPlacement; a rebalance replaces
        it), else None."""
        bal = self.engine.expert_balance
        return self._eplb_start if bal is None else bal.placement

    def get_tokenizer(self):
        return self.tokenizer

    # ---- expert load balancing (enable_eplb; engine/expert_balance.py) --------------------------------
    def _expert_balance(self):
        bal = self.engine.expert_balance
        if bal is None:
            raise ValueError("the expert load is counted with enable_eplb (--enable-eplb) only, and not under "
                             "pipeline parallelism")
        return bal

    def expert_load(self) -> dict:
        """The observed expert load since start: {"load": [MoE layers, E] routed token copies per logical expert,
        "per_expert": [E], "balancedness": the placement's (mean over max rank load, 1.0 even), "max_rank_load"}."""
        bal = self._expert_balance()
        return {"load": bal.load(), **bal.report()}

    def rebalance_experts(self) -> dict:
        """Place the experts anew from the observed load (between steps; no recompile), where that lowers the
        largest EP rank load on it: ExpertBalance.rebalance's figures."""
        return self._expert_balance().rebalance()

    # ---- generation ------------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling params of a call without any: the generation config's defaults (vLLM's method)."""
        d = self._sampling_defaults
        if not self._defaults_logged and d.log_line():
            log.warning("%s", d.log_line())
        self._defaults_logged = True
        return SamplingParams(**d.values)

    def _prompt_ids(self, prompt: Any) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass {'prompt_token_ids': [...]} "
                                 "with skip_tokenizer_init=True")
            return self.tokenizer.encode(prompt), prompt
        raise ValueError(f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        encoded = [self._prompt_ids(p) for p in prompts]
        return self._run(encoded, params, use_tqdm)

    def chat(self, messages: Any, sampling_params: SamplingParams | None = None, *, tools: list | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation (a list of {role, content}) or a list of them, through the chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=False)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        encoded = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **(chat_template_kwargs or {}))
            ids = self.tokenizer.apply_chat_template(conv, tools=tools, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True, **(chat_template_kwargs or {}))
            encoded.append((ids, text))
        sp = sampling_params or self.get_default_sampling_params()
        return self._run(encoded, [sp] * len(encoded), use_tqdm)

    def shutdown(self) -> None:
        """Several hosts, rank 0: end the other ranks' step loops (their `LLM(...)` returns). Also done at exit."""
        if self._channel is not None and self.node_rank == 0:
            self.engine.runner.channel = None
            self._channel.close()

    def _run(self, encoded, params, use_tqdm: bool) -> list[RequestOutput]:
        if self.node_rank > 0:
            raise RuntimeError(f"this LLM is --node-rank {self.node_rank} of {self.nnodes}: it ran rank 0's steps "
                               "until rank 0 shut down; generate on rank 0")
        eng = self.engine
        ids = []
        try:
            for (tok_ids, text), sp in zip(encoded, params):
                rid = eng.new_request_id()
                # Only the finished outputs are kept: the engine builds nothing before (vLLM's LLM does the same).
                sp = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                eng.add_request(rid, tok_ids, sp, prompt=text)
                ids.append(rid)
        except Exception:  # a refused prompt: the call adds nothing, so a later call runs only its own prompts
            for rid in ids:
                eng.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req", disable=None)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in ids]
