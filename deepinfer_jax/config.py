"""Frozen configuration dataclasses. No JAX here (ARCHITECTURE.md rule 2).

`ModelConfig` is built from a Hugging Face `config.json` and carries every field its family's forward needs.
`MODEL_FAMILIES` maps each supported `model_type` to its family (the model module that serves it,
models/registry.py): "deepseek" (MLA + MoE: `deepseek_v2`, `deepseek_v3`, and `deepseek_v32` with DeepSeek Sparse
Attention's lightning indexer), "dense" (GQA decoders: Llama, Qwen2, Qwen3, Mistral) or "deepseek_v4" (its fields in
`ModelConfig.v4`, a V4Config of config_v4.py). Unknown model types and
unsupported options raise `ConfigError` naming the field, never a silent default. The engine's own settings
(CacheConfig, SchedulerConfig, RunnerConfig) live in config_engine.py and speculative decoding's in
config_speculative.py; both are re-exported here, as are ConfigError and RopeScaling (config_common.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from deepinfer_jax.config_common import ConfigError, RopeScaling  # noqa: F401 - re-exported
from deepinfer_jax.config_engine import (  # noqa: F401 - re-exported
    FORWARD_SWITCHES, KV_CACHE_DTYPES, CacheConfig, RunnerConfig, SchedulerConfig)
from deepinfer_jax.config_speculative import SpeculativeConfig  # noqa: F401 - re-exported

# HF model_type -> (the family that serves it, models/registry.py; the HF architecture of that type).
MODEL_FAMILIES = {
    "deepseek_v2": ("deepseek", "DeepseekV2ForCausalLM"), "deepseek_v3": ("deepseek", "DeepseekV3ForCausalLM"),
    "deepseek_v32": ("deepseek", "DeepseekV32ForCausalLM"),
    "llama": ("dense", "LlamaForCausalLM"), "qwen2": ("dense", "Qwen2ForCausalLM"),
    "qwen3": ("dense", "Qwen3ForCausalLM"), "qwen3_moe": ("dense", "Qwen3MoeForCausalLM"),
    "mistral": ("dense", "MistralForCausalLM"),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4ForCausalLM"),
}
SUPPORTED_MODEL_TYPES = tuple(MODEL_FAMILIES)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")


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
    # DeepSeek Sparse Attention (V3.2): the lightning indexer's heads and head size, and how many cached
    # tokens each query attends to. index_topk 0: no indexer, dense MLA (V2 / V3).
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # Rows of embed / columns of lm_head in the params (0: vocab_size). Larger when tensor parallelism does
    # not divide vocab_size (`with_vocab_multiple`): the padding rows are zero, and the forward drops the
    # padding columns from the logits, so no padding id is ever sampled or reported.
    padded_vocab_size: int = 0
    family: str = "deepseek"  # MODEL_FAMILIES[model_type]; the fields below: the dense family (models/dense.py)
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm per head on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # each token sees the last `sliding_window` keys (Mistral)
    v4: Any = None  # the deepseek_v4 family: its V4Config (config_v4.py), which its model code reads

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        """DeepSeek Sparse Attention: a lightning indexer picks the index_topk keys each query attends to."""
        return self.index_topk > 0

    @property
    def latent_dim(self) -> int:
        """c_kv (kv_lora_rank) + k_pe (qk_rope_head_dim): the part of a cache entry attention reads."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Width of one token's cache entry: the latent (c_kv, k_pe), then with DSA the indexer's key
        (index_head_dim), so the key lives in the same pages as the latent (prefix caching, preemption and
        chunked prefill carry it unchanged)."""
        return self.latent_dim + (self.index_head_dim if self.has_indexer else 0)

    @property
    def param_vocab_size(self) -> int:
        """The vocab length of embed and lm_head in the params (vocab_size plus any padding)."""
        return max(self.vocab_size, self.padded_vocab_size)

    def with_vocab_multiple(self, multiple: int) -> "ModelConfig":
        """This config with the params' vocab padded to a multiple of `multiple` (vLLM pads its parallel
        embedding and lm_head to a multiple of 64 x TP); unchanged where `multiple` divides vocab_size."""
        if multiple < 1:
            raise ValueError(f"vocab padding multiple must be >= 1, got {multiple}")
        if self.padded_vocab_size and self.padded_vocab_size % multiple == 0:
            return self  # padded already, to a multiple of this one
        if self.vocab_size % multiple == 0:
            return dataclasses.replace(self, padded_vocab_size=0)
        return dataclasses.replace(self, padded_vocab_size=-(-self.vocab_size // multiple) * multiple)

    @property
    def has_mtp(self) -> bool:
        """Whether the loaded model carries multi-token-prediction layers. A checkpoint whose config declares
        num_nextn_predict_layers but whose files have no MTP weights (HF transformers drops them on save)
        loads with num_nextn_predict_layers = 0: MTP is then absent and speculative decoding with it refused."""
        return self.num_nextn_predict_layers > 0

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
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, not a {type(d).__name__}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = d.get("architectures") or []
            named = f"architecture {archs[0]!r} (model_type {model_type!r})" if archs else f"model_type {model_type!r}"
            raise ConfigError(f"{named} is not supported; supported: "
                              + ", ".join(f"{a} ({t})" for t, (_, a) in MODEL_FAMILIES.items()))
        heads = [str(a) for a in d.get("architectures") or []]
        if heads and not any("CausalLM" in a for a in heads):  # a classifier / reward / embedding head on the type
            raise ConfigError(f"architecture {heads[0]!r} is not a causal LM (this engine generates text; a "
                              f"{model_type} model it serves is {MODEL_FAMILIES[model_type][1]})")
        if MODEL_FAMILIES[model_type][0] == "dense":
            return _dense_config(cls, d)
        if model_type == "deepseek_v4":
            return _v4_config(cls, d)

        def req(key: str) -> Any:
            if d.get(key) is None:
                raise ConfigError(f"config.json of a {model_type} model needs {key!r}")
            return d[key]

        n_routed = int(d.get("n_routed_experts") or 0)
        v3_family = model_type in ("deepseek_v3", "deepseek_v32")
        topk_method = d.get("topk_method") or ("noaux_tc" if v3_family else "greedy")
        scoring = d.get("scoring_func") or ("sigmoid" if v3_family else "softmax")
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
        index = _parse_indexer(d, model_type, q_lora_rank, int(req("qk_rope_head_dim")))
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
            **index,
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


def _parse_indexer(d: dict[str, Any], model_type: str, q_lora_rank, rope_dim: int) -> dict[str, int]:
    """The lightning indexer's sizes of a deepseek_v32 config ({} for other model types)."""
    if model_type != "deepseek_v32":
        return {}
    out = {}
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        if d.get(key) is None or int(d[key]) <= 0:
            raise ConfigError(f"config.json of a deepseek_v32 model needs a positive {key!r}")
        out[key] = int(d[key])
    if q_lora_rank is None:
        raise ConfigError("a deepseek_v32 model needs q_lora_rank: its indexer reads the q-LoRA latent")
    if out["index_head_dim"] < rope_dim or rope_dim % 2:
        raise ConfigError(f"index_head_dim {out['index_head_dim']} must hold the even qk_rope_head_dim {rope_dim}")
    return out
