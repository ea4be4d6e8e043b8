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

    def __post_init__(self) -> None:
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
    """Implementation choices of the device step. `attn_impl` / `moe_impl` pick kernels or references."""

    dtype: str = "bfloat16"
    attn_impl: str = "reference"  # "reference" | "pallas" | "pallas_interpret"
    moe_impl: str = "ragged"  # "ragged" | "dense" | "pallas" | "pallas_interpret"
    token_buckets: tuple[int, ...] = field(default_factory=tuple)  # () = powers of two (runner/inputs.py)
    seed: int = 0
    # Compile the penalties / logprobs variant of every bucket at warm-up (else it is compiled on first use).
    warmup_full_variant: bool = True
    # Return the routed expert ids of every step (benchmarks: distinct experts per layer per step).
    collect_routing: bool = False
    # Steps of at most this many token slots run their layers unrolled (straight-line code: no per-layer
    # weight-slice copies, XLA schedules across layers; on an H200 a V2-Lite decode step at batch 32 drops
    # from 15.1 to 12.5 ms) at the price of a longer compile; bigger (prefill) buckets run as prefill_layers
    # says. None: 256 on a GPU, 0 (never) elsewhere. With every bucket unrolled `serve`'s 24 programs took 147 s
    # to ready even with their autotuning results, 326 s without (benchmarks/RESULTS.md, session 20).
    unroll_max_tokens: int | None = None
    # How steps above unroll_max_tokens run their layers: "scan" (lax.scan) or "indexed" (straight-line, each
    # layer reading its weights by an index XLA cannot see through, so all layers share their compiled kernels
    # and autotuning, and no step program holds a while loop: models/deepseek.py run_layers). None: "indexed"
    # on a GPU, "scan" elsewhere. While any step program with a scanned loop is loaded, an H200 runs the decode
    # steps ~0.15 ms slower (sessions 17-20, cause unknown); session 21, Protocol A: indexed 3,639-3,645 tok/s,
    # scanned 3,580-3,587, every bucket unrolled 3,643-3,645, on one machine; ready on an empty cache 20.9 s.
    prefill_layers: str | None = None
    # Run the shared experts inside the Pallas MoE kernels (moe_impl "pallas*", one device or TP without
    # expert splitting, float weights) instead of as separate XLA GEMMs. H200, V2-Lite decode step at
    # batch 32: 9.93 -> 9.70 ms.
    fuse_shared_experts: bool = True
    # Route and align decode-size steps in one Pallas kernel (kernels/moe_route.py: greedy top-k without
    # expert groups) instead of ~15 small XLA kernels. H200, same step: 9.93 -> 9.65 ms (9.28 with both).
    fuse_moe_routing: bool = True
    # Prefill-bucket steps on the Pallas path (one device): "expanded" attends each token to its own
    # chunk in the expanded form (kernels/mla_chunk.py, 3.4x fewer FLOPs) and to the cached context in
    # the absorbed form; "absorbed" runs all of it absorbed (kernels/mla_prefill.py).
    prefill_attention: str = "expanded"
    # With "expanded", whether the step's cached context exists is known on the host (StepMetadata.has_context):
    # each prefill bucket then has two programs, one with the context part and one without, instead of one
    # whose layers each decide it with a lax.cond. XLA's GPU runtime reads a cond's predicate on the host, so
    # that program's call lasts as long as the step and the host queues nothing meanwhile. H200 (session 17):
    # Protocol B at concurrency 128, 7,007 against 6,749 output tok/s, TTFT mean 270 against 426 ms, ITL mean
    # 17.5 against 34.8 ms; Protocol A even (3,594 against 3,589). The price: twice the prefill buckets' programs.
    prefill_context_variant: bool = True
    # Decode-size steps on the Pallas path (one device) run o_proj and the dense MLP through
    # kernels/decode_matmul.py, which reads each layer's weight in place from the stacked array,
    # instead of XLA's GEMMs (which copied o_proj's slice every layer for cuBLAS and padded the dense
    # MLP's down weight every step; models/deepseek.py: STACKABLE).
    decode_projection_kernel: bool = True
    # Decode-size steps on the Pallas path (one device, at least 16 token slots) merge the decode
    # attention's context splits and apply W_UV in one kernel (kernels/mla_output.py, kv_b_proj read in
    # place) instead of XLA's five (the merge's two reductions, W_UV's slice copy, a GEMM, its reduce).
    # H200, V2-Lite batch-32 step: even (8.65 ms either way); Protocol A 0.6% faster with it.
    decode_output_kernel: bool = True
    # Decode-size steps on the Pallas path (one device, token slots a multiple of 16) absorb the query
    # through W_UK and rotate its rope part in one kernel (kernels/mla_absorb.py: q and W_UK read in
    # place) instead of XLA's pad of q_nope, GEMM over kv_b's whole rows and RoPE.
    decode_absorb_kernel: bool = True
    # Where the absorb kernel runs, its launch also takes the kv_a projection's raw rows, applies
    # kv_a_layernorm and RoPE and writes the latents into the paged cache in place
    # (kernels/mla_absorb.py: absorb_query_write_latents), instead of XLA's norm / RoPE fusion, the cache's
    # scatter and a slice copy (1.6 + 3.0 + 1.3 us a layer on an H200 at batch 32). H200, V2-Lite batch-32
    # step: 8.23 ms against 8.28 (session 11; the kernel 4.2 us against 3.6 for the absorption alone, and XLA
    # now copies the latents out of its merged q / kv_a GEMM too: a second 1.4 us slice).
    decode_latent_kernel: bool = True
    # Where that launch writes the latents and does not run the projections itself, on models without q-LoRA,
    # the q / kv_a projections are written as one GEMM over the two weights, concatenated (models/mla.py
    # project_qkv_merged), and the launch reads q and the kv_a rows in place out of its output, instead of XLA
    # merging the two GEMMs itself and copying two slices out for the launch (1.5 + 1.4 us a layer on an H200
    # at batch 32). Session 13 (H200, V2-Lite, batch 32 at 640): the GEMM (7.4 us) now ends in a split-K reduce
    # (1.7 us) in place of the two copies, 14 kernels a layer against 15; step 8.28 ms against 8.31 on that
    # machine; Protocol A 3,524 / 3,528 tok/s (3,526 / 3,521 without, on another); fp32 greedy tokens 8/8 equal
    # to the CPU reference.
    decode_merged_qkv: bool = True
    # Where the routing runs in its kernel (fuse_moe_routing, decode sizes), the MoE's two expert kernels run
    # in one launch: a row block's down tiles wait (on an atomic counter) for its gate_up tiles, so the down
    # tiles start while the last gate_up tiles stream, with no kernel boundary (kernels/moe_gmm.py
    # `single_launch`). H200, V2-Lite batch-32 step: 8.34 ms against 8.64 (session 11).
    moe_single_launch: bool = True
    # Decode-size MoE layers on the Pallas path (one device, o_proj read in place, routing in its kernel) go
    # from o_proj's split-K partials to the routing in one launch (kernels/residual_route.py: the residual
    # add, the post-attention RMSNorm, the router's logits as a split dot, the routing), instead of five
    # launches (12.9 us a layer on an H200 at batch 32; session 10's first try, a per-token kernel, was slower
    # than XLA). Session 13 (H200, batch 32): 12.8 us against 14.4 for the five, but the step is 8.25 ms
    # against 8.23-8.24; at batch 8, 5.36 ms against 5.41 (one run each). Session 24: 8.14 ms against 8.14
    # alone; on since session 24 as the base of decode_moe_launch.
    decode_route_launch: bool = True
    # Where the route launch runs (decode_route_launch) and the expert kernels run in one launch
    # (moe_single_launch), the two launches are one (kernels/route_experts.py): the shared experts' tiles (which
    # need only the normed x) stream while the router and the routing run, and the routed tiles follow with no
    # launch boundary. Session 24 (H200, V2-Lite, batch 32): in isolation 268.1 us a layer against 270.1 for the
    # two launches (moe_launch_sweep.py); Protocol A alternating on one machine 3,672 / 3,664 and 3,674 / 3,661
    # tok/s (temp 0 / 1) against 3,666 / 3,655 and 3,669 / 3,658 without; fp32 greedy tokens 8/8 equal to the
    # CPU reference. The shared tiles stream on ~44 programs while the routing runs, a third of the bandwidth,
    # so the overlap is ~2 us a layer, not the ~8 us their bytes are worth (session 28: ~2 us more with tiles of
    # their own, decode_moe_shared_tiles).
    decode_moe_launch: bool = True
    # The step sizes (token slots) that launch runs at; None: every size it takes. Session 25 (H200, V2-Lite, at
    # 640 tokens of context, alternating): batch 8 5.40 / 5.41 ms against 5.41 / 5.38 without, batch 16 7.13 /
    # 7.14 against 7.02 / 7.03, batch 32 Protocol A 3,677 / 3,677 tok/s against 3,665 / 3,662, batch 64 9.01 / 9.03
    # against 8.97 / 8.97; session 24, batch 128 even. In isolation (moe_launch_sweep.py, its defaults: 8 warps,
    # the shared down tiles late) the one launch is slower than the two at 16 and 64 tokens too. Session 28, with
    # decode_moe_shared_tiles: batch 64 9.05, 9.03 ms against 9.00, 8.98; batch 16 7.06, 7.08 against 7.02, 7.02.
    decode_moe_launch_tokens: tuple[int, ...] | None = (32,)
    # That launch's shared-expert tiles: (row block, gate_up column tile, down column tile), the row block cut to
    # its greatest common divisor with the step's token slots; None: the routed tiles' sizes (16 rows, 128 / 256
    # columns at batch 32: each shared gate_up weight tile read by two 16-row programs). Session 28 (H200, V2-Lite,
    # batch 32 at 640, alternating): the step 7.99, 7.99 ms with (32, 64, 256) and 8.00, 7.97 with (16, 64, 256)
    # against 8.04, 8.04 with None; in isolation 262.2 us a layer against 263.9-265.0 (moe_launch_sweep.py);
    # Protocol A on another machine, alternating: 3,682 / 3,674 and 3,688 / 3,677 tok/s (temp 0 / 1) against 3,673
    # / 3,659 and 3,674 / 3,659 with None (vLLM 0.26 there: 3,066 / 3,054); fp32 greedy tokens 8/8 equal to the CPU.
    decode_moe_shared_tiles: tuple[int, int, int] | None = (32, 64, 256)
    # Prefill-size MoE steps (16,384+ token copies, where tile_config's row blocks are 128, 16-bit weights, no shared
    # experts in the kernels, a Hopper GPU) run the expert GEMMs on Mosaic GPU (kernels/moe_gmm_mgpu.py:
    # warp-specialized wgmma + TMA, the gate_up SwiGLU in its epilogue) over XLA's gather of the rows, instead of the
    # Triton kernels. Session 34 (H100): a step's experts (kernels + XLA's gather and combine) 689 / 867 / 1,529 /
    # 2,914 us against 764 / 1,007 / 1,795 / 3,168 at 2,731 / 4,096 / 8,192 / 16,384 tokens x top-6; Protocol A's
    # 32 x 512 prefill 150-153 ms against 157-159, greedy tokens and bf16 error as the Triton path's. On.
    moe_prefill_mosaic: bool = True
    # Decode buckets get a third sampling variant for steps whose every request is greedy (vLLM's all-greedy
    # path): the argmax without the temperature, min-p and the Gumbel draw (session 33, H100, batch 32: 11.3 us
    # beyond the lm_head against the base variant's 17.8). One more program per decode bucket at warm-up.
    # Session 22 (H200): Protocol A greedy 3,696 tok/s against 3,684 without it, temperature 1 even (3,687).
    greedy_variant: bool = True
    # Prefill buckets (more token slots than sequence rows; one device, no routing collected) run a step as two
    # programs: the bucket's forward, shared by its sampling variants, which writes each sequence's output into
    # a resident buffer, then the variant's sampler. Warm-up then compiles one forward a (bucket, context
    # variant) instead of one a sampling variant too: `serve` at Protocol B's flags compiles 8 prefill forwards
    # instead of 16 whole programs. Session 26 (H200, one machine, empty cache, with runner/lowering.py): 53.4 s
    # to /health against 66.6 s without. The price, a second program and input copy a prefill step, did not
    # show: Protocol A 3,671 / 3,663 tok/s (temp 0 / 1) and prefill 153-155 ms with it, 3,674 / 3,663 and 154 ms
    # without; the GPU-vs-CPU check equal (8/8 greedy).
    prefill_shared_forward: bool = True
    # Runs of each step program on padding at warm-up, one at a time: the first records the program's
    # CUDA graph (xla_env.py), so that no engine step pays for it. Three, from the SKIP_PROFILED mode of
    # sessions 5-15, whose address profile took a program's first 3 runs (gpu_executable_va_remap_
    # allocator.cc); under SKIP_TEMP one would do, and three cost milliseconds, so it is kept.
    warmup_runs: int = 3
    # Where warm-up keeps the compiled step programs (runner/program_cache.py): a later start with the
    # same code, model, configuration and device loads them without tracing. None: off. One device only.
    # LLM (and so `serve`) puts it inside the compilation cache directory.
    program_cache_dir: str | None = None

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
