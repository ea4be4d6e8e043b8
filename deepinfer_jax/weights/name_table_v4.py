"""DeepSeek-V4's table from HF tensor names to param paths, and the loader of a V4 HF checkpoint.

Names on disk come in DeepSeek's own layout (`layers.0.attn.wq_a.weight`, `ffn.experts.3.w1`,
`hc_attn_fn`, `attn_sink`, `ape`, ...: what DeepSeek releases and what HF's `save_pretrained` writes back)
or in HF's module layout (`model.layers.0.self_attn.q_a_proj.weight`). `canonical_v4_name` maps both
to HF's module names with the renames of HF's `conversion_mapping["deepseek_v4"]`; the table is
written in those.

`v4_expected_tensors(cfg)` lists every tensor the V4 params need (HF name, HF shape, the param leaf,
the index inside it, the transform from HF's `[out, in]` layout to ours), as `name_table.py` does for
V2 / V3. `load_v4_checkpoint` checks all of them (a missing or misshapen tensor is named) and
assembles the params on the host, then on the device.

The MTP block as DeepSeek releases it (`mtp.{j}.*`, which HF skips by its `_keys_to_ignore_on_load_unexpected`)
loads as params["mtp"][j] where the checkpoint has it: its own `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm`,
`hc_head_*` and a block named as a layer's (`mtp.{j}.attn.wq_a`, `mtp.{j}.ffn.experts.3.w1`, ...; canonical
`mtp.{j}.self_attn.q_a_proj`, ...). A config that declares MTP layers the files do not have loads without them
(`v4_checkpoint_config`); rotary buffers are skipped by name. FP8 / FP4 weights as DeepSeek releases them
(`X.scale` beside `X.weight`) are read by weights/v4_native.py: kept as Fp8Weight / Fp4Weight leaves, or
dequantized with quantization "none".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config_v4 import CSA, SLIDING, V4Config
from deepinfer_jax.models.params import is_spec
from deepinfer_jax.models.v4_params import v4_param_specs
from deepinfer_jax.weights.name_table import TensorRule
from deepinfer_jax.weights.safetensors_io import CheckpointError, TensorInfo, index_checkpoint, load_tensor
from deepinfer_jax.weights.v4_native import (V4Quant, check_quantized, dequantized, leaf_kinds, leaf_shapes,
                                             quant_index, read_quantized, scale_aliases, stored_kind,
                                             v4_quant_config)

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F32", "F16", "BF16")
INT_DTYPES = ("I64", "I32")


# DeepSeek's names -> HF module names, in HF's order (conversion_mapping.py, "deepseek_v4"); applied to
# a name without its leading "model.".
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"), (r"^hc_head_base$", "hc_head.hc_base"), (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"), (r"\.hc_attn_base$", ".attn_hc.base"), (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"), (r"\.hc_ffn_base$", ".ffn_hc.base"), (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."), (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
)]


_MTP = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.*)$")
_MTP_OWN = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")  # MTPBlock's own, beside its block


def canonical_v4_name(name: str) -> str:
    """HF's module name of a V4 tensor named either way (see the module docstring); an MTP block's tensors as
    `mtp.{j}.` and its own name or a layer's canonical name inside the layer."""
    m = _MTP.match(name)
    if m:
        j, rest = m.groups()
        if rest.startswith(_MTP_OWN):
            return f"mtp.{j}.{rest}"
        return f"mtp.{j}." + canonical_v4_name(f"layers.0.{rest}")[len("model.layers.0."):]
    bare = name[len("model."):] if name.startswith("model.") else name
    for pat, rep in _RENAMES:
        bare = pat.sub(rep, bare)
    return bare if bare.startswith(("lm_head.", "mtp.")) else "model." + bare


def _identity(w: np.ndarray) -> np.ndarray:
    return w


def _t(w: np.ndarray) -> np.ndarray:
    """[out, in] -> [in, out]."""
    return w.T


def _heads_in(h: int, d: int) -> Any:
    """[h*d, in] -> [in, h, d] (q_b_proj, the indexer's q_b_proj)."""
    return lambda w: w.T.reshape(w.shape[1], h, d)