def _dense_config(cls, d: dict[str, Any]) -> "ModelConfig":
    """A Llama / Qwen2 / Qwen3 (-MoE) / Mistral config.json -> ModelConfig of the dense family; options it does not
    serve (biases beyond Qwen2's qkv bias, other activations, Qwen's sliding-window or dense layers) by name."""
    mt = d["model_type"]
    needed = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if (key := next((k for k in needed + ("max_position_embeddings",) if d.get(k) is None), None)) is not None:
        raise ConfigError(f"config.json of a {mt} model needs {key!r}")
    refused = [("hidden_act", d.get("hidden_act", "silu") != "silu"), ("mlp_bias", d.get("mlp_bias")),
               ("attention_bias", mt != "qwen2" and d.get("attention_bias")),
               ("partial_rotary_factor", d.get("partial_rotary_factor", 1.0) != 1.0),
               ("use_sliding_window", mt != "mistral" and (
                   d.get("use_sliding_window") or "sliding_attention" in (d.get("layer_types") or ()))),
               ("decoder_sparse_step", d.get("decoder_sparse_step", 1) != 1),
               ("mlp_only_layers", d.get("mlp_only_layers"))]
    if (key := next((k for k, bad in refused if bad), None)) is not None:
        raise ConfigError(f"{key}={d.get(key)!r} is not supported for {mt}")
    experts = d.get("num_experts") or d.get("num_local_experts") or 0  # HF v5 saves the latter name
    H, E = int(d["num_attention_heads"]), int(experts) if mt == "qwen3_moe" else 0
    kvh, hd = int(d.get("num_key_value_heads") or H), int(d.get("head_dim") or int(d["hidden_size"]) // H)
    if H % kvh:
        raise ConfigError(f"num_attention_heads {H} is not a multiple of num_key_value_heads {kvh}")
    eos, window = d.get("eos_token_id"), int(d.get("sliding_window") or 0) if mt == "mistral" else 0
    return cls(
        model_type=mt, family="dense", vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]), num_hidden_layers=int(d["num_hidden_layers"]),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0), num_attention_heads=H, q_lora_rank=None,
        kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=hd, v_head_dim=hd, n_routed_experts=E, n_shared_experts=0,
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if E else 0, n_group=1, topk_group=1,
        topk_method="greedy", scoring_func="softmax", norm_topk_prob=bool(E and d.get("norm_topk_prob")),
        routed_scaling_factor=1.0, first_k_dense_replace=0, moe_layer_freq=1,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(_rope_dict(d).get("rope_theta", d.get("rope_theta", 10000.0))),
        rope_scaling=_parse_dense_rope(d), max_position_embeddings=int(d["max_position_embeddings"]),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), bos_token_id=d.get("bos_token_id"),
        eos_token_id=tuple(int(e) for e in eos) if isinstance(eos, list) else eos, num_key_value_heads=kvh, head_dim=hd,
        attention_bias=mt == "qwen2", qk_norm=mt in ("qwen3", "qwen3_moe"), sliding_window=window or None)


