"""Frozen configuration dataclasses. No JAX here (ARCHITECTURE.md rule 2).

`ModelConfig` is built from a Hugging Face `config.json` of model_type `deepseek_v2` or `deepseek_v3`
and carries every field the DeepSeek forward needs. Unknown model types and unsupported options raise
`ConfigError` naming the field, never a silent default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """An HF config that this engine cannot serve, with the offending field named."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (DeepSeek's `rope_scaling` / HF v5's `rope_parameters` with type yarn)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """Static model hyper-parameters; hashable so it can be a static jit argument."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # HF builds q_a_layernorm / kv_a_layernorm with a fixed 1e-6 whatever rms_norm_eps says.
    latent_norm_eps: float = 1e-6

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one token's latent cache entry: c_kv (kv_lora_rank) + k_pe (qk_rope_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def has_e_score_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @property
    def num_dense_layers(self) -> int:
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        """(qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when YaRN is on."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )

        def req(key: str) -> Any:
            if d.get(key) is None:
                raise ConfigError(f"config.json of a {model_type} model needs {key!r}")
            return d[key]

        n_routed = int(d.get("n_routed_experts") or 0)
        topk_method = d.get("topk_method") or ("noaux_tc" if model_type == "deepseek_v3" else "greedy")
        scoring = d.get("scoring_func") or ("sigmoid" if model_type == "deepseek_v3" else "softmax")
        if topk_method not in TOPK_METHODS:
            raise ConfigError(f"topk_method {topk_method!r} is not supported; expected one of {TOPK_METHODS}")
        if scoring not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func {scoring!r} is not supported; expected one of {SCORING_FUNCS}")
        n_group = int(d.get("n_group") or 1)
        topk_group = int(d.get("topk_group") or 1)
        k = int(req("num_experts_per_tok")) if n_routed else 0
        if n_routed:
            if n_routed % n_group:
                raise ConfigError(f"n_routed_experts {n_routed} is not divisible by n_group {n_group}")
            if topk_group > n_group:
                raise ConfigError(f"topk_group {topk_group} exceeds n_group {n_group}")
            if k > topk_group * (n_routed // n_group):
                raise ConfigError(
                    f"num_experts_per_tok {k} exceeds the experts in topk_group groups "
                    f"({topk_group} x {n_routed // n_group})"
                )
        if d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not supported by DeepSeek checkpoints")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {d.get('hidden_act')!r} is not supported (only silu)")

        q_lora_rank = d.get("q_lora_rank")
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = tuple(int(e) for e in eos)
        return cls(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),
            hidden_size=int(req("hidden_size")),
            intermediate_size=int(req("intermediate_size")),
            moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=int(req("num_attention_heads")),
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(req("kv_lora_rank")),
            qk_nope_head_dim=int(req("qk_nope_head_dim")),
            qk_rope_head_dim=int(req("qk_rope_head_dim")),
            v_head_dim=int(req("v_head_dim")),
            n_routed_experts=n_routed,
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            num_experts_per_tok=k,
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            scoring_func=scoring,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_dict(d).get("rope_theta", d.get("rope_theta", 10000.0))),
            rope_scaling=_parse_rope_scaling(d),
            max_position_embeddings=int(req("max_position_embeddings")),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{model_dir} has no config.json")
        return cls.from_json_file(path)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _rope_dict(d: dict[str, Any]) -> dict[str, Any]:
    """HF v5 writes `rope_parameters`; older configs `rope_scaling`. Both may be absent."""
    rp = d.get("rope_parameters")
    if isinstance(rp, dict):
        return rp
    rs = d.get("rope_scaling")
    return rs if isinstance(rs, dict) else {}


def _parse_rope_scaling(d: dict[str, Any]) -> RopeScaling | None:
    rs = _rope_dict(d)
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (only yarn or none)")
    if "factor" not in rs or "original_max_position_embeddings" not in rs:
        raise ConfigError("yarn rope_scaling needs 'factor' and 'original_max_position_embeddings'")
    return RopeScaling(
        factor=float(rs["factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        beta_fast=float(rs.get("beta_fast") or 32.0),
        beta_slow=float(rs.get("beta_slow") or 1.0),
        mscale=float(rs.get("mscale") or 1.0),
        mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0),
    )


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's m(f, s) = 0.1 * s * ln(f) + 1, and 1 when f <= 1."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


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

    def __post_init__(self) -> None:
        if self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB, got {self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs prefix caching (drop --no-enable-prefix-caching)")
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


@dataclass(frozen=True)
class RunnerConfig:
    """Implementation choices of the device step, grouped by concern. The decode-kernel and MoE-launch switches
    apply on the Pallas path on one device and fall back to XLA's ops elsewhere (CPU reference, sharded); each is
    on because it measured faster, and stays a switch so a benchmark can compare it with the XLA path on a new
    GPU (benchmarks/runner_flags.py). The measurements behind each default: benchmarks/RESULTS.md."""

    # ---- kernels and precision -----------------------------------------------------------------------------------
    dtype: str = "bfloat16"
    attn_impl: str = "reference"  # "reference" | "pallas" | "pallas_interpret"
    moe_impl: str = "ragged"  # "ragged" | "dense" | "pallas" | "pallas_interpret"

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
    # 3.4x fewer FLOPs) and to the cached context in the absorbed form; "absorbed" runs all of it absorbed
    # (kernels/mla_prefill.py, the path sharded steps and unsupported head sizes take anyway).
    prefill_attention: str = "expanded"
    # Decode-size steps read o_proj and the dense MLP's weights in place (kernels/decode_matmul.py) instead of XLA
    # copying o_proj's slice every layer and padding the MLP's down weight every step (models/decode_kernels.py).
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
    # Compile the penalties / logprobs variant of every bucket at warm-up (else on first use).
    warmup_full_variant: bool = True

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