def _fused_gate_up(w: np.ndarray) -> np.ndarray:
    """HF v5 experts.gate_up_proj [E, 2I, D] (gate rows first) -> [E, D, 2, I]."""
    E, two_i, D = w.shape
    return w.reshape(E, 2, two_i // 2, D).transpose(0, 3, 1, 2)


def _fused_down(w: np.ndarray) -> np.ndarray:
    """HF v5 experts.down_proj [E, D, I] -> [E, I, D]."""
    return w.transpose(0, 2, 1)


def _grouped_out(g: int, r: int) -> Any:
    """o_a_proj [g*r, H*hd/g] (group-major rows) -> [g, H*hd/g, r]."""
    return lambda w: w.reshape(g, r, w.shape[1]).transpose(0, 2, 1)


def _pool_rules(pre: str, path: tuple, width: int, series: int, rate: int, D: int) -> list[TensorRule]:
    return [
        TensorRule(f"{pre}.kv_proj.weight", (series * width, D), path + ("kv_proj",), (), _t, False),
        TensorRule(f"{pre}.gate_proj.weight", (series * width, D), path + ("gate_proj",), (), _t, False),
        TensorRule(f"{pre}.position_bias", (rate, series * width), path + ("position_bias",), (), _identity, False),
        TensorRule(f"{pre}.kv_norm.weight", (width,), path + ("kv_norm",), (), _identity, False),
    ]


def v4_layer_rules(cfg: V4Config, i: int, fused: bool = True, pre: str | None = None,
                   lp: tuple | None = None) -> list[TensorRule]:
    """Rules of layer `i`; `fused`: its routed experts are stored as HF v5's fused 3-D tensors, else
    one gate / up / down matrix per expert. `pre` / `lp`: another name prefix and param path (an MTP block)."""
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    Rq, g, r, n = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult
    E, I, V, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.vocab_size, cfg.num_experts_per_tok
    pre, lp = pre or f"model.layers.{i}", lp or ("layers", i)
    a, sa = lp + ("attn",), f"{pre}.self_attn"
    rules = [
        TensorRule(f"{pre}.input_layernorm.weight", (D,), lp + ("input_layernorm",), (), _identity, False),
        TensorRule(f"{pre}.post_attention_layernorm.weight", (D,), lp + ("post_attention_layernorm",), (), _identity, False),
    ]
    for site in ("attn_hc", "ffn_hc"):
        rules += [
            TensorRule(f"{pre}.{site}.fn", ((2 + n) * n, n * D), lp + (site, "fn"), (), _t, False),
            TensorRule(f"{pre}.{site}.base", ((2 + n) * n,), lp + (site, "base"), (), _identity, False),
            TensorRule(f"{pre}.{site}.scale", (3,), lp + (site, "scale"), (), _identity, False),
        ]
    rules += [
        TensorRule(f"{sa}.q_a_proj.weight", (Rq, D), a + ("q_a_proj",), (), _t),
        TensorRule(f"{sa}.q_a_norm.weight", (Rq,), a + ("q_a_norm",), (), _identity, False),
        TensorRule(f"{sa}.q_b_proj.weight", (H * hd, Rq), a + ("q_b_proj",), (), _heads_in(H, hd)),
        TensorRule(f"{sa}.kv_proj.weight", (hd, D), a + ("kv_proj",), (), _t),
        TensorRule(f"{sa}.kv_norm.weight", (hd,), a + ("kv_norm",), (), _identity, False),
        TensorRule(f"{sa}.sinks", (H,), a + ("sinks",), (), _identity, False),
        TensorRule(f"{sa}.o_a_proj.weight", (g * r, H * hd // g), a + ("o_a_proj",), (), _grouped_out(g, r)),
        TensorRule(f"{sa}.o_b_proj.weight", (D, g * r), a + ("o_b_proj",), (), _t),
    ]
    lt = cfg.attn_type(i)
    if lt != SLIDING:
        rules += _pool_rules(f"{sa}.compressor", a + ("compressor",), hd, 2 if lt == CSA else 1, cfg.compress_rate(lt), D)
    if lt == CSA:
        di, nI, ip = cfg.index_head_dim, cfg.index_n_heads, a + ("indexer",)
        rules += _pool_rules(f"{sa}.compressor.indexer", ip, di, 2, cfg.compress_rate(CSA), D)
        rules += [
            TensorRule(f"{sa}.compressor.indexer.q_b_proj.weight", (nI * di, Rq), ip + ("q_b_proj",), (), _heads_in(nI, di), False),
            TensorRule(f"{sa}.compressor.indexer.scorer.weights_proj.weight", (nI, D), ip + ("weights_proj",), (), _t, False),
        ]
    m = lp + ("moe",)
    rules.append(TensorRule(f"{pre}.mlp.gate.weight", (E, D), m + ("gate",), (), _t, False))
    if cfg.mlp_type(i) == "hash_moe":
        rules.append(TensorRule(f"{pre}.mlp.gate.tid2eid", (V, k), m + ("tid2eid",), (), _identity, False))
    else:
        rules.append(TensorRule(f"{pre}.mlp.gate.e_score_correction_bias", (E,), m + ("e_score_correction_bias",), (), _identity, False))
    ex = m + ("experts",)
    if fused:
        rules += [
            TensorRule(f"{pre}.mlp.experts.gate_up_proj", (E, 2 * I, D), ex + ("gate_up",), (), _fused_gate_up),
            TensorRule(f"{pre}.mlp.experts.down_proj", (E, D, I), ex + ("down",), (), _fused_down),
        ]
    else:
        for e in range(E):
            ep = f"{pre}.mlp.experts.{e}"
            rules += [
                TensorRule(f"{ep}.gate_proj.weight", (I, D), ex + ("gate_up",), (e, slice(None), 0), _t),
                TensorRule(f"{ep}.up_proj.weight", (I, D), ex + ("gate_up",), (e, slice(None), 1), _t),
                TensorRule(f"{ep}.down_proj.weight", (D, I), ex + ("down",), (e,), _t),
            ]
    rules += [
        TensorRule(f"{pre}.mlp.shared_experts.gate_proj.weight", (I, D), m + ("shared", "gate_up"), (slice(None), 0), _t),
        TensorRule(f"{pre}.mlp.shared_experts.up_proj.weight", (I, D), m + ("shared", "gate_up"), (slice(None), 1), _t),
        TensorRule(f"{pre}.mlp.shared_experts.down_proj.weight", (D, I), m + ("shared", "down"), (), _t),
    ]
    return rules


def v4_expected_tensors(cfg: V4Config, fused_layers: frozenset[int] = frozenset()) -> list[TensorRule]:
    D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    rules = [
        TensorRule("model.embed_tokens.weight", (V, D), ("embed",), (), _identity, False),
        TensorRule("model.norm.weight", (D,), ("final_norm",), (), _identity, False),
        TensorRule("model.hc_head.hc_fn", (n, n * D), ("hc_head", "fn"), (), _t, False),
        TensorRule("model.hc_head.hc_base", (n,), ("hc_head", "base"), (), _identity, False),
        TensorRule("model.hc_head.hc_scale", (1,), ("hc_head", "scale"), (), _identity, False),
    ]
    lm_src = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    rules.append(TensorRule(lm_src, (V, D), ("lm_head",), (), _t, False))
    for i in range(cfg.num_hidden_layers):
        rules += v4_layer_rules(cfg, i, i in fused_layers)
    for j in range(cfg.num_nextn_predict_layers):
        rules += v4_mtp_rules(cfg, j, cfg.num_hidden_layers + j in fused_layers)
    return rules


def v4_mtp_rules(cfg: V4Config, j: int, fused: bool) -> list[TensorRule]:
    """MTP layer j: its own tensors (e_proj / h_proj may be FP8 as released) and its block, layer L + j's rules."""
    D, n, pre, mp = cfg.hidden_size, cfg.hc_mult, f"mtp.{j}", ("mtp", j)
    rules = [TensorRule(f"{pre}.{k}.weight", (D,), mp + (k,), (), _identity, False) for k in ("enorm", "hnorm", "norm")]
    rules += [TensorRule(f"{pre}.{k}.weight", (D, D), mp + (k,), (), _t) for k in ("e_proj", "h_proj")]
    rules += [
        TensorRule(f"{pre}.hc_head_fn", (n, n * D), mp + ("hc_head", "fn"), (), _t, False),
        TensorRule(f"{pre}.hc_head_base", (n,), mp + ("hc_head", "base"), (), _identity, False),
        TensorRule(f"{pre}.hc_head_scale", (1,), mp + ("hc_head", "scale"), (), _identity, False),
    ]
    return rules + v4_layer_rules(cfg, cfg.num_hidden_layers + j, fused, pre, mp + ("layer",))


def mtp_layers_on_disk(names) -> int:
    """MTP blocks (`mtp.{j}.*`) the tensor names hold: the count of leading j with a tensor."""
    present = {int(m.group(1)) for n in names if (m := _MTP.match(n))}
    j = 0
    while j in present:
        j += 1
    return j


def v4_checkpoint_config(cfg: Any, model_dir: str) -> Any:
    """`cfg` (a ModelConfig of deepseek_v4, or its V4Config) with num_nextn_predict_layers what the files hold: a
    config that declares MTP layers whose tensors are absent (HF's save_pretrained drops them) loads without
    them, and speculative decoding with MTP is then refused."""
    v4 = getattr(cfg, "v4", None) or cfg
    if not v4.num_nextn_predict_layers:
        return cfg
    n = min(v4.num_nextn_predict_layers, mtp_layers_on_disk(index_checkpoint(model_dir)))
    if n == v4.num_nextn_predict_layers:
        return cfg
    log.info("config names %d MTP layer(s) but the checkpoint has %d; loading without them",
             v4.num_nextn_predict_layers, n)
    v4 = dataclasses.replace(v4, num_nextn_predict_layers=n)
    return v4 if cfg is v4 or not hasattr(cfg, "v4") else dataclasses.replace(cfg, v4=v4, num_nextn_predict_layers=n)


def v4_is_ignored(name: str) -> bool:
    """Tensors HF's DeepseekV4ForCausalLM does not load either: the MTP block and rotary buffers."""
    return name.startswith(("mtp.", "model.mtp.")) or name.endswith("inv_freq")


_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj$")


def check_v4_checkpoint(model_dir: str, cfg: V4Config) -> tuple[dict[str, TensorInfo], list[TensorRule],
                                                                 dict[str, str], dict[tuple, str], V4Quant | None]:
    """(tensors by HF name, the rules, each rule tensor's stored kind, the quantized leaves' kinds, the format)
    of a V4 directory, every needed tensor checked (a missing, misshapen or unknown one is named), from the
    headers alone."""
    with open(os.path.join(model_dir, "config.json")) as f:
        quant = v4_quant_config(json.load(f))
    tensors: dict[str, TensorInfo] = {}
    for name, info in index_checkpoint(model_dir).items():
        canon = canonical_v4_name(name)
        if canon in tensors:
            raise CheckpointError(f"checkpoint names tensor {canon} twice (as {tensors[canon].name} and {name})")
        tensors[canon] = info
    tensors = scale_aliases(tensors)
    fused = frozenset(int(m.group(1)) for n in tensors if (m := _FUSED.match(n)))
    rules = v4_expected_tensors(cfg, fused)
    known = {r.hf_name for r in rules} | {r.hf_name + "_scale_inv" for r in rules}
    kinds = {}
    for rule in rules:
        info = tensors.get(rule.hf_name)
        if info is None:
            raise CheckpointError(f"checkpoint is missing tensor {rule.hf_name} (HF's name)")
        allowed = INT_DTYPES if rule.hf_name.endswith("tid2eid") else FLOAT_DTYPES
        kinds[rule.hf_name] = "float" if info.dtype in allowed else stored_kind(rule, info)
        if kinds[rule.hf_name] != "float":
            check_quantized(rule, info, tensors, quant)
            continue
        if info.shape != rule.hf_shape:
            raise CheckpointError(f"tensor {rule.hf_name} has shape {info.shape}, expected {rule.hf_shape}")
        if info.dtype not in allowed:
            raise CheckpointError(f"tensor {rule.hf_name} has dtype {info.dtype}; expected one of {allowed}")
    extra = sorted(n for n in tensors if n not in known and not v4_is_ignored(n))
    if extra:
        raise CheckpointError(f"checkpoint has {len(extra)} tensor(s) the V4 name table does not know, e.g. {extra[0]}")
    return tensors, rules, kinds, leaf_kinds(rules, kinds), quant


def load_v4_checkpoint(model_dir: str, dtype: Any = jnp.float32, cfg: V4Config | None = None,
                       on_host: bool = False, quantization: str | None = None) -> tuple[V4Config, Any]:
    """(config, params) of an HF-saved DeepSeek-V4 directory; every needed tensor is checked first and
    an unexpected one (a name this table does not know) is an error, so a renamed layout fails loudly.
    `quantization` None / "auto": FP8 / FP4 tensors kept (weights/v4_native.py); "none": dequantized to `dtype`.
    `on_host`: the params as numpy arrays (the converter's), else on the default device."""
    cfg = v4_checkpoint_config(cfg or V4Config.from_model_dir(model_dir), model_dir)
    tensors, rules, kinds, leaves, quant = check_v4_checkpoint(model_dir, cfg)
    keep = quantization in (None, "auto")
    specs = v4_param_specs(cfg)
    host: dict = _alloc(specs, dtype)
    packed: dict[tuple, tuple] = {}
    if keep:
        for path, kind in leaves.items():
            qs, qd, ss, sd, make = leaf_shapes(kind, path, _leaf(specs, path).shape, quant)
            packed[path] = (np.zeros(qs, qd), np.zeros(ss, sd), make)
    for rule in rules:
        kind = kinds[rule.hf_name]
        if kind != "float" and keep:
            q, s = read_quantized(rule, tensors, kind)
            qa, sa, _ = packed[rule.path]
            at = quant_index(rule) or Ellipsis
            qa[at], sa[at] = q, s
            continue
        info = tensors[rule.hf_name]
        raw = dequantized(rule, tensors, kind, quant) if kind != "float" else np.asarray(load_tensor(info))
        leaf = _leaf(host, rule.path)
        value = rule.transform(raw)
        if rule.hf_name.endswith("tid2eid") and (value.min() < 0 or value.max() >= cfg.n_routed_experts):
            raise CheckpointError(f"tensor {rule.hf_name} names experts outside 0..{cfg.n_routed_experts - 1}")
        if rule.index:
            leaf[rule.index] = value
        else:
            leaf[...] = value
    for path, (qa, sa, make) in packed.items():
        _leaf(host, path[:-1])[path[-1]] = make(qa, sa)
    return cfg, (host if on_host else _to_device(host))


def v4_abstract(model_dir: str, cfg: V4Config, abstract: Any, quantization: str | None = None) -> Any:
    """The float params' abstract tree (`abstract`, from the specs) with the leaves `load_v4_checkpoint` keeps
    quantized as Fp8Weight / Fp4Weight of ShapeDtypeStructs (their shardings the float leaf's, a mesh layout's
    mapped onto their packed arrays: sharding/packed.py)."""
    from deepinfer_jax.weights.v4_native import abstract_leaf

    if quantization not in (None, "auto"):
        return abstract
    cfg = v4_checkpoint_config(cfg, model_dir)
    _, _, _, leaves, quant = check_v4_checkpoint(model_dir, cfg)
    specs = v4_param_specs(cfg)
    for path, kind in leaves.items():
        leaf = _leaf(abstract, path)
        _leaf(abstract, path[:-1])[path[-1]] = abstract_leaf(kind, path, leaf.shape, quant, leaf.sharding,
                                                             _leaf(specs, path).axes)
    return abstract


def v4_shared_block(model_dir: str, cfg: Any, quantization: str | None = None) -> tuple[int, int] | None:
    """The FP8 weight_block_size of the shared experts as `load_v4_checkpoint` keeps them (one stored in FP8 and
    `quantization` None / "auto"), else None (float: a converted directory, a bf16 checkpoint, "none", or a directory
    without weights, whose dummy weights are float); from the headers alone. sharding/rules.py v4_splits_shared
    splits them over the tensor axis only on whole blocks."""
    from deepinfer_jax.weights.orbax_io import is_converted

    if (quantization not in (None, "auto") or is_converted(model_dir)
            or not any(f.endswith(".safetensors") for f in os.listdir(model_dir))):
        return None
    cfg = v4_checkpoint_config(getattr(cfg, "v4", None) or cfg, model_dir)
    _, _, _, leaves, quant = check_v4_checkpoint(model_dir, cfg)
    kept = any(path[-2] == "shared" and kind == "fp8" for path, kind in leaves.items())
    return tuple(quant.block) if kept and quant is not None else None


def _alloc(spec: Any, dtype: Any) -> Any:
    if is_spec(spec):
        dt = np.dtype(jnp.dtype(dtype)) if spec.dtype == "model" else np.dtype(spec.dtype)
        return np.zeros(spec.shape, dt)
    if isinstance(spec, dict):
        return {k: _alloc(v, dtype) for k, v in spec.items()}
    return [_alloc(v, dtype) for v in spec]


def _leaf(tree: Any, path: tuple) -> np.ndarray:
    for k in path:
        tree = tree[k]
    return tree


def _to_device(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_device(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_device(v) for v in tree]
    if dataclasses.is_dataclass(tree):  # an Fp8Weight / Fp4Weight
        return dataclasses.replace(tree, q=jnp.asarray(tree.q), scale=jnp.asarray(tree.scale))
    return jnp.asarray(tree)
