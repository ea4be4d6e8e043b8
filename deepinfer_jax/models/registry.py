"""The model registry: HF `model_type` -> the family module that serves it.

config.py's `MODEL_FAMILIES` names each supported model_type's family (config parsing lives there, JAX-free);
this module maps a family to its code: param specs with logical axes, the pure forward, the paged forward,
the KV cache layout, and which `forward_paged` switches of RunnerConfig it takes. The HF name table is
weights/name_table.py's, keyed by the same family. Adding a family: a model module, its entries here and in
MODEL_FAMILIES, its name rules, and parity tests (docs/models.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax.numpy as jnp

from deepinfer_jax.config import FORWARD_SWITCHES, MODEL_FAMILIES, ModelConfig


@dataclass(frozen=True)
class ModelFamily:
    name: str
    param_specs: Callable[[ModelConfig], Any]
    forward: Callable  # (params, cfg, token_ids [B, S], *, attention_mask) -> logits [B, S, V]
    forward_paged: Callable  # (params, cfg, kv_cache, meta, *, moe_impl, attn_impl, ...) -> (logits, cache)
    kv_cache_shape: Callable[[ModelConfig, int, int], tuple[int, ...]]
    forward_switches: tuple[str, ...]  # RunnerConfig.forward_switches() names its forward_paged takes
    attn_impls: tuple[str, ...]  # the attn_impl values its forward_paged serves

    def splits_prefill_attention(self, cfg: ModelConfig, attn_impl: str, mesh_rules, prefill_attention: str) -> bool:
        """Whether prefill steps carry StepMetadata.has_context (models/deepseek.py; no other family uses it)."""
        if self.name != "deepseek":
            return False
        from deepinfer_jax.models.mla_split import splits_prefill_attention

        return splits_prefill_attention(cfg, attn_impl, mesh_rules, prefill_attention)


def _deepseek() -> ModelFamily:
    from deepinfer_jax.models import cache, deepseek, params

    return ModelFamily("deepseek", params.param_specs, deepseek.forward, deepseek.forward_paged,
                       cache.kv_cache_shape, FORWARD_SWITCHES,
                       ("reference", "pallas", "pallas_interpret"))


def _dense() -> ModelFamily:
    from deepinfer_jax.models import dense

    return ModelFamily("dense", dense.param_specs, dense.forward, dense.forward_paged, dense.kv_cache_shape,
                       ("decode_projection_kernel",), dense.ATTN_IMPLS)


def _deepseek_v4() -> ModelFamily:
    from deepinfer_jax.models import v4_paged

    return ModelFamily("deepseek_v4", v4_paged.param_specs, v4_paged.forward, v4_paged.forward_paged,
                       v4_paged.kv_cache_shape, (), v4_paged.ATTN_IMPLS)


_BUILDERS = {"deepseek": _deepseek, "dense": _dense, "deepseek_v4": _deepseek_v4}
_FAMILIES: dict[str, ModelFamily] = {}


def family(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        _FAMILIES[name] = _BUILDERS[name]()
    return _FAMILIES[name]


def family_of(cfg: ModelConfig) -> ModelFamily:
    return family(cfg.family)


def param_specs(cfg: ModelConfig) -> Any:
    """The params tree of `cfg`'s family: ParamSpec leaves (shape, dtype, logical axes)."""
    return family_of(cfg).param_specs(cfg)


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, ...]:
    """The family's KV cache layout; every family's is [L, num_pages, page_size, ...]."""
    return family_of(cfg).kv_cache_shape(cfg, num_pages, page_size)


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    return math.prod(kv_cache_shape(cfg, 1, page_size)) * jnp.dtype(dtype).itemsize


def init_kv_cache(cfg: ModelConfig, num_pages: Any, page_size: int, dtype=jnp.bfloat16) -> Any:
    """The zero cache: one array, or for a per-group cache (`num_pages` a config_v4.CachePools) one per pool."""
    shape = kv_cache_shape(cfg, num_pages, page_size)
    if shape and isinstance(shape[0], tuple):
        return tuple(jnp.zeros(s, dtype) for s in shape)
    return jnp.zeros(shape, dtype)


def supported_models() -> dict[str, tuple[str, str]]:
    """model_type -> (family, HF architecture), every type the engine serves."""
    return dict(MODEL_FAMILIES)
