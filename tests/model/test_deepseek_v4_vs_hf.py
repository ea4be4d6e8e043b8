"""DeepSeek-V4's whole-sequence forward against HF transformers on a tiny random fp32 checkpoint with
every attention layer type (sliding, CSA, HCA) and MLP type (hash_moe, moe): logits within 1e-4 over a
sequence longer than the sliding window and spanning many compression windows, greedy generation equal
to HF's `generate` (cached decode there, recomputation here), and the loader's name handling."""

from __future__ import annotations

import numpy as np
import pytest

from hf_models import random_prompts, read_tensors, rewrite_checkpoint

SEQ = 40  # > sliding_window 8; 10 CSA windows (m 4, index_topk 3), 5 HCA windows (m 8)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    from hf_models_v4 import build_hf_v4

    from deepinfer_jax.weights.name_table_v4 import load_v4_checkpoint

    model = build_hf_v4(seed=0)
    path = str(tmp_path_factory.mktemp("v4"))
    model.save_pretrained(path, safe_serialization=True)
    cfg, params = load_v4_checkpoint(path)
    return model, path, cfg, params


def test_tiny_config_covers_every_layer_kind(v4):
    _, _, cfg, _ = v4
    from deepinfer_jax.config_v4 import CSA, HCA, SLIDING

    assert set(cfg.layer_types) == {SLIDING, CSA, HCA} and set(cfg.mlp_layer_types) == {"hash_moe", "moe"}
    assert SEQ > cfg.sliding_window and SEQ // cfg.compress_rate(CSA) > cfg.index_topk
    assert SEQ // cfg.compress_rate(HCA) >= 3 and cfg.compress_rope_scaling is not None


