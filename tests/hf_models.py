"""Tiny random DeepSeek checkpoints built with HF transformers (the numerics reference).

Each builder makes an fp32 HF model, randomises norms, router weights and correction biases so
routing is not flat, saves it with `save_pretrained` (safetensors, per-expert names on disk) and
returns the directory. Three cases, as the foundation issue lists them:
  (a) deepseek_v2, no q-LoRA, greedy softmax routing, YaRN with mscale 0.707;
  (b) deepseek_v3, q-LoRA, grouped noaux_tc sigmoid routing with random non-negative biases, YaRN;
  (c) deepseek_v3 with n_group 1, no YaRN, rms_norm_eps 1e-5.
V32_CASES (built the same way, kept apart so the V2 / V3 parametrised tests do not run them):
  (d) deepseek_v32: case (b) plus DeepSeek Sparse Attention's indexer, index_topk well below the test
      prompts' lengths so the selection really drops keys.
"""

from __future__ import annotations

import os

YARN_V2 = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
    "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0,
}
YARN_V3 = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0,
}

COMMON = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
    max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    initializer_range=0.1,
)

CASES = {
    "v2_greedy_yarn": dict(
        model_type="deepseek_v2", q_lora_rank=None, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=3, topk_method="greedy", n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=False, rope_parameters=YARN_V2, rms_norm_eps=1e-6,
    ),
    "v3_grouped_noaux": dict(
        model_type="deepseek_v3", q_lora_rank=24, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, topk_method="noaux_tc",
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN_V3, rms_norm_eps=1e-6,
    ),
    "v3_flat_plain_rope": dict(
        model_type="deepseek_v3", q_lora_rank=None, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, topk_method="noaux_tc",
        routed_scaling_factor=2.446, norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rms_norm_eps=1e-5,
    ),
}


V32_CASES = {
    "v32_sparse": dict(
        model_type="deepseek_v32", q_lora_rank=24, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=YARN_V3, rms_norm_eps=1e-6, index_n_heads=16, index_head_dim=20, index_topk=11,
    ),
}


def build_hf_model(case: str, seed: int = 0, **overrides):
    """An fp32 eval-mode HF model for `case` (of CASES or V32_CASES) with randomised norms / router / biases."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    kw = {**COMMON, **{**CASES, **V32_CASES}[case], **overrides}
    model_type = kw.pop("model_type")
    torch.manual_seed(seed)
    if model_type == "deepseek_v32":
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

        model = DeepseekV32ForCausalLM(DeepseekV32Config(**kw))
    elif model_type == "deepseek_v2":
        cfg = DeepseekV2Config(**kw)
        model = DeepseekV2ForCausalLM(cfg)
    else:
        kw.setdefault("num_nextn_predict_layers", 0)
        cfg = DeepseekV3Config(**kw)
        model = DeepseekV3ForCausalLM(cfg)
    model = model.float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.rand(b.shape, generator=g))  # non-negative (HF masks with 0.0)
    model.config._attn_implementation = "eager"
    return model


def save_hf_model(model, path: str) -> str:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_logits(model, token_ids) -> "np.ndarray":  # noqa: F821
    import torch

    with torch.no_grad():
        out = model(torch.tensor(token_ids, dtype=torch.long), use_cache=False)
    return out.logits.float().numpy()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy continuation of `prompt`: exactly `n` tokens, EOS ignored."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, use_cache=True)
    return out[0, len(prompt):].tolist()


def read_tensors(path: str) -> dict:
    """Every tensor of a checkpoint directory as numpy arrays (bf16 / fp8 through ml_dtypes)."""
    import numpy as np

    from deepinfer_jax.weights.safetensors_io import index_checkpoint, load_tensor

    return {n: np.array(load_tensor(i)) for n, i in index_checkpoint(path).items()}


def rewrite_checkpoint(src: str, dst: str, tensors: dict, extra_config: dict | None = None) -> str:
    """A copy of `src`'s config.json (updated with `extra_config`) and `tensors` as one safetensors file."""
    import json

    from safetensors.numpy import save_file

    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(extra_config or {})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def is_linear(name: str, w) -> bool:
    """A 2-D projection weight of a DeepSeek checkpoint (the router's gate excluded): what FP8 releases store in FP8."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight")) and "mlp.gate." not in name and w.ndim == 2


def fp8_checkpoint(src: str, dst: str, block: tuple[int, int], quantized=is_linear) -> tuple[str, dict]:
    """(`dst`, its tensors): a copy of the checkpoint `src` whose tensors `quantized(name, w)` picks are FP8 in
    `block`s (weight + weight_scale_inv, as DeepSeek's releases store them), its config naming the block."""
    from deepinfer_jax.models.quant import fp8_quantize_blocks

    out = {}
    for name, w in read_tensors(src).items():
        if quantized(name, w):
            out[name], out[name + "_scale_inv"] = fp8_quantize_blocks(w, block)
        else:
            out[name] = w
    quant_cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
    return rewrite_checkpoint(src, dst, out, quant_cfg), out


def random_prompts(seed: int, lengths, vocab: int, lo: int = 2):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(lo, vocab, int(n)).tolist() for n in lengths]


