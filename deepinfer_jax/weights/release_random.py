"""Random DeepSeek weights in the formats DeepSeek releases them (load_format "dummy" on a release config).

A config.json with V4's `quantization_config` (weights/v4_native.py) names a release: FP8 block-scaled attention
and shared-expert linears, routed experts FP4 (`expert_dtype` "fp4") or FP8. The dummy load then draws those
leaves packed, as `load_v4_checkpoint` keeps a release's (Fp8Weight / Fp4Weight of the same shapes, dtypes and
placements), so the same kernels run as on the real checkpoint and the device holds the release's bytes; the
float leaves are `random_params`' draws. Which leaves a release stores quantized (`release_leaves`) is what
DeepSeek's V4 checkpoints hold: wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b, the shared expert's w1 / w2 /
w3 and MTP's e_proj / h_proj in FP8; the routed experts in `expert_dtype`.

The MLA family (V2 / V3 / V3.2) likewise: a config.json whose `quantization_config` has quant_method "fp8" (DeepSeek's
V3 and V3.2 releases: every projection of every layer in e4m3 with `weight_scale_inv` blocks of
`weight_block_size`, the router, norms, embeddings, lm_head and the indexer's weights_proj in bf16) draws the
leaves the loader keeps as Fp8Weight from such a checkpoint (`fp8_release_leaves`: hf_loader's own choice).

Values keep the float dummy's scale (|w| up to about `scale`): FP8 codes ~ U(-1, 1) with block scales
~ U(scale / 2, scale); FP4 codes are uniform bytes (every e2m1 value is finite) with e8m0 scales 2 ** -7 or
2 ** -6, so |w| <= 6 * 2 ** -6 ~ 0.09 and typically ~ 0.02.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import is_spec
from deepinfer_jax.models.registry import param_specs
from deepinfer_jax.weights.pending import PendingParams, abstract_from_specs

_ATTN_FP8 = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")
FP4_SCALE_BYTES = (120, 122)  # e8m0 bytes drawn in [lo, hi): scales 2 ** -7 and 2 ** -6
# Elements of an FP8 leaf drawn at once: a larger leaf (a V3 release's stacked routed experts are tens of GB) is
# drawn a slice of its leading axes at a time, so the bf16 draw's temporary is a slice's (256 MiB), not the leaf's.
FP8_DRAW_CHUNK = 1 << 27


@dataclasses.dataclass(frozen=True)
class Fp8Release:
    """What config.json says of an FP8 release of the MLA family (V2 / V3 / V3.2): its weight_block_size (bn rows,
    bk columns)."""
    block: tuple[int, int]


def _key(k: Any) -> Any:
    return getattr(k, "key", getattr(k, "idx", k))


def release_leaves(cfg: ModelConfig, expert_dtype: str) -> dict[tuple, str]:
    """path (dict keys and list indices) -> "fp8" | "fp4" for every params leaf a V4 release stores quantized."""
    out = {}
    for path, _ in jax.tree.flatten_with_path(param_specs(cfg), is_leaf=is_spec)[0]:
        p = tuple(_key(k) for k in path)
        if len(p) >= 2 and p[-2] == "experts":
            out[p] = expert_dtype
        elif ((len(p) >= 2 and p[-2] == "attn" and p[-1] in _ATTN_FP8) or p[-2:] == ("indexer", "q_b_proj")
              or (len(p) >= 2 and p[-2] == "shared") or (p[0] == "mtp" and p[-1] in ("e_proj", "h_proj"))):
            out[p] = "fp8"
    return out


def _draw_packed(kind: str, key: Any, q_shape: tuple, s_shape: tuple, scale: float) -> tuple[jax.Array, jax.Array]:
    """A packed leaf's (q, scale) at the float dummy's magnitude (module docstring)."""
    kq, ks = jax.random.split(key)
    if kind == "fp4":
        return (jax.random.bits(kq, q_shape, jnp.uint8),
                jax.random.randint(ks, s_shape, *FP4_SCALE_BYTES, jnp.int32).astype(jnp.uint8))
    return fp8_codes(kq, q_shape), jax.random.uniform(ks, s_shape, jnp.float32, scale / 2, scale)


def fp8_codes(key: Any, shape: tuple, chunk: int = FP8_DRAW_CHUNK) -> jax.Array:
    """e4m3 codes ~ U(-1, 1) of `shape`; above `chunk` elements a slice of the leading axes at a time (lax.map over
    keys split from `key`), each slice's draw at most `chunk` elements."""
    def one(k, s):
        return jax.random.uniform(k, s, jnp.bfloat16, -1.0, 1.0).astype(jnp.float8_e4m3fn)

    if math.prod(shape) <= chunk:
        return one(key, shape)
    n = next(n for n in range(1, len(shape) + 1) if math.prod(shape[n:]) <= chunk)  # leading axes mapped over
    keys = jax.random.split(key, math.prod(shape[:n]))
    return jax.lax.map(lambda k: one(k, shape[n:]), keys).reshape(shape)


