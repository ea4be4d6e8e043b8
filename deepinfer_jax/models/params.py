"""The params pytree: shapes, dtypes and logical axis names of every DeepSeek weight.

`param_specs(cfg)` is the single source of truth: the HF loader, the converter and the sharding rules
all check against it. Layers are grouped into *segments* of consecutive layers of one kind ("dense" or
"moe"); a segment's leaves are stacked along a leading "layers" axis so the forward scans over them.

Weights are `[in, out]`; attention weights keep an explicit heads axis so tensor parallelism can split
heads by editing the rules in `sharding/`, never this file.

Tree (E experts, H heads, R = kv_lora_rank, dr = qk_rope_head_dim, dn = qk_nope_head_dim):
  embed [V, D]; final_norm [D]; lm_head [D, V] (V: cfg.param_vocab_size, the vocab plus any TP padding)
  segments[i]: {input_layernorm [L, D], post_attention_layernorm [L, D],
                attn: {q_proj [L, D, H, dn+dr] | q_a_proj [L, D, Rq], q_a_layernorm [L, Rq],
                       q_b_proj [L, Rq, H, dn+dr]; kv_a_proj_with_mqa [L, D, R+dr];
                       kv_a_layernorm [L, R]; kv_b_proj [L, R, H, dn+dv]; o_proj [L, H, dv, D],
                       indexer (DSA, V3.2; Hi = index_n_heads, Di = index_head_dim):
                         {wq_b [L, Rq, Hi, Di], wk [L, D, Di], k_norm [L, Di], k_norm_bias [L, Di],
                          weights_proj [L, D, Hi] (fp32, as HF keeps it)}},
                mlp (dense): {gate_up [L, D, 2, I], down [L, I, D]}
                moe: {gate [L, D, E], e_score_correction_bias [L, E] (noaux_tc, fp32),
                      experts: {gate_up [L, E, D, 2, Im], down [L, E, Im, D]},
                      shared: {gate_up [L, D, 2, Is], down [L, Is, D]} (n_shared_experts > 0)}}
  mtp[j] (num_nextn_predict_layers): {enorm [D], hnorm [D], eh_proj [2D, D], shared_head_norm [D],
                                      layer: one MoE-kind layer without the stacked axis}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    """One leaf: its shape, its dtype ("model" = the engine dtype, or a fixed dtype) and logical axes."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: str = "model"

    def __post_init__(self) -> None:
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)


@dataclass(frozen=True)
class Segment:
    kind: str  # "dense" | "moe"
    start: int  # first layer index (inclusive)
    stop: int  # last layer index (exclusive)

    @property
    def num_layers(self) -> int:
        return self.stop - self.start


def layer_segments(cfg: ModelConfig) -> tuple[Segment, ...]:
    """Maximal runs of consecutive layers of one kind, in order."""
    segs: list[Segment] = []
    for i in range(cfg.num_hidden_layers):
        kind = "moe" if cfg.is_moe_layer(i) else "dense"
        if segs and segs[-1].kind == kind:
            segs[-1] = Segment(kind, segs[-1].start, i + 1)
        else:
            segs.append(Segment(kind, i, i + 1))
    return tuple(segs)


def _mlp_specs(d: int, inter: int, lead: tuple, lead_axes: tuple, axis: str) -> dict:
    return {
        "gate_up": ParamSpec(lead + (d, 2, inter), lead_axes + ("embed", None, axis)),
        "down": ParamSpec(lead + (inter, d), lead_axes + (axis, "embed")),
    }