def test_logits_match_hf(v4):
    import jax
    import jax.numpy as jnp
    import torch

    from deepinfer_jax.models.deepseek_v4 import v4_forward

    model, _, cfg, params = v4
    ids = np.array(random_prompts(3, [SEQ], cfg.vocab_size)[0])
    with torch.no_grad():
        ref = model(torch.tensor(ids[None]), use_cache=False).logits[0].numpy()
    out = np.asarray(jax.jit(lambda p, t: v4_forward(cfg, p, t))(params, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_greedy_generation_matches_hf_generate(v4):
    import jax
    import jax.numpy as jnp
    import torch

    from deepinfer_jax.models.deepseek_v4 import v4_greedy_generate

    model, _, cfg, params = v4
    prompt, new = random_prompts(5, [27], cfg.vocab_size)[0], 12  # decode crosses CSA / HCA window ends
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0].tolist()
    buf = jnp.zeros((SEQ,), jnp.int32).at[: len(prompt)].set(jnp.asarray(prompt, jnp.int32))
    gen = jax.jit(lambda p, b, n: v4_greedy_generate(cfg, p, b, n, new))(params, buf, jnp.int32(len(prompt)))
    assert np.asarray(gen)[: len(prompt) + new].tolist() == ref


def test_hf_module_names_and_fused_experts_load_the_same(v4, tmp_path):
    import jax

    from deepinfer_jax.weights.name_table_v4 import canonical_v4_name, load_v4_checkpoint

    _, path, cfg, params = v4
    tensors = read_tensors(path)
    canon = {canonical_v4_name(n): t for n, t in tensors.items()}
    assert "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight" in canon
    for i in range(cfg.num_hidden_layers):  # fuse the per-expert matrices as HF v5 holds them in memory
        pre = f"model.layers.{i}.mlp.experts"
        E = cfg.n_routed_experts
        gate = [canon.pop(f"{pre}.{e}.gate_proj.weight") for e in range(E)]
        up = [canon.pop(f"{pre}.{e}.up_proj.weight") for e in range(E)]
        canon[f"{pre}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        canon[f"{pre}.down_proj"] = np.stack([canon.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
    _, again = load_v4_checkpoint(rewrite_checkpoint(path, str(tmp_path / "hf_names"), canon))
    jax.tree.map(np.testing.assert_array_equal, params, again)


@pytest.mark.parametrize("edit, needle", [
    ("drop", "missing tensor model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"),
    ("extra", "does not know"),
    ("shape", "model.layers.0.self_attn.sinks has shape"),
])
def test_bad_checkpoint_names_the_tensor(v4, tmp_path, edit, needle):
    from deepinfer_jax.weights.name_table_v4 import load_v4_checkpoint
    from deepinfer_jax.weights.safetensors_io import CheckpointError

    _, path, _, _ = v4
    tensors = read_tensors(path)
    if edit == "drop":
        del tensors["model.layers.1.attn.indexer.wq_b.weight"]
    elif edit == "extra":
        tensors["model.layers.0.attn.mystery.weight"] = np.zeros(3, np.float32)
    else:
        tensors["model.layers.0.attn.attn_sink"] = np.zeros(5, np.float32)
    with pytest.raises(CheckpointError, match=needle):
        load_v4_checkpoint(rewrite_checkpoint(path, str(tmp_path / edit), tensors))


def test_specs_axes_and_random_init_match_the_loaded_tree(v4):
    import jax

    from deepinfer_jax.models.params import is_spec
    from deepinfer_jax.models.v4_params import v4_init_params, v4_logical_axes, v4_param_specs

    _, _, cfg, params = v4
    shapes = jax.tree.map(lambda x: (x.shape, str(x.dtype)), params)
    assert jax.tree.map(lambda x: (x.shape, str(x.dtype)), v4_init_params(cfg)) == shapes
    specs = v4_param_specs(cfg)
    axes = jax.tree.leaves(v4_logical_axes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    assert [len(a) for a in axes] == [len(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec)]
    assert jax.tree.structure(params) == jax.tree.structure(specs, is_leaf=is_spec)


def test_chunked_prefill_over_a_cache_matches_hf(v4):
    """Chunks of 10 tokens (each ending inside a CSA window of 4 and an HCA window of 8) over the
    contiguous per-layer cache: every position's logits equal HF's whole-sequence ones."""
    import jax
    import jax.numpy as jnp
    import torch

    from deepinfer_jax.models.deepseek_v4 import v4_forward_chunk, v4_init_caches

    model, _, cfg, params = v4
    ids = np.array(random_prompts(7, [SEQ], cfg.vocab_size)[0])
    with torch.no_grad():
        ref = model(torch.tensor(ids[None]), use_cache=False).logits[0].numpy()
    step = jax.jit(lambda p, c, t, s: v4_forward_chunk(cfg, p, c, t, s))
    caches, got, pos = v4_init_caches(cfg, SEQ), [], 0
    for size in [10] * (SEQ // 10):
        logits, caches = step(params, caches, jnp.asarray(ids[pos: pos + size], jnp.int32), jnp.int32(pos))
        got.append(np.asarray(logits))
        pos += size
    np.testing.assert_allclose(np.concatenate(got), ref, atol=1e-4, rtol=0)


def test_sigmoid_scored_moe_layers_match_hf(tmp_path):
    """The router's other scoring function, layer by layer against HF's MoE blocks (hash and scored)."""
    import jax.numpy as jnp
    import torch
    from hf_models_v4 import build_hf_v4

    from deepinfer_jax.models.deepseek_v4 import v4_moe
    from deepinfer_jax.weights.name_table_v4 import load_v4_checkpoint

    model = build_hf_v4(seed=2, scoring_func="sigmoid")
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    cfg, params = load_v4_checkpoint(str(tmp_path))
    assert cfg.scoring_func == "sigmoid"
    ids = np.array(random_prompts(9, [23], cfg.vocab_size)[0])
    x = np.random.default_rng(0).standard_normal((23, cfg.hidden_size)).astype(np.float32)
    for i in (0, 2):  # hash_moe, moe
        with torch.no_grad():
            ref = model.model.layers[i].mlp(torch.tensor(x[None]), input_ids=torch.tensor(ids[None]))[0].numpy()
        out = v4_moe(cfg, i, params["layers"][i]["moe"], jnp.asarray(x), jnp.asarray(ids, jnp.int32))
        np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)


def test_convert_round_trip_and_engine_loader(v4, tmp_path):
    """The converter writes the V4 params unit by unit; loading the converted directory, and the HF directory
    through the engine's loader, gives the name table's params leaf for leaf. Quantized conversion is refused."""
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.weights.convert import convert
    from deepinfer_jax.weights.loader import load_model

    _, path, _, params = v4
    dst = str(tmp_path / "conv")
    convert(path, dst, "float32", "none", progress=False)
    cfg_hf, p_hf = load_model(path, jnp.float32, progress=False)
    cfg_c, p_c = load_model(dst, jnp.float32, progress=False)
    assert cfg_c == cfg_hf == ModelConfig.from_model_dir(path) and cfg_c.family == "deepseek_v4"
    for got in (p_hf, p_c):
        assert jax.tree.structure(got) == jax.tree.structure(params)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, params)
    with pytest.raises(ValueError, match="--quantize int8 is not supported for deepseek_v4"):
        convert(path, str(tmp_path / "q"), "float32", "int8", progress=False)


def test_plan_counts_the_family_params_and_cache(v4):
    """`deepinfer plan` on a V4 directory: the weights' bytes are the loaded params' and a token's KV bytes those of
    the compressed groups (a row of each CSA layer, head_dim + index_head_dim, per 4 tokens; of each HCA layer,
    head_dim, per 8); a parallel layout is refused by name."""
    import jax

    from deepinfer_jax.engine.plan import plan

    _, path, cfg, params = v4
    p = plan(path, dtype="float32", gpu_memory_gib=1.0)
    assert p.weight_bytes_per_device == sum(x.nbytes for x in jax.tree.leaves(params))
    assert p.kv_bytes_per_token == (2 * (24 + 12) // 4 + 24 // 8) * 4 and p.fits
    with pytest.raises(ValueError, match="--data-parallel-size above 1 is not supported for deepseek_v4"):
        plan(path, data_parallel_size=2)
