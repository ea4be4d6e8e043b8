"""The one table from HF tensor names to param paths (ARCHITECTURE.md rule 8).

`expected_tensors(cfg, fused_layers)` lists, for a config, every HF tensor the engine needs: its name,
its HF shape ([out, in] for linears), the param leaf it lands in, the index inside that leaf (layer
within the segment, expert, gate/up half) and the transform from HF's layout to ours. The loader
and the converter both walk this list, so a missing tensor is named exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import layer_segments

Transform = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class TensorRule:
    hf_name: str
    hf_shape: tuple[int, ...]
    path: tuple  # keys into the params pytree, e.g. ("segments", 1, "attn", "o_proj")
    index: tuple  # index into that leaf, e.g. (layer, expert, slice(None), 0)
    transform: Transform
    quantizable: bool = True  # FP8 checkpoints may store it as e4m3 + weight_scale_inv


def _t(w: np.ndarray) -> np.ndarray:
    """[out, in] -> [in, out]."""
    return w.T


def _heads_in(h: int, d: int) -> Transform:
    """[h*d, in] -> [in, h, d] (q_proj, q_b_proj, kv_b_proj)."""
    return lambda w: w.T.reshape(w.shape[1], h, d)


def _heads_out(h: int, d: int) -> Transform:
    """o_proj [out, h*d] -> [h, d, out]."""
    return lambda w: w.T.reshape(h, d, w.shape[0])


def _fused_gate_up(w: np.ndarray) -> np.ndarray:
    """HF v5 experts.gate_up_proj [E, 2I, D] (gate rows first) -> [E, D, 2, I]."""
    E, two_i, D = w.shape
    return w.reshape(E, 2, two_i // 2, D).transpose(0, 3, 1, 2)


def _fused_down(w: np.ndarray) -> np.ndarray:
    """HF v5 experts.down_proj [E, D, I] -> [E, I, D]."""
    return w.transpose(0, 2, 1)


def _identity(w: np.ndarray) -> np.ndarray:
    return w


def _dense_attn_rules(cfg: ModelConfig, pre: str, path: tuple, idx: tuple) -> list[TensorRule]:
    """The dense family's attention (models/dense.py): k_proj and v_proj land in kv_proj's halves."""
    D, H, KVH, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    a, s = path + ("attn",), f"{pre}.self_attn"
    kv = a + ("kv_proj",)
    rules = [TensorRule(f"{s}.q_proj.weight", (H * hd, D), a + ("q_proj",), idx, _heads_in(H, hd)),
             TensorRule(f"{s}.k_proj.weight", (KVH * hd, D), kv, idx + (slice(None), 0), _heads_in(KVH, hd)),
             TensorRule(f"{s}.v_proj.weight", (KVH * hd, D), kv, idx + (slice(None), 1), _heads_in(KVH, hd)),
             TensorRule(f"{s}.o_proj.weight", (D, H * hd), a + ("o_proj",), idx, _heads_out(H, hd))]
    if cfg.attention_bias:
        kvb = a + ("kv_bias",)

        def heads(n):
            return lambda w: w.reshape(n, hd)

        rules += [TensorRule(f"{s}.q_proj.bias", (H * hd,), a + ("q_bias",), idx, heads(H), False),
                  TensorRule(f"{s}.k_proj.bias", (KVH * hd,), kvb, idx + (0,), heads(KVH), False),
                  TensorRule(f"{s}.v_proj.bias", (KVH * hd,), kvb, idx + (1,), heads(KVH), False)]
    if cfg.qk_norm:
        rules += [TensorRule(f"{s}.q_norm.weight", (hd,), a + ("q_norm",), idx, _identity, False),
                  TensorRule(f"{s}.k_norm.weight", (hd,), a + ("k_norm",), idx, _identity, False)]
    return rules


def _attn_rules(cfg: ModelConfig, pre: str, path: tuple, idx: tuple) -> list[TensorRule]:
    if cfg.family == "dense":
        return _dense_attn_rules(cfg, pre, path, idx)
    D, H = cfg.hidden_size, cfg.num_attention_heads
    dqk, dv, R, dr = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    a = path + ("attn",)
    rules = []
    if cfg.q_lora_rank is None:
        rules.append(TensorRule(f"{pre}.self_attn.q_proj.weight", (H * dqk, D), a + ("q_proj",), idx, _heads_in(H, dqk)))
    else:
        Rq = cfg.q_lora_rank
        rules += [
            TensorRule(f"{pre}.self_attn.q_a_proj.weight", (Rq, D), a + ("q_a_proj",), idx, _t),
            TensorRule(f"{pre}.self_attn.q_a_layernorm.weight", (Rq,), a + ("q_a_layernorm",), idx, _identity, False),
            TensorRule(f"{pre}.self_attn.q_b_proj.weight", (H * dqk, Rq), a + ("q_b_proj",), idx, _heads_in(H, dqk)),
        ]
    dkv = cfg.qk_nope_head_dim + dv
    rules += [
        TensorRule(f"{pre}.self_attn.kv_a_proj_with_mqa.weight", (R + dr, D), a + ("kv_a_proj_with_mqa",), idx, _t),
        TensorRule(f"{pre}.self_attn.kv_a_layernorm.weight", (R,), a + ("kv_a_layernorm",), idx, _identity, False),
        TensorRule(f"{pre}.self_attn.kv_b_proj.weight", (H * dkv, R), a + ("kv_b_proj",), idx, _heads_in(H, dkv)),
        TensorRule(f"{pre}.self_attn.o_proj.weight", (D, H * dv), a + ("o_proj",), idx, _heads_out(H, dv)),
    ]
    if cfg.has_indexer:
        Hi, Di, ix, n = cfg.index_n_heads, cfg.index_head_dim, a + ("indexer",), f"{pre}.self_attn.indexer"
        rules += [
            TensorRule(f"{n}.wq_b.weight", (Hi * Di, cfg.q_lora_rank), ix + ("wq_b",), idx, _heads_in(Hi, Di)),
            TensorRule(f"{n}.wk.weight", (Di, D), ix + ("wk",), idx, _t),
            TensorRule(f"{n}.k_norm.weight", (Di,), ix + ("k_norm",), idx, _identity, False),
            TensorRule(f"{n}.k_norm.bias", (Di,), ix + ("k_norm_bias",), idx, _identity, False),
            TensorRule(f"{n}.weights_proj.weight", (Hi, D), ix + ("weights_proj",), idx, _t, False),
        ]
    return rules


def _mlp_rules(pre: str, path: tuple, idx: tuple, d: int, inter: int) -> list[TensorRule]:
    return [
        TensorRule(f"{pre}.gate_proj.weight", (inter, d), path + ("gate_up",), idx + (slice(None), 0), _t),
        TensorRule(f"{pre}.up_proj.weight", (inter, d), path + ("gate_up",), idx + (slice(None), 1), _t),
        TensorRule(f"{pre}.down_proj.weight", (d, inter), path + ("down",), idx, _t),
    ]


def layer_rules(cfg: ModelConfig, kind: str, layer: int, path: tuple, idx: tuple, fused: bool) -> list[TensorRule]:
    """Rules of decoder layer `layer` whose leaves live at `path`, indexed by `idx` (() if unstacked)."""
    D = cfg.hidden_size
    pre = f"model.layers.{layer}"
    rules = [
        TensorRule(f"{pre}.input_layernorm.weight", (D,), path + ("input_layernorm",), idx, _identity, False),
        TensorRule(f"{pre}.post_attention_layernorm.weight", (D,), path + ("post_attention_layernorm",), idx, _identity, False),
    ]
    rules += _attn_rules(cfg, pre, path, idx)
    if kind == "dense":
        return rules + _mlp_rules(f"{pre}.mlp", path + ("mlp",), idx, D, cfg.intermediate_size)
    E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
    m = path + ("moe",)
    rules.append(TensorRule(f"{pre}.mlp.gate.weight", (E, D), m + ("gate",), idx, _t, False))
    if cfg.has_e_score_correction_bias:
        rules.append(TensorRule(f"{pre}.mlp.gate.e_score_correction_bias", (E,), m + ("e_score_correction_bias",), idx, _identity, False))
    ex = m + ("experts",)
    if fused:
        rules += [
            TensorRule(f"{pre}.mlp.experts.gate_up_proj", (E, 2 * Im, D), ex + ("gate_up",), idx, _fused_gate_up),
            TensorRule(f"{pre}.mlp.experts.down_proj", (E, D, Im), ex + ("down",), idx, _fused_down),
        ]
    else:
        for e in range(E):
            rules += _mlp_rules(f"{pre}.mlp.experts.{e}", ex, idx + (e,), D, Im)
    if cfg.n_shared_experts:
        rules += _mlp_rules(f"{pre}.mlp.shared_experts", m + ("shared",), idx, D, Im * cfg.n_shared_experts)
    return rules


def expected_tensors(cfg: ModelConfig, fused_layers: frozenset[int] = frozenset()) -> list[TensorRule]:
    """Every HF tensor the params need. `fused_layers`: MoE layers stored in HF v5's fused layout."""
    D, V = cfg.hidden_size, cfg.vocab_size
    # A vocab padded for tensor parallelism: the checkpoint's rows fill the first V of the leaf's, the rest stay 0.
    rows = (slice(0, V),) if cfg.param_vocab_size != V else ()
    cols = (slice(None), slice(0, V)) if cfg.param_vocab_size != V else ()
    rules = [
        TensorRule("model.embed_tokens.weight", (V, D), ("embed",), rows, _identity, False),
        TensorRule("model.norm.weight", (D,), ("final_norm",), (), _identity, False),
    ]
    if cfg.tie_word_embeddings:
        rules.append(TensorRule("model.embed_tokens.weight", (V, D), ("lm_head",), cols, _t, False))
    else:
        rules.append(TensorRule("lm_head.weight", (V, D), ("lm_head",), cols, _t, False))
    for si, seg in enumerate(layer_segments(cfg)):
        for layer in range(seg.start, seg.stop):
            rules += layer_rules(cfg, seg.kind, layer, ("segments", si), (layer - seg.start,), layer in fused_layers)
    for j in range(cfg.num_nextn_predict_layers):
        layer = cfg.num_hidden_layers + j
        pre, path = f"model.layers.{layer}", ("mtp", j)
        rules += [
            TensorRule(f"{pre}.enorm.weight", (D,), path + ("enorm",), (), _identity, False),
            TensorRule(f"{pre}.hnorm.weight", (D,), path + ("hnorm",), (), _identity, False),
            TensorRule(f"{pre}.eh_proj.weight", (D, 2 * D), path + ("eh_proj",), (), _t, False),
            TensorRule(f"{pre}.shared_head.norm.weight", (D,), path + ("shared_head_norm",), (), _identity, False),
        ]
        kind = "moe" if cfg.n_routed_experts else "dense"
        rules += layer_rules(cfg, kind, layer, path + ("layer",), (), layer in fused_layers)
    return rules


# Tensors a checkpoint may hold that the engine does not need (MTP copies of embed/head, buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq", "shared_head.head.weight")


def is_ignored(cfg: ModelConfig, name: str) -> bool:
    if name.endswith(IGNORED_SUFFIXES):
        return True
    mtp_first = cfg.num_hidden_layers
    return any(name == f"model.layers.{mtp_first + j}.embed_tokens.weight" for j in range(cfg.num_nextn_predict_layers))
