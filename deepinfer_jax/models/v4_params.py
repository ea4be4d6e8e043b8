"""The DeepSeek-V4 params pytree: shapes, dtypes and logical axis names of every weight.

V4's layers differ in kind (attention by `layer_types`, MLP by `mlp_layer_types`), so the tree keeps one
dict per layer (`layers[i]`) instead of stacked segments. Weights are `[in, out]`; projections into
heads keep an explicit heads axis. Parameters HF keeps in fp32 whatever the model dtype (the
hyper-connection mixes, sinks, compressor position biases, the correction bias) are fp32 here too.

Tree (D hidden, H heads, hd head_dim, Rq q_lora_rank, g o_groups, r o_lora_rank, n hc_mult,
E experts, I moe_intermediate_size, m a layer's compress rate, c = 2 for CSA (two overlapping series)
and 1 for HCA, nI / di index heads / index head dim):
  embed [V, D]; final_norm [D]; lm_head [D, V]; hc_head: {fn [n*D, n], base [n], scale [1]}
  layers[i]: {input_layernorm [D], post_attention_layernorm [D],
              attn_hc / ffn_hc: {fn [n*D, (2+n)*n], base [(2+n)*n], scale [3]},
              attn: {q_a_proj [D, Rq], q_a_norm [Rq], q_b_proj [Rq, H, hd], kv_proj [D, hd], kv_norm [hd],
                     sinks [H], o_a_proj [g, H*hd/g, r], o_b_proj [g*r, D],
                     compressor (CSA, HCA): {kv_proj [D, c*hd], gate_proj [D, c*hd], position_bias [m, c*hd],
                                             kv_norm [hd]},
                     indexer (CSA): {kv_proj [D, 2*di], gate_proj [D, 2*di], position_bias [m, 2*di],
                                     kv_norm [di], q_b_proj [Rq, nI, di], weights_proj [D, nI]}},
              moe: {gate [D, E], e_score_correction_bias [E] (moe) | tid2eid [V, k] int32 (hash_moe),
                    experts: {gate_up [E, D, 2, I], down [E, I, D]}, shared: {gate_up [D, 2, I], down [I, D]}}}
  mtp[j] (num_nextn_predict_layers): {enorm [D], hnorm [D], e_proj [D, D], h_proj [D, D], norm [D],
              hc_head: {fn [n*D, n], base [n], scale [1]}, layer: a layers[i] dict of layer num_hidden_layers + j
              (its attention kind `V4Config.attn_type`, a scored "moe")}
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config_v4 import CSA, SLIDING, V4Config
from deepinfer_jax.models.params import ParamSpec, is_spec, spec_dtype


def _hc_specs(cfg: V4Config, mix: int, nscale: int) -> dict[str, ParamSpec]:
    n, D = cfg.hc_mult, cfg.hidden_size
    return {
        "fn": ParamSpec((n * D, mix), (None, None), "float32"),
        "base": ParamSpec((mix,), (None,), "float32"),
        "scale": ParamSpec((nscale,), (None,), "float32"),
    }


def _pool_specs(cfg: V4Config, width: int, series: int, rate: int) -> dict[str, ParamSpec]:
    D = cfg.hidden_size
    return {
        "kv_proj": ParamSpec((D, series * width), ("embed", None)),
        "gate_proj": ParamSpec((D, series * width), ("embed", None)),
        "position_bias": ParamSpec((rate, series * width), (None, None), "float32"),
        "kv_norm": ParamSpec((width,), (None,)),
    }


def v4_layer_specs(cfg: V4Config, i: int) -> dict[str, Any]:
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    Rq, g, r = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    lt = cfg.attn_type(i)
    attn: dict[str, Any] = {
        "q_a_proj": ParamSpec((D, Rq), ("embed", "q_lora")),
        "q_a_norm": ParamSpec((Rq,), ("q_lora",)),
        "q_b_proj": ParamSpec((Rq, H, hd), ("q_lora", "heads", "qk_head")),
        "kv_proj": ParamSpec((D, hd), ("embed", None)),
        "kv_norm": ParamSpec((hd,), (None,)),
        "sinks": ParamSpec((H,), ("heads",), "float32"),
        "o_a_proj": ParamSpec((g, H * hd // g, r), ("o_groups", None, None)),
        "o_b_proj": ParamSpec((g * r, D), ("o_groups", "embed")),
    }
    if lt != SLIDING:
        attn["compressor"] = _pool_specs(cfg, hd, 2 if lt == CSA else 1, cfg.compress_rate(lt))
    if lt == CSA:
        di, nI = cfg.index_head_dim, cfg.index_n_heads
        attn["indexer"] = {
            **_pool_specs(cfg, di, 2, cfg.compress_rate(CSA)),
            "q_b_proj": ParamSpec((Rq, nI, di), ("q_lora", None, None)),
            "weights_proj": ParamSpec((D, nI), ("embed", None)),
        }
    moe: dict[str, Any] = {
        "gate": ParamSpec((D, E), ("embed", None)),
        "experts": {
            "gate_up": ParamSpec((E, D, 2, I), ("expert", "embed", None, "moe_mlp")),
            "down": ParamSpec((E, I, D), ("expert", "moe_mlp", "embed")),
        },
        "shared": {
            "gate_up": ParamSpec((D, 2, I), ("embed", None, "mlp")),
            "down": ParamSpec((I, D), ("mlp", "embed")),
        },
    }
    if cfg.mlp_type(i) == "hash_moe":
        moe["tid2eid"] = ParamSpec((cfg.vocab_size, cfg.num_experts_per_tok), ("vocab", None), "int32")
    else:
        moe["e_score_correction_bias"] = ParamSpec((E,), (None,), "float32")
    n = cfg.hc_mult
    return {
        "input_layernorm": ParamSpec((D,), ("embed",)),
        "post_attention_layernorm": ParamSpec((D,), ("embed",)),
        "attn_hc": _hc_specs(cfg, (2 + n) * n, 3),
        "ffn_hc": _hc_specs(cfg, (2 + n) * n, 3),
        "attn": attn,
        "moe": moe,
    }


def v4_mtp_specs(cfg: V4Config, j: int) -> dict[str, Any]:
    """MTP layer j (DeepSeek's MTPBlock): the block of layer num_hidden_layers + j, the projections of the token's
    embedding and of the main model's streams into it, and its own hyper head and final norm."""
    D = cfg.hidden_size
    return {
        "enorm": ParamSpec((D,), ("embed",)),
        "hnorm": ParamSpec((D,), ("embed",)),
        "e_proj": ParamSpec((D, D), ("embed", None)),
        "h_proj": ParamSpec((D, D), ("embed", None)),
        "norm": ParamSpec((D,), ("embed",)),
        "hc_head": _hc_specs(cfg, cfg.hc_mult, 1),
        "layer": v4_layer_specs(cfg, cfg.num_hidden_layers + j),
    }


def v4_param_specs(cfg: V4Config) -> dict[str, Any]:
    D, V = cfg.hidden_size, cfg.vocab_size
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "final_norm": ParamSpec((D,), ("embed",)),
        "lm_head": ParamSpec((D, V), ("embed", "vocab")),
        "hc_head": _hc_specs(cfg, cfg.hc_mult, 1),
        "layers": [v4_layer_specs(cfg, i) for i in range(cfg.num_hidden_layers)],
    }
    if cfg.num_nextn_predict_layers:
        specs["mtp"] = [v4_mtp_specs(cfg, j) for j in range(cfg.num_nextn_predict_layers)]
    return specs


