"""FP8 block-scaled checkpoints load with their weights kept as e4m3 plus fp32 block scales (models/quant.py's
Fp8Weight) at an odd block size whose blocks do not divide the weights, and compute exactly what HF transformers
computes on the dequantized model; `quantization` "none" dequantizes them and "fp8" quantizes a float
checkpoint online; bad scales are named before anything loads."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import fp8_checkpoint, hf_logits, is_linear, random_prompts
from hf_models import read_tensors as _tensors
from hf_models import rewrite_checkpoint as _rewrite
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.models.quant import dequantize, fp8_quantize_blocks, is_fp8, weights_nbytes
from deepinfer_jax.weights.hf_loader import dequantize_fp8_blocks
from deepinfer_jax.weights.loader import load_model, prepare_model
from deepinfer_jax.weights.safetensors_io import CheckpointError

CASE = "v3_grouped_noaux"  # q-LoRA, dense MLP, routed and shared experts
BLOCK = (16, 24)  # rows (out) x columns (in): divides none of 64, 40, 24 columns / 40 rows exactly


@pytest.fixture(scope="module")
def fp8_dirs(hf_case, tmp_path_factory):
    """(FP8 checkpoint dir, the float checkpoint dir, HF model holding the FP8 weights dequantized)."""
    import torch

    hf_model, path = hf_case(CASE)
    tmp = tmp_path_factory.mktemp("fp8")
    fp8, deq = {}, {}
    for name, w in _tensors(path).items():
        if is_linear(name, w):
            q, s = fp8_quantize_blocks(w, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize_fp8_blocks(q, s, BLOCK)  # HF's arithmetic: float(q) * scale, in fp32
        else:
            fp8[name] = deq[name] = w
    quant_cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}}
    d = _rewrite(path, str(tmp / "fp8"), fp8, quant_cfg)
    ref = _rewrite(path, str(tmp / "dequantized"), deq)
    model = type(hf_model).from_pretrained(ref, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return d, path, model, fp8


@pytest.fixture(scope="module")
def fp8_params(fp8_dirs):
    return load_model(fp8_dirs[0], jnp.float32, progress=False)


def test_fp8_checkpoint_keeps_its_blocks_and_matches_hf(fp8_dirs, fp8_params):
    d, _, model, fp8 = fp8_dirs
    cfg, params = fp8_params
    seg0, seg1 = params["segments"]
    kept = [x for x in jax.tree.leaves(params, is_leaf=is_fp8) if is_fp8(x)]
    # Every linear weight of every layer is FP8 (attention, dense MLP, routed and shared experts)...
    assert len(kept) == 2 * 5 + 2 + 2 + 2 and all(x.q.dtype == jnp.float8_e4m3fn for x in kept)
    assert all(x.block == BLOCK and x.scale.dtype == jnp.float32 for x in kept)
    # ... holding the checkpoint's own tensors, HF's [out, in] orientation and blocks.
    qb = seg1["attn"]["q_b_proj"]  # [L, H * dqk, Rq]: blocks over the flattened heads
    name = "model.layers.2.self_attn.q_b_proj.weight"
    np.testing.assert_array_equal(np.asarray(qb.q[1]), fp8[name])
    np.testing.assert_array_equal(np.asarray(qb.scale[1]), fp8[name + "_scale_inv"])
    up = seg1["moe"]["experts"]["gate_up"]  # [L, E, 2, Im, D]: gate and up blocked apart
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    np.testing.assert_array_equal(np.asarray(up.q[0, 5, 1]), fp8[name])
    np.testing.assert_array_equal(np.asarray(up.scale[0, 5, 1]), fp8[name + "_scale_inv"])
    assert seg0["mlp"]["down"].shape == (1, cfg.intermediate_size, cfg.hidden_size)  # the logical shape
    # Router, norms, embeddings and lm_head stay float.
    assert not is_fp8(seg1["moe"]["gate"]) and params["lm_head"].dtype == jnp.float32
    # fp32 compute on the dequantized weights is HF's model on the same weights.
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 40))
    out = np.asarray(jax.jit(lambda p, t: forward(p, cfg, t))(params, jnp.asarray(ids, jnp.int32)))
    ref = hf_logits(model, ids)
    assert np.abs(out - ref).max() <= 1e-4 and np.abs(ref).max() > 0.5


def test_fp8_device_bytes_are_the_checkpoints(fp8_dirs, fp8_params):
    """The weights take (within 5%) the bytes the checkpoint's files hold past their JSON headers (a tiny model's
    header, one entry per tensor, is 6% of its file): e4m3 weights, fp32 scales, and the float tensors (fp32
    here, as loaded)."""
    d = fp8_dirs[0]
    on_device = weights_nbytes(fp8_params[1])
    on_disk = 0
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as fh:
                header = int.from_bytes(fh.read(8), "little")
            on_disk += os.path.getsize(os.path.join(d, f)) - 8 - header
    assert abs(on_device - on_disk) <= 0.05 * on_disk, (on_device, on_disk)
    _, deq = load_model(d, jnp.float32, progress=False, quantization="none")
    assert weights_nbytes(deq) > 1.5 * on_device  # the dequantized load is what it saves


def test_quantization_none_dequantizes_every_leaf_exactly(fp8_dirs, fp8_params):
    """quantization="none" gives float leaves; each equals its Fp8Weight dequantized, layout included (gate/up
    halves, heads flattened into rows or columns, experts, layers)."""
    _, params = fp8_params
    _, deq = load_model(fp8_dirs[0], jnp.float32, progress=False, quantization="none")
    assert not any(is_fp8(x) for x in jax.tree.leaves(deq, is_leaf=is_fp8))
    kept = jax.tree.leaves(params, is_leaf=is_fp8)
    assert len(kept) == len(jax.tree.leaves(deq))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params, is_leaf=is_fp8)[0], jax.tree.leaves(deq)):
        a = dequantize(a, jnp.float32) if is_fp8(a) else a
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_online_fp8_of_a_float_checkpoint(fp8_dirs, tmp_path):
    """quantization="fp8" on a float checkpoint: 128 x 128 blocks, exactly what the same weights stored as an FP8
    checkpoint with weight_block_size [128, 128] load as."""
    _, path, _, _ = fp8_dirs
    cfg, online = load_model(path, jnp.float32, progress=False, quantization="fp8")
    d, _ = fp8_checkpoint(path, str(tmp_path / "fp8_128"), (128, 128), is_linear)
    _, stored = load_model(d, jnp.float32, progress=False)
    assert jax.tree.structure(online) == jax.tree.structure(stored)
    kept = [x for x in jax.tree.leaves(online, is_leaf=is_fp8) if is_fp8(x)]
    assert kept and all(x.block == (128, 128) for x in kept)
    for a, b in zip(jax.tree.leaves(online), jax.tree.leaves(stored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_fp8_scales_are_named_before_loading(fp8_dirs, tmp_path):
    d, path, _, fp8 = fp8_dirs
    name = "model.layers.1.self_attn.o_proj.weight"
    missing = {n: w for n, w in fp8.items() if n != name + "_scale_inv"}
    bad = _rewrite(d, str(tmp_path / "missing"), missing)
    with pytest.raises(CheckpointError, match=rf"tensor {name} is F8_E4M3 without a usable weight_scale_inv"):
        prepare_model(bad, jnp.float32, progress=False)  # raises while checking: no array made
    wrong = dict(fp8)
    wrong[name + "_scale_inv"] = fp8[name + "_scale_inv"][:, :-1]
    bad = _rewrite(d, str(tmp_path / "wrong"), wrong)
    with pytest.raises(CheckpointError, match=rf"tensor {name}_scale_inv has shape \(4, 2\), expected \(4, 3\) for "
                                              r"the \(64, 64\) weight with weight_block_size \[16, 24\]"):
        prepare_model(bad, jnp.float32, progress=False)
    with pytest.raises(ValueError, match="quantization 'int8' needs a converted checkpoint"):
        prepare_model(d, jnp.float32, progress=False, quantization="int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        prepare_model(d, jnp.float32, progress=False, quantization="fp4")


def test_llm_greedy_on_fp8_checkpoint_equals_hf(fp8_dirs):
    """The engine (paged cache, scheduler, compiled steps) on the FP8 checkpoint at fp32: HF's greedy tokens on
    the dequantized model, token for token."""
    import torch

    from deepinfer_jax import LLM, SamplingParams

    d, _, model, _ = fp8_dirs
    llm = LLM(d, dtype="float32", skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, page_size=8, progress=False, token_buckets=(4, 64))
    assert is_fp8(llm.engine.runner.params["segments"][1]["attn"]["o_proj"])
    prompts = random_prompts(5, [3, 17, 40], 320)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, use_cache=True)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref


def test_dense_family_fp8_keeps_k_and_v_blocked_apart(hf_case, tmp_path):
    """A dense-family (Llama) FP8 checkpoint: k_proj and v_proj, each with its own blocks, land in kv_proj's two
    parts [L, 2, KVH * hd, D] (as gate and up do in gate_up); dequantized, every leaf equals the "none" load."""
    _, path = hf_case("llama_tp")
    d, fp8 = fp8_checkpoint(path, str(tmp_path / "llama_fp8"), (12, 8),
                       lambda name, w: name.endswith("proj.weight") and w.ndim == 2)
    _, params = load_model(d, jnp.float32, progress=False)
    _, deq = load_model(d, jnp.float32, progress=False, quantization="none")
    kv = params["segments"][0]["attn"]["kv_proj"]
    assert is_fp8(kv) and kv.parts == 2 and kv.q.shape[1:3] == (2, 2 * 12)  # [L, 2, KVH * hd, D]
    np.testing.assert_array_equal(np.asarray(kv.q[0, 1]), fp8["model.layers.0.self_attn.v_proj.weight"])
    for (path_, a), b in zip(jax.tree_util.tree_flatten_with_path(params, is_leaf=is_fp8)[0], jax.tree.leaves(deq)):
        a = dequantize(a, jnp.float32) if is_fp8(a) else a
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path_))
