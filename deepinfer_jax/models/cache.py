"""The paged latent KV cache and the metadata of one ragged step.

Layout: `kv_cache[num_layers, num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`: per layer and
token the normalised latent c_kv followed by the roped k_pe. Page 0 is the *null page*: the scheduler
never hands it to a sequence; padding tokens write into it and padded page-table entries point at it.

A ragged step flattens the scheduled tokens of S sequences into T slots (T and S padded to buckets).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig

NULL_PAGE = 0


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
    return (cfg.num_hidden_layers, num_pages, page_size, cfg.kv_cache_dim)


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
    return cfg.num_hidden_layers * page_size * cfg.kv_cache_dim * jnp.dtype(dtype).itemsize


E4M3_MAX = 448.0


def to_cache_dtype(latent: jax.Array, dtype) -> jax.Array:
    """Latents as the cache stores them: a cast, saturating at e4m3's +-448 for an FP8 cache (scale 1.0; an
    out-of-range value would otherwise become NaN, e4m3fn having no infinity)."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        latent = jnp.clip(latent, -E4M3_MAX, E4M3_MAX)
    return latent.astype(dtype)


def write_slots(kv_cache: jax.Array, layer, slot_mapping: jax.Array, rows: jax.Array) -> jax.Array:
    """rows [T, *row] into their cache slots `slot_mapping` [T] (page * page_size + offset) of layer `layer` of
    kv_cache [L, P, page_size, *row], cast to the cache's dtype.

    Declared unique: every real token of a step has a slot of its own, and the padding tokens' repeated slots lie
    on the null page, which no one reads. XLA then writes the rows in parallel, where a scatter that may meet
    duplicates ran at a sixth of the speed (benchmarks/kv_write.py)."""
    page_size = kv_cache.shape[2]
    return kv_cache.at[layer, slot_mapping // page_size, slot_mapping % page_size].set(
        rows.astype(kv_cache.dtype), unique_indices=True)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16) -> jax.Array:
    return jnp.zeros(kv_cache_shape(cfg, num_pages, page_size), dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Where each flattened token sits and where its sequence's cache lives.

    token_ids [T], positions [T]: absolute position of each token in its sequence.
    seq_ids [T]: row of `page_table` the token belongs to (padding tokens: any valid row).
    slot_mapping [T]: flat cache slot page * page_size + offset the token's latent is written to
        (padding tokens: a slot of the null page).
    page_table [S, max_pages]: the pages of each sequence in order, padded with the null page.
    logits_indices [S]: index into T of the token whose logits each sequence samples from.
    has_context: static (pytree metadata, part of a step program's key): whether some sequence of the step
        has cached tokens before its first one here (a later chunk, a prefix-cache hit, a decode), as the
        host knows it; None: not given, and a prefill-bucket step decides on the device
        (models/mla_split.py attend_split). False is exact: no token of the step may see a cached key.
    groups: a per-group cache (DeepSeek-V4, models/v4_paged.py): per cache group (page_table [S, pages],
        slot_mapping [T]), the group's pages of each sequence and the row slot each token writes; None otherwise.
    next_token_ids [S] or None: with MTP speculation only (models/mtp.py mtp_propose), per sequence row the token
        after its last slot where the host knows it (a prefill chunk that does not sample), -1 where the row
        samples it, -2 for a padding row.
    """

    token_ids: jax.Array
    positions: jax.Array
    seq_ids: jax.Array
    slot_mapping: jax.Array
    page_table: jax.Array
    logits_indices: jax.Array
    has_context: bool | None = dataclasses.field(default=None, metadata=dict(static=True))
    groups: tuple | None = None
    next_token_ids: jax.Array | None = None
