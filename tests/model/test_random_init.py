"""Random weights for benchmarks and --load-format dummy: leaf i is uniform from fold_in(key(seed), i)
at a realistic scale (BENCHMARKS.md: weights too small collapse MoE routing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import is_spec, param_specs
from deepinfer_jax.weights.random_init import random_params


def test_random_params_leaves_and_ranges():
    import os

    cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models",
                                                  "tiny-deepseek-v3.json"))
    params = random_params(cfg, jnp.bfloat16, seed=7)
    paths = jax.tree.flatten_with_path(param_specs(cfg), is_leaf=is_spec)[0]
    leaves = jax.tree.leaves(params)
    assert len(leaves) == len(paths)
    key = jax.random.key(7)
    for i, ((path, spec), leaf) in enumerate(zip(paths, leaves)):
        name = jax.tree_util.keystr(path)
        assert leaf.shape == spec.shape
        lo, hi = (0.9, 1.1) if "norm" in name else (0.0, 0.1) if "e_score_correction_bias" in name else (-0.05, 0.05)
        x = np.asarray(leaf, np.float32)
        eps = 0.01 * (hi - lo)  # bf16 rounds the bounds
        assert lo - eps <= x.min() and x.max() <= hi + eps and x.std() > (hi - lo) / 5, name
        if i in (0, len(leaves) - 1):  # the drawing is independent of batching: leaf i = its own key
            want = jax.random.uniform(jax.random.fold_in(key, i), spec.shape, leaf.dtype, lo, hi)
            np.testing.assert_array_equal(x, np.asarray(want, np.float32))
    again = random_params(cfg, jnp.bfloat16, seed=7)
    other = random_params(cfg, jnp.bfloat16, seed=8)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)))
    assert not np.array_equal(jax.tree.leaves(params)[0], jax.tree.leaves(other)[0])


def test_v4_random_params_hash_table_names_experts():
    """DeepSeek-V4's dummy weights: every leaf of the family's specs, the hash routing table int32 expert ids."""
    from hf_models_v4 import V4_TINY

    from deepinfer_jax.models.registry import param_specs as family_specs

    one_layer = dict(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["hash_moe"])
    cfg = ModelConfig.from_hf_dict(dict(V4_TINY, model_type="deepseek_v4", **one_layer))  # few leaves to compile
    params = random_params(cfg, jnp.float32, seed=3)
    specs = jax.tree.leaves(family_specs(cfg), is_leaf=is_spec)
    assert [x.shape for x in jax.tree.leaves(params)] == [s.shape for s in specs]
    tables = [lp["moe"]["tid2eid"] for lp in params["layers"] if "tid2eid" in lp["moe"]]
    assert len(tables) == 1
    for t in tables:
        assert t.dtype == jnp.int32 and int(t.min()) >= 0 and int(t.max()) < cfg.n_routed_experts
        assert len(np.unique(np.asarray(t))) > 1