def _v4_config(cls, d: dict[str, Any]) -> "ModelConfig":
    """A deepseek_v4 config.json -> ModelConfig of the deepseek_v4 family: the engine-facing fields (vocab,
    layers, positions, special tokens) here, every V4 field in `v4` (V4Config). num_nextn_predict_layers is the
    declared count; loading sets it to what the files hold (weights/name_table_v4.py `v4_checkpoint_config`)."""
    from deepinfer_jax.config_v4 import V4Config

    v4 = V4Config.from_hf_dict(d)
    return cls(
        model_type="deepseek_v4", family="deepseek_v4", vocab_size=v4.vocab_size, hidden_size=v4.hidden_size,
        intermediate_size=0, moe_intermediate_size=v4.moe_intermediate_size,
        num_hidden_layers=v4.num_hidden_layers, num_attention_heads=v4.num_attention_heads,
        q_lora_rank=v4.q_lora_rank, kv_lora_rank=0, qk_nope_head_dim=v4.head_dim - v4.qk_rope_head_dim,
        qk_rope_head_dim=v4.qk_rope_head_dim, v_head_dim=v4.head_dim, n_routed_experts=v4.n_routed_experts,
        n_shared_experts=v4.n_shared_experts, num_experts_per_tok=v4.num_experts_per_tok, n_group=1, topk_group=1,
        topk_method="noaux_tc", scoring_func=v4.scoring_func, norm_topk_prob=True,
        routed_scaling_factor=v4.routed_scaling_factor, first_k_dense_replace=0, moe_layer_freq=1,
        rms_norm_eps=v4.rms_norm_eps, rope_theta=v4.rope_theta, rope_scaling=None,
        max_position_embeddings=v4.max_position_embeddings,
        num_nextn_predict_layers=v4.num_nextn_predict_layers,
        tie_word_embeddings=v4.tie_word_embeddings, bos_token_id=v4.bos_token_id, eos_token_id=v4.eos_token_id,
        num_key_value_heads=1, head_dim=v4.head_dim, sliding_window=v4.sliding_window, v4=v4)


def _parse_dense_rope(d: dict[str, Any]) -> RopeScaling | None:
    """`rope_scaling` of the dense family: none/default, linear, llama3 or yarn (HF's parameter names)."""
    rs = _rope_dict(d)
    kind, orig = rs.get("rope_type", rs.get("type")), rs.get("original_max_position_embeddings")
    af = rs.get("attention_factor")
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3", "yarn"):
        raise ConfigError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3 or yarn)")
    if rs.get("factor") is None or (kind == "llama3" and orig is None):
        extra = " and 'original_max_position_embeddings'" if kind == "llama3" else ""
        raise ConfigError(f"{kind} rope_scaling needs 'factor'{extra}")
    return RopeScaling(
        factor=float(rs["factor"]), rope_type=kind,
        original_max_position_embeddings=int(orig or d["max_position_embeddings"]),
        beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
        mscale=float(rs.get("mscale") or 0.0), mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)), high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        attention_factor=None if af is None else float(af), truncate=bool(rs.get("truncate", True)))


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
