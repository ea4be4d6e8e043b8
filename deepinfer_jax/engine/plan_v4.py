"""`deepinfer plan`'s DeepSeek-V4 parts (engine/plan.py): the weights' bytes as the checkpoint stores them and the
per-group cache pools the engine makes."""

from __future__ import annotations

import math


def v4_weight_bytes(cfg, dtype: str, model_dir: str | None = None, quantization: str | None = None,
                    by_leaf: dict | None = None, parallel=None) -> tuple[int, str]:
    """(bytes of a DeepSeek-V4 model's params on its one device, the weights' format): the loader's own abstract
    tree of an HF directory (FP8 / FP4 leaves as the checkpoint stores them, weights/name_table_v4.py `v4_abstract`),
    else the family's float param specs in `dtype`. `by_leaf`: filled with each leaf's bytes by path (a quantized
    leaf's arrays together). `parallel` (a ParallelConfig): a layout that would cut a kept leaf's scale blocks is
    refused as the loader refuses it (`check_packed_splits`)."""
    import jax
    import numpy as np

    from deepinfer_jax.models.quant import is_fp8
    from deepinfer_jax.models.quant_fp4 import is_fp4
    from deepinfer_jax.runner.weight_offload import path_key
    from deepinfer_jax.weights.pending import abstract_from_specs

    if model_dir is not None:  # the MTP layers the files hold
        from deepinfer_jax.weights.name_table_v4 import v4_checkpoint_config

        cfg = v4_checkpoint_config(cfg, model_dir)
    abstract = abstract_from_specs(cfg, jax.numpy.dtype(dtype))
    if model_dir is not None:
        from deepinfer_jax.weights.name_table_v4 import v4_abstract

        abstract = v4_abstract(model_dir, cfg.v4, abstract, quantization)

    def quantized(x):
        return is_fp8(x) or is_fp4(x)

    flat = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=quantized)[0]
    if parallel is not None and not parallel.is_single_device:
        check_packed_splits(cfg, parallel, [(path_key(p), x) for p, x in flat if quantized(x)])
    sizes = {path_key(p): sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(x))
             for p, x in flat}
    if by_leaf is not None:
        by_leaf.update(sizes)
    kinds = sorted({"fp4" if is_fp4(x) else "fp8" for _, x in flat if quantized(x)})
    return sum(sizes.values()), " + ".join(f"{k} (kept)" for k in kinds) or "float"


def check_packed_splits(cfg, parallel, leaves: list) -> None:
    """A ValueError, the loader's own (sharding/packed.py packed_sharding), where `parallel`'s layout (v4_rules)
    would split a kept FP8 / FP4 leaf (`leaves`: (path, leaf) pairs) through a scale block."""
    import jax
    from jax.sharding import AbstractMesh, NamedSharding

    from deepinfer_jax.models.parallel import logical_to_spec
    from deepinfer_jax.models.params import is_spec
    from deepinfer_jax.models.registry import param_specs
    from deepinfer_jax.runner.weight_offload import path_key
    from deepinfer_jax.sharding.mesh import AXES
    from deepinfer_jax.sharding.packed import packed_sharding
    from deepinfer_jax.sharding.rules import v4_rules

    specs = {path_key(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=is_spec)[0]}
    mesh = AbstractMesh((parallel.data_parallel_size, parallel.tensor_parallel_size), AXES)
    from deepinfer_jax.models.quant import is_fp8

    shared = next((tuple(w.block) for path, w in leaves if path[-2] == "shared" and is_fp8(w)), None)
    rules = v4_rules(parallel, cfg, shared)  # the shared expert split on whole blocks only (v4_splits_shared)
    for path, w in leaves:
        axes = specs[path].axes
        packed_sharding(w, NamedSharding(mesh, logical_to_spec(axes, rules)), axes, ".".join(map(str, path)))


def v4_groups(cfg, page_size: int, sched, runner, cache: int | None) -> tuple[tuple[dict, ...], int | None, int]:
    """DeepSeek-V4's cache groups for `plan` -> (a dict per group, the tokens of context the pools hold and the pools'
    bytes, or None and 0). With
    `cache` (the KV cache's bytes on the device) the pools are those the engine makes of them (`pages_for_memory`'s
    pages, then runner/device_memory.v4_pools)."""
    import jax.numpy as jnp

    from deepinfer_jax.config_v4 import v4_cache_groups, v4_group_page_bytes, v4_pool_bytes
    from deepinfer_jax.models.registry import kv_cache_bytes_per_page
    from deepinfer_jax.runner.device_memory import v4_pools

    item = jnp.dtype(runner.kv_dtype).itemsize
    pools = None
    if cache is not None:
        num_pages = cache // kv_cache_bytes_per_page(cfg, page_size, runner.kv_dtype)
        pools = v4_pools(cfg, num_pages, "sized by memory", page_size, sched, runner)[0]
    out = []
    for gi, g in enumerate(v4_cache_groups(cfg.v4, item)):
        d = dict(name=g.name, layers=len(g.layers), row_bytes=g.row_bytes, tokens_per_row=g.tokens_per_row,
                 window=g.window_tokens, page_size=g.rows_per_page(page_size))  # the state groups' own page size
        if g.window_tokens is None:
            d["bytes_per_token"] = v4_group_page_bytes(g, page_size) / d["page_size"] / g.tokens_per_row
        else:
            d["bytes_per_sequence"] = g.window_tokens * g.row_bytes * len(g.layers)
        if pools is not None:
            k = pools.pool_of[gi]
            d.update(pool_pages=pools.pool_pages[k], pool_bytes=v4_pool_bytes(pools)[k])
        out.append(d)
    if pools is None:
        return tuple(out), None, 0
    return tuple(out), pools.context_tokens, sum(v4_pool_bytes(pools))
