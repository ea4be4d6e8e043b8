"""Loading HF checkpoints: layouts (per-expert, fused v5, sharded), FP8 block scales, and bad input."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from hf_models import read_tensors as _tensors
from hf_models import rewrite_checkpoint as _rewrite
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.weights.hf_loader import dequantize_fp8_blocks, load_hf_checkpoint
from deepinfer_jax.weights.safetensors_io import CheckpointError, index_checkpoint

E4M3_MAX = 448.0


def quantize_fp8_blocks(w: np.ndarray, block=128):
    """Reference block quantizer (as DeepSeek's weights were made): scale = amax / 448 per block."""
    m, n = w.shape
    sm, sn = -(-m // block), -(-n // block)
    scale = np.zeros((sm, sn), np.float32)
    q = np.zeros((m, n), ml_dtypes.float8_e4m3fn)
    for i in range(sm):
        for j in range(sn):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = max(float(np.abs(blk).max()) / E4M3_MAX, 1e-12)
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("shape", [(576, 2048), (200, 130), (128, 128), (7, 300)])
def test_fp8_block_dequantization_round_trip(shape):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 0.02
    q, s = quantize_fp8_blocks(w)
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    deq = dequantize_fp8_blocks(q, s)
    assert deq.shape == shape and deq.dtype == np.float32
    # e4m3 keeps 3 mantissa bits: relative error per element at most 2^-4 of the block's scale range.
    blockmax = np.repeat(np.repeat(s * E4M3_MAX, 128, 0), 128, 1)[: shape[0], : shape[1]]
    assert np.all(np.abs(deq - w) <= blockmax * 2.0**-4 + 1e-12)
    # Exactly q * scale, elementwise, with the edge blocks partial.
    i, j = shape[0] - 1, shape[1] - 1
    assert deq[i, j] == np.float32(q[i, j].astype(np.float32) * s[i // 128, j // 128])
    with pytest.raises(CheckpointError, match="weight_scale_inv shape"):
        dequantize_fp8_blocks(q, s[:, :-1] if s.shape[1] > 1 else s[:-1])




def _load(path, dtype=jnp.float32):
    return load_hf_checkpoint(path, ModelConfig.from_model_dir(path), dtype, progress=False)


def _logits(cfg, params, seed=0):
    ids = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    return np.asarray(forward(params, cfg, ids))


def test_fp8_checkpoint_loads_dequantized(hf_case, tmp_path):
    """quantization="none" (vLLM's meaning) dequantizes an FP8 checkpoint at load: exactly the float checkpoint
    of its dequantized weights. (Kept as FP8, the default: tests/model/test_fp8_weights.py.)"""
    _, path = hf_case("v3_grouped_noaux")
    tensors = _tensors(path)
    fp8, deq = {}, {}
    for name, w in tensors.items():
        linear = name.endswith("proj.weight") and "mlp.gate." not in name
        if linear and w.ndim == 2:
            q, s = quantize_fp8_blocks(w, block=16)  # small blocks so tiny shapes get several, partial ones
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize_fp8_blocks(q, s, (16, 16))
        else:
            fp8[name] = deq[name] = w
    quant_cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}}
    d_fp8 = _rewrite(path, str(tmp_path / "fp8"), fp8, quant_cfg)
    d_ref = _rewrite(path, str(tmp_path / "ref"), deq)
    cfg, p_fp8 = load_hf_checkpoint(d_fp8, ModelConfig.from_model_dir(d_fp8), jnp.float32, progress=False,
                                    hf_config=json.load(open(os.path.join(d_fp8, "config.json"))),
                                    quantization="none")
    _, p_ref = _load(d_ref)
    for a, b in zip(jax.tree.leaves(p_fp8), jax.tree.leaves(p_ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # And the model still computes about the same thing as the unquantized one.
    _, p_orig = _load(path)
    a, b = _logits(cfg, p_fp8), _logits(cfg, p_orig)
    corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
    assert not np.array_equal(a, b) and corr > 0.9, corr


def test_fused_v5_expert_layout_and_sharded_index(hf_case, tmp_path):
    _, path = hf_case("v2_greedy_yarn")
    cfg0 = ModelConfig.from_model_dir(path)
    tensors = _tensors(path)
    fused = {}
    for name, w in tensors.items():
        if ".mlp.experts." not in name:
            fused[name] = w
    E, Im = cfg0.n_routed_experts, cfg0.moe_intermediate_size
    for layer in range(cfg0.first_k_dense_replace, cfg0.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts"
        gate = np.stack([tensors[f"{pre}.{e}.gate_proj.weight"] for e in range(E)])
        up = np.stack([tensors[f"{pre}.{e}.up_proj.weight"] for e in range(E)])
        fused[f"{pre}.gate_up_proj"] = np.concatenate([gate, up], axis=1)  # [E, 2I, D]
        fused[f"{pre}.down_proj"] = np.stack([tensors[f"{pre}.{e}.down_proj.weight"] for e in range(E)])
        assert fused[f"{pre}.gate_up_proj"].shape == (E, 2 * Im, cfg0.hidden_size)
    # Two shards plus an index, as large checkpoints are stored.
    d = tmp_path / "fused"
    d.mkdir()
    shutil.copy(os.path.join(path, "config.json"), d / "config.json")
    names = sorted(fused)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fn, ns in shards.items():
        save_file({n: fused[n] for n in ns}, str(d / fn))
        weight_map.update({n: fn for n in ns})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(d / "model.safetensors.index.json", "w"))
    cfg, p_fused = _load(str(d))
    _, p_ref = _load(path)
    np.testing.assert_array_equal(_logits(cfg, p_fused), _logits(cfg, p_ref))


@pytest.mark.parametrize("case, dtype", [("v2_greedy_yarn", jnp.bfloat16), ("v3_grouped_noaux", jnp.float32)])
def test_host_assembly_equals_device_updates(hf_case, monkeypatch, case, dtype):
    """Small models on a CPU are assembled in numpy and put on the device leaf by leaf (hf_loader.host_assembly);
    their leaves equal, bit for bit, those the in-place device updates of every other load give (fp32 tensors
    rounded to bf16 included), on the same devices."""
    from deepinfer_jax.weights import hf_loader
    from deepinfer_jax.weights.pending import abstract_from_specs

    _, path = hf_case(case)
    cfg, host = _load(path, dtype)
    assert hf_loader.host_assembly(abstract_from_specs(cfg, dtype))
    monkeypatch.setattr(hf_loader, "HOST_ASSEMBLY_BYTES", -1)
    assert not hf_loader.host_assembly(abstract_from_specs(cfg, dtype))
    _, dev = _load(path, dtype)
    assert jax.tree.structure(host) == jax.tree.structure(dev)
    for (kp, a), b in zip(jax.tree_util.tree_flatten_with_path(host)[0], jax.tree.leaves(dev)):
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding), jax.tree_util.keystr(kp)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(kp))


def test_bf16_checkpoint_loads_into_bf16(hf_case, tmp_path):
    _, path = hf_case("v3_flat_plain_rope")
    t = {n: w.astype(ml_dtypes.bfloat16) if n.endswith("weight") else w for n, w in _tensors(path).items()}
    d = _rewrite(path, str(tmp_path / "bf16"), t)
    cfg, params = _load(d, jnp.bfloat16)
    assert params["segments"][0]["attn"]["kv_b_proj"].dtype == jnp.bfloat16
    assert params["segments"][1]["moe"]["e_score_correction_bias"].dtype == jnp.float32
    _, p32 = _load(path)
    a, b = _logits(cfg, params), _logits(cfg, p32)
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.98


def test_missing_tensor_is_named(hf_case, tmp_path):
    _, path = hf_case("v3_grouped_noaux")
    t = _tensors(path)
    del t["model.layers.2.mlp.experts.5.up_proj.weight"]
    d = _rewrite(path, str(tmp_path / "missing"), t)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        _load(d)


def test_shape_mismatch_is_named(hf_case, tmp_path):
    _, path = hf_case("v2_greedy_yarn")
    t = _tensors(path)
    t["model.layers.0.self_attn.kv_b_proj.weight"] = t["model.layers.0.self_attn.kv_b_proj.weight"][:-1]
    d = _rewrite(path, str(tmp_path / "shape"), t)
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight has shape \(127, 32\), expected \(128, 32\)"):
        _load(d)


def test_wrong_dtype_is_named(hf_case, tmp_path):
    _, path = hf_case("v2_greedy_yarn")
    t = _tensors(path)
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)
    d = _rewrite(path, str(tmp_path / "dtype"), t)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has dtype I32"):
        _load(d)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v2"}))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        index_checkpoint(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        index_checkpoint(str(tmp_path))