def assert_same_outputs(expected, actual) -> None:
    """Two engines' CompletionOutputs agree: token ids exactly, logprobs' token sets and ranks exactly, their
    values within 1e-5 (programs split differently may fuse differently)."""
    import numpy as np

    for w, s in zip(expected, actual, strict=True):
        assert s.token_ids == w.token_ids
        assert (s.logprobs is None) == (w.logprobs is None)
        for wp, sp in zip(w.logprobs or [], s.logprobs or []):
            assert sp.keys() == wp.keys() and [sp[t].rank for t in sp] == [wp[t].rank for t in wp]
            np.testing.assert_allclose([sp[t].logprob for t in sp], [wp[t].logprob for t in wp], rtol=1e-5,
                                       atol=1e-5)

# ---- the dense GQA family (models/dense.py): Llama, Qwen2, Qwen3, Mistral -----------------------------------

# Odd shapes: 6 query heads over 2 KV heads (groups of 3), head_dim 12 (Qwen3: 10, not hidden / heads).
DENSE_COMMON = dict(
    vocab_size=331, hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, initializer_range=0.1,
    rms_norm_eps=1e-5,
)
DENSE_CASES = {
    "llama_llama3": dict(model_type="llama", tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0}),
    "llama_linear_tied": dict(model_type="llama", tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}),
    "llama_yarn": dict(model_type="llama", tie_word_embeddings=False, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
    "qwen2_tied": dict(model_type="qwen2", tie_word_embeddings=True, use_sliding_window=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=10, use_sliding_window=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # sized for tensor parallelism 2 and 4 (vocab, heads, intermediate divisible; 2 KV heads split or replicated)
    "llama_tp": dict(model_type="llama", vocab_size=336, intermediate_size=96, num_attention_heads=8, head_dim=12,
                     tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3_moe": dict(model_type="qwen3_moe", tie_word_embeddings=False, head_dim=10, use_sliding_window=False,
                      num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[],
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mistral_window": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=7, head_dim=12,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
DENSE_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                 "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def build_dense_hf_model(case: str, seed: int = 0, **overrides):
    """An fp32 eval-mode HF model of a dense family with randomised norms (q/k norms too), biases, and for
    Qwen3-MoE router and expert weights."""
    import torch
    import transformers

    kw = {**DENSE_COMMON, **DENSE_CASES[case], **overrides}
    cfg_cls, model_cls = (getattr(transformers, n) for n in DENSE_CLASSES[kw.pop("model_type")])
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):  # the router: not flat
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "experts" in name:  # HF v5 leaves fused expert weights to the initializer's zeros or empties
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.config._attn_implementation = "eager"
    return model


def with_mtp_weights(src: str, dst: str) -> str:
    """`src` plus random weights for its declared MTP layer (at index num_hidden_layers), named as DeepSeek's
    checkpoints name them (transformers saves none)."""
    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.weights.name_table import expected_tensors

    cfg = ModelConfig.from_model_dir(src)
    tensors = read_tensors(src)
    rng = np.random.default_rng(3)
    for rule in expected_tensors(cfg):
        if rule.path[0] == "mtp" and rule.hf_name not in tensors:
            base = 1.0 if len(rule.hf_shape) == 1 else 0.0  # norms around 1, matrices around 0
            tensors[rule.hf_name] = (base + 0.1 * rng.standard_normal(rule.hf_shape)).astype(np.float32)
    return rewrite_checkpoint(src, dst, tensors)
