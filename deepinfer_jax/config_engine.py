"""The engine's own settings: the paged cache (CacheConfig), the scheduler's limits (SchedulerConfig) and the
device step's implementation choices (RunnerConfig). Plain frozen data, no JAX; `deepinfer_jax.config` re-exports
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# ------------------------------------------------------------------------------------------------
# Engine configs. Plain data; the engine fills them from LLM(...) / CLI flags.
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheConfig:
    """Paged latent KV cache: `num_pages` pages of `page_size` tokens, 576 values per token per layer."""

    page_size: int = 64
    num_pages: int | None = None  # None: sized from gpu_memory_utilization at start
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_offloading_size: float = 0.0  # GiB of host memory for the KV cache's host tier (vLLM's name); 0: off
    gpu_memory_gib: float | None = None  # the memory of each device, for a device without figures (or a smaller one)
    cpu_offload_gb: float = 0.0  # GiB of weights kept in host memory (vLLM's name; runner/weight_offload.py); 0: off

    def __post_init__(self) -> None:
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs prefix caching (drop --no-enable-prefix-caching)")
        if self.cpu_offload_gb < 0:
            raise ValueError(f"cpu_offload_gb must be >= 0 GiB, got {self.cpu_offload_gb}")
        if self.gpu_memory_gib is not None and not self.gpu_memory_gib > 0:
            raise ValueError(f"gpu_memory_gib must be positive, got {self.gpu_memory_gib}")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2, got {self.num_pages}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the continuous-batching scheduler."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # 0: a single prompt may take the whole step budget

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names; fp8 is e4m3


@dataclass(frozen=True)
class RunnerConfig:
    """Implementation choices of the device step, grouped by concern. The decode-kernel and MoE-launch switches
    apply on the Pallas path on one device and fall back to XLA's ops elsewhere (CPU reference, sharded); each is
    on because it measured faster, and stays a switch so a benchmark can compare it with the XLA path on a new
    GPU (benchmarks/runner_flags.py). The measurements behind each default: benchmarks/RESULTS.md."""

    # ---- kernels and precision -----------------------------------------------------------------------------------
    dtype: str = "bfloat16"
    # The latent KV cache's element type: "auto" (the compute dtype) or "fp8" (float8_e4m3fn with a per-tensor
    # scale of 1.0, vLLM's default: MLA's latents are RMS-normed and its rope keys of unit scale, well inside
    # e4m3's +-448, so no scale is stored and a read is a plain cast); half the bytes per token of bf16.
    kv_cache_dtype: str = "auto"
    attn_impl: str = "reference"  # "reference" | "pallas" | "pallas_interpret"
    moe_impl: str = "ragged"  # "ragged" | "dense" | "pallas" | "pallas_interpret"

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype name (see kv_cache_dtype)."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        return self.dtype if self.kv_cache_dtype == "auto" else "float8_e4m3fn"

    # ---- buckets and the layer loop ------------------------------------------------------------------------------
    token_buckets: tuple[int, ...] = field(default_factory=tuple)  # () = powers of two (runner/inputs.py)
    # Steps of at most this many token slots run their layers unrolled: straight-line code, no per-layer weight-slice
    # copies, XLA schedules across layers (a V2-Lite decode step at batch 32 on an H200: 12.5 ms against 15.1
    # scanned), at the price of a longer compile. None: 256 on a GPU, 0 (never) elsewhere.
    unroll_max_tokens: int | None = None
    # How larger steps run their layers: "scan" (lax.scan) or "indexed" (straight-line, each layer reading its
    # weights by an index XLA cannot see through, so the layers share compiled kernels and autotuning and no
    # program holds a while loop: models/deepseek.py run_layers). None: "indexed" on a GPU, where a loaded scanned
    # program slowed the decode steps (~0.15 ms on an H200), "scan" elsewhere.
    prefill_layers: str | None = None

    # ---- attention kernels (Pallas, one device) ------------------------------------------------------------------
    # Prefill-bucket steps: "expanded" attends each token to its own chunk in the expanded form (kernels/mla_chunk.py,
    # 3.4x fewer FLOPs) and to the cached context in the expanded form too for runs of 256+ new tokens
    # (kernels/mla_context.py: the context up-projected window by window), in the absorbed form for the rest;
    # "absorbed" runs all of it absorbed (kernels/mla_prefill.py, the path sharded steps and unsupported head sizes
    # take anyway).
    prefill_attention: str = "expanded"
    # Decode-size steps read o_proj and the dense MLP's weights in place (kernels/decode_matmul.py) instead of XLA
    # copying o_proj's slice every layer and padding the MLP's down weight every step (models/decode_kernels.py);
    # the dense family's q, kv and o projections and MLP (models/dense.py `decode_projections`).
    decode_projection_kernel: bool = True
    # Decode steps of 16+ token slots merge the attention's context splits and apply W_UV in one kernel
    # (kernels/mla_output.py, kv_b_proj read in place) instead of XLA's five; Protocol A 0.6% faster.
    decode_output_kernel: bool = True
    # Decode steps absorb the query through W_UK and rotate its rope part in one kernel (kernels/mla_absorb.py,
    # q and W_UK read in place) instead of XLA's pad, GEMM and RoPE.
    decode_absorb_kernel: bool = True
    # That launch also norms, ropes and writes the step's latents into the paged cache in place
    # (absorb_query_write_latents) instead of XLA's norm / RoPE fusion, scatter and slice copy.
    decode_latent_kernel: bool = True
    # Without q-LoRA, the q / kv_a projections are one GEMM over the two weights concatenated
    # (mla.project_qkv_merged), whose output that launch reads in place, instead of XLA copying two slices out.
    decode_merged_qkv: bool = True

    # ---- MoE launches ---------------------------------------------------------------------------------------------
    # The shared experts run inside the Pallas expert kernels at decode sizes (float weights, experts not split
    # over devices) instead of as separate XLA GEMMs.
    fuse_shared_experts: bool = True
    # Decode-size steps route and align in one kernel (kernels/moe_route.py: greedy top-k without expert groups)
    # instead of ~15 small XLA kernels.
    fuse_moe_routing: bool = True
    # There, both expert kernels run in one launch, each row block's down tiles waiting on its gate_up tiles
    # (kernels/moe_gmm.py `single_launch`): no kernel boundary between them.
    moe_single_launch: bool = True
    # Decode MoE layers go from o_proj's split-K partials to the routing in one launch (kernels/residual_route.py:
    # residual add, post-attention RMSNorm, router logits, routing) instead of five; the base of decode_moe_launch.
    decode_route_launch: bool = True
    # That launch and the experts' single launch are one (kernels/route_experts.py): the shared experts' tiles stream
    # while the router and the routing run.
    decode_moe_launch: bool = True
    # The step sizes (token slots) it runs at; None: any. 32: it was slower at 16 and 64 tokens, even at 8 and 128.
    decode_moe_launch_tokens: tuple[int, ...] | None = (32,)
    # Its shared-expert tiles (row block, gate_up columns, down columns), the row block cut to its gcd with the
    # step's slots; None: the routed tiles' sizes. (32, 64, 256) reads each shared weight tile once.
    decode_moe_shared_tiles: tuple[int, int, int] | None = (32, 64, 256)
    # Prefill-size MoE steps (16,384+ token copies, 16-bit weights, a Hopper GPU) run the expert GEMMs on Mosaic GPU
    # (kernels/moe_gmm_mgpu.py: warp-specialized wgmma + TMA) instead of the Triton kernels: 8-15% faster on an H100.
    moe_prefill_mosaic: bool = True

    # ---- step programs and sampling variants ---------------------------------------------------------------------
    # Prefill buckets get a program with the attention's context part and one without, picked on the host
    # (StepMetadata.has_context), instead of a lax.cond a layer, whose predicate XLA's GPU runtime reads on the
    # host, so the host could queue nothing during the step. Twice the prefill programs; off: fewer to compile.
    prefill_context_variant: bool = True
    # Decode buckets get a sampling variant for steps whose every request is greedy (vLLM's all-greedy path): the
    # argmax without temperature, min-p and draw. One more program per decode bucket.
    greedy_variant: bool = True
    # Prefill buckets run a step as two programs on resident buffers: the bucket's forward, shared by its sampling
    # variants, then the variant's sampler. Warm-up compiles one forward a (bucket, context variant) instead of
    # one a sampling variant too: a shorter cold start at no measured cost a step. One device.
    prefill_shared_forward: bool = True
    # With it, decode buckets run every sampling variant's step that way too (not only the full and mask ones): each
    # decode bucket's forward is compiled once instead of once a variant (base, greedy and full: three unrolled
    # forwards of every layer), for a second launch and input copy a step. Off: the one-program decode step.
    decode_shared_forward: bool = False
    # Compile the penalties / logprobs variant of every bucket at warm-up (else on first use).
    warmup_full_variant: bool = True
    # `deepseek_mtp` speculation: plan step N + 1 before step N's results come back, as if every draft of N were
    # accepted, and correct its positions, slots and token ids on the device (runner/spec_overlap.py,
    # engine/spec_overlap.py), so the host's work between two steps overlaps the device. Steps whose requests all
    # decode greedily without logprobs, penalties, bias or grammar overlap; the others run fetched in turn. One
    # device, no data-parallel attention. None: wherever it can run (on an H100 it took a K = 3 step of the default
    # model from 2.29 to 1.95 ms at batch 1 and from 2.35 to 2.25 at 32); True: refused in one line where it
    # cannot; False: every speculating step is fetched before the next is planned.
    spec_overlap: bool | None = None

    # ---- warm-up and caching -------------------------------------------------------------------------------------
    # Runs of each step program on padding at warm-up, one at a time: the first records the program's CUDA graph
    # (xla_env.py), so that no engine step pays for it. Three cover XLA's address profiling of a program's first
    # runs in its SKIP_PROFILED mode; under SKIP_TEMP one would do, and the other two cost milliseconds.
    warmup_runs: int = 3
    # Where warm-up keeps the compiled step programs (runner/program_cache.py): a later start with the same code,
    # model, configuration and device loads them without tracing. None: off. One device only. LLM (and so
    # `serve`) puts it inside the compilation cache directory.
    program_cache_dir: str | None = None

    # ---- sampling seed and benchmarks ----------------------------------------------------------------------------
    seed: int = 0
    # Return the routed expert ids of every step (benchmarks: distinct experts per layer per step).
    collect_routing: bool = False
    # Count the routed token copies of every (MoE layer, logical expert) on the device (EPLB's observed load:
    # ModelRunner.expert_load): each step adds its counts into a resident [num_moe_layers, E] int32 array; the host
    # reads it only when asked. LLM turns it on with enable_eplb.
    count_expert_load: bool = False

    def __post_init__(self) -> None:
        if self.prefill_layers not in (None, "scan", "indexed"):
            raise ValueError(f"prefill_layers must be 'scan' or 'indexed', got {self.prefill_layers!r}")
        if self.decode_moe_launch_tokens is not None:  # hashable: a static argument of the step's jit
            object.__setattr__(self, "decode_moe_launch_tokens", tuple(int(t) for t in self.decode_moe_launch_tokens))
        if self.decode_moe_shared_tiles is not None:
            object.__setattr__(self, "decode_moe_shared_tiles", tuple(int(t) for t in self.decode_moe_shared_tiles))

    def forward_switches(self) -> dict[str, Any]:
        """The implementation switches that models/deepseek.py forward_paged takes under the same names."""
        return {name: getattr(self, name) for name in FORWARD_SWITCHES}

    def unroll_for(self, num_tokens: int, platform: str) -> bool:
        limit = self.unroll_max_tokens
        if limit is None:
            limit = 256 if platform == "gpu" else 0
        return num_tokens <= limit

    def layer_loop(self, num_tokens: int, platform: str) -> int | bool | str:
        """forward_paged's `unroll` for a step of `num_tokens` token slots."""
        if self.unroll_for(num_tokens, platform):
            return True
        mode = self.prefill_layers or ("indexed" if platform == "gpu" else "scan")
        return "indexed" if mode == "indexed" else 1


# RunnerConfig's fields that forward_paged takes as keyword arguments of the same name.
FORWARD_SWITCHES = ("fuse_shared_experts", "fuse_moe_routing", "prefill_attention", "decode_projection_kernel",
                    "decode_output_kernel", "decode_absorb_kernel", "decode_latent_kernel", "decode_merged_qkv",
                    "moe_single_launch", "decode_route_launch", "decode_moe_launch", "decode_moe_launch_tokens",
                    "decode_moe_shared_tiles", "moe_prefill_mosaic")