def fp8_release_leaves(cfg: ModelConfig) -> dict[tuple, str]:
    """path -> "fp8" for every params leaf that an FP8 release of the MLA family loads as an Fp8Weight: the loader's
    choice (hf_loader.fp8_leaf_paths) on a checkpoint whose every quantizable tensor is e4m3, as DeepSeek ships V3 and
    V3.2 (a leaf the engine keeps in the model dtype, as the indexer's wq_b / wk, is dequantized by the loader and
    drawn float here)."""
    from deepinfer_jax.weights.hf_loader import FP8_DTYPES, fp8_leaf_paths
    from deepinfer_jax.weights.name_table import expected_tensors
    from deepinfer_jax.weights.safetensors_io import TensorInfo

    rules = expected_tensors(cfg)
    tensors = {r.hf_name: TensorInfo(r.hf_name, "", FP8_DTYPES[0] if r.quantizable else "BF16", r.hf_shape, 0, 0)
               for r in rules}
    return dict.fromkeys(fp8_leaf_paths(rules, tensors, None)[0], "fp8")


def release_random_params(cfg: ModelConfig, abstract: Any, leaves: dict[tuple, str], dtype: Any, seed: int,
                          scale: float) -> Any:
    """The params of `abstract`, every leaf drawn in one jitted program from fold_in(key(seed), i) (leaf i of
    the specs' order): the float ones as `random_params` draws them, the packed ones in their formats."""
    from deepinfer_jax.weights.random_init import draw_leaf, leaf_range

    specs = jax.tree.flatten_with_path(param_specs(cfg), is_leaf=is_spec)[0]
    flat, treedef = jax.tree.flatten_with_path(abstract, is_leaf=dataclasses.is_dataclass)
    plan = []
    for (path, _), (_, a) in zip(specs, flat):
        p = tuple(_key(k) for k in path)
        if p in leaves:
            plan.append((leaves[p], tuple(a.q.shape), tuple(a.scale.shape)))
        else:
            plan.append(("float", tuple(a.shape), jnp.dtype(a.dtype), *leaf_range(cfg, path, scale)))

    def draw(key):
        out = []
        for i, (kind, *rest) in enumerate(plan):
            k = jax.random.fold_in(key, i)
            out.append(draw_leaf(k, *rest) if kind == "float" else _draw_packed(kind, k, *rest, scale))
        return out

    shardings = [(a.q.sharding, a.scale.sharding) if dataclasses.is_dataclass(a) else a.sharding for _, a in flat]
    drawn = jax.jit(draw, out_shardings=shardings)(jax.random.key(seed))
    out = [dataclasses.replace(a, q=x[0], scale=x[1]) if dataclasses.is_dataclass(a) else x
           for (_, a), x in zip(flat, drawn)]
    return jax.tree.unflatten(treedef, out)


def pending_release_params(cfg: ModelConfig, quant: Any, dtype: Any = jnp.bfloat16, seed: int = 0,
                           scale: float = 0.05, shardings: Any = None) -> PendingParams:
    """Random params in the release format `quant` (`release_quant`: a V4 release's weights/v4_native.V4Quant, an MLA
    family FP8 release's Fp8Release), pending (weights/pending.py). Not offered for weights placed in host memory
    (no `load_to`)."""
    from deepinfer_jax.weights.hf_loader import fp8_abstract
    from deepinfer_jax.weights.v4_native import abstract_leaf

    abstract = abstract_from_specs(cfg, jnp.dtype(dtype), shardings)
    specs = param_specs(cfg)
    mla = isinstance(quant, Fp8Release)
    leaves = fp8_release_leaves(cfg) if mla else release_leaves(cfg, quant.expert_dtype)
    for path, kind in leaves.items():
        parent, spec = abstract, specs
        for k in path[:-1]:
            parent, spec = parent[k], spec[k]
        leaf, spec = parent[path[-1]], spec[path[-1]]
        parent[path[-1]] = (fp8_abstract(path, spec, quant.block, leaf.sharding) if mla else
                            abstract_leaf(kind, path, tuple(leaf.shape), quant, leaf.sharding, spec.axes))
    return PendingParams(abstract, load=lambda: release_random_params(cfg, abstract, leaves, dtype, seed, scale))


def release_format(model_dir: str, cfg: ModelConfig) -> Any:
    """`release_quant` of the config.json in `model_dir`."""
    import json
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        return release_quant(json.load(f), cfg)


def release_quant(hf: dict, cfg: ModelConfig) -> Any:
    """The release format of config.json `hf` (its weights drawn packed): a DeepSeek-V4 release's V4Quant, an MLA
    family config with quant_method "fp8" an Fp8Release; None for a float checkpoint or another family."""
    from deepinfer_jax.weights.hf_loader import fp8_block_shape
    from deepinfer_jax.weights.v4_native import v4_quant_config

    if cfg.family == "deepseek_v4":
        return v4_quant_config(hf)
    if cfg.family == "deepseek" and (hf.get("quantization_config") or {}).get("quant_method") == "fp8":
        return Fp8Release(fp8_block_shape(hf))
    return None
