"""DeepSeek-V4 in its released formats (weights/v4_native.py) on the tiny checkpoint rewritten as DeepSeek ships
V4-Flash: attention and shared-expert linears FP8 (e4m3, ue8m0 block scales under `.scale`, blocks partial at the
edges), routed experts FP4 (I8 packed e2m1 pairs, F8_E8M0 scales per 1 x 32, groups partial over input sizes 40
and 24). The FP8 / FP4 leaves hold the file's bytes, dequantize exactly to the released weights, and the forward
on them is HF transformers' on the dequantized weights; "none" dequantizes at load; the converter and `deepinfer
plan` take the directory; bad scales are named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import random_prompts, read_tensors, rewrite_checkpoint
from deepinfer_jax.models.quant import Fp8Weight, dequantize, is_quantized
from deepinfer_jax.models.quant_fp4 import Fp4Weight
from deepinfer_jax.weights.name_table_v4 import load_v4_checkpoint
from deepinfer_jax.weights.safetensors_io import CheckpointError

SEQ = 40


@pytest.fixture(scope="module")
def release(v4_release):
    model, rel, ref = v4_release
    cfg, params = load_v4_checkpoint(rel)
    _, floats = load_v4_checkpoint(ref)
    return model, rel, ref, cfg, params, floats


def _quantized(params):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=is_quantized)[0] if is_quantized(x)]


def test_leaves_hold_the_files_bytes(release):
    _, rel, _, cfg, params, _ = release
    files = read_tensors(rel)
    lp = params["layers"][1]
    gu, down = lp["moe"]["experts"]["gate_up"], lp["moe"]["experts"]["down"]
    E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert isinstance(gu, Fp4Weight) and gu.q.shape == (E, 2, I, D // 2) and gu.scale.shape == (E, 2, I, 2)
    assert gu.q.dtype == jnp.uint8 and gu.scale.dtype == jnp.uint8 and gu.shape == (E, D, 2, I)
    assert isinstance(down, Fp4Weight) and down.q.shape == (E, D, I // 2) and down.shape == (E, I, D)
    w3 = "model.layers.1.ffn.experts.4.w3"  # up
    np.testing.assert_array_equal(np.asarray(gu.q[4, 1]), files[w3 + ".weight"].view(np.uint8))
    np.testing.assert_array_equal(np.asarray(gu.scale[4, 1]), files[w3 + ".scale"].view(np.uint8))
    qb = lp["attn"]["q_b_proj"]
    assert isinstance(qb, Fp8Weight) and qb.block == (8, 12) and qb.q.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(qb.q), files["model.layers.1.attn.wq_b.weight"])
    np.testing.assert_array_equal(np.asarray(qb.scale), files["model.layers.1.attn.wq_b.scale"].astype(np.float32))
    assert isinstance(lp["attn"]["indexer"]["q_b_proj"], Fp8Weight)
    assert isinstance(lp["moe"]["shared"]["down"], Fp8Weight)
    assert not is_quantized(lp["attn"]["compressor"]["kv_proj"]) and not is_quantized(lp["moe"]["gate"])
    # The routed experts take on the device exactly their bytes in the file (packed codes + e8m0 scales).
    file_bytes = sum(a.nbytes for n, a in files.items() if ".ffn.experts." in n)
    dev = sum(x.q.nbytes + x.scale.nbytes for lp in params["layers"] for x in lp["moe"]["experts"].values())
    assert dev == file_bytes


def test_dequantized_leaves_are_the_released_weights_and_logits_match_hf(release):
    import torch

    from deepinfer_jax.models.deepseek_v4 import v4_forward

    model, _, _, cfg, params, floats = release
    quantized = _quantized(params)
    csa = sum(t == "compressed_sparse_attention" for t in cfg.layer_types)  # the indexer's q_b_proj
    assert len(quantized) == cfg.num_hidden_layers * 9 + csa
    float_leaves = dict((jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(floats)[0])
    for path, w in quantized:  # bit for bit: e4m3 / e2m1 times a power of two is exact in fp32
        deq = dequantize(w, jnp.float32)
        if path.endswith("['o_a_proj']"):
            deq = jnp.moveaxis(deq, 0, 1)  # [H*hd/g, g, r] -> [g, H*hd/g, r]
        np.testing.assert_array_equal(np.asarray(deq), np.asarray(float_leaves[path]), err_msg=path)
    ids = np.array(random_prompts(3, [SEQ], cfg.vocab_size)[0])
    with torch.no_grad():
        ref = model(torch.tensor(ids[None]), use_cache=False).logits[0].numpy()
    fwd = jax.jit(lambda p, t: v4_forward(cfg, p, t))
    out = np.asarray(fwd(params, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_none_dequantizes_and_convert_writes_the_float_weights(release, tmp_path):
    from deepinfer_jax.weights.convert import convert
    from deepinfer_jax.weights.loader import load_model

    _, rel, _, _, _, floats = release
    _, none = load_v4_checkpoint(rel, quantization="none")
    jax.tree.map(np.testing.assert_array_equal, none, floats)
    meta = convert(rel, str(tmp_path / "conv"), dtype="float32", progress=False)
    assert meta["quantization"]["method"] == "none" and meta["source"]["fp8"]
    _, conv = load_model(str(tmp_path / "conv"), jnp.float32, progress=False)
    jax.tree.map(np.testing.assert_array_equal, conv, floats)


def test_plan_counts_the_fp4_and_fp8_bytes(release):
    from deepinfer_jax.engine.plan import plan
    from deepinfer_jax.models.quant import weights_nbytes
    from deepinfer_jax.weights.loader import load_model

    _, rel, _, _, params, floats = release
    p = plan(rel, dtype="float32")
    assert p.weights == "fp4 (kept) + fp8 (kept)" and p.weight_bytes_per_device == weights_nbytes(params)
    assert plan(rel, dtype="float32", quantization="none").weight_bytes_per_device == weights_nbytes(floats)
    _, loaded = load_model(rel, jnp.float32, progress=False)  # the engine's loader: the same leaves
    assert weights_nbytes(loaded) == weights_nbytes(params)
    with pytest.raises(ValueError, match="quantization 'fp8' is not supported for deepseek_v4"):
        plan(rel, dtype="float32", quantization="fp8")


@pytest.mark.parametrize("edit, needle", [
    ("drop_scale", r"model.layers.0.self_attn.q_a_proj.weight is F8_E4M3 without its scales"),
    ("fp4_scale_shape", r"model.layers.2.ffn.experts.1.w2.scale has shape \(40, 2\), expected \(40, 1\)"),
    ("no_config", "is F8_E4M3 but config.json has no quantization_config"),
])
def test_bad_release_names_the_tensor(release, tmp_path, edit, needle):
    import json
    import os

    _, rel, _, _, _, _ = release
    tensors = read_tensors(rel)
    with open(os.path.join(rel, "config.json")) as f:
        cfg = json.load(f)
    if edit == "drop_scale":
        del tensors["model.layers.0.attn.wq_a.scale"]
    elif edit == "fp4_scale_shape":
        tensors["model.layers.2.ffn.experts.1.w2.scale"] = np.zeros((40, 2), np.uint8)
    else:
        del cfg["quantization_config"]
    d = rewrite_checkpoint(rel, str(tmp_path / edit), tensors)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=needle):
        load_v4_checkpoint(d)


@pytest.mark.parametrize("experts", ["fp4", "fp8"])
def test_quantized_experts_through_the_kernels_match_the_reference(experts):
    """The V4 MoE (scored routing with FP4 experts, hash routing with FP8 ones) through kernels/moe_gmm_quant.py
    (interpret mode, swiglu_limit in the gate_up kernel) equals the dense reference on the same weights (fp32).
    Hidden 64 and width 32: whole FP4 groups and FP8 blocks along K, as the kernels take them."""
    from hf_models_v4 import V4_TINY

    from deepinfer_jax.config_v4 import V4Config
    from deepinfer_jax.kernels.moe_gmm_quant import supported
    from deepinfer_jax.models.deepseek_v4 import expert_formats, v4_moe
    from deepinfer_jax.models.quant import quantize_fp8
    from deepinfer_jax.models.quant_fp4 import quantize_fp4
    from deepinfer_jax.models.v4_params import v4_init_params

    cfg = V4Config.from_hf_dict({**V4_TINY, "model_type": "deepseek_v4", "hidden_size": 64,
                                 "moe_intermediate_size": 32, "num_hidden_layers": 2,
                                 "layer_types": V4_TINY["layer_types"][:2], "mlp_layer_types": ["hash_moe", "moe"]})
    params = v4_init_params(cfg, seed=1, std=0.2)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((11, 64)), jnp.float32)
    tokens = jnp.asarray(random_prompts(4, [11], cfg.vocab_size)[0], jnp.int32)
    i = 1 if experts == "fp4" else 0
    lp = params["layers"][i]
    ex = lp["moe"]["experts"]
    if experts == "fp4":
        q = {"gate_up": quantize_fp4(np.asarray(ex["gate_up"]), 2, gate_up=True),
             "down": quantize_fp4(np.asarray(ex["down"]), 1)}
    else:
        q = {"gate_up": quantize_fp8(np.asarray(ex["gate_up"]), 1, 2, True, (16, 32)),
             "down": quantize_fp8(np.asarray(ex["down"]), 1, 1, False, (16, 32))}
    q = {k: jax.tree.map(jnp.asarray, v) for k, v in q.items()}
    p = {**lp["moe"], "experts": q}
    fmts = expert_formats(q)  # the kernels take these experts: no fallback to the reference
    assert fmts[0].kind == experts and supported(*fmts, 64, 32, 11 * cfg.num_experts_per_tok)
    ref = v4_moe(cfg, i, p, x, tokens)
    out = v4_moe(cfg, i, p, x, tokens, impl="pallas_interpret")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["ragged", "pallas_interpret"])
def test_float_experts_run_only_their_routed_copies(impl):
    """Float experts outside the reference run in XLA's grouped GEMM over the routed token copies (every expert
    computed for every token only with "reference" / "dense"): the same sums as the dense reference (fp32), for
    hash and scored routing, and the traced program holds ragged_dot and no [S, E, 2, I] product."""
    from hf_models_v4 import V4_TINY

    from deepinfer_jax.config_v4 import V4Config
    from deepinfer_jax.models.deepseek_v4 import v4_moe
    from deepinfer_jax.models.v4_params import v4_init_params

    cfg = V4Config.from_hf_dict({**V4_TINY, "model_type": "deepseek_v4"})
    params = v4_init_params(cfg, seed=3, std=0.2)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((9, cfg.hidden_size)), jnp.float32)
    tokens = jnp.asarray(random_prompts(5, [9], cfg.vocab_size)[0], jnp.int32)
    for i in (0, 2):  # hash_moe, moe
        p = params["layers"][i]["moe"]
        ref = v4_moe(cfg, i, p, x, tokens)
        out = v4_moe(cfg, i, p, x, tokens, impl=impl)
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)
        jaxpr = str(jax.make_jaxpr(lambda x: v4_moe(cfg, i, p, x, tokens, impl=impl))(x))
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        assert "ragged_dot" in jaxpr and f"[9,{E},2,{I}]" not in jaxpr


@pytest.mark.parametrize("q", ["fp4", "mxfp4"])
def test_online_fp4_is_refused_naming_why(release, q):
    from deepinfer_jax.weights.loader import check_quantization

    with pytest.raises(ValueError, match=f"got '{q}': online FP4 quantization is not implemented"):
        check_quantization(release[1], q)


def test_fp8_experts_as_v4_flash_base_ships_them(release, tmp_path):
    """expert_dtype "fp8" (V4-Flash-Base): the routed experts are FP8 blocks too, kept as Fp8Weight in HF's
    orientation (gate and up apart), dequantizing to the released weights."""
    import os

    from hf_models_v4 import write_v4_release

    _, rel, _, _, _, _ = release
    d, deq = write_v4_release(os.path.join(os.path.dirname(rel), "float"), str(tmp_path / "base"), (8, 12), "fp8")
    _, params = load_v4_checkpoint(d)
    gu = params["layers"][2]["moe"]["experts"]["gate_up"]
    assert isinstance(gu, Fp8Weight) and gu.q.shape == (6, 2, 24, 40) and gu.parts == 2
    up = np.asarray(dequantize(gu, jnp.float32))[3, :, 1, :]  # [D, I] of expert 3's up projection
    np.testing.assert_array_equal(up, deq["model.layers.2.ffn.experts.3.w3.weight"].T)


def test_fp4_scales_in_a_float_container_are_read_exactly():
    """FP4 scales stored as F32 (a power-of-two container, as V4-Flash-Base stores its ue8m0 scales) become the
    same e8m0 bytes; a scale that is not a power of two is refused, naming the tensor."""
    import ml_dtypes

    from deepinfer_jax.weights.v4_native import e8m0_bytes

    s = np.array([[2.0**-9, 0.5, 1.0, 4.0]], np.float32)
    np.testing.assert_array_equal(e8m0_bytes(s, "x"), [[118, 126, 127, 129]])
    np.testing.assert_array_equal(e8m0_bytes(s.astype(ml_dtypes.float8_e8m0fnu), "x"), [[118, 126, 127, 129]])
    with pytest.raises(CheckpointError, match="tensor w.scale holds scales that are not powers of two"):
        e8m0_bytes(np.array([0.75], np.float32), "w.scale")


def test_dummy_release_draws_the_leaves_the_release_loads_as(v4_mtp_dirs):
    """load_format "dummy" on a release config.json (weights/release_random.py): the tree the release loads as
    (every FP8 / FP4 leaf packed, MTP's e_proj / h_proj included, the same q / scale shapes and dtypes), the float
    leaves drawn as the float dummy draws them, the packed ones at its scale (|w| < 0.1, FP4 scales 2 ** -7 or
    2 ** -6)."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.models.quant_fp4 import fp4_dequantize
    from deepinfer_jax.weights.loader import prepare_model
    from deepinfer_jax.weights.release_random import pending_release_params, release_format

    rel = v4_mtp_dirs[2]
    _, loaded = prepare_model(rel, jnp.float32, progress=False)
    cfg = ModelConfig.from_model_dir(rel)
    dummy = pending_release_params(cfg, release_format(rel, cfg), jnp.float32, seed=3)

    def described(tree):
        return [(jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype))
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]

    assert described(dummy.abstract) == described(loaded.abstract)
    assert [k for k, _ in _quantized(dummy.abstract)] == [k for k, _ in _quantized(loaded.abstract)]
    assert "['mtp'][0]['e_proj']" in dict(_quantized(dummy.abstract))
    # the values on the first two layers (HCA and CSA, hash-routed) without MTP: half the leaves to compile
    from hf_models_v4 import V4_TINY
    from deepinfer_jax.weights.v4_native import V4Quant

    two = ModelConfig.from_hf_dict(dict(V4_TINY, model_type="deepseek_v4", num_hidden_layers=2,
                                        layer_types=V4_TINY["layer_types"][:2], mlp_layer_types=["hash_moe"] * 2))
    params = pending_release_params(two, V4Quant((8, 12), "fp4"), jnp.float32, seed=3).result()
    kv = np.asarray(params["layers"][1]["attn"]["indexer"]["kv_proj"])  # a float leaf: random_params' range
    assert kv.dtype == np.float32 and 0.02 < np.abs(kv).mean() and np.abs(kv).max() <= 0.05
    for name, w in _quantized(params):
        full = np.asarray(fp4_dequantize(w, jnp.float32) if isinstance(w, Fp4Weight) else dequantize(w, jnp.float32))
        assert np.all(np.isfinite(full)) and 0.005 < np.abs(full).mean() and np.abs(full).max() < 0.1, name
        if isinstance(w, Fp4Weight):
            assert set(np.unique(np.asarray(w.scale)).tolist()) == {120, 121}, name
