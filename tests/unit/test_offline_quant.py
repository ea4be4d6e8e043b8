"""benchmarks/offline.py --quantization: Protocol A's weights drawn in FP8 / INT8 / INT4 on the device are the formats
the engine keeps such checkpoints in, each leaf of the float model's logical shape, its values spread over the float
dummy's range (about U(-0.05, 0.05) once dequantized), and the float leaves (norms, router, embeddings) untouched."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.offline import quantized_params
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import is_spec
from deepinfer_jax.models.quant import dequantize, is_quantized
from deepinfer_jax.models.registry import param_specs
from deepinfer_jax.weights.random_init import random_params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("method", ["fp8", "int8", "int4"])
def test_quantized_protocol_a_weights(method):
    cfg = ModelConfig.from_json_file(os.path.join(ROOT, "configs", "models", "tiny-deepseek-v2.json"))
    floats = random_params(cfg, jnp.bfloat16, seed=0)
    params = quantized_params(cfg, None if method == "fp8" else floats, method, jnp.bfloat16)
    specs = jax.tree.flatten_with_path(param_specs(cfg), is_leaf=is_spec)[0]
    leaves = jax.tree.flatten_with_path(params, is_leaf=is_quantized)[0]
    assert [jax.tree_util.keystr(p) for p, _ in specs] == [jax.tree_util.keystr(p) for p, _ in leaves]
    quantized = 0
    for (path, spec), (_, leaf) in zip(specs, leaves):
        if not is_quantized(leaf):
            assert leaf.shape == tuple(spec.shape), jax.tree_util.keystr(path)
            continue
        quantized += 1
        w = np.asarray(dequantize(leaf, jnp.float32))
        assert w.shape == tuple(spec.shape), jax.tree_util.keystr(path)
        assert np.abs(w).max() <= 0.0505 and w.std() > 0.01, (jax.tree_util.keystr(path), np.abs(w).max(), w.std())
    names = {jax.tree_util.keystr(p) for p, leaf in leaves if is_quantized(leaf)}
    assert quantized and any("experts" in n for n in names) and any("o_proj" in n for n in names)
    assert not any("norm" in n or "gate" == n.split("'")[-2] for n in names)
