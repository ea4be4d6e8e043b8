"""Tiny random DeepSeek-V4 checkpoints built with HF transformers (the numerics reference).

One fp32 model with every attention layer type (sliding, CSA, HCA) and both MLP types (hash_moe, moe),
odd sizes where the arithmetic allows (vocab 101, 3 hyper-connection streams, 13 index heads, a rotary
slice of 6 in a head of 24), a YaRN compress rope, and every parameter HF initialises to a constant (sinks, position biases, hyper-connection base / scale, hash
table, correction bias, norms) randomised so each one matters in the comparison.
"""

from __future__ import annotations

V4_TINY = dict(
    vocab_size=101, hidden_size=40, moe_intermediate_size=24, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=24, q_lora_rank=20,
    partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=6, n_shared_experts=1,
    scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5,
    max_position_embeddings=64, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32, "beta_slow": 1},
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    hc_mult=3, hc_sinkhorn_iters=20, hc_eps=1e-6, mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    swiglu_limit=0.9, sliding_window=8, o_groups=2, o_lora_rank=10, index_n_heads=13, index_head_dim=12,
    index_topk=3, num_nextn_predict_layers=0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, initializer_range=0.1,
)


def build_hf_v4(seed: int = 0, **overrides):
    """An fp32 eval-mode `DeepseekV4ForCausalLM` with every constant-initialised parameter randomised."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**{**V4_TINY, **overrides})
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "hc_scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("sinks", "position_bias", "base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.rand(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                E = cfg.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E, generator=g)[: cfg.num_experts_per_tok]
                                     for _ in range(b.shape[0])]))
    model.config._attn_implementation = "eager"
    return model


# ---- DeepSeek-V4 as released: FP8 linears (e4m3, ue8m0 block scales) and FP4 routed experts ----------------

FP8_LINEARS = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight", ".attn.wo_b.weight",
               ".attn.indexer.wq_b.weight", ".shared_experts.w1.weight", ".shared_experts.w2.weight",
               ".shared_experts.w3.weight", ".e_proj.weight", ".h_proj.weight")  # the last two: the MTP block's


def add_mtp_block(src: str, dst: str, seed: int = 3, like: int = 2) -> str:
    """`src` (a tiny V4 float checkpoint saved by HF, which drops MTP) with an MTP block in DeepSeek's released
    names (`mtp.0.*`): a block shaped as layer `like` (sliding, scored moe: the released MTP layer's kinds), fresh
    random values, and the MTPBlock's own e_proj, h_proj, enorm, hnorm, norm and hc_head_*; config.json declares
    num_nextn_predict_layers 1. Returns dst."""
    import numpy as np

    from hf_models import read_tensors, rewrite_checkpoint

    rng = np.random.default_rng(seed)
    tensors = read_tensors(src)
    D = tensors["model.norm.weight"].shape[0]
    n = tensors["model.hc_head.hc_base"].shape[0]

    def like_values(name, w):
        if "norm" in name or name.endswith("scale"):
            return (1.0 + 0.3 * rng.standard_normal(w.shape)).astype(w.dtype)
        if w.dtype.kind == "f":
            return (max(float(w.std()), 0.05) * rng.standard_normal(w.shape)).astype(w.dtype)
        return w

    pre = f"model.layers.{like}."
    out = dict(tensors)
    out.update({"mtp.0." + k[len(pre):]: like_values(k, w) for k, w in tensors.items() if k.startswith(pre)})
    for k in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{k}.weight"] = (1.0 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    for k in ("e_proj", "h_proj"):
        out[f"mtp.0.{k}.weight"] = (0.2 * rng.standard_normal((D, D))).astype(np.float32)
    out["mtp.0.hc_head_fn"] = (0.1 * rng.standard_normal((n, n * D))).astype(np.float32)
    out["mtp.0.hc_head_base"] = (0.5 * rng.standard_normal(n)).astype(np.float32)
    out["mtp.0.hc_head_scale"] = (1.0 + 0.3 * rng.standard_normal(1)).astype(np.float32)
    return rewrite_checkpoint(src, dst, out, {"num_nextn_predict_layers": 1})


def fp8_ue8m0_blocks(w, block):
    """w [N, K] -> (e4m3 [N, K], e8m0 scales [cdiv(N, bn), cdiv(K, bk)]): per block the smallest power of two
    >= amax / 448 (DeepSeek's ue8m0 scales), q = e4m3(w / scale)."""
    import ml_dtypes
    import numpy as np

    bn, bk = block
    N, K = w.shape
    sn, sk = -(-N // bn), -(-K // bk)
    pad = np.zeros((sn * bn, sk * bk), np.float32)
    pad[:N, :K] = w
    amax = np.maximum(np.abs(pad.reshape(sn, bn, sk, bk)).max(axis=(1, 3)), 1e-30)
    mant, exp = np.frexp(amax / 448.0)
    scale = np.ldexp(np.float32(1.0), np.where(mant == 0.5, exp - 1, exp)).astype(np.float32)
    full = np.repeat(np.repeat(scale, bn, 0), bk, 1)[:N, :K]
    q = np.clip(w / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q, scale.astype(ml_dtypes.float8_e8m0fnu)


def write_v4_release(src: str, dst: str, block=(8, 12), expert_dtype: str = "fp4"):
    """The float V4 checkpoint `src` (DeepSeek's names, as HF saves it) rewritten as DeepSeek releases V4: the
    attention and shared-expert linears FP8 with `.scale` beside each `.weight`, the routed experts FP4 (I8 packed
    pairs + F8_E8M0 scales per 1 x 32) or FP8 (`expert_dtype`), the rest as it was. Returns (dst, the dequantized
    tensors under the same names: what the released weights are, exactly, in fp32)."""
    import ml_dtypes
    import numpy as np

    from hf_models import read_tensors, rewrite_checkpoint
    from deepinfer_jax.models.quant_fp4 import E2M1_VALUES, fp4_quantize_rows

    out, deq = {}, {}
    for name, w in read_tensors(src).items():
        expert = ".ffn.experts." in name and name.endswith(".weight")
        if expert and expert_dtype == "fp4":
            q, s = fp4_quantize_rows(w)
            out[name], out[name[:-len("weight")] + "scale"] = q.view(np.int8), s.view(ml_dtypes.float8_e8m0fnu)
            lut = np.array(E2M1_VALUES, np.float32)
            v = np.stack([lut[q & 15], lut[q >> 4]], -1).reshape(w.shape)
            deq[name] = v * np.repeat(np.ldexp(np.float32(1), s.astype(np.int32) - 127), 32, -1)[:, : w.shape[1]]
        elif expert or name.endswith(FP8_LINEARS):
            q, s = fp8_ue8m0_blocks(w, block)
            out[name], out[name[:-len("weight")] + "scale"] = q, s
            full = np.repeat(np.repeat(s.astype(np.float32), block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
            deq[name] = q.astype(np.float32) * full
        else:
            out[name] = deq[name] = w
    quant = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "scale_fmt": "ue8m0", "weight_block_size": list(block)},
             "expert_dtype": expert_dtype}
    return rewrite_checkpoint(src, dst, out, quant), deq


def v4_release_dirs(tmp: str, block=(8, 12), expert_dtype: str = "fp4"):
    """(HF's fp32 model on the released weights dequantized, the release-format directory, the dequantized float
    directory) of the tiny V4 checkpoint (odd shapes: FP8 blocks partial at the edges, FP4 groups of 32 over input
    sizes 40 and 24)."""
    import os

    import torch
    from transformers import DeepseekV4ForCausalLM

    from hf_models import rewrite_checkpoint

    src = os.path.join(tmp, "float")
    build_hf_v4(seed=0).save_pretrained(src, safe_serialization=True)
    rel, deq = write_v4_release(src, os.path.join(tmp, "release"), block, expert_dtype)
    ref = rewrite_checkpoint(src, os.path.join(tmp, "dequantized"), deq)
    model = DeepseekV4ForCausalLM.from_pretrained(ref, torch_dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    return model, rel, ref