def packed_order(name: str, entries: tuple) -> tuple:
    """A float leaf's per-axis entries (logical axes, or a partition) in the axis order of its FP8 form kept as
    released: the grouped o_a_proj [g, H*hd/g, r] is kept as [H*hd/g, g, r] (weights/v4_native.py); any other
    leaf's order is its own. `name`: the leaf's path, its keys joined by dots."""
    if name.rsplit(".", 1)[-1] != "o_a_proj":
        return tuple(entries)
    e = tuple(entries) + (None,) * (3 - len(entries))
    return (e[1], e[0]) + e[2:]


def v4_logical_axes(cfg: V4Config) -> Any:
    """Pytree of logical axis-name tuples, with the structure of the params."""
    return jax.tree.map(lambda s: s.axes, v4_param_specs(cfg), is_leaf=is_spec)


def v4_init_params(cfg: V4Config, seed: int = 0, dtype: Any = jnp.float32, std: float = 0.02) -> Any:
    """Random params (host numpy, then device arrays): linears ~ N(0, std), norms ~ 1 + N(0, 0.1),
    hash tables uniform over the experts, everything else ~ N(0, std)."""
    rng = np.random.default_rng(seed)

    def make(path, spec: ParamSpec):
        name = jax.tree_util.keystr(path)
        if "tid2eid" in name:
            return jnp.asarray(rng.integers(0, cfg.n_routed_experts, spec.shape), jnp.int32)
        if "norm" in name or name.endswith("['scale']"):
            arr = 1.0 + 0.1 * rng.standard_normal(spec.shape, dtype=np.float32)
        else:
            arr = std * rng.standard_normal(spec.shape, dtype=np.float32)
        return jnp.asarray(arr, dtype=spec_dtype(spec, dtype))

    return jax.tree_util.tree_map_with_path(make, v4_param_specs(cfg), is_leaf=is_spec)