def layer_specs(cfg: ModelConfig, kind: str, n: int | None) -> dict[str, Any]:
    """Specs of one layer of `kind`; with `n` set, every leaf gets a leading [n] "layers" axis."""
    lead = () if n is None else (n,)
    la = () if n is None else ("layers",)
    D, H = cfg.hidden_size, cfg.num_attention_heads
    dqk, dv, R, dr = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim

    def P(shape, axes, dtype="model"):
        return ParamSpec(lead + shape, la + axes, dtype)

    attn: dict[str, Any] = {}
    if cfg.q_lora_rank is None:
        attn["q_proj"] = P((D, H, dqk), ("embed", "heads", "qk_head"))
    else:
        Rq = cfg.q_lora_rank
        attn["q_a_proj"] = P((D, Rq), ("embed", "q_lora"))
        attn["q_a_layernorm"] = P((Rq,), ("q_lora",))
        attn["q_b_proj"] = P((Rq, H, dqk), ("q_lora", "heads", "qk_head"))
    attn["kv_a_proj_with_mqa"] = P((D, R + dr), ("embed", "kv_latent"))
    attn["kv_a_layernorm"] = P((R,), ("kv_lora",))
    attn["kv_b_proj"] = P((R, H, cfg.qk_nope_head_dim + dv), ("kv_lora", "heads", "kv_head"))
    attn["o_proj"] = P((H, dv, D), ("heads", "v_head", "embed"))
    if cfg.has_indexer:  # replicated: one key per token, and its heads are few and small
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        attn["indexer"] = {
            "wq_b": P((cfg.q_lora_rank, Hi, Di), ("q_lora", None, None)),
            "wk": P((D, Di), ("embed", None)),
            "k_norm": P((Di,), (None,)),
            "k_norm_bias": P((Di,), (None,)),
            "weights_proj": P((D, Hi), ("embed", None), "float32"),
        }

    spec: dict[str, Any] = {
        "input_layernorm": P((D,), ("embed",)),
        "post_attention_layernorm": P((D,), ("embed",)),
        "attn": attn,
    }
    if kind == "dense":
        spec["mlp"] = _mlp_specs(D, cfg.intermediate_size, lead, la, "mlp")
    else:
        E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
        moe: dict[str, Any] = {
            "gate": P((D, E), ("embed", None)),
            "experts": {
                "gate_up": P((E, D, 2, Im), ("expert", "embed", None, "moe_mlp")),
                "down": P((E, Im, D), ("expert", "moe_mlp", "embed")),
            },
        }
        if cfg.has_e_score_correction_bias:
            moe["e_score_correction_bias"] = P((E,), (None,), "float32")
        if cfg.n_shared_experts:
            moe["shared"] = _mlp_specs(D, Im * cfg.n_shared_experts, lead, la, "mlp")
        spec["moe"] = moe
    return spec


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    D, V = cfg.hidden_size, cfg.param_vocab_size
    specs: dict[str, Any] = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "final_norm": ParamSpec((D,), ("embed",)),
        "lm_head": ParamSpec((D, V), ("embed", "vocab")),
        "segments": [layer_specs(cfg, s.kind, s.num_layers) for s in layer_segments(cfg)],
    }
    if cfg.num_nextn_predict_layers:
        specs["mtp"] = [
            {
                "enorm": ParamSpec((D,), ("embed",)),
                "hnorm": ParamSpec((D,), ("embed",)),
                "eh_proj": ParamSpec((2 * D, D), (None, "embed")),
                "shared_head_norm": ParamSpec((D,), ("embed",)),
                "layer": layer_specs(cfg, "moe" if cfg.n_routed_experts else "dense", None),
            }
            for _ in range(cfg.num_nextn_predict_layers)
        ]
    return specs


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def spec_dtype(spec: ParamSpec, dtype: Any) -> Any:
    return jnp.dtype(dtype) if spec.dtype == "model" else jnp.dtype(spec.dtype)


def logical_axes(cfg: ModelConfig) -> Any:
    """Pytree of logical axis-name tuples, with the structure of the params."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=is_spec)


def init_params(cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, std: float = 0.02) -> Any:
    """Random params at a realistic scale: linear weights ~ N(0, std), norms ~ 1 + N(0, 0.1)
    (so routing is not flat), correction biases ~ U(0, 0.1). Built on the host with numpy so even
    large shapes cost no device compile."""
    rng = np.random.default_rng(seed)
    specs = param_specs(cfg)

    def make(path, spec: ParamSpec):
        dt = spec_dtype(spec, dtype)
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            arr = 1.0 + 0.1 * rng.standard_normal(spec.shape, dtype=np.float32)
        elif "e_score_correction_bias" in name:
            arr = rng.uniform(0.0, 0.1, spec.shape).astype(np.float32)
        else:
            arr = std * rng.standard_normal(spec.shape, dtype=np.float32)
        return jnp.asarray(arr, dtype=dt)

    return jax.tree_util.tree_map_with_path(make, specs, is_leaf=is_spec)
